"""eval.py on a tiny trained workdir: outputs, schema, and one-line errors."""

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from unittest import mock

import numpy as np
import orbax.checkpoint as ocp
import pytest

from lexjax import checkpoint, evaluation, reports
from tests.processes import ELEMENTAL_EMITTERS, interruptible, kill, make_read_only, tmpfs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config=configs/tiny.py",
    "--config.model.num_layers=1",
    "--config.model.d_model=32",
    "--config.model.num_heads=2",
    "--config.model.mlp_dim=64",
    "--config.train_len=32",
    "--config.batch_size=2",
    "--config.num_train_steps=2",
    "--config.eval_batches=1",
    "--config.data.shuffle_rows=64",  # the default 1,024 rows: ~0.7 s more per run
]


def _env(**environ) -> dict:
    """The environment of an eval.py child: one CPU device (no simulated ones), XLA's
    default optimization level (see tests/conftest.py) with the element-wise emitters
    (tests/processes.py; with them this file's tests took 242.2 s of user time instead of
    265.4 s)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **environ)
    env.pop("XLA_FLAGS", None)
    if ELEMENTAL_EMITTERS:
        env["XLA_FLAGS"] = ELEMENTAL_EMITTERS
    return env


def _run(script, *args, **environ):
    env = _env(**environ)
    return subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("run"))
    done = _run("train.py", *TINY, f"--workdir={path}")
    assert done.returncode == 0, done.stderr[-2000:]
    return path


def test_eval_writes_the_table_json_and_figures(workdir, tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"doc{i}.txt").write_text("lexjax " * (20 + 5 * i))  # 142+ tokens
    first = [f"--workdir={workdir}", f"--eval_files={texts}/*.txt", "--max_length=128"]
    done = _run("eval.py", *first, "--lengths=32,48,64,128", "--resolution", "--figure")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[0] == "mesh {'data': 1, 'fsdp': 1, 'tensor': 1}"
    assert "| xpos with BCA |" in done.stdout and "| xpos without BCA |" in done.stdout
    # 48 does not divide the budget: a missing cell with its reason, not fewer tokens.
    assert "— bca 48: length 48 does not divide the budget of 128 tokens" in done.stdout
    assert "every cell: 3 documents × the first 128 tokens = 384 scored tokens" in done.stdout
    # stderr is not a terminal here: progress comes as plain lines, not a redrawn bar.
    assert re.search(r"^tokens \d+/\d+ ", done.stderr, re.M) and "\r" not in done.stderr
    eval_dir = os.path.join(workdir, "eval")
    with open(os.path.join(eval_dir, "perplexity.json")) as f:
        summary = json.load(f)
    assert summary["train_len"] == 32 and summary["max_length"] == 128
    assert summary["format"] == 1  # REPORT_FORMAT, first in the file
    assert next(iter(summary)) == "format"
    rows = summary["results"]
    assert {(r["mode"], r["length"]) for r in rows} == {
        (m, n) for m in ("bca", "full") for n in (32, 64, 128)
    }
    assert {(m["mode"], m["length"]) for m in summary["missing"]} == {("bca", 48), ("full", 48)}
    for r in rows:
        assert isinstance(r["perplexity"], float) and r["perplexity"] > 1
        assert r["tokens"] == 3 * 128 and r["documents"] == 3 and r["max_length"] == 128
    with open(os.path.join(eval_dir, "resolution.json")) as f:
        resolution = json.load(f)
    assert resolution["format"] == 1
    assert {(r["mode"], r["length"]) for r in resolution["results"]} == {
        (m, n) for m in ("bca", "full") for n in (32, 64)
    }
    assert resolution["missing"] == []  # as perplexity.json's: what could not be measured
    for name in ("perplexity.png", "expectation.png"):
        assert os.path.getsize(os.path.join(eval_dir, name)) > 0

    # A second run with other settings: a length asked alone gives the same number,
    # perplexity.json is that run's, and the first run's results stay under their name.
    done = _run("eval.py", *first, "--lengths=32", "--bca=on")
    assert done.returncode == 0, done.stderr[-2000:]
    with open(os.path.join(eval_dir, "perplexity.json")) as f:
        alone = json.load(f)
    assert [(r["mode"], r["length"]) for r in alone["results"]] == [("bca", 32)]
    bca32 = next(r for r in rows if (r["mode"], r["length"]) == ("bca", 32))
    assert alone["results"][0]["perplexity"] == pytest.approx(bca32["perplexity"], rel=1e-6)
    kept = sorted(f for f in os.listdir(eval_dir) if re.match(r"perplexity-.+\.json$", f))
    assert len(kept) == 2, kept
    assert any("bca+full" in f for f in kept) and any("-bca-" in f for f in kept)
    for name in kept:
        assert os.path.exists(os.path.join(eval_dir, name[: -len(".json")] + ".png"))
    with open(os.path.join(eval_dir, next(f for f in kept if "bca+full" in f))) as f:
        assert json.load(f)["results"] == rows

    # Sinks + window: up to train_len nothing is evicted, so it equals the dense number.
    done = _run("eval.py", *first, "--lengths=32,64", "--modes=sinks", "--sinks=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| xpos with sinks + window |" in done.stdout
    assert "the first 2 tokens of its segment and its 30 most recent" in done.stdout
    with open(os.path.join(eval_dir, "perplexity.json")) as f:
        sinks = json.load(f)
    assert sinks["sinks"] == 2 and sinks["settings"]["sinks"] == 2
    assert [(r["mode"], r["length"]) for r in sinks["results"]] == [("sinks", 32), ("sinks", 64)]
    full32 = next(r for r in rows if (r["mode"], r["length"]) == ("full", 32))
    assert sinks["results"][0]["perplexity"] == pytest.approx(full32["perplexity"], rel=1e-5)
    assert any("-sinks-" in f for f in os.listdir(eval_dir))

    # Other text under the same settings (a file edited): another name. It wrote over
    # the earlier file, whose name promised "the same settings give the same numbers".
    (texts / "doc0.txt").write_text("other " * 40)
    done = _run("eval.py", *first, "--lengths=32", "--bca=on")
    assert done.returncode == 0, done.stderr[-2000:]
    bca_only = sorted(
        f for f in os.listdir(eval_dir) if re.match(r"perplexity-.+-bca-.+\.json$", f)
    )
    assert len(bca_only) == 2, bca_only
    written = []
    for name in bca_only:
        with open(os.path.join(eval_dir, name)) as f:
            written.append(json.load(f))
    assert alone in written  # the first text's file, kept whole
    digests = {w["settings"]["scored_sha256"] for w in written}
    assert len(digests) == 2 and len({w["results"][0]["perplexity"] for w in written}) == 2

    done = _run(
        "eval.py",
        f"--workdir={workdir}",
        "--generate",
        "--prompt=def ",
        "--max_new_tokens=40",
        "--temperature=0",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("def ")


def test_a_closed_stderr_is_dev_null_not_stdout_or_the_next_file(workdir):
    """``eval.py --generate 2>&-``: Python's ``print(file=None)`` wrote the mesh line,
    or the ``error:`` line, into the generated text on stdout; and the first file the
    program opened became descriptor 2, where XLA's C++ code writes."""

    def closed_stderr(*argv):  # the shell closes it: no preexec_fn, no fork in this process
        return subprocess.run(
            ["sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, *argv],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
            timeout=300,
        )

    flags = [f"--workdir={workdir}", "--generate", "--prompt=def ", "--max_new_tokens=4"]
    made = closed_stderr("eval.py", *flags)
    assert made.returncode == 0 and made.stdout.startswith("def "), made.stdout
    assert made.stdout.count("\n") == 1 and "mesh" not in made.stdout, made.stdout
    refused = closed_stderr("eval.py", f"--workdir={workdir}", "--generate", "--top_p=0")
    assert (refused.returncode, refused.stdout) == (2, "")
    # What a program's first call leaves: stderr is /dev/null, a file opened next is not
    # descriptor 2, and a printed error line goes there. (stdin and stdout closed too.)
    check = """if True:
        import os, sys
        from lexjax import errors
        errors.closed_std_streams_to_devnull()
        with open(os.devnull) as f:
            opened = f.fileno()
        print("error: x", file=sys.stderr)
        os.write(3, repr([os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)]).encode())
        os.write(3, f" {opened > 2} {sys.stderr is sys.__stderr__}".encode())
    """
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" 3>&1 <&- >&- 2>&-', "sh", sys.executable, "-c", check],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    assert done.stdout == f"{[os.devnull] * 3!r} True True", done.stdout


def test_generate_streams_its_text_and_ctrl_c_ends_it_with_a_newline(workdir, tmp_path):
    """The text comes while the model writes it; Ctrl-C then stops eval.py with one
    line and status 130, the text so far kept (and ended by a newline)."""
    env = _env()
    many = f"--max_new_tokens={2**24}"  # chunks of 1,024 tokens: minutes of them
    command = [sys.executable, "eval.py", f"--workdir={workdir}", "--generate", "--prompt=ab", many]
    with (tmp_path / "stderr").open("wb") as stderr:  # a file: progress never blocks it
        proc = subprocess.Popen(
            interruptible([*command, "--temperature=0"]),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            bufsize=0,  # unbuffered: what read() does not return, communicate() does
        )
        got = b""
        try:
            while len(got) < 3 and (part := proc.stdout.read(3)):  # the prompt, then text
                got += part
        finally:
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
    err = (tmp_path / "stderr").read_bytes()
    err_lines = err.decode().strip().splitlines()
    # Ended by SIGINT, as Python ends on an uncaught Ctrl-C (status 130 in a shell).
    assert proc.returncode == -signal.SIGINT, err_lines[-5:]
    assert err_lines[-1] == "interrupted (Ctrl-C)" and "Traceback" not in err.decode()
    text = (got + out).decode(errors="replace")
    # Not the whole text written at the end: the run stopped long before its end.
    assert text.startswith("ab") and text.endswith("\n") and 4 < len(text) < 10**5
    # The text shown is what the model wrote: the start of an uninterrupted run's.
    whole = subprocess.run(
        [*command[:-1], f"--max_new_tokens={4 * len(text)}", "--temperature=0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr.decode()[-2000:]
    assert whole.stdout.decode(errors="replace").startswith(text[:-1])

    # A reader that goes away (`eval.py --generate | head -c 3`) ends the run quietly.
    with (tmp_path / "stderr").open("wb") as stderr:
        proc = subprocess.Popen(
            [*command, "--temperature=0"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr
        )
        try:
            proc.stdout.read(3)
        finally:
            proc.stdout.close()
            proc.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 141 and "Traceback" not in err and "Error" not in err, err[-2000:]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_a_ctrl_c_while_eval_py_loads_jax_ends_it_in_one_line(workdir, delay):
    """While eval.py imports JAX a KeyboardInterrupt could land inside an import (a
    segfault, a traceback, or an interrupt lost in a gc callback, the run going on):
    there a Ctrl-C ends it at once, as one does later. The signal is sent ``delay``
    seconds after jaxlib's library appears in the process's memory map."""
    env = _env()
    command = [sys.executable, "eval.py", f"--workdir={workdir}", "--generate"]
    proc = subprocess.Popen(
        interruptible([*command, "--max_new_tokens=100000"]),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/maps") as maps:
            if "jaxlib" in maps.read():
                break
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted (Ctrl-C)" and "Traceback" not in err, err


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_eval_py_started_with_ctrl_c_ignored_keeps_it_ignored(workdir):
    """A background job's eval.py (SIGINT ignored, ``nohup … &``) is not stopped by a
    Ctrl-C meant for the terminal's foreground program: not while it loads JAX, not
    while it generates."""
    many = f"--max_new_tokens={2**24}"  # greedy from "ab": minutes of text, as above
    command = [sys.executable, "eval.py", f"--workdir={workdir}", "--generate", "--prompt=ab"]
    proc = subprocess.Popen(
        interruptible([*command, many, "--temperature=0"], "SIG_IGN"),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/maps") as maps:
                if "jaxlib" in maps.read():  # exec'd into eval.py, SIGINT still ignored
                    break
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.read(1), "eval.py ended before it generated"
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        assert proc.stdout.read(20) and proc.poll() is None  # still generating
    finally:
        code, _, err = kill(proc, signal.SIGTERM)
    assert code == -signal.SIGTERM and "interrupted" not in err, err[-2000:]


def test_a_ctrl_c_ends_the_program_at_once_not_through_pythons_finalization():
    """Finalization ran while jaxlib's threads still compiled, and a Ctrl-C ended one
    eval.py in eight by SIGSEGV (loaded cores). The process now ends by SIGINT right
    after its line: an exit handler, as finalization's work, never runs."""
    program = textwrap.dedent(
        """
        import atexit, sys
        from lexjax import cli

        def program():
            atexit.register(lambda: print("finalized", flush=True))
            print("working", end="")  # buffered: still printed
            raise KeyboardInterrupt

        sys.exit(cli.main(program))
        """
    )
    done = subprocess.run(
        interruptible([sys.executable, "-c", program]),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGINT, done.stderr[-2000:]
    assert (done.stdout, done.stderr) == ("working", "interrupted (Ctrl-C)\n")
    # Started without a stdout (`>&-`; sys.stdout is None): the same end, no traceback.
    closed = subprocess.run(  # the shell closes it: no preexec_fn, no fork in this process
        ["sh", "-c", 'exec "$@" >&-', "sh", *interruptible([sys.executable, "-c", program])],
        cwd=ROOT,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    assert closed.returncode == -signal.SIGINT, closed.stderr[-2000:]
    assert closed.stderr == "interrupted (Ctrl-C)\n"


def test_a_ctrl_c_a_callback_swallowed_still_ends_the_program():
    """Python only reports what a gc callback or ``__del__`` raises, and JAX's gc
    callback runs often: a Ctrl-C landing there was lost and eval.py went on (seen while
    it imported JAX). The programs' boundary raises it again in the main thread."""
    program = textwrap.dedent(
        """
        import sys, time
        from lexjax import cli

        class Swallowed:
            def __del__(self):
                raise KeyboardInterrupt  # as the Ctrl-C's, raised inside a callback

        def program():
            Swallowed()
            time.sleep(600)  # past the timeout: only the Ctrl-C ends it in time

        sys.exit(cli.main(program))
        """
    )
    env = _env()
    started = time.monotonic()
    done = subprocess.run(
        interruptible([sys.executable, "-c", program]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGINT, done.stderr[-2000:]
    assert done.stderr == "interrupted (Ctrl-C)\n" and time.monotonic() - started < 110


def _head_n_1(workdir, flags, stderr) -> subprocess.Popen:
    """eval.py on ``workdir`` whose stdout is closed after its first line, the mesh line,
    as ``eval.py | head -n 1`` closes it (``stderr``: where its stderr goes)."""
    argv = [sys.executable, "eval.py", f"--workdir={workdir}", *flags]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    assert proc.stdout.readline().startswith("mesh ")  # what `head -n 1` takes
    proc.stdout.close()
    return proc


@pytest.mark.parametrize(
    "kind, flags, written",
    [
        ("perplexity", ["--lengths=32", "--max_length=32"], "perplexity.json"),
        ("passkey", ["--passkey", "--lengths=96", "--passkey_depths=0"], "passkey.json"),
    ],
)
def test_a_stdout_closed_early_keeps_the_results(workdir, tmp_path, kind, flags, written):
    """`eval.py | head -n 1`: the tables were printed before the JSON was written, so the
    reader going away was a BrokenPipeError traceback, exit 1, and no results kept."""
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("eval"))
    more = ["--passkey_trials=1"] if kind == "passkey" else ["--max_docs=1"]
    proc = _head_n_1(copy, [*flags, *more], stderr=subprocess.PIPE)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 141 and "Traceback" not in err, err[-3000:]
    assert (copy / "eval" / written).is_file()


@pytest.mark.parametrize(
    "flags, written",
    [
        (["--lengths=32", "--max_length=32", "--max_docs=1"], "perplexity.json"),
        (["--generate", "--max_new_tokens=200"], None),
    ],
)
def test_a_merged_stderr_closed_early_ends_quietly_too(workdir, tmp_path, flags, written):
    """`eval.py 2>&1 | head -n 1`: the reader also of stderr went away, and the next
    progress line (or note) on it was a BrokenPipeError, exit 1, no results kept. The
    display and the notes are not the work: the run goes on, keeps its results and ends
    as with stdout alone closed (141)."""
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("eval"))
    assert _head_n_1(copy, flags, stderr=subprocess.STDOUT).wait(timeout=300) == 141
    if written:
        assert (copy / "eval" / written).is_file()


def test_generate_writes_its_text_where_stderr_cannot_take_the_mesh_line(workdir):
    """`eval.py --generate 2>/dev/full`: its mesh line goes to stderr, and a stderr that
    could not take it ended the run before any text, exit 1."""
    args = [f"--workdir={workdir}", "--generate", "--prompt=ab", "--max_new_tokens=3"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "eval.py", *args, "--temperature=0"],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=full,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0 and done.stdout.startswith("ab") and done.stdout.endswith("\n")


def test_a_stdout_that_cannot_take_the_tables_is_one_line(workdir, tmp_path):
    """`eval.py > /dev/full`: was an OSError traceback, exit 1. Its first line (the
    mesh) fails already, before any computation."""
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("eval"))
    args = [f"--workdir={copy}", "--lengths=32", "--max_length=32", "--max_docs=1"]
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "eval.py", *args],
            cwd=ROOT,
            env=_env(),
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert done.returncode == 6, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: cannot write to stdout (No space left on device); send it to a file or "
        "device with room"
    )


def test_eval_passkey_writes_the_json_heat_maps_and_tables(workdir):
    args = [f"--workdir={workdir}", "--passkey", "--lengths=32,96", "--passkey_depths=0,1"]
    done = _run("eval.py", *args, "--passkey_trials=2", "--seed=3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| xpos with BCA: depth | 32 | 96 |" in done.stdout
    assert "| xpos without BCA: depth | 32 | 96 |" in done.stdout
    assert "— full 32: length 32 is below the 69 tokens of the format" in done.stdout
    eval_dir = os.path.join(workdir, "eval")
    with open(os.path.join(eval_dir, "passkey.json")) as f:
        summary = json.load(f)
    assert summary["train_len"] == 32 and summary["seed"] == 3 and summary["format"] == 1
    assert [(r["mode"], r["length"], r["depth"], r["trials"]) for r in summary["results"]] == [
        (m, 96, d, 2) for m in ("bca", "full") for d in (0.0, 1.0)
    ]
    assert all(0 <= r["accuracy"] <= 1 for r in summary["results"])
    for mode in ("bca", "full"):
        assert os.path.getsize(os.path.join(eval_dir, f"passkey-{mode}.png")) > 0
    _one_line_error(_run("eval.py", *args, "--passkey_depths=2"), 2, "--passkey_depths")


_GREEDY = "--generate with --temperature=0 (greedy) does not use"


@pytest.mark.parametrize(
    "flags, message",
    [
        # Greedy decoding takes no chances: the sampling flags would change nothing.
        (dict(generate=True, temperature=0.0, top_k=5, seed=9), f"{_GREEDY} --top_k, --seed"),
        (dict(generate=True, temperature=0.0, top_p=0.5), f"{_GREEDY} --top_p"),
        (dict(generate=True, resolution=True), "--generate does not use --resolution"),
        (
            dict(passkey_run=True, temperature=0.5),
            "--passkey with --passkey_filler=repeat does not use --temperature",
        ),
        (
            dict(lengths=["32"], prompt="ab"),
            "eval.py without --generate or --passkey does not use --prompt",
        ),
    ],
)
def test_a_flag_the_run_would_ignore_is_refused_before_it_loads(tmp_path, flags, message):
    from lexjax import cli, generation
    from lexjax.errors import ConfigError

    them = "them" if "," in message else "it"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}; leave {them} out$"):
        cli.run_eval(str(tmp_path / "never-read"), **{**generation.SAMPLING, **flags})


def test_resolution_without_a_mode_it_measures_is_refused_before_it_loads(tmp_path):
    """`--resolution --modes=sinks`: refused only after the checkpoint had loaded, exit 6,
    though the flags alone contradict each other (exit 2, as a flag the run ignores).
    The API says the same with its own names, a ConfigError too."""
    from lexjax import cli, evaluation, generation, make_config
    from lexjax.errors import ConfigError

    message = (
        "--resolution is measured in bca or full mode, which --modes=sinks leaves out; "
        "add one or leave --resolution out"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        cli.run_eval(
            str(tmp_path / "never-read"), modes=["sinks"], resolution=True, **generation.SAMPLING
        )
    api = message.replace("--", "")
    with pytest.raises(ConfigError, match=f"^{re.escape(api)}$"):
        evaluation.evaluate_run(
            make_config({"train_len": 32}), None, 0, str(tmp_path), modes=["sinks"], resolution=True
        )
    # With a mode it measures beside sinks, nothing is refused before the run loads.
    assert evaluation.check_modes(["sinks", "full"], resolution=True) == ("sinks", "full")


def test_passkey_and_generate_modes_name_only_the_modes_they_decode_in(tmp_path):
    """`--passkey --modes=dense` suggested sinks, which passkey then refused; so did
    `--generate --modes=dense`. Each names its run, as test_fuzz.py asks of each flag."""
    from lexjax import cli, generation
    from lexjax.errors import ConfigError

    for run, flag in (("--passkey", {"passkey_run": True}), ("--generate", {"generate": True})):
        for mode in ("dense", "sinks"):
            message = f"^--modes={mode}: use some of bca, full with {run}$"
            with pytest.raises(ConfigError, match=message):
                cli.run_eval(str(tmp_path), modes=[mode], **flag, **generation.SAMPLING)


def _one_line_error(done, code, *fragments):
    assert done.returncode == code, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0]


def test_resolution_files_are_named_by_what_they_measured(workdir, tmp_path):
    """Two resolution runs over different documents (--max_docs 1, then 2, with one
    document long enough for perplexity's budget) keep both settings-named files:
    the name counts resolution's own documents, not perplexity's."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "long.txt").write_text("lexjax " * 90)  # 631 tokens: perplexity (513) too
    (texts / "mid.txt").write_text("lexjax " * 15)  # 106 tokens: resolution's 64 only
    names = []
    # The third: perplexity's other lengths, resolution's same measurement (it was a
    # third copy, the name counting lengths and sinks resolution does not measure).
    for docs, lengths in ((1, 32), (2, 32), (1, 16)):
        done = _run(
            "eval.py",
            f"--workdir={workdir}",
            f"--eval_files={texts}/*.txt",
            f"--lengths={lengths}",
            "--bca=on",
            "--resolution",
            f"--max_docs={docs}",
        )
        assert done.returncode == 0, done.stderr[-2000:]
        names.append(re.search(r"resolution-step[^ ,]+\.json", done.stdout).group(0))
        with open(os.path.join(workdir, "eval", names[-1])) as f:
            written = json.load(f)
        assert {r["documents"] for r in written["results"]} == {docs}
        # Which settings made it, as perplexity.json says (resolution.json did not).
        assert written["settings"]["documents"] == docs and "lengths" not in written["settings"]
    assert names[0] != names[1] and names[2] == names[0]


def test_eval_refuses_a_corpus_changed_since_training(tmp_path):
    """Three files are split within each file; with forty they are split by file, and
    a file whose first 90% was training text becomes test text. eval.py must not
    score the model on it: the run records the build it trained on."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "\n",
    ]

    def write(i, n):
        (corpus / f"book{i}.txt").write_text(" ".join(rng.choice(words, size=n)) + "\n")

    for i in range(3):
        write(i, 3000)
    data = [
        "--config.data.name=textfiles",
        f"--config.data.files={corpus}/*.txt",
        f"--config.data.data_dir={tmp_path / 'tfds'}",
    ]
    workdir = f"--workdir={tmp_path / 'run'}"
    done = _run("train.py", *TINY, *data, workdir)
    assert done.returncode == 0, done.stderr[-2000:]
    short = ["--lengths=32", "--max_length=32", "--modes=bca"]
    done = _run("eval.py", workdir, *short)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "textfiles test split" in done.stdout, done.stdout

    for i in range(3, 40):
        write(i, 300)
    done = _run("eval.py", workdir, *short)
    assert done.returncode == 3, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: the textfiles corpus changed since this run trained on it \(build "
        r"textfiles/\w+/[\d.]+ then, textfiles/\w+/[\d.]+ now\): its test split may hold "
        r"text the run trained on; restore the files, or evaluate on other text with "
        r"--eval_files",
        line,
    ), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_bad_input_is_one_line(workdir, tmp_path, program, capsys):
    import jax

    from lexjax import config as config_lib
    from lexjax.steps import TrainSetup

    def refused(*flags):
        """eval.py in this process (tests/programs.py): status "reached" if it went on
        to load the run, so a refusal here is one made before the run loads."""
        code, err = program("eval", [f"--workdir={workdir}", *flags], capsys)
        return types.SimpleNamespace(returncode=code, stderr=err)

    no_run = _run("eval.py", f"--workdir={tmp_path}")
    _one_line_error(
        no_run, 4, "no checkpoint", f"train first: python train.py --workdir={tmp_path}"
    )
    _one_line_error(refused("--lengths=64,0"), 2, "positive")
    _one_line_error(refused("--max_docs=0"), 2, "max_docs")
    _one_line_error(  # it was absl's tuple "('Non-boolean argument to boolean flag', 'no')"
        refused("--resolution=no"),
        2,
        "flag --resolution=no: a switch is true or false (--resolution, --noresolution or "
        "--resolution=false)",
    )
    _one_line_error(  # it was a ValueError traceback, exit 1
        refused("--noresolution=maybe"),
        2,
        "flag --noresolution=maybe: --noresolution takes no value; give --noresolution or "
        "--resolution=false",
    )
    _one_line_error(refused("--generate", "--top_p=0"), 2, "top_p")
    # Mode full cannot place XPOS positions that far: refused before the run loads (no
    # mesh line), naming the flags to change; it said "length 200003 …; use BCA".
    flags = ["--generate", "--bca=off", "--prompt=ab", "--max_new_tokens=200000"]
    far = _run("eval.py", f"--workdir={workdir}", *flags)
    _one_line_error(
        far,
        6,
        "--max_new_tokens=200000 after 3 prompt tokens without BCA: length 200003",
        "generate with --bca=on, or at most 66871 new tokens",
    )
    assert "mesh" not in far.stdout
    # Passkey settings generation cannot take are refused before the run loads: a
    # length past the host's samples, a mode it cannot decode in (was exit 6).
    huge = refused("--passkey", f"--lengths=64,{10**11}")
    _one_line_error(huge, 2, "--lengths=100000000000: give passkey lengths of at most 16,777,216")
    sinks = refused("--passkey", "--modes=bca,sinks")
    _one_line_error(sinks, 2, "--modes=bca,sinks: use some of bca, full with --passkey")
    # A prompt byte that is not UTF-8 (argv holds it as a lone surrogate); a terminal
    # that cannot show a character of the text gets "?" for it, not a traceback.
    bad = _run("eval.py", f"--workdir={workdir}", "--generate", "--prompt=a\udcff")
    _one_line_error(bad, 2, r"the prompt is not valid text: '\udcff' at character 1")
    shown = _run(
        "eval.py",
        f"--workdir={workdir}",
        "--generate",
        "--prompt=\u2713 ",
        "--max_new_tokens=4",
        PYTHONIOENCODING="latin-1",
    )
    assert shown.returncode == 0 and shown.stdout.startswith("? "), shown.stderr[-2000:]
    _one_line_error(
        _run("eval.py", f"--workdir={workdir}", f"--eval_files={tmp_path}/*.nope"),
        3,
        f"--eval_files='{tmp_path}/*.nope' matches no files",
    )
    short = tmp_path / "short.txt"
    short.write_text("x" * 50)
    _one_line_error(
        _run("eval.py", f"--workdir={workdir}", f"--eval_files={short}", "--lengths=32,64"),
        3,
        "budget of 512 tokens",
        f"(in 1 file of {short}: 1 document, the longest 52 tokens)",
        "--max_length=51",
    )
    # Resolution needs 2 × train_len tokens: refused before the perplexity run, not after.
    eval_dir = os.path.join(workdir, "eval")
    listing = lambda: {
        f: os.stat(os.path.join(eval_dir, f)).st_mtime_ns for f in os.listdir(eval_dir)
    }
    before = listing() if os.path.isdir(eval_dir) else None
    _one_line_error(
        _run(
            "eval.py",
            f"--workdir={workdir}",
            f"--eval_files={short}",
            "--lengths=16",
            "--max_length=32",
            "--resolution",
        ),
        3,
        "resolution needs documents of 64 tokens",
    )
    assert (listing() if os.path.isdir(eval_dir) else None) == before
    _one_line_error(refused("--lengths=32,64", "--max_length=48"), 2, "below")
    too_many = _run("eval.py", f"--workdir={workdir}", "--modes=sinks", "--sinks=17")
    _one_line_error(too_many, 2, "error: --sinks=17 must be an integer in [0, 16]")
    assert "mesh" not in too_many.stdout  # refused before the parameters were loaded
    # Before the parameters were loaded too, exit 2 (it was 6, after loading).
    unmeasured = _run("eval.py", f"--workdir={workdir}", "--modes=sinks", "--resolution")
    _one_line_error(unmeasured, 2, "--resolution is measured in bca or full mode")
    assert "mesh" not in unmeasured.stdout

    # A checkpoint whose stored config does not describe its arrays.
    stored = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    config_dict = stored.restore_config()
    stored.close()
    state = TrainSetup(config_lib.from_configdict(config_dict), jax.devices()[:1]).init_state()
    config_dict["model"]["d_model"] = 64
    other = tmp_path / "other"
    writer = checkpoint.Checkpointer(str(other / "checkpoints"))
    writer.save(1, state, config=config_dict)
    writer.close()
    _one_line_error(_run("eval.py", f"--workdir={other}"), 4, "different model shape")


FIXTURE = os.path.join(ROOT, "tests", "fixtures", "run_v1")


def _fixture_copy(tmp_path):
    """The pre-redesign tiny run (eval writes eval/ into its workdir, so a copy)."""
    path = tmp_path / "run_v1"
    shutil.copytree(FIXTURE, path)
    return path


def test_old_workdir_evaluates_to_the_same_numbers(tmp_path):
    """The checkpoint train.py wrote before the redesign gives the perplexity.json
    eval.py gave then (tests/fixtures/run_v1_perplexity.json)."""
    workdir = _fixture_copy(tmp_path)
    done = _run(
        "eval.py",
        f"--workdir={workdir}",
        "--eval_files=tests/fixtures/eval_text.txt",
        "--lengths=16,32,64,128",
        "--max_length=128",  # the budget the pre-redesign protocol took from the largest length
        "--bca=both",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with open(workdir / "eval" / "perplexity.json") as f:
        got = json.load(f)
    with open(os.path.join(ROOT, "tests", "fixtures", "run_v1_perplexity.json")) as f:
        want = json.load(f)
    assert got["train_len"] == want["train_len"]
    key = lambda r: (r["mode"], r["length"])
    assert sorted(map(key, got["results"])) == sorted(map(key, want["results"]))
    expected = {key(r): r for r in want["results"]}
    for r in got["results"]:
        w = expected[key(r)]
        assert (r["tokens"], r["documents"]) == (w["tokens"], w["documents"])
        # float32 sums: XLA's CPU kernels differ by processor (an AMD EPYC gave 1.4e-6
        # relative from the fixture's numbers); a protocol change (other tokens, budget
        # or positions) moves them by far more.
        for field in ("perplexity", "nll"):
            assert r[field] == pytest.approx(w[field], rel=1e-5), (key(r), field)


def test_a_rope_scaling_is_in_every_row_and_its_own_file(tmp_path):
    """eval.py --rope_scaling=yarn on the old xpos run: factor 0 is each length /
    train_len (32), recorded per row; the file is named after the scaling, so a
    later evaluation with another one (here through the API) leaves it in place."""
    workdir = _fixture_copy(tmp_path)
    text = "tests/fixtures/eval_text.txt"
    done = _run(
        "eval.py",
        f"--workdir={workdir}",
        f"--eval_files={text}",
        "--lengths=32,64",
        "--max_length=64",
        "--bca=off",
        "--rope_scaling=yarn",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| xpos+yarn without BCA |" in done.stdout
    eval_dir = workdir / "eval"
    pattern = r"perplexity-step6-full-budget64-yarn-[0-9a-f]{8}\.json"
    (named,) = [f for f in os.listdir(eval_dir) if re.fullmatch(pattern, f)]
    with open(eval_dir / named) as f:
        yarn = json.load(f)
    assert yarn["settings"]["rope_scaling"] == "yarn" and yarn["settings"]["rope_factor"] == 0
    assert yarn["rope_scaling"] == "yarn"
    rows = {r["length"]: r for r in yarn["results"]}
    assert {(n, r["rope_scaling"], r["rope_factor"]) for n, r in rows.items()} == {
        (32, "yarn", 1.0),
        (64, "yarn", 2.0),
    }

    import lexjax

    run = lexjax.load(workdir)
    (pi,) = run.evaluate(
        [64], max_length=64, modes=("full",), eval_files=text, rope_scaling="pi", rope_factor=2
    )
    assert (pi.rope_scaling, pi.rope_factor) == ("pi", 2.0)
    assert pi.perplexity != pytest.approx(rows[64]["perplexity"], rel=1e-4)
    kept = sorted(f for f in os.listdir(eval_dir) if re.match(r"perplexity-.+\.json$", f))
    assert len(kept) == 2 and named in kept and any("-budget64-pi2-" in f for f in kept), kept


def test_a_run_trained_with_a_rope_scaling_is_labelled_and_named_by_it(tmp_path):
    """Without --rope_scaling the run's own scaling ran and every row said so, but the
    table's label, the file name and the JSON's top level said there was none."""
    import lexjax

    workdir = _fixture_copy(tmp_path)
    run = lexjax.load(workdir)
    yarn = dataclasses.replace(run.config.model, rope_scaling="yarn", rope_factor=2.0)
    kwargs = dict(
        lengths=[64],
        max_length=64,
        modes=("full",),
        eval_files="tests/fixtures/eval_text.txt",
        tokenizer=run.tokenizer,
        say=lambda _: None,
    )
    evaluate = functools.partial(evaluation.evaluate_run, params=run.params, step=run.step)
    (own,), written = evaluate(
        dataclasses.replace(run.config, model=yarn), workdir=workdir, **kwargs
    )
    name = re.compile(r"perplexity-step6-full-budget64-yarn2-[0-9a-f]{8}\.json$")
    (named,) = [p for p in written if name.search(p)]
    with open(named) as f:
        saved = json.load(f)
    assert (saved["rope_scaling"], saved["settings"]["rope_factor"]) == ("yarn", 2.0)
    assert (own.rope_scaling, own.rope_factor) == ("yarn", 2.0)
    # The same as asking for that scaling of the unscaled run: one file, one number.
    other = tmp_path / "asked"
    shutil.copytree(workdir, other)
    (asked,), again = evaluate(
        run.config, workdir=other, rope_scaling="yarn", rope_factor=2.0, **kwargs
    )
    assert [os.path.basename(p) for p in again if name.search(p)] == [os.path.basename(named)]
    assert asked.perplexity == own.perplexity


def _tamper_integrity(workdir, leaf_prefix):
    """Changes the recorded checksum of the first leaf whose name starts with
    ``leaf_prefix``: any reader that checks that leaf finds it damaged."""
    path = workdir / "checkpoints" / "6" / "integrity" / "metadata"
    record = json.loads(path.read_text())
    name = next(n for n in record["leaves"] if n.startswith(leaf_prefix))
    record["leaves"][name]["sha256"] = "0" * 64
    if "self_sha256" in record:  # the leaf is damaged, not the record: sealed again
        record["self_sha256"] = checkpoint._record_sha256(record)
    path.write_text(json.dumps(record))
    return name


def test_evaluation_reads_and_verifies_only_the_parameters(tmp_path, monkeypatch):
    workdir = _fixture_copy(tmp_path)
    # The optimizer moments' checksums are wrong: the full restore would call
    # the step damaged; reading parameters alone does not touch them.
    _tamper_integrity(workdir, ".opt_state")
    read = []
    restore = ocp.PyTreeCheckpointHandler.restore

    def spy(self, *args, **kwargs):
        tree = restore(self, *args, **kwargs)
        read.append(tree)
        return tree

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", spy)
    config, params, step = checkpoint.load_params(workdir)
    assert step == 6 and config.train_len == 32
    assert [set(tree) for tree in read] == [{"params"}]  # no opt_state, no step
    assert params["embed"]["embedding"].shape == (320, 16)

    # A parameter's checksum is checked: with the older step damaged too (a copy of
    # step 6 as step 4, its integrity record garbled), nothing good is left.
    damaged = _fixture_copy(tmp_path / "damaged")
    shutil.copytree(damaged / "checkpoints" / "6", damaged / "checkpoints" / "4")
    (damaged / "checkpoints" / "4" / "integrity" / "metadata").write_text("{garbled")
    _tamper_integrity(damaged, ".params")
    # The error line says why the newest is damaged (it was only in a warning line).
    said = r"every step is damaged \(step 6, the newest: [^)]*checksum.*\); restore them from a "
    with pytest.raises(
        checkpoint.CheckpointError, match=f"{said}copy, or move the workdir {damaged} "
    ):
        checkpoint.load_params(damaged)
    # Its only step damaged: that step, and "it" (it was "every step … restore them").
    shutil.rmtree(damaged / "checkpoints" / "4")
    said = r"its only step is damaged \(step 6: [^)]*checksum.*\); restore it from a copy, "
    with pytest.raises(checkpoint.CheckpointError, match=said):
        checkpoint.load_params(damaged)


def test_a_sentencepiece_run_evaluates_and_generates_with_its_own_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "a",
        "length",
        "extrapolates",
    ]
    rng = np.random.default_rng(0)
    for i in range(3):
        lines = [" ".join(rng.choice(words, 12)) for _ in range(150)]
        (corpus / f"book{i}.txt").write_text("\n".join(lines) + "\n")
    workdir, data_dir = tmp_path / "run", tmp_path / "tfds"
    data = [
        "--config.data.name=textfiles",
        f"--config.data.files={corpus}/*.txt",
        f"--config.data.data_dir={data_dir}",
        "--config.data.tokenizer=sentencepiece",
        "--config.data.vocab_size=300",
    ]
    done = _run("train.py", *TINY, *data, f"--workdir={workdir}")
    assert done.returncode == 0, done.stderr[-2000:]

    held_out = tmp_path / "other.txt"
    held_out.write_text("a lazy fox extrapolates over the quick dog\n" * 40)
    done = _run(
        "eval.py",
        f"--workdir={workdir}",
        f"--eval_files={held_out}",
        "--lengths=32,64",
        "--max_length=128",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bits per byte (sentencepiece (300 ids) tokens" in done.stdout
    with open(workdir / "eval" / "perplexity.json") as f:
        rows = json.load(f)["results"]
    tok = checkpoint.load_tokenizer(workdir)
    scored = tok.encode_document(held_out.read_bytes())[1 : rows[0]["max_length"] + 1]
    assert tok.kind == "sentencepiece" and len({r["bytes"] for r in rows}) == 1
    assert rows[0]["bytes"] == len(tok.decode(scored).encode())  # the text those tokens spell
    for r in rows:
        assert r["bits_per_byte"] == pytest.approx(
            r["nll"] * r["tokens"] / (np.log(2) * r["bytes"]), rel=1e-6
        )

    done = _run("eval.py", f"--workdir={workdir}", "--generate", "--prompt=the ", "--temperature=0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("the ") and "\ufffd" not in done.stdout

    # The corpus build now holds another tokenizer than the run's: refused in one line.
    (model_file,) = data_dir.glob("textfiles/*/*/sentencepiece-300.model")
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text((corpus / "book0.txt").read_text().upper())
    from lexjax import data as data_lib

    retrained = data_lib.load_tokenizer(
        "sentencepiece", 300, "textfiles", tmp_path / "t2", str(other / "*.txt")
    )
    model_file.write_bytes(retrained.model_proto)
    _one_line_error(
        _run("eval.py", f"--workdir={workdir}"),
        3,
        f"sentencepiece (300 ids, {retrained.fingerprint[:8]}) tokenizer other than the "
        f"sentencepiece (300 ids, {tok.fingerprint[:8]}) one",
    )


def test_a_workdir_eval_cannot_write_to_is_one_line_before_any_computation(workdir, tmp_path):
    """A read-only workdir (a tmpfs remounted read-only; a chmod for a non-root user):
    eval.py says so, exit 4, before it computes what it could not keep."""
    with tmpfs(tmp_path / "ro", "4m") as mount:
        copy = (mount or tmp_path / "ro") / "run"
        shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("eval", "lease.json"))
        make_read_only(mount, copy)
        for more in (["--max_docs=1"], ["--passkey", "--lengths=96"]):
            done = _run("eval.py", f"--workdir={copy}", *more)
            # Notes on the documents chosen may come first; the error is the one last line.
            errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
            assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr[-2000:]
            assert errors == done.stderr.strip().splitlines()[-1:], done.stderr[-2000:]
            assert f"cannot write {copy / 'eval'}" in errors[0], errors
            assert "make its directory writable" in errors[0], errors
            assert errors[0].endswith(  # the way that works for a run one cannot write
                f"eval.py has no --out_dir: from Python, lexjax.load('{copy}').evaluate(…) and "
                ".passkey(…) take out_dir=DIR"
            ), errors
            assert "perplexity of" not in done.stdout and "passkey retrieval" not in done.stdout
        assert not (copy / "eval").exists()


def test_a_read_only_run_is_evaluated_into_another_directory(tmp_path):
    """A run on read-only storage (someone else's, shared) could not be evaluated
    through the API: every report went to WORKDIR/eval. ``out_dir`` takes them."""
    import lexjax
    from lexjax.errors import CheckpointError, ConfigError

    out, text = tmp_path / "reports", os.path.join(ROOT, "tests", "fixtures", "eval_text.txt")
    with tmpfs(tmp_path / "ro", "4m") as mount:
        run = (mount or tmp_path / "ro") / "run_v1"
        shutil.copytree(FIXTURE, run)
        make_read_only(mount, run)
        loaded = lexjax.load(str(run))
        with pytest.raises(CheckpointError, match=f"cannot write {run / 'eval'}"):
            loaded.evaluate([16], max_length=32, eval_files=text)
        kept = loaded.evaluate([16], max_length=32, eval_files=text, out_dir=out)
        keys = loaded.passkey([96], depths=[0.5], trials=1, modes=["bca"], out_dir=str(out))
        assert not (run / "eval").exists()
    assert kept and keys
    assert json.loads((out / "perplexity.json").read_text())["results"][0]["length"] == 16
    assert json.loads((out / "passkey.json").read_text())["results"][0]["length"] == 96
    with pytest.raises(ConfigError, match="^out_dir is empty; give a path"):
        loaded.evaluate([16], max_length=32, out_dir=" ")
    # A file, or a place among the run's steps (its listing is the run's checkpoints).
    with pytest.raises(ConfigError, match=r"^out_dir=.*perplexity.json is a file; give a dir"):
        loaded.evaluate([16], max_length=32, out_dir=out / "perplexity.json")
    with pytest.raises(ConfigError, match=r"perplexity.json is a file; give a dir"):  # further up
        loaded.evaluate([16], max_length=32, out_dir=out / "perplexity.json" / "sub")
    (tmp_path / "link").symlink_to(run / "checkpoints")  # the checkpoints under another name
    for inside in (run / "checkpoints", run / "checkpoints" / "mine", tmp_path / "link" / "mine"):
        with pytest.raises(ConfigError, match="is inside the run's checkpoints"):
            loaded.passkey([96], out_dir=inside)


def test_a_full_disk_while_writing_a_report_is_one_line_and_leaves_no_tmp(tmp_path):
    from lexjax import reports
    from lexjax.errors import CheckpointError

    with tmpfs(tmp_path / "full", "64k") as mount:
        if mount is None:
            pytest.skip("needs a tmpfs (root with mount rights)")
        with open(mount / "filler", "wb") as f, contextlib.suppress(OSError):
            f.write(b"x" * (1 << 20))
        path = mount / "eval" / "perplexity.json"
        with pytest.raises(CheckpointError, match="No space left on device") as error:
            reports.write_json(str(path), {"results": ["x" * 100_000]})
        assert "\n" not in str(error.value) and not list(path.parent.glob("*.tmp"))


_FRESH_TMP = reports._fresh_tmp


def _full_disk_at(monkeypatch, path):
    """The write of report ``path`` goes to /dev/full (no space left): its temporary
    file is a link there, made after reports removed whatever was at its name. The
    latest call's path only."""
    real = _FRESH_TMP

    def fresh(at):
        tmp = real(at)
        if os.path.abspath(at) == os.path.abspath(path):
            os.remove(tmp)
            os.symlink("/dev/full", tmp)
        return tmp

    monkeypatch.setattr(reports, "_fresh_tmp", fresh)


def test_a_report_cut_off_shows_its_results_and_keeps_the_latest_pair_whole(
    workdir, tmp_path, capsys, monkeypatch
):
    """A full disk while eval.py wrote its reports lost what it had computed (the tables
    were printed only after the writes) and left perplexity.json new beside the
    perplexity.png before it."""
    import lexjax
    from lexjax.errors import CheckpointError

    copy = tmp_path / "run"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("eval", "lease.json"))
    run = lexjax.load(str(copy))
    run.evaluate([32], max_length=64, modes=["bca"], max_docs=1)
    before = {
        name: (copy / "eval" / name).read_bytes() for name in ("perplexity.json", "perplexity.png")
    }
    capsys.readouterr()
    # The latest figure's temporary file (a name per process) is on a full device.
    _full_disk_at(monkeypatch, copy / "eval" / "perplexity.png")
    with pytest.raises(CheckpointError, match="perplexity.png \\(No space left on device\\)"):
        run.evaluate([64], max_length=64, modes=["bca"], max_docs=1)
    shown = capsys.readouterr().out
    assert f"perplexity of {copy} (step 2" in shown and "| 64 " in shown, shown
    for name, content in before.items():  # the pair before, both unchanged
        assert (copy / "eval" / name).read_bytes() == content, name
    # The settings' own record and figure were written before the latest pair.
    own = {p.name: json.loads(p.read_text()) for p in (copy / "eval").glob("perplexity-*.json")}
    assert sorted(r["settings"]["lengths"] for r in own.values()) == [[32], [64]], own
    assert all((copy / "eval" / name).with_suffix(".png").exists() for name in own)
    # Passkey and attention resolution alike (they printed nothing, and passkey.json
    # was written before its heat maps and its settings' copy).
    _full_disk_at(monkeypatch, copy / "eval" / "passkey.json")
    with pytest.raises(CheckpointError, match="passkey.json \\(No space left on device\\)"):
        run.passkey([96], depths=[0.5], trials=1, modes=["bca"])
    assert "passkey retrieval of" in capsys.readouterr().out
    assert (copy / "eval" / "passkey-bca.png").exists() and not (
        copy / "eval" / "passkey.json"
    ).exists()
    assert len(list((copy / "eval").glob("passkey-step*.json"))) == 1
    _full_disk_at(monkeypatch, copy / "eval" / "resolution.json")
    with pytest.raises(CheckpointError, match="resolution.json \\(No space left on device\\)"):
        run.evaluate([32], max_length=64, modes=["bca"], max_docs=1, resolution=True)
    assert "attention resolution (paper eq. 3 with eq. 11; 1 document)" in capsys.readouterr().out

    # A Ctrl-C while the reports are written (a second or so, the figures) ended eval.py
    # with nothing shown of the scan it had finished.
    def interrupted(path, text):
        raise KeyboardInterrupt

    with mock.patch.object(reports, "write_text", interrupted), pytest.raises(KeyboardInterrupt):
        run.evaluate([16], max_length=64, modes=["bca"], max_docs=1)
    assert "| 16 " in capsys.readouterr().out


def test_settings_checked_after_loading_name_eval_pys_flags(tmp_path):
    """Checks that need the run's config said "rope_scaling=ntk extends …" and "sinks
    must be …" to eval.py's user, who has --rope_scaling and --sinks."""
    from lexjax import evaluation
    from lexjax.errors import ConfigError, naming_flags
    from tests.helpers import small_config

    alibi = small_config(**{"model.position": "alibi"})
    for kwargs, message in (
        ({"rope_scaling": "ntk"}, "--rope_scaling=ntk extends a rotary encoding"),
        ({"modes": ["sinks"], "sinks": 9}, r"--sinks=9 must be an integer in \[0, 8\]"),
        # Decided from the settings before any text is read (it was exit 6, after it).
        (
            {"lengths": [33, 40]},
            "no length can be evaluated as asked: none of --lengths=33,40 divides the default "
            "budget of 256 tokens; give lengths that divide it, or a --max_length they divide "
            "such as 1320",
        ),
    ):
        with naming_flags(), pytest.raises(ConfigError, match=f"^{message}"):
            evaluation.evaluate_run(alibi, None, 1, str(tmp_path / "run"), **kwargs)
    assert not (tmp_path / "run").exists()


def test_two_processes_writing_one_report_both_finish(tmp_path):
    """Two evaluations of one workdir (say --rope_scaling=pi and yarn) write the same
    perplexity.json: they shared one temporary name, and a rename by one left the
    other's "cannot write …/perplexity.json (No such file or directory)" at its end."""
    path = tmp_path / "eval" / "perplexity.json"
    code = (
        "import sys; from lexjax import reports\n"
        "for i in range(300): reports.write_json(sys.argv[1], {'writer': sys.argv[2], 'i': i})"
    )
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), name], cwd=ROOT, stderr=subprocess.PIPE
        )
        for name in "ab"
    ]
    for writer in writers:
        _, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err.decode()[-2000:]
    assert json.loads(path.read_text())["i"] == 299
    assert os.listdir(path.parent) == ["perplexity.json"]


def test_a_table_cut_off_while_written_is_one_line_and_keeps_the_one_before(tmp_path, monkeypatch):
    """The study's markdown tables and summary were plain writes: a full disk was a
    traceback (exit 1) and left the table half written."""
    from lexjax import reports
    from lexjax.errors import CheckpointError

    path = tmp_path / "table3.md"
    reports.write_text(str(path), "## before\n")
    # Where this process writes the table first (a name per process: two evaluations
    # of one workdir shared "table3.md.tmp", and one's rename took the other's file).
    _full_disk_at(monkeypatch, path)  # no space left
    with pytest.raises(CheckpointError, match="No space left on device") as error:
        reports.write_text(str(path), "## after\n" * 10_000)
    assert "\n" not in str(error.value) and path.read_text() == "## before\n"
    assert not os.path.lexists(reports._tmp(str(path)))


def test_a_link_planted_at_a_reports_temporary_name_is_not_written_through(tmp_path):
    """A run from elsewhere held a link at eval/perplexity.json.PID.tmp for every pid:
    evaluating it overwrote the file the link named, outside the run, with the report."""
    victim = tmp_path / "mine.txt"
    victim.write_text("the user's own file\n")
    out = tmp_path / "downloaded-run" / "eval"
    out.mkdir(parents=True)
    for name in ("perplexity.json", "perplexity.png"):
        pathlib.Path(reports._tmp(str(out / name))).symlink_to(victim)
    reports.write_json(str(out / "perplexity.json"), {"perplexity": 1.5})
    reports.plot_perplexity(
        [("xpos", "bca", [(32, 10.0), (64, 9.0)])], str(out / "perplexity.png"), train_len=32,
        title="t",
    )  # fmt: skip
    assert victim.read_text() == "the user's own file\n"
    assert json.loads((out / "perplexity.json").read_text()) == {"perplexity": 1.5}
    assert sorted(p.name for p in out.iterdir()) == ["perplexity.json", "perplexity.png"]


def test_two_threads_writing_one_runs_reports_at_once_both_succeed(tmp_path):
    """A notebook evaluating in two threads: they shared the process's temporary name
    (one removed the other's file: "cannot write …; make its directory writable or
    free space") and rendered figures at once (matplotlib's mathtext parser is not
    thread-safe: a ParseException), losing the evaluation."""
    out = tmp_path / "eval"
    errors = []

    def write(i):
        try:
            for j in range(40):
                reports.write_json(str(out / "perplexity.json"), {"thread": i, "j": j})
            for _ in range(4):
                reports.plot_perplexity(
                    [("xpos", "bca", [(32, 10.0 + i), (512, 9.0), (4096, 30.0)])],
                    str(out / "perplexity.png"), train_len=32, title="t",
                )  # fmt: skip
        except Exception as e:  # what the thread hit, to assert on
            errors.append(repr(e))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    assert json.loads((out / "perplexity.json").read_text())["j"] == 39
    assert sorted(p.name for p in out.iterdir()) == ["perplexity.json", "perplexity.png"]


def test_a_figure_cut_off_while_written_leaves_the_one_before_whole(tmp_path, monkeypatch):
    """Figures are replaced atomically, as the JSON is: a write cut off (a file-size
    limit, a full disk, a Ctrl-C) keeps the earlier figure and leaves no .tmp."""
    from matplotlib.figure import Figure

    from lexjax import reports
    from lexjax.errors import CheckpointError

    path = str(tmp_path / "eval" / "perplexity.png")
    curves = [("xpos", "bca", [(32, 10.0), (64, 9.0)])]
    reports.plot_perplexity(curves, path, train_len=32, title="t")
    with open(path, "rb") as f:
        before = f.read()
    savefig = Figure.savefig

    def cut_off(self, fname, **kwargs):
        savefig(self, fname, **kwargs)
        with open(fname, "r+b") as f:
            f.truncate(100)
        raise OSError(27, "File too large")

    monkeypatch.setattr(Figure, "savefig", cut_off)
    with pytest.raises(CheckpointError, match="File too large"):
        reports.plot_perplexity(curves, path, train_len=32, title="t")
    with open(path, "rb") as f:
        assert f.read() == before
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.endswith(".tmp")]
