"""Two train.py processes joined by jax.distributed on 127.0.0.1 (4 CPU devices each,
gloo collectives) train like one process on 8 devices, resume elastically (2 → 1 → 2
processes) on the same token stream, and a survivor stops on its own when its peer
is killed; two eval.py processes evaluate and generate like one.

The mesh is (data=2, fsdp=4) with the FSDP sharding preset: each process holds one
data row of the mesh and feeds its rows of every global batch (process i: rows
4i..4i+3). Every process builds the same global stream, so the one-process reference
reads it whole and feeds the same batches to the same 8-device mesh. The runs that
are resumed use a constant learning rate after the warmup, so runs of 3, 6 and 9
steps follow one schedule.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lexjax import checkpoint as ckpt_lib
from lexjax import config as cfg
from lexjax import data as data_lib
from lexjax.steps import TrainSetup
from tests import processes as P

STEPS = 3
MESH = {"mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1, "sharding": "fsdp"}
CONSTANT_LR = {"optim.schedule": "constant"}
RECORDER = "tests/recording_train.py"
HEARTBEAT_S = 5


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return P.context(tmp_path_factory, "multihost", 4)


def start_pair(ctx, workdir, heartbeat_s=60, record=None, late_listing_s=None, **overrides):
    """Two train.py processes joined on 127.0.0.1. The heartbeat timeout is generous
    (a loaded machine can starve a process's heartbeat thread for seconds) except in
    the test of a killed peer, which measures it. With ``record`` (a path prefix) they
    run under tests/recording_train.py, recording the batches of their steps, and
    process 1 lists the checkpoints to delete ``late_listing_s`` late."""
    base, files, data_dir, environ = ctx
    if late_listing_s is not None:
        environ = {**environ, "LATE_LISTING_S": str(late_listing_s)}
    port = P.free_port()
    prefix = [str(record)] if record else []
    return [
        P.start(
            prefix
            + P.train_args(
                workdir,
                files,
                data_dir,
                **MESH,
                **overrides,
                **{
                    "-coordinator_address": f"127.0.0.1:{port}",
                    "-num_processes": 2,
                    "-process_id": i,
                    "-heartbeat_timeout_s": heartbeat_s,
                    "-initialization_timeout_s": 60,
                },
            ),
            environ,
            program=RECORDER if record else "train.py",
        )
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def two_process_run(ctx):
    workdir, tokens = ctx[0] / "two", ctx[0] / "tokens-two"
    procs = start_pair(
        ctx, workdir, record=tokens, num_train_steps=STEPS, checkpoint_every=STEPS, **CONSTANT_LR
    )
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return workdir, outputs, tokens


# gloo's threads print "[Gloo] Rank r is connected to n peer ranks. Expected number of
# connected peer ranks is : m" in pieces, and under load the pieces of two threads
# interleave: a line can end up holding parts of both, or only a number ("7").
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank | is connected to | peer ranks\. ?"
    r"|Expected number of connected peer ranks is : ?"
)


def _gloo(line: str) -> bool:
    """Whether ``line`` is made of gloo's pieces and the numbers between them only."""
    return re.fullmatch(r"[\d\s]*", _GLOO_PIECES.sub(" ", line)) is not None


def test_only_process_0_prints_and_logs(two_process_run):
    """(gloo itself prints its connection lines on every process)"""
    workdir, ((out0, _), (out1, _)), _ = two_process_run
    assert f"trained {STEPS} steps" in out0 and "mesh {'data': 2, 'fsdp': 4" in out0
    assert [line for line in out1.splitlines() if not _gloo(line)] == []
    assert [s for s, _ in P.losses(workdir)] == list(range(1, STEPS + 1))  # one writer


def _eval_pair(ctx, workdir, *args, program="eval.py"):
    """eval.py (or ``program``) as two processes joined on 127.0.0.1 (4 devices each):
    their outputs."""
    procs = _start_eval_pair(ctx, workdir, *args, program=program)
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return outputs


def _start_eval_pair(ctx, workdir, *args, program="eval.py", lead=(), **kwargs) -> list:
    """eval.py (or ``program``, given the arguments ``lead`` first) as processes 0 and 1."""
    port = P.free_port()
    return [
        P.start(
            [
                *lead,
                f"--workdir={workdir}",
                *args,
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                "--initialization_timeout_s=60",
            ],
            ctx[3],
            program=program,
            **kwargs,
        )
        for i in range(2)
    ]


def test_two_processes_evaluate_and_generate_like_one(ctx, two_process_run):
    """eval.py over the two processes' (data=2, fsdp=4) mesh, each holding its shards of
    the parameters: process 0 alone prints and writes WORKDIR/eval, and perplexities,
    attention resolution and passkey results equal those of one process on 8 devices
    (1e-4 relative); greedy text is the same."""
    base, files, _, environ = ctx
    one, two = base / "eval-one", base / "eval-two"
    for workdir in (one, two):
        shutil.copytree(two_process_run[0], workdir)
    args = ["--lengths=32,64", "--max_length=64", f"--eval_files={files}", "--max_docs=6"]
    args.append("--resolution")
    env8 = P.env(8, environ["JAX_COMPILATION_CACHE_DIR"])
    done = P.run([f"--workdir={one}", *args], env8, program="eval.py")
    assert done.returncode == 0, done.stderr[-3000:]
    (out0, _), (out1, err1) = _eval_pair(ctx, two, *args)
    spoken = [line for line in out0.splitlines() if not _gloo(line)]
    assert spoken[0] == "mesh {'data': 2, 'fsdp': 4, 'tensor': 1}", out0[-2000:]
    assert [line for line in out1.splitlines() if not _gloo(line)] == []
    assert [line for line in err1.splitlines() if not _gloo(line)] == []
    cells = {}
    for workdir in (one, two):
        written = json.loads((workdir / "eval" / "perplexity.json").read_text())
        cells[workdir] = {(r["mode"], r["length"]): r["perplexity"] for r in written["results"]}
    assert len(cells[one]) == 4 and cells[two].keys() == cells[one].keys()
    for cell, value in cells[one].items():
        assert cells[two][cell] == pytest.approx(value, rel=1e-4), cell
    resolution = [json.loads((w / "eval" / "resolution.json").read_text()) for w in (one, two)]
    want = [(r["mode"], r["length"], r["mean"]) for r in resolution[0]["results"]]
    got = [(r["mode"], r["length"], r["mean"]) for r in resolution[1]["results"]]
    assert [w[:2] for w in got] == [w[:2] for w in want] and len(want) == 4
    np.testing.assert_allclose([g[2] for g in got], [w[2] for w in want], rtol=1e-4)

    keys = ["--passkey", "--lengths=80", "--passkey_depths=0,1", "--passkey_trials=3"]
    done = P.run([f"--workdir={one}", *keys], env8, program="eval.py")
    assert done.returncode == 0, done.stderr[-3000:]
    # Process 1 lists no step here: both read the one process 0 listed.
    _eval_pair(ctx, two, *keys, program="tests/unlisted_eval.py")
    found = [json.loads((w / "eval" / "passkey.json").read_text())["results"] for w in (one, two)]
    assert len(found[0]) == 4 and [r["accuracy"] for r in found[1]] == [
        r["accuracy"] for r in found[0]
    ]
    np.testing.assert_allclose(
        [r["answer_nats"] for r in found[1]], [r["answer_nats"] for r in found[0]], rtol=1e-4
    )

    greedy = ["--generate", "--prompt=alpha beta", "--temperature=0", "--max_new_tokens=40"]
    done = P.run([f"--workdir={one}", *greedy], env8, program="eval.py")
    assert done.returncode == 0, done.stderr[-3000:]
    (text, _), (silent, _) = _eval_pair(ctx, two, *greedy)
    # gloo's C++ lines share the pipe with Python's and once left a blank line ahead
    # of the text (CI of this test, 2026-12-03): compare what is not gloo's.
    lines = lambda out: [x for x in out.splitlines(keepends=True) if not _gloo(x)]
    assert lines(text) == lines(done.stdout), (text, done.stdout)
    assert lines(text)[0].startswith("alpha beta"), text
    assert [line for line in silent.splitlines() if not _gloo(line)] == []


def test_when_process_0s_reader_goes_away_both_generating_processes_stop(ctx, two_process_run):
    """`eval.py --generate … | head` over two processes, the reader gone before the first
    text: process 0 finds its stdout closed at its first chunk and says so, and both stop
    there: process 0 exits 141 quietly, the other 0. (Process 0 used to leave alone,
    and the processes ended in a coordination-service abort, status -6.)"""
    workdir = ctx[0] / "eval-head"
    shutil.copytree(two_process_run[0], workdir)
    greedy = ["--generate", "--prompt=ab", "--temperature=0"]  # "abbb…": no end of text
    # Two chunks of 32 tokens (generation.CHUNK is 1024): a stop after the first.
    procs = _start_eval_pair(
        ctx, workdir, *greedy, "--max_new_tokens=64", program="tests/chunked_eval.py", lead=["32"]
    )
    procs[0].stdout.close()  # as `head` does, here before the first text
    errs = [p.communicate(timeout=400)[1] for p in procs]
    assert procs[0].returncode == 141 and "Traceback" not in errs[0], errs[0][-2000:]
    assert procs[1].returncode == 0, errs[1][-2000:]


def _reference(config, steps):
    """``steps`` steps in this one process on 8 devices, fed the whole global stream:
    (setup, losses, final params, the batches)."""
    setup = TrainSetup(config)
    source = data_lib.load_source(
        "textfiles", "train", data_dir=config.data.data_dir, files=config.data.files
    )
    stream = data_lib.make_train_iterator(
        source,
        seq_len=config.train_len,
        batch_size=config.batch_size,
        seed=config.seed,
        shuffle_rows=config.data.shuffle_rows,
    )
    batches = [next(stream) for _ in range(steps)]
    state, losses = setup.init_state(), []
    with jax.set_mesh(setup.mesh):
        for batch in batches:
            state, metrics = setup.train_step(state, setup.global_batch(batch))
            losses.append(float(metrics["loss"]))
    return setup, losses, jax.device_get(state.params), batches


def _stored_config(workdir):
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True)
    try:
        return cfg.from_configdict(ckpt.restore_config())
    finally:
        ckpt.close()


def test_two_processes_match_one_and_their_checkpoint_restores_in_one(two_process_run):
    """Losses and parameters agree up to float32 summation order (rtol 1e-5):
    gloo's cross-process all-reduce adds in another order than one process does (and
    this process compiles at XLA:CPU's level 0, tests/conftest.py, where the two
    train.py processes compile at the default level)."""
    workdir, _, _ = two_process_run
    config = _stored_config(workdir)
    assert (config.mesh.data, config.mesh.fsdp) == (2, 4)
    setup, ref_losses, ref_params, _ = _reference(config, STEPS)
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True)
    state, _, step = ckpt.restore(abstract_state=setup.abstract_state)
    ckpt.close()
    assert step == STEPS
    np.testing.assert_allclose([loss for _, loss in P.losses(workdir)], ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        jax.device_get(state.params),
        ref_params,
    )


def _recorded(prefix, processes: int) -> list[dict[str, np.ndarray]]:
    """The global batches a run's steps consumed: its processes' rows in process order."""
    rows = [
        [json.loads(line) for line in pathlib.Path(f"{prefix}.p{i}.jsonl").read_text().splitlines()]
        for i in range(processes)
    ]
    assert len({len(r) for r in rows}) == 1, [len(r) for r in rows]
    return [
        {k: np.concatenate([np.asarray(r[s][k], np.int32) for r in rows]) for k in rows[0][s]}
        for s in range(len(rows[0]))
    ]


def test_elastic_resume_2_to_1_to_2_processes_continues_the_token_stream(ctx, two_process_run):
    """The two-process run's 3 steps, then 3 more in one process (8 devices, same mesh),
    then 3 more in two processes again: the tokens every step consumed equal those of an
    uninterrupted one-process run exactly (no document repeated or skipped, same rows in
    the same places), and the losses agree up to float32 summation order.

    The last leg keeps one checkpoint, so its first save deletes step 3, and process 1
    lists the steps late: each process deciding from its own listing, process 1 found
    step 3 gone and skipped the deletion's collective (an abort inside gloo)."""
    first, _, tokens_first = two_process_run
    base, files, data_dir, environ = ctx
    workdir = base / "elastic"
    shutil.copytree(first, workdir)
    tokens_one, tokens_two = base / "tokens-elastic-one", base / "tokens-elastic-two"
    one = P.run(
        [
            str(tokens_one),
            *P.train_args(
                workdir,
                files,
                data_dir,
                **MESH,
                **CONSTANT_LR,
                num_train_steps=2 * STEPS,
                checkpoint_every=STEPS,
            ),
        ],
        {**environ, "XLA_FLAGS": P.xla_flags(8)},
        program=RECORDER,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert f"at step {STEPS}" in one.stdout and "restarts" not in one.stderr
    procs = start_pair(
        ctx,
        workdir,
        record=tokens_two,
        late_listing_s=2,
        num_train_steps=3 * STEPS,
        checkpoint_every=STEPS,
        keep_checkpoints=1,
        **CONSTANT_LR,
    )
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
        assert "restarts" not in err
    assert f"resumed from {workdir / 'checkpoints'} at step {2 * STEPS}" in outputs[0][0]
    assert ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True).all_steps() == [3 * STEPS]

    consumed = _recorded(tokens_first, 2) + _recorded(tokens_one, 1) + _recorded(tokens_two, 2)
    _, ref_losses, _, ref_batches = _reference(_stored_config(workdir), 3 * STEPS)
    assert len(consumed) == len(ref_batches) == 3 * STEPS
    for got, want in zip(consumed, ref_batches):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    logged = P.losses(workdir)
    assert [s for s, _ in logged] == list(range(1, 3 * STEPS + 1))
    np.testing.assert_allclose([loss for _, loss in logged], ref_losses, rtol=1e-5)


def test_sigterm_to_one_process_makes_both_save_the_same_step_and_exit_0(ctx):
    """Only the worker gets SIGTERM; the processes agree at the next log step, save that
    step together (each the same data position) and exit 0; process 0 says why."""
    workdir = ctx[0] / "sigterm-one"
    procs = start_pair(ctx, workdir, num_train_steps=100_000, checkpoint_every=100_000)
    P.wait_until(lambda: P.last_step(workdir) >= 3, procs[0])
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    match = re.search(r"stopped by a signal to another process at step (\d+)", outputs[0][0])
    assert match, outputs[0][0][-2000:]
    stopped = int(match.group(1))
    assert stopped == P.last_step(workdir) >= 3
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True)
    assert ckpt.all_steps() == [stopped]  # one step, saved by both processes together
    ckpt.close()
    step_dir = workdir / "checkpoints" / str(stopped)
    integrity = json.loads((step_dir / "integrity" / "metadata").read_text())
    assert integrity["data_iter"]["process_count"] == 2
    assert integrity["data_iter"]["shared"]  # one global stream: the same position on both
    assert len(set(integrity["data_iter"]["sha256"])) == 1
    for i, digest in enumerate(integrity["data_iter"]["sha256"]):  # each process's position
        position = json.loads((step_dir / "data_iter" / f"process_{i}-of-2.json").read_text())
        canonical = json.dumps(position, sort_keys=True).encode()
        assert hashlib.sha256(canonical).hexdigest() == digest


def test_a_sigterm_that_ends_a_grain_worker_too_stops_both_where_they_agree(ctx):
    """``data.worker_count=1``: process 0's grain worker ends with the SIGTERM to
    process 0 (a scheduler's or a shutdown's signal reaches every process) while
    process 0 waits for its next batch and process 1 for process 0. Process 0
    replaces its iterator at the position reached; both stop at the next step, save
    it together and exit 0, and the steps consumed the uninterrupted stream's tokens
    (process 0 raised grain's error and the pair lost every step since the last
    checkpoint)."""
    workdir, tokens = ctx[0] / "worker-sigterm", ctx[0] / "tokens-worker-sigterm"
    long_run = {"num_train_steps": 100_000, "checkpoint_every": 100_000}
    procs = start_pair(ctx, workdir, record=tokens, **long_run, **{"data.worker_count": 1})
    P.wait_until(lambda: P.last_step(workdir) >= 2, procs[0], poll=0.005)
    [worker] = P.grain_workers(procs[0].pid)
    os.kill(worker, signal.SIGSTOP)
    stepped = P.settled_step(workdir, procs[0])  # process 0 drained its prefetch, waits
    os.kill(worker, signal.SIGTERM)  # delivered with the SIGCONT: the worker ends
    procs[0].send_signal(signal.SIGTERM)
    os.kill(worker, signal.SIGCONT)
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert f"stopped by SIGTERM at step {stepped + 1}" in outputs[0][0], outputs[0][0][-2000:]
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True)
    assert ckpt.all_steps() == [stepped + 1]
    ckpt.close()
    consumed = _recorded(tokens, 2)
    _, _, _, ref_batches = _reference(_stored_config(workdir), stepped + 1)
    assert len(consumed) == len(ref_batches)
    for got, want in zip(consumed, ref_batches):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-killed", "coordinator-killed"])
def test_killed_peer_stops_the_survivor_in_bounded_time(ctx, victim):
    workdir = ctx[0] / f"kill-{victim}"
    procs = start_pair(
        ctx, workdir, heartbeat_s=HEARTBEAT_S, num_train_steps=100_000, checkpoint_every=100_000
    )
    P.wait_until(lambda: P.last_step(workdir) >= 3, procs[0])
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = procs[1 - victim]
    out, err = survivor.communicate(timeout=HEARTBEAT_S + 60)
    elapsed = time.monotonic() - killed_at
    procs[victim].wait()
    assert survivor.returncode != 0
    assert elapsed < HEARTBEAT_S + 30, elapsed
    assert "Terminating process because the JAX distributed service detected fatal errors" in err
    assert "another task died" in err, err[-3000:]


def test_unreachable_coordinator_or_taken_port_ends_in_one_line_and_status_7(ctx):
    """JAX aborts (status 134, a C++ stack) when a process cannot register in time, and
    on a taken port it raised in one run and segfaulted in another; so a worker first
    waits for process 0 in Python, and process 0 checks its port. Both are a run that
    cannot start: one line, status 7."""
    base, files, data_dir, environ = ctx
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        unused = P.free_port()
        for process_id, address in [(1, f"127.0.0.1:{unused}"), (0, f"127.0.0.1:{port}")]:
            flags = {
                "-coordinator_address": address,
                "-num_processes": 2,
                "-process_id": process_id,
                "-initialization_timeout_s": 3,
            }
            done = P.run(
                P.train_args(base / f"join-{process_id}", files, data_dir, **flags), environ
            )
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 7, done.stderr[-3000:]
            assert lines[-1].startswith("error: ") and address in lines[-1], lines
            assert "Traceback" not in done.stderr and "stack trace" not in done.stderr


def test_processes_started_with_different_process_counts_stop_in_one_line(ctx):
    """Process 0 told of 3 processes, process 1 of 2: neither can finish registering,
    and jaxlib aborted both (status 134, a C++ stack naming no flag) about 4 s after
    the initialization timeout. Both now stop just after it, in one line, status 7."""
    base, files, data_dir, environ = ctx
    address = f"127.0.0.1:{P.free_port()}"
    procs = [
        P.start(
            P.train_args(
                base / "miscounted",
                files,
                data_dir,
                **{
                    "-coordinator_address": address,
                    "-num_processes": count,
                    "-process_id": process_id,
                    "-initialization_timeout_s": 5,
                },
            ),
            environ,
        )
        for process_id, count in [(0, 3), (1, 2)]
    ]
    for proc, count in zip(procs, (3, 2)):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 7, err[-3000:]
        assert err.strip().splitlines() == [
            f"error: could not join the multi-process run via {address} within 5s: not every "
            f"process registered (--num_processes={count} here); start every process with "
            "the same --coordinator_address and --num_processes, and distinct --process_id"
        ], err[-3000:]
    assert not (base / "miscounted" / "checkpoints").exists()


def test_processes_started_with_different_settings_stop_in_one_line_naming_them(
    ctx, two_process_run
):
    """Other step counts hung both processes in a collective no heartbeat ends (and
    SIGTERM did not stop them); another seed trained silently on another data order
    than the checkpoint records; other eval lengths aborted inside gloo. Every
    process now compares what it was given before any work: one line, status 7."""
    base, files, data_dir, environ = ctx
    port = P.free_port()
    cluster = {"-coordinator_address": f"127.0.0.1:{port}", "-num_processes": 2}
    cluster |= {"-initialization_timeout_s": 60}
    differ = [{"num_train_steps": 3, "seed": 0}, {"num_train_steps": 5, "seed": 7}]
    procs = [
        P.start(
            P.train_args(
                base / "differ",
                files,
                data_dir,
                **MESH,
                **differ[i],
                **cluster,
                **{"-process_id": i},
            ),
            environ,
        )
        for i in range(2)
    ]
    said = (
        "error: num_train_steps, seed differ between processes (process 1 from process 0); "
        "start every process of train.py with the same flags"
    )
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 7, err[-3000:]
            assert said in err.splitlines() and "Traceback" not in err, err[-3000:]
    finally:
        for p in procs:  # (they hung, before: leave none behind)
            p.kill()
    assert not (base / "differ" / "checkpoints").exists()

    workdir = two_process_run[0]
    port = P.free_port()
    procs = [
        P.start(
            [
                f"--workdir={workdir}",
                f"--lengths={lengths}",
                "--max_docs=1",
                "--modes=bca",
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                "--initialization_timeout_s=60",
            ],
            environ,
            program="eval.py",
        )
        for i, lengths in enumerate(["32,64", "32"])
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 7, err[-3000:]
            assert "error: --lengths differ between processes (process 1 from process 0); " in err
    finally:
        for p in procs:
            p.kill()


def test_a_coordinator_port_out_of_range_is_a_one_line_config_error():
    """Port 99999 passed: process 0 ended in bind()'s OverflowError traceback, and the
    others dialled port 34463 (getaddrinfo takes it modulo 2^16)."""
    from lexjax import distributed
    from lexjax.errors import ConfigError

    def check(port):
        address = f"127.0.0.1:{port}"
        cluster = distributed.ClusterOptions(
            coordinator_address=address, num_processes=2, process_id=0
        )
        return distributed._check(cluster)

    for port in (0, 65536, 99999):
        with pytest.raises(ConfigError, match=rf"^--coordinator_address='127\.0\.0\.1:{port}': "):
            check(port)
    assert check(1) and check(65535)


def test_distributed_on_with_no_coordinator_and_no_cluster_says_so(ctx):
    """It said "could not join ... within 30s (coordinator_address should be defined.)"
    after 2 s: no wait happened and no cluster was detected."""
    base, files, data_dir, environ = ctx
    flags = {"-distributed": "on", "-num_processes": 2, "-process_id": 1}
    flags["-initialization_timeout_s"] = 30
    environ = {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    done = P.run(P.train_args(base / "nothing", files, data_dir, **flags), environ, timeout=120)
    assert done.returncode == 7, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert "no --coordinator_address was given and no cluster launcher was detected" in line
    assert "within" not in line, line


_TERMINATED_AFTER_JOINING = """
import os, signal, sys, time
from lexjax import distributed

port = sys.argv[1]
distributed.initialize(
    distributed.ClusterOptions(
        coordinator_address=f"127.0.0.1:{port}", num_processes=1, process_id=0
    )
)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("survived SIGTERM")
"""


def test_a_sigterm_after_joining_takes_pythons_action_not_jaxlibs():
    """jax.distributed.initialize hands SIGTERM to jaxlib's preemption notifier, which
    logged it and went on: a multi-process eval.py ignored it until a SIGKILL, and a
    stop train.py deferred while starting was lost. (One process joined on 127.0.0.1.)"""
    done = subprocess.run(
        [sys.executable, "-c", _TERMINATED_AFTER_JOINING, str(P.free_port())],
        cwd=P.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    assert "survived" not in done.stdout


def test_a_cpu_run_of_several_processes_turns_the_compilation_cache_off_where_it_hangs(
    monkeypatch, capsys, tmp_path
):
    """Under jax 0.12.1, process 0 of a joined CPU run reading a cache entry another
    program wrote (its peers never find theirs) waits forever in the first collective:
    this module's runs hung there with their shared JAX_COMPILATION_CACHE_DIR (eval.py
    after train.py). Joining turns the cache off there, process 0 saying so in one
    line; under jax 0.12.0.1 and older, or with no cache, nothing changes."""
    from lexjax import distributed

    settings = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    before = {name: getattr(jax.config, name) for name in settings}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    try:
        for directory, version, index, off in (
            (tmp_path, (0, 12, 0, 1), 0, False),
            (None, (0, 12, 1), 0, False),
            (tmp_path, (0, 12, 1), 0, True),
            (tmp_path, (0, 13, 0), 1, True),
        ):
            jax.config.update("jax_compilation_cache_dir", directory and str(directory))
            jax.config.update("jax_enable_compilation_cache", True)
            monkeypatch.setattr(jax, "__version_info__", version)
            monkeypatch.setattr(jax, "process_index", lambda index=index: index)
            distributed._no_cache_on_cpu_processes()
            assert jax.config.jax_enable_compilation_cache is not off, (directory, version)
            err = capsys.readouterr().err
            if off and index == 0:
                assert err.startswith("note: JAX's persistent compilation cache is off")
                assert err.count("\n") == 1 and str(tmp_path) in err
            else:
                assert err == ""
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
