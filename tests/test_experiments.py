"""The extrapolation experiment's command at smoke size: tables, JSON, figures, resumption."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = [
    sys.executable,
    "-m",
    "lexjax.experiments.extrapolation",
    "--config=configs/extrapolation.py:smoke",
]


def _run(out):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    # A relative --out, as in the documented command (orbax needs absolute paths inside).
    return subprocess.run(
        [*COMMAND, f"--out={os.path.relpath(out, ROOT)}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _table(path):
    """Rows of a markdown table file as lists of cells; checks every row has the header's width."""
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f.read().splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert len(cells) >= 3 and re.fullmatch(r"(---\|)+", rows[1].lstrip("|"))
    assert all(len(row) == len(cells[0]) for row in cells), path
    return cells[0], cells[2:]


def _number(cell):
    return float(cell)


def test_smoke_experiment_writes_well_formed_tables_and_resumes(tmp_path):
    out = tmp_path / "out"
    done = _run(out)
    assert done.returncode == 0, done.stderr[-3000:]

    header, rows = _table(out / "table2.md")
    assert header == ["model", "16", "32"]
    assert [r[0] for r in rows] == ["RoPE", "LEX (XPOS b=8 + BCA)"]
    header, rows = _table(out / "table5.md")
    assert [r[0] for r in rows] == [
        "RoPE with BCA",
        "RoPE without BCA",
        "XPOS b=8 with BCA",
        "XPOS b=8 without BCA",
    ]
    for row in rows:
        assert all(_number(c) > 1 for c in row[1:])
    header, rows = _table(out / "table3.md")
    assert header == ["model", "R at 16", "R at 32", "s range at 16", "s range at 32"]
    for row in rows:
        assert all(-1 <= _number(c) <= 1 for c in row[1:3]) and _number(row[3]) >= 0

    with open(out / "results.json") as f:
        results = json.load(f)
    assert results["lengths"] == [16, 32] and results["train_len"] == 16
    assert [r["name"] for r in results["runs"]] == ["rope_s0", "xpos_b8_s0"]
    for run in results["runs"]:
        assert run["steps"] == 2 and run["tokens"] == 2 * 4 * 16
        assert set(run["perplexity"]) == {"bca", "full"}
        assert set(run["perplexity"]["bca"]) == {"16", "32"}
        # At the training length BCA's two blocks cover the whole causal window.
        assert abs(run["perplexity"]["bca"]["16"] - run["perplexity"]["full"]["16"]) < 1e-3
    for name in ("perplexity.png", "figure1.png", "scores.png"):
        assert os.path.getsize(out / name) > 1000
    with open(out / "summary.md") as f:
        summary = f.read()
    assert "paper Table 2" in summary and "paper Table 3" in summary

    # A second invocation finds every stage done and only rewrites the reports.
    again = _run(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("trained already") == 2
    assert again.stdout.count("evaluated already") == 2
    with open(out / "timing.json") as f:
        assert len(json.load(f)["invocations"]) == 2


def test_bad_runs_are_one_line_errors(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [*COMMAND, f"--out={tmp_path}", "--config.runs=rope/b=3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: runs: 'rope/b=3': /b= applies to xpos only"]
