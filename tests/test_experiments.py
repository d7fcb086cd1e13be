"""The extrapolation experiment's command at smoke size: tables, JSON, figures, resumption."""

import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import lexjax
from tests import processes as P
from tests import programs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = [
    sys.executable,
    "-m",
    "lexjax.experiments.extrapolation",
    "--config=configs/extrapolation.py:smoke",
]


def _on_cpu(args, timeout=120, home=None):
    """``args`` run from the repository on one CPU device (the study's own setting)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=P.xla_flags())
    env.update({"HOME": str(home)} if home else {})
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _run(out, *flags, home=None):
    # A relative --out, as in the documented command (orbax needs absolute paths inside),
    # or one under ~ (given as a str), as a script passes it: the shell expands none.
    out = out if isinstance(out, str) else os.path.relpath(out, ROOT)
    # A hang guard: on 2 loaded cores the smoke study took 300 s.
    return _on_cpu([*COMMAND, f"--out={out}", *flags], timeout=900, home=home)


def _table(path, which=0):
    """Rows of the ``which``-th markdown table of a file as lists of cells; checks every
    row has the header's width."""
    with open(path, encoding="utf-8") as f:
        blocks = [b for b in f.read().split("\n\n") if b.lstrip().startswith("|")]
    rows = [line for line in blocks[which].splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert len(cells) >= 3 and re.fullmatch(r"(---\|)+", rows[1].lstrip("|"))
    assert all(len(row) == len(cells[0]) for row in cells), path
    return cells[0], cells[2:]


def _number(cell):
    return float(cell)


def _eq3(s):
    """Attention resolution, paper eq. 3, of one curve s[0 … N]: the numerator's
    e^{s[i+1]} exists for i < N, the denominator sums every term."""
    e = np.exp(s - np.max(s))  # R does not change when a constant is added to s
    return float(np.sum(e[:-1] * (e[:-1] - e[1:])) / np.sum(e) ** 2)


def test_smoke_experiment_writes_well_formed_tables_and_resumes(tmp_path):
    out = tmp_path / "out"
    done = _run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert os.stat(out / ".study.lock").st_mode & 0o111 == 0  # was made executable

    header, rows = _table(out / "table2.md")
    assert header == ["model", "16", "32"]
    assert [r[0] for r in rows] == ["RoPE", "LEX (XPOS b=8 + BCA)"]
    header, rows = _table(out / "table5.md")
    assert [r[0] for r in rows] == [
        "RoPE with BCA",
        "RoPE without BCA",
        "RoPE with sinks + window",
        "XPOS b=8 with BCA",
        "XPOS b=8 without BCA",
        "XPOS b=8 with sinks + window",
    ]
    for row in rows:
        assert all(_number(c) > 1 for c in row[1:])
    header, rows = _table(out / "table3.md")
    assert header == [
        "model",
        "R at 16",
        "R at 32",
        "R at 32, N = 16",
        "s range at 16",
        "s range at 32",
    ]
    # Every R is eq. 3 of the stored per-layer curves s[n] (eq. 11), here by hand in
    # float64, averaged over layers; "N = 16" sums over the distances 0 … 15 only.
    with open(out / "runs" / "rope_s0" / "resolution.json") as f:
        stored = {(r["mode"], r["length"]): r for r in json.load(f)["results"]}
    for r in stored.values():
        curves = np.asarray(r["expected_scores"], np.float64)
        assert r["mean"] == pytest.approx(np.mean([_eq3(s) for s in curves]), rel=1e-5)
        assert r["window_mean"] == pytest.approx(np.mean([_eq3(s[:16]) for s in curves]), rel=1e-5)
    rope_bca = next(row for row in rows if row[0] == "RoPE with BCA")
    assert rope_bca[1:4] == [
        f"{stored['bca', 16]['mean']:.3g}",
        f"{stored['bca', 32]['mean']:.3g}",
        f"{stored['bca', 32]['window_mean']:.3g}",
    ]
    # Under BCA every distance lies in a window, so at 32 N is 16 either way.
    assert stored["bca", 32]["mean"] == pytest.approx(stored["bca", 32]["window_mean"])

    with open(out / "results.json") as f:
        results = json.load(f)
    assert results["lengths"] == [16, 32] and results["train_len"] == 16
    assert results["format"] == 1
    assert [r["name"] for r in results["runs"]] == ["rope_s0", "xpos_b8_s0"]
    for run in results["runs"]:
        assert run["steps"] == 2 and run["tokens"] == 2 * 4 * 16
        assert set(run["perplexity"]) == {"bca", "full", "sinks", "full+pi", "full+yarn"}
        assert set(run["perplexity"]["bca"]) == {"16", "32"}
        # At the training length BCA's two blocks, and the sinks with their window, cover
        # the whole causal window; an extension's factor is 1 there.
        at_train_len = {key: run["perplexity"][key]["16"] for key in run["perplexity"]}
        assert max(at_train_len.values()) - min(at_train_len.values()) < 1e-3
        # Beyond it, an extension changes the numbers.
        assert run["perplexity"]["full+yarn"]["32"] != run["perplexity"]["full"]["32"]
    header, rows = _table(out / "scalings.md")
    assert [r[0] for r in rows] == [
        "RoPE + no extension (seed 0)",
        "RoPE + position interpolation (seed 0)",
        "RoPE + YaRN (seed 0)",
        "XPOS b=8 + no extension (seed 0)",
        "XPOS b=8 + position interpolation (seed 0)",
        "XPOS b=8 + YaRN (seed 0)",
    ]
    header, rows = _table(out / "table4.md")
    assert [r[0] for r in rows] == ["RoPE", "XPOS b=8"]
    # Passkey retrieval: every run, both decoding modes, 2 keys at each length and depth.
    header, rows = _table(out / "passkey.md")
    assert header == ["model", "128", "256"]
    assert [r[0] for r in rows] == [
        "RoPE with BCA",
        "RoPE without BCA",
        "XPOS b=8 with BCA",
        "XPOS b=8 without BCA",
    ]
    with open(out / "runs" / "xpos_b8_s0" / "passkey.json") as f:
        stored = json.load(f)
    assert {(r["mode"], r["length"], r["depth"]) for r in stored["results"]} == {
        (m, n, d) for m in ("bca", "full") for n in (128, 256) for d in (0.0, 1.0)
    }
    assert all(r["trials"] == 2 and r["accuracy"] in (0, 0.5, 1) for r in stored["results"])
    cells = {(r["mode"], r["length"]): [] for r in stored["results"]}
    for r in stored["results"]:
        cells[r["mode"], r["length"]].append(r["accuracy"])
    xpos_bca = next(row for row in rows if row[0] == "XPOS b=8 with BCA")
    assert xpos_bca[1:] == [f"{np.mean(cells['bca', n]):.2f}" for n in (128, 256)]
    # The key's nats, beside chance (ln 90000), in a second table of the same rows.
    assert all(r["answer_nats"] > 0 for r in stored["results"])
    assert stored["chance_nats"] == pytest.approx(np.log(90000))
    nats_header, nats_rows = _table(out / "passkey.md", which=1)
    assert nats_header == header and [r[0] for r in nats_rows] == [r[0] for r in rows]
    nats = {(r["mode"], r["length"]): [] for r in stored["results"]}
    for r in stored["results"]:
        nats[r["mode"], r["length"]].append(r["answer_nats"])
    xpos_full = next(row for row in nats_rows if row[0] == "XPOS b=8 without BCA")
    assert xpos_full[1:] == [f"{np.mean(nats['full', n]):.2f}" for n in (128, 256)]
    for name in ("perplexity.png", "scalings.png", "passkey.png", "figure1.png", "scores.png"):
        assert os.path.getsize(out / name) > 1000
    with open(out / "summary.md") as f:
        summary = f.read()
    assert "paper Table 2" in summary and "paper Table 3" in summary

    # A second invocation finds every stage done and only rewrites the reports; the
    # same --out as ~/out (it wrote everything, then failed reading ~/out/summary.md).
    again = _run("~/out", home=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "paper Table 2" in again.stdout
    assert again.stdout.count("trained already") == 2
    assert again.stdout.count("evaluated already") == 2
    with open(out / "timing.json") as f:
        timing = json.load(f)
    assert len(timing["invocations"]) == 2
    assert all(i["machine"] == timing["machine"] for i in timing["invocations"])

    # Other evaluation settings are measured again (they were reported over the old
    # numbers): one document, sinks 2, one passkey key. Training is kept. (The RoPE run
    # alone: every stage of the other is the same code, and compiling it took 30 s.)
    changed = _run(
        out,
        "--config.runs=rope",
        "--config.eval_docs=1",
        "--config.sinks=2",
        "--config.passkey_trials=1",
        "--config.passkey_multipliers=2,8",  # 32 tokens: below a sample's, skipped
    )
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert changed.stdout.count("trained already") == 1, changed.stdout
    assert "evaluated already" not in changed.stdout, changed.stdout
    stages = list(out.glob("runs/rope_s0/perplexity_*.json"))
    assert len(stages) == 5, stages
    for path in stages:
        with open(path) as f:
            stage = json.load(f)
        assert {r["documents"] for r in stage["results"]} == {1}, path
        assert stage["mode"] != "sinks" or stage["measured"]["sinks"] == 2, path
    with open(out / "runs" / "rope_s0" / "passkey.json") as f:
        stored = json.load(f)
    assert stored["trials"] == 1 and {r["length"] for r in stored["results"]} == {128}
    # A skipped cell is listed with why, in the JSON and under the table (its "–" was all).
    why = "length 32 is below the 69 tokens of the format"
    assert stored["skipped"] == [{"mode": m, "length": 32, "reason": why} for m in ("bca", "full")]
    header, rows = _table(out / "passkey.md")
    assert header == ["model", "32", "128"] and [row[1] for row in rows] == ["–", "–"]
    with open(out / "passkey.md") as f:
        text = f.read()
    assert f"– RoPE with BCA 32: {why}\n– RoPE without BCA 32: {why}\n" in text


@pytest.mark.parametrize(
    "flags,expected",
    [
        ("--config.runs=rope/b=3", "runs: 'rope/b=3': /b= applies to xpos only"),
        ("--config.nosuch=1", "unknown config field nosuch; known: "),
        # A training field without its train. (it listed the study's own fields), and a
        # name two sections share: the closer (it was data.vocab_size, by order).
        (
            "--config.num_train_steps=3",
            "unknown config field num_train_steps; did you mean train.num_train_steps?",
        ),
        (
            "--config.model.vocab_size=300",
            "unknown config field model.vocab_size; did you mean train.model.vocab_size?",
        ),
        # A positional argument was ignored (the study ran into the default --out), and
        # train.py's config was a KeyError traceback.
        (
            "study",
            "unexpected argument 'study': flags are --name=value (did you mean --out=study?)",
        ),
        # train.py's: its first field was named as a typo before the study's own check.
        (
            "--config=configs/tiny.py",
            "--config=configs/tiny.py: none of its fields is one of this program's (a config "
            "for another program?); name a config like configs/extrapolation.py",
        ),
        (
            "--config=configs/extrapolation.py:smok",
            "unknown preset 'smok' of configs/extrapolation.py; use small, text",
        ),
        # Empty lists were empty tables (exit 0) after every training.
        ("--config.modes=", "modes is empty; list some of bca, full, sinks"),
        ("--config.passkey_modes=", "passkey_modes is empty (passkey_trials=2; 0 measures"),
        # A bad passkey multiplier was named as one of multipliers (which were fine).
        ("--config.passkey_multipliers=1,2,x", "passkey_multipliers: 'x' is not a number"),
        # A sink count the block cannot hold: refused after the first run's training.
        ("--config.sinks=100", "sinks=100 must be an integer in [0, 8] (train_len/2)"),
        # Every passkey length below the format: no passkey table, after every training.
        (
            "--config.passkey_multipliers=1.5,2",
            "passkey_multipliers=1.5,2: no length reaches the 69 tokens of a passkey sample "
            "(the longest is 32); add a larger multiplier",
        ),
        # No length reaches train_len for the extensions: an error after every training.
        (
            "--config.multipliers=0.5 --config.scalings=pi",
            "scalings pi (evaluated on rope_s0, xpos_b8_s0) are measured at lengths of at "
            "least train_len 16, and multipliers 0.5 give none; add a multiplier of at least 1",
        ),
    ],
)
def test_bad_runs_and_flags_are_one_line_errors(tmp_path, flags, expected, program, capsys):
    """Before any training: nothing is written. Run in this process up to the first
    training (tests/programs.py); the test below runs one as the real command."""
    argv = [COMMAND[-1], f"--out={tmp_path / 'out'}", *flags.split()]
    code, err = program(programs.STUDY, argv, capsys)
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), err[-3000:]
    assert not os.path.exists(tmp_path / "out")


def test_a_refusal_is_one_line_and_status_2_from_the_command(tmp_path):
    done = _on_cpu([*COMMAND, f"--out={tmp_path / 'out'}", "--config.sinks=100"])
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: sinks=100 must be an integer in [0, 8] (train_len/2)"), line
    assert not os.path.exists(tmp_path / "out")


def test_runs_expand_seeds_and_refuse_repeats():
    from lexjax.experiments.extrapolation import ExperimentError, parse_runs

    specs = parse_runs("rope/seeds=3,xpos/seed=5/seeds=2,alibi", scale_base=64.0, seed=0)
    assert [s.name for s in specs] == [
        "rope_s0",
        "rope_s1",
        "rope_s2",
        "xpos_b64_s5",
        "xpos_b64_s6",
        "alibi_s0",
    ]
    with pytest.raises(ExperimentError, match="repeats run rope_s1"):
        parse_runs("rope/seeds=2,rope/seed=1", scale_base=64.0, seed=0)
    with pytest.raises(ExperimentError, match="at least 1"):
        parse_runs("rope/seeds=0", scale_base=64.0, seed=0)


def test_the_rope_extensions_go_to_the_lowest_seeds_of_each_rotary_variant():
    """scaling_seeds counted seeds from train.seed, not from the variant's own: runs
    rope/seed=4/seeds=2 had no extension measured at all, and runs below train.seed
    each had them, whatever scaling_seeds said."""
    from configs import extrapolation as presets
    from lexjax.experiments.extrapolation import evaluations, parse_runs

    exp = presets.get_config("smoke").to_dict()  # scalings pi,yarn on scaling_seeds=1
    assert (exp["scalings"], exp["scaling_seeds"], exp["train"]["seed"]) == ("pi,yarn", 1, 0)
    plain = ["bca", "full", "sinks"]

    def keys(runs, seed=0, **given):
        specs = parse_runs(runs, scale_base=8.0, seed=seed)
        return {s.name: [k for k, _, _ in evaluations({**exp, **given}, s, specs)] for s in specs}

    assert keys("xpos/seed=5/seeds=2,rope/seed=4/seeds=2,xpos/b=16/seed=9,alibi") == {
        "xpos_b8_s5": [*plain, "full+pi", "full+yarn"],
        "xpos_b8_s6": plain,
        "rope_s4": [*plain, "full+pi", "full+yarn"],
        "rope_s5": plain,
        "xpos_b16_s9": [*plain, "full+pi", "full+yarn"],  # another b: another variant
        "alibi_s0": plain,
    }
    assert keys("rope/seed=1,rope/seed=0", seed=3) == {
        "rope_s1": plain,
        "rope_s0": [*plain, "full+pi", "full+yarn"],
    }
    both = keys("rope/seeds=3", scaling_seeds=2)
    assert [len(both[f"rope_s{s}"]) for s in range(3)] == [5, 5, 3]


def test_lengths_are_exact_products_and_passkey_settings_in_another_order_the_same():
    """1.1 × train_len 100 was refused (110.00000000000001 is no whole number), and a
    finished study measured passkey again for depths 1,0 after 0,1 (the same cells)."""
    from lexjax.experiments.extrapolation import ExperimentError, _passkey_plan, eval_lengths

    assert eval_lengths("1.1", 100) == [110] and eval_lengths("0.7,1.4", 90) == [63, 126]
    with pytest.raises(ExperimentError, match=r"^multipliers: 0\.333 × train_len 100 = 33\.3 "):
        eval_lengths("0.333", 100)
    plan = lambda **given: _passkey_plan({"passkey_trials": 2, **given}, 16)
    swapped = plan(passkey_depths="1,0", passkey_modes="full,bca")
    assert swapped == plan(passkey_depths="0,1,1", passkey_modes="bca,full")
    assert (swapped["depths"], swapped["modes"]) == ([0.0, 1.0], ["bca", "full"])


def test_seed_statistics_and_the_noise_verdict_by_hand():
    from lexjax import reports

    def runs(*values):
        return [{"perplexity": {"bca": {"8": v}}} for v in values]

    xpos, rope = runs(7.0, 7.2, 7.4), runs(8.0, 8.1, 8.3)
    # mean 7.2, sample std 0.2; mean 8.1333…, sample std sqrt(0.02333…)
    assert reports._fmt_stats(xpos, "bca", 8) == "7.200 ± 0.200"
    d = reports.compare(xpos, rope, "bca", 8)
    assert d["diff"] == pytest.approx(7.2 - 24.4 / 3)
    # RoPE: squared deviations sum to 0.14/3, so its variance is 0.07/3; SE² = var/3 each.
    assert d["two_se"] == pytest.approx(2 * np.sqrt(0.04 / 3 + 0.07 / 9))
    assert d["verdict"] == "lower"  # 0.933 apart, 2 SE ≈ 0.3
    close = reports.compare(runs(8.0, 8.2, 8.4), rope, "bca", 8)
    assert close["verdict"] == "within seed noise"
    assert reports.compare(runs(7.0), rope, "bca", 8)["verdict"] == "one seed"
    assert reports.compare(xpos, rope, "bca", 16) is None
    assert reports._fmt_stats(runs(7.0), "bca", 8) == "7.000"
    # A seed whose perplexity was not finite (written null in strict JSON) makes the
    # cell NaN: it was dropped, and the row's mean silently left out the diverged seed.
    assert reports._fmt_stats(runs(7.0, None), "bca", 8) == "nan ± nan"
    assert reports.compare(runs(7.0, 7.2, None), rope, "bca", 8)["verdict"] == "not finite"
    nats = [{"passkey_nats": {"bca": {"64": {"0.5": 3.0, "0.9": None}}}}]
    assert np.isnan(reports._passkey_mean(nats, "bca", 64, key="passkey_nats")[0])

    # Seeds paired (same initialisation and data order): per-seed differences.
    def seeded(*values):
        return [{"seed": s, "perplexity": {"bca": {"8": v}}} for s, v in enumerate(values)]

    paired = reports.compare(seeded(7.0, 7.2, 7.4), seeded(8.0, 8.1, 8.3), "bca", 8)
    # differences −1.0, −0.9, −0.9: mean −0.9333, sample std sqrt(0.01/3)
    assert paired["paired"] and paired["diff"] == pytest.approx(-2.8 / 3)
    assert paired["two_se"] == pytest.approx(2 * np.sqrt(0.01 / 3) / np.sqrt(3))
    # A shift every seed shares is no noise when paired, though unpaired it is.
    a, b = (8.0, 8.4, 8.8), (8.1, 8.5, 8.9)
    assert reports.compare(runs(*a), runs(*b), "bca", 8)["verdict"] == "within seed noise"
    shift = reports.compare(seeded(*a), seeded(*b), "bca", 8)
    assert shift["verdict"] == "lower" and shift["diff"] == pytest.approx(-0.1)
    # Different seeds on the two sides: unpaired.
    other = [{**r, "seed": r["seed"] + 5} for r in seeded(*b)]
    assert not reports.compare(seeded(*a), other, "bca", 8)["paired"]
    # Paired by seed, not by the order the runs are listed in: seed 2, 0, 1 of one
    # side against 0, 1, 2 of the other gives 8.8 − 8.1, 8.0 − 8.5, 8.4 − 8.9 by seed.
    shuffled = [seeded(*a)[i] for i in (2, 0, 1)]
    d = reports.compare(shuffled, seeded(*b[::-1]), "bca", 8)
    assert d["paired"] and d["per_seed"] == pytest.approx([8.0 - 8.9, 8.4 - 8.5, 8.8 - 8.1])
    # A seed diverged on both sides (null) is no pair to leave out: the verdict says so,
    # not a paired verdict of the other seeds.
    diverged = reports.compare(seeded(7.0, 7.2, None), seeded(8.0, 8.1, None), "bca", 8)
    assert diverged["verdict"] == "not finite"
    # The same numbers in every seed: a difference of 0 within a noise of 0.
    same = reports.compare(seeded(*a), seeded(*a), "bca", 8)
    assert (same["diff"], same["two_se"], same["verdict"]) == (0, 0, "within seed noise")


def test_resolution_passkey_and_modes_are_compared_seed_by_seed_in_the_results():
    """The paired resolution and passkey differences docs/results.md quotes were worked
    out by hand from the runs; and sinks − BCA was quoted only as unpaired spreads."""
    from lexjax import reports

    def run(position, seed, ppl_bca, ppl_sinks, r_full, window, passkey):
        return {
            "position": position,
            "scale_base": 64.0 if position == "xpos" else None,
            "seed": seed,
            "perplexity": {"bca": {"8": ppl_bca}, "sinks": {"8": ppl_sinks}},
            "resolution": {"full": {"16": {"mean": r_full, "window_mean": window}}},
            "passkey": {"full": {"80": {"0.0": passkey, "1.0": 1.0}}},
        }

    rope = [run("rope", s, 9.0, 9.5 + s, 0.1 + s / 10, 0.2, 0.0) for s in range(3)]
    xpos = [run("xpos", s, 8.0, 8.1, 0.3 + s / 5, 0.2 + s / 100, s / 2) for s in range(3)]
    stats = {v["position"]: v for v in reports.variant_stats(rope + xpos, [8])}
    # XPOS − RoPE per seed, by hand: resolution 0.2, 0.3, 0.4; window 0, 0.01, 0.02;
    # passkey over depths (x + 1)/2: 0.5, 0.75, 1.0 against 0.5 each, so 0, 0.25, 0.5.
    for name, diffs in [
        ("resolution_minus_rope", [0.2, 0.3, 0.4]),
        ("resolution_window_minus_rope", [0.0, 0.01, 0.02]),
    ]:
        d = stats["xpos"][name]["full"]["16"]
        assert d["per_seed"] == pytest.approx(diffs) and d["diff"] == pytest.approx(diffs[1])
        assert d["two_se"] == pytest.approx(2 * np.std(diffs, ddof=1) / np.sqrt(3))
    d = stats["xpos"]["passkey_minus_rope"]["full"]["80"]
    # mean 0.25, sample std 0.25: 2 SE = 0.289, so within seed noise
    assert d["per_seed"] == pytest.approx([0.0, 0.25, 0.5])
    assert d["verdict"] == "within seed noise"
    # Sinks − BCA in the same seeds: RoPE 0.5, 1.5, 2.5 (mean 1.5, 2 SE = 2/√3 = 1.15);
    # XPOS 0.1 each.
    d = stats["rope"]["minus_bca"]["sinks"]["8"]
    assert d["per_seed"] == pytest.approx([0.5, 1.5, 2.5]) and d["verdict"] == "higher"
    assert d["two_se"] == pytest.approx(2 / np.sqrt(3))
    assert stats["xpos"]["minus_bca"]["sinks"]["8"]["diff"] == pytest.approx(0.1)
    assert "resolution_minus_rope" not in stats["rope"]


def test_the_seeds_report_says_paired_only_for_the_same_seeds():
    """Three RoPE seeds against two XPOS ones were reported as "paired: the mean of
    the per-seed differences" beside the unpaired difference of the means (−30.1 where
    the per-seed differences averaged −1.7); and only the first XPOS b was compared."""
    from lexjax import reports

    def run(position, b, seed, ppl):
        return {
            "position": position,
            "scale_base": b,
            "seed": seed,
            "perplexity": {"bca": {"8": ppl}},
        }

    rope = [run("rope", None, s, p) for s, p in enumerate((10.0, 12.0, 20.0))]
    xpos = [run("xpos", 8.0, s, p) for s, p in enumerate((9.0, 11.5))]
    xpos += [run("xpos", 64.0, s, p) for s, p in enumerate((8.0, 9.0, 10.0))]
    text = reports.seeds_table({"runs": rope + xpos, "lengths": [8]})
    unpaired, paired = text.split("XPOS b=8 − RoPE ±")[1], text.split("XPOS b=64 − RoPE ±")[1]
    assert "different seeds (2 and 3), so they are not paired" in unpaired.split("|")[0]
    # The difference of the means 10.25 − 14 (not the per-seed mean −0.75).
    assert "| −3.750 ± " in unpaired.replace("-", "−")
    assert "so the seeds are paired" in paired.split("|")[0]
    assert "| −5.000 ± " in paired.replace("-", "−")  # differences −2, −3, −10
    # As many seeds on each side, but other ones: not paired either.
    shifted = [run("xpos", 8.0, s + 3, p) for s, p in enumerate((9.0, 11.5, 12.0))]
    text = reports.seeds_table({"runs": rope + shifted, "lengths": [8]})
    how = text.split("XPOS b=8 − RoPE ±")[1].split("|")[0]
    assert "different seeds (3 and 3), so they are not paired" in how


def test_the_resolution_scalings_and_passkey_tables_by_hand():
    """Cells worked out by hand from two seeds: Table 3's R at 1× and 2× and at 2× over
    N = train_len (seed means), the RoPE-extension table's columns from train_len on,
    passkey accuracy as the seed mean of each seed's mean over depths ± the sample std,
    and the seeds report's per-seed XPOS − RoPE rows."""
    from lexjax import reports

    def run(position, seed, r, window, spread, accuracy, ppl):
        cell = lambda mean, window: {"mean": mean, "window_mean": window, "score_range": spread}
        return {
            "position": position,
            "scale_base": 8.0 if position == "xpos" else None,
            "seed": seed,
            "perplexity": {"full": {"8": ppl, "16": ppl + 1}, "full+yarn": {"16": ppl - 1}},
            "resolution": {"full": {"8": cell(r, 0.9), "16": cell(r / 2, window)}},
            "passkey": {"full": {"16": {"0.0": accuracy, "1.0": 1.0}}},
        }

    runs = [run("rope", 0, 0.4, 0.3, 2.0, 0.0, 9.0), run("rope", 1, 0.2, 0.1, 4.0, 1.0, 11.0)]
    runs += [run("xpos", 0, 0.6, 0.5, 2.0, 0.5, 8.0), run("xpos", 1, 0.8, 0.5, 2.0, 0.5, 8.5)]
    c = {"runs": runs, "lengths": [4, 8, 16], "train_len": 8}
    rows = [line.split(" | ")[1:] for line in reports.table3(c).splitlines()[2:]]
    # RoPE: R 0.3 at 8, 0.15 at 16, window 0.2; s range 3 (mean of 2 and 4) at both.
    assert [cell.strip(" |") for cell in rows[0]] == ["0.3", "0.15", "0.2", "3.000", "3.000"]
    assert [cell.strip(" |") for cell in rows[1]] == ["0.7", "0.35", "0.5", "2.000", "2.000"]
    scalings = reports.scalings_table(c).splitlines()
    assert scalings[0] == "| model | 8 | 16 |"  # from train_len on: 4 is left out
    assert scalings[3] == "| RoPE + YaRN (seeds 0, 1) | – | 9.000 ± 1.414 |"
    # Passkey, over depths (x + 1)/2 per seed: RoPE 0.5 and 1.0, XPOS 0.75 twice.
    passkey = reports.study_passkey_table(c).splitlines()
    assert passkey[2] == "| RoPE without BCA (2 seeds) | 0.75 ± 0.35 |"
    assert passkey[3] == "| XPOS b=8 without BCA (2 seeds) | 0.75 ± 0.00 |"
    # XPOS − RoPE by seed: 8 − 9 and 8.5 − 11 at 8 and at 16 (both one more).
    seeds = reports.seeds_table(c)
    assert "| without BCA, seed 0 | – | -1.000 | -1.000 |" in seeds
    assert "| without BCA, seed 1 | – | -2.500 | -2.500 |" in seeds


def test_an_out_that_cannot_be_a_directory_is_one_line(tmp_path):
    """--out naming a file (or a path under one) was a FileExistsError/NotADirectoryError
    traceback; an empty --out wrote the study into the current directory."""
    (tmp_path / "file").write_text("x")
    run = tmp_path / "run"  # a training's workdir: the study's runs were written into it
    (run / "checkpoints" / "6" / "state").mkdir(parents=True)
    for out, code, expected in [
        (run, 2, f"--out {run} is a training run's workdir (it holds checkpoints); choose"),
        (run / "checkpoints", 2, f"--out {run / 'checkpoints'} is inside a training run: "),
        (tmp_path / "file", 4, f"cannot make --out {tmp_path / 'file'} (File exists)"),
        (tmp_path / "file" / "out", 4, "(Not a directory); choose another directory"),
        ("", 2, "--out is empty"),
    ]:
        done = subprocess.run(
            [*COMMAND, f"--out={out}"],
            cwd=ROOT,
            env=dict(os.environ, XLA_FLAGS=P.xla_flags()),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == code, done.stderr[-3000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert os.listdir(run) == ["checkpoints"] and os.listdir(run / "checkpoints") == ["6"]


def _smoke_config(**overrides):
    from configs import extrapolation as presets
    from lexjax.config import from_configdict

    train = presets.get_config("smoke").train
    train.update(overrides)
    return from_configdict(train)


def test_a_started_training_keeps_its_config_and_its_seconds(tmp_path, monkeypatch):
    """The smoke run's real training, stopped after a step as a SIGTERM stops it
    (``train``'s ``stop_after``), then resumed: under another learning rate it is
    refused (it continued under it, and recorded the new config as if every step had
    used it), and train.json's seconds add up every invocation (they were the last
    one's alone). How often it logs and saves may change between invocations."""
    from lexjax import training
    from lexjax.config import to_dict
    from lexjax.experiments.extrapolation import (
        STARTED,
        ExperimentError,
        RunSpec,
        _plain,
        _refuse_another_config,
        _train_stage,
    )

    # Three steps, a checkpoint after each; 8 rows for the suite's 8 simulated devices.
    steps = dict(num_train_steps=3, checkpoint_every=1, batch_size=8)
    spec, config = RunSpec("rope", 8.0, 0), _smoke_config(**steps)
    workdir, log, walls = str(tmp_path / "runs" / spec.name), lambda _: None, []

    def invocation(config):
        start = time.perf_counter()
        try:
            return _train_stage(spec, config, workdir, log=log)
        finally:
            walls.append(time.perf_counter() - start)

    real_train = training.train
    monkeypatch.setattr(training, "train", functools.partial(real_train, stop_after=1))
    assert invocation(config) is None  # stopped after step 1, saved
    with pytest.raises(ExperimentError) as error:
        _train_stage(spec, _smoke_config(**steps, learning_rate=0.05), workdir, log=log)
    assert error.value.exit_code == 2
    assert "train_started.json was written for another training config (differs in " in str(
        error.value
    )
    # With both values, so that "the same config" can be followed.
    assert re.search(
        r"learning_rate: [0-9.e-]+ there, 0\.05 now\); use a new --out or the same config$",
        str(error.value),
    )
    other_model = _smoke_config(**steps)
    other_model = dataclasses.replace(
        other_model, model=dataclasses.replace(other_model.model, scale_base=4.0)
    )
    with pytest.raises(
        ExperimentError, match=r"\(differs in model\.scale_base: 8\.0 there, 4\.0 now\)"
    ):
        _train_stage(spec, other_model, workdir, log=log)  # it named only "model"
    # A study checks every run under OUT before it trains any: another config trained
    # the runs listed before the first old one (or, none listed, wrote its tables over
    # the old study's), and was refused only then.
    shared = lambda c: {k: v for k, v in _plain(to_dict(c)).items() if k != "sharding_rules"}
    out, other = str(tmp_path), _smoke_config(**steps, learning_rate=0.05)
    for listed in ({}, {spec.name: config}):
        _refuse_another_config(out, shared(config), listed)
    for listed in ({}, {spec.name: other}):  # the run listed now, or not
        with pytest.raises(
            ExperimentError, match=rf"^{re.escape(workdir)}/{STARTED} .* learning_rate"
        ):
            _refuse_another_config(out, shared(other), listed)
    # Not XPOS, a run not listed is not refused over the scale_base it does not use:
    # a RoPE run's record as the study writes it (with the study's b then, 8).
    rope = tmp_path / "runs" / "rope_s5"
    rope.mkdir()
    record = json.loads((tmp_path / "runs" / spec.name / STARTED).read_text())
    record["config"]["model"]["position"], record["config"]["seed"] = "rope", 5
    (rope / "train.json").write_text(json.dumps(record))
    b16 = dataclasses.replace(config, model=dataclasses.replace(config.model, scale_base=16.0))
    _refuse_another_config(out, shared(b16), {})
    rope.joinpath("train.json").unlink()
    rope.rmdir()
    # A record that cannot be read is named (it was a JSONDecodeError traceback).
    damaged = tmp_path / "runs" / "xpos_b4_s3"
    damaged.mkdir()
    (damaged / "train.json").write_text('{"config": {"mod')
    with pytest.raises(
        ExperimentError, match=rf"^cannot read {re.escape(str(damaged))}/train.json \("
    ):
        _refuse_another_config(out, shared(config), {})
    damaged.joinpath("train.json").unlink()
    damaged.rmdir()
    # Settings that change no number the study reports may change (they were refused).
    assert invocation(_smoke_config(**{**steps, "checkpoint_every": 2}, log_every=7)) is None
    monkeypatch.setattr(training, "train", real_train)
    record = invocation(config)
    assert record["summary"]["step"] == 3 and record["summary"]["start_step"] == 2
    # Each invocation compiles its step (seconds), far more than the stage adds.
    assert walls[-1] < record["seconds"] <= sum(walls), (record["seconds"], walls)


def test_a_runs_advice_on_its_workdir_names_the_studys_out(tmp_path):
    """Training's messages name the API's workdir (train.py's say --workdir): the
    study's runs live in OUT/runs/<run>, so the advice is about --out."""
    from lexjax import training
    from lexjax.errors import CheckpointError
    from lexjax.experiments.extrapolation import RunSpec, _run_error

    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError) as e:
        training._check_workdir(str(tmp_path / "f"))
    said = _run_error(RunSpec("rope", 8.0, 0), e.value)
    assert type(said) is CheckpointError
    assert (
        str(said)
        == f"run rope_s0: workdir {tmp_path / 'f'} is a file; choose a directory for --out"
    )


def test_resolution_is_measured_again_on_other_documents(tmp_path, monkeypatch):
    """The documents resolution reads depend on the longest evaluated length (the
    plan keeps those that have it): with more multipliers perplexity was measured
    again, resolution kept, from other documents than the new numbers."""
    from lexjax import checkpoint, evaluation
    from lexjax.experiments.extrapolation import ExperimentError, RunSpec, _eval_stage, _stage_done

    spec, config = RunSpec("rope", 8.0, 0), _smoke_config(batch_size=8)  # 8 devices
    lexjax.train(config, str(tmp_path), log=lambda _: None)  # a real run of 2 steps
    measured, real_protocol = [], evaluation.resolution_protocol

    def resolution(model, params, documents, **kwargs):  # the real one, counted
        measured.append([list(d) for d in documents])
        return real_protocol(model, params, documents, **kwargs)

    monkeypatch.setattr(evaluation, "resolution_protocol", resolution)
    plan = {
        "docs": {"perplexity": 1, "resolution": 2},
        "eval_split": "test",
        "evaluations": lambda spec: [],
        "corpus": None,  # not checked
    }
    workdir, log = str(tmp_path), lambda _: None
    first = [list(range(40)), list(range(1, 41)), list(range(2, 42))]
    _eval_stage(spec, config, workdir, {**plan, "documents": first}, log)
    _eval_stage(spec, config, workdir, {**plan, "documents": first}, log)
    assert measured == [first[:2]]
    _eval_stage(spec, config, workdir, {**plan, "documents": first[1:]}, log)
    assert measured[1:] == [first[1:]]
    _eval_stage(spec, config, workdir, {**plan, "documents": first[2:]}, log)
    assert measured[2:] == [first[2:]]
    with open(tmp_path / "resolution.json") as f:
        assert json.load(f)["measured"]["documents"] == 1
    # A result damaged from outside (the study writes atomically) is measured again; it
    # was a JSONDecodeError traceback (exit 1).
    (tmp_path / "resolution.json").write_text('{"config": ')
    _eval_stage(spec, config, workdir, {**plan, "documents": first[2:]}, log)
    assert measured[3:] == [first[2:]]
    with open(tmp_path / "resolution.json") as f:
        assert json.load(f)["measured"]["documents"] == 1
    # A damaged train.json is not measured: refused, naming the file.
    (tmp_path / "train.json").write_text("{")
    with pytest.raises(ExperimentError, match=r"^cannot read .*train\.json \(Expecting "):
        _stage_done(str(tmp_path / "train.json"), config)
    # Files that changed since the run trained make another build: refused, not
    # measured on text its held-out split may share with its training (and kept, not
    # mixed with other runs' numbers, when measured already).
    trained = checkpoint.load_params_and_tokenizer(workdir).corpus
    assert trained is not None
    with pytest.raises(
        ExperimentError, match=f"^run rope_s0 trained on the corpus build {trained}, "
    ):
        _eval_stage(spec, config, workdir, {**plan, "documents": first[2:], "corpus": "x/y/1"}, log)
    assert measured[4:] == []


def test_an_evaluation_is_measured_again_under_other_lengths_or_another_protocol(
    tmp_path, monkeypatch
):
    """A perplexity stage is done only for the lengths and the protocol it was measured
    with: a length added below the largest (the same budget and documents) or a file of
    an older protocol must be measured again, else its table shows numbers of other
    settings, or "–". The evaluation itself is stubbed: what is checked is which stages
    run."""
    from lexjax import evaluation
    from lexjax.experiments import extrapolation as ex

    spec, config = ex.RunSpec("rope", 8.0, 0), _smoke_config()
    measured = []

    def perplexity(model, params, docs, lengths, **kwargs):
        measured.append(list(lengths))
        return [
            evaluation.PerplexityResult("bca", n, 2.0, 0.7, 32, 1, 0.0, kwargs["max_length"])
            for n in lengths
        ]

    monkeypatch.setattr(ex, "_load_run", lambda spec, workdir, plan: (config, None, 2))
    monkeypatch.setattr(evaluation, "perplexity", perplexity)
    monkeypatch.setattr(evaluation, "resolution_protocol", lambda *a, **k: [])
    plan = {
        "documents": [list(range(40))],
        "docs": {"perplexity": 1, "resolution": 1},
        "eval_split": "test",
        "corpus": None,
        "lengths": [16, 32],
        "max_length": 32,
        "sinks": 4,
        "tokens_per_batch": 64,
        "tokenizer": None,
        "evaluations": lambda spec: [("bca", "bca", "none")],
    }
    workdir, log = str(tmp_path), lambda _: None
    ex._eval_stage(spec, config, workdir, plan, log)
    ex._eval_stage(spec, config, workdir, plan, log)  # done: not measured again
    assert measured == [[16, 32]]
    ex._eval_stage(spec, config, workdir, {**plan, "lengths": [8, 16, 32]}, log)
    assert measured == [[16, 32], [8, 16, 32]]
    path = tmp_path / "perplexity_bca.json"
    stage = json.loads(path.read_text())
    assert [r["length"] for r in stage["results"]] == [8, 16, 32]
    assert stage["protocol"] == ex.PROTOCOL
    path.write_text(json.dumps({**stage, "protocol": ex.PROTOCOL - 1}))
    ex._eval_stage(spec, config, workdir, {**plan, "lengths": [8, 16, 32]}, log)
    assert measured == [[16, 32], [8, 16, 32], [8, 16, 32]]


def test_each_run_trains_with_its_own_seed_position_and_scale_base():
    """A run's config is the shared one with the run's position, b and seed: the seeds
    of a variant must differ (the same seed trains the same model), and an XPOS run's b
    is its own, not the shared one."""
    from lexjax.config import to_dict
    from lexjax.experiments.extrapolation import _plain, _run_config, parse_runs

    shared = {k: v for k, v in _plain(to_dict(_smoke_config())).items() if k != "sharding_rules"}
    specs = parse_runs("rope/seeds=2,xpos/b=16/seed=3,alibi", scale_base=8.0, seed=0)
    configs = [_run_config(shared, spec) for spec in specs]
    assert [(c.model.position, c.model.scale_base, c.seed) for c in configs] == [
        ("rope", 8.0, 0),
        ("rope", 8.0, 1),
        ("xpos", 16.0, 3),
        ("alibi", 8.0, 0),
    ]
    assert shared["model"]["position"] == _smoke_config().model.position  # not changed


def test_a_second_study_on_the_same_out_is_a_workdir_error(tmp_path):
    """It was exit 2 (configuration) and advised --workdir, which the study has not."""
    from lexjax import lease
    from lexjax.errors import CheckpointError
    from lexjax.experiments.extrapolation import RunSpec, _train_stage

    spec, config = RunSpec("rope", 8.0, 0), _smoke_config()
    workdir = str(tmp_path / "runs" / spec.name)
    os.makedirs(workdir)
    held = lease.hold(workdir, timeout_s=120, log=lambda _: None)
    with held, pytest.raises(CheckpointError) as error:
        _train_stage(spec, config, workdir, log=lambda _: None)
    assert error.value.exit_code == 4
    message = str(error.value)
    assert message.startswith(f"run rope_s0: workdir {workdir} is in use by a training job on ")
    assert message.endswith(
        "another study (or train.py) is writing this --out; wait for it to finish or use "
        "another --out"
    )


def test_a_second_study_is_refused_for_its_whole_run(tmp_path):
    """Only training took a lock: a second study with other lengths evaluated the
    first's trained runs while the first trained its next, and the first's tables then
    showed one model scored on other text than the model beside it (both exit 0)."""
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".study.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a study at work (training or evaluating)
        done = _run(out, "--config.multipliers=1,2,4")
    assert done.returncode == 4, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: another study is writing --out {out}; wait for it to finish or use another --out"
    )
    assert sorted(p.name for p in out.iterdir()) == [".study.lock"]  # nothing written


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_while_the_study_imports_jax_stops_it_at_its_start(tmp_path, name):
    """Before the study had handlers (importing JAX) a SIGTERM ended it by the default
    action (status 143, nothing said, where train.py exits 0) and a Ctrl-C was a
    KeyboardInterrupt traceback from inside an import."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=P.xla_flags())
    out = tmp_path / "out"
    proc = subprocess.Popen(  # Ctrl-C's default action, also where the suite has it ignored
        P.interruptible([*COMMAND, f"--out={out}"]),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def loading_jax():  # jaxlib's extension is mapped: `import jax` is under way
        try:
            with open(f"/proc/{proc.pid}/maps") as f:
                return "jaxlib" in f.read()
        except OSError:
            return False

    P.wait_until(loading_jax, proc, poll=0.001)
    code, stdout, stderr = P.kill(proc, getattr(signal, name))
    assert "Traceback" not in stderr, stderr[-3000:]
    if name != "SIGINT":
        assert code == 0, stderr[-3000:]
        last = stdout.strip().splitlines()[-1]
        assert last == f"stopped by {name}; run the same command again to continue ({out})"
    else:
        assert code == -signal.SIGINT and stderr.strip() == "interrupted (Ctrl-C)", stderr
    assert not out.exists()  # it stopped before it began


# A study whose run is trained and whose evaluation gets a signal in a callback (where
# Python only reports what a handler raises, as in JAX's gc callback): argv[1] names it.
# It starts as the study's __main__ does: stop signals deferred while JAX loads.
_SIGNALLED = """
import os, signal, sys, time
from lexjax import signals
signals.defer()
from lexjax.experiments import extrapolation as study

class Callback:
    def __del__(self):
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        time.sleep(1)  # the handler runs, and raises, here

def evaluate(spec, config, workdir, plan, log):
    Callback()
    time.sleep(10)
    raise SystemExit("the signal was lost")

study._train_stage = lambda spec, config, workdir, log: {}
study._eval_stage = evaluate
argv = ["study", "--config=configs/extrapolation.py:smoke", "--config.passkey_trials=0"]
sys.exit(study.run([*argv, "--out=" + sys.argv[2]]))
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_outside_training_stops_the_study(tmp_path, name):
    """SIGTERM during evaluation ended the study by the default handler (143, nothing
    said, the invocation not in timing.json); a Ctrl-C that landed in a callback was
    lost (1 in 6: the study ran to its end). SIGHUP (an ssh session that dropped)
    still ended it by the default handler (129)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=P.xla_flags())
    out = tmp_path / "out"
    done = subprocess.run(  # Ctrl-C's default action, also where the suite has it ignored
        P.interruptible([sys.executable, "-c", _SIGNALLED, name, str(out)]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if name != "SIGINT":
        assert done.returncode == 0, done.stderr[-3000:]
        last = done.stdout.strip().splitlines()[-1]
        assert last == f"stopped by {name}; run the same command again to continue ({out})"
    else:
        assert done.returncode == -signal.SIGINT, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C)", done.stderr
    with open(out / "timing.json") as f:
        (invocation,) = json.load(f)["invocations"]
    assert invocation["outcome"] == {"SIGINT": "interrupted"}.get(name, "stopped")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


# A study whose runs are done and which gets a SIGTERM while it writes its reports.
_SIGNALLED_WRITING = """
import os, signal, sys, time
from lexjax import reports
from lexjax.experiments import extrapolation as study

def write_all(out, collected):
    reports.write_text(os.path.join(out, "first.md"), "written")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)  # an armed handler raises here
    reports.write_text(os.path.join(out, "last.md"), "written")

study._train_stage = lambda spec, config, workdir, log: {}
study._eval_stage = study._passkey_stage = lambda *args: None
reports.collect = lambda *args: {}
reports.write_all = write_all
argv = ["study", "--config=configs/extrapolation.py:smoke", "--config.passkey_trials=0"]
sys.exit(study.run([*argv, "--out=" + sys.argv[1]]))
"""


def test_a_sigterm_while_the_reports_are_written_stops_the_study_after_them(tmp_path):
    """The reports were left half old, half new, with timing.json saying completed."""
    out = tmp_path / "out"
    done = _on_cpu([sys.executable, "-c", _SIGNALLED_WRITING, str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "first.md").exists() and (out / "last.md").exists()
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"stopped by SIGTERM; run the same command again to continue ({out})"


@pytest.mark.parametrize(
    "tokenizer,ylabel",
    [("bytes (258 ids)", "perplexity (per byte)"), ("sentencepiece (2048 ids)", "perplexity")],
)
def test_the_perplexity_figure_says_per_byte_only_for_bytes(monkeypatch, tokenizer, ylabel):
    """It said "per byte" for a study of SentencePiece tokens too."""
    from lexjax import reports

    drawn = []
    monkeypatch.setattr(reports, "plot_perplexity", lambda *a, **k: drawn.append(k["ylabel"]))
    c = {"runs": [], "lengths": [16, 32], "train_len": 16, "tokenizer": tokenizer}
    reports._plot_variants(c, "unused.png")
    assert drawn == [ylabel]


def test_tables_2_and_4_of_a_study_of_bca_alone():
    """With --config.modes=bca, Table 2's baselines (read without BCA) were empty with no
    word why, and every Table 4 cell was empty, though at the training length BCA's
    numbers are the same."""
    from lexjax import reports

    runs = [
        {"position": p, "scale_base": b, "perplexity": {"bca": {"16": v, "32": v + 1}}}
        for p, b, v in (("rope", None, 9.0), ("xpos", 8.0, 8.0))
    ]
    c = {"runs": runs, "lengths": [16, 32], "train_len": 16}
    table2 = reports.table2(c)
    assert "| RoPE | – | – |" in table2 and "| 8.000 | 9.000 |" in table2
    assert table2.endswith(
        "– : not measured; this table reads mode full, which the study's modes leave out"
        "\n\nThe baselines without BCA, LEX with it."  # and what ± is, with several seeds:
    )
    seeds = {"runs": [*runs, {**runs[1], "seed": 1}], "lengths": [16, 32], "train_len": 16}
    for table in (reports.table2(seeds), reports.table5(seeds)):
        assert table.endswith(
            "Perplexity: mean ± sample standard deviation over a variant's seeds."
        )
    assert [row.split("|")[2].strip() for row in reports.table4(c).splitlines()[2:]] == [
        "9.000",
        "8.000",
    ]


def test_a_sink_count_is_checked_only_for_a_study_that_evaluates_sinks(monkeypatch):
    """Checked before any training, but only where mode sinks uses it (a study without
    that mode was refused a sink count it never uses)."""
    from configs import extrapolation as presets
    from lexjax import data as data_lib
    from lexjax.errors import ConfigError
    from lexjax.experiments import extrapolation as ex

    class Planned(Exception):
        """Raised where the plan starts reading the corpus: every setting checked."""

    def planned(*args, **kwargs):
        raise Planned

    monkeypatch.setattr(data_lib, "load_tokenizer", planned)
    exp, shared = presets.get_config("smoke"), _smoke_config()
    specs = ex.parse_runs("rope", scale_base=8.0, seed=0)
    exp.sinks = 100
    exp.modes = "bca,full"
    with pytest.raises(Planned):
        ex._plan(exp, shared, specs)
    exp.modes = "bca,full,sinks"
    with pytest.raises(ConfigError, match=r"^sinks=\d+ must be an integer in \[0, 8\]"):
        ex._plan(exp, shared, specs)
