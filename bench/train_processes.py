"""``train_processes``: the CPU train step as whole processes, alternating — lexjax as
``train.py`` runs it (huge pages, lexjax/hugepages.py), lexjax with 4 KiB pages, and
torchscale.

Every side starts a fresh process each round (nothing warm is shared, and glibc reads
its tunables only at a process's start). A lexjax side is this file with ``--child``:
the tiny config's f32 train step, compiled, one warm call, then three timed calls of
``steps`` steps; it reports the median's tokens/s and the minor page faults per step.
The torchscale side is ``bench/reference_train.py`` with the same shape: one step, one
warm call, then three timed calls. The headline is the per-round ratio lexjax (huge pages) /
torchscale; ``hugepages_gain`` is huge pages / 4 KiB pages.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common
from bench import train_vs_reference as tvr
from lexjax import hugepages

EXPECTED_ERRORS = tvr.EXPECTED_ERRORS
CALLS = 3  # timed calls per process; each side's figure is their median


def _config(quick: bool):
    """The tiny config's f32 train step (two layers with ``--quick``), both sides' shape."""
    return common.tiny_config(dtype="float32", **(common.QUICK_MODEL if quick else {}))


def _child(steps: int, quick: bool) -> dict:
    """One lexjax process: the train step's tokens/s and page faults per step."""
    config = _config(quick)
    batches = common.train_batches(config.batch_size, config.train_len, 2)
    _, timer = common.train_timer(config, batches, steps)
    timer()  # warm: the first calls after compiling touch fresh memory either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = sorted(timer() for _ in range(CALLS))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {
        "tokens_per_sec": steps * config.batch_size * config.train_len / seconds[CALLS // 2],
        "page_faults_per_step": faults / (CALLS * steps),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def run(args) -> dict:
    python = tvr.resolve_python(args.reference_python)
    skip = hugepages.reason_to_skip(environ={})
    quick = args.quick
    rounds, steps = (1, 1) if quick else (7, 2)
    config = _config(quick)
    settings = tvr.reference_settings(config, args.threads)
    tokens = steps * config.batch_size * config.train_len
    replies = {"huge_pages": [], "small_pages": []}

    def lexjax_side(name):
        def once():
            command = [sys.executable, __file__, "--child", str(steps)] + ["--quick"] * quick
            env = hugepages.environ_with_tunable(os.environ, on=name == "huge_pages")
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            replies[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            return replies[name][-1]["tokens_per_sec"]

        return once

    def reference_side():
        reference = tvr.Reference(python, settings)  # it has run one step
        try:
            reference.run(steps)  # warm, as the lexjax side's untimed call
            seconds = sorted(reference.run(steps)["seconds"] for _ in range(CALLS))
        finally:
            reference.close()
        return tokens / seconds[CALLS // 2]

    sides = {"huge_pages": lexjax_side("huge_pages"), "reference": reference_side}
    if skip is None:  # where the tunable cannot apply, the two lexjax sides are one
        sides["small_pages"] = lexjax_side("small_pages")
    else:
        del replies["small_pages"]
    rates = common.alternate(sides, rounds)
    ratio = common.ratios(rates["huge_pages"], rates["reference"])
    gain = None if skip else common.ratios(rates["huge_pages"], rates["small_pages"]).as_dict()
    return common.result(
        ratio.median,
        "× reference tokens/s (whole processes)",
        "≥ 1.0× (parity; aim 1.2×)",
        ratio.median >= 1.0,
        ratio=ratio.as_dict(),
        hugepages_gain=gain,
        hugepages_skipped=skip,
        tokens_per_sec={k: common.Summary.of(v).as_dict() for k, v in rates.items()},
        page_faults_per_step={
            k: common.Summary.of([r["page_faults_per_step"] for r in v]).as_dict()
            for k, v in replies.items()
        },
        glibc_tunables={k: v[0]["glibc_tunables"] for k, v in replies.items()},
        dtype="float32",
        rounds=rounds,
        steps_per_call=steps,
        calls_per_process=CALLS,
        reference_python=python,
        threads=args.threads,
        model_overrides=common.QUICK_MODEL if quick else {},
    )


def rows(entry: dict) -> list[tuple[str, str]]:
    t, f = entry["tokens_per_sec"], entry["page_faults_per_step"]
    out = [
        ("torchscale tokens/s", common.fmt(t["reference"], ".0f")),
        ("lexjax f32 tokens/s, huge pages", common.fmt(t["huge_pages"], ".0f")),
        ("page faults per step, huge pages", common.fmt(f["huge_pages"], ".0f")),
    ]
    if entry["hugepages_skipped"]:
        return out + [("4 KiB pages side skipped", entry["hugepages_skipped"])]
    return out + [
        ("lexjax f32 tokens/s, 4 KiB pages", common.fmt(t["small_pages"], ".0f")),
        ("page faults per step, 4 KiB pages", common.fmt(f["small_pages"], ".0f")),
        (
            "ratio 4 KiB pages / torchscale",
            common.fmt(
                common.ratios(t["small_pages"]["values"], t["reference"]["values"]).as_dict(), ".2f"
            ),
        ),
        ("speed-up from huge pages", common.fmt(entry["hugepages_gain"], ".3f")),
    ]


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print(json.dumps(_child(int(sys.argv[2]), "--quick" in sys.argv[3:])))
