"""Tables, JSON and figures of evaluation results (the paper's Tables 2/3, Figure 1).

Plain functions of result lists; matplotlib is imported only when a figure is
drawn, with the file-only Agg backend.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from lexjax import resolution as res_lib

__all__ = [
    "perplexity_table",
    "perplexity_json",
    "plot_perplexity",
    "resolution_table",
    "resolution_json",
    "plot_expectation",
    "write_json",
]

_MODE_NAMES = {"bca": "BCA", "full": "without BCA"}


def perplexity_table(results: Sequence, position: str) -> str:
    """Markdown: one row per mode, one column per length (paper Table 2)."""
    lengths = sorted({r.length for r in results})
    modes = [m for m in ("bca", "full") if any(r.mode == m for r in results)]
    cell = {(r.mode, r.length): r for r in results}
    lines = [
        "| " + " | ".join(["model"] + [str(n) for n in lengths]) + " |",
        "|" + "---|" * (len(lengths) + 1),
    ]
    for mode in modes:
        row = [f"{position} {_MODE_NAMES[mode]}"]
        row += [f"{cell[mode, n].perplexity:.3f}" if (mode, n) in cell else "–" for n in lengths]
        lines.append("| " + " | ".join(row) + " |")
    some = results[0]
    lines.append("")
    lines.append(
        f"{some.documents} documents; tokens per cell: "
        + ", ".join(
            f"{n}: {cell[m, n].tokens}" for m in modes[:1] for n in lengths if (m, n) in cell
        )
    )
    return "\n".join(lines)


def perplexity_json(results: Sequence, *, train_len: int, **extra) -> dict:
    """``{"train_len", "results": [{"mode", "length", "perplexity", "tokens", "documents", ...}]}``.

    ``seconds`` (and ``tokens_per_second``) are wall time including each
    shape's compilation; ``bench/eval_throughput.py`` measures steady speed.
    """
    rows = []
    for r in results:
        row = {
            "mode": r.mode,
            "length": r.length,
            "perplexity": r.perplexity,
            "tokens": r.tokens,
            "documents": r.documents,
            "nll": r.nll,
            "seconds": r.seconds,
            "tokens_per_second": r.tokens / max(r.seconds, 1e-9),
        }
        rows.append(row)
    return {"train_len": train_len, **extra, "results": rows}


def write_json(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_perplexity(results: Sequence, path: str, *, train_len: int, title: str) -> None:
    """Perplexity against length (log x), one line per mode, the training length marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("bca", "full"):
        points = sorted((r.length, r.perplexity) for r in results if r.mode == mode)
        if points:
            ax.plot(*zip(*points), marker="o", label=_MODE_NAMES[mode])
    ax.axvline(train_len, color="gray", linestyle="--", label=f"train_len {train_len}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resolution_table(results: Sequence, position: str) -> str:
    """Markdown in the spirit of paper Table 3: a row per (mode, length), R per layer and mean."""
    layers = len(results[0].per_layer)
    lines = [
        "| model | length | " + " | ".join(f"layer {i + 1}" for i in range(layers)) + " | mean |",
        "|" + "---|" * (layers + 3),
    ]
    for r in results:
        lines.append(
            f"| {position} {_MODE_NAMES[r.mode]} | {r.length} | "
            + " | ".join(f"{x:.3g}" for x in r.per_layer)
            + f" | {r.mean:.3g} |"
        )
    return "\n".join(lines)


def resolution_json(results: Sequence, *, train_len: int, **extra) -> dict:
    return {
        "train_len": train_len,
        **extra,
        "results": [
            {
                "mode": r.mode,
                "length": r.length,
                "per_layer": list(r.per_layer),
                "mean": r.mean,
                "documents": r.documents,
                "expected_scores": [list(s) for s in r.expected_scores],
            }
            for r in results
        ],
    }


def plot_expectation(
    path: str, *, head_dim: int, scale_base: float, theta: float, max_distance: int
) -> None:
    """Paper Figure 1: expected score against distance for RoPE and XPOS (eq. 8)."""
    plt = _pyplot()
    distance = np.arange(max_distance + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        distance,
        res_lib.xpos_expectation(
            distance, head_dim, scale_base=scale_base, theta=theta, gamma=None
        ),
        label="RoPE",
    )
    ax.plot(
        distance,
        res_lib.xpos_expectation(distance, head_dim, scale_base=scale_base, theta=theta),
        label="XPOS",
    )
    ax.set_xlabel("relative distance")
    ax.set_ylabel("expected attention score")
    ax.set_title(f"head_dim {head_dim}, scale_base {scale_base:g}")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
