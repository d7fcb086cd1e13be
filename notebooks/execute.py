"""Executes notebooks/quickstart.ipynb headless, as CI does (tests/test_notebook.py).

    python notebooks/execute.py --smoke --json=docs/notebook_smoke.json
    python notebooks/execute.py --out=runs/quickstart.ipynb      # full size, with outputs

The kernel starts in ``--cwd`` (default a new temporary directory, so the notebook's
runs/ land there) and imports this checkout's lexjax. A failing cell raises
``nbclient.exceptions.CellExecutionError`` with the cell's traceback (exit status 1).
``--json`` records the wall time of the whole execution, kernel start included.
The directories of ``--cwd``, ``--out`` and ``--json`` are made before the first
cell runs; one that cannot be is an ``error:`` line (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NOTEBOOK = os.path.join(HERE, "quickstart.ipynb")


def execute(
    *, smoke: bool, cwd: str, timeout_s: int = 600, env: dict[str, str] | None = None
) -> tuple[nbformat.NotebookNode, float]:
    """Runs every cell of the quickstart in a fresh kernel; returns the executed
    notebook and the wall time in seconds. ``env`` (default ``os.environ``) is the
    kernel's environment, with ``LEXJAX_SMOKE`` and this checkout on PYTHONPATH added."""
    env = dict(os.environ if env is None else env)
    env["LEXJAX_SMOKE"] = "1" if smoke else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": cwd}}
    )
    start = time.perf_counter()
    client.execute(env=env)
    return notebook, time.perf_counter() - start


def prepare(cwd: str | None, *outputs: str | None) -> str:
    """Makes the kernel's directory (a new temporary one when ``cwd`` is None) and the
    directories the ``outputs`` go in, before anything runs: a full-size execution
    takes minutes, and its notebook is written only at the end. Returns the cwd."""
    for output in filter(None, outputs):
        if os.path.isdir(output):
            print(f"error: {output} is a directory; name the file to write", file=sys.stderr)
            raise SystemExit(2)
    paths = [cwd] + [os.path.dirname(os.path.abspath(p)) for p in outputs if p]
    for path in filter(None, paths):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            print(
                f"error: cannot make the directory {path} ({e.strerror}); choose another",
                file=sys.stderr,
            )
            raise SystemExit(2) from None
    return cwd or tempfile.mkdtemp(prefix="lexjax-notebook-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="LEXJAX_SMOKE=1: seconds per stage")
    parser.add_argument("--cwd", help="the kernel's working directory (default: a new temp dir)")
    parser.add_argument("--out", help="write the executed notebook (with outputs) here")
    parser.add_argument("--json", help="write the wall time and the machine here")
    parser.add_argument("--timeout_s", type=int, default=600, help="limit per cell")
    args = parser.parse_args()
    cwd = prepare(args.cwd, args.out, args.json)
    notebook, seconds = execute(smoke=args.smoke, cwd=cwd, timeout_s=args.timeout_s)
    print(f"executed {NOTEBOOK} in {seconds:.1f} s (smoke={args.smoke}, cwd={cwd})")
    if args.out:
        nbformat.write(notebook, args.out)
    if args.json:
        record = {
            "notebook": "notebooks/quickstart.ipynb",
            "smoke": args.smoke,
            "seconds": round(seconds, 1),
            "cells": len(notebook.cells),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "command": " ".join(["python", "notebooks/execute.py", *sys.argv[1:]]),
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
