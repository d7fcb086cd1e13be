"""Tables, JSON and figures of evaluation results (the paper's Tables 2, 3, 5, Figure 1).

Plain functions: those of ``eval.py`` take result lists of one run
(:mod:`lexjax.evaluation`); those of the extrapolation experiment take the
dict :func:`collect` builds from the files its stages wrote, where seeds of
one variant (position and, for XPOS, scale_base) are pooled: table cells are
means over seeds, and ``seeds.md`` shows every seed. matplotlib is imported
only when a figure is drawn, with the file-only Agg backend.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import tempfile
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from lexjax import resolution as res_lib
from lexjax.config import ABSOLUTE_ENCODINGS, ROTARY_ENCODINGS, check_path
from lexjax.errors import CheckpointError, ConfigError, arg, counted, nearest_existing

__all__ = [
    "MODE_NAMES",
    "REPORT_FORMAT",
    "perplexity_table",
    "perplexity_json",
    "plot_perplexity",
    "resolution_table",
    "resolution_json",
    "plot_expectation",
    "passkey_table",
    "passkey_json",
    "plot_passkey",
    "write_json",
    "read_json",
    "check_writable",
    "OUTPUTS",
    "collect",
    "write_all",
    "variant_label",
    "variant_stats",
]

# The "format" every report JSON starts with (eval.py's perplexity, resolution and passkey
# files, the study's results.json): it grows when a field changes meaning or goes away,
# not when one is added. Files written before it was recorded have none (read them as 1).
REPORT_FORMAT = 1

# The display name of each evaluation mode (lexjax.evaluation.MODES), in table order.
MODE_NAMES = {"bca": "with BCA", "full": "without BCA", "sinks": "with sinks + window"}
_LINE_STYLES = {"bca": "-", "full": "--", "sinks": "-."}
POSITION_NAMES = {
    "sinusoidal": "Transformer (sinusoidal)",
    "learned": "Transformer (learned)",
    "alibi": "ALiBi",
    "rope": "RoPE",
    "xpos_norotate": "XPOS without rotation (decay only)",
    "none": "NoPE",
}
_ORDER = {
    "sinusoidal": 0,
    "learned": 1,
    "alibi": 2,
    "rope": 3,
    "xpos": 4,
    "xpos_norotate": 5,
    "none": 6,
}


def perplexity_table(
    results: Sequence, position: str, missing: Sequence[dict] = (), metric: str = "perplexity"
) -> str:
    """Markdown: one row per mode, one column per length (paper Table 2) of ``metric``
    (``perplexity`` or ``bits_per_byte``); a ``missing`` cell (``{"mode", "length",
    "reason"}``) shows "—" and its reason below."""
    lengths = sorted({r.length for r in results} | {m["length"] for m in missing})
    modes = [m for m in MODE_NAMES if any(r.mode == m for r in results)]
    modes += [m for m in MODE_NAMES if m not in modes and any(x["mode"] == m for x in missing)]
    cell = {(r.mode, r.length): r for r in results}
    lines = [_header("model", lengths)]
    for mode in modes:
        cells = [
            f"{getattr(cell[mode, n], metric):.3f}" if (mode, n) in cell else "—" for n in lengths
        ]
        lines.append(_row(f"{position} {MODE_NAMES[mode]}", cells))
    some = results[0]
    lines += [
        "",
        f"every cell: {counted(some.documents, 'document')} × the first "
        f"{counted(some.max_length, 'token')} = {counted(some.tokens, 'scored token')}"
        + (f" ({counted(some.bytes, 'byte')} of text)" if some.bytes is not None else ""),
    ]
    lines += [f"— {m['mode']} {m['length']}: {m['reason']}" for m in missing]
    if position in ABSOLUTE_ENCODINGS and "bca" in modes:
        lines.append(
            f"with BCA, {position} positions are window-relative (a lexjax choice: each token "
            "keeps the position of the window that computed it, all below train_len)"
        )
    return "\n".join(lines)


def perplexity_json(results: Sequence, *, train_len: int, **extra) -> dict:
    """``{"format", "train_len", ..., "results": [{"mode", "length", "perplexity", "tokens",
    "documents", "max_length", ...}]}``.

    ``seconds`` (and ``tokens_per_second``) are wall time including each
    shape's compilation; ``bench/eval_throughput.py`` measures steady speed.
    """
    rows = [dict(r.as_dict(), tokens_per_second=r.tokens / max(r.seconds, 1e-9)) for r in results]
    return {"format": REPORT_FORMAT, "train_len": train_len, **extra, "results": rows}


def _tmp(path: str) -> str:
    """Where ``path``'s new content is written before it replaces ``path``: a name per
    process and thread, so two evaluations writing one workdir's reports (two
    processes, or two threads of a notebook) never share one."""
    return f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"


def _fresh_tmp(path: str) -> str:
    """:func:`_tmp` of ``path``, made anew as an empty file of this process's: whatever
    was at that name (a file left by a killed writer, a symbolic link) is removed, not
    written through. A run from elsewhere could hold a link at every such name (one
    per pid), and the report written through it overwrote a file of the user's."""
    tmp = _tmp(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
    return tmp


def _writes() -> bool:
    """Whether this process writes report files: in a multi-process run every process
    computes the same results and process 0 alone writes them."""
    return jax.process_index() == 0


@contextlib.contextmanager
def _writing(path: str, what: str | None = None):
    """Makes ``path``'s directory; an ``OSError`` inside (read-only, full disk) becomes
    one :class:`~lexjax.errors.CheckpointError` line about ``what`` (default ``path``),
    with no temporary file (:func:`_tmp`) left."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        yield
    except BaseException as e:  # a Ctrl-C too leaves no temporary file
        with contextlib.suppress(OSError):
            os.remove(_tmp(path))
        if not isinstance(e, OSError):
            raise
        raise CheckpointError(
            f"cannot write {what or path} ({e.strerror or e}); make its directory writable or free "
            "space, then run again"
        ) from None


def output_dir(workdir: str, out_dir=None) -> str:
    """Where an evaluation of the run in ``workdir`` writes its reports: ``WORKDIR/eval``,
    or ``out_dir`` (a :class:`~lexjax.errors.ConfigError` for a file, or a place among
    the run's checkpoints, whose listing is the run's steps), checked writable
    (:func:`check_writable`) before anything is computed."""
    if out_dir is None:
        out = os.path.join(workdir, "eval")
        try:
            check_writable(out)
        except CheckpointError as e:  # another user's run, read-only storage
            elsewhere = arg(
                "or pass out_dir=DIR",
                f"eval.py has no --out_dir: from Python, lexjax.load({workdir!r})"
                ".evaluate(…) and .passkey(…) take out_dir=DIR",
            )
            raise CheckpointError(f"{e}; {elsewhere}") from None
        return out
    out = os.path.abspath(check_path("out_dir", out_dir))
    checkpoints = os.path.realpath(os.path.join(workdir, "checkpoints"))  # links resolved
    if os.path.commonpath([os.path.realpath(out), checkpoints]) == checkpoints:
        raise ConfigError(
            f"out_dir={out_dir} is inside the run's checkpoints ({checkpoints}); give a "
            "directory outside them"
        )
    there = nearest_existing(out)
    if not os.path.isdir(there):
        raise ConfigError(f"out_dir={out_dir}: {there} is a file; give a directory")
    check_writable(out)
    return out


def check_writable(directory: str) -> None:
    """Raises :class:`~lexjax.errors.CheckpointError` unless process 0 can write in
    ``directory`` (made if missing): an evaluation checks where its reports go before
    it computes them."""
    if _writes():
        probe = os.path.join(directory, ".probe")
        with (
            _writing(probe, what=directory),
            tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"),
        ):
            pass


def write_then_show(write: Callable[[], None], show: Callable[[], None]) -> None:
    """``write()`` an evaluation's reports, then ``show()`` its tables on stdout; when a
    write fails (a full disk), the tables are shown before its error propagates, so
    what was computed is not lost (a stdout that fails then changes nothing). A Ctrl-C
    during the writes (a second or so, the figures), or any other error, shows them too."""
    try:
        write()
    except (Exception, KeyboardInterrupt):
        with contextlib.suppress(Exception):
            show()
        raise
    show()


def remove(path: str) -> None:
    """Deletes the report at ``path`` if there is one (process 0 only); a refusal is
    one :class:`~lexjax.errors.CheckpointError` line, as a failed write is."""
    if _writes():
        with _writing(path), contextlib.suppress(FileNotFoundError):
            os.remove(path)


def write_json(path: str, value: dict) -> None:
    """``value`` as indented JSON at ``path``, replaced atomically (process 0 only).
    Strict JSON: a non-finite number (a model whose loss is NaN or overflows) is
    written ``null``; Python's ``NaN``/``Infinity`` are not JSON, and strict parsers
    (JavaScript's, jq) refused the whole file."""
    write_text(path, json.dumps(_finite_or_null(value), indent=2, allow_nan=False) + "\n")


def _finite_or_null(value):
    """``value`` with every non-finite float (numpy's too) replaced by None."""
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return None
    return value


def read_json(path: str):
    """The JSON value stored at ``path``."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_text(path: str, text: str) -> None:
    """``text`` at ``path``, written to a temporary file and renamed (process 0 only): the
    file before stays whole when the write is cut off, which is one line."""
    if not _writes():
        return
    with _writing(path):
        tmp = _fresh_tmp(path)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)


def _figure(*grid, **kwargs):
    """``(figure, axes)`` of ``Figure.subplots(*grid, **kwargs)``, ``figsize`` for the figure.

    A bare ``matplotlib.figure.Figure`` renders to files without pyplot, so writing a
    report neither selects a backend nor touches pyplot's state (a notebook's inline
    plots keep working after an evaluation).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=kwargs.pop("figsize"))
    return fig, fig.subplots(*grid, **kwargs)


# matplotlib (its mathtext parser, for one) is not thread-safe: two threads drawing
# at once failed with a ParseException. Every figure is drawn holding this lock.
_RENDERING = threading.RLock()


def _one_figure_at_a_time(plot):
    @functools.wraps(plot)
    def locked(*args, **kwargs):
        with _RENDERING:
            return plot(*args, **kwargs)

    return locked


def _save(fig, path: str, dpi: int = 120) -> None:
    """``fig`` at ``path``, replaced atomically as :func:`write_json` does: a write
    cut off (a full disk, a Ctrl-C) leaves the figure before it whole."""
    if _writes():
        with _writing(path):
            tmp = _fresh_tmp(path)
            fig.savefig(tmp, dpi=dpi, format=os.path.splitext(path)[1][1:] or "png")
            os.replace(tmp, path)


@_one_figure_at_a_time
def plot_perplexity(
    curves, path: str, *, train_len: int, title: str, ylabel: str = "perplexity"
) -> None:
    """Perplexity against length (log x; log y too when it spans more than 4×).

    ``curves``: ``[(variant label, mode, [(length, perplexity[, std]), ...])]``; a
    colour per variant, solid with BCA, dashed without, dash-dotted with sinks +
    window, error bars where a std is given (one std over seeds); the training
    length marked.
    """
    fig, ax = _figure(figsize=(7.5, 4.8))
    colours = {}
    values = [p[1] for _, _, points in curves for p in points]
    for label, mode, points in curves:
        if points:
            colour = colours.setdefault(label, f"C{len(colours)}")
            style = _LINE_STYLES[mode]
            name = f"{label} {MODE_NAMES[mode]}"
            x, y, *err = zip(*points)
            yerr = err[0] if err and any(e for e in err[0]) else None
            ax.errorbar(
                x,
                y,
                yerr=yerr,
                fmt=style,
                marker="o",
                markersize=3,
                color=colour,
                label=name,
                capsize=2,
            )
    ax.axvline(train_len, color="gray", linestyle=":", label=f"train_len {train_len}")
    ax.set_xscale("log", base=2)
    if values and max(values) / min(values) > 4:
        ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save(fig, path)


def resolution_table(results: Sequence, position: str) -> str:
    """Markdown in the spirit of paper Table 3: a row per (mode, length), R per layer and mean."""
    layers = len(results[0].per_layer)
    columns = ["length", *(f"layer {i + 1}" for i in range(layers)), "mean", "mean, N = window"]
    lines = [_header("model", columns)]
    for r in results:
        cells = [str(r.length), *(f"{x:.3g}" for x in r.per_layer), f"{r.mean:.3g}"]
        lines.append(_row(f"{position} {MODE_NAMES[r.mode]}", [*cells, f"{r.window_mean:.3g}"]))
    lines.append(
        "\nR sums over every distance its curve holds; the last column sums over the "
        "distances a BCA window holds (0 … train_len − 1) in every mode, so modes compare there."
    )
    return "\n".join(lines)


def resolution_json(results: Sequence, *, train_len: int, **extra) -> dict:
    return {
        "format": REPORT_FORMAT,
        "train_len": train_len,
        **extra,
        "results": [
            {
                "mode": r.mode,
                "length": r.length,
                "per_layer": list(r.per_layer),
                "mean": r.mean,
                "window_mean": r.window_mean,
                "documents": r.documents,
                "expected_scores": [list(s) for s in r.expected_scores],
            }
            for r in results
        ],
    }


@_one_figure_at_a_time
def plot_expectation(
    path: str, *, head_dim: int, scale_base: float, theta: float, max_distance: int
) -> None:
    """Paper Figure 1: expected score against distance for RoPE and XPOS (eq. 8)."""
    distance = np.arange(max_distance + 1)
    fig, ax = _figure(figsize=(6, 4))
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
    _save(fig, path)


def passkey_table(results: Sequence, position: str, skipped: Sequence[dict] = ()) -> str:
    """Markdown per mode: a row per depth, a column per length, passkey accuracy
    (:class:`lexjax.passkey.PasskeyResult`); a ``skipped`` cell (``{"mode",
    "length", "reason"}``) shows "—" and its reason below."""
    lengths = sorted({r.length for r in results} | {s["length"] for s in skipped})
    modes = list(dict.fromkeys([*(r.mode for r in results), *(s["mode"] for s in skipped)]))
    depths = sorted({r.depth for r in results})
    cell = {(r.mode, r.length, r.depth): r for r in results}
    lines = []
    for mode in modes:
        lines.append(_header(f"{position} {MODE_NAMES.get(mode, mode)}: depth", lengths))
        for depth in depths:
            cells = [
                f"{cell[mode, n, depth].accuracy:.2f}" if (mode, n, depth) in cell else "—"
                for n in lengths
            ]
            lines.append(_row(f"{depth:g}", cells))
        nats = [
            [r.answer_nats for r in results if (r.mode, r.length) == (mode, n)] for n in lengths
        ]
        lines.append(_row("key nats", [f"{np.mean(v):.2f}" if v else "—" for v in nats]))
        lines.append("")
    lines.append(
        "accuracy: the fraction of keys the greedy continuation gives exactly; key nats: "
        "−log p(key | prompt), mean over depths"
    )
    lines += [f"— {s['mode']} {s['length']}: {s['reason']}" for s in skipped]
    return "\n".join(lines)


def passkey_json(results: Sequence, *, train_len: int, **extra) -> dict:
    """``{"format", "train_len", ..., "results": [{"mode", "length", "depth", "accuracy",
    "trials", ...}]}``."""
    rows = [r.as_dict() for r in results]
    return {"format": REPORT_FORMAT, "train_len": train_len, **extra, "results": rows}


@_one_figure_at_a_time
def plot_passkey(results: Sequence, path: str, *, train_len: int, title: str) -> None:
    """A length × depth heat map of passkey accuracy (one mode's results): the
    value in each cell, lengths beyond ``train_len`` right of a dashed line."""
    lengths = sorted({r.length for r in results})
    depths = sorted({r.depth for r in results})
    fig, ax = _figure(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    image = _draw_passkey(ax, results, train_len=train_len, title=title)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    _save(fig, path)


def _draw_passkey(ax, results: Sequence, *, train_len: int, title: str):
    """:func:`plot_passkey`'s heat map on ``ax``; returns the image."""
    lengths = sorted({r.length for r in results})
    depths = sorted({r.depth for r in results})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in results:
        grid[depths.index(r.depth), lengths.index(r.length)] = r.accuracy
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
    for (i, j), value in np.ndenumerate(grid):
        if not np.isnan(value):
            colour = "black" if value > 0.6 else "white"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8, color=colour)
    within = sum(n <= train_len for n in lengths)
    if 0 < within < len(lengths):
        ax.axvline(within - 0.5, color="white", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel(f"length (tokens; train_len {train_len})")
    ax.set_ylabel("depth of the key")
    ax.set_title(title, fontsize=9)
    return image


# --------------------------------------------------------------------------- the experiment

OUTPUTS = (
    "table2.md",
    "table3.md",
    "table4.md",
    "scalings.md",
    "passkey.md",
    "table5.md",
    "seeds.md",
    "results.json",
    "summary.md",
    "perplexity.png",
    "scalings.png",
    "passkey.png",
    "figure1.png",
    "scores.png",
)


def variant_label(position: str, scale_base: float | None) -> str:
    return (
        f"XPOS b={scale_base:g}" if position == "xpos" else POSITION_NAMES.get(position, position)
    )


def _score_range(curves) -> float:
    """Mean over layers of max − min of the measured expected scores s[n]."""
    return float(np.mean([np.max(c) - np.min(c) for c in curves]))


def recorded_settings(config) -> dict:
    """The model shape and training schedule a study records in results.json
    (``{"model": {...}, "train": {...}}``), from a run's :class:`lexjax.config.Config`."""
    m = config.model
    return {
        "model": {
            "num_layers": m.num_layers,
            "d_model": m.d_model,
            "num_heads": m.num_heads,
            "head_dim": m.head_dim,
            "mlp_dim": m.mlp_dim,
            "dtype": m.dtype,
        },
        "train": {
            "batch_size": config.batch_size,
            "num_train_steps": config.num_train_steps,
            "learning_rate": config.learning_rate,
            "schedule": config.optim.schedule,
            "warmup_steps": config.warmup_steps,
        },
    }


def collect(out, specs, config, plan, timing) -> dict:
    """Everything the tables need, as plain JSON-able values."""
    runs = []
    for spec in specs:
        workdir = os.path.join(out, "runs", spec.name)
        trained = read_json(os.path.join(workdir, "train.json"))
        perplexity, eval_seconds = {}, 0.0
        for key, _, _ in plan["evaluations"](spec):
            stored = read_json(os.path.join(workdir, f"perplexity_{key.replace('+', '_')}.json"))
            eval_seconds += stored["seconds"]
            perplexity[key] = {str(r["length"]): r["perplexity"] for r in stored["results"]}
        passkey = _passkey_cells(workdir) if plan.get("passkey") else {}
        stored = read_json(os.path.join(workdir, "resolution.json"))
        eval_seconds += stored["seconds"]
        resolution = {}
        for r in stored["results"]:
            resolution.setdefault(r["mode"], {})[str(r["length"])] = {
                "mean": r["mean"],
                "window_mean": r["window_mean"],
                "per_layer": r["per_layer"],
                "score_range": _score_range(r["expected_scores"]),
                "mean_scores": np.mean(r["expected_scores"], axis=0).tolist(),
            }
        s = trained["summary"]
        runs.append(
            {
                "name": spec.name,
                "position": spec.position,
                "scale_base": spec.variant[1],
                "seed": spec.seed,
                "num_params": s["num_params"],
                "steps": s["step"],
                "tokens": trained["tokens"],
                "loss": s.get("loss"),
                "val_loss": s.get("val_loss"),
                "train_seconds": trained["seconds"],
                "eval_seconds": eval_seconds,
                "perplexity": perplexity,
                "resolution": resolution,
                "passkey": passkey.get("accuracy", {}),
                "passkey_nats": passkey.get("answer_nats", {}),
                "passkey_skipped": passkey.get("skipped", []),
            }
        )
    m = config.model
    scale_bases = sorted({r["scale_base"] for r in runs if r["position"] == "xpos"}) or [
        m.scale_base
    ]
    expected = []
    for n in (config.train_len, 2 * config.train_len):
        distances = np.arange(n)
        curves = [("RoPE", None)] + [(f"XPOS b={b:g}", b) for b in scale_bases]
        for name, b in curves:
            g = np.asarray(
                res_lib.xpos_expectation(
                    distances,
                    m.head_dim,
                    scale_base=b or 1.0,
                    theta=m.theta,
                    gamma=None if b is None else 0.4,
                )
            )
            expected.append(
                {
                    "curve": name,
                    "length": n,
                    "raw": float(res_lib.attention_resolution(g)),
                    "scaled": float(res_lib.attention_resolution(g / np.sqrt(m.head_dim))),
                }
            )
    invocations = timing["invocations"]
    return {
        "train_len": config.train_len,
        "lengths": plan["lengths"],
        "max_length": plan["max_length"],
        "documents": {k: min(v, len(plan["documents"])) for k, v in plan["docs"].items()},
        "eval_split": plan.get("eval_split"),
        "tokenizer": plan["tokenizer"].describe(),
        "passkey": plan.get("passkey"),
        "data": config.data.name,
        **recorded_settings(config),
        "machine": timing["machine"],
        "wall_seconds": sum(i["wall_seconds"] for i in invocations),
        "invocations": [{k: v for k, v in i.items() if k != "argv"} for i in invocations],
        "runs": runs,
        "expected_resolution": expected,
        "variants": variant_stats(runs, plan["lengths"]),
    }


def _passkey_cells(workdir) -> dict:
    """``{field: {mode: {length: {depth: value}}}}`` (str keys) of a run's passkey.json
    for ``accuracy`` and ``answer_nats``; a field its results lack is left out; and
    ``skipped``: the cells it could not measure, with why (none listed before)."""
    stored = read_json(os.path.join(workdir, "passkey.json"))
    cells = {"skipped": stored.get("skipped", [])}
    for r in stored["results"]:
        for field in ("accuracy", "answer_nats"):
            if field in r:
                by_mode = cells.setdefault(field, {}).setdefault(r["mode"], {})
                by_mode.setdefault(str(r["length"]), {})[str(r["depth"])] = r[field]
    return cells


def _passkey_mean(runs, mode, length, depth=None, key="passkey"):
    """``key``'s value (``passkey``: accuracy, ``passkey_nats``: the key's nats) of a
    (mode, length) cell, averaged over depths (or at ``depth``), per seed: the list over
    the seeds that have it."""
    values = []
    for r in runs:
        cell = r.get(key, {}).get(mode, {}).get(str(length))
        if cell:
            cell = {k: _nan_if_null(v) for k, v in cell.items()}  # null: not finite
            values.append(
                cell[str(depth)] if depth is not None else float(np.mean([*cell.values()]))
            )
    return values


def _nan_if_null(value):
    """A number read back from a report: ``null`` was a non-finite one (NaN here)."""
    return math.nan if value is None else value


def study_passkey_table(c, key: str = "passkey") -> str:
    """Passkey accuracy (``key="passkey_nats"``: the key's teacher-forced nats) by
    length, averaged over depths: mean ± std over seeds."""
    lengths = {int(n) for r in c["runs"] for m in r.get(key, {}).values() for n in m}
    lengths = sorted(
        lengths | {s["length"] for r in c["runs"] for s in r.get("passkey_skipped", [])}
    )
    if not lengths:
        return "The study measured no passkey retrieval."
    lines = [_header("model", lengths)]
    for label, _, _, group in _variants(c["runs"]):
        modes = [m for m in MODE_NAMES if any(m in r.get(key, {}) for r in group)]
        for mode in modes:
            cells = []
            for n in lengths:
                values = _passkey_mean(group, mode, n, key=key)
                std = f" ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else ""
                cells.append(f"{np.mean(values):.2f}{std}" if values else "–")
            lines.append(_row(f"{label} {MODE_NAMES[mode]}{_seeds_note(group)}", cells))
    if key != "passkey":  # the nats table's empty cells are the accuracy table's
        return "\n".join(lines)
    # Why a cell is empty, once per variant (its seeds skip the same cells).
    reasons = {
        (label, s["mode"], s["length"]): s["reason"]
        for label, _, _, group in _variants(c["runs"])
        for r in group
        for s in r.get("passkey_skipped", [])
    }
    lines += [""] * bool(reasons)
    lines += [f"– {label} {MODE_NAMES[m]} {n}: {why}" for (label, m, n), why in reasons.items()]
    return "\n".join(lines)


def study_passkey_tables(c) -> str:
    """The accuracy table and, where measured, the key's nats beside chance."""
    text = study_passkey_table(c)
    chance = (c.get("passkey") or {}).get("chance_nats")
    if chance is not None and any(r.get("passkey_nats") for r in c["runs"]):
        text += (
            "\n\nThe key's negative log-likelihood given the prompt (nats, teacher-forced in "
            f"the same mode; {chance:.2f} = the format known, the key not):\n\n"
            + study_passkey_table(c, "passkey_nats")
        )
    return text


@_one_figure_at_a_time
def plot_passkey_grid(c, path) -> None:
    """Heat maps of passkey accuracy (seed means), a row per variant, a column per mode."""
    from types import SimpleNamespace

    variants = [v for v in _variants(c["runs"]) if any(r["passkey"] for r in v[3])]
    modes = [m for m in MODE_NAMES if any(m in r["passkey"] for v in variants for r in v[3])]
    if not variants or not modes:
        return
    fig, axes = _figure(
        len(variants), len(modes), figsize=(4.2 * len(modes), 2.6 * len(variants)), squeeze=False
    )
    for row, (label, _, _, group) in zip(axes, variants):
        for ax, mode in zip(row, modes):
            cells = [
                SimpleNamespace(length=int(n), depth=float(d), accuracy=float(np.mean(values)))
                for n, depths in group[0]["passkey"].get(mode, {}).items()
                for d in depths
                if (values := _passkey_mean(group, mode, n, d))
            ]
            if cells:
                title = f"{label} {MODE_NAMES[mode]}{_seeds_note(group)}"
                _draw_passkey(ax, cells, train_len=c["train_len"], title=title)
    fig.tight_layout()
    _save(fig, path, dpi=110)


def variant_stats(runs, lengths) -> list[dict]:
    """Per variant: its seeds and each cell's mean, std (ddof 1) and seed count; each
    other mode against BCA in its seeds (``minus_bca``); and for each XPOS variant, the
    XPOS − RoPE comparisons of :func:`compare` of perplexity (``minus_rope``), attention
    resolution (``resolution_minus_rope``, ``resolution_window_minus_rope``) and
    passkey accuracy over depths (``passkey_minus_rope``)."""
    groups = _variants(runs)
    rope = next((g for _, p, _, g in groups if p == "rope"), None)
    stats = []
    for label, position, scale_base, group in groups:
        modes = sorted({m for r in group for m in r["perplexity"]})
        cells = {}
        for m in modes:
            by_length = {str(n): _stats(group, m, n) for n in lengths}
            cells[m] = {
                n: dict(zip(("mean", "std", "seeds"), v)) for n, v in by_length.items() if v[2]
            }
        entry = {
            "label": label,
            "position": position,
            "scale_base": scale_base,
            "seeds": sorted(r["seed"] for r in group),
            "perplexity": cells,
        }
        if position == "xpos" and rope:
            entry["minus_rope"] = {
                m: {str(n): compare(group, rope, m, n) for n in lengths} for m in modes
            }
            # Attention resolution (over every distance; over the first train_len:
            # "window") and passkey accuracy (mean over depths), compared as perplexity.
            for name, (key, value) in _OTHER_METRICS.items():
                their_modes = [m for m in MODE_NAMES if any(m in r.get(key, {}) for r in group)]
                ns = sorted({int(n) for r in group for by in r.get(key, {}).values() for n in by})
                mine, theirs = (_as_runs(g, value, their_modes, ns) for g in (group, rope))
                entry[f"{name}_minus_rope"] = {
                    m: {str(n): compare(mine, theirs, m, n) for n in ns} for m in their_modes
                }
        if "bca" in modes:  # every other mode against BCA, seed by seed
            bca_of = lambda r, _, n: r["perplexity"].get("bca", {}).get(n)
            bca = _as_runs(group, bca_of, modes, lengths)
            entry["minus_bca"] = {
                m: {str(n): compare(group, bca, m, n) for n in lengths} for m in modes if m != "bca"
            }
        stats.append(entry)
    return stats


def _passkey_over_depths(r, mode, n):
    """One run's passkey accuracy of a cell, averaged over depths (None: no cell)."""
    return next(iter(_passkey_mean([r], mode, n)), None)


# name: (the runs' field, value(run, mode, str length) or None) of variant_stats.
_OTHER_METRICS = {
    "resolution": ("resolution", lambda r, m, n: r["resolution"].get(m, {}).get(n, {}).get("mean")),
    "resolution_window": (
        "resolution",
        lambda r, m, n: r["resolution"].get(m, {}).get(n, {}).get("window_mean"),
    ),
    "passkey": ("passkey", _passkey_over_depths),
}


def _as_runs(group, value, modes, lengths) -> list[dict]:
    """The runs with ``value(run, mode, str length)`` (None: no cell) where
    :func:`compare` reads a perplexity: every metric compared, and paired by seed, as
    perplexity is."""
    return [
        {
            "seed": r["seed"],
            "perplexity": {
                m: {str(n): v for n in lengths if (v := value(r, m, str(n))) is not None}
                for m in modes
            },
        }
        for r in group
    ]


def _variants(runs):
    """``[(label, position, scale_base, [runs])]`` in the paper's order."""
    groups = {}
    for r in runs:
        groups.setdefault((r["position"], r["scale_base"]), []).append(r)
    keys = sorted(groups, key=lambda k: (_ORDER.get(k[0], 9), k[1] or 0))
    return [(variant_label(*k), k[0], k[1], groups[k]) for k in keys]


def _modes(runs, key="perplexity"):
    """The modes (in MODE_NAMES order) some run has results of under ``key``."""
    return [m for m in MODE_NAMES if any(m in r[key] for r in runs)]


def _stats(runs, mode, length):
    """``(mean, std, n)`` of a cell over the seeds in ``runs`` that have it; std is the
    sample standard deviation (ddof 1), None with one seed; ``(None, None, 0)`` if none.
    A cell written ``null`` (a non-finite perplexity: :func:`write_json`) counts as NaN,
    so a diverged seed makes the mean NaN instead of leaving it silently."""
    cells = [r["perplexity"].get(mode, {}) for r in runs]
    values = [_nan_if_null(c[str(length)]) for c in cells if str(length) in c]
    if not values:
        return None, None, 0
    std = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return float(np.mean(values)), std, len(values)


def _fmt_stats(runs, mode, length, digits=3):
    """``mean ± std`` over seeds (the mean alone for one seed)."""
    mean, std, _ = _stats(runs, mode, length)
    if mean is None:
        return "–"
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


def compare(a, b, mode, length) -> dict | None:
    """Difference of two variants' cells, ``a − b``, with twice its standard error.

    When both sides ran the same seeds (≥ 2; a seed fixes the initialisation and the
    data order, so seed s of one variant is paired with seed s of the other), the
    difference is the mean of the per-seed differences and its standard error
    std(d)/sqrt(n) (paired); otherwise the difference of the seed means with
    sqrt(s_a²/n_a + s_b²/n_b). The verdict calls a difference within two standard
    errors "within seed noise"; with a single seed on either side there is no
    estimate of the noise, and the verdict says so."""
    (ma, sa, na), (mb, sb, nb) = _stats(a, mode, length), _stats(b, mode, length)
    if ma is None or mb is None:
        return None
    pairs = _paired(a, b, mode, length)
    if pairs is not None:
        diff = float(np.mean(pairs))
        two_se = 2 * float(np.std(pairs, ddof=1)) / np.sqrt(len(pairs))
        n = [len(pairs)] * 2
    elif sa is None or sb is None:
        return {"diff": ma - mb, "two_se": None, "seeds": [na, nb], "verdict": "one seed"}
    else:
        diff, two_se, n = ma - mb, 2 * float(np.sqrt(sa**2 / na + sb**2 / nb)), [na, nb]
    verdict = "within seed noise" if abs(diff) <= two_se else ("lower" if diff < 0 else "higher")
    if not (math.isfinite(diff) and math.isfinite(two_se)):  # a diverged seed: no verdict
        verdict = "not finite"
    return {
        "diff": diff,
        "two_se": two_se,
        "seeds": n,
        "paired": pairs is not None,
        **({"per_seed": pairs} if pairs is not None else {}),  # a − b of seed s, s ascending
        "verdict": verdict,
    }


def _paired(a, b, mode, length) -> list[float] | None:
    """Per-seed differences ``a − b`` when both sides hold the same ≥ 2 seeds, else None."""
    cell = lambda r: r["perplexity"].get(mode, {}).get(str(length))
    x = {r["seed"]: cell(r) for r in a if "seed" in r and cell(r) is not None}
    y = {r["seed"]: cell(r) for r in b if "seed" in r and cell(r) is not None}
    if len(x) < 2 or set(x) != set(y) or len(x) != len(a) or len(y) != len(b):
        return None
    return [x[s] - y[s] for s in sorted(x)]


def _row(label, cells):
    return "| " + " | ".join([label] + cells) + " |"


def _header(first, columns):
    return "\n".join([_row(first, [str(c) for c in columns]), "|" + "---|" * (len(columns) + 1)])


def _fmt(value, digits=3):
    return "–" if value is None else f"{value:.{digits}f}"


def _seeds_note(group):
    return f" ({len(group)} seeds)" if len(group) > 1 else ""


def table2(c) -> str:
    """Paper Table 2 as its values read: absolute/ALiBi/RoPE without BCA, LEX with it.

    The paper's text says every model used BCA, but its baselines' values equal Table 5's
    rows without BCA; only LEX's equal a row with it.
    """
    lines, read = [_header("model", c["lengths"])], set()
    for label, position, _, group in _variants(c["runs"]):
        mode = "bca" if position == "xpos" else "full"
        name = f"LEX ({label} + BCA)" if position == "xpos" else label
        read.add(mode)
        lines.append(
            _row(name + _seeds_note(group), [_fmt_stats(group, mode, n) for n in c["lengths"]])
        )
    if unmeasured := sorted(read - set(_modes(c["runs"]))):  # say why a row is empty
        lines.append(
            f"\n– : not measured; this table reads mode {' and '.join(unmeasured)}, which the "
            "study's modes leave out"
        )
    lines.append("\nThe baselines without BCA, LEX with it." + _spread_note(c))
    return "\n".join(lines)


def _spread_note(c) -> str:
    """What a table's ``±`` is, where some variant has several seeds."""
    if all(len(group) == 1 for *_, group in _variants(c["runs"])):
        return ""
    return " Perplexity: mean ± sample standard deviation over a variant's seeds."


def table5(c) -> str:
    """Paper Table 5: every model with and without blockwise causal attention."""
    lines = [_header("model", c["lengths"])]
    for label, _, _, group in _variants(c["runs"]):
        for mode in _modes(c["runs"]):
            lines.append(
                _row(
                    f"{label} {MODE_NAMES[mode]}{_seeds_note(group)}",
                    [_fmt_stats(group, mode, n) for n in c["lengths"]],
                )
            )
    if note := _spread_note(c):
        lines.append("\n" + note.strip())
    return "\n".join(lines)


def table3(c) -> str:
    """Paper Table 3: attention resolution (mean over layers) at 1× and 2× train_len, and the
    spread max − min of the measured expected scores s[n] that R depends on."""
    n1, n2 = c["train_len"], 2 * c["train_len"]
    columns = [f"R at {n1}", f"R at {n2}", f"R at {n2}, N = {n1}"]
    lines = [_header("model", [*columns, f"s range at {n1}", f"s range at {n2}"])]
    for label, _, _, group in _variants(c["runs"]):
        for mode in _modes(c["runs"], "resolution"):
            cells = []
            for key, lengths in (
                ("mean", (n1, n2)),
                ("window_mean", (n2,)),
                ("score_range", (n1, n2)),
            ):
                for n in lengths:
                    values = [r["resolution"].get(mode, {}).get(str(n), {}).get(key) for r in group]
                    values = [v for v in values if v is not None]
                    mean = float(np.mean(values)) if values else None
                    cells.append(f"{mean:.3g}" if key != "score_range" and values else _fmt(mean))
            lines.append(_row(f"{label} {MODE_NAMES[mode]}{_seeds_note(group)}", cells))
    return "\n".join(lines)


def seeds_table(c) -> str:
    """Every seed of the variants that have several, and XPOS − RoPE per seed."""
    multi = [v for v in _variants(c["runs"]) if len(v[3]) > 1]
    if not multi:
        return "Every variant has a single seed."
    lines = [_header("model, seed", c["lengths"])]
    for label, _, _, group in multi:
        for mode in _modes(c["runs"]):
            for r in sorted(group, key=lambda r: r["seed"]):
                lines.append(
                    _row(
                        f"{label} {MODE_NAMES[mode]}, seed {r['seed']}",
                        [_fmt(r["perplexity"].get(mode, {}).get(str(n))) for n in c["lengths"]],
                    )
                )
    by = {(v[1], v[2]): v[3] for v in multi}
    rope = by.get(("rope", None))
    xpos = [k for k in by if k[0] == "xpos"]
    for b in [k[1] for k in xpos] if rope else []:  # every XPOS variant against RoPE
        group = by[("xpos", b)]
        x = {r["seed"]: r for r in group}
        if set(x) == {r["seed"] for r in rope}:
            how = (
                "Seed s of both trains from the same initialisation seed and data order, so "
                "the seeds are paired: the mean and standard error of the per-seed "
                "differences (the next table)"
            )
        else:  # as compare() computes it: the seeds differ, so no pairs
            how = (
                f"The two ran different seeds ({len(x)} and {len(rope)}), so they are not "
                "paired: the difference of the seed means, with the standard error of two "
                "independent means (the per-seed table lists the seeds both ran)"
            )
        lines += [
            "",
            f"XPOS b={b:g} − RoPE ± twice its standard error; within that, the "
            f"difference is seed noise. {how}:",
            "",
            _header("mode", c["lengths"]),
        ]
        for mode in _modes(c["runs"]):
            cells = []
            for n in c["lengths"]:
                d = compare(group, rope, mode, n)
                cells.append(
                    "–"
                    if d is None or d["two_se"] is None
                    else f"{d['diff']:+.3f} ± {d['two_se']:.3f} ({d['verdict']})"
                )
            lines.append(_row(MODE_NAMES[mode], cells))
        lines += ["", _header(f"XPOS b={b:g} − RoPE, seed", c["lengths"])]
        for mode in _modes(c["runs"]):
            for r in sorted(rope, key=lambda r: r["seed"]):
                if r["seed"] not in x:
                    continue
                cells = []
                for n in c["lengths"]:
                    a, b_ = (
                        x[r["seed"]]["perplexity"].get(mode, {}).get(str(n)),
                        r["perplexity"].get(mode, {}).get(str(n)),
                    )
                    cells.append("–" if a is None or b_ is None else f"{a - b_:+.3f}")
                lines.append(_row(f"{MODE_NAMES[mode]}, seed {r['seed']}", cells))
    return "\n".join(lines)


SCALING_NAMES = {
    "pi": "position interpolation",
    "ntk": "NTK-aware",
    "dynamic_ntk": "dynamic NTK",
    "yarn": "YaRN",
}


def table4(c) -> str:
    """Paper Table 4, the rotation ablation: RoPE (rotation), XPOS (rotation + decay) and
    XPOS without rotation (decay only) at the training length, without BCA (at that length
    both modes see the same keys); NoPE beside them when the study has it."""
    n = c["train_len"]
    lines = [_header("model", [f"perplexity at {n}"])]
    # At the training length BCA's window holds every key: a study of mode bca alone
    # has the same numbers there.
    mode = "full" if "full" in _modes(c["runs"]) else "bca"
    for label, position, _, group in _variants(c["runs"]):
        if position in ("rope", "xpos", "xpos_norotate", "none"):
            lines.append(_row(label + _seeds_note(group), [_fmt_stats(group, mode, n)]))
    return "\n".join(lines)


def _scaling_rows(c):
    """``(label, extension name or None, key, runs)`` for each rotary variant without and
    with each RoPE extension, over the seeds that were evaluated so."""
    for label, position, _, group in _variants(c["runs"]):
        if position not in ROTARY_ENCODINGS:
            continue
        for key in ["full"] + [f"full+{s}" for s in SCALING_NAMES]:
            runs = [r for r in group if key in r["perplexity"]]
            if runs:
                yield label, None if key == "full" else SCALING_NAMES[key[5:]], key, runs


def scalings_table(c) -> str:
    """Inference-time RoPE extensions of each rotary variant, without BCA, from the
    training length on; each row over the seeds that were evaluated so."""
    lengths = [n for n in c["lengths"] if n >= c["train_len"]]
    lines = [_header("model", lengths)]
    for label, name, key, runs in _scaling_rows(c):
        seeds = ", ".join(str(r["seed"]) for r in runs)
        lines.append(
            _row(
                f"{label} + {name or 'no extension'} (seed{'s' * (len(runs) > 1)} {seeds})",
                [_fmt_stats(runs, key, n) for n in lengths],
            )
        )
    return "\n".join(lines)


def expected_resolution_table(c) -> str:
    """R of the expected-score curves of eq. 8 (Figure 1), as drawn and divided by √d."""
    lengths = sorted({e["length"] for e in c["expected_resolution"]})
    curves = list(dict.fromkeys(e["curve"] for e in c["expected_resolution"]))
    value = {(e["curve"], e["length"]): e for e in c["expected_resolution"]}
    head = [f"R(g) at {n}" for n in lengths] + [f"R(g/√d) at {n}" for n in lengths]
    lines = [_header("curve", head)]
    for curve in curves:
        lines.append(
            _row(
                curve,
                [_fmt(value[curve, n]["raw"]) for n in lengths]
                + [_fmt(value[curve, n]["scaled"]) for n in lengths],
            )
        )
    return "\n".join(lines)


def _plot_variants(c, path) -> None:
    """:func:`plot_perplexity` of every variant's seed means."""
    curves = []
    for label, _, _, group in _variants(c["runs"]):
        for mode in _modes(c["runs"]):
            points = [(n, *_stats(group, mode, n)[:2]) for n in c["lengths"]]
            curves.append((label, mode, [(n, v, e or 0.0) for n, v, e in points if v is not None]))
    plot_perplexity(
        curves,
        path,
        train_len=c["train_len"],
        title=f"trained at {c['train_len']} tokens",
        # Per token of the study's tokenizer: a byte only for the byte tokenizer.
        ylabel="perplexity (per byte)" if c["tokenizer"].startswith("bytes") else "perplexity",
    )


def _plot_scalings(c, path) -> None:
    """Perplexity without BCA of each rotary variant with each RoPE extension."""
    curves = []
    for label, name, key, runs in _scaling_rows(c):
        points = [(n, *_stats(runs, key, n)[:2]) for n in c["lengths"]]
        points = [(n, v, e or 0.0) for n, v, e in points if v]
        curves.append((label if name is None else f"{label} + {name}", "full", points))
    plot_perplexity(
        [curve for curve in curves if curve[2]],
        path,
        train_len=c["train_len"],
        title="RoPE extensions at inference (no retraining)",
        ylabel="perplexity",
    )


@_one_figure_at_a_time
def plot_figure1(c, path) -> None:
    """Paper Figure 1: expected score g[n] (eq. 8) of RoPE and XPOS, one panel per scale_base."""
    bases = sorted({r["scale_base"] for r in c["runs"] if r["position"] == "xpos"})
    m = c["model"]
    distance = np.arange(c["lengths"][-1] + 1)
    fig, axes = _figure(1, max(len(bases), 1), figsize=(5 * max(len(bases), 1), 3.8), squeeze=False)
    for ax, b in zip(axes[0], bases or [512.0]):
        ax.plot(
            distance,
            res_lib.xpos_expectation(distance, m["head_dim"], gamma=None),
            label="RoPE",
            linewidth=0.8,
        )
        ax.plot(
            distance,
            res_lib.xpos_expectation(distance, m["head_dim"], scale_base=b),
            label=f"XPOS b={b:g}",
        )
        ax.axvline(c["train_len"], color="gray", linestyle=":", label="train_len")
        ax.set_xlabel("relative distance")
        ax.set_ylabel("expected score g[n]")
        ax.set_title(f"head_dim {m['head_dim']}, b = {b:g}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


@_one_figure_at_a_time
def plot_scores(c, path) -> None:
    """Measured expected scores s[n] (eq. 11, mean over layers) at 2× train_len: the curves
    whose attention resolution Table 3 gives; one panel per mode, the first seed of each variant."""
    length = str(2 * c["train_len"])
    fig, axes = _figure(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, mode in zip(axes, ("bca", "full")):
        for i, (label, _, _, group) in enumerate(_variants(c["runs"])):
            scores = group[0]["resolution"].get(mode, {}).get(length, {}).get("mean_scores")
            if scores:
                ax.plot(np.arange(len(scores)), scores, color=f"C{i}", linewidth=1, label=label)
        ax.axvline(c["train_len"], color="gray", linestyle=":")
        ax.set_xscale("symlog", linthresh=8)
        ax.set_xlabel("distance n")
        ax.set_title(f"{MODE_NAMES[mode]}, {length} tokens")
    axes[0].set_ylabel("mean pre-softmax score s[n]")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)


def _machine(m: dict) -> str:
    return f"{m['cpu']}, {m['cores']} cores, {m['backend']} ({m['devices']}), jax {m['jax']}"


def _settings(c) -> str:
    first = c["runs"][0]
    m, t, mach = c["model"], c["train"], c["machine"]
    # Invocations on another machine (a study resumed elsewhere) are named; timing.json
    # files written before invocations recorded theirs name the last machine only.
    others = {_machine(i["machine"]) for i in c["invocations"] if "machine" in i} - {_machine(mach)}
    earlier = f"; earlier invocations also on {' and '.join(sorted(others))}" if others else ""
    loads = [i["load_average_start"][0] for i in c["invocations"]] + [
        i["load_average_end"][0] for i in c["invocations"]
    ]
    lines = [
        f"- model: {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} heads "
        f"(head_dim {m['head_dim']}), mlp {m['mlp_dim']}, {m['dtype']}; "
        f"{first['num_params'] / 1e6:.2f} M parameters ({c['tokenizer']} tokenizer)",
        f"- training: {c['data']} train split, train_len {c['train_len']}, batch "
        f"{t['batch_size']}, {t['num_train_steps']} steps = {first['tokens']:,} tokens per run, "
        f"learning rate {t['learning_rate']:g} ({t['warmup_steps']} warmup steps, "
        f"{t['schedule']})",
        f"- evaluation: the first {c['max_length']} tokens of {c['documents']['perplexity']} "
        f"documents of the {c['eval_split'] or 'test'} split, the same tokens for every length "
        f"and mode; lengths {', '.join(map(str, c['lengths']))}; "
        f"{c['documents']['resolution']} documents for resolution",
        f"- machine: {_machine(mach)}{earlier}",
        f"- wall time: {c['wall_seconds'] / 60:.1f} min over {len(c['invocations'])} "
        f"invocation(s); 1-minute load average {min(loads):.2f} … {max(loads):.2f} at their "
        "starts and ends",
    ]
    per_run = ["| run | loss | validation loss | train s | eval s |", "|---|---|---|---|---|"]
    for r in c["runs"]:
        per_run.append(
            f"| {r['name']} | {_fmt(r['loss'])} | {_fmt(r['val_loss'])} | "
            f"{r['train_seconds']:.0f} | {r['eval_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(per_run)


def write_all(out, c) -> None:
    tables = {
        "table2.md": ("Perplexity by evaluation length (paper Table 2)", table2(c)),
        "table5.md": ("With and without blockwise causal attention (paper Table 5)", table5(c)),
        "table3.md": ("Attention resolution, mean over layers (paper Table 3)", table3(c)),
        "seeds.md": ("Seeds", seeds_table(c)),
        "table4.md": ("Rotation ablation at the training length (paper Table 4)", table4(c)),
        "scalings.md": ("RoPE extensions at inference, without BCA", scalings_table(c)),
        "passkey.md": ("Passkey retrieval, mean over depths", study_passkey_tables(c)),
    }
    for name, (title, body) in tables.items():
        write_text(os.path.join(out, name), f"## {title}\n\n{body}\n")
    write_json(os.path.join(out, "results.json"), {"format": REPORT_FORMAT, **c})
    _plot_variants(c, os.path.join(out, "perplexity.png"))
    _plot_scalings(c, os.path.join(out, "scalings.png"))
    plot_passkey_grid(c, os.path.join(out, "passkey.png"))
    plot_figure1(c, os.path.join(out, "figure1.png"))
    plot_scores(c, os.path.join(out, "scores.png"))
    parts = ["# Length extrapolation at small scale\n", _settings(c)]
    for name in (
        "table2.md",
        "table5.md",
        "table4.md",
        "scalings.md",
        "passkey.md",
        "table3.md",
        "seeds.md",
    ):
        title, body = tables[name]
        parts.append(f"## {title}\n\n{body}")
    parts.append(
        "## Resolution of the expected-score curves (eq. 8), for comparison\n\n"
        + expected_resolution_table(c)
    )
    write_text(os.path.join(out, "summary.md"), "\n\n".join(parts) + "\n")
