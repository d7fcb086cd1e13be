"""Checkpoints round-trip, move between meshes, and refuse damaged steps."""

import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lexjax.checkpoint import Checkpointer, CheckpointError, _record_sha256

# Orbax leaves un-awaited read coroutines behind when tensorstore fails on a
# damaged file; that is the failure under test, not a leak of ours.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

ROWS = 512  # big enough that OCDBT keeps the arrays in data files, not b-tree nodes


def mesh_of(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def host_params(seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((rows, 16)).astype(np.float32),
        "b": np.zeros((16,), np.float32),
        # Random integers do not compress, so their bytes appear verbatim on disk.
        "counts": rng.integers(0, 2**31, (rows, 16), dtype=np.int32),
    }


def make_state(mesh, seed=0, rows=ROWS):
    spec = {"w": P("data"), "b": P(), "counts": P("data")}
    params = {
        k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec[k]), lambda i, v=v: v[i])
        for k, v in host_params(seed, rows).items()
    }
    state = {"params": params, "opt": optax.adam(1e-3).init(params), "step": jnp.int32(seed)}

    def global_array(x):  # as a jitted train step would leave it, also with several processes
        if isinstance(x.sharding, NamedSharding):
            return x
        value = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda i: value[i])

    return jax.tree.map(global_array, state)


def abstract(state, mesh, spec_for=lambda path: None):
    def leaf(path, x):
        spec = spec_for(jax.tree_util.keystr(path)) if x.ndim else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec or P()))

    return jax.tree_util.tree_map_with_path(leaf, state)


def assert_same(a, b):
    from jax.experimental import multihost_utils

    def host(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x)

    jax.tree.map(lambda x, y: np.testing.assert_array_equal(host(x), host(y)), a, b)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A directory with good steps 1 and 2 (different values), made once."""
    path = tmp_path_factory.mktemp("two_steps") / "ckpt"
    mesh = mesh_of(8)
    ckpt = Checkpointer(path, keep=None)
    for step in (1, 2):
        ckpt.save(
            step,
            make_state(mesh, seed=step),
            config={"seed": step},
            tokenizer={"kind": "test", "step": step},
        )
    ckpt.close()
    return path


def fresh_copy(two_steps, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(two_steps, target)
    return target


def copy_with_flipped_step_2(two_steps, tmp_path):
    """A copy of the two-step checkpoint whose step 2 has one flipped array byte;
    returns (path, mesh, the state saved at step 2)."""
    path = fresh_copy(two_steps, tmp_path)
    flip_byte(path / "2", host_params(2)["counts"])
    mesh = mesh_of(8)
    return path, mesh, make_state(mesh, seed=2)


def data_files_holding(step_dir, value):
    """Files under step_dir/state whose bytes contain a slice of `value`."""
    needle = np.ascontiguousarray(value[ROWS // 2 : ROWS // 2 + 8]).tobytes()
    hits = []
    for f in sorted(pathlib.Path(step_dir, "state").rglob("*")):
        if f.is_file() and (at := f.read_bytes().find(needle)) >= 0:
            hits.append((f, at))
    assert hits, "array bytes not found verbatim in any file"
    return hits


def test_round_trip_is_exact(tmp_path):
    mesh = mesh_of(8)
    state = make_state(mesh)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    assert ckpt.save(5, state, config={"model": {"d": 16}})
    restored, config, step = ckpt.restore(abstract_state=abstract(state, mesh))
    assert (step, config) == (5, {"model": {"d": 16}})
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert_same(restored, state)
    assert ckpt.restore_config() == {"model": {"d": 16}}
    ckpt.close()


def test_a_given_step_restores_that_step_or_names_the_complete_ones(two_steps, tmp_path):
    """restore(1) with step 2 newer reads step 1 (values, config and step); a step
    that was never saved is an error listing the complete steps, not the newest one."""
    path, mesh = fresh_copy(two_steps, tmp_path), mesh_of(8)
    ckpt = Checkpointer(path, read_only=True)
    assert ckpt.latest_step() == 2
    state1 = make_state(mesh, seed=1)
    restored, config, step = ckpt.restore(1, abstract_state=abstract(state1, mesh))
    assert (step, config) == (1, {"seed": 1})
    assert_same(restored, state1)
    complete = re.escape("no complete checkpoint for step 3 in ") + r".*; complete steps: \[1, 2\]$"
    with pytest.raises(CheckpointError, match=complete):
        ckpt.restore(3, abstract_state=abstract(state1, mesh))
    ckpt.close()


def test_a_step_saved_again_after_going_back_is_written(tmp_path):
    """Save 1 and 2, go back and save 1 again (step 2 moved aside): a later save of
    step 2 is of another history and is written, not skipped as saved already."""
    mesh = mesh_of(8)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=None, async_save=False)
    state1, state3 = make_state(mesh, seed=1), make_state(mesh, seed=3)
    assert ckpt.save(1, state1) and ckpt.save(2, state1)
    assert ckpt.save(1, state1, force=True)  # step 2 moved to superseded/
    assert ckpt.all_steps() == [1]
    assert ckpt.save(2, state3)
    restored, _, step = ckpt.restore(abstract_state=abstract(state3, mesh))
    assert step == 2
    assert_same(restored, state3)
    ckpt.close()


def test_a_state_on_several_device_sets_saves_and_restores(tmp_path):
    """Leaves on an 8-device mesh, on one device and on a 4-device mesh: the checksum
    took every leaf into one computation, which refuses arguments on different
    devices (a ValueError at save, and every step "damaged" at restore)."""
    from lexjax import checkpoint

    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    state = {
        "w": jax.device_put(value, NamedSharding(mesh_of(8), P("data"))),
        "rng": jax.device_put(jnp.arange(4, dtype=jnp.uint32), jax.devices()[0]),
        "v": jax.device_put(value + 1, NamedSharding(mesh_of(4), P(None, "data"))),
    }
    records = checkpoint._leaf_records(sorted(state.items()))
    assert {k: r["mix64"] for k, r in records.items()} == {
        k: checkpoint._host_digest(np.asarray(x)) for k, x in state.items()
    }
    ckpt = Checkpointer(tmp_path / "ckpt", on_corrupt="error")
    ckpt.save(1, state)
    ckpt.wait()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored, _, step = ckpt.restore(abstract_state=target)
    assert step == 1
    assert_same(restored, state)
    ckpt.close()


def test_restore_onto_another_mesh(tmp_path):
    state = make_state(mesh_of(8))
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, state)
    ckpt.wait()
    small = mesh_of(2)
    spec_for = lambda name: P(None, "data") if name.endswith("['w']") else None
    target = abstract(state, small, spec_for)
    restored, _, _ = ckpt.restore(abstract_state=target)
    assert_same(restored, state)
    jax.tree.map(
        lambda x, t: (x.sharding == t.sharding) or pytest.fail(f"{x.sharding} != {t.sharding}"),
        restored,
        target,
    )
    assert restored["params"]["w"].sharding.spec == P(None, "data")
    assert len(restored["params"]["w"].sharding.device_set) == 2
    ckpt.close()


def test_keep_n_deletes_only_the_oldest(tmp_path):
    mesh = mesh_of(8)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    for step in range(1, 5):
        ckpt.save(step, make_state(mesh, rows=8))
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
    ckpt.close()


def test_process_1_moves_and_deletes_no_step_process_0_does(tmp_path, monkeypatch):
    """On a shared directory process 0 alone renames a step aside or deletes it
    (README: orbax writes checkpoints cooperatively; a second rename of one step
    fails); process 1 (simulated) waits at the barrier and finds them as
    process 0 leaves them."""
    from jax.experimental import multihost_utils

    mesh = mesh_of(8)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=None)
    for step in (1, 2):
        ckpt.save(step, make_state(mesh, rows=8))
    ckpt.wait()
    barriers = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(multihost_utils, "sync_global_devices", barriers.append)
    try:
        ckpt._delete([1])
        ckpt._supersede([2])
    finally:
        monkeypatch.undo()
    assert barriers == ["lexjax_delete_1", "lexjax_supersede_2"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2"]
    ckpt.close()


def test_close_finishes_the_write_and_runs_no_collective(tmp_path, monkeypatch):
    """close() collected garbage, whose collectives (process 0's listing, the checks of
    the steps) hung a two-process run that one process left by an error: it waited
    there while the other waited in the training loop's. The loop's wait() collects."""
    from lexjax import checkpoint

    mesh = mesh_of(8)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=1, async_save=True)
    for step in (1, 2):
        ckpt.save(step, make_state(mesh, rows=8))

    def collective(*args):
        raise AssertionError("close() ran a collective")

    monkeypatch.setattr(checkpoint, "process_0s", collective)
    monkeypatch.setattr(checkpoint, "all_processes", collective)
    ckpt.close()
    assert Checkpointer(tmp_path / "ckpt", read_only=True).all_steps() == [1, 2]  # finished


def test_async_save_then_wait(tmp_path):
    mesh = mesh_of(8)
    state = make_state(mesh)
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=True)
    ckpt.save(10, state)
    ckpt.wait()
    assert ckpt.latest_step() == 10
    reopened = Checkpointer(tmp_path / "ckpt")
    restored, _, step = reopened.restore(abstract_state=abstract(state, mesh))
    assert step == 10
    assert_same(restored, state)
    ckpt.close()
    reopened.close()


def test_resumed_iterator_continues_identically(tmp_path):
    def make_iter():
        return iter(grain.MapDataset.range(100).shuffle(seed=0).batch(4).to_iter_dataset())

    mesh = mesh_of(8)
    state = make_state(mesh, rows=8)
    it = make_iter()
    for _ in range(3):
        next(it)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, state, data_iter=it)
    expected = [next(it).tolist() for _ in range(5)]
    ckpt.wait()
    resumed = make_iter()
    ckpt.restore(abstract_state=abstract(state, mesh), data_iter=resumed)
    assert [next(resumed).tolist() for _ in range(5)] == expected
    ckpt.close()


def _iterator_records(tmp_path):
    """A step saved at iterator position 3 (one process), and the batches after it."""
    mesh = mesh_of(8)
    state = make_state(mesh, rows=8)
    it = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
    for _ in range(3):
        next(it)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, state, data_iter=it)
    ckpt.close()
    return tmp_path / "ckpt" / "3", abstract(state, mesh), [next(it).tolist() for _ in range(2)]


def _as_if_saved_by(step_dir, process_count, shared, stream=None):
    """Rewrites step_dir's iterator record as a writer with ``process_count`` processes
    would have left it: every process's file, its digest, and ``shared`` (None: the key
    absent, as lexjax wrote it before the stream was one for any process count), and
    ``stream`` the stream version it wrote (None: this lexjax's)."""
    path = step_dir / "integrity" / "metadata"
    integrity = json.loads(path.read_text())
    record = integrity["data_iter"]
    own = step_dir / "data_iter" / "process_0-of-1.json"
    for i in range(process_count):
        text = own.read_text()
        if not shared and i:  # another process's position in its own shard
            text = text.replace('"next_index": 3', f'"next_index": {3 + i}')
        (step_dir / "data_iter" / f"process_{i}-of-{process_count}.json").write_text(text)
        digest = hashlib.sha256(json.dumps(json.loads(text), sort_keys=True).encode())
        record["sha256"][i:] = [digest.hexdigest()]
    record["process_count"] = process_count
    if shared is None:  # nor the stream version, which came later still
        del record["shared"], record["stream"]
    else:
        record["shared"] = shared
    if stream is not None:
        record["stream"] = stream
    if shared is None:  # nor a digest of the record itself
        integrity.pop("self_sha256")
    else:  # as the writer sealed it
        integrity["self_sha256"] = _record_sha256(integrity)
    path.write_text(json.dumps(integrity))


@pytest.mark.parametrize(
    "process_count, shared, stream, note",
    [
        # one process, older lexjax: packing order, before the row shuffle
        (1, None, None, "a position in the data stream of an older lexjax (stream 1, now 3"),
        (2, True, None, None),  # the global stream saved by two processes
        (2, None, None, "a position in the data stream of an older lexjax (stream 1, now 3"),
        # per-process positions of another process count
        (2, False, None, "holds per-process data positions of 2 processes (this run has 1)"),
        # the row shuffle, before chunks were taken in turn from open documents
        (1, True, 2, "a position in the data stream of an older lexjax (stream 2, now 3"),
    ],
    ids=["old-one-process", "shared-two", "old-two-processes", "per-process-two", "stream-2"],
)
def test_iterator_state_of_other_process_counts_and_older_lexjax(
    tmp_path, caplog, process_count, shared, stream, note
):
    """A position restores wherever it means the same; otherwise the stream restarts
    from its beginning with a one-line note (and the train state still restores)."""
    step_dir, target, expected = _iterator_records(tmp_path)
    _as_if_saved_by(step_dir, process_count, shared, stream)
    ckpt = Checkpointer(tmp_path / "ckpt")
    resumed = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        _, _, step = ckpt.restore(abstract_state=target, data_iter=resumed)
    ckpt.close()
    assert step == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "lexjax.checkpoint"]
    if note is None:
        assert warnings == []
        assert [next(resumed).tolist() for _ in range(2)] == expected
    else:
        assert len(warnings) == 1 and "\n" not in warnings[0]
        assert note in warnings[0]
        assert warnings[0].endswith("the data stream restarts from its beginning")
        assert next(resumed).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "saved_by, peer_ok, expected",
    [
        ((1, True, None), True, [[12, 13, 14, 15], [16, 17, 18, 19]]),  # elastic 1 -> 2
        ((2, False, None), True, [[16, 17, 18, 19], [20, 21, 22, 23]]),  # its own position
        ((1, True, None), False, None),  # process 0's copy damaged: both stop reading
        ((1, True, 2), True, "restart"),  # an older stream: process 0 alone says so
    ],
    ids=["one-process-save", "per-process-positions", "peer-damaged", "older-stream"],
)
def test_process_1_of_2_restores_the_position_meant_for_it(
    tmp_path, caplog, monkeypatch, saved_by, peer_ok, expected
):
    """Process 1 of 2 (the agreement simulated, process 0's flag given): a shared
    position is read from process 0's file, the same global stream (README: a
    state saved by n processes restores on m); a per-process one from its own
    (there next_index 4); a copy damaged on process 0 stops it too; the note of
    a restarted older stream is process 0's alone."""
    from lexjax import checkpoint as ckpt_lib
    from lexjax import distributed

    step_dir, _, _ = _iterator_records(tmp_path)
    _as_if_saved_by(step_dir, *saved_by)
    ckpt = Checkpointer(tmp_path / "ckpt")
    integrity = ckpt._read_integrity(3)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(
        distributed, "_gather_flags", lambda flag: np.array([int(peer_ok), int(flag)])
    )
    resumed = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
    try:
        with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
            if expected is None:
                with pytest.raises(ckpt_lib._IteratorDamaged, match="damaged on another process"):
                    ckpt._restore_iterator(3, integrity, resumed)
                return
            ckpt._restore_iterator(3, integrity, resumed)
    finally:
        monkeypatch.undo()
        ckpt.close()
    assert [r.getMessage() for r in caplog.records if r.name == "lexjax.checkpoint"] == []
    if expected == "restart":
        expected = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [next(resumed).tolist() for _ in range(2)] == expected


def test_the_committed_older_checkpoint_restarts_its_data_stream(caplog):
    """tests/fixtures/run_v1 was written by one process before the row shuffle
    (stream 1): its parameters restore and its data stream restarts, with one line."""
    from lexjax import config as cfg
    from lexjax.steps import TrainSetup

    directory = pathlib.Path(__file__).parent / "fixtures" / "run_v1" / "checkpoints"
    saved = json.loads((directory / "6" / "data_iter" / "process_0-of-1.json").read_text())
    ckpt = Checkpointer(directory.resolve(), read_only=True)
    setup = TrainSetup(cfg.from_configdict(ckpt.restore_config()), jax.devices()[:4])

    class Position:
        def set_state(self, state):
            self.state = json.loads(state)

    position = Position()
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        _, _, step = ckpt.restore(abstract_state=setup.abstract_state, data_iter=position)
    ckpt.close()
    assert step == 6 and saved and not hasattr(position, "state")
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "lexjax.checkpoint"]
    assert "older lexjax (stream 1, now 3" in warning


def test_a_position_is_refused_by_an_iterator_of_other_stream_settings(tmp_path):
    """The settings an iterator's stream depends on (``stream_settings``) are saved with
    its position; an iterator of other settings refuses it (CheckpointError naming each
    change) instead of repeating or skipping data. Settings known to one side only, and
    positions saved without settings (older checkpoints), restore as before."""

    def make_iter(**settings):
        it = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
        if settings:
            it.stream_settings = settings
        return it

    mesh = mesh_of(8)
    state = make_state(mesh, rows=8)
    it = make_iter(seed=0, shuffle=1024)
    for _ in range(3):
        next(it)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, state, data_iter=it)
    ckpt.save(4, state, data_iter=make_iter())  # no settings: as saved before they were
    ckpt.wait()
    integrity = json.loads((tmp_path / "ckpt" / "3" / "integrity" / "metadata").read_text())
    assert integrity["data_iter"]["settings"] == {"seed": 0, "shuffle": 1024}
    target = abstract(state, mesh)
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(3, abstract_state=target, data_iter=make_iter(seed=1, shuffle=16))
    assert "(seed is 0 there, 1 here; shuffle is 1024 there, 16 here)" in str(e.value)
    # The API's name for the directory (train.py's messages say --workdir).
    assert "resume with the checkpoint's values or use a new workdir" in str(e.value)
    for resumed in (make_iter(seed=0, shuffle=1024, new=1), make_iter()):
        ckpt.restore(3, abstract_state=target, data_iter=resumed)
        assert next(resumed).tolist() == [12, 13, 14, 15]
    resumed = make_iter(seed=1, shuffle=16)
    ckpt.restore(4, abstract_state=target, data_iter=resumed)
    assert next(resumed).tolist() == [0, 1, 2, 3]
    ckpt.close()


def truncate(step_dir, value):
    for f, _ in data_files_holding(step_dir, value):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def delete(step_dir, value):
    for f, _ in data_files_holding(step_dir, value):
        f.unlink()


def flip_byte(step_dir, value):
    for f, at in data_files_holding(step_dir, value):
        data = bytearray(f.read_bytes())
        data[at + 5] ^= 0x10
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, why", [(truncate, ""), (delete, ""), (flip_byte, "checksum")])
def test_damaged_latest_falls_back(two_steps, tmp_path, caplog, damage, why):
    path = fresh_copy(two_steps, tmp_path)
    mesh = mesh_of(8)
    state2 = make_state(mesh, seed=2)
    damage(path / "2", host_params(2)["counts"])
    ckpt = Checkpointer(path, keep=None)
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        restored, config, step = ckpt.restore(abstract_state=abstract(state2, mesh))
    assert (step, config) == (1, {"seed": 1})
    assert_same(restored, make_state(mesh, seed=1))
    # Only lexjax's own records: orbax can leave a failed read task of an earlier
    # test behind, and asyncio logs it (with that test's "damaged" path) when freed.
    lines = [r.getMessage() for r in caplog.records if r.name == "lexjax.checkpoint"]
    assert len(lines) == 1 and "step 2 " in lines[0] and "falling back to step 1" in lines[0]
    assert why in lines[0]
    assert ckpt.all_steps() == [1, 2]  # fallback deletes nothing
    ckpt.close()


def test_every_arrays_checksum_is_compared(two_steps, tmp_path):
    """Damage found in one array only: step 2's record is given a wrong digest for
    each array in turn (and sealed again, as a writer would), so the restore must
    compare that array's bytes with it, whichever array it is."""
    path = fresh_copy(two_steps, tmp_path)
    mesh = mesh_of(8)
    state2 = make_state(mesh, seed=2)
    record_path = path / "2" / "integrity" / "metadata"
    original = record_path.read_text()
    names = sorted(json.loads(original)["leaves"])
    assert len(names) == len(jax.tree_util.tree_leaves(state2)) > 4
    for name in names:
        integrity = json.loads(original)
        algorithm = integrity["algorithm"]  # mix64: the key of each leaf's digest
        integrity["leaves"][name][algorithm] = hashlib.sha256(name.encode()).hexdigest()[:16]
        integrity["self_sha256"] = _record_sha256(integrity)
        record_path.write_text(json.dumps(integrity))
        ckpt = Checkpointer(path, on_corrupt="error")
        said = f"damaged: checksum mismatch in 1 array(s), first {name}"
        with pytest.raises(CheckpointError, match=re.escape(said)):
            ckpt.restore(abstract_state=abstract(state2, mesh))
        ckpt.close()
    record_path.write_text(original)
    ckpt = Checkpointer(path, on_corrupt="error")
    assert ckpt.restore(abstract_state=abstract(state2, mesh))[2] == 2
    ckpt.close()


def _mix64_by_the_definition(value: np.ndarray) -> str:
    """mix64 element by element in Python integers, from the bytes: for each lane,
    Σ_i fmix32(w_i xor (i·φ + seed)) mod 2^32 over the uint32 words w_i."""
    raw = np.ascontiguousarray(value).tobytes()  # little-endian on every host we run
    step = min(value.dtype.itemsize, 4)  # 1- and 2-byte elements: one word each
    words = [int.from_bytes(raw[j : j + step], "little") for j in range(0, len(raw), step)]
    m = 0xFFFFFFFF

    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & m
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & m
        return h ^ (h >> 16)

    lanes = [sum(fmix(w ^ ((i * 0x9E3779B9 + seed) & m)) for i, w in enumerate(words)) & m
             for seed in (0x3C6EF372, 0xDAA66D2B)]  # fmt: skip
    return "".join(f"{lane:08x}" for lane in lanes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "int8", "bool"])
def test_a_leaf_checksum_is_its_definition_on_any_sharding_and_on_the_host(dtype):
    """Computed where the leaf lies (every device reduces its shards; 8 bytes per leaf
    reach the host): the same digest on every sharding of an 8-device mesh, on the
    host (the read-back before garbage collection) and by the definition."""
    from lexjax import checkpoint

    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    value = np.asarray(
        (np.random.default_rng(0).standard_normal((8, 6, 4)) * 100).astype(jnp.dtype(dtype))
    )
    want = _mix64_by_the_definition(value)
    for spec in (P(), P("a"), P(None, "b"), P("a", "b"), P(("a", "b")), P(None, None, "b")):
        leaf = jax.device_put(value, NamedSharding(mesh, spec))
        record = checkpoint._leaf_records([("x", leaf)])["x"]
        assert record == {"shape": [8, 6, 4], "dtype": dtype, "mix64": want}, spec
    assert checkpoint._host_digest(value) == want


def test_a_leaf_checksum_changes_with_any_bit_and_any_swap():
    from lexjax import checkpoint

    value = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    digest = checkpoint._host_digest(value)
    bits = value.view(np.uint32)
    for i, bit in [(0, 0), (17, 31), (299, 5), (150, 22)]:
        flipped = bits.copy()
        flipped[i] ^= np.uint32(1 << bit)
        assert checkpoint._host_digest(flipped.view(np.float32)) != digest, (i, bit)
    swapped = value.copy()
    swapped[[3, 200]] = swapped[[200, 3]]
    assert checkpoint._host_digest(swapped) != digest
    assert checkpoint._host_digest(value.reshape(20, 15)) == digest  # C order, any shape


def test_a_step_with_an_unknown_checksum_algorithm_is_refused_as_damaged(two_steps, tmp_path):
    path = fresh_copy(two_steps, tmp_path)
    mesh = mesh_of(8)
    record_path = path / "2" / "integrity" / "metadata"
    integrity = json.loads(record_path.read_text())
    integrity["algorithm"] = "blake9"
    integrity["self_sha256"] = _record_sha256(integrity)
    record_path.write_text(json.dumps(integrity))
    ckpt = Checkpointer(path, on_corrupt="error")
    said = "damaged: its leaf checksums are 'blake9', unknown to this lexjax version"
    with pytest.raises(CheckpointError, match=re.escape(said)):
        ckpt.restore(abstract_state=abstract(make_state(mesh, seed=2), mesh))
    ckpt.close()


def test_error_mode_raises_on_damage(two_steps, tmp_path):
    path, mesh, state2 = copy_with_flipped_step_2(two_steps, tmp_path)
    ckpt = Checkpointer(path, on_corrupt="error")
    with pytest.raises(CheckpointError, match="step 2 .*damaged: checksum mismatch"):
        ckpt.restore(abstract_state=abstract(state2, mesh))
    ckpt.close()


def test_gc_keeps_the_last_good_step(two_steps, tmp_path):
    path = fresh_copy(two_steps, tmp_path)
    mesh = mesh_of(8)
    flip_byte(path / "2", host_params(2)["counts"])
    ckpt = Checkpointer(path, keep=1)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    ckpt.save(3, make_state(mesh, seed=3))
    ckpt.wait()
    assert ckpt.all_steps() == [3]
    ckpt.close()


@pytest.mark.parametrize("record", ["config", "tokenizer"])
def test_gc_keeps_the_last_good_step_when_the_newest_has_a_damaged_record(
    two_steps, tmp_path, record
):
    """Garbage collection read back only the arrays; a restore refuses a step whose
    config or tokenizer record fails its checksum, so step 1 was deleted and no
    good step was left."""
    path = fresh_copy(two_steps, tmp_path)
    metadata = path / "2" / record / "metadata"
    text = metadata.read_bytes()
    at = text.index(b'"step"' if record == "tokenizer" else b'"seed"') + 1
    metadata.write_bytes(text[:at] + bytes([text[at] ^ 1]) + text[at + 1 :])
    ckpt = Checkpointer(path, keep=1)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    mesh = mesh_of(8)
    restored, config, step = ckpt.restore(abstract_state=abstract(make_state(mesh, seed=1), mesh))
    assert (step, config) == (1, {"seed": 1})
    ckpt.close()


def test_other_model_shape_is_refused(two_steps, tmp_path):
    mesh = mesh_of(8)
    ckpt = Checkpointer(fresh_copy(two_steps, tmp_path))
    other = make_state(mesh, rows=64)
    with pytest.raises(CheckpointError, match="different model shape.*new workdir"):
        ckpt.restore(abstract_state=abstract(other, mesh))
    ckpt.close()


def test_bad_directories_are_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        Checkpointer(blocker / "ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpointer(tmp_path / "missing", read_only=True)
    ckpt = Checkpointer(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ckpt.restore(abstract_state={})
    ckpt.close()


def test_a_save_cut_short_is_not_listed(two_steps, tmp_path):
    path = fresh_copy(two_steps, tmp_path)
    shutil.copytree(path / "1", path / "3.orbax-checkpoint-tmp-1234")
    ckpt = Checkpointer(path, read_only=True)
    assert ckpt.all_steps() == [1, 2]
    assert ckpt.latest_step() == 2
    ckpt.close()


@pytest.mark.parametrize("record", ["integrity", "config", "tokenizer"])
def test_a_step_missing_a_record_it_was_saved_with_is_damaged(two_steps, tmp_path, caplog, record):
    """orbax lists a step once every item is written, so a step without one of its
    records lost it since. It used to be skipped without a word (integrity), or
    read as an older lexjax's step without that record: a resume skipped the model
    check of a missing config, and eval.py stopped instead of falling back."""
    path = fresh_copy(two_steps, tmp_path)
    mesh = mesh_of(8)
    shutil.rmtree(path / "2" / record)
    target = abstract(make_state(mesh, seed=2), mesh)
    ckpt = Checkpointer(path, keep=None)
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        restored, config, step = ckpt.restore(abstract_state=target)
    assert (step, config) == (1, {"seed": 1})
    assert_same(restored, make_state(mesh, seed=1))
    lines = [r.getMessage() for r in caplog.records if r.name == "lexjax.checkpoint"]
    assert lines == [
        f"checkpoint step 2 in {path} is damaged: {record} record missing; falling back to step 1"
    ]
    assert ckpt.restore_config() == {"seed": 1}  # the step restore picks, not the newest
    ckpt.close()
    ckpt = Checkpointer(path, on_corrupt="error")
    with pytest.raises(CheckpointError, match=f"step 2 .*damaged: {record} record missing"):
        ckpt.restore(abstract_state=target)
    ckpt.close()


def test_damaged_iterator_state_falls_back(tmp_path, caplog):
    mesh = mesh_of(8)
    state = make_state(mesh, rows=8)
    it = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
    ckpt = Checkpointer(tmp_path / "ckpt")
    for step in (1, 2):
        next(it)
        ckpt.save(step, state, data_iter=it)
    ckpt.wait()
    saved = tmp_path / "ckpt" / "2" / "data_iter" / "process_0-of-1.json"
    saved.write_text(saved.read_text().replace('"next_index": 2', '"next_index": 7'))
    resumed = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        _, _, step = ckpt.restore(abstract_state=abstract(state, mesh), data_iter=resumed)
    assert step == 1 and next(resumed).tolist() == [4, 5, 6, 7]
    assert "step 2 " in caplog.text and "data iterator state checksum mismatch" in caplog.text
    # An empty file names json's reason, not the StopIteration json raised it over.
    saved.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        ckpt.restore(abstract_state=abstract(state, mesh), data_iter=resumed)
    assert "data iterator state unreadable (JSONDecodeError: Expecting value" in caplog.text
    assert "StopIteration" not in caplog.text
    # Every step's position lost, their training whole: the newest resumes with the data
    # stream from its start (it was "every step is damaged; ... train from the start").
    (tmp_path / "ckpt" / "1" / "data_iter" / "process_0-of-1.json").unlink()
    caplog.clear()
    restarted = iter(grain.MapDataset.range(100).batch(4).to_iter_dataset())
    with caplog.at_level(logging.WARNING, logger="lexjax.checkpoint"):
        restored, _, step = ckpt.restore(abstract_state=abstract(state, mesh), data_iter=restarted)
    assert step == 2 and next(restarted).tolist() == [0, 1, 2, 3]
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state)
    assert caplog.messages[-1] == (
        f"note: checkpoint step 2 in {tmp_path / 'ckpt'} is whole but for its data iterator "
        "state, and no step is whole; it resumes with the data stream from its beginning"
    )
    ckpt.close()


def test_resuming_before_a_damaged_step_moves_it_aside(two_steps, tmp_path):
    path, mesh, state2 = copy_with_flipped_step_2(two_steps, tmp_path)
    ckpt = Checkpointer(path, keep=None)
    _, _, step = ckpt.restore(abstract_state=abstract(state2, mesh))
    assert step == 1
    assert ckpt.save(2, state2)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    assert [p.name.split("-")[0] for p in (path / "superseded").iterdir()] == ["2"]
    restored, _, step = ckpt.restore(abstract_state=abstract(state2, mesh))
    assert step == 2
    assert_same(restored, state2)
    assert not ckpt.save(2, state2)  # saved by this object already
    assert ckpt.save(2, state2, force=True)
    ckpt.wait()
    assert len(list((path / "superseded").iterdir())) == 2
    ckpt.close()


def run_two_process_resume(process_id, port, path):
    """One of two processes: save per-process iterator state, damage, resume."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from jax.experimental import multihost_utils

    def make_iter():
        return iter(grain.MapDataset.range(100)[process_id::2].batch(2).to_iter_dataset())

    mesh = mesh_of(4)
    it = make_iter()
    for _ in range(process_id + 1):  # the processes stand at different positions
        next(it)
    ckpt = Checkpointer(path, keep=None)
    ckpt.save(1, make_state(mesh, seed=1), data_iter=it)
    expected = [next(it).tolist() for _ in range(3)]
    ckpt.save(2, make_state(mesh, seed=2), data_iter=it)
    ckpt.wait()
    if process_id == 0:
        flip_byte(pathlib.Path(path, "2"), host_params(2)["counts"])
    multihost_utils.sync_global_devices("damaged")

    other = jax.make_mesh((2, 2), ("data", "model"))
    spec_for = lambda name: P("model") if name.endswith("['w']") else None
    resumed = make_iter()
    restored, _, step = ckpt.restore(
        abstract_state=abstract(make_state(mesh, seed=1), other, spec_for), data_iter=resumed
    )
    assert step == 1
    assert [next(resumed).tolist() for _ in range(3)] == expected
    assert_same(restored, make_state(mesh, seed=1))
    ckpt.close()
    print(f"process {process_id} resumed correctly", flush=True)


@pytest.mark.slow
def test_two_processes_resume_each_their_own_iterator(tmp_path):
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = pathlib.Path(__file__).parent.parent
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": path,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port), str(tmp_path / "ckpt")],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"process {i} resumed correctly" in out, out[-3000:]


if __name__ == "__main__":
    run_two_process_resume(int(sys.argv[1]), sys.argv[2], sys.argv[3])


_ORBAX_ERROR_AFTER_QUIETING = """
import sys, threading
import orbax.checkpoint as ocp
from lexjax import checkpoint

checkpoint.quiet_background_errors()  # as lexjax.load and train.py install it
try:
    ocp.PyTreeCheckpointer().restore(sys.argv[1])
except FileNotFoundError as e:
    caught = e
# From another thread, as a tensorstore callback's error is printed: kept quiet.
report = lambda: sys.excepthook(type(caught), caught, caught.__traceback__)
thread = threading.Thread(target=report)
thread.start()
thread.join()
print("thread reported", file=sys.stderr, flush=True)
ocp.PyTreeCheckpointer().restore(sys.argv[1])  # the main thread's own: shown
"""


def test_a_users_own_uncaught_orbax_error_still_prints_after_lexjax_quiets_orbax(tmp_path):
    """lexjax.load's hook dropped every uncaught exception whose traceback passed
    through orbax, the user's own later ones too: exit 1, nothing printed."""
    missing = str(tmp_path / "does-not-exist")
    done = subprocess.run(
        [sys.executable, "-c", _ORBAX_ERROR_AFTER_QUIETING, missing],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    before, _, after = done.stderr.partition("thread reported\n")
    assert "Traceback" not in before, before[-2000:]
    assert "Traceback" in after and "FileNotFoundError" in after.splitlines()[-1], after[-2000:]


def test_a_tokenizer_with_more_ids_than_the_models_table_is_refused():
    """A run whose stored tokenizer has more ids than its model's embedding table (a
    run put together elsewhere) evaluated to NaN, exit 0."""
    import types

    from lexjax import checkpoint as ckpt_lib
    from lexjax import data as data_lib

    here = types.SimpleNamespace(directory="/runs/x/checkpoints")
    record = data_lib.BYTES.to_json()  # 258 ids
    with pytest.raises(CheckpointError, match="its tokenizer has 258 ids, its model's table 100$"):
        ckpt_lib._tokenizer_of(here, 6, {"model": {"vocab_size": 100}}, record)
    fits = ckpt_lib._tokenizer_of(here, 6, {"model": {"vocab_size": 320}}, record)
    assert fits is data_lib.BYTES


def test_a_path_with_a_bracket_is_refused_before_any_work(tmp_path):
    """orbax and TFDS glob their directories' paths: under a workdir holding '[abc]' a
    checkpoint was saved without its parts (exit 0) and could never be read back, and
    under such a data_dir the corpus was built anew at every use."""
    from lexjax import checkpoint, data
    from lexjax.errors import DataError
    from lexjax.training import train
    from tests.helpers import small_config

    workdir = tmp_path / "runs[abc]" / "one"
    with pytest.raises(CheckpointError, match=r"^workdir .*runs\[abc\]/one holds a '\[…\]'"):
        train(small_config(), str(workdir), log=lambda _: None, progress=False)
    assert not (tmp_path / "runs[abc]").exists()
    with pytest.raises(CheckpointError, match="use a workdir without '\\['$"):
        checkpoint.load_params(str(workdir))
    bad_data = small_config(**{"data.data_dir": str(tmp_path / "data[1]")})
    with pytest.raises(DataError, match="choose a data_dir without '\\['$"):
        train(bad_data, str(tmp_path / "run"), log=lambda _: None, progress=False)
    assert not (tmp_path / "run").exists() and not (tmp_path / "data[1]").exists()
    # An unmatched '[' is a character to a glob, and * and ? match themselves: they work.
    for fine in ("x[draft/run", "all*?/run"):
        checkpoint.check_workdir_path(tmp_path / fine)
        data.check_data_dir_path(tmp_path / fine)
