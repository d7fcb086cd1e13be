"""``hugepages``: the CPU train step with and without glibc's ``glibc.malloc.hugetlb=1``.

The tunable is read when a process starts (lexjax/hugepages.py), so each side is a
fresh process — this file with ``--child`` — running the tiny config's f32 train step:
compile, one warm call, then three timed calls of ``steps`` steps; it reports the
median tokens/s and the minor page faults per step. The sides alternate, ``rounds``
processes each; the headline is the per-round ratio, with over without.
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
from lexjax import hugepages


def _env(on: bool) -> dict:
    env = dict(os.environ)
    kept = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and "hugetlb" not in t]
    if on:
        kept.append(hugepages.TUNABLE)
    if kept:
        env["GLIBC_TUNABLES"] = ":".join(kept)
    return env


def _child(steps: int, quick: bool) -> dict:
    """One side's process: the train step's tokens/s and page faults per step."""
    config = common.tiny_config(dtype="float32", **(common.QUICK_MODEL if quick else {}))
    batches = common.train_batches(config.batch_size, config.train_len, 2)
    _, timer = common.train_timer(config, batches, steps)
    timer()  # warm: the first calls after compiling touch fresh memory either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = sorted(timer() for _ in range(3))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {
        "tokens_per_sec": steps * config.batch_size * config.train_len / seconds[1],
        "page_faults_per_step": faults / (3 * steps),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def run(args) -> dict:
    rounds, steps = (1, 1) if args.quick else (5, 2)
    skip = hugepages.reason_to_skip(environ={})
    if skip:
        return common.result(None, "× tokens/s with huge pages", "> 1.0×", None, skipped=skip)
    replies = {"off": [], "on": []}

    def side(name):
        def once():
            command = [sys.executable, __file__, "--child", str(steps)]
            if args.quick:
                command.append("--quick")
            out = subprocess.run(
                command, env=_env(name == "on"), capture_output=True, text=True, check=True
            ).stdout
            replies[name].append(json.loads(out.strip().splitlines()[-1]))
            return replies[name][-1]["tokens_per_sec"]

        return once

    rates = common.alternate({"off": side("off"), "on": side("on")}, rounds)
    ratio = common.ratios(rates["on"], rates["off"])
    return common.result(
        ratio.median,
        "× tokens/s with huge pages",
        "> 1.0×",
        ratio.median > 1.0,
        ratio=ratio.as_dict(),
        tokens_per_sec={k: common.Summary.of(v).as_dict() for k, v in rates.items()},
        page_faults_per_step={
            k: common.Summary.of([r["page_faults_per_step"] for r in v]).as_dict()
            for k, v in replies.items()
        },
        glibc_tunables={k: v[0]["glibc_tunables"] for k, v in replies.items()},
        rounds=rounds,
        steps_per_call=steps,
        model_overrides=common.QUICK_MODEL if args.quick else {},
    )


def rows(entry: dict) -> list[tuple[str, str]]:
    if entry.get("skipped"):
        return [("skipped", entry["skipped"])]
    t, f = entry["tokens_per_sec"], entry["page_faults_per_step"]
    return [
        ("f32 tokens/s, 4 KiB pages", common.fmt(t["off"], ".0f")),
        ("f32 tokens/s, huge pages", common.fmt(t["on"], ".0f")),
        ("page faults per step, 4 KiB pages", common.fmt(f["off"], ".0f")),
        ("page faults per step, huge pages", common.fmt(f["on"], ".0f")),
    ]


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print(json.dumps(_child(int(sys.argv[2]), "--quick" in sys.argv[3:])))
