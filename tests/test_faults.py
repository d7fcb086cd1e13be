"""Faults done to a real training process (train.py in a subprocess): a run loses at
most the steps since its last complete checkpoint, and every user-caused failure is
one error line, a non-zero exit and nothing overwritten.

All runs train the same tiny model for N steps with a checkpoint every 2 steps on 2
simulated CPU devices; the uninterrupted run is the reference. On CPU a resumed run
is bit-identical to it, so parameters and per-step losses are compared exactly —
equal losses at every step after a resume also show the data iterator neither
repeated nor skipped a batch.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import zstandard

import lexjax
from lexjax import checkpoint as ckpt_lib
from lexjax import config as cfg
from lexjax import data, training
from lexjax.errors import CheckpointError, TrainingError
from lexjax.steps import TrainSetup
from tests import processes as P
from tests.helpers import small_config

N = 12
BASE = {"num_train_steps": N, "checkpoint_every": 2, "keep_checkpoints": 4}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return P.context(tmp_path_factory, "faults", 2)


def args(ctx, workdir, **overrides):
    base, files, data_dir, _ = ctx
    return P.train_args(workdir, files, data_dir, **{**BASE, **overrides})


def final_params(workdir, step=None):
    """(step, params) of a checkpoint, restored and checksum-verified in this process."""
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    config = cfg.from_configdict({**ckpt.restore_config(step), "mesh": {"data": -1}})
    state, _, got = ckpt.restore(step, abstract_state=TrainSetup(config).abstract_state)
    ckpt.close()
    return got, jax.device_get(state.params)


def assert_same_params(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def assert_losses_match(workdir, reference_losses, steps=range(1, N + 1)):
    logged = P.losses(workdir)
    assert {s for s, _ in logged} >= set(steps), logged
    for s, loss in logged:
        assert loss == reference_losses[s], f"step {s}: {loss} != {reference_losses[s]}"


def tree_digest(path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(pathlib.Path(path).rglob("*"))
        if p.is_file()
    }


def one_error_line(result) -> str:
    """The run failed with exactly one 'error:' line on stderr and no traceback."""
    assert result.returncode not in (0, None), result.stdout[-1000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def reference(ctx):
    workdir = ctx[0] / "reference"
    result = P.run(args(ctx, workdir), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert P.complete_steps(workdir) == [6, 8, 10, 12]
    step, params = final_params(workdir)
    assert step == N
    return workdir, dict(P.losses(workdir)), params


def test_sigkill_anywhere_then_resume_equals_uninterrupted(ctx, reference):
    """SIGKILL while a checkpoint is being written, then at a random step; the
    restarts resume from the last complete checkpoint and end where the
    uninterrupted run ends."""
    _, ref_losses, ref_params = reference
    workdir = ctx[0] / "missing" / "parents" / "killed"  # created with its parents
    ckpts = workdir / "checkpoints"

    def writing_step_4_or_later():
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(ckpts):
                name = entry.name
                if ".orbax-checkpoint-tmp" in name and int(name.split(".")[0]) >= 4:
                    return name
        return None

    for _ in range(3):  # a write takes a few tenths of a second; a loaded test can miss it
        proc = P.start(args(ctx, workdir), ctx[3])
        tmp = P.wait_until(writing_step_4_or_later, proc, poll=0.001)
        code, _, _ = P.kill(proc)
        assert code == -signal.SIGKILL
        if (ckpts / tmp).exists():
            break  # killed while writing
    else:
        pytest.fail("three times the write finished before the kill landed")
    first_resume = P.complete_steps(workdir)[-1]
    assert first_resume == int(tmp.split(".")[0]) - 2

    seed = int.from_bytes(os.urandom(2), "little")
    kill_at = int(np.random.default_rng(seed).integers(first_resume + 1, N))
    logged = len(P.losses(workdir))
    proc = P.start(args(ctx, workdir), ctx[3])
    P.wait_until(lambda: len(P.losses(workdir)) > logged and P.last_step(workdir) >= kill_at, proc)
    code, out, _ = P.kill(proc)
    assert f"resumed from {ckpts} at step {first_resume}" in out, (seed, out)
    second_resume = P.complete_steps(workdir)[-1]

    result = P.run(args(ctx, workdir), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {ckpts} at step {second_resume}" in result.stdout, seed
    assert not list(ckpts.glob("*orbax-checkpoint-tmp*"))  # the cut-off write was cleaned up
    step, params = final_params(workdir)
    assert step == N
    assert_same_params(params, ref_params)
    assert_losses_match(workdir, ref_losses)


def test_sigterm_saves_the_current_step_and_exits_0(ctx, reference):
    _, ref_losses, ref_params = reference
    workdir = ctx[0] / "terminated"
    for _ in range(3):  # the run has ~1.5 s left at step 3; a loaded test can miss it
        shutil.rmtree(workdir, ignore_errors=True)
        proc = P.start(args(ctx, workdir), ctx[3])
        P.wait_until(lambda: P.last_step(workdir) >= 3, proc, poll=0.005)
        code, out, err = P.kill(proc, signal.SIGTERM)
        assert code == 0, err[-3000:]
        if found := re.search(r"stopped by SIGTERM at step (\d+)", out):
            break
    else:
        pytest.fail("three times the run ended before SIGTERM landed")
    stopped = int(found.group(1))
    assert 3 <= stopped < N, out
    assert P.complete_steps(workdir)[-1] == stopped

    result = P.run(args(ctx, workdir), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {workdir / 'checkpoints'} at step {stopped}, mesh {{'data': " in (
        result.stdout  # the mesh is what an elastic resume changes
    )
    step, params = final_params(workdir)
    assert step == N
    assert_same_params(params, ref_params)
    assert_losses_match(workdir, ref_losses)


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_the_run_resumes(ctx, reference):
    """The first Ctrl-C asks for a save after the current step; a second one ends the
    run there: `interrupted (Ctrl-C)`, no traceback, the process ended by SIGINT.
    Nothing is lost: the lease is released and the next run resumes from the last
    finished checkpoint."""
    _, ref_losses, ref_params = reference
    workdir = ctx[0] / "interrupted"
    for _ in range(3):  # both signals must land in the run, the second after the first
        shutil.rmtree(workdir, ignore_errors=True)
        proc = P.start(args(ctx, workdir), ctx[3])
        P.wait_until(lambda: P.last_step(workdir) >= 2, proc, poll=0.005)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        code, out, err = P.kill(proc, signal.SIGINT)
        if code == -signal.SIGINT:  # ended by SIGINT, as Python on an uncaught Ctrl-C
            break
        assert code == 0, err[-3000:]  # the run ended, or saw a single signal: again
    else:
        pytest.fail("three times the second Ctrl-C came too late or merged with the first")
    assert err.strip().splitlines()[-1] == "interrupted (Ctrl-C)", err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not (workdir / "lease.json").exists()
    result = P.run(args(ctx, workdir), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    step, params = final_params(workdir)
    assert step == N
    assert_same_params(params, ref_params)


def test_a_background_runs_ignored_ctrl_c_leaves_it_training(ctx):
    """Started with SIGINT ignored (a shell's background job, ``nohup … &``), the run
    keeps it so, as Python does: Ctrl-Cs meant for the terminal's foreground program,
    also one while JAX loads, leave it training. SIGTERM still stops and saves it."""
    workdir = ctx[0] / "background"
    long_run = args(ctx, workdir, num_train_steps=100_000, checkpoint_every=100_000)
    proc = P.start(long_run, ctx[3], sigint="SIG_IGN")

    def exec_d() -> bool:  # from the wrapper that set SIGINT ignored: `python …/train.py …`
        argv = pathlib.Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        return len(argv) > 1 and argv[1].endswith(b"train.py")  # empty until the fork execs

    P.wait_until(exec_d, proc, 60, 0.001)
    proc.send_signal(signal.SIGINT)  # while it imports (SIG_IGN holds across exec)
    P.wait_until(lambda: P.last_step(workdir) >= 2, proc, poll=0.005)
    for _ in range(2):  # a second Ctrl-C would otherwise stop it at once
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    stepped = P.last_step(workdir)
    P.wait_until(lambda: P.last_step(workdir) >= stepped + 3, proc)  # still training
    code, out, err = P.kill(proc, signal.SIGTERM)
    assert code == 0, err[-3000:]
    assert "SIGINT" not in out + err, (out + err)[-3000:]
    found = re.search(r"stopped by SIGTERM at step (\d+)", out)
    assert found, out[-2000:]
    assert P.complete_steps(workdir) == [int(found.group(1))]


# train.py on a terminal of its own (stdin, stdout and stderr the pty's slave), as the
# controlling process of a new session: closing the master is a hangup (SIGHUP), as
# when an ssh session drops. SIGHUP's action reset: a suite run under nohup ignores it.
_ON_A_TERMINAL = (
    "import fcntl, os, signal, sys, termios; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
)


def test_a_closed_terminal_saves_the_current_step_and_the_run_resumes(ctx):
    """A dropped ssh session (SIGHUP) ended train.py by the default action (status 129),
    losing the save under way and the steps since the last one; the terminal it
    printed to then fails every write (EIO). It now stops as on SIGTERM."""
    import pty
    import select
    import threading

    workdir = ctx[0] / "hangup"
    long_run = args(ctx, workdir, num_train_steps=10**6, checkpoint_every=10**6)
    argv = [sys.executable, "-c", _ON_A_TERMINAL, sys.executable, str(P.ROOT / "train.py")]
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*argv, *long_run], cwd=P.ROOT, env=ctx[3], stdin=slave, stdout=slave, stderr=slave
    )
    os.close(slave)
    reading, shown = True, []

    def drain():  # the terminal's reader: a full pty would block the run's writes
        while reading:
            if select.select([master], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    shown.append(os.read(master, 65536))

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        P.wait_until(lambda: P.last_step(workdir) >= 3, proc)
    finally:
        reading = False
        reader.join()
        os.close(master)  # the hangup
    assert proc.wait(timeout=240) == 0, b"".join(shown)[-3000:]
    (saved,) = P.complete_steps(workdir)  # the step it was on, saved
    assert saved >= 3 and not (workdir / "lease.json").exists()
    result = P.run(args(ctx, workdir, num_train_steps=saved + 1), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {workdir / 'checkpoints'} at step {saved}" in result.stdout


def test_ctrl_c_is_handled_while_train_runs_and_left_alone_where_ignored():
    """In-process: train()'s handlers take SIGINT over from Python's and give it back;
    an ignored SIGINT (a background job's) is neither taken over nor recorded."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with training._StopFlag() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert stop.signal_name is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with training._StopFlag() as stop:
            assert signal.getsignal(signal.SIGINT) == stop._handle
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert stop.signal_name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    # SIGHUP likewise: a hangup stops a run, unless ignored (nohup's), then left so.
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with training._StopFlag():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with training._StopFlag() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)
            assert stop.signal_name == "SIGHUP"
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_closed_stdout_loses_no_step(ctx):
    """`train.py | tee log` and a Ctrl-C: the Ctrl-C ends tee first, and train.py's next
    line found its stdout closed: a BrokenPipeError traceback, exit 1, the steps since
    the last save lost. The log goes on on stderr; the Ctrl-C saves the current step."""
    workdir = ctx[0] / "closed-stdout"
    proc = P.start(args(ctx, workdir, num_train_steps=10**6, checkpoint_every=10**6), ctx[3])
    while not proc.stdout.readline().startswith("model: "):  # (the corpus built first)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.stdout.close()  # tee gone
    note = "stdout failed (Broken pipe); printing to stderr from here on\n"
    for _ in range(1000):  # the next log line finds it closed (a bound: it would train on)
        if (line := proc.stderr.readline()) in (note, ""):
            break
    if line != note:
        proc.kill()
    assert line == note, line
    proc.send_signal(signal.SIGINT)  # then the Ctrl-C reaches train.py
    err = proc.stderr.read()
    assert proc.wait(timeout=240) == 0 and "Traceback" not in err, err[-3000:]
    stopped = re.search(r"stopped by SIGINT at step (\d+); checkpoint saved in ", err)
    assert stopped and P.complete_steps(workdir) == [int(stopped[1])], err[-3000:]


def test_a_run_started_without_stdout_trains(ctx):
    """`train.py >&-` (started with no stdout at all): an AttributeError on None where
    it re-executed itself for huge pages, before any step."""
    workdir = ctx[0] / "no-stdout"
    argv = [sys.executable, str(P.ROOT / "train.py"), *args(ctx, workdir, num_train_steps=2)]
    done = subprocess.run(
        ["bash", "-c", 'exec "$@" >&-', "bash", *argv],
        env=ctx[3],
        cwd=P.ROOT,
        stderr=subprocess.PIPE,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert P.complete_steps(workdir) == [2]


def test_a_signal_before_the_first_step_exits_0_and_leaves_no_lease(ctx):
    """SIGTERM / Ctrl-C while the run sets up (taking the lease, reading the corpus,
    initialising or restoring) ends it at once: exit 0, one line, no traceback, no
    lease left behind, nothing written; the next run starts or resumes as usual."""
    workdir = ctx[0] / "early"
    ckpts, lease = workdir / "checkpoints", workdir / "lease.json"

    def stopped(sig, read, before):
        code, out, err = P.kill(proc, sig)
        assert code == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert (read + out).splitlines()[-1] == (
            f"stopped by {sig.name} {before}; there was nothing new to save"
        ), read + out
        assert not lease.exists()

    # SIGTERM as soon as the lease is taken: the corpus and the model are set up after it,
    # seconds before the first step. (At "model: " less than a second is left on a loaded
    # machine, and a signal during the first step rightly saves it.)
    proc = P.start(args(ctx, workdir, num_train_steps=4), ctx[3])
    P.wait_until(lease.exists, proc, poll=0.001)
    stopped(signal.SIGTERM, "", "before the first step")
    assert not list(ckpts.glob("*"))
    result = P.run(args(ctx, workdir, num_train_steps=4), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model: " in result.stdout and "note:" not in result.stdout, result.stdout
    assert P.complete_steps(workdir) == [2, 4]
    saved = tree_digest(ckpts)

    # Ctrl-C as soon as the lease is taken. (Not at "resumed from": the first step
    # follows it within milliseconds, and a signal in that step saves it, rightly.)
    proc = P.start(args(ctx, workdir, num_train_steps=8), ctx[3])
    P.wait_until(lease.exists, proc, poll=0.001)
    stopped(signal.SIGINT, "", f"before resuming from {ckpts}")
    assert tree_digest(ckpts) == saved

    result = P.run(args(ctx, workdir, num_train_steps=8), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"resumed from {ckpts} at step 4"), result.stdout
    assert P.complete_steps(workdir)[-1] == 8


def test_a_signal_while_jax_loads_exits_0(ctx):
    """SIGTERM while train.py is still importing JAX, before train() has its handlers,
    is acted on once train() starts: exit 0 with the same line, not status 143."""
    workdir = ctx[0] / "importing"
    proc = P.start(args(ctx, workdir), ctx[3])

    def loading_jax():  # jaxlib's extension is mapped: `import jax` is under way
        with contextlib.suppress(OSError):
            return "jaxlib" in pathlib.Path(f"/proc/{proc.pid}/maps").read_text()

    P.wait_until(loading_jax, proc, poll=0.001)
    code, out, err = P.kill(proc, signal.SIGTERM)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert out.splitlines()[-1] == (
        "stopped by SIGTERM before the first step; there was nothing new to save"
    ), out
    assert not workdir.exists()


def test_a_signal_that_lands_in_a_gc_callback_still_stops_the_setup(capsys):
    """A signal handler runs wherever the main thread is, also inside a garbage-collector
    callback (JAX registers one), where an exception is only printed as "Exception
    ignored in ..." (CI once showed that traceback, and setup went on). The stop must
    still end the set-up, with nothing printed."""
    sent = []

    def callback(phase, info):
        if phase == "start" and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside the callback
                pass

    with training._StopFlag() as stop:
        gc.callbacks.append(callback)
        try:
            with pytest.raises(training._Stopped), stop.raising():
                gc.collect()
                for _ in range(10_000_000):  # where the stop is raised again
                    pass
        finally:
            gc.callbacks.remove(callback)
    assert sent and stop.signal_name == "SIGTERM"
    assert "Exception ignored" not in capsys.readouterr().err


def test_ctrl_c_in_a_notebook_before_the_first_step(ctx, tmp_path):
    """An in-process train() (a notebook cell; a kernel interrupt is a SIGINT) stopped
    while it sets up returns at once, releases the lease and leaves the signal handlers
    as it found them."""
    _, files, data_dir, _ = ctx
    overrides = {"data.name": "textfiles", "data.files": files, "data.data_dir": data_dir}
    lines = []

    def interrupt_at_model_line(line):
        lines.append(line)
        if line.startswith("model: "):
            os.kill(os.getpid(), signal.SIGINT)

    # A kernel's SIGINT handler (a test run as a background job has SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    workdir = tmp_path / "run"
    try:
        summary = training.train(
            small_config(**overrides), str(workdir), log=interrupt_at_model_line, progress=False
        )
        handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert summary["stopped_by"] == "SIGINT"
    assert lines[-1] == "stopped by SIGINT before the first step; there was nothing new to save"
    assert handlers == before
    assert not workdir.exists()  # created by the call, nothing written: removed


def largest_data_file(step_dir) -> pathlib.Path:
    files = [p for p in pathlib.Path(step_dir, "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def flip_one_array_byte(step_dir):
    """Flips one bit of a stored array value so that its chunk still decodes: the
    silent corruption only the checkpoint's checksums can catch.

    OCDBT packs the arrays' chunks, each a zstd frame without a content checksum,
    into data files in no fixed order, so a byte at a fixed offset sometimes lands
    in zstd's own structure and the read fails in the decoder instead. This walks
    the frames of the largest data file from its middle one outward and flips the
    first bit, from the middle of a frame, after which the frame still decodes to
    as many bytes as before and to different bytes."""
    path = largest_data_file(step_dir)
    data = bytearray(path.read_bytes())
    frame_starts = [m.start() for m in re.finditer(re.escape(_ZSTD_MAGIC), data)]
    # B-tree nodes (CRC-checked, their body a zstd frame too) are no array's value.
    nodes = [m.start() for m in re.finditer(re.escape(_OCDBT_NODE_MAGIC), data)]
    bounds = sorted({*frame_starts, *nodes, len(data)})
    frames = [
        (start, bounds[bounds.index(start) + 1])
        for start in frame_starts
        if not any(start - 16 <= node < start for node in nodes)
    ]
    middle = len(frames) // 2
    for _, (start, end) in sorted(enumerate(frames), key=lambda f: abs(f[0] - middle)):
        try:
            original = _decode_frame(data[start:end])
        except zstandard.ZstdError:
            continue  # a magic number inside compressed bytes, not a frame
        centre = (start + end) // 2
        for offset in sorted(range(start + 16, end - 4), key=lambda i: abs(i - centre)):
            data[offset] ^= 0x01
            try:
                changed = _decode_frame(data[start:end])
            except zstandard.ZstdError:
                changed = None
            if changed is not None and len(changed) == len(original) and changed != original:
                path.write_bytes(bytes(data))
                return
            data[offset] ^= 0x01
    raise AssertionError(f"no bit of {path} changes a value and keeps its frame decodable")


_ZSTD_MAGIC = bytes.fromhex("28b52ffd")
_OCDBT_NODE_MAGIC = bytes.fromhex("0cdb20de")


def _decode_frame(frame) -> bytes:
    return zstandard.ZstdDecompressor().decompress(bytes(frame))


def test_damaged_checkpoints_are_named_and_skipped(ctx, reference):
    """Step 12 truncated, step 10 missing a file, step 8 with one flipped byte:
    the restart names each, falls back to step 6, moves the damaged steps aside
    (never deletes them) and ends exactly where the reference ends."""
    ref_dir, ref_losses, ref_params = reference
    workdir = ctx[0] / "damaged"
    shutil.copytree(ref_dir, workdir)
    ckpts = workdir / "checkpoints"
    big = largest_data_file(ckpts / "12")
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    largest_data_file(ckpts / "10").unlink()
    flip_one_array_byte(ckpts / "8")
    logged_before = len(P.losses(workdir))

    result = P.run(args(ctx, workdir), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    damaged = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(damaged) == 3, result.stderr
    for line, step, then in zip(damaged, (12, 10, 8), (10, 8, 6)):
        # The whole line: lexjax's notes carry no absl prefix ("W1205 02:00:33.47 ...]").
        assert line.startswith(f"checkpoint step {step} in {ckpts} is damaged: "), line
        assert line.endswith(f"; falling back to step {then}"), line
    moved = [line for line in result.stderr.splitlines() if "before saving over it" in line]
    assert len(moved) == 3 and all(line.startswith("checkpoint step ") for line in moved), moved
    assert "checksum mismatch" in damaged[2]
    assert f"resumed from {ckpts} at step 6" in result.stdout
    assert sorted(p.name.split("-")[0] for p in (ckpts / "superseded").iterdir()) == [
        "10",
        "12",
        "8",
    ]
    step, params = final_params(workdir)
    assert step == N
    assert_same_params(params, ref_params)
    for s, loss in P.losses(workdir)[logged_before:]:
        assert s > 6 and loss == ref_losses[s]


def test_a_damaged_tokenizer_record_falls_back_for_resume_eval_and_load(ctx, reference):
    """Step 12's tokenizer record garbled: resume, eval.py and lexjax.load each name
    it and use step 10, as for any other damaged item of a step."""
    ref_dir, ref_losses, ref_params = reference
    workdir = ctx[0] / "damaged-tokenizer"
    shutil.copytree(ref_dir, workdir)
    ckpts = workdir / "checkpoints"
    (ckpts / "12" / "tokenizer" / "metadata").write_text("garbage{")
    note = f"checkpoint step 12 in {ckpts} is damaged: tokenizer record unreadable ("

    run = lexjax.load(workdir)
    assert run.step == 10 and run.tokenizer is not None
    done = P.run(
        ["--workdir", str(workdir), "--lengths=32", "--max_docs=1", "--modes=full"],
        ctx[3],
        program="eval.py",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{note}" in done.stderr and "falling back to step 10" in done.stderr, done.stderr

    result = P.run(args(ctx, workdir), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    damaged = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and note in damaged[0], result.stderr
    assert damaged[0].endswith("; falling back to step 10"), damaged[0]
    assert f"resumed from {ckpts} at step 10" in result.stdout
    step, params = final_params(workdir)
    assert step == N
    assert_same_params(params, ref_params)


@pytest.mark.parametrize("reader", ["_read_config", "_restore_params"])
def test_a_step_deleted_while_being_read_is_not_damage(ctx, reference, monkeypatch, caplog, reader):
    """A reader takes no lease: a training run's garbage collection may delete the
    step being read (here for real, when the reader opens its config record or its
    arrays). The reader reads the newest step still there and calls nothing damaged."""
    workdir = ctx[0] / f"deleted-while-read-{reader}"
    shutil.copytree(reference[0], workdir)
    ckpts = workdir / "checkpoints"
    deleted = []
    owner = ckpt_lib.Checkpointer if reader == "_read_config" else ckpt_lib
    original = getattr(owner, reader)

    def delete_first(*args, **kwargs):
        step = next(a for a in args if isinstance(a, int))
        if not deleted:
            shutil.rmtree(ckpts / str(step))
            deleted.append(step)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, reader, delete_first)
    with caplog.at_level(logging.INFO):
        run = lexjax.load(workdir)
    assert deleted == [12] and run.step == 10 and run.tokenizer is not None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "checkpoint step 12" in caplog.text and "was deleted while being read" in caplog.text
    assert not (ckpts / "superseded").exists()
    assert P.complete_steps(workdir) == [6, 8, 10]


def test_a_step_verified_after_its_workdir_moved_is_gone_not_damaged(ctx, reference, caplog):
    """Training verifies its newest step before deleting older ones; with the workdir
    renamed meanwhile the step "is damaged: its directory is gone" was the note."""
    workdir, away = ctx[0] / "verified-then-moved", ctx[0] / "verified-moved-away"
    shutil.copytree(reference[0], workdir)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    workdir.rename(away)
    try:
        with caplog.at_level(logging.WARNING):
            assert not ckpt._verify_on_host(N)
    finally:
        ckpt.close()
    assert f"checkpoint step {N} in {workdir / 'checkpoints'} is gone (moved or deleted)" in (
        caplog.text
    )
    assert "damaged" not in caplog.text


def test_damage_with_on_corrupt_error_stops_and_changes_nothing(ctx, reference):
    workdir = ctx[0] / "strict"
    shutil.copytree(reference[0], workdir)
    flip_one_array_byte(workdir / "checkpoints" / "12")
    before = tree_digest(workdir)
    result = P.run(args(ctx, workdir, on_corrupt_checkpoint="error"), ctx[3])
    line = one_error_line(result)
    assert f"checkpoint step 12 in {workdir / 'checkpoints'} is damaged: checksum mismatch" in line
    assert tree_digest(workdir) == before


def test_nan_stops_naming_the_step_and_keeps_the_last_checkpoint(ctx, reference):
    _, ref_losses, _ = reference
    workdir = ctx[0] / "nan"
    result = P.run(["5", *args(ctx, workdir)], ctx[3], program="tests/poisoned_train.py")
    line = one_error_line(result)
    assert result.returncode == TrainingError.exit_code, result.stderr[-3000:]
    assert "non-finite loss (nan) or gradient at step 5" in line, line
    assert "last checkpoint: step 4" in line, line
    assert line.endswith(
        "; lower learning_rate or raise warmup_steps (or optim.grad_clip below its value) "
        "and train again"
    )
    assert P.complete_steps(workdir) == [2, 4]
    assert_losses_match(workdir, ref_losses, steps=range(1, 5))
    assert final_params(workdir)[0] == 4  # restores, checksums verified


def test_nan_before_any_checkpoint_says_there_is_none(ctx):
    workdir = ctx[0] / "nan_first"
    result = P.run(["1", *args(ctx, workdir)], ctx[3], program="tests/poisoned_train.py")
    line = one_error_line(result)
    assert result.returncode == TrainingError.exit_code, result.stderr[-3000:]
    assert (
        "at step 1; stopped without saving that state (last checkpoint: no checkpoint yet in"
        in line
    ), line
    # Step 1 is the initial parameters': lowering learning_rate cannot help (it said to).
    assert line.endswith("; the initial model gives it, before any update: check the model's "
                         "config (its dtype, position settings such as scale_base or theta) "
                         "and the data"), line  # fmt: skip


def test_read_only_workdir(ctx, reference):
    """A read-only filesystem (a tmpfs remounted read-only; without mount rights,
    chmod for a non-root user) holding a finished run: one error line, nothing changed."""
    with P.tmpfs(ctx[0] / "ro", "4m") as mount:
        workdir = (mount or ctx[0] / "ro") / "run"
        shutil.copytree(reference[0], workdir)
        P.make_read_only(mount, workdir)
        before = tree_digest(workdir)
        line = one_error_line(P.run(args(ctx, workdir, num_train_steps=N + 2), ctx[3]))
        assert f"workdir {workdir} is not writable" in line, line
        assert tree_digest(workdir) == before


def test_workdir_that_cannot_be_created(ctx):
    """A workdir under a regular file: its parent can never be created."""
    blocker = ctx[0] / "a-file"
    blocker.write_text("not a directory")
    line = one_error_line(P.run(args(ctx, blocker / "run"), ctx[3]))
    assert f"cannot create workdir {blocker / 'run'}: Not a directory" in line, line
    assert blocker.read_text() == "not a directory"


def test_full_disk(ctx, reference):
    """A 300 KiB tmpfs (room for the logs, not for a checkpoint); without mount
    rights, a 100 KiB file-size limit (RLIMIT_FSIZE) on the process instead, with
    the corpus already built (by ``reference``: its files pass the limit too)."""
    with P.tmpfs(ctx[0] / "full", "300k") as mount:
        workdir = (mount or ctx[0] / "full") / "run"
        rlimits = None if mount else {"RLIMIT_FSIZE": 100 * 1024}  # writes past it: EFBIG
        result = P.run(args(ctx, workdir), ctx[3], rlimits=rlimits)
        line = one_error_line(result)
        assert result.stderr.strip().splitlines() == [line], result.stderr[-3000:]
        where = re.escape(str(workdir / "checkpoints"))
        assert re.search(rf"writing checkpoint step 2 to {where} failed: ", line), line
        assert f"failed: {'No space left on device' if mount else 'File too large'}; " in line


def _fill_the_disk_while_training(ctx, name: str, **overrides) -> tuple:
    """Trains on a 20 MiB tmpfs, fills it after step 2 and waits for the run to fail:
    (workdir, its one error line); skips where this process may not mount. Not after
    step 1: its metrics line is on disk before its first TensorBoard events, which on
    a loaded machine could still be waiting for a page when the disk filled."""
    with P.tmpfs(ctx[0] / name, "20m") as mount:
        if mount is None:
            pytest.skip("needs a tmpfs (root and mount)")
        workdir = mount / "run"
        proc = P.start(args(ctx, workdir, **overrides), ctx[3])
        P.wait_until(lambda: P.last_step(workdir) >= 2, proc)
        with open(mount / "filler", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        out, err = proc.communicate(timeout=240)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        line = one_error_line(result)
        assert result.returncode == 4 and err.strip().splitlines() == [line], err[-3000:]
        return workdir, line


def test_disk_filling_up_before_a_save(ctx):
    """The disk fills while training runs; the next save fails as it starts (orbax's
    synchronous part), which once gave no step and stray RuntimeWarnings on stderr."""
    workdir, line = _fill_the_disk_while_training(
        ctx, "filling", num_train_steps=8, checkpoint_every=8
    )
    assert line.startswith(
        f"error: writing checkpoint step 8 to {workdir / 'checkpoints'} "
        "failed: No space left on device; "
    ), line


def test_disk_filling_up_between_saves(ctx):
    """The disk fills far from a save: the next metrics record that needs a new page
    fails first. It was two OSError tracebacks and exit 1 (a bug's), not a full disk's
    one line and exit 4."""
    many = dict(num_train_steps=2000, checkpoint_every=2000, eval_every=2000, log_every=1)
    workdir, line = _fill_the_disk_while_training(ctx, "filling-between", **many)
    assert re.fullmatch(
        rf"error: writing step \d+'s metrics to {re.escape(str(workdir))} failed: No space "
        r"left on device; free space or fix the directory, then restart \(the checkpoints "
        r"are kept\)",
        line,
    ), line


def test_a_workdir_moved_while_training_is_named_as_moved(ctx):
    """The workdir renamed under a running job: it said the lease "was taken over by
    another job while this one was stalled … free space or fix the directory", or
    "No such file or directory; free space …", after calling the step being verified
    "damaged"; none of it was so."""
    workdir, moved = ctx[0] / "moving", ctx[0] / "moved"
    proc = P.start(args(ctx, workdir, num_train_steps=5000, checkpoint_every=2), ctx[3])
    P.wait_until(lambda: P.last_step(workdir) >= 6, proc)
    os.rename(workdir, moved)
    out, err = proc.communicate(timeout=240)
    line = one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert proc.returncode == 4 and line == (
        f"error: workdir {workdir} was moved, renamed or deleted while this job trained; "
        "stopped without saving (a directory written there since holds only fragments of "
        "the save in progress); resume the run where it is now, with --workdir its new path"
    ), err[-3000:]
    assert "damaged" not in err, err[-3000:]
    assert P.complete_steps(moved), os.listdir(moved)


@pytest.mark.parametrize("limit", ["tmpfs", "file size"])
def test_a_data_dir_that_fills_up_while_the_corpus_is_built(ctx, tmp_path, limit):
    """Was TFDS's RuntimeError traceback, exit 1, on the open "building dataset" line.
    Now one line, exit 3 (a read-only data_dir's code), and no partial build is left
    for the next run to mistake for one. A file-size limit (RLIMIT_FSIZE, EFBIG) was
    still that traceback."""
    with (
        P.tmpfs(tmp_path / "small", "16k")
        if limit == "tmpfs"
        else contextlib.nullcontext(tmp_path) as mount
    ):
        if mount is None:
            pytest.skip("needs a tmpfs (root and mount)")
        workdir, data_dir = tmp_path / "run", mount / "tfds"
        result = P.run(
            P.train_args(workdir, ctx[1], data_dir, num_train_steps=1),
            ctx[3],
            rlimits=None if limit == "tmpfs" else {"RLIMIT_FSIZE": 64 * 1024},
        )
        line = one_error_line(result)
        reason, cure = ("No space left on device", "free space there")
        if limit != "tmpfs":  # freeing space would not help
            reason, cure = ("File too large", "raise the file-size limit (ulimit -f)")
        assert result.returncode == 3 and line == (
            f"error: data.data_dir={data_dir}: building the corpus textfiles failed "
            f"({reason}); {cure} or choose another data.data_dir"
        ), result.stderr[-3000:]
        assert result.stdout.endswith("...\n"), result.stdout[-300:]  # the line is ended
        assert not [p for p in data_dir.rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_a_corpus_file_that_cannot_be_read_is_one_line(ctx, tmp_path):
    """A file the glob selects but reading fails on (permissions; here an I/O error:
    a link to the reading process's own /proc/self/mem, unreadable even by root) was a
    traceback from the corpus digest, exit 1."""
    corpus = tmp_path / "corpus"
    shutil.copytree(pathlib.Path(ctx[1]).parent, corpus)
    (corpus / "mem.txt").symlink_to("/proc/self/mem")
    workdir = tmp_path / "run"
    result = P.run(
        P.train_args(workdir, str(corpus / "*.txt"), tmp_path / "tfds", num_train_steps=1), ctx[3]
    )
    line = one_error_line(result)
    assert result.returncode == 3 and line == (
        f"error: cannot read {corpus / 'mem.txt'} (Input/output error); make it readable "
        "or narrow the glob that selects it"
    ), line


def test_a_flipped_byte_in_the_config_or_integrity_record_falls_back(reference, tmp_path, caplog):
    """The config and integrity records had no checksum: one byte ("train_len": 32 →
    12) made eval.py evaluate with another window and label it so, exit 0; a dtype or
    shape byte in the integrity record was a traceback or a model-shape error, with
    an intact step before it."""
    train_len = ckpt_lib.load_params(reference[0])[0].train_len
    flips = {
        "config": (f'"train_len": {train_len}', '"train_len": 12'),
        "integrity": ('"dtype": "float32"', '"dtype": "float33"'),
    }
    for item, (before, after) in flips.items():
        workdir = tmp_path / item
        shutil.copytree(reference[0], workdir)
        path = workdir / "checkpoints" / str(N) / item / "metadata"
        text = path.read_text()
        assert before in text, text[:300]
        path.write_text(text.replace(before, after, 1))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
            config, _, step = ckpt_lib.load_params(workdir)
        assert step == N - 2 and config.train_len == train_len
        said = {"config": "config record fails its checksum"}.get(
            item, "integrity record fails its own checksum"
        )
        damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
        assert len(damaged) == 1 and f"step {N} in {workdir}" in damaged[0], damaged
        assert said in damaged[0] and damaged[0].endswith(f"falling back to step {N - 2}")


@pytest.mark.parametrize("record", ["config", "integrity"])
def test_eval_falls_back_from_a_step_that_lost_a_record(reference, tmp_path, caplog, record):
    """A step whose config record is gone was read as an older lexjax's step without
    one: eval.py and lexjax.load stopped ("has no config; it was not written by
    train.py") with an intact step before it. load_tokenizer picks the same step."""
    workdir = tmp_path / "run"
    shutil.copytree(reference[0], workdir)
    shutil.rmtree(workdir / "checkpoints" / str(N) / record)
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        _, _, step = ckpt_lib.load_params(workdir)
    assert step == N - 2
    damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert damaged == [
        f"checkpoint step {N} in {workdir / 'checkpoints'} is damaged: {record} record missing; "
        f"falling back to step {N - 2}"
    ]
    assert ckpt_lib.load_tokenizer(workdir) is data.BYTES


def test_a_model_too_big_for_memory_is_one_line(ctx, tmp_path):
    """XLA's failed allocation was a traceback with exit 1, a bug in the exit scheme.
    A 17 G-parameter model under a 15 GiB address space: its allocations fail at
    once, with no memory taken from the machine."""
    limit = 15 * 2**30
    result = P.run(
        args(ctx, tmp_path / "huge", num_train_steps=1, **{"model.d_model": 65536}),
        ctx[3],
        rlimits={"RLIMIT_AS": limit},
    )
    line = one_error_line(result)
    assert result.returncode == 5, result.stderr[-2000:]
    assert line.startswith("error: out of memory (") and "lower batch_size" in line, line
    assert line.endswith("or set model.remat_policy=full"), line
    assert not (tmp_path / "huge").exists()  # the run created it and wrote no file


def test_checkpoints_of_another_model_shape(ctx, reference):
    workdir = ctx[0] / "other-shape"
    shutil.copytree(reference[0], workdir)
    before = tree_digest(workdir)
    result = P.run(args(ctx, workdir, **{"model.d_model": 64}), ctx[3])
    line = one_error_line(result)
    # The workdir named, not its checkpoints directory.
    said = (
        f"workdir {workdir} holds checkpoints of another model (model.d_model is 32 there, 64 here)"
    )
    assert said in line, line
    assert tree_digest(workdir) == before


@pytest.mark.parametrize(
    "change, detail",
    [
        ({"data.shuffle_rows": 16}, "data.shuffle_rows is 64 there, 16 here"),
        ({"data.worker_count": 1}, "data.worker_count is 0 there, 1 here"),
        ({"data.text_feature": "path"}, "data.text_feature is text there, path here"),
    ],
    ids=["shuffle_rows", "worker_count", "text_feature"],
)
def test_resume_with_other_data_stream_settings_is_refused(ctx, reference, change, detail):
    """The saved data position belongs to the stream of its settings: applied to
    another one it re-trained rows already seen (shuffle_rows), failed inside grain
    (worker_count, a KeyError traceback) or went on reading another feature as the
    text (text_feature). One line, exit 4, nothing written."""
    workdir = ctx[0] / f"other-stream-{next(iter(change)).split('.')[-1]}"
    shutil.copytree(reference[0], workdir)
    before = tree_digest(workdir)
    result = P.run(args(ctx, workdir, num_train_steps=N + 2, **change), ctx[3])
    line = one_error_line(result)
    assert result.returncode == CheckpointError.exit_code, result.stderr[-3000:]
    # Only the line: orbax's two notices of a read-only directory came before it.
    assert result.stderr.strip().splitlines() == [line], result.stderr[-3000:]
    assert f"checkpoint step {N} in {workdir / 'checkpoints'} holds a position in another" in line
    assert f"data stream ({detail})" in line, line
    assert "resume with the checkpoint's values or use a new --workdir" in line, line
    assert tree_digest(workdir) == before


def test_a_corpus_glob_over_the_runs_own_workdir_is_refused(ctx):
    """files='proj/**' with --workdir=proj/runs/a: the run's lease, metrics and
    checkpoints would be trained on, and each resume refused as another corpus. Refused
    at the start instead: one line naming the setting, exit 3, nothing trained."""
    project = ctx[0] / "proj"
    P.write_corpus(project / "texts", 12)
    workdir = project / "runs" / "a"
    base, _, data_dir, environ = ctx
    result = P.run(P.train_args(workdir, str(project / "**"), data_dir, num_train_steps=2), environ)
    line = one_error_line(result)
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"data.files={str(project / '**')!r} matches 1 file inside --workdir=" in line, line
    assert "(first runs/a/lease.json)" in line and "move --workdir out of the corpus" in line
    assert not (workdir / "checkpoints").exists()


def test_a_step_without_its_files_is_one_line_not_orbaxs_warnings(ctx, reference):
    """An empty step folder (a copy cut short): lexjax's line, and orbax's "Metadata file
    does not exist" warnings (five here) no more."""
    workdir = ctx[0] / "empty-step"
    shutil.copytree(reference[0], workdir)
    (workdir / "checkpoints" / str(N + 2)).mkdir()
    result = P.run(args(ctx, workdir, num_train_steps=N + 2), ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout + result.stderr
    assert f"checkpoint step {N + 2} in {workdir / 'checkpoints'} is damaged: integrity " in said
    assert "Metadata file does not exist" not in said, said[-3000:]


def test_resume_on_another_corpus_of_as_many_documents_is_refused(ctx, reference):
    """The same number of files with other text: the saved position would index
    documents of another corpus; the two builds' names (their fingerprints) differ."""
    corpus = ctx[0] / "swapped"
    files = P.write_corpus(corpus)
    (corpus / "doc3.txt").write_text("alpha beta " * 50)
    workdir = ctx[0] / "other-corpus"
    shutil.copytree(reference[0], workdir)
    before = tree_digest(workdir)
    result = P.run(
        P.train_args(workdir, files, ctx[2], **{**BASE, "num_train_steps": N + 2}), ctx[3]
    )
    line = one_error_line(result)
    assert result.returncode == CheckpointError.exit_code, result.stderr[-3000:]
    assert re.search(
        r"data stream \(train corpus is textfiles/\w+/[\d.]+ there, "
        r"textfiles/\w+/[\d.]+ here\)",
        line,
    ), line
    # Not "the checkpoint's values": no setting shows a file's contents.
    assert line.endswith(
        "resume with the files and data.* settings its corpus was built from, or use a new "
        "--workdir"
    ), line
    assert tree_digest(workdir) == before
    # Refused before the other corpus was built (on a large corpus: minutes, and a build
    # left behind; with SentencePiece, its tokenizer learned too).
    from lexjax import data

    assert not os.path.exists(os.path.join(ctx[2], data.build_name("textfiles", files)))


def test_corpus_edge_cases_train(ctx):
    """Empty, binary, invalid UTF-8 and a 3 MB single-line file among ordinary ones:
    the byte tokenizer takes them all."""
    corpus = ctx[0] / "edge"
    files = P.write_corpus(corpus)
    (corpus / "empty.txt").write_bytes(b"")
    (corpus / "binary.txt").write_bytes(np.random.default_rng(0).bytes(4096))
    (corpus / "invalid.txt").write_bytes(b"caf\xe9 \xff\xfe \xc3\x28 end\n")
    (corpus / "huge.txt").write_bytes(b"x" * 3_000_000)
    result = P.run(
        P.train_args(
            ctx[0] / "edge-run",
            files,
            str(ctx[0] / "edge-tfds"),
            num_train_steps=2,
            checkpoint_every=2,
        ),
        ctx[3],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps" in result.stdout


def test_grain_worker_processes_train(ctx, tmp_path):
    """data.worker_count=1: the corpus's source reaches a grain worker process (it
    failed to unpickle there, a traceback for every built-in corpus)."""
    result = P.run(
        args(
            ctx, tmp_path / "run", num_train_steps=2, checkpoint_every=2, **{"data.worker_count": 1}
        ),
        ctx[3],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps" in result.stdout


def test_a_sigterm_that_ends_the_grain_worker_too_still_stops_where_it_would(ctx, reference):
    """A scheduler's or a shutdown's SIGTERM reaches every process, the grain worker of
    ``data.worker_count=1`` too, so the batch after the stop request may never come:
    the run replaces its iterator at the position reached and stops and saves after
    the step, as without workers (it was a grain traceback, exit 1, every step since
    the last checkpoint lost). The resumed run equals the uninterrupted one (which
    ran without workers: one worker runs the same pipeline, the same batches)."""
    workdir = ctx[0] / "worker-sigterm"
    run = args(ctx, workdir, **{"data.worker_count": 1})
    proc = P.start(run, ctx[3])
    P.wait_until(lambda: P.last_step(workdir) >= 2, proc, poll=0.005)
    [worker] = P.grain_workers(proc.pid)
    os.kill(worker, signal.SIGSTOP)
    # Held stopped, it prefetches nothing more: the run drains what it had and waits
    # inside next() for the next batch.
    stepped = P.settled_step(workdir, proc)
    assert stepped < N, "the run finished before its worker was held"
    os.kill(worker, signal.SIGTERM)  # delivered with the SIGCONT: the worker ends
    proc.send_signal(signal.SIGTERM)
    os.kill(worker, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert f"stopped by SIGTERM at step {stepped + 1}" in out, (out + err)[-3000:]
    assert stepped + 1 in P.complete_steps(workdir)

    result = P.run(run, ctx[3])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {stepped + 1}" in result.stdout, result.stdout[-2000:]
    _, ref_losses, ref_params = reference
    step, params = final_params(workdir)
    assert step == N
    assert_same_params(params, ref_params)
    assert_losses_match(workdir, ref_losses)


def test_a_terminals_ctrl_c_to_a_run_with_grain_workers_stops_it_quietly(ctx, tmp_path):
    """A terminal's Ctrl-C goes to the whole foreground process group, the grain
    workers of ``data.worker_count`` too: they ignore it, the run stops and saves as
    without workers (each worker printed a KeyboardInterrupt traceback)."""
    workdir = tmp_path / "run"
    long_run = {"num_train_steps": 100_000, "checkpoint_every": 100_000}
    proc = P.start(
        args(ctx, workdir, **long_run, **{"data.worker_count": 1}), ctx[3], start_new_session=True
    )
    P.wait_until(lambda: P.last_step(workdir) >= 2, proc, poll=0.005)
    assert P.grain_workers(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    for noise in ("Traceback", "KeyboardInterrupt"):
        assert noise not in err, err[-3000:]
    found = re.search(r"stopped by SIGINT at step (\d+)", out)
    assert found, out[-2000:]
    assert P.complete_steps(workdir) == [int(found.group(1))]


def test_read_only_data_dir_without_this_vocab_size(ctx, tmp_path):
    """A shared read-only data_dir holding the corpus's build but no SentencePiece
    model of this vocab_size: one line, exit 3, nothing written (was an OSError
    traceback, exit 1)."""
    with P.tmpfs(tmp_path / "ro", "16m") as mount:
        data_dir = (mount or tmp_path / "ro") / "tfds"
        data.prepare("textfiles", data_dir, ctx[1])
        P.make_read_only(mount, data_dir)
        before = tree_digest(data_dir)
        overrides = {"data.tokenizer": "sentencepiece", "data.vocab_size": 280}
        result = P.run(P.train_args(tmp_path / "run", ctx[1], data_dir, **overrides), ctx[3])
        line = one_error_line(result)
        assert result.returncode == 3, line
        assert re.fullmatch(
            rf"error: data\.data_dir={data_dir}: cannot create \S+/sentencepiece-280\.model "
            r"\(Read-only file system\); choose another data\.data_dir, or make this one a "
            r"writable directory \(a symlink to one will do\)",
            line,
        ), line
        assert tree_digest(data_dir) == before
        assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def sentencepiece_build(ctx):
    """ctx's corpus built, with a SentencePiece model of 280 ids, in a data_dir of its own."""
    data_dir = ctx[0] / "sp-tfds"
    data.load_tokenizer("sentencepiece", 280, "textfiles", data_dir, ctx[1])
    [model] = data_dir.glob("textfiles/*/*/sentencepiece-280.model")
    return data_dir, model.parent.relative_to(data_dir)


def _flip_byte(path, offset=1000):
    content = bytearray(path.read_bytes())
    content[offset] ^= 0xFF
    path.write_bytes(bytes(content))


@pytest.mark.parametrize(
    "damage,damaged",
    [
        (lambda b: os.truncate(b / "textfiles-train.array_record-00000-of-00001", 100), "build"),
        # A flipped byte in a record not read when the split opens is found by the
        # first batch, before the first metrics record (and tensorboard file).
        (lambda b: _flip_byte(b / "textfiles-train.array_record-00000-of-00001"), "build"),
        (lambda b: (b / "dataset_info.json").write_text("garbage\n"), "build"),
        (lambda b: os.truncate(b / "sentencepiece-280.model", 100), "model"),
    ],
    ids=["truncated_array_record", "flipped_byte", "garbled_dataset_info", "truncated_model"],
)
def test_a_damaged_corpus_build_is_one_line(ctx, sentencepiece_build, tmp_path, damage, damaged):
    """A build in data_dir damaged after it was written: one line naming it and saying
    to delete it, exit 3, no workdir left (was a traceback, exit 1, and a workdir)."""
    data_dir = tmp_path / "tfds"
    shutil.copytree(sentencepiece_build[0], data_dir)
    build = data_dir / sentencepiece_build[1]
    damage(build)
    # The default shuffle window (1,024 rows, not the tests' 64) reads this small build
    # whole before the run starts: a flipped byte anywhere in it is found then.
    overrides = {
        "data.tokenizer": "sentencepiece",
        "data.vocab_size": 280,
        "data.shuffle_rows": 1024,
    }
    result = P.run(P.train_args(tmp_path / "run", ctx[1], data_dir, **overrides), ctx[3])
    line = one_error_line(result)
    assert result.returncode == 3, line
    what = "corpus build" if damaged == "build" else "SentencePiece model"
    named = build if damaged == "build" else build / "sentencepiece-280.model"
    assert line.startswith(f"error: the {what} {named} is damaged; delete it and run again"), line
    assert not (tmp_path / "run").exists()


def test_a_record_damaged_mid_run_saves_the_steps_before_it_and_the_run_resumes(ctx, tmp_path):
    """A flipped byte in a record first read mid-run (a window of 64 rows reads the
    build as it goes), here in a grain worker process and between two log steps: exit
    3, one line naming the build and the checkpoint of the steps trained, saved with
    the data position before the batch that failed (they were lost back to the last
    save). Once the build is deleted, the same command builds it again and resumes
    there: its losses equal an undamaged run's."""
    data_dir, steps = tmp_path / "tfds", 60
    data.prepare("textfiles", data_dir, ctx[1])
    [records] = data_dir.glob("textfiles/*/*/textfiles-train.array_record-00000-of-00001")
    _flip_byte(records, offset=9000)  # ~1/3 into this corpus's records
    workdir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    flags = dict(num_train_steps=steps, checkpoint_every=1000, log_every=7)
    flags["data.worker_count"] = 1
    argv = P.train_args(workdir, ctx[1], data_dir, **flags)
    result = P.run(argv, ctx[3])
    line = one_error_line(result)
    assert result.returncode == 3, line
    trained = P.last_step(workdir)  # the steps not yet logged were, before the save
    assert 0 < trained < steps and trained % 7, line  # mid-run, between log steps
    build = records.parent
    assert line.startswith(f"error: the corpus build {build} is damaged; delete it and run"), line
    said = "; the steps trained before the damaged record was read are saved (checkpoint step "
    assert line.endswith(f"{said}{trained} in {ckpts}), and the run resumes there"), line
    assert P.complete_steps(workdir) == [trained]

    shutil.rmtree(build)
    again = P.run(argv, ctx[3])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpts} at step {trained}" in again.stdout, again.stdout
    reference = tmp_path / "reference"
    done = P.run(P.train_args(reference, ctx[1], ctx[2], **flags), ctx[3])
    assert done.returncode == 0, done.stderr[-3000:]
    resumed, uninterrupted = dict(P.losses(workdir)), dict(P.losses(reference))
    # Both log every 7th step and the last; the resumed run also the step it saved.
    assert set(resumed) == set(uninterrupted) | {trained}
    for step, loss in uninterrupted.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-6), step


def test_glob_matching_nothing(ctx):
    files = str(ctx[0] / "nowhere" / "*.txt")
    result = P.run(P.train_args(ctx[0] / "no-data", files, str(ctx[0] / "none-tfds")), ctx[3])
    line = one_error_line(result)
    assert f"error: data.files={files!r} matches no files" in line, line


def _python_child(code: str, *, signal_after: str | None = None, timeout=60):
    """``code`` in a new Python from the repository, with SIGINT's default action (a
    test run as a background job hands it ignored); with ``signal_after`` a line the
    child prints, after which this sends it SIGINT. Returns (status, stdout, stderr)."""
    child = subprocess.Popen(
        P.interruptible([sys.executable, "-c", code]),
        cwd=P.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(P.ROOT)},
    )
    if signal_after is not None:
        while child.stdout.readline().strip() != signal_after:
            assert child.poll() is None, child.stderr.read()
        child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=timeout)
    return child.returncode, out, err


@pytest.mark.parametrize("end", ["return 0", "sys.exit(0)"])  # the latter: absl's app.run
def test_a_stop_that_interrupted_work_ends_the_program_without_finalization(end):
    """train.py stopped while it compiled its initial state printed its line, then
    Python's finalization crashed in jaxlib's compiling thread: SIGSEGV, exit 139 (6 of
    8 SIGTERMs 0.2-0.4 s after its model line). The stop now ends the process at once,
    with the program's status, after what it printed (an atexit callback stands in
    for the finalization)."""
    code = f"""
import atexit, sys
from lexjax import errors
atexit.register(lambda: print("finalized", flush=True))
def program():
    print("stopped by SIGTERM before the first step")
    errors.stopped_mid_work()
    {end}
sys.exit(errors.report(program))
"""
    status, out, err = _python_child(code)
    assert (status, out, err) == (0, "stopped by SIGTERM before the first step\n", "")
    # Without an interrupted stop the program ends as usual.
    status, out, _ = _python_child(code.replace("    errors.stopped_mid_work()\n", ""))
    assert (status, out) == (0, "stopped by SIGTERM before the first step\nfinalized\n")


def test_a_second_ctrl_c_while_a_program_starts_ends_it_in_one_line():
    """A second Ctrl-C while train.py loaded JAX (signals deferred) raised a
    KeyboardInterrupt there: a traceback through JAX's import, or, inside JAX's gc
    callback, nothing at all (the run went on and exited 0)."""
    code = """
import os, signal, time
from lexjax import signals
signals.defer()
os.kill(os.getpid(), signal.SIGINT)  # the first: recorded for train() to act on
print("ready", flush=True)
time.sleep(30)
"""
    status, out, err = _python_child(code, signal_after="ready")
    assert status == -signal.SIGINT and err == "interrupted (Ctrl-C)\n", err


def test_a_ctrl_c_while_the_interpreter_shuts_down_ends_it_as_a_ctrl_c():
    """A Ctrl-C as eval.py finished (in an atexit callback, whose exception Python only
    reports) was swallowed and delivered again to a main thread that had ended: exit 0,
    nothing said, and a shell loop over runs went on."""
    code = """
import atexit, signal, os, sys, time
from lexjax import signals
signals.redeliver_swallowed_interrupts()
def at_exit():
    print("exiting", flush=True)
    time.sleep(30)
atexit.register(at_exit)
"""
    status, out, err = _python_child(code, signal_after="exiting")
    assert status == -signal.SIGINT and err == "interrupted (Ctrl-C)\n", err
