"""The train and eval steps: module-level pure functions, and the one place they are jitted.

``train_step(state, batch, *, model, tx, config)`` and ``eval_step(params,
batch, *, model)`` are pure. :class:`TrainSetup` binds them to one config and
jits them once with explicit in/out shardings (the state donated), to be
called under ``jax.set_mesh(setup.mesh)``. The same code runs on one CPU, on 8
simulated devices and on a pod: only the mesh and the rules table change.
Benchmarks time ``setup.train_step``, the step training runs.

Batches are dicts of int32 ``[B, T]`` arrays: ``inputs``, ``targets``,
``positions`` and ``segment_ids`` (0 = padding), as ``lexjax.data`` packs them.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lexjax import sharding as shard_lib
from lexjax.config import Config
from lexjax.model import Decoder, count_params
from lexjax.optim import learning_rate_schedule, make_optimizer

__all__ = ["TrainState", "TrainSetup", "loss_fn", "train_step", "eval_step", "init_state"]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []: completed (finite) steps
    params: Any
    opt_state: Any


def loss_fn(params, model: Decoder, batch) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy over real tokens (segment id > 0).

    Returns ``(loss, weight)``: float32 scalars, the mean and the number of
    tokens it averages (the weight of this batch in a larger mean).
    """
    logits_BxTxV, _ = model.apply(
        {"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"]
    )
    weights_BxT = (batch["segment_ids"] > 0).astype(jnp.float32)
    nll_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, batch["targets"])
    total = jnp.sum(weights_BxT)
    return jnp.sum(nll_BxT * weights_BxT) / jnp.maximum(total, 1.0), total


def _micro_batches(batch, accum: int):
    """``batch``'s ``[B, T]`` arrays as ``[accum, B / accum, T]``: micro-batches to
    scan, micro-batch ``m`` the rows ``m, m + accum, …``. The batch is split over
    the devices in contiguous blocks, so each device holds its share of every
    micro-batch, and each step of the scan runs on every device (contiguous
    micro-batches would give each device whole micro-batches one after another:
    all the work, and no memory saved)."""
    split = lambda x: x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1)
    return jax.tree_util.tree_map(split, batch)


def _loss_and_grads(params, model: Decoder, batch, accum: int):
    """The token-weighted mean loss over the batch and its gradient.

    With ``accum > 1`` the batch is split into ``accum`` micro-batches scanned
    one after another (less activation memory); weighting each by its token
    count makes the result equal the one-batch gradient up to summation order.
    """
    grad_fn = jax.value_and_grad(lambda p, b: loss_fn(p, model, b), has_aux=True)
    if accum == 1:
        (loss, _), grads = grad_fn(params, batch)
        return loss, grads
    micro = _micro_batches(batch, accum)

    def body(carry, mb):
        loss_sum, weight_sum, grad_sum = carry
        (loss, weight), grads = grad_fn(params, mb)
        grad_sum = jax.tree_util.tree_map(lambda a, g: a + g * weight, grad_sum, grads)
        return (loss_sum + loss * weight, weight_sum + weight, grad_sum), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    (loss_sum, weight_sum, grad_sum), _ = jax.lax.scan(
        body, (jnp.zeros(()), jnp.zeros(()), zeros), micro
    )
    weight_sum = jnp.maximum(weight_sum, 1.0)
    return loss_sum / weight_sum, jax.tree_util.tree_map(lambda g: g / weight_sum, grad_sum)


def train_step(
    state: TrainState, batch, *, model: Decoder, tx: optax.GradientTransformation, config: Config
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step (pure). Returns the new state and scalar metrics.

    A step whose loss or gradient norm is not finite leaves the state as it
    was (step count included) and reports ``finite=False``: the loop stops on
    it, so the state it saves is the last good one.
    """
    loss, grads = _loss_and_grads(state.params, model, batch, config.optim.grad_accum_steps)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
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


def eval_step(params, batch, *, model: Decoder, accum: int = 1) -> tuple[jax.Array, jax.Array]:
    """Summed next-token NLL over real tokens and their count (pure; float32 scalars).

    With ``accum > 1``, in ``accum`` micro-batches scanned one after another, as
    the train step takes them: a batch that trains in micro-batches is validated
    within the same memory (its logits alone are ``[B, T, V]``)."""

    def sums(mb):
        loss, weight = loss_fn(params, model, mb)
        return loss * weight, weight

    if accum == 1:
        return sums(batch)
    add = lambda total, mb: (jax.tree_util.tree_map(jnp.add, total, sums(mb)), None)
    totals, _ = jax.lax.scan(add, (jnp.zeros(()), jnp.zeros(())), _micro_batches(batch, accum))
    return totals


def init_state(rng, *, model: Decoder, tx: optax.GradientTransformation, train_len: int):
    """A fresh state whose leaves keep Flax's logical-axis boxes (pure).

    optax builds its moments with tree maps that go inside the
    ``LogicallyPartitioned`` boxes, so the optimizer state carries the same
    logical axes as the parameters it mirrors (scalars come out unboxed).
    """
    params = model.init(rng, jnp.zeros((1, train_len), jnp.int32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


# XLA:CPU hands dots, elementwise loops and reductions to YNNPACK "library
# fusions" by default. For the train step, XLA's own dots and loops are faster
# with jaxlib 0.10 and equal with 0.12, but its reductions (the bias gradients'
# sums over batch and time) were the slowest operations of the step, so the train
# step keeps YNNPACK for reductions only (docs/benchmarks.md §11); the block scan
# is slower without YNNPACK and keeps XLA's defaults.
_CPU_TRAIN_STEP_OPTIONS = (("xla_cpu_experimental_ynn_fusion_type", "LIBRARY_FUSION_TYPE_REDUCE"),)


@functools.cache
def _compiler_accepts(options: tuple) -> bool:
    """Whether this jaxlib's CPU compiler knows every option (unknown ones fail)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(np.float32(0)).compile()
    except jax.errors.JaxRuntimeError:  # INVALID_ARGUMENT: no such compile option
        return False
    return True


def train_step_compiler_options(devices) -> dict:
    """XLA options for the jitted train step on these devices: on CPUs, YNNPACK for
    reductions only, unless ``XLA_FLAGS`` sets a YNNPACK option itself or this jaxlib lacks it."""
    if any(d.platform != "cpu" for d in devices):
        return {}
    if "ynn" in os.environ.get("XLA_FLAGS", "") or not _compiler_accepts(_CPU_TRAIN_STEP_OPTIONS):
        return {}
    return dict(_CPU_TRAIN_STEP_OPTIONS)


class TrainSetup:
    """The model, optimizer, mesh, shardings and jitted steps of one config.

    ``TrainSetup(config).init_state()`` builds a sharded state directly on the
    devices (each device materialises only its shard). ``train_step(state,
    batch)`` (state donated) and ``eval_step(params, batch)`` are the jitted,
    sharded :func:`train_step` and :func:`eval_step`; ``abstract_state`` is the
    state's ``ShapeDtypeStruct`` tree with shardings, a restore target.
    ``compiler_options``: XLA options of the train step (default:
    :func:`train_step_compiler_options`; ``{}`` for XLA's defaults).
    """

    def __init__(self, config: Config, devices=None, *, compiler_options: dict | None = None):
        self.config = config
        self.mesh = shard_lib.make_mesh(config, devices)
        if compiler_options is None:
            compiler_options = train_step_compiler_options(self.mesh.devices.flat)
        self.compiler_options = compiler_options
        rules = shard_lib.rules(config)
        self.model = Decoder(config.model, rules)
        self.tx = make_optimizer(config)
        init = functools.partial(
            init_state, model=self.model, tx=self.tx, train_len=config.train_len
        )
        boxed = jax.eval_shape(init, jax.random.key(0))
        self.state_shardings = shard_lib.param_shardings(boxed, self.mesh, rules)
        self.abstract_state = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            nn.unbox(boxed),
            self.state_shardings,
        )
        self.batch_sharding = shard_lib.batch_sharding(self.mesh, rules)
        self.num_params = count_params(self.abstract_state.params)
        repl = shard_lib.replicated(self.mesh)
        self._init = jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            functools.partial(train_step, model=self.model, tx=self.tx, config=config),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, repl),
            donate_argnums=(0,),
            compiler_options=self.compiler_options,
        )
        self.eval_step = jax.jit(
            functools.partial(eval_step, model=self.model, accum=config.optim.grad_accum_steps),
            in_shardings=(self.state_shardings.params, self.batch_sharding),
            out_shardings=(repl, repl),
        )

    def init_state(self, seed: int | None = None) -> TrainState:
        """A fresh sharded state from ``seed`` (default: the config's)."""
        seed = self.config.seed if seed is None else seed
        with jax.set_mesh(self.mesh):
            return self._init(jax.random.key(seed))

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assembles each process's rows into global arrays sharded over the batch axes."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v)
            for k, v in local_batch.items()
        }
