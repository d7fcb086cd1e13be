"""Checkpoints: train state, data iterator and config in one step, with integrity.

A thin layer over `orbax.checkpoint.CheckpointManager`. One step directory
holds four items::

  DIR/<step>/
    _CHECKPOINT_METADATA, commit_success.txt   orbax bookkeeping
    state/       StandardSave of the state pytree (OCDBT + zarr)
    data_iter/   process_<i>-of-<n>.json, one per process (grain's layout).
                 lexjax's training stream is one global stream, so every
                 process saves the same state ("shared" in integrity) and
                 it restores on any number of processes
    config/      metadata: the config dict as JSON
    tokenizer/   metadata: the tokenizer as JSON (a SentencePiece model in
                 base64), so evaluation and generation use the training one
    integrity/   metadata: JSON with a checksum of every state leaf, a sha256 of every
                 process's iterator state, of the config and tokenizer records
                 and of itself, whether the iterator states agree, and the
                 settings the saved position belongs to (a resume under other
                 ones is refused)
  DIR/superseded/<step>-<time>/   steps moved aside by `save` (never deleted)

Complete: orbax finalized the step (it writes into
`<step>.orbax-checkpoint-tmp*` and renames to `<step>` on commit, so
`CheckpointManager.all_steps` only lists finalized steps) and the
`integrity` item is present.

Good: complete, and on restore every leaf's checksum matches. Orbax restores
a flipped byte in an array data file silently (only OCDBT b-tree nodes carry
a CRC), hence the checksums. Each checksum (`mix64`, see `_device_lanes`) is
over the *global* value of a leaf in C order, yet computed where the leaf
lies: every device reduces its shards and 8 bytes per leaf reach the host, so
it does not depend on the mesh it was saved from or restored onto, and every
process reaches the same verdict. Its cost is one pass over the state on the
devices per save and per restore. Steps written before it record a sha256 of
each leaf gathered to the host (`process_allgather` when not fully
addressable); they are verified that way.

Garbage collection is ours, not orbax's (its `max_to_keep` would delete old
steps without knowing whether the newer ones are readable). Before a save
starts, complete steps older than the newest `keep` are deleted only if a
newer step has been *verified*: read back to host memory (numpy) and its
checksums matched. So a damaged newest step never costs the last good one.
The read-back is one extra read of the previous checkpoint per save, in the
caller's thread; `verify_before_delete=False` skips it and then GC keeps the
newest `keep` complete steps by recency alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import hashlib
import json
import logging
import os
import re
import shlex
import sys
import threading
import traceback
import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath
from jax.experimental import multihost_utils

from lexjax import data as data_lib
from lexjax import sharding as shard_lib
from lexjax.config import Config, from_configdict
from lexjax.data import tokenizer as tokenizer_lib
from lexjax.data.pipeline import STREAM_VERSION
from lexjax.distributed import all_processes, process_0s
from lexjax.errors import (
    CheckpointError,
    DataError,
    arg,
    globs_to_itself,
    nearest_existing,
    one_line,
    refused_by,
)
from lexjax.model import Decoder

log = logging.getLogger(__name__)

PyTree = Any

_STATE, _DATA_ITER, _CONFIG, _INTEGRITY = "state", "data_iter", "config", "integrity"
_TOKENIZER = "tokenizer"
_FORMAT = 1


def other_stream(step: int, directory, changed: list[str]) -> CheckpointError:
    """The refusal of a resume whose data stream differs from the one step ``step``
    in ``directory`` holds a position in (``changed``: "<setting> is A there, B here")."""
    # The build's name changes with its files' contents, which no setting shows.
    restore = (
        "the files and data.* settings its corpus was built from,"
        if [c.split(" is ")[0] for c in changed] == ["train corpus"]
        else "the checkpoint's values"
    )
    return CheckpointError(
        f"checkpoint step {step} in {directory} holds a position in another data stream "
        f"({'; '.join(changed)}), which would repeat or skip training data; resume with "
        f"{restore} or use a new {arg('workdir')}"
    )


def checkpoint_dir(workdir: str | os.PathLike[str]) -> str:
    """Where a workdir's checkpoints are: ``WORKDIR/checkpoints``, absolute (orbax's need)."""
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def check_workdir_path(workdir: str | os.PathLike[str], what: str = "workdir") -> None:
    """A :class:`CheckpointError` for a workdir whose absolute path is a glob pattern
    that does not match itself (``runs/[abc]``; an unmatched ``[`` is a character, and
    ``*``, ``?`` match themselves): orbax finds a checkpoint's parts with a glob of its
    directory's path, so a checkpoint saved there was written without them (exit 0)
    and could never be read back, there or moved. ``what`` names it (the study's
    ``--out``)."""
    if not globs_to_itself(path := os.path.abspath(workdir)):
        raise CheckpointError(
            f"{what} {path} holds a '[…]': orbax reads checkpoint paths as glob patterns, so a "
            f"checkpoint saved there could not be read back; use a {what} without '['"
        )


def has_steps(workdir: str | os.PathLike[str]) -> bool:
    """Whether a workdir's checkpoints hold a step's directory, complete or not
    (False where there is none, or it cannot be listed)."""
    try:
        return any(name.isdigit() for name in os.listdir(checkpoint_dir(workdir)))
    except OSError:
        return False


def trained_corpus(directory: str) -> tuple[int, str] | None:
    """``(step, build)``: the corpus build the newest complete step in ``directory``
    trained on, from its integrity record; None where there is no such step, or it
    is damaged or records none (its restore then says what is wrong, or falls back)."""
    if not os.path.isdir(directory):
        return None
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        step = checkpointer.latest_step()
        if step is None:
            return None
        build = _recorded_corpus(checkpointer._read_integrity(step))
    except _Damaged:
        return None
    finally:
        checkpointer.close()
    return None if build is None else (step, build)


def _recorded_corpus(integrity: dict) -> str | None:
    """The corpus build a step's data position is in (its integrity record's)."""
    stream = integrity.get("data_iter") or {}
    return (stream.get("settings") or {}).get("train corpus")


class _Damaged(Exception):
    """A step is unreadable or fails verification (internal)."""


class _IteratorDamaged(_Damaged):
    """Only a step's data iterator state is unreadable or fails verification."""


class _NoGoodStep(CheckpointError):
    """Every step was tried and each is damaged."""


# Readers take no lease: a training run's garbage collection may delete the step
# being read. The steps are listed again this many times.
_RELISTS = 5
_DELETING = ".orbax-checkpoint-tmp-deleting"  # orbax skips and cleans up such names


def _missing(e: BaseException) -> bool:
    """Whether a file was missing somewhere in the chain of `e`."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, FileNotFoundError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


class _IteratorSnapshot:
    """The iterator's state taken when `save` is called, for grain's handler.

    Grain's handler calls `get_state()` itself; handing it a snapshot makes the
    saved position the one at the call, whatever thread orbax writes it from.
    """

    def __init__(self, state_json: str):
        self._state = state_json.encode()

    def get_state(self) -> bytes:
        return self._state


def _canonical_iterator_state(state: Any) -> str:
    if isinstance(state, bytes):
        state = json.loads(state.decode())
    return json.dumps(state, sort_keys=True)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _record_sha256(record: Any) -> str:
    """The checksum of a JSON record as it reads back (keys sorted; a digest of the
    integrity record itself leaves out its own ``self_sha256``)."""
    if isinstance(record, dict):
        record = {k: v for k, v in record.items() if k != "self_sha256"}
    return _sha256(json.dumps(record, sort_keys=True))


def _host_value(x: Any) -> np.ndarray:
    """The global value of one leaf as a C-ordered numpy array on this host."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return shard_lib.host_array(x)


def _leaf_record(x: Any) -> dict[str, Any]:
    """The ``sha256`` record of steps written before ``mix64``: over the gathered value."""
    value = _host_value(x)
    return {
        "shape": list(value.shape),
        "dtype": str(value.dtype),
        "sha256": hashlib.sha256(value.tobytes()).hexdigest(),
    }


# -- mix64: the leaf checksum, computed where the leaf is ------------------------
#
# Each element's bits as one uint32 word w_i (8-byte elements as two; i its C-order
# index), and per lane ℓ: Σ_i fmix32(w_i ⊕ (i·φ + seed_ℓ)) mod 2³², with fmix32
# murmur3's finalizer. For a given i the term is a bijection of w_i, so one changed
# element always changes the sum; with the index in each term, more changes or two
# elements swapped almost surely do. A sum of integers mod 2³² is the same in any
# order, hence on any mesh and any sharding: the devices holding a leaf reduce it
# where it lies and only 8 bytes per leaf reach the host (sha256 needed the whole
# state gathered to every host, per save). Like sha256 here, it finds damage, not
# tampering: whoever edits a step can recompute its checksums.

_MIX64 = "mix64"
_PHI = np.uint32(0x9E3779B9)
_SEEDS = (np.uint32(0x3C6EF372), np.uint32(0xDAA66D2B))
_FMIX = (np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35))


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * _FMIX[0]
    h = h ^ (h >> 13)
    h = h * _FMIX[1]
    return h ^ (h >> 16)


def _device_lanes(x) -> jax.Array:
    """The two mix64 lanes of one array, uint32 ``[2]`` (traced: inside a jit)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)  # 8 bytes: [..., 2]
    index, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for axis in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        index, stride = index + iota * np.uint32(stride % 2**32), stride * words.shape[axis]
    terms = [_fmix32(words ^ (index * _PHI + seed)) for seed in _SEEDS]
    # One reduction of both lanes: XLA fuses the terms into it (two sums each kept
    # their terms, 8 bytes per element of temporaries on a CPU).
    zero = np.uint32(0)
    add = lambda a, b: [a[0] + b[0], a[1] + b[1]]
    return jnp.stack(jax.lax.reduce(terms, [zero, zero], add, tuple(range(words.ndim))))


@jax.jit
def _device_digests(leaves: list) -> jax.Array:
    keys = jax.dtypes.prng_key
    leaves = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, keys) else x for x in leaves]
    return jnp.stack([_device_lanes(x) for x in leaves])


def _host_digest(value: np.ndarray) -> str:
    """mix64 of a host array, as :func:`_device_lanes` computes it on devices."""
    flat = np.ascontiguousarray(value).reshape(-1)
    if flat.dtype == np.bool_:
        flat = flat.view(np.uint8)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[flat.dtype.itemsize]
    words = flat.view(unsigned)
    sums = [0, 0]
    for start in range(0, words.size, 1 << 22):  # bounded temporaries
        part = words[start : start + (1 << 22)].astype(np.uint32)
        index = np.arange(start, start + part.size, dtype=np.uint64).astype(np.uint32)
        for lane, seed in enumerate(_SEEDS):
            sums[lane] += int(_fmix32(part ^ (index * _PHI + seed)).sum(dtype=np.uint64))
    return "".join(f"{total % 2**32:08x}" for total in sums)


def _leaf_records(named: list[tuple[str, Any]], algorithm: str = _MIX64) -> dict[str, Any]:
    """``{name: {"shape", "dtype", algorithm: hex digest}}`` of named leaves: mix64
    on the leaves' devices (one small read-back for all), or the older sha256."""
    if algorithm != _MIX64:
        return {name: _leaf_record(x) for name, x in named}
    # One computation per mesh (or set of devices) the leaves lie on: a jit takes
    # the arguments of one only (a state may keep, say, its rng on one device).
    groups: dict[Any, list[tuple[str, jax.Array]]] = {}
    for name, x in named:
        if isinstance(x, jax.Array):
            where = getattr(x.sharding, "mesh", None) or frozenset(x.sharding.device_set)
            groups.setdefault((where, x.is_fully_addressable), []).append((name, x))
    digests = {}
    for group in groups.values():
        lanes = shard_lib.host_array(_device_digests([x for _, x in group]))
        digests.update({name: f"{a:08x}{b:08x}" for (name, _), (a, b) in zip(group, lanes)})
    records = {}
    for name, x in named:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.eval_shape(jax.random.key_data, x)
        elif not isinstance(x, jax.Array):
            x = np.asarray(x)
            digests[name] = _host_digest(x)
        records[name] = {
            "shape": list(x.shape),
            "dtype": str(np.dtype(x.dtype)),
            _MIX64: digests[name],
        }
    return {name: records[name] for name, _ in named}


def _algorithm(integrity: dict) -> str:
    """The leaf checksum a step was written with (sha256 before mix64 came)."""
    algorithm = integrity.get("algorithm", "sha256")
    if algorithm not in ("sha256", _MIX64):
        raise _Damaged(f"its leaf checksums are {algorithm!r}, unknown to this lexjax version")
    return algorithm


def _mismatches(wanted, restored, saved: dict, algorithm: str) -> list[str]:
    """Names of the restored leaves whose checksum differs from the step's record."""
    records = _leaf_records(_leaf_names(restored), algorithm)
    got = [r[algorithm] for r in records.values()]
    return [name for (name, _), g in zip(wanted, got) if g != saved[name].get(algorithm)]


def _leaf_names(tree: PyTree) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _write_failure(e: BaseException) -> str:
    """Why a write failed, in words: the OS error tensorstore names (e.g. "No space
    left on device"), else the innermost exception's first line."""
    text = str(e)
    seen = {id(e)}
    while (cause := e.__cause__ or e.__context__) is not None and id(cause) not in seen:
        seen.add(id(cause))
        e = cause
        text = str(e)
    if m := re.search(r":\s*([^:\[]+?)\s*\[os_error_code", text):
        return m.group(1)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return one_line(e, innermost=True)


class Checkpointer:
    """Saves and restores train state, data iterator state and config by step.

    Call every method from every process (saves and restores are collective).
    `save` returns once the state is copied off the devices; the write goes on
    in the background (`async_save=True`) until `wait()`, the next `save` or
    `close()`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = 3,
        async_save: bool = True,
        on_corrupt: str = "fallback",
        verify_before_delete: bool = True,
        read_only: bool = False,
    ):
        if on_corrupt not in ("fallback", "error"):
            raise ValueError(f"on_corrupt must be 'fallback' or 'error', got {on_corrupt!r}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be None or >= 1, got {keep}")
        self.directory = epath.Path(directory)
        self.keep = keep
        self.on_corrupt = on_corrupt
        self.verify_before_delete = verify_before_delete
        self.read_only = read_only
        self._verified: dict[int, bool] = {}
        self._saved: set[int] = set()
        self._writing: int | None = None  # the step of the last save started
        self._check_directory()
        with absl_filter(_NoOrbaxNotices()):  # a read-only directory's two warnings
            self._open(async_save)

    def _open(self, async_save: bool) -> None:
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=1,
            create=False,
            cleanup_tmp_directories=not self.read_only,
            enable_async_checkpointing=async_save,
            read_only=self.read_only,
        )
        try:
            self._manager = self._listing(
                lambda: ocp.CheckpointManager(
                    self.directory,
                    options=options,
                    item_handlers={
                        _STATE: ocp.StandardCheckpointHandler(),
                        _DATA_ITER: grain.checkpoint.CheckpointHandler(),
                        _CONFIG: ocp.JsonCheckpointHandler(),
                        _TOKENIZER: ocp.JsonCheckpointHandler(),
                        _INTEGRITY: ocp.JsonCheckpointHandler(),
                    },
                )
            )
        except Exception as e:
            raise CheckpointError(
                f"cannot open checkpoint directory {self.directory}: {one_line(e, innermost=True)}"
            ) from e

    def _check_directory(self) -> None:
        if self.read_only:
            if not self.directory.is_dir():
                raise CheckpointError(
                    f"checkpoint directory {self.directory} does not exist; pass the"
                    " workdir of a training run"
                )
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}"
                f" ({e.strerror or e}); choose a writable workdir"
            ) from e
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint path {self.directory} is not a directory")
        if "://" not in os.fspath(self.directory) and not os.access(
            self.directory, os.W_OK | os.X_OK
        ):
            raise CheckpointError(
                f"checkpoint directory {self.directory} is not writable; choose a writable workdir"
            )

    # -- steps -----------------------------------------------------------------

    def _step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def _listing(self, read: Any) -> Any:
        """`read()`, which lists the steps; again if a step it listed was deleted
        meanwhile (by a training run's garbage collection, when reading)."""
        for attempt in range(_RELISTS):
            try:
                return read()
            except Exception as e:
                if attempt + 1 == _RELISTS or not _missing(e):
                    raise

    def all_steps(self) -> list[int]:
        """Complete steps (finalized by orbax: every item was written), ascending.
        A step whose items have gone since is damaged, not incomplete: reading
        it reports what is missing (`_read_integrity`, `_read_config`)."""
        self._listing(self._manager.reload)
        return sorted(self._manager.all_steps())

    def _gone(self, step: int) -> bool:
        """Whether `step` was deleted since it was listed (its directory is gone)."""
        return not all_processes(self._step_dir(step).is_dir())

    def latest_step(self) -> int | None:
        """The newest complete step, or None. It is not verified until restored."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- save ------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        data_iter: Any = None,
        config: dict[str, Any] | None = None,
        tokenizer: dict[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts saving `state` (and the iterator position, config, tokenizer's
        `to_json()`) as `step`.

        The caller decides when to save; every call saves, except a second save
        of the same `step` by this object (e.g. a final save right after a
        periodic one), which is skipped unless `force`. Existing steps at or
        after `step` come from another history (a run that resumed from an
        older step, say after a fallback): they are moved to DIR/superseded/,
        never deleted. Returns True when a save was started.
        """
        if self.read_only:
            raise CheckpointError(f"checkpoint directory {self.directory} was opened read-only")
        step = int(step)
        self._finish_writes()
        if step in self._saved and not force:
            log.info(
                "checkpoint step %d was already saved to %s; not saved again", step, self.directory
            )
            return False
        later = [s for s in process_0s(self.all_steps()) if s >= step]  # as in GC
        if later:
            self._supersede(later)
        self._collect_garbage()

        integrity: dict[str, Any] = {
            "format": _FORMAT,
            "algorithm": _MIX64,
            "leaves": _leaf_records(_leaf_names(state)),
            "data_iter": None,
        }
        items = {_STATE: ocp.args.StandardSave(state)}
        if data_iter is not None:
            snapshot = _canonical_iterator_state(data_iter.get_state())
            digest = np.frombuffer(hashlib.sha256(snapshot.encode()).digest(), np.uint8)
            if jax.process_count() > 1:
                digests = multihost_utils.process_allgather(digest[None], tiled=True)
            else:
                digests = digest[None]
            hexdigests = [bytes(d).hex() for d in np.asarray(digests)]
            integrity["data_iter"] = {
                "process_count": jax.process_count(),
                "sha256": hexdigests,
                "shared": len(set(hexdigests)) == 1,
                "stream": STREAM_VERSION,
            }
            if (settings := getattr(data_iter, "stream_settings", None)) is not None:
                integrity["data_iter"]["settings"] = dict(settings)
            items[_DATA_ITER] = grain.checkpoint.CheckpointSave(_IteratorSnapshot(snapshot))
        if config is not None:
            config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            integrity["config_sha256"] = _record_sha256(config)
            items[_CONFIG] = ocp.args.JsonSave(config)
        if tokenizer is not None:
            integrity["tokenizer_sha256"] = _record_sha256(tokenizer)
            items[_TOKENIZER] = ocp.args.JsonSave(tokenizer)
        integrity["self_sha256"] = _record_sha256(integrity)
        items[_INTEGRITY] = ocp.args.JsonSave(integrity)
        self._writing = step
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:
            # What orbax started in the background fails too: report it once, here.
            with contextlib.suppress(Exception):
                self._manager.wait_until_finished()
            raise self._write_error(e) from e
        self._saved = {s for s in self._saved if s < step} | {step}
        return True

    def wait(self) -> None:
        """Blocks until the last save is finalized, then collects garbage."""
        self._finish_writes()
        if not self.read_only:
            self._collect_garbage()

    def _finish_writes(self) -> None:
        """Waits for the background write of the last save; raises if it failed."""
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            raise self._write_error(e) from e

    def _write_error(self, e: BaseException) -> CheckpointError:
        return CheckpointError(
            f"writing checkpoint step {self._writing} to {self.directory} failed: "
            f"{_write_failure(e)}; free space or fix the directory, then restart "
            "(older checkpoints are kept)"
        )

    def close(self) -> None:
        """Finishes the last write and closes; no garbage collection, whose collectives
        would hang a multi-process run that one process leaves by an error (the
        training loop's :meth:`wait` collects, in step, on its way out)."""
        try:
            self._finish_writes()
        finally:
            self._manager.close()

    def _supersede(self, steps: list[int]) -> None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        aside = self.directory / "superseded"
        if jax.process_index() == 0:
            aside.mkdir(parents=True, exist_ok=True)
            for s in steps:
                target = aside / f"{s}-{stamp}"
                self._step_dir(s).rename(target)  # said once done (it may be refused)
                log.warning(
                    "checkpoint step %d in %s moved to %s before saving over it",
                    s,
                    self.directory,
                    target,
                )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"lexjax_supersede_{steps[0]}")
        for s in steps:
            self._verified.pop(s, None)
        self._manager.reload()

    def _collect_garbage(self) -> None:
        if self.keep is None:
            return
        # Process 0's listing: a process listing after process 0 deleted would find
        # nothing to delete and skip the collectives below (an abort inside gloo).
        steps = process_0s(self.all_steps())
        doomed = steps[: max(0, len(steps) - self.keep)]
        if not doomed:
            return
        if self.verify_before_delete:
            good = next((s for s in reversed(steps) if self._verify_on_host(s)), None)
            doomed = [s for s in doomed if good is not None and s < good]
        if doomed:
            self._delete(doomed)

    def _delete(self, steps: list[int]) -> None:
        """Deletes `steps`, each first renamed out of the step names (one atomic
        rename on a local disk), so a reader, which takes no lease, finds a step
        whole or not at all, never half deleted."""
        if "://" in os.fspath(self.directory):
            for s in steps:
                self._manager.delete(s)
        else:
            if jax.process_index() == 0:
                for s in steps:
                    doomed = self.directory / f"{s}{_DELETING}"
                    self._step_dir(s).rename(doomed)
                    doomed.rmtree()
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"lexjax_delete_{steps[0]}")
            self._manager.reload()
        for s in steps:
            self._verified.pop(s, None)

    def _verify_on_host(self, step: int) -> bool:
        """Reads `step` back into host memory and checks it as a restore would (cached)."""
        if step not in self._verified:
            try:
                integrity = self._read_integrity(step)
                # The records a restore and load_params refuse a step for (no collective
                # here: every process reaches the one below whatever it finds).
                self._read_config(step, integrity)
                if error := self._tokenizer_on_this_process(step, integrity)[1]:
                    raise _Damaged(error)
                names = list(integrity["leaves"])
                handler = ocp.PyTreeCheckpointHandler()
                tree = handler.metadata(self._step_dir(step) / _STATE).tree
                restore_args = jax.tree.map(
                    lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree
                )
                values = handler.restore(
                    self._step_dir(step) / _STATE,
                    args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args),
                )
                handler.close()
                flat = [leaf for _, leaf in _leaf_names(values)]
                if len(flat) != len(names):
                    raise _Damaged(f"{len(flat)} arrays stored, integrity lists {len(names)}")
                algorithm = _algorithm(integrity)
                records = _leaf_records(_leaf_names(values), algorithm)  # numpy: on the host
                digests = sorted(r[algorithm] for r in records.values())
                if digests != sorted(r.get(algorithm) for r in integrity["leaves"].values()):
                    raise _Damaged("checksum mismatch")
                ok = True
            except Exception as e:
                # A step moved or deleted away under a running job (its workdir renamed)
                # is not damaged: the job's next write says what happened.
                try:
                    gone = not self._step_dir(step).is_dir()  # (epath: gs:// too)
                except Exception:  # a store that cannot say: judged as before
                    gone = False
                reason = e if isinstance(e, _Damaged) else one_line(e, innermost=True)
                log.warning(
                    "checkpoint step %d in %s is %s; older steps are kept",
                    step,
                    self.directory,
                    "gone (moved or deleted)" if gone else f"damaged: {reason}",
                )
                ok = False
            self._verified[step] = all_processes(ok)
        return self._verified[step]

    # -- restore ---------------------------------------------------------------

    def _read_integrity(self, step: int) -> dict[str, Any]:
        if not self._has_item(step, _INTEGRITY):
            raise _Damaged("integrity record missing")
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_INTEGRITY: ocp.args.JsonRestore()})
            )
            integrity = restored[_INTEGRITY]
        except Exception as e:
            raise _Damaged(f"integrity record unreadable ({one_line(e, innermost=True)})") from e
        if not isinstance(integrity, dict) or integrity.get("format") != _FORMAT:
            raise _Damaged("integrity record has an unknown format")
        # Older lexjax recorded no digest of the record itself (nor of the config).
        if "self_sha256" in integrity and integrity["self_sha256"] != _record_sha256(integrity):
            raise _Damaged("integrity record fails its own checksum")
        return integrity

    def restore_config(self, step: int | None = None) -> dict[str, Any] | None:
        """The config dict saved with `step`, or None if none was. Default: the
        newest step whose records are good (a damaged one is reported and
        skipped, as `restore` does; a named step that is damaged raises)."""
        if step is None:
            return self._newest_good(self._read_records)[1][0]
        return self._read_one(self._read_config, self._pick_step(step))

    def _read_records(self, step: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """``(config, tokenizer record)`` of ``step``, each checked against its
        integrity record (read once): what picks the step a reader of the records
        without the parameters uses, as `load_params` picks it."""
        integrity = self._read_integrity(step)
        return self._read_config(step, integrity), self._read_tokenizer(step, integrity)

    def _read_one(self, read: Any, step: int) -> Any:
        """``read(step)`` of a step named by the caller (no other to fall back to):
        damage is a CheckpointError."""
        try:
            return read(step)
        except _Damaged as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is damaged: {e}"
            ) from e

    def _has_item(self, step: int, item: str) -> bool:
        """Whether `step` holds `item` (older lexjax saved fewer); a step directory
        that is gone was deleted while being read (`_newest_good`)."""
        if (self._step_dir(step) / item).is_dir():
            return True
        if not self._step_dir(step).is_dir():
            raise _Damaged("its directory is gone")
        if why := refused_by(self._step_dir(step), os.R_OK | os.X_OK):  # not damage
            raise _unreadable(f"checkpoint step {step} in {self.directory}", why)
        return False

    def _read_config(self, step: int, integrity: dict | None = None) -> dict[str, Any] | None:
        """The config record of ``step``, checked against the ``integrity`` record
        (None: read here)."""
        integrity = self._read_integrity(step) if integrity is None else integrity
        if not self._has_item(step, _CONFIG):
            if "config_sha256" in integrity:  # It was written with the step.
                raise _Damaged("config record missing")
            return None
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()})
            )
        except Exception as e:
            raise _Damaged(f"config record unreadable ({one_line(e, innermost=True)})") from e
        config, want = restored[_CONFIG], integrity.get("config_sha256")
        if want is not None and (not isinstance(config, dict) or _record_sha256(config) != want):
            raise _Damaged("config record fails its checksum")
        return config

    def restore_tokenizer_json(self, step: int) -> dict[str, Any] | None:
        """The tokenizer record saved with `step`, checked against its checksum,
        or None if none was saved (checkpoints of an older lexjax)."""
        return self._read_one(self._read_tokenizer, step)

    def _read_tokenizer(self, step: int, integrity: dict | None = None) -> dict[str, Any] | None:
        """The tokenizer record of ``step``, checked as :meth:`_read_config` checks."""
        integrity = self._read_integrity(step) if integrity is None else integrity
        record, error = self._tokenizer_on_this_process(step, integrity)
        if not all_processes(error is None):
            raise _Damaged(error or "tokenizer record damaged on another process")
        return record

    def _tokenizer_on_this_process(self, step: int, integrity: dict) -> tuple[Any, str | None]:
        """``(the tokenizer record or None, what is wrong with it or None)``."""
        if not self._has_item(step, _TOKENIZER):
            if "tokenizer_sha256" in integrity:  # It was written with the step.
                return None, "tokenizer record missing"
            return None, None
        record = None
        try:
            record = self._manager.restore(
                step, args=ocp.args.Composite(**{_TOKENIZER: ocp.args.JsonRestore()})
            )[_TOKENIZER]
            ok = _record_sha256(record) == integrity.get("tokenizer_sha256")
            error = None if ok else "tokenizer record fails its checksum"
        except _Damaged as e:
            error = str(e)
        except Exception as e:
            error = f"tokenizer record unreadable ({one_line(e, innermost=True)})"
        return record, error

    def _pick_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory}; "
                f"complete steps: {steps}"
            )
        return step

    def restore(
        self,
        step: int | None = None,
        *,
        abstract_state: PyTree,
        data_iter: Any = None,
        check_config: Any = None,
    ) -> tuple[PyTree, dict[str, Any] | None, int]:
        """Restores state onto the shardings of `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` whose `.sharding`
        says where each leaf goes (any mesh, any device count). With
        `step=None` the newest good step is used: damaged steps are reported and
        skipped (`on_corrupt='fallback'`) or raise (`'error'`). A given `step`
        that is damaged always raises. If `data_iter` is given, its position is
        set to the saved one: on any number of processes if every process
        saved the same state, else on as many as saved it; otherwise it stays
        at the start of its stream, with a one-line note. `check_config`, if
        given, is called with a step's config (or None) before its state is read,
        and may raise to refuse it. Returns (state, config or None, step).
        """

        lost_position = []  # steps whole but for their data iterator state, newest first

        def read(s: int, data_iter=data_iter) -> tuple[PyTree, dict[str, Any] | None]:
            integrity = self._read_integrity(s)  # read once: it checks the records too
            config = self._read_config(s, integrity)
            if check_config is not None:
                check_config(config)
            self._read_tokenizer(s, integrity)
            try:
                state = self._restore_step(s, abstract_state, data_iter, integrity)
            except _IteratorDamaged:
                lost_position.append(s)
                raise
            self._verified[s] = True
            return state, config

        if step is None:
            try:
                s, (state, config) = self._newest_good(read)
            except _NoGoodStep:
                if not lost_position:
                    raise
                # Its training is whole: resumed with the data stream from its start
                # rather than lost (the advice was to train from the start).
                s = lost_position[0]
                state, config = read(s, data_iter=None)
                log.warning(
                    "note: checkpoint step %d in %s is whole but for its data iterator state, "
                    "and no step is whole; it resumes with the data stream from its beginning",
                    s,
                    self.directory,
                )
            return state, config, s
        s = self._pick_step(step)
        state, config = self._read_one(read, s)
        return state, config, s

    def _newest_good(self, read: Any) -> tuple[int, Any]:
        """``(step, read(step))`` of the newest complete step that ``read`` can read.

        A damaged step (``read`` raises `_Damaged`) is reported and the next older
        one tried (``on_corrupt='fallback'``), or raises (``'error'``). A step that
        is gone by then was deleted while being read, by the garbage collection of
        a training run that writes meanwhile: not damage; the steps are listed
        again and the newest then present read (at most `_RELISTS` times). Every
        process takes process 0's listing (a collective, as ``read``'s checks are):
        processes that listed on their own could read two steps.
        """
        for _ in range(_RELISTS):
            candidates = list(reversed(process_0s(self.all_steps())))  # one choice
            newest = ""  # why the newest step is damaged, for the error if all are
            only = len(candidates) == 1
            if not candidates:
                raise CheckpointError(
                    f"no complete checkpoint in {self.directory} yet; a training writing there "
                    "saves its first at step checkpoint_every: read it then"
                )
            for i, s in enumerate(candidates):
                try:
                    return s, read(s)
                except _Damaged as e:
                    if _denied(e):  # files this user may not read: not damage
                        why = refused_by(self._step_dir(s), os.R_OK | os.X_OK)
                        what = f"checkpoint step {s} in {self.directory}"
                        raise _unreadable(what, why or " (Permission denied)") from e
                    if self._gone(s):
                        log.info(
                            "checkpoint step %d in %s was deleted while being read",
                            s,
                            self.directory,
                        )
                        break
                    message = f"checkpoint step {s} in {self.directory} is damaged: {e}"
                    newest = newest or (
                        f" (step {s}: {e})" if only else f" (step {s}, the newest: {e})"
                    )
                    if self.on_corrupt == "error":
                        raise CheckpointError(message) from e
                    if i + 1 < len(candidates):
                        log.warning("%s; falling back to step %d", message, candidates[i + 1])
                    else:
                        log.warning("%s", message)
            else:
                damaged = "its only step is damaged" if only else "every step is damaged"
                raise _NoGoodStep(
                    f"no good checkpoint in {self.directory}: {damaged}{newest}; "
                    f"restore {'it' if only else 'them'} from a copy, or move the workdir "
                    f"{os.path.dirname(self.directory)} aside (or use a new {arg('workdir')}) to "
                    "train from the start"
                )
        raise CheckpointError(
            f"the checkpoints in {self.directory} were deleted faster than they could be read "
            f"({_RELISTS} tries); read them while training saves less often or keeps more "
            "(keep_checkpoints)"
        )

    def _restore_step(
        self, step: int, abstract_state: PyTree, data_iter: Any, integrity: dict
    ) -> PyTree:
        saved = integrity["leaves"]
        wanted = _leaf_names(abstract_state)
        self._check_shapes(step, saved, wanted)

        # Restore in the saved dtype so the checksum applies, then cast.
        targets = [
            jax.ShapeDtypeStruct(
                tuple(saved[name]["shape"]),
                np.dtype(saved[name]["dtype"]),
                sharding=getattr(leaf, "sharding", None),
            )
            for name, leaf in wanted
        ]
        treedef = jax.tree_util.tree_structure(abstract_state)
        target = jax.tree_util.tree_unflatten(treedef, targets)
        algorithm = _algorithm(integrity)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)})
            )[_STATE]
            bad = _mismatches(wanted, restored, saved, algorithm)
            error = None
        except Exception as e:
            error = one_line(e, innermost=True)
        if not all_processes(error is None):
            raise _Damaged(f"orbax could not read it ({error or 'on another process'})")
        if bad:
            raise _Damaged(f"checksum mismatch in {len(bad)} array(s), first {bad[0]}")

        if data_iter is not None:
            self._restore_iterator(step, integrity, data_iter)

        flat = jax.tree_util.tree_leaves(restored)
        cast = [
            x.astype(leaf.dtype) if hasattr(leaf, "dtype") and x.dtype != leaf.dtype else x
            for x, (_, leaf) in zip(flat, wanted)
        ]
        return jax.tree_util.tree_unflatten(treedef, cast)

    def _check_shapes(
        self, step: int, saved: dict[str, Any], wanted: list[tuple[str, Any]]
    ) -> None:
        wanted_shapes = {
            name: list(getattr(leaf, "shape", np.shape(leaf))) for name, leaf in wanted
        }
        saved_shapes = {name: r["shape"] for name, r in saved.items()}
        if wanted_shapes == saved_shapes:
            return
        missing = sorted(set(wanted_shapes) - set(saved_shapes))
        extra = sorted(set(saved_shapes) - set(wanted_shapes))
        if missing or extra:
            detail = f"arrays {missing[:1] or extra[:1]} {'missing' if missing else 'unexpected'}"
        else:
            name = next(n for n in wanted_shapes if wanted_shapes[n] != saved_shapes[n])
            detail = (
                f"{name} is {tuple(saved_shapes[name])} there, {tuple(wanted_shapes[name])} here"
            )
        raise CheckpointError(
            f"the checkpoint at {self._step_dir(step)} has a different model shape"
            f" ({detail}); use a new workdir or the config it was trained with"
        )

    def _restore_iterator(self, step: int, integrity: dict[str, Any], data_iter: Any) -> None:
        """Sets ``data_iter`` to the saved position, or leaves it at the start of
        its stream with a one-line note when the saved one cannot apply here.

        A shared state (every process saved the same: a position in one global
        stream) restores on any number of processes. Per-process states restore
        only on as many processes; those of checkpoints written before the
        global stream (no "shared" key, more than one process) are positions in
        per-process document shards, which the global stream cannot continue.
        A one-process state was always the global stream's.

        A position saved with the settings its stream depends on (the
        iterator's ``stream_settings``, recorded by `save`; training's:
        ``lexjax.training._stream_settings``) is never applied to an iterator
        of other settings: that repeats or skips data, or fails inside grain.
        It raises CheckpointError naming each changed setting.
        """
        record = integrity.get("data_iter")
        if record is None:
            log.warning(
                "checkpoint step %d has no data iterator state; the iterator starts from the "
                "beginning",
                step,
            )
            return
        count, index = jax.process_count(), jax.process_index()
        saved_count = record["process_count"]
        stream = record.get("stream", 1)
        if stream != STREAM_VERSION:
            if index == 0:
                log.warning(
                    "note: checkpoint step %d in %s holds a position in the data stream of an "
                    "older lexjax (stream %d, now %d: see lexjax/data/pipeline.py); the data "
                    "stream restarts from its beginning",
                    step,
                    self.directory,
                    stream,
                    STREAM_VERSION,
                )
            return
        saved, here = record.get("settings"), getattr(data_iter, "stream_settings", None)
        if saved and here:
            changed = [
                f"{name} is {saved[name]} there, {here[name]} here"
                for name in saved
                if name in here and saved[name] != here[name]
            ]
            if changed:
                raise other_stream(step, self.directory, changed)
        shared = record.get("shared", saved_count == 1)
        if not shared and (saved_count != count or "shared" not in record):
            why = (
                f"this run has {count}"
                if "shared" in record
                else "saved before the data stream was the same for any process count"
            )
            if index == 0:
                log.warning(
                    "note: checkpoint step %d in %s holds per-process data positions of %d "
                    "processes (%s); the data stream restarts from its beginning",
                    step,
                    self.directory,
                    saved_count,
                    why,
                )
            return
        source = 0 if shared else index
        path = self._step_dir(step) / _DATA_ITER / f"process_{source}-of-{saved_count}.json"
        try:
            state = _canonical_iterator_state(path.read_text().encode())
            ok = _sha256(state) == record["sha256"][source]
            error = None if ok else "checksum mismatch"
        except Exception as e:
            error = f"unreadable ({one_line(e, innermost=True)})"
        if not all_processes(error is None):
            raise _IteratorDamaged(f"data iterator state {error or 'damaged on another process'}")
        if isinstance(data_iter, grain.DatasetIterator):
            data_iter.set_state(json.loads(state))
        else:
            data_iter.set_state(state.encode())


# -- parameters only -----------------------------------------------------------


def abstract_params(config: Config) -> PyTree:
    """``jax.ShapeDtypeStruct`` of every (unboxed) parameter of ``config``'s model.
    How attention is computed makes no parameter: the shapes are traced with the
    explicit path, which every backend runs (splash is refused off a TPU)."""
    model = Decoder(dataclasses.replace(config.model, attention_impl="explicit"))
    init = lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    return jax.eval_shape(init)


def load_params(
    workdir: str | os.PathLike[str], *, sharding: Any = None
) -> tuple[Config, PyTree, int]:
    """The parameters of the newest good checkpoint of a training workdir, with
    the config stored beside them: ``(config, params, step)``.

    Reads only the ``params`` subtree of the saved state (no optimizer moments)
    and verifies the checksum of every array it reads; a damaged step is
    reported and the next older one tried, as :meth:`Checkpointer.restore` does.
    The tokenizer saved with that step is :func:`load_tokenizer` ``(workdir, step)``
    (or, read together, :func:`load_params_and_tokenizer`).
    ``sharding``: one ``jax.sharding.Sharding`` for every array, a pytree of
    them shaped like the params (any mesh), or a function of the stored config
    that returns either; default one device. Each array is read directly into
    its sharding.
    """
    loaded = _load(workdir, sharding, tokenizer=False)
    return loaded.config, loaded.params, loaded.step


class Loaded(NamedTuple):
    """What evaluation reads of a run: one step's parameters, config and tokenizer,
    and ``corpus``, the ``name/config/version`` of the corpus build it trained on
    (:attr:`lexjax.data.TextSource.build`; None where the step did not record it)."""

    config: Config
    params: PyTree
    step: int
    tokenizer: Any
    corpus: str | None


def _holds_steps(directory: str) -> bool:
    """Whether ``directory`` holds a numbered step with a train state (is a run's
    checkpoints/, not a folder of runs named 1, 2, …)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(n.isdigit() and os.path.isdir(os.path.join(directory, n, _STATE)) for n in names)


def misplaced_workdir(workdir, *, study: bool = True) -> str | None:
    """Advice where ``workdir``, without checkpoints of its own, is a place inside a
    run (its checkpoints/, or a directory in it) or, with ``study``, a study's
    ``--out`` (its runs are in runs/NAME): the directory meant. Else None."""
    workdir = os.path.abspath(workdir)
    for place in (workdir, os.path.dirname(workdir)):
        if _holds_steps(place):
            meant = shlex.quote(os.path.dirname(place))
            return f"{place} is a run's checkpoint directory; the run is {meant}"
    runs = sorted(glob.glob(os.path.join(glob.escape(workdir), "runs", "*", "checkpoints")))
    if study and runs:
        names = ", ".join(os.path.basename(os.path.dirname(r)) for r in runs)
        meant = shlex.quote(os.path.dirname(runs[0]))
        return f"{workdir} is a study's output with runs {names}; give one, e.g. {meant}"
    return None


def _unreadable(what, why: str) -> CheckpointError:
    """The error for a part of a run this user may not read (``why``: :func:`refused_by`'s)."""
    return CheckpointError(f"cannot read {what}{why}; ask its owner to share it (chmod -R a+rX)")


def _denied(error: BaseException) -> bool:
    """Whether ``error`` comes of a PermissionError (its causes and contexts walked)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, PermissionError) or "Permission denied" in str(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _open_run(workdir) -> Checkpointer:
    """A read-only Checkpointer on ``workdir``'s checkpoints, or the CheckpointError
    saying why there are none (decided by all processes together: what follows
    collects)."""
    check_workdir_path(workdir)
    directory = checkpoint_dir(workdir)
    # Another user's run: not "does not exist". Reading passes through the workdir (and
    # the directories above it, the nearest existing one checked) and lists checkpoints/.
    for place, access in ((nearest_existing(workdir), os.X_OK), (directory, os.R_OK | os.X_OK)):
        if os.path.isdir(place) and (why := refused_by(place, access)):
            raise _unreadable(place, why)
    if not all_processes(os.path.isdir(directory)):
        if os.path.exists(workdir) and not os.path.isdir(workdir):  # training there fails too
            raise CheckpointError(f"workdir {workdir} is not a directory; give the run's directory")
        if meant := misplaced_workdir(workdir):  # "train first" would make a run in there
            # checkpoints/20: the run it names is read at its newest step, maybe not 20
            step = os.path.basename(os.path.normpath(workdir))
            if step.isdigit() and _holds_steps(os.path.dirname(os.path.abspath(workdir))):
                meant += f" (read at its newest good step; step {int(step)} cannot be chosen)"
            raise CheckpointError(f"no checkpoint in {workdir}: {meant}")
        raise CheckpointError(
            f"no checkpoint in {workdir} ({directory} does not exist); train first: "
            + arg(
                "lexjax.train(config, workdir)",
                f"python train.py --workdir={shlex.quote(os.fspath(workdir))}",
            )
        )
    return Checkpointer(directory, read_only=True)


def _load(workdir, sharding, *, tokenizer: bool) -> Loaded:
    """`load_params`, and the tokenizer of the same step if `tokenizer` (else
    None). Its record is checked either way, so every reader picks the same step."""
    checkpointer = _open_run(workdir)
    directory = checkpointer.directory

    def read(step: int) -> tuple[Config, PyTree, Any]:
        integrity = checkpointer._read_integrity(step)  # read once: it checks the records too
        stored = checkpointer._read_config(step, integrity)
        if stored is None:
            raise CheckpointError(
                f"checkpoint step {step} in {directory} has no config; "
                "it was not written by train.py"
            )
        record = checkpointer._read_tokenizer(step, integrity)
        config = from_configdict(stored)
        shardings = sharding(config) if callable(sharding) else sharding
        params = _restore_params(checkpointer, step, integrity, abstract_params(config), shardings)
        tok = _tokenizer_of(checkpointer, step, stored, record) if tokenizer else None
        return config, params, tok, _recorded_corpus(integrity)

    try:
        step, (config, params, tok, corpus) = checkpointer._newest_good(read)
    finally:
        checkpointer.close()
    return Loaded(config, params, step, tok, corpus)


def load_params_and_tokenizer(workdir: str | os.PathLike[str], *, sharding: Any = None) -> Loaded:
    """:func:`load_params` and the tokenizer and corpus recorded with the same step,
    read together (a training run writing meanwhile may delete that step once it
    is read)."""
    return _load(workdir, sharding, tokenizer=True)


def _restore_params(
    checkpointer: Checkpointer, step: int, integrity: dict, abstract: PyTree, sharding
) -> PyTree:
    """Restores the ``params`` subtree of ``step`` and verifies it against the step's
    ``integrity`` record (raises _Damaged)."""
    saved = integrity["leaves"]
    # The train state is a dataclass (".params[...]"); accept a dict state too.
    prefix = next((p for p in (".params", "['params']") if p + "[" in "".join(saved)), ".params")
    wanted = [(prefix + name, leaf) for name, leaf in _leaf_names(abstract)]
    in_params = {name: r for name, r in saved.items() if name.startswith(prefix + "[")}
    checkpointer._check_shapes(step, in_params, wanted)
    algorithm = _algorithm(integrity)
    if sharding is None:
        sharding = jax.sharding.make_single_device_sharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.tree.map(lambda _: sharding, abstract)
    # Restore in the saved dtype so the checksum applies, then cast.
    dtypes = [np.dtype(saved[name]["dtype"]) for name, _ in wanted]
    treedef = jax.tree_util.tree_structure(abstract)
    restore_args = jax.tree_util.tree_unflatten(
        treedef,
        [
            ocp.ArrayRestoreArgs(sharding=s, global_shape=leaf.shape, dtype=d)
            for (_, leaf), s, d in zip(wanted, jax.tree.leaves(sharding), dtypes)
        ],
    )
    error = None
    try:
        handler = ocp.PyTreeCheckpointHandler()
        try:
            restored = handler.restore(
                checkpointer._step_dir(step) / _STATE,
                args=ocp.args.PyTreeRestore(
                    item={"params": abstract},
                    restore_args={"params": restore_args},
                    partial_restore=True,
                ),
            )["params"]
        finally:
            handler.close()
        bad = _mismatches(wanted, restored, saved, algorithm)
    except Exception as e:
        error = one_line(e, innermost=True)
    if not all_processes(error is None):
        raise _Damaged(f"orbax could not read it ({error or 'on another process'})")
    if bad:
        raise _Damaged(f"checksum mismatch in {len(bad)} array(s), first {bad[0]}")
    return jax.tree.map(lambda x, a: x.astype(a.dtype), restored, abstract)


# -- the tokenizer -------------------------------------------------------------


def stored_tokenizer(
    checkpointer: Checkpointer, step: int, config: dict[str, Any] | None
) -> data_lib.Tokenizer:
    """The tokenizer saved with ``step``. Checkpoints of an older lexjax saved none;
    they were all byte-level, which their config (``data.tokenizer`` absent or
    'bytes') confirms. ``config``: the config dict saved with the step."""
    return _tokenizer_of(checkpointer, step, config, checkpointer.restore_tokenizer_json(step))


def _tokenizer_of(
    checkpointer: Checkpointer, step: int, config: dict[str, Any] | None, record: Any
) -> data_lib.Tokenizer:
    if record is None:
        kind = ((config or {}).get("data") or {}).get("tokenizer", "bytes")
        if kind != "bytes":
            raise CheckpointError(
                f"checkpoint step {step} in {checkpointer.directory} has no saved {kind} "
                "tokenizer; it cannot be evaluated or resumed without the exact one it "
                "was trained with"
            )
        return data_lib.BYTES
    try:
        tokenizer = tokenizer_lib.from_json(record)
    except (DataError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"tokenizer of checkpoint step {step} in {checkpointer.directory} is damaged: "
            f"{one_line(e)}"
        ) from None
    vocab = ((config or {}).get("model") or {}).get("vocab_size")
    if isinstance(vocab, int) and tokenizer.vocab_size > vocab:  # ids past the table: NaN
        raise CheckpointError(
            f"checkpoint step {step} in {checkpointer.directory} does not hold together: its "
            f"tokenizer has {tokenizer.vocab_size} ids, its model's table {vocab}"
        )
    return tokenizer


def load_tokenizer(workdir: str | os.PathLike[str], step: int | None = None) -> data_lib.Tokenizer:
    """The tokenizer a training workdir's model was trained with, as saved with
    checkpoint ``step`` (default the newest good one, as :func:`load_params`
    picks it; pass the step it returned to pair them)."""
    checkpointer = _open_run(workdir)
    try:
        if step is None:
            step, (config, record) = checkpointer._newest_good(checkpointer._read_records)
            return _tokenizer_of(checkpointer, step, config, record)
        step = checkpointer._pick_step(step)
        return stored_tokenizer(checkpointer, step, checkpointer.restore_config(step))
    finally:
        checkpointer.close()


# --------------------------------------------------------------------------- program boundary


# orbax's warnings of a step without its metadata file (a step lexjax reports damaged,
# or reads without that file, in a line) and of a directory opened read-only (as
# lexjax opens one to look before it resumes).
_ORBAX_NOTICES = (
    "Metadata file does not exist",
    "CheckpointManagerOptions.read_only=True",
    "Given directory is read only",
)


def logged_by_orbax(record: logging.LogRecord) -> bool:
    """Whether orbax logged ``record`` (called from a filter, in the logging call).

    Its ``pathname`` names orbax's file, except where absl's caller lookup stops
    at absl's own ``log`` (with a user's filter on the "absl" logger, for one); the
    logging call's stack names orbax either way."""
    where = f"{os.sep}orbax{os.sep}"
    if where in record.pathname:
        return True
    return any(where in frame.f_code.co_filename for frame, _ in traceback.walk_stack(None))


class _NoOrbaxNotices(logging.Filter):
    """Drops orbax's records in ``_ORBAX_NOTICES`` (on the "absl" logger, which
    orbax logs to, for records that reach no filtered handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith(_ORBAX_NOTICES) and logged_by_orbax(record))


@contextlib.contextmanager
def absl_filter(quiet: logging.Filter):
    """``quiet`` on the "absl" logger, which orbax logs to, within the block."""
    logger = logging.getLogger("absl")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _NoOrbaxErrors(logging.Filter):
    """Drops ERROR logs of orbax's background writes: its own, and asyncio's
    "Task exception was never retrieved" for orbax's tasks; and orbax's warnings
    in ``_ORBAX_NOTICES``, whose cases lexjax reports itself or are no news.

    The same failure reaches the Checkpointer as an exception at the next save or
    wait, and the user sees it once, as one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        notice = record.getMessage().startswith(_ORBAX_NOTICES)
        if record.levelno < logging.ERROR and not notice:
            return True  # every other record below ERROR, without a walk of the stack
        orbax = logged_by_orbax(record)
        if orbax and notice:
            return False
        if record.levelno < logging.ERROR:
            return True
        if orbax:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            record.name == "asyncio"
            and (_from_checkpoint_io(exc) or f"{os.sep}orbax{os.sep}" in record.getMessage())
        )


def _from_checkpoint_io(exc: BaseException | None, obj=None) -> bool:
    """True for errors raised inside orbax/tensorstore's asynchronous plumbing."""
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    code = getattr(obj, "cr_code", None)
    files = [code.co_filename] if code is not None else []
    tb = getattr(exc, "__traceback__", None)
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return any(f"{os.sep}orbax{os.sep}" in f or f"{os.sep}tensorstore{os.sep}" in f for f in files)


_quiet = False


def quiet_background_errors() -> None:
    """Keeps orbax's background failures from printing tracebacks on stderr (once
    per process: later calls change nothing).

    A failed read or write surfaces three ways: as the exception the
    Checkpointer turns into one line, and as stray reports from the threads and
    coroutines that carried it (logged errors, "Exception ignored in
    <coroutine>", tensorstore callbacks hitting a closed event loop). Only the
    first is shown; every other error still reaches the default hooks, and so does
    any exception the main thread leaves uncaught (a user's own orbax call after
    ``lexjax.load`` in the same process still prints its traceback).
    """
    global _quiet
    if _quiet:
        return
    _quiet = True
    # absl's handler joins the root logger only inside app.run, after this runs.
    for handler in {*logging.getLogger().handlers, absl_logging.get_absl_handler()}:
        handler.addFilter(_NoOrbaxErrors())
    default_unraisable, default_excepthook = sys.unraisablehook, sys.excepthook

    def unraisable(report):
        if not _from_checkpoint_io(report.exc_value, report.object):
            default_unraisable(report)

    def excepthook(exc_type, exc, tb):  # a callback's error printed from another thread
        if threading.current_thread() is threading.main_thread() or not _from_checkpoint_io(exc):
            default_excepthook(exc_type, exc, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook
    # A save that fails part way leaves orbax's handlers' coroutines unawaited.
    warnings.filterwarnings(
        "ignore", r"coroutine '\w+CheckpointHandler\.\w+' was never awaited", RuntimeWarning
    )
