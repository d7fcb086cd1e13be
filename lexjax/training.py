"""Train state, optimizer, sharded train step and the train loop.

The train step is one ``jax.jit`` with explicit ``in_shardings`` /
``out_shardings`` and the state donated, run under ``jax.set_mesh``. The same
code runs on one CPU, on 8 simulated devices and on a pod: only the mesh and
the rules table change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lexjax import distributed
from lexjax import sharding as shard_lib
from lexjax.config import Config, to_dict
from lexjax.errors import TrainingError
from lexjax.model import Decoder, count_params

__all__ = [
    "TrainState",
    "make_optimizer",
    "learning_rate_schedule",
    "loss_fn",
    "Trainer",
    "TrainingError",
    "flops_per_token",
    "train",
]


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def learning_rate_schedule(config: Config) -> optax.Schedule:
    """Linear warmup to the peak, then cosine / polynomial decay or constant."""
    o = config.optim
    peak, steps, warm = config.learning_rate, config.num_train_steps, config.warmup_steps
    end = peak * o.end_lr_fraction
    decay_steps = max(steps - warm, 1)
    if o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=o.end_lr_fraction)
    elif o.schedule == "polynomial":
        decay = optax.polynomial_schedule(peak, end, power=1.0, transition_steps=decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), decay], [warm])


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW; no weight decay on biases and LayerNorm scales."""
    o = config.optim
    decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
        optax.adamw(
            learning_rate_schedule(config),
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=o.weight_decay,
            mask=decay_mask,
        ),
    )


def loss_fn(params, model: Decoder, batch) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy over real tokens (segment id > 0); returns (loss, weight)."""
    logits, _ = model.apply(
        {"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    weights = (batch["segment_ids"] > 0).astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    total = jnp.sum(weights)
    return jnp.sum(nll * weights) / jnp.maximum(total, 1.0), total


def flops_per_token(config: Config) -> float:
    """Analytic training FLOPs per token: 6·(matmul params) + causal attention (counted half).

    Forward+backward = 3× forward; forward = 2 FLOPs per multiply-add. The
    attention scores and weighted sum cost ``2·2·T·D`` per token per layer
    forward, halved because causal attention needs only the lower triangle.
    """
    m = config.model
    per_layer = 4 * m.d_model * m.d_model + 2 * m.d_model * m.mlp_dim
    matmul_params = m.num_layers * per_layer + m.vocab_size * m.d_model
    attention = m.num_layers * 2 * config.train_len * m.d_model
    return 6.0 * matmul_params + 3.0 * attention


def _abstract_state(model: Decoder, tx, config: Config):
    """The state's shapes with logical-axis boxes, computed without allocating.

    optax builds its moments with tree maps that go inside Flax's
    ``LogicallyPartitioned`` boxes, so the optimizer state carries the same
    logical axes as the parameters it mirrors (scalars come out unboxed).
    """
    tokens = jnp.zeros((1, config.train_len), jnp.int32)

    def init(rng):
        boxed = model.init(rng, tokens)["params"]
        return TrainState(step=jnp.zeros((), jnp.int32), params=boxed, opt_state=tx.init(boxed))

    return jax.eval_shape(init, jax.random.key(0))


class Trainer:
    """Holds the model, mesh, shardings and jitted steps for one config.

    ``Trainer(config).init_state(seed)`` builds a sharded state directly on
    the devices (each device materialises only its shard);
    ``train_step(state, batch)`` and ``eval_step(params, batch)`` are the
    jitted, sharded functions.
    """

    def __init__(self, config: Config, devices=None):
        self.config = config
        self.mesh = shard_lib.make_mesh(config, devices)
        self.rules = shard_lib.rules(config)
        self.model = Decoder(config.model)
        self.tx = make_optimizer(config)
        boxed = _abstract_state(self.model, self.tx, config)
        self.state_shardings = shard_lib.param_shardings(boxed, self.mesh, self.rules)
        abstract = nn.unbox(boxed)
        self.abstract_state = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            self.state_shardings,
        )
        self.batch_sharding = shard_lib.batch_sharding(self.mesh, self.rules)
        self.num_params = count_params(abstract.params)
        self._build_steps()

    def _build_steps(self):
        config, model, tx = self.config, self.model, self.tx
        accum = config.optim.grad_accum_steps

        def init(rng):
            tokens = jnp.zeros((1, config.train_len), jnp.int32)
            params = nn.unbox(model.init(rng, tokens)["params"])
            return TrainState(
                step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params)
            )

        def grads_of(params, batch):
            (loss, weight), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model, batch)
            return loss, weight, grads

        def train_step(state: TrainState, batch):
            if accum == 1:
                loss, _, grads = grads_of(state.params, batch)
            else:
                micro = jax.tree_util.tree_map(
                    lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch
                )

                def body(carry, mb):
                    loss, weight, grads = grads_of(state.params, mb)
                    total_loss, total_weight, total_grads = carry
                    total_grads = jax.tree_util.tree_map(
                        lambda a, g: a + g * weight, total_grads, grads
                    )
                    return (total_loss + loss * weight, total_weight + weight, total_grads), None

                zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
                (loss, weight, grads), _ = jax.lax.scan(
                    body, (jnp.zeros(()), jnp.zeros(()), zeros), micro
                )
                weight = jnp.maximum(weight, 1.0)
                loss = loss / weight
                grads = jax.tree_util.tree_map(lambda g: g / weight, grads)
            grad_norm = optax.global_norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            # A non-finite step never reaches the state: the loop stops on it and
            # the state it would have saved is the last good one.
            keep = lambda new, old: jax.tree_util.tree_map(
                lambda n, o: jnp.where(finite, n, o), new, old
            )
            new_state = TrainState(
                step=state.step + finite.astype(jnp.int32),
                params=keep(params, state.params),
                opt_state=keep(opt_state, state.opt_state),
            )
            metrics = {
                "loss": loss,
                "grad_norm": grad_norm,
                "finite": finite,
                "learning_rate": learning_rate_schedule(config)(state.step),
            }
            return new_state, metrics

        def eval_step(params, batch):
            loss, weight = loss_fn(params, model, batch)
            return loss * weight, weight

        repl = shard_lib.replicated(self.mesh)
        self._init = jax.jit(init, out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            train_step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, repl),
            donate_argnums=(0,),
        )
        self.eval_step = jax.jit(
            eval_step,
            in_shardings=(self.state_shardings.params, self.batch_sharding),
            out_shardings=(repl, repl),
        )

    def init_state(self, seed: int | None = None) -> TrainState:
        seed = self.config.seed if seed is None else seed
        with jax.set_mesh(self.mesh):
            return self._init(jax.random.key(seed))

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assembles each process's rows into global arrays sharded over the batch axes."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in local_batch.items()
        }


def mfu_peak_flops() -> tuple[float, str]:
    """Per-device peak FLOP/s for MFU: the chip's datasheet bf16 figure where known,
    else a measured jitted float32 matmul (CPU)."""
    kind = jax.devices()[0].device_kind.lower()
    table = {
        "h200": 989e12,
        "h100": 989e12,
        "a100": 312e12,
        "tpu v4": 275e12,
        "tpu v5 lite": 197e12,
        "tpu v5e": 197e12,
        "tpu v5p": 459e12,
        "tpu v6": 918e12,
    }
    for name, flops in table.items():
        if name in kind:
            return flops, f"{name} datasheet bf16 dense"
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best, "measured f32 matmul"


class _StopFlag:
    """Turns SIGTERM / Ctrl-C into a request to stop after the current step."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Progress:
    """A progress bar with ETA on a terminal, plain periodic lines otherwise."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start, self.enabled = total, start, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, text: str):
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        if self.tty:
            width = 30
            filled = int(width * step / self.total)
            bar = "#" * filled + "-" * (width - filled)
            print(f"\r[{bar}] {step}/{self.total} {text} eta {eta:5.0f}s", end="", flush=True)
        else:
            print(f"step {step}/{self.total} {text} eta {eta:.0f}s", flush=True)

    def close(self):
        if self.tty:
            print(flush=True)


class _MetricsWriter:
    """metrics.jsonl + TensorBoard event files under the workdir (process 0 only)."""

    def __init__(self, workdir: str, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, values: dict[str, float]):
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        for key, value in values.items():
            if isinstance(value, (int, float)) and value is not None:
                self.tb.add_scalar(key, value, step)
        self.tb.flush()

    def close(self):
        if self.enabled:
            self.jsonl.close()
            self.tb.close()


def _validation_batches(config: Config, count: int):
    """A fixed list of validation batches (this process's rows), the same at every eval."""
    from lexjax import data as data_lib

    source = data_lib.load_source(
        config.data.name,
        "validation",
        data_dir=config.data.data_dir,
        files=config.data.files,
        text_feature=config.data.text_feature,
    )
    it = data_lib.make_train_iterator(
        source,
        seq_len=config.train_len,
        batch_size=config.batch_size // jax.process_count(),
        seed=0,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )
    return [next(it) for _ in range(count)]


def _check_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise TrainingError(
            f"cannot create workdir {workdir}: {e.strerror}; choose a writable --workdir"
        ) from None
    if not os.access(workdir, os.W_OK):
        raise TrainingError(f"workdir {workdir} is not writable; choose a writable --workdir")


def train(
    config: Config,
    workdir: str,
    *,
    log: Callable[[str], None] = print,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Trains (or resumes) ``config`` in ``workdir``; returns a summary dict.

    Resumes from the latest good checkpoint in ``workdir/checkpoints`` (state
    and data-iterator position), so an interrupted run continues with exactly
    the batches it would have seen. SIGTERM / Ctrl-C finish the current step,
    save and return. A non-finite loss raises :class:`TrainingError` naming the
    step; that state is never saved. ``stop_after`` ends this invocation after
    that many steps, exactly as a SIGTERM would (used to test resumption).
    """
    from lexjax import checkpoint as ckpt_lib
    from lexjax import data as data_lib

    _check_workdir(workdir)
    is_main = jax.process_index() == 0
    say = log if is_main else (lambda _: None)
    trainer = Trainer(config)
    if jax.process_count() > 1:
        # Process 0 builds a dataset first, so processes sharing a data_dir never
        # write it at the same time; the others then load (or build their own copy).
        if is_main:
            data_lib.load_source(
                config.data.name,
                "train",
                data_dir=config.data.data_dir,
                files=config.data.files,
                text_feature=config.data.text_feature,
            )
        distributed.any_process(False)
    source = data_lib.load_source(
        config.data.name,
        "train",
        data_dir=config.data.data_dir,
        files=config.data.files,
        text_feature=config.data.text_feature,
    )
    data_iter = data_lib.make_train_iterator(
        source,
        seq_len=config.train_len,
        batch_size=config.batch_size // jax.process_count(),
        seed=config.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
        worker_count=config.data.worker_count,
    )
    # Read now, not at the first evaluation: a corpus without a validation split
    # must fail before training, not after eval_every steps of it.
    val_batches = _validation_batches(config, config.eval_batches)
    ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
    checkpointer = ckpt_lib.Checkpointer(
        ckpt_dir, keep=config.keep_checkpoints, on_corrupt=config.on_corrupt_checkpoint
    )
    try:
        state, step = _restore_or_init(trainer, checkpointer, data_iter, config, say)
        return _loop(
            trainer,
            checkpointer,
            data_iter,
            val_batches,
            state,
            step,
            config,
            workdir,
            say,
            progress and is_main,
            stop_after,
        )
    finally:
        checkpointer.close()


def _restore_or_init(trainer, checkpointer, data_iter, config, say):
    if checkpointer.latest_step() is None:
        say(
            f"model: {trainer.num_params / 1e6:.2f} M parameters, position={config.model.position}, "
            f"mesh {dict(trainer.mesh.shape)}"
        )
        return trainer.init_state(), 0
    stored = checkpointer.restore_config()
    stored_model = (stored or {}).get("model")
    ours = dataclasses.asdict(config.model)
    if stored_model is not None and {k: stored_model.get(k) for k in ours} != ours:
        diff = sorted(k for k in ours if stored_model.get(k) != ours[k])
        raise TrainingError(
            f"workdir {checkpointer.directory} holds checkpoints of another model "
            f"(differs in model.{', model.'.join(diff)}); use a new --workdir or "
            "the same model config"
        )
    state, _, step = checkpointer.restore(
        abstract_state=trainer.abstract_state, data_iter=data_iter
    )
    say(f"resumed from {checkpointer.directory} at step {step}")
    return state, int(step)


def _loop(
    trainer: Trainer,
    checkpointer,
    data_iter,
    val_batches,
    state,
    step,
    config: Config,
    workdir,
    say,
    show_progress,
    stop_after,
) -> dict[str, Any]:
    total = config.num_train_steps
    writer = _MetricsWriter(workdir, jax.process_index() == 0)
    bar = _Progress(total, step, show_progress)
    tokens_per_step = config.batch_size * config.train_len
    peak, _ = mfu_peak_flops()
    flops = flops_per_token(config)
    pending: list[tuple[int, dict]] = []
    last = {"time": time.perf_counter(), "step": step}
    summary: dict[str, Any] = {"start_step": step}
    saved_step = step if checkpointer.latest_step() == step else None

    def flush():
        """Reads the metrics of the steps dispatched since the last flush."""
        values = jax.device_get([m for _, m in pending])
        for (s, _), m in zip(pending, values):
            if not bool(m["finite"]):
                with contextlib.suppress(RuntimeError):  # a failed write is reported by close()
                    checkpointer.wait()  # so the message names a finished checkpoint
                raise TrainingError(
                    f"non-finite loss ({float(m['loss'])}) or gradient at step {s}; stopped "
                    f"without saving that state (last checkpoint: step "
                    f"{checkpointer.latest_step()} in {checkpointer.directory})"
                )
        s, m = pending[-1][0], values[-1]
        pending.clear()
        now = time.perf_counter()
        rate = (s - last["step"]) * tokens_per_step / max(now - last["time"], 1e-9)
        last.update(time=now, step=s)
        record = {
            "loss": float(m["loss"]),
            "learning_rate": float(m["learning_rate"]),
            "grad_norm": float(m["grad_norm"]),
            "tokens_per_sec": rate,
            "mfu": rate * flops / (peak * jax.device_count()),
        }
        writer.write(s, record)
        summary.update(record)
        bar.update(s, f"loss {record['loss']:.3f} {rate:,.0f} tok/s")

    def save(s):
        nonlocal saved_step
        checkpointer.save(s, state, data_iter=data_iter, config=to_dict(config))
        saved_step = s

    def stop_requested() -> bool:
        """Whether to stop after this step.

        Steps and saves are collective, so with several processes all must stop
        at the same step, also when only one got the signal: they agree at the
        log and checkpoint steps, where the host waits for the devices anyway.
        """
        local = stop.signal_name is not None
        if jax.process_count() == 1:
            return local
        if step % config.log_every and step % config.checkpoint_every:
            return False
        if distributed.any_process(local):
            stop.signal_name = stop.signal_name or "a signal to another process"
            return True
        return False

    with _StopFlag() as stop, jax.set_mesh(trainer.mesh):
        try:
            while step < total and not stop_requested():
                batch = trainer.global_batch(next(data_iter))
                state, metrics = trainer.train_step(state, batch)
                step += 1
                pending.append((step, metrics))
                boundary = step == total or step % config.checkpoint_every == 0
                if step % config.log_every == 0 or boundary or step % config.eval_every == 0:
                    flush()
                if step % config.eval_every == 0 or step == total:
                    sums = [
                        trainer.eval_step(state.params, trainer.global_batch(b))
                        for b in val_batches
                    ]
                    nll, weight = map(sum, zip(*jax.device_get(sums)))
                    summary["val_loss"] = float(nll / max(weight, 1.0))
                    writer.write(step, {"val_loss": summary["val_loss"]})
                if boundary:
                    save(step)
                if stop_after is not None and step - summary["start_step"] >= stop_after:
                    stop.signal_name = stop.signal_name or "stop_after"
            if pending:
                flush()
            if saved_step != step:
                save(step)
            checkpointer.wait()
        finally:
            bar.close()
            writer.close()
    summary.update(
        step=step,
        checkpoint_dir=checkpointer.directory,
        stopped_by=stop.signal_name,
        num_params=trainer.num_params,
    )
    if stop.signal_name:
        say(
            f"stopped by {stop.signal_name} at step {step}; checkpoint saved in "
            f"{checkpointer.directory}"
        )
    return summary
