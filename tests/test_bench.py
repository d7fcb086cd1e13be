"""Smoke tests of bench/: the programs run and their JSON has the promised shape.

Nothing here asserts a speed; figures come from `python bench/run.py` (docs/benchmarks.md).
"""

import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from configs import paper
from lexjax import hugepages
from lexjax.config import from_configdict
from tests import processes as P
from tests import programs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args, tmp_path, **environ):
    env = {
        **os.environ,
        "XLA_FLAGS": P.xla_flags(),  # one CPU device
        **environ,
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


# The train step's XLA options in a process like the benchmark's (one CPU device).
_OPTIONS = (
    "import json, jax; from lexjax.steps import train_step_compiler_options as o; "
    "print(json.dumps(o(jax.devices()[:1])))"
)


def test_run_mfu_quick_writes_the_json_shape(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["bench/run.py", "--quick", "--only", "mfu", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert {"machine", "mfu", "shared_cores"} <= set(results)
    check = results["machine"]["load_check"]
    assert check["shared"] in (True, False) and check["other_cores_busy"] >= 0
    assert results["mfu"]["shared_cores"] in (True, False)
    entry = results["mfu"]
    for key in ("value", "unit", "target", "met"):
        assert key in entry
    assert entry["value"] > 0
    assert set(entry["by_dtype"]) == {"float32", "bfloat16"}
    assert entry["model_overrides"] == {"num_layers": 2}  # --quick: a smoke test, not a figure
    # The shapes those overrides apply to, and the code measured (neither was recorded).
    assert results["model"] == dict(
        num_layers=6,
        d_model=256,
        num_heads=4,
        mlp_dim=1024,
        vocab_size=320,
        position="xpos",
        dtype="float32",
        train_len=256,
        batch_size=16,
    )
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if commit.returncode == 0:  # a git checkout
        assert results["machine"]["git_commit"].startswith(commit.stdout.strip())
    # The step was timed cold (its first call after the matmul sides) against a warm peak,
    # and the forward/backward split compiled without the step's XLA options.
    assert entry["warm"] is True
    options = json.loads(_run(["-c", _OPTIONS], tmp_path).stdout)
    assert entry["step_breakdown_seconds"]["compiler_options"] == options
    assert "mfu:" in proc.stdout


@pytest.mark.reference
def test_train_vs_reference_quick_times_every_side_against_torchscale(tmp_path):
    """Live (torch + torchscale in this interpreter): the parity benchmark's JSON, with
    XLA's default options timed beside the library's whenever the library sets some."""
    import jax

    from lexjax.steps import train_step_compiler_options

    out = tmp_path / "bench.json"
    args = ["--quick", "--only", "train_vs_reference", "--reference_python", sys.executable]
    proc = _run(["bench/run.py", *args, "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = json.loads(out.read_text())["train_vs_reference"]
    assert entry["unit"] == "× reference tokens/s" and entry["value"] > 0
    sides = {"lexjax_float32", "lexjax_bfloat16", "reference"}
    options = train_step_compiler_options(jax.devices()[:1])
    assert entry["compiler_options"] == options
    if options:
        sides.add("lexjax_float32_xla_defaults")
        assert math.isfinite(entry["compiler_options_gain"]["median"])  # a ratio, any
    assert set(entry["tokens_per_sec"]) == sides
    assert set(entry["ratio"]) == sides - {"reference"}
    assert entry["value"] == max(
        entry["ratio"][k]["median"] for k in ("lexjax_float32", "lexjax_bfloat16")
    )
    assert entry["model_overrides"] == {"num_layers": 2}  # --quick: a smoke test, not a figure
    assert "torchscale tokens/s" in proc.stdout


@pytest.mark.reference
def test_train_processes_quick_runs_every_side_in_its_own_process(tmp_path):
    """Live: lexjax with and without huge pages and torchscale, each a fresh process."""
    out = tmp_path / "bench.json"
    args = ["--quick", "--only", "train_processes", "--reference_python", sys.executable]
    proc = _run(["bench/run.py", *args, "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    entry = results["train_processes"]
    assert entry["unit"] == "× reference tokens/s (whole processes)" and entry["value"] > 0
    assert entry["model_overrides"] == {"num_layers": 2}  # --quick: a smoke test, not a figure
    skip = hugepages.reason_to_skip(environ={})
    assert entry["hugepages_skipped"] == skip
    if skip is None:
        assert "glibc.malloc.hugetlb=1" in results["machine"]["glibc_tunables"]  # restarted
        assert entry["glibc_tunables"] == {
            "huge_pages": "glibc.malloc.hugetlb=1",
            "small_pages": "",
        }
        faults = entry["page_faults_per_step"]
        # The mechanism, not a speed: the step's temporaries stop faulting in 4 KiB pages.
        assert faults["huge_pages"]["median"] < faults["small_pages"]["median"] / 2
        assert math.isfinite(entry["hugepages_gain"]["median"])  # a speed: not asserted
    assert "torchscale tokens/s" in proc.stdout


def _refused(capsys, script: str, flags: list[str]):
    """(exit status, stdout, stderr) of bench/SCRIPT.py's argument checks on ``flags``,
    in this process: every check runs before any benchmark (a real process shows
    that the status and the one line reach the shell, below)."""
    module = programs.load_script(f"bench/{script}.py")
    capsys.readouterr()
    argv = [f"bench/{script}.py", *flags]
    try:
        if script == "run":
            module.parse(flags)
        elif script == "own_text":  # reads sys.argv
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(sys, "argv", argv)
                module.main()
        else:
            module.main(flags)
    except SystemExit as e:
        out = capsys.readouterr()
        return e.code, out.out, out.err
    pytest.fail(f"bench/{script}.py accepted {flags}")


def test_unknown_benchmark_is_a_one_line_error(tmp_path, capsys):
    proc = _run(["bench/run.py", "--only", "nope"], tmp_path)
    assert proc.returncode == 2
    # One line, not argparse's usage text and "run.py: error: ...".
    assert proc.stderr.startswith("error: unknown benchmark 'nope'"), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    code, _, err = _refused(capsys, "run", ["--only", "nope"])  # the same, in this process
    assert code == 2 and err == proc.stderr
    for flags, said in (
        (["--threads", "0"], "error: --threads=0: give a whole number of at least 1"),
        (["--threads", "x"], "error: argument --threads: invalid int value: 'x'"),
        (["--bogus"], "error: unrecognized arguments: --bogus"),
    ):
        code, _, err = _refused(capsys, "run", ["--only", "mfu", *flags])
        assert code == 2 and err == said + "\n", err
    code, _, err = _refused(capsys, "run", ["--only", ","])
    assert code == 2 and "--only names no benchmark" in err
    # A --json it cannot write is refused before any benchmark runs (it was a traceback
    # after the first, whose results were lost).
    (tmp_path / "file").write_text("x")
    code, _, err = _refused(
        capsys, "run", ["--only", "eval_scaling", "--json", f"{tmp_path}/file/x.json"]
    )
    said = f"x.json: cannot write there (Not a directory: {tmp_path}/file is a file)"
    assert code == 2 and said in err, err  # was "(File exists)"
    deeper = ["--only", "eval_scaling", "--json", f"{tmp_path}/file/a/x.json"]
    code, _, err = _refused(capsys, "run", deeper)  # a file further up: was "(Not a directory)"
    assert code == 2 and said in err, err
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # was "(File exists)"
    dangling = ["--only", "eval_scaling", "--json", f"{tmp_path}/dangling/x.json"]
    code, _, err = _refused(capsys, "run", dangling)
    assert code == 2 and f"{tmp_path}/dangling is a link to nothing)" in err
    # profile_step.py's flags too (a bad --position was a ConfigError traceback).
    code, _, err = _refused(capsys, "profile_step", ["--position", "bogus"])
    assert code == 2 and err.startswith("error: model.position='bogus'")
    assert err.count("\n") == 1, err
    # The other scripts: usage text and "PROG: error:" (argparse's), or a count of 0
    # taken and a traceback after a minute's work (--rounds 0).
    for script, flags, said in (
        ("pipeline_throughput", ["--rounds", "0"], "--rounds=0: give a whole number of at least 1"),
        ("pipeline_throughput", ["--rounds", "x"], "argument --rounds: invalid int value: 'x'"),
        ("pipeline_throughput", ["--json", str(tmp_path)], f"--json={tmp_path}: cannot write"),
        ("profile_step", ["--steps", "0"], "--steps=0: give a whole number of at least 1"),
        ("own_text", [], "the following arguments are required: --out, --heldout"),
    ):
        code, out, err = _refused(capsys, script, flags)
        assert code == 2 and out == "", err[-2000:]
        assert err.startswith(f"error: {said}") and err.count("\n") == 1


def test_own_text_keeps_no_sample_of_a_generation_that_failed(tmp_path):
    """eval.py --generate stopped midway (Ctrl-C: status 130 after the text so far) left
    its text in WORKDIR.generate.txt, which the next run, resuming, took as the sample
    (and a failure was a CalledProcessError traceback)."""
    module = programs.load_script("bench/own_text.py")
    workdir = str(tmp_path / "sentencepiece_1")
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/sh\necho 'the text so far'\necho 'interrupted (Ctrl-C)' >&2\nexit 130\n"
    )
    stub.chmod(0o755)
    with pytest.raises(SystemExit) as e:
        module._generate(str(stub), workdir, "The")
    assert str(e.value).startswith("error: ") and "exited 130; see " in str(e.value)
    assert "\n" not in str(e.value)
    assert not os.path.exists(workdir + ".generate.txt")
    assert "interrupted" in (tmp_path / "sentencepiece_1.generate.log").read_text()
    stub.write_text("#!/bin/sh\necho 'the whole text'\n")
    assert module._generate(str(stub), workdir, "The")["text"] == "the whole text\n"


def test_a_json_in_a_read_only_directory_is_refused_before_any_benchmark(tmp_path):
    """Was a traceback after the first benchmark, its results lost."""
    with P.tmpfs(tmp_path / "ro", "1m") as mount:
        P.make_read_only(mount, tmp_path / "ro")
        args = ["bench/run.py", "--only", "eval_scaling", "--json", f"{tmp_path}/ro/x.json"]
        proc = _run(args, tmp_path)
    said = "x.json: cannot write there (Read-only file system); choose another path"
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr


def test_ctrl_c_keeps_an_earlier_json_and_the_finished_benchmarks(tmp_path):
    """A Ctrl-C: one line, status 130; the finished benchmarks are in OUT.partial and an
    earlier complete OUT is left as it was (it was replaced by the partial results,
    nothing marking them so, after a KeyboardInterrupt traceback)."""
    out = tmp_path / "bench.json"
    out.write_text('{"earlier": "complete"}\n')
    # train_vs_reference fails at once without torch (recorded); then mfu starts.
    args = ["--only", "train_vs_reference,mfu", "--reference_python", "/bin/false"]
    proc = subprocess.Popen(  # Ctrl-C's default action, also where the suite has it ignored
        P.interruptible([sys.executable, "bench/run.py", *args, "--json", str(out)]),
        cwd=ROOT,
        env=dict(os.environ, XLA_FLAGS=P.xla_flags()),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("running mfu"):
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()  # (a no-op once it has ended)
    assert proc.returncode == 130, "".join(lines) + rest
    assert (
        rest.strip() == f"interrupted (Ctrl-C); the benchmarks that finished are in {out}.partial"
    )
    assert out.read_text() == '{"earlier": "complete"}\n'
    finished = json.loads(pathlib.Path(f"{out}.partial").read_text())
    assert "error" in finished["train_vs_reference"] and "mfu" not in finished


def test_a_ctrl_c_a_gc_callback_swallowed_still_stops_the_benchmarks(tmp_path):
    """Python only reports what a gc callback raises, and JAX's runs often: a Ctrl-C that
    landed there (CI saw it, during mfu) was lost and the benchmarks went on. A callback
    swallowing a KeyboardInterrupt stands in for that unlucky timing, deterministically."""
    program = textwrap.dedent(
        f"""
        import sys, time
        from bench import run

        class Swallowed:
            def __del__(self):
                raise KeyboardInterrupt  # as the Ctrl-C's, raised inside a callback

        def benchmarks(args, results, partial):
            Swallowed()
            time.sleep(600)  # past the timeout: only the Ctrl-C ends it in time
            return 0

        run._run = benchmarks
        sys.exit(run.main(["--only", "mfu", "--json", {str(tmp_path / "b.json")!r}]))
        """
    )
    started = time.monotonic()
    done = subprocess.run(
        P.interruptible([sys.executable, "-c", program]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == "interrupted (Ctrl-C)", done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr and time.monotonic() - started < 110


@pytest.mark.parametrize(
    "python, said",
    [
        ("/nonexistent/python", "cannot be run (No such file or directory)"),
        ("/bin/false", "cannot import torch and torchscale"),  # runs, imports nothing
    ],
)
def test_a_reference_python_without_torch_is_a_one_line_error(tmp_path, python, said):
    """Was a FileNotFoundError traceback, or exit 1 with the message on stdout only."""
    out = tmp_path / "bench.json"
    args = ["--only", "train_vs_reference", "--reference_python", python, "--json", str(out)]
    proc = _run(["bench/run.py", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and said in errors[0], errors
    assert f"--reference_python={python}" in errors[0]
    assert said in json.loads(out.read_text())["train_vs_reference"]["error"]  # still recorded
    assert "SHARED CORES" not in proc.stdout  # nothing measured: no ratio to doubt
    if python != "/bin/false":
        return
    # An earlier run's results are not replaced by a record of this error alone.
    out.write_text('{"earlier": "complete"}\n')
    proc = _run(["bench/run.py", *args], tmp_path)
    assert proc.returncode == 2 and out.read_text() == '{"earlier": "complete"}\n'
    assert (
        said
        in json.loads(pathlib.Path(f"{out}.partial").read_text())["train_vs_reference"]["error"]
    )


def test_a_relative_reference_python_is_found_and_a_non_python_is_named(tmp_path, monkeypatch):
    """A relative --reference_python passed its check (against the working directory),
    then failed with a traceback from the repository's root; /bin/true passed the import
    probe (it exits 0)."""
    from bench import train_vs_reference as tvr

    monkeypatch.chdir(tmp_path)
    (tmp_path / "py").write_text("#!/bin/sh\necho ok\n")  # answers the probe as one would
    (tmp_path / "py").chmod(0o755)
    assert tvr.resolve_python("./py") == str(tmp_path / "py")
    with pytest.raises(tvr.ReferenceUnavailable, match="^--reference_python=/bin/true cannot"):
        tvr.resolve_python("/bin/true")


def test_paper_literal_mirrors_configs_paper():
    pytest.importorskip("ml_collections")
    sys.path.insert(0, str(ROOT))
    from bench import common

    paper = common.config_dict("paper")
    for section in ("model", "optim", "mesh"):
        assert common.PAPER[section] == {k: paper[section][k] for k in common.PAPER[section]}
    for key in ("sharding", "train_len", "batch_size", "num_train_steps"):
        assert common.PAPER[key] == paper[key]


# Runs a script as an accelerator host would, with jax, flax and optax only: the
# project's other requirements fail to import.
_ONLY_JAX = """
import runpy, sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {
            "ml_collections", "grain", "tensorflow_datasets", "array_record",
            "sentencepiece", "tensorboardX", "matplotlib",
        }:
            raise ImportError(f"{name} is not installed on this host")
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_accelerator_small_writes_one_json_line_per_measurement(tmp_path):
    """Also without the data and reporting packages: the block scan imported them (via
    lexjax.evaluation) and ended the run in a traceback after the first measurements."""
    args = ["--small", "--attention_impls", "fused", "--remat_policies", "full,dots_except_mlp"]
    proc = _run(["-c", _ONLY_JAX, "bench/accelerator.py", *args, "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    (written,) = tmp_path.glob("*.jsonl")
    assert [json.loads(line) for line in written.read_text().splitlines()] == lines
    kinds = [line["kind"] for line in lines]
    assert kinds == [
        "matmul_peak",
        "train",
        "train_position_none",
        "xpos_overhead",
        "block_scan",
        "block_scan",
        "train",
    ]
    # Timed side by side in alternating rounds, not one window of each in turn.
    xpos = lines[3]
    assert xpos["rounds"] == 3 and len(xpos["percent_per_round"]) == 3
    assert xpos["percent_min"] <= xpos["percent"] <= xpos["percent_max"]
    trains = [line for line in lines if line["kind"] == "train"]
    assert [t["remat_policy"] for t in trains] == ["full", "dots_except_mlp"]
    vocab = from_configdict(paper.get_config()).model.vocab_size  # reported with every figure
    assert all(t["tokens_per_sec_per_device"] > 0 for t in trains)
    # The XPOS overhead and the block-scan lines too (they carried the attention alone,
    # and depend on the output layer as much as the train figures do).
    for line in lines[1:]:
        assert line["vocab_size"] == vocab and line["layers"] == 2, line["kind"]
        assert line["attention_impl"] == "fused" and line["dtype"] == "bfloat16", line["kind"]
    assert xpos["remat_policy"] == "full" and "position" not in xpos
    assert all(s["position"] == "xpos" and s["train_len"] == 128 for s in lines[4:6])
    # The median of rounds, with the rounds (it was one timed window), and the command.
    for t in trains:
        rounds = t["step_seconds_rounds"]
        assert len(rounds) == 3 and t["step_seconds"] == sorted(rounds)[1]
        assert t["command"].startswith("python bench/accelerator.py --small ")
    # One line per length, each written as soon as it is measured: a failure at a longer
    # length (out of memory at 256k) loses none measured before it.
    scans = [line for line in lines if line["kind"] == "block_scan"]
    assert [s["length"] for s in scans] == [1024, 4096]
    assert all(s["tokens_per_sec"] > 0 for s in scans)
    # Each configuration's own compiled step (it was the process-wide high-water mark,
    # so every row reported the largest configuration measured before it).
    for t in [*trains, lines[2]]:
        memory = t["memory_bytes"]
        assert memory["argument"] >= 4 * t["num_params"] and memory["temp"] > 0
        assert (
            memory["total"]
            == memory["temp"] + memory["argument"] + memory["output"] - (memory["alias"])
        )
        assert t["memory_gib"] == memory["total"] / 2**30 < 4
        assert "peak_memory_gib" not in t and "process_peak_memory_gib" in t
    full, dots = (t["memory_bytes"]["temp"] for t in trains)
    assert full < dots  # full remat keeps fewer activations than dots_except_mlp


def test_accelerator_refuses_a_bad_flag_before_measuring(tmp_path):
    """A typo was a traceback (exit 1) after the matmul peak, on a leased accelerator."""
    for flag, value, said in (
        ("--remat_policies", "full,ful", "--remat_policies=full,ful: 'ful' is not one of"),
        ("--attention_impls", "cudnn", "--attention_impls=cudnn: 'cudnn' is not one of"),
        ("--eval_lengths", "16k", "--eval_lengths=16k: give comma-separated token counts"),
        ("--steps", "0", "--steps=0: give a whole number of at least 1"),
    ):
        proc = _run(["bench/accelerator.py", "--small", flag, value, "--out", str(tmp_path)], None)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert said in proc.stderr and proc.stdout == ""
    # A budget the shell's timeout would cut short (accelerator.sh's 570 s).
    proc = _run(
        ["bench/accelerator.py", "--small", "--budget=900", "--out", str(tmp_path)],
        None,
        ACCELERATOR_TIMEOUT_S="570",
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert "error: --budget=900: accelerator.sh stops the run after 570 s; give at most 510" in (
        proc.stderr
    )
    # Without --small on a host whose jax sees no accelerator: it trained the paper-size
    # model on the CPU until the shell's timeout, then recorded that as the accelerator's.
    proc = _run(["bench/accelerator.py", "--out", str(tmp_path)], None)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr == (
        "error: jax found no accelerator (backend cpu); install jax with this host's GPU or "
        "TPU plugin, or pass --small to check the script on a CPU\n"
    )
    assert not list(tmp_path.iterdir())


def test_error_text_survives_an_empty_message():
    """``str(e).splitlines()[0]`` raised IndexError on an empty message, ending the run."""
    sys.path.insert(0, str(ROOT))
    from bench import common

    assert common.error_text(MemoryError()) == "MemoryError: (no message)"
    assert common.error_text(RuntimeError("RESOURCE_EXHAUSTED: 2 GiB\nmore")) == (
        "RuntimeError: RESOURCE_EXHAUSTED: 2 GiB"
    )


def test_an_unmeasured_load_is_null_not_idle():
    """Without /proc the load check measured nothing, yet run.py wrote shared_cores false."""
    sys.path.insert(0, str(ROOT))
    from bench import common

    assert common.other_cores_busy(None, None) is None
    assert common.shared_cores(None) is None
    assert common.shared_cores(0.0) is False and common.shared_cores(1.5) is True
    assert common.any_shared(None, False) is None and common.any_shared(False, None) is None
    assert common.any_shared(None, True) is True and common.any_shared(False, False) is False


def test_load_check_does_not_count_this_process():
    sys.path.insert(0, str(ROOT))
    from bench import common

    before = common.cpu_snapshot()
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:  # one core busy, in this process
        pass
    after = common.cpu_snapshot()
    assert after["own"] > before["own"]  # counted as this process's, not as other load
    assert common.other_cores_busy(before, after) <= os.cpu_count()
    check = common.load_check(0.5)
    assert set(check) >= {"other_cores_busy", "shared", "threshold_cores"}


def test_a_standalone_benchmarks_json_records_its_command_and_load(tmp_path):
    """pipeline_throughput.py and profile_step.py wrote no load check: their JSONs
    could only say "idle cores" in a typed note. Each records what run.py does."""
    proc = _run(["bench/profile_step.py", "--steps=1", f"--json={tmp_path / 'p.json'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["command"].startswith("python bench/profile_step.py --steps=1 --json=")
    assert set(record["load_check"]) >= {"other_cores_busy", "shared", "threshold_cores"}
    assert record["other_cores_busy"] >= 0 and record["shared_cores"] in (True, False)
    assert record["shared_cores"] == (
        record["load_check"]["shared"]
        or record["other_cores_busy"] > record["load_check"]["threshold_cores"]
    )


def test_the_block_scans_profile_names_what_each_operation_computes(tmp_path, capsys):
    """``--program scan`` profiles the evaluation xpos_overhead times, and the JSON says
    which JAX operation each fused operation came from (the fusions' names alone do not)."""
    from bench import profile_step

    out = tmp_path / "p.json"
    argv = ["--program", "scan", "--steps", "1", "--top", "500", "--json", str(out)]
    assert profile_step.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["program"] == "scan" and record["steps"] == 1
    top = record["top"]
    assert [t["name"] for t in top] == list(record["by_name"])[: len(top)]
    # The scan's loop body runs every layer's attention; its matmuls are float32 arrays.
    sources = {t["source"] for t in top}
    assert any("while/body" in s and "layer_0/attention" in s for s in sources), sources
    matmuls = [t for t in top if t["kind"] == "matmul"]
    assert matmuls and all(t["shape"].startswith("f32[") for t in matmuls)
    assert "1 scan steps" in capsys.readouterr().out


def test_the_rotation_layout_benchmark_times_both_layouts_and_records_its_run(tmp_path, capsys):
    module = programs.load_script("bench/rotation_layout.py")
    out = tmp_path / "r.json"
    assert module.main(["--rounds", "1", "--json", str(out)]) == 0
    record, printed = json.loads(out.read_text()), capsys.readouterr().out
    for T in module.LENGTHS:
        row = record[f"tokens_{T}"]
        assert set(row["us_per_call"]) == {"interleaved", "halves", "scale_only"}
        assert all(v["median"] > 0 for v in row["us_per_call"].values())
        assert row["interleaved_over_halves"]["median"] > 0
        assert f"{T:5d} tokens: interleaved " in printed
    assert set(record) >= {"machine", "command", "load_check", "shared_cores"}
    with pytest.raises(SystemExit):
        module.main(["--rounds", "0"])


def test_the_quartiles_of_two_rounds_lie_between_them():
    """--quick runs 2 rounds, whose quartiles fell outside their min-max."""
    from bench import common

    summary = common.Summary.of([1.0, 2.0])
    assert summary.min <= summary.q25 <= summary.median <= summary.q75 <= summary.max


def test_the_accelerators_matmul_peak_multiplies_random_operands(monkeypatch):
    """All-ones operands: a GPU runs constant data at higher clocks (less power), so
    the measured peak was above what a train step can reach."""
    import jax
    import numpy as np

    from bench import accelerator

    seen, jit = [], jax.jit

    def spy(fn, **kwargs):
        compiled = jit(fn, **kwargs)
        return lambda x: (seen.append(np.asarray(x, np.float32)), compiled(x))[1]

    monkeypatch.setattr(jax, "jit", spy)
    assert accelerator.matmul_peak(64) > 0
    assert seen and all(np.unique(x).size > 64 for x in seen)


def _stub_eval_scalings_model(monkeypatch) -> None:
    """eval_scaling without its model: the tiny config, and a compiled function of the
    tokens alone standing in for each mode's scoring (its timings are stubbed too)."""
    import jax
    import jax.numpy as jnp

    from bench import common, eval_scaling

    config = common.tiny_config()
    monkeypatch.setattr(eval_scaling, "_model_and_params", lambda: (config, None, {}))
    scores = jax.jit(lambda params, tokens: tokens[:, 1:].astype(jnp.float32))
    monkeypatch.setattr(eval_scaling, "_function", lambda mode, model, block: scores)


def test_the_headline_ratios_are_medians_of_per_round_ratios(monkeypatch):
    """train_vs_reference, xpos_overhead and eval_scaling give under ``value`` (with its
    ``unit``) the median over rounds of each round's ratio, its sides timed in the same
    round: worked out by hand on timings where a ratio of the medians, or a mean,
    differs. The timings are stubbed: what is checked is what is made of them."""
    sys.path.insert(0, str(ROOT))
    import types

    from bench import common, eval_scaling, run, train_vs_reference, xpos_overhead

    # The JSON keys of bench/run.py, which docs/benchmarks.md and older JSONs name.
    assert {"train_vs_reference", "xpos_overhead", "eval_scaling"} <= set(run.BENCHMARKS)
    timings = []  # per call of alternate(): every side's seconds per round
    monkeypatch.setattr(common, "alternate", lambda sides, rounds, **_: timings.pop(0))
    no_options = types.SimpleNamespace(compiler_options={})
    monkeypatch.setattr(common, "train_timer", lambda *a, **k: (no_options, lambda: 0.0))
    args = types.SimpleNamespace(quick=True, reference_python=None, threads=2)

    # XPOS over none per round in the train step: +10%, −10%, +20% (median +10%; the
    # medians, 1.8 / 2: −10%); in the block scan +5% each.
    others = dict(rope=[1.0] * 3, alibi=[1.0] * 3)
    timings.append(dict(none=[1.0, 2.0, 3.0], xpos=[1.1, 1.8, 3.6], **others))
    timings.append(dict(none=[1.0] * 3, xpos=[1.05] * 3, **others))
    monkeypatch.setattr(xpos_overhead, "_eval_timer", lambda *a: lambda: 0.0)
    entry = xpos_overhead.run(args)
    assert entry["value"] == pytest.approx(10.0)
    assert entry["eval_overhead_percent"] == pytest.approx(5.0)
    assert entry["unit"] == "% slower than position=none (train step)"
    assert entry["met"] is False

    # lexjax's tokens/s over torchscale's per round: f32 6.0, 0.8, 0.75 (median 0.8;
    # the medians, 3.0 / 2.5: 1.2; the rounds sorted first: 1.5); bf16 0.5, 1/6, 0.25
    # (median 0.25). The faster dtype is the headline.
    class Reference:
        info = {}

        def __init__(self, python, settings):
            pass

        def close(self):
            pass

    monkeypatch.setattr(train_vs_reference, "resolve_python", lambda requested: "python")
    monkeypatch.setattr(train_vs_reference, "Reference", Reference)
    monkeypatch.setattr(train_vs_reference, "loss_curves", lambda steps, model: {})
    timings.append(
        dict(
            reference=[6.0, 2.0, 3.0],
            lexjax_float32=[1.0, 2.5, 4.0],
            lexjax_bfloat16=[12.0, 12.0, 12.0],
        )
    )
    entry = train_vs_reference.run(args)
    assert (entry["value"], entry["best"]) == (pytest.approx(0.8), "lexjax_float32")
    assert entry["ratio"]["lexjax_bfloat16"]["median"] == pytest.approx(0.25)
    assert entry["unit"] == "× reference tokens/s" and entry["met"] is False

    # The block scan's tokens/s at 8× over 2× per round: 2048/4 over 512/1, then 2048/4
    # over 512/2: 1.0 and 2.0, median 1.5 (a ratio of the medians, 512 / 384: 1.33).
    _stub_eval_scalings_model(monkeypatch)
    timings.append({512: [1.0, 2.0], 2048: [4.0, 4.0]})
    entry = eval_scaling.run(args)
    assert entry["value"] == pytest.approx(1.5)
    assert entry["unit"] == "× tokens/s at 8× vs 2× train_len (bca_scan)"
    assert timings == []


def test_eval_scalings_ratio_takes_the_longest_length_the_caps_let_run(monkeypatch):
    """A machine slow enough that the time cap skips the longest block scan gets the
    ratio at the longest length measured, named in the unit (it was a KeyError after
    every measurement); with only the shortest left, one line says there is no ratio."""
    sys.path.insert(0, str(ROOT))
    import types

    from bench import common, eval_scaling

    _stub_eval_scalings_model(monkeypatch)
    monkeypatch.setattr(eval_scaling, "_rss", lambda mode, length: 0)
    monkeypatch.setattr(eval_scaling, "MULTIPLES", (2, 8, 32))
    # First calls: the scan at 512 tokens takes 1 s, at 2048 20 s, so 8192 would take
    # ~80 s > the 60 s cap and is skipped; every later call 1 s.
    first_calls = [1.0, 20.0]
    monkeypatch.setattr(common, "timed", lambda fn: first_calls.pop(0) if first_calls else 1.0)
    measured = {512: [1.0, 1.0], 2048: [2.0, 8.0]}  # per round: 2.0 and 0.5, median 1.25
    monkeypatch.setattr(common, "alternate", lambda timers, rounds, **_: measured)
    args = types.SimpleNamespace(quick=False)
    entry = eval_scaling.run(args)
    assert "skipped" in entry["points"]["bca_scan"]["8192"]
    assert entry["value"] == pytest.approx(1.25)
    assert entry["unit"] == "× tokens/s at 8× vs 2× train_len (bca_scan)"

    # The time cap of --quick (10 s) skips 2048 after a 20 s first call at 512.
    monkeypatch.setattr(common, "timed", lambda fn: 20.0)
    monkeypatch.setattr(common, "alternate", lambda timers, rounds, **_: {512: [1.0, 1.0]})
    with pytest.raises(eval_scaling.TooFewLengths, match="^the block scan ran at 512 tokens only"):
        eval_scaling.run(types.SimpleNamespace(quick=True))
    # Nothing run at all (every length over the memory cap): said so, not max() of nothing.
    monkeypatch.setattr(eval_scaling, "MEMORY_CAP", 0)
    monkeypatch.setattr(common, "alternate", lambda timers, rounds, **_: {})
    with pytest.raises(eval_scaling.TooFewLengths, match="^the block scan ran at no length"):
        eval_scaling.run(types.SimpleNamespace(quick=True))
    assert eval_scaling.TooFewLengths in eval_scaling.EXPECTED_ERRORS  # run.py: one line


def test_other_processes_load_is_the_busy_time_less_this_process_tree(monkeypatch):
    """By hand: 600 busy jiffies of 1000, 400 of them this process's (and its
    children's), on 4 cores: other processes kept 0.8 cores busy."""
    sys.path.insert(0, str(ROOT))
    from bench import common

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    before = {"total": 1000, "busy": 300, "own": 100, "time": 0.0}
    after = {"total": 2000, "busy": 900, "own": 500, "time": 1.0}
    assert common.other_cores_busy(before, after) == pytest.approx(0.8)
    assert common.other_cores_busy(before, before) is None  # no time passed
