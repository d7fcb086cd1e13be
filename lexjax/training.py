"""The training loop: restore or initialise, step, log, validate, save.

:func:`train` resumes from the latest good checkpoint of its workdir (state
and data-iterator position, so a resumed run sees exactly the batches it would
have seen), stops cleanly on SIGTERM / Ctrl-C (finish the step, save, return)
and raises :class:`TrainingError` on a non-finite loss without saving that
state. The step itself is :mod:`lexjax.steps`; what is measured and written is
:mod:`lexjax.metrics`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lexjax import checkpoint as ckpt_lib
from lexjax import data as data_lib
from lexjax import distributed, errors, metrics, passkey, signals
from lexjax import lease as lease_lib
from lexjax import positions as pos_lib
from lexjax import sharding as shard_lib
from lexjax import steps as steps_lib
from lexjax.config import (
    DECAYING_ENCODINGS,
    Config,
    check_bool,
    check_int,
    check_path,
    field_at,
    from_configdict,
    is_real,
    model_changes,
    to_dict,
    upgraded,
)
from lexjax.errors import CheckpointError, ConfigError, TrainingError, arg, one_line, out_of_memory
from lexjax.optim import learning_rate_schedule
from lexjax.progress import Progress
from lexjax.steps import TrainSetup

__all__ = ["train"]


class _Stopped(BaseException):
    """A SIGTERM / Ctrl-C before the step loop: nothing was trained, so nothing to save.
    A BaseException, like KeyboardInterrupt, so no ``except Exception`` swallows it."""


class _StopFlag:
    """SIGTERM / Ctrl-C during one :func:`train` call (the handlers it found are
    restored on exit; off the main thread signals are left alone).

    Inside :meth:`raising` (from the lease taken until the step loop is set up)
    a signal raises :class:`_Stopped`, ending the call at once: the ``finally``
    blocks on its way out release the lease. Elsewhere it is a request to stop
    after the current step. A second Ctrl-C stops at once.

    A handler runs wherever the main thread is, also inside a callback whose
    exceptions Python only reports ("Exception ignored in ...": a gc callback of
    JAX's, a ``__del__``). There :func:`_deliver_again` swallows the report and has
    the signal delivered again, so that it raises where it ends the call.
    """

    def __init__(self):
        self.signal_name: str | None = None
        self._raising = False
        self._again = False
        self._previous = {}

    def __enter__(self):
        for sig in signals.STOP_SIGNALS:  # SIGHUP (a closed terminal) as SIGTERM
            if signals.ignored(sig):  # a background job's Ctrl-C, nohup's hangup: not for us
                continue
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        # One while the program started; or one that came since the handlers were set.
        self.signal_name = signals.take_deferred() or self.signal_name
        signals.on_swallowed(_Stopped, _deliver_again)
        _active.append(self)
        return self

    def _handle(self, signum, frame):
        again, self._again = self._again, False
        if not again:
            if self.signal_name is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            self.signal_name = signal.Signals(signum).name
        if self._raising:
            raise _Stopped(self.signal_name)

    def deliver_again(self) -> None:
        """The :class:`_Stopped` raised was swallowed by a callback: raise it anew
        (:func:`lexjax.signals.interrupt_main_later`) where it still can."""
        if self._raising and self.signal_name is not None:
            self._again = True
            signals.interrupt_main_later(signal.Signals[self.signal_name])

    @contextlib.contextmanager
    def raising(self):
        """Signals raise :class:`_Stopped` in this block (one that came before it, on
        entry). Not with several processes: they must stop together, which the loop
        arranges (they agree before its first step)."""
        try:
            self._raising = jax.process_count() == 1
            if self._raising and self.signal_name is not None:
                raise _Stopped(self.signal_name)
            yield
        finally:
            self._raising = False

    def __exit__(self, *exc):
        _active.remove(self)
        for sig, handler in self._previous.items():
            # None: a handler not set from Python, which cannot be put back
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


_active: list[_StopFlag] = []  # the train() calls running, innermost last


def _deliver_again() -> bool:
    """A :class:`_Stopped` swallowed by a callback: the innermost call raises it anew.
    Never reported while a call runs (a stop it no longer raises is recorded)."""
    if _active:
        _active[-1].deliver_again()
    return bool(_active)


def _source(config: Config, split: str) -> data_lib.TextSource:
    return data_lib.load_source(config.data.name, split, **config.data.corpus())


def _train_source(config: Config, tokenizer: data_lib.Tokenizer):
    """The train split, with passkey and copy documents mixed in when
    ``data.passkey_fraction`` or ``data.copy_fraction`` > 0."""
    source = _source(config, "train")
    if config.data.passkey_fraction == 0 and config.data.copy_fraction == 0:
        return source
    return passkey.PasskeyMix(
        source,
        fraction=config.data.passkey_fraction,
        copy_fraction=config.data.copy_fraction,
        length=config.train_len,
        tokenizer=tokenizer,
        seed=config.seed,
    )


def _tokenizer(config: Config) -> data_lib.Tokenizer:
    d = config.data
    tokenizer = data_lib.load_tokenizer(d.tokenizer, d.vocab_size, d.name, **config.data.corpus())
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size} is below the tokenizer's "
            f"{tokenizer.vocab_size} ids; leave it unset (it follows the tokenizer)"
        )
    return tokenizer


def _iterator(config: Config, source, tokenizer, setup: TrainSetup, seed: int, worker_count=0):
    """This process's rows of each global batch; the stream (and the iterator's
    state) is the same for any number of processes."""
    shard_index, shard_count = shard_lib.process_rows(setup.batch_sharding, config.batch_size)
    return data_lib.make_train_iterator(
        source,
        tokenizer=tokenizer,
        seq_len=config.train_len,
        batch_size=config.batch_size,
        seed=seed,
        shard_index=shard_index,
        shard_count=shard_count,
        worker_count=worker_count,
        shuffle_rows=config.data.shuffle_rows,
        open_documents=config.data.open_documents,
    )


def _stream_settings(config: Config, source) -> dict[str, Any]:
    """The settings the training stream, and so the position saved with each
    checkpoint, depend on (lexjax.checkpoint refuses a position saved under
    other ones). The document shuffle permutes the source's documents (the
    corpus's build, named by its fingerprint, their count, the feature read as
    their text and the passkey/copy mix) with ``seed``, which also seeds the
    packing and the row shuffle; ``batch_size`` is the packing's bins,
    ``train_len`` its row length,
    ``data.shuffle_rows`` the window (0 and 1 are both off),
    ``data.open_documents`` how many documents take turns and
    ``data.worker_count`` where packing runs. The process and device counts are
    not among them (elastic resume)."""
    d, documents = config.data, getattr(source, "source", source)  # before the mix
    return {
        "train corpus": getattr(documents, "build", None),
        "train documents": len(documents),
        "data.text_feature": d.text_feature,
        "data.passkey_fraction": d.passkey_fraction,
        "data.copy_fraction": d.copy_fraction,
        "seed": config.seed,
        "batch_size": config.batch_size,
        "train_len": config.train_len,
        "data.shuffle_rows": d.shuffle_rows if d.shuffle_rows > 1 else 0,
        "data.open_documents": d.open_documents,
        "data.worker_count": d.worker_count,
    }


def _check_workdir(workdir: str) -> None:
    """Creates ``workdir`` if needed; raises CheckpointError unless it is writable."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise CheckpointError(
            f"workdir {workdir} is a file; choose a directory for {arg('workdir')}"
        )
    inside = ckpt_lib.misplaced_workdir(workdir, study=False)
    if inside and not ckpt_lib.has_steps(workdir):  # a new run inside another's checkpoints
        raise CheckpointError(f"workdir {workdir} is inside another run: {inside}")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create workdir {workdir}: {e.strerror}; choose a writable {arg('workdir')}"
        ) from None
    if not os.access(workdir, os.W_OK):
        raise CheckpointError(
            f"workdir {workdir} is not writable; choose a writable {arg('workdir')}"
        )


def train(
    config: Config | Mapping[str, Any],
    workdir: str | os.PathLike[str],
    *,
    log: Callable[[str], None] = print,
    progress: bool = True,
    stop_after: int | None = None,
    peak_flops: float | None = None,
    lease_timeout_s: float = lease_lib.DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Trains (or resumes) ``config`` in ``workdir``; returns a summary dict.

    ``config``: a :class:`Config`, or the overrides :func:`lexjax.make_config` takes.
    ``log``: called with each line of the run's own (process 0 only): the model,
    notes, and with ``progress=False`` each logged step's ``step N/T loss …``,
    which ``progress`` (the default) shows on stdout instead (a bar on a terminal,
    a line per logged step elsewhere); the progress lines of a corpus build or a
    tokenizer learned go to stdout.

    The job holds the workdir's lease (:mod:`lexjax.lease`) throughout and
    releases it on every exit: a second job on the same workdir raises
    :class:`CheckpointError` naming the holder; a lease whose holder is gone
    (dead pid on this host, or no heartbeat for its ``lease_timeout_s``) is
    taken over with a one-line notice.

    SIGTERM / Ctrl-C finish the current step, save and return; before the first
    step (reading the corpus, restoring) they return at once, with nothing new
    to save (``step`` and ``start_step`` may then be None). A non-finite loss
    raises :class:`TrainingError` naming the step; that state is never
    saved. ``stop_after`` ends this invocation after that many steps, exactly
    as a SIGTERM would. ``peak_flops`` (per device; default the config's
    ``peak_flops``, else the datasheet figure of a known accelerator) sets the
    MFU denominator; without one MFU is not reported.

    The summary (JSON-serialisable) holds ``start_step``, ``step``, ``checkpoint_dir`` (a str),
    ``stopped_by`` (a signal name or None), ``num_params`` and the last logged
    ``loss``, ``learning_rate``, ``grad_norm``, ``tokens_per_sec`` (``mfu``)
    and ``val_loss``. ``tokens_per_sec`` counts ``batch_size × train_len``
    tokens per step (padding included) over the time of the training steps
    since the previous record: neither the first step of a call (compilation)
    nor validation and saves are timed, and a record after only that first
    step has no rate.
    """
    # A Config built by hand or with dataclasses.replace is checked like any other.
    config = from_configdict(config)
    _check_xpos_range(config)
    _check_param_dtype(config)
    workdir = check_path("workdir", workdir)
    ckpt_lib.check_workdir_path(workdir)  # before anything is trained
    data_lib.check_data_dir_path(config.data.data_dir)
    if not callable(log):
        raise ConfigError(f"log={log!r} must be a function of one str, such as print")
    progress = check_bool("progress", progress)
    if stop_after is not None:
        stop_after = check_int("stop_after", stop_after, bound="a positive integer or None")
    if peak_flops is not None and not (is_real(peak_flops) and 0 < peak_flops < float("inf")):
        raise ConfigError(
            f"peak_flops={peak_flops!r} must be a positive number (FLOP/s per device)"
        )
    if not (is_real(lease_timeout_s) and 0 < lease_timeout_s <= lease_lib.MAX_TIMEOUT_S):
        raise ConfigError(
            f"lease_timeout_s={lease_timeout_s!r} must be a number of seconds in "
            f"(0, {lease_lib.MAX_TIMEOUT_S:g}] (a week)"
        )
    with _StopFlag() as stop:  # from here on a signal ends the call cleanly
        created = not os.path.isdir(workdir)
        _check_workdir(workdir)
        is_main = jax.process_index() == 0
        say = log if is_main else (lambda _: None)
        try:
            with lease_lib.hold(workdir, timeout_s=lease_timeout_s, log=say) as lease:
                show = progress and is_main
                return _train(config, workdir, lease, say, show, stop_after, peak_flops, stop)
        except BaseException as e:
            if created and is_main:
                _remove_if_no_files(workdir)
            if out_of_memory(e):
                raise TrainingError(
                    f"out of memory ({one_line(e)}); lower batch_size (or raise "
                    "optim.grad_accum_steps), train_len or the model's size (model.*), or "
                    "set model.remat_policy=full"
                ) from None
            if not isinstance(e, _Stopped):
                raise
            errors.stopped_mid_work()  # its exception may have left a compilation running
        directory = ckpt_lib.checkpoint_dir(workdir)
        _say_nothing_trained(say, stop.signal_name, directory, ckpt_lib.has_steps(workdir))
        return dict(
            start_step=None,
            step=None,
            checkpoint_dir=directory,
            stopped_by=stop.signal_name,
            num_params=None,
        )


def _check_xpos_range(config: Config) -> None:
    """XPOS's key scale grows as ζ^(−p/b): beyond a position set by scale_base b it
    is past the compute dtype's largest number. Training's positions (centred,
    ±train_len/2) must keep it a factor 10 below that, room for keys of magnitude up
    to 10: refused before any work, not a non-finite loss at step 1. (With no room,
    b = 8 at train_len 1130 in float32 was accepted and every logit row was NaN; the
    full room of max_safe_position, 1e3, refused float16 configs that train.) Under
    PI the decay sees p/s, so its base is b·s; the other RoPE scalings keep b."""
    m = config.model
    if m.position not in DECAYING_ENCODINGS:
        return
    base = m.scale_base
    if m.rope_scaling == "pi":  # s: rope_factor, or (0) this length / rope_train_len
        rope_train_len = m.rope_train_len or config.train_len
        base *= m.rope_factor or pos_lib.length_factor(config.train_len, rope_train_len)
    limit = pos_lib.max_safe_position(base, dtype=m.dtype, margin=10.0)
    if config.train_len // 2 > limit:
        # The advice keeps all of max_safe_position's room for the keys' own magnitude
        # (1e3, more than the refusal asks for): its b at no room put the scale on the
        # edge, and the first step was not finite.
        room = pos_lib.max_safe_position(base, dtype=m.dtype)
        least = m.scale_base * (config.train_len // 2) / room  # the limit grows with b
        raise ConfigError(
            f"model.scale_base={m.scale_base:g} lets XPOS's scale overflow {m.dtype} beyond "
            f"positions ±{limit:.1f}, and train_len={config.train_len} trains at "
            f"±{config.train_len // 2}; use model.scale_base ≥ {math.ceil(least * 100) / 100:g} "
            "or a shorter train_len"
        )


# The newest few TrainSetups of this process, by config and devices: a notebook's next
# train() of the same config (stop_after=N again, another workdir) reuses the compiled
# init, train and eval steps instead of compiling them anew.
_SETUPS: dict[tuple, TrainSetup] = {}
_KEEP_SETUPS = 4
_SETUPS_LOCK = threading.Lock()  # train() may run in several threads of one process


def _setup(config: Config) -> TrainSetup:
    # The class and step function are part of the key: a test's wrapper is its own setup.
    key = (TrainSetup, steps_lib.train_step, repr(config), tuple(jax.devices()))
    with _SETUPS_LOCK:
        setup = _SETUPS.pop(key, None)
    setup = setup or TrainSetup(config)  # (built outside the lock: it traces the model)
    with _SETUPS_LOCK:
        _SETUPS[key] = setup  # the newest last
        while len(_SETUPS) > _KEEP_SETUPS:
            _SETUPS.pop(next(iter(_SETUPS)))
    return setup


def _check_param_dtype(config: Config) -> None:
    """float16 parameters are refused: AdamW keeps its moments in the parameters'
    dtype, where the second moment ((1 − b2)·g²) underflows to 0 for |g| below about
    2e-3 (b2 = 0.98), and such steps grow to about 100× the learning rate."""
    if config.model.param_dtype == "float16":
        raise ConfigError(
            "model.param_dtype=float16: AdamW's second moment, kept in the parameters' "
            "dtype, underflows to 0 there and its steps grow ~100× the learning rate; "
            "use param_dtype=float32, which also continues a run trained so "
            "(model.dtype=float16 computes in float16)"
        )


def _precision_notes(model) -> list[str]:
    """What a low-precision setting costs, said once at the start of training."""
    notes = []
    if model.param_dtype == "bfloat16":
        notes.append(
            "note: model.param_dtype=bfloat16 rounds away each update below 1/256 of its "
            "weight (no float32 copy is kept); param_dtype=float32 trains better at twice "
            "the parameters' memory"
        )
    if model.dtype == "float16":
        notes.append(
            "note: model.dtype=float16 has no loss scaling: the gradients of a batch of many "
            "tokens lose precision (a token's is ~1/tokens); bfloat16 keeps float32's range"
        )
    return notes


def _check_corpus_outside(config: Config, workdir: str) -> None:
    """Refuses corpus globs that match the run's own files (its workdir's, or the
    data dir's built corpus): they would be trained on, and every resume would see
    another corpus."""
    d = config.data
    places = {arg("workdir"): workdir, "data.data_dir": data_lib.resolve_data_dir(d.data_dir)}
    for what in ("files", "validation_files", "test_files"):
        data_lib.check_outside(getattr(d, what), f"data.{what}", places)


def _say_nothing_trained(say, signal_name: str, checkpoint_dir: str, resuming: bool) -> None:
    when = f"before resuming from {checkpoint_dir}" if resuming else "before the first step"
    say(f"stopped by {signal_name} {when}; there was nothing new to save")


def _remove_if_no_files(workdir: str) -> None:
    """Removes a workdir this run created when the run failed before writing a file
    into it (it may hold empty directories), so no empty run is left behind."""
    if not any(files for _, _, files in os.walk(workdir)):
        shutil.rmtree(workdir, ignore_errors=True)


def _train(config, workdir, lease, say, show_progress, stop_after, peak_flops, stop):
    # Until the loop is set up a signal ends the call (stop.raising); in the loop it
    # stops after the current step.
    with stop.raising():
        for note in _precision_notes(config.model):
            say(note)
        _check_same_corpus(config, workdir)
        if jax.process_count() > 1:
            # Process 0 builds the dataset (and its tokenizer) first, so processes sharing
            # a data_dir never write it at the same time; the others then load it. The
            # byte tokenizer needs no build, so the source is opened explicitly.
            if jax.process_index() == 0:
                _tokenizer(config)
                _source(config, "train")
            distributed.any_process(False)
        _check_corpus_outside(config, workdir)
        tokenizer = _tokenizer(config)
        setup = _setup(config)
        train_source = _train_source(config, tokenizer)

        def data_stream():
            """A new iterator at the start of the training stream, with its workers."""
            it = _iterator(
                config, train_source, tokenizer, setup, config.seed, config.data.worker_count
            )
            it.stream_settings = _stream_settings(config, train_source)  # lexjax.checkpoint
            return it

        data_iter = data_stream()
        # Read now, not at the first evaluation: a corpus without a validation split
        # must fail before training, not after eval_every steps of it. The same fixed
        # batches are used at every evaluation.
        try:
            val_iter = _iterator(config, _source(config, "validation"), tokenizer, setup, seed=0)
            with contextlib.closing(val_iter):
                val_batches = [next(val_iter) for _ in range(config.eval_batches)]
            checkpointer = ckpt_lib.Checkpointer(
                ckpt_lib.checkpoint_dir(workdir),
                keep=config.keep_checkpoints,
                on_corrupt=config.on_corrupt_checkpoint,
            )
        except BaseException:
            data_iter.close()
            raise
    if peak_flops is None:
        peak_flops = getattr(config, "peak_flops", None)
    # Closing the iterator ends its grain worker processes and frees the batches
    # they had put in shared memory (left to exit, they were reported as leaked).
    with contextlib.closing(data_iter):
        try:
            with stop.raising():  # (a signal that came in between raises on entry)
                state, step = _restore_or_init(setup, checkpointer, data_iter, tokenizer, say)
            loop = _Loop(setup, checkpointer, data_iter, tokenizer, workdir, say, peak_flops, lease)
            loop.data_stream = data_stream  # for a replacement (_Loop._next_batch)
            return loop.run(state, step, val_batches, show_progress, stop_after, stop)
        finally:
            checkpointer.close()


def _check_same_corpus(config: Config, workdir: str) -> None:
    """A resume on a corpus whose files changed is refused before that corpus is built
    and its tokenizer learned (on a large corpus minutes of work, and a build left
    behind), as the restore would refuse it after them."""
    directory = ckpt_lib.checkpoint_dir(workdir)
    trained = ckpt_lib.trained_corpus(directory)
    if trained is None:
        return
    planned = data_lib.planned_build(config.data)
    if planned is not None and planned != trained[1]:
        changed = [f"train corpus is {trained[1]} there, {planned} here"]
        raise ckpt_lib.other_stream(trained[0], directory, changed)


def _restore_or_init(setup: TrainSetup, checkpointer, data_iter, tokenizer, say):
    config = setup.config
    if checkpointer.latest_step() is None:
        say(
            f"model: {setup.num_params / 1e6:.2f} M parameters, "
            f"position={config.model.position}, mesh {dict(setup.mesh.shape)}"
        )
        return setup.init_state(), 0

    def same_model(stored: dict | None) -> None:
        if diff := model_changes(stored or {}, config):
            raise CheckpointError(
                f"workdir {os.path.dirname(checkpointer.directory)} holds checkpoints of "
                f"another model ({'; '.join(diff)}); use a new {arg('workdir')} or "
                "the checkpoint's values"
            )

    state, stored, step = checkpointer.restore(
        abstract_state=setup.abstract_state, data_iter=data_iter, check_config=same_model
    )
    saved = ckpt_lib.stored_tokenizer(checkpointer, step, stored)
    stored = upgraded(stored or {})  # an older lexjax's field names, for the changes said
    if saved.fingerprint != tokenizer.fingerprint:
        raise CheckpointError(
            f"workdir {checkpointer.directory} was trained with another tokenizer "
            f"({saved.describe(tokenizer)}) than this corpus build gives "
            f"({tokenizer.describe(saved)}); "
            f"use a new {arg('workdir')} or the corpus and tokenizer it was trained with"
        )
    say(f"resumed from {checkpointer.directory} at step {step}, mesh {dict(setup.mesh.shape)}")
    if config.num_train_steps > step:  # else "already trained": no update follows
        if changed := _schedule_changes(stored or {}, config, int(step)):
            say(
                f"learning-rate schedule changed: {', '.join(changed)}; "
                f"from step {step} the rate follows the new schedule"
            )
        if changed := _changes(stored or {}, config, _OPTIMIZER_FIELDS):
            say(
                f"optimizer settings changed: {', '.join(changed)}; "
                f"from step {step} the updates use the new values"
            )
    return state, int(step)


# Settings of the updates a resume may change (the moments keep their meaning); said
# in one line, as the schedule's are. grad_accum_steps changes only memory.
_OPTIMIZER_FIELDS = ("optim.b1", "optim.b2", "optim.eps", "optim.weight_decay", "optim.grad_clip")
_SCHEDULE_FIELDS = (
    "num_train_steps",
    "learning_rate",
    "warmup_steps",
    "optim.schedule",
    "optim.end_lr_fraction",
)


def _changes(stored: dict, config: Config, names) -> list[str]:
    """``"field old → new"`` for each of ``names`` whose value in the checkpoint's
    config (where it has one) differs from ``config``'s."""
    now = to_dict(config)
    pairs = [(name, field_at(stored, name), field_at(now, name)) for name in names]
    return [f"{name} {old} → {new}" for name, old, new in pairs if old is not None and old != new]


def _schedule_changes(stored: dict, config: Config, step: int) -> list[str]:
    """``"field old → new"`` for each schedule setting that differs from the
    checkpoint's config, if the rates of the updates left from ``step`` on differ;
    else nothing."""

    before = to_dict(config)
    changed = _changes(stored, config, _SCHEDULE_FIELDS)
    if not changed:
        return []
    for name in _SCHEDULE_FIELDS:
        if (old := field_at(stored, name)) is not None:
            *parents, key = name.split(".")
            (before[parents[0]] if parents else before)[key] = old  # one level at most
    try:
        old_config = from_configdict(before)
    except ConfigError:  # a value this version no longer takes: say what changed
        return changed
    # The rates of the updates this run makes: update s (from 0) takes the rate at s.
    steps = jnp.arange(step, config.num_train_steps)
    rates = [learning_rate_schedule(c)(steps) for c in (config, old_config)]
    return [] if bool(jnp.allclose(*rates, rtol=1e-6, atol=0.0)) else changed


class _Position:
    """A data iterator's position before the batch that failed, saved as
    :meth:`Checkpointer.save` saves an iterator (``get_state``, ``stream_settings``)."""

    def __init__(self, state, stream_settings):
        self.state, self.stream_settings = state, stream_settings

    def get_state(self):
        return self.state


class _Loop:
    """One invocation of the step loop, with its metrics, progress and saves."""

    def __init__(
        self, setup: TrainSetup, checkpointer, data_iter, tokenizer, workdir, say, peak_flops, lease
    ):
        self.setup, self.checkpointer, self.data_iter = setup, checkpointer, data_iter
        self.data_stream: Callable[[], Any] | None = None  # makes a new data_iter
        self.replaced_data_iter = False  # then data_iter is ours to close, not the caller's
        # data_iter's position before the batch being read, with one process (a save
        # is collective: with several, one that fails alone, as with a per-host copy
        # of the build, cannot save, so none does)
        self.position, self.one_process = None, jax.process_count() == 1
        self.tokenizer, self.workdir, self.lease = tokenizer, workdir, lease
        self.say = say
        self.writer = metrics.MetricsWriter(workdir, jax.process_index() == 0)
        self.peak = metrics.peak_flops(jax.devices()[0].device_kind, peak_flops)
        self.pending: list[tuple[int, dict]] = []  # (step, metrics) not yet read back
        self.summary: dict[str, Any] = {}

    def run(self, state, step, val_batches, show_progress, stop_after, stop) -> dict[str, Any]:
        setup, config, checkpointer = self.setup, self.setup.config, self.checkpointer
        total = config.num_train_steps
        self.summary["start_step"] = step
        self.writer.start_at(step)
        if step >= total:  # already trained: drop what a killed run left after `step`
            self.writer.settle_at(step)
        self.last = (time.perf_counter(), step)
        # On stdout with the other log lines; one line per log step off a terminal.
        self.bar = Progress(
            total,
            label="step",
            start=step,
            stream=sys.stdout,
            enabled=show_progress,
            min_interval_s=0,
        )
        saved_step = step if checkpointer.latest_step() == step else None
        with jax.set_mesh(setup.mesh):
            try:
                while step < total and not self._stop_requested(stop, step):
                    try:
                        batch = self._next_batch(stop)
                    except errors.DataError as e:  # a damaged record, read only now
                        raise self._save_before(e, step, state, saved_step) from e
                    state, step_metrics = setup.train_step(state, setup.global_batch(batch))
                    step += 1
                    if step == self.summary["start_step"] + 1:  # compiled and ran: not timed
                        jax.block_until_ready(step_metrics)
                        self.last = (time.perf_counter(), step)
                    self.pending.append((step, step_metrics))
                    boundary = step == total or step % config.checkpoint_every == 0
                    evaluate = step == total or step % config.eval_every == 0
                    if boundary or evaluate or step % config.log_every == 0:
                        self._flush()
                    if evaluate:
                        self._validate(state.params, step, val_batches)
                    if boundary:
                        saved_step = self._save(step, state)
                    if evaluate or boundary:  # the next rate times training steps only
                        self.last = (time.perf_counter(), step)
                    # Not at the last step: a run that finished was reported stopped.
                    left = step < total and stop_after is not None
                    if left and step - self.summary["start_step"] >= stop_after:
                        stop.signal_name = stop.signal_name or "stop_after"
                if self.pending:
                    self._flush()
                trained = step > self.summary["start_step"] or stop.signal_name is None
                if saved_step != step and trained:
                    self._save(step, state)
                checkpointer.wait()
            finally:
                self.bar.close()
                self.writer.close()
                if self.replaced_data_iter:
                    self.data_iter.close()
        self.summary.update(
            step=step,
            checkpoint_dir=str(checkpointer.directory),  # a str, as when it stops early
            stopped_by=stop.signal_name,
            num_params=setup.num_params,
        )
        if stop.signal_name and not trained:
            resuming = checkpointer.latest_step() is not None
            _say_nothing_trained(self.say, stop.signal_name, checkpointer.directory, resuming)
        elif stop.signal_name:
            self.say(
                f"stopped by {stop.signal_name} at step {step}; checkpoint saved in "
                f"{checkpointer.directory}"
            )
        return self.summary

    def _stop_requested(self, stop: _StopFlag, step: int) -> bool:
        """Whether to stop before the next step.

        Steps and saves are collective, so with several processes all must stop
        at the same step, also when only one got the signal: they agree at the
        log and checkpoint steps, where the host waits for the devices anyway.
        """
        local = stop.signal_name is not None
        if jax.process_count() == 1:
            return local
        config = self.setup.config
        if step % config.log_every and step % config.checkpoint_every:
            return False
        if distributed.any_process(local):
            stop.signal_name = stop.signal_name or "a signal to another process"
            return True
        return False

    def _save_before(self, error, step: int, state, saved_step) -> errors.DataError:
        """``error``, once the steps trained since the last save are saved with the
        data position before the batch that failed (the run resumes there once the
        data is mended), saying where. Not with several processes (a save is
        collective, and the others may not have failed): they stop as before."""
        if saved_step != step:
            if self.position is None or step == self.summary["start_step"]:
                return error  # nothing trained here (or several processes)
            if self.pending:
                self._flush()  # a non-finite step raises, and is not saved
            settings = getattr(self.data_iter, "stream_settings", None)
            try:
                self._save(step, state, _Position(self.position, settings))
                self.checkpointer.wait()
            except CheckpointError as e:  # the data's error first: it is why the run stopped
                return errors.DataError(f"{error}; saving the steps trained before failed: {e}")
        return errors.DataError(
            f"{error}; the steps trained before the damaged record was read are saved "
            f"(checkpoint step {step} in {self.checkpointer.directory}), and the run resumes there"
        )

    def _next_batch(self, stop: _StopFlag) -> dict:
        """The next batch.

        A signal to the whole process group (a terminal's Ctrl-C, a scheduler's or
        a shutdown's SIGTERM to every process) reaches grain's worker processes
        too, and SIGTERM ends them, so after a stop request the next batch may
        fail (grain raises on the dead worker). The run still has to reach the
        step where it stops (with several processes, the one they agree on): the
        iterator is replaced, once, by a new one at the position reached, with
        new workers, and the run stops and saves where it would have.
        """
        if self.one_process:  # kept for a save should the next batch fail
            self.position = self.data_iter.get_state()
        try:
            return next(self.data_iter)
        except Exception:
            if stop.signal_name is None or self.replaced_data_iter:
                raise
        position = self.data_iter.get_state()
        self.data_iter.close()
        self.data_iter, self.replaced_data_iter = self.data_stream(), True
        self.data_iter.set_state(position)
        return next(self.data_iter)

    def _flush(self) -> None:
        """Reads back the metrics of the steps dispatched since the last flush
        (the host waits for the devices only here) and logs the newest."""
        values = jax.device_get([m for _, m in self.pending])
        for (s, _), m in zip(self.pending, values):
            if not bool(m["finite"]):
                with contextlib.suppress(RuntimeError):  # a failed write is reported by close()
                    self.checkpointer.wait()  # so the message names a finished checkpoint
                latest = self.checkpointer.latest_step()
                saved = "no checkpoint yet" if latest is None else f"step {latest}"
                # Step 1's loss and gradient are the initial parameters': no rate acted yet.
                advice = (
                    "the initial model gives it, before any update: check the model's config "
                    "(its dtype, position settings such as scale_base or theta) and the data"
                    if s == 1
                    else "lower learning_rate or raise warmup_steps (or optim.grad_clip below "
                    "its value) and train again"
                )
                raise TrainingError(
                    f"non-finite loss ({float(m['loss'])}) or gradient at step {s}; stopped "
                    f"without saving that state (last checkpoint: {saved} in "
                    f"{self.checkpointer.directory}); {advice}"
                )
        step, m = self.pending[-1][0], values[-1]
        self.pending.clear()
        # The first record starts the TensorBoard writer (about 2 s: its import; not at
        # the loop's start, so a run that fails at its first batch leaves no files): it
        # is not timed.
        opening = time.perf_counter()
        self.writer.open()
        untimed = time.perf_counter() - opening
        now, (then, then_step) = time.perf_counter(), self.last
        config = self.setup.config
        self.last = (now, step)
        record = {
            "loss": float(m["loss"]),
            "learning_rate": float(m["learning_rate"]),
            "grad_norm": float(m["grad_norm"]),
        }
        shown = f"loss {record['loss']:.3f}"
        if step > then_step:  # else only the first step (with its compilation) ran since
            tokens = (step - then_step) * config.batch_size * config.train_len
            rate = tokens / max(now - then - untimed, 1e-9)
            record["tokens_per_sec"] = rate
            if self.peak is not None:
                record["mfu"] = metrics.mfu(rate, config, self.peak, jax.device_count())
            shown += f" {rate:,.0f} tok/s"
        self.writer.write(step, record)
        self.summary.update(record)
        self.bar.update(step, shown)
        if not self.bar.enabled:  # the display shows it otherwise
            self.say(f"step {step}/{config.num_train_steps} {shown}")

    def _validate(self, params, step: int, val_batches) -> None:
        setup = self.setup
        sums = [setup.eval_step(params, setup.global_batch(b)) for b in val_batches]
        nll, weight = map(sum, zip(*jax.device_get(sums)))
        self.summary["val_loss"] = float(nll / max(weight, 1.0))
        self.writer.write(step, {"val_loss": self.summary["val_loss"]})

    def _save(self, step: int, state, data_iter=None) -> int:
        lease_lib.check_held(self.lease, self.workdir)  # never write over another job
        self.checkpointer.save(
            step,
            state,
            data_iter=data_iter or self.data_iter,
            config=to_dict(self.setup.config),
            tokenizer=self.tokenizer.to_json(),
        )
        return step
