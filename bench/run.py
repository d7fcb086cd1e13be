"""Runs lexjax's benchmarks, prints a table and writes JSON.

    python bench/run.py [--only NAME[,NAME]] [--json OUT] [--quick]
                        [--reference_python PY] [--threads 2]

Benchmarks (stable names, also the JSON keys): ``train_vs_reference``,
``xpos_overhead``, ``eval_scaling``, ``mfu``, ``remat``, ``train_processes``. Each JSON entry
has its headline figure under ``value`` with ``unit``, ``target``, ``met`` and the raw
measurements; ``machine`` records where and when. Every comparison is
measured in one run, alternating its sides, as a median with min–max over
rounds. ``--quick`` runs fewer rounds and shorter lengths (a smoke test, not
a measurement). The accelerator benchmark is ``bench/accelerator.sh``.

``--json`` is written whole when the last benchmark ends; until then the
results so far are in ``OUT.partial`` (rewritten after each benchmark), so a
run cut short (a Ctrl-C: one line, status 130) leaves an earlier complete
``OUT`` as it was.

A flag it cannot use ends it with one line on stderr, ``error: …``, and status
2 before anything runs (also a ``--json`` whose directory is not writable).
So does a ``--reference_python`` that cannot be run or lacks torch and
torchscale, after the other benchmarks: the JSON records that benchmark's
``error`` (a run that measured nothing leaves an earlier ``OUT`` as it was, its
record in ``OUT.partial``).

Before it starts, the run samples for a few seconds how many cores *other*
processes keep busy (its own process and children do not count), and again
over each benchmark; ``machine.load_check`` and each entry's
``other_cores_busy`` record it, and ``shared_cores`` (top level and per
entry) is true when other work used more than
``common.SHARED_THRESHOLD_CORES`` cores (null where the load could not be
measured, as without /proc): a ratio taken under load is not a
speed (sides of a comparison slow down unequally), so such a run is flagged
and its figures do not go into the docs unflagged.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    from lexjax import hugepages

    hugepages.reexec_with_hugepages()  # as train.py does; see lexjax/hugepages.py

from bench import common
from lexjax import reports, signals

BENCHMARKS = (
    "train_vs_reference",
    "xpos_overhead",
    "eval_scaling",
    "mfu",
    "remat",
    "train_processes",
)


def parse(argv=None) -> argparse.Namespace:
    p = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help="comma-separated benchmark names (default: all)",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="fewer rounds, shorter lengths")
    p.add_argument(
        "--reference_python",
        help="interpreter with torch + torchscale for train_vs_reference "
        "(default: this one, if it has them)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads for the reference (JAX uses every core: set both equal)",
    )
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads={args.threads}: give a whole number of at least 1")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    if not names:
        p.error(f"--only names no benchmark; choose from {', '.join(BENCHMARKS)}")
    p.check_json(args.json)  # before any benchmark runs: its results are written after each one
    args.names = names
    return args


def table(results: dict) -> str:
    lines = []
    for name in BENCHMARKS:
        if name not in results:
            continue
        entry = results[name]
        if "error" in entry:
            lines.append(f"{name}: ERROR {entry['error']}")
            continue
        status = {True: "met", False: "MISSED", None: "-"}[entry["met"]]
        lines.append(
            f"{name}: {entry['value']:.3g} {entry['unit']} (target {entry['target']}: {status})"
        )
        module = importlib.import_module(f"bench.{name}")
        for label, text in module.rows(entry):
            lines.append(f"    {label:<38} {text}")
    return "\n".join(lines)


def main(argv=None) -> int:
    # JAX's gc callback runs often; a Ctrl-C landing in it was only reported ("Exception
    # ignored in: _xla_gc_callback") and the benchmarks went on. Raise it again instead.
    signals.redeliver_swallowed_interrupts()
    args = parse(argv)
    started = common.Provenance()
    check = started.check
    results: dict = {
        "machine": dict(
            common.machine(),
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            quick=args.quick,
            command=started.command,
            load_check=check,
        ),
        "shared_cores": check["shared"],  # None: not measured (no /proc), not "idle"
        # The benchmarks' model (configs/tiny.py) before each one's model_overrides.
        "model": common.model_shapes(common.tiny_config()),
    }
    # A run cut short (a Ctrl-C, a crash) leaves its results in JSON.partial and the
    # JSON of an earlier complete run as it was.
    partial = f"{args.json}.partial" if args.json else None
    if partial and os.path.exists(partial):
        os.remove(partial)  # an earlier cut-off run's
    try:
        return _run(args, results, partial)
    except KeyboardInterrupt:
        kept = partial and os.path.exists(partial)
        print(
            "interrupted (Ctrl-C)" + (f"; the benchmarks that finished are in {partial}" * kept),
            file=sys.stderr,
            flush=True,
        )
        return 130


def _run(args, results: dict, partial: str | None) -> int:
    errors = []
    for name in args.names:
        module = importlib.import_module(f"bench.{name}")
        start = time.perf_counter()
        snapshot = common.cpu_snapshot()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = module.run(args)
        except Exception as e:
            if not getattr(module, "EXPECTED_ERRORS", ()) or not isinstance(
                e, module.EXPECTED_ERRORS
            ):
                raise
            results[name] = {"error": str(e)}
            if str(e) not in errors:  # train_processes repeats train_vs_reference's
                errors.append(str(e))
        results[name]["wall_seconds"] = time.perf_counter() - start
        busy = common.other_cores_busy(snapshot, common.cpu_snapshot())
        shared = common.shared_cores(busy)
        results[name].update(other_cores_busy=busy, shared_cores=shared)
        results["shared_cores"] = common.any_shared(results["shared_cores"], shared)
        if partial:  # the results so far, in case a later benchmark fails
            reports.write_json(partial, results)  # whole or not at all
    measured = any("error" not in results[name] for name in args.names)
    if partial and (measured or not os.path.exists(args.json)):
        os.replace(partial, args.json)
    elif partial:  # an earlier complete run's results outweigh a record of errors alone
        print(
            f"nothing was measured: {args.json} is left as it was; this run's record is in "
            f"{partial}",
            file=sys.stderr,
            flush=True,
        )
    print(table(results))
    if results["shared_cores"] and measured:
        print("SHARED CORES: other processes ran during this run; its ratios are not speeds")
    if errors:  # a missing reference interpreter (a flag to change), too few lengths: status 2
        print(f"error: {'; '.join(errors)}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
