"""Two train.py processes joined by jax.distributed on 127.0.0.1 (4 CPU devices each,
gloo collectives) train like one process on 8 devices, write a checkpoint that one
process restores, and a survivor stops on its own when its peer is killed.

The mesh is (data=2, fsdp=4) with the FSDP sharding preset: each process holds one
data row of the mesh and reads its own half of the corpus (documents i ≡ process
id mod 2), so the one-process reference feeds the same global batch — process 0's
rows, then process 1's — to the same 8-device mesh.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time

import jax
import numpy as np
import pytest

from lexjax import checkpoint as ckpt_lib
from lexjax import config as cfg
from lexjax import data as data_lib
from lexjax.errors import CheckpointError
from lexjax.steps import TrainSetup
from tests import processes as P

STEPS = 3
MESH = {"mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1, "sharding": "fsdp"}
HEARTBEAT_S = 5


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return P.context(tmp_path_factory, "multihost", 4)


def start_pair(ctx, workdir, heartbeat_s=60, **overrides):
    """Two train.py processes joined on 127.0.0.1. The heartbeat timeout is generous
    (a loaded machine can starve a process's heartbeat thread for seconds) except in
    the test of a killed peer, which measures it."""
    base, files, data_dir, environ = ctx
    port = P.free_port()
    return [
        P.start(
            P.train_args(
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
        )
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def two_process_run(ctx):
    workdir = ctx[0] / "two"
    procs = start_pair(ctx, workdir, num_train_steps=STEPS, checkpoint_every=STEPS)
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return workdir, outputs


def test_only_process_0_prints_and_logs(two_process_run):
    """(gloo itself prints its connection lines on every process)"""
    workdir, ((out0, _), (out1, _)) = two_process_run
    assert f"trained {STEPS} steps" in out0 and "mesh {'data': 2, 'fsdp': 4" in out0
    assert [line for line in out1.splitlines() if not line.startswith("[Gloo]")] == []
    assert [s for s, _ in P.losses(workdir)] == list(range(1, STEPS + 1))  # one writer


def _reference(config):
    """STEPS steps in this one process on 8 devices, fed both processes' rows."""
    setup = TrainSetup(config)
    source = data_lib.load_source(
        "textfiles", "train", data_dir=config.data.data_dir, files=config.data.files
    )
    shards = [
        data_lib.make_train_iterator(
            source,
            seq_len=config.train_len,
            batch_size=config.batch_size // 2,
            seed=config.seed,
            shard_index=i,
            shard_count=2,
        )
        for i in range(2)
    ]
    state, losses = setup.init_state(), []
    with jax.set_mesh(setup.mesh):
        for _ in range(STEPS):
            rows = [next(it) for it in shards]
            batch = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
            state, metrics = setup.train_step(state, setup.global_batch(batch))
            losses.append(float(metrics["loss"]))
    return setup, losses, jax.device_get(state.params)


def test_two_processes_match_one_and_their_checkpoint_restores_in_one(two_process_run):
    """Losses and parameters agree up to float32 summation order (rtol 1e-5):
    gloo's cross-process all-reduce adds in another order than one process does."""
    workdir, _ = two_process_run
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True)
    config = cfg.from_configdict(ckpt.restore_config())
    assert (config.mesh.data, config.mesh.fsdp) == (2, 4)
    setup, ref_losses, ref_params = _reference(config)
    state, _, step = ckpt.restore(abstract_state=setup.abstract_state)
    ckpt.close()
    assert step == STEPS
    np.testing.assert_allclose([loss for _, loss in P.losses(workdir)], ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        jax.device_get(state.params),
        ref_params,
    )


def test_one_process_run_refuses_to_resume_two_processes_data(ctx, two_process_run):
    """Resuming needs each process's data position: a one-process train.py says so."""
    workdir, _ = two_process_run
    base, files, data_dir, environ = ctx
    result = P.run(
        P.train_args(workdir, files, data_dir, **MESH, num_train_steps=STEPS + 1),
        {**environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert result.returncode == CheckpointError.exit_code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "holds data iterator state for 2 processes, this run has 1" in result.stderr


def test_sigterm_to_one_process_makes_both_save_the_same_step_and_exit_0(ctx):
    """Only the worker gets SIGTERM; the processes agree at the next log step, save that
    step together (each its own data position) and exit 0; process 0 says why."""
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
    for i, digest in enumerate(integrity["data_iter"]["sha256"]):  # each process's position
        position = json.loads((step_dir / "data_iter" / f"process_{i}-of-2.json").read_text())
        canonical = json.dumps(position, sort_keys=True).encode()
        assert hashlib.sha256(canonical).hexdigest() == digest


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
