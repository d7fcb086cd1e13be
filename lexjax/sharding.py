"""Device mesh and logical-axis sharding rules (the axis names: lexjax.config, which checks them).

Parameters are annotated with logical axis names (``embed``, ``heads``,
``kv``, ``mlp``, ``vocab``, ``layers``, ``positions``) in ``lexjax.model``;
a preset table maps them to the mesh axes ``data``, ``fsdp`` and ``tensor``,
so one flag (``--config.sharding=data|fsdp|tensor``) switches between data
parallel, FSDP and tensor parallel without touching model code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lexjax.config import MESH_AXES, SHARDINGS, Config, ConfigError, MeshConfig, check_mesh_sizes

__all__ = [
    "MESH_AXES",
    "MeshMismatch",
    "SHARDING_PRESETS",
    "rules",
    "mesh_shape",
    "check_mesh",
    "make_mesh",
    "fit_mesh",
    "eval_mesh",
    "model_param_shardings",
    "batch_shards",
    "fit_batch",
    "process_rows",
    "param_shardings",
    "batch_sharding",
    "replicated",
    "host_array",
]

# Logical axis name → mesh axes (None: replicated). ``config.sharding`` picks a
# preset; ``config.sharding_rules`` may override single entries. Weights use
# embed/heads/kv/mlp/vocab/layers/positions; activations use batch and the act_*
# names (model._pin), unsharded unless a rule names them, so FSDP's ``embed``
# shards of the weights never spread to the activations.
_DATA_PARALLEL = {"batch": ("data", "fsdp")} | dict.fromkeys(
    ("embed", "heads", "kv", "mlp", "vocab", "layers", "positions")
)
SHARDING_PRESETS: dict[str, dict[str, Any]] = {
    "data": _DATA_PARALLEL,
    "fsdp": _DATA_PARALLEL | {"embed": "fsdp"},
    "tensor": _DATA_PARALLEL
    | {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    | {"act_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor"},
}
assert tuple(SHARDING_PRESETS) == SHARDINGS, "lexjax.config.SHARDINGS names these presets"


def rules(config: Config) -> tuple[tuple[str, Any], ...]:
    """The (logical axis, mesh axes) table of ``config.sharding`` and its overrides."""
    if config.sharding not in SHARDING_PRESETS:
        raise ConfigError(
            f"sharding={config.sharding!r}: choose one of {', '.join(SHARDING_PRESETS)}"
        )
    table = SHARDING_PRESETS[config.sharding] | dict(config.sharding_rules)
    # Hashable (a list of mesh axes from a config file becomes a tuple): the model keeps it.
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in table.items())


class MeshMismatch(ConfigError):
    """A mesh that does not fit the devices, the batch or the model: ``reason``, and
    ``remedy`` for a program that chooses its mesh (train.py); the message is both."""

    def __init__(self, reason: str, remedy: str):
        super().__init__(f"{reason}; {remedy}")
        self.reason, self.remedy = reason, remedy

    def __reduce__(self):
        return type(self), (self.reason, self.remedy)


def mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """The (data, fsdp, tensor) sizes: a single −1 becomes the devices left."""
    check_mesh_sizes(mesh)
    sizes = [mesh.data, mesh.fsdp, mesh.tensor]
    fill = [i for i, s in enumerate(sizes) if s == -1]
    known = math.prod(s for s in sizes if s != -1)
    if fill:
        if num_devices % known:
            raise MeshMismatch(
                f"mesh {tuple(sizes)} cannot fill {num_devices} devices: "
                f"{known} does not divide {num_devices}",
                "change mesh.data, mesh.fsdp or mesh.tensor",
            )
        sizes[fill[0]] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise MeshMismatch(
            f"mesh data×fsdp×tensor = {'×'.join(map(str, sizes))} = "
            f"{math.prod(sizes)} but there are {num_devices} devices",
            "set one axis to -1 or make the product match",
        )
    return tuple(sizes)


def split_axes(axes) -> tuple[str, ...]:
    """A rule's mesh axes (a name, a sequence of names, or None) as a tuple."""
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _batch_advice(batch: int, accum: int, shards: int) -> str:
    """What makes ``batch / accum`` a multiple of ``shards``: the nearest accumulation
    that does, if any (a resumed run can change it, not its batch_size), the next
    batch_size that does, or fewer devices."""
    fits = [g for g in range(1, batch + 1) if batch % g == 0 and (batch // g) % shards == 0]
    nearest = min(fits, key=lambda g: (abs(g - accum), -g), default=None)
    ways = [] if nearest is None else [f"optim.grad_accum_steps={nearest}"]
    ways.append(f"batch_size={-(-batch // (shards * accum)) * shards * accum} (a new run only)")
    return f"use {', or '.join(ways)}, or fewer devices (or give some to mesh.tensor)"


def check_mesh(
    config: Config, num_devices: int, num_processes: int = 1, *, check_batch: bool = True
) -> tuple[int, int, int]:
    """Resolves the mesh shape for ``num_devices``; checks the model (and, with
    ``check_batch``, the training batch) divide it."""
    shape = mesh_shape(config.mesh, num_devices)
    table = dict(rules(config))

    def split(logical: str) -> tuple[tuple[str, ...], int]:
        axes = split_axes(table.get(logical))
        return axes, math.prod(shape[MESH_AXES.index(a)] for a in axes)

    batch_axes, batch_shards = split("batch")
    per_step = config.batch_size // config.optim.grad_accum_steps
    if not check_batch:
        per_step = batch_shards * num_processes
    if per_step % batch_shards:
        raise MeshMismatch(
            f"batch_size/grad_accum_steps = {per_step} is not divisible by "
            f"mesh {'×'.join(batch_axes)} = {batch_shards}",
            _batch_advice(config.batch_size, config.optim.grad_accum_steps, batch_shards),
        )
    if per_step % num_processes:
        raise MeshMismatch(
            f"batch_size/grad_accum_steps = {per_step} is not divisible by the "
            f"{num_processes} processes",
            "change batch_size or optim.grad_accum_steps",
        )
    if check_batch:  # a training mesh: every device does its own share of the work
        used = {a for axes in table.values() for a in split_axes(axes)}
        for axis, size in zip(MESH_AXES, shape):
            if size > 1 and axis not in used:
                raise MeshMismatch(
                    f"mesh.{axis}={size} under sharding={config.sharding!r} shards nothing (no "
                    f"rule names {axis!r}), so {size} copies of every step would run",
                    f"set mesh.{axis}=1, or choose a sharding that uses it",
                )
    for logical, size in _model_sizes(config.model).items():
        axes, n = split(logical)
        if size % n:
            raise MeshMismatch(
                f"model {logical} size {size} is not divisible by its mesh axes {axes} of size {n}",
                "change the model or the mesh",
            )
    return shape


def _model_sizes(m) -> dict[str, int]:
    """The size of every logical axis a rule may shard (weights and activations)."""
    sizes = {
        "embed": m.d_model,
        "heads": m.num_heads,
        "act_heads": m.num_heads,
        "kv": m.head_dim,
        "mlp": m.mlp_dim,
        "act_mlp": m.mlp_dim,
        "vocab": m.vocab_size,
        "act_vocab": m.vocab_size,
    }
    if m.scan_layers:  # the layers' parameters are stacked
        sizes["layers"] = m.num_layers
    if m.position == "learned":  # a [max_len, d_model] table
        sizes["positions"] = m.max_len
    return sizes


def make_mesh(config: Config, devices=None, *, check_batch: bool = True) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all) with Auto axes.

    Auto axes let XLA propagate shardings from the annotated parameters and
    inputs; ``-1`` in ``config.mesh`` fills with the remaining devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = check_mesh(config, len(devices), jax.process_count(), check_batch=check_batch)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def fit_mesh(
    mesh: MeshConfig, num_devices: int, fits: Callable[[MeshConfig], bool] | None = None
) -> MeshConfig:
    """A run's mesh re-fitted to ``num_devices`` (evaluating where it did not train).

    Each fixed axis keeps the largest size dividing both its own and the
    devices left (tensor first, then fsdp, data); the ``-1`` axis (data if
    none) takes the rest. A mesh that fits is returned as it resolves. With
    ``fits`` (does a mesh divide the model?), a ``-1`` axis other than data that
    would not keeps the largest share of its devices that does, and data takes
    the rest (FSDP trained on 8 devices, evaluated on 6).
    """
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    fill = next((axis for axis in MESH_AXES if sizes[axis] == -1), "data")
    left = num_devices
    for axis in ("tensor", "fsdp", "data"):
        if axis != fill:
            sizes[axis] = math.gcd(max(sizes[axis], 1), left)
            left //= sizes[axis]
    sizes[fill] = left
    if fits is not None and fill != "data":
        for share in (d for d in range(left, 0, -1) if left % d == 0):
            shared = MeshConfig(**{**sizes, fill: share, "data": sizes["data"] * (left // share)})
            if fits(shared):
                return shared
    return MeshConfig(**sizes)


def eval_mesh(config: Config, devices=None) -> Mesh:
    """The mesh evaluation and generation run on: ``config.mesh`` re-fitted to
    ``devices`` (default: all) by :func:`fit_mesh` so that it divides the model,
    with no training-batch check."""
    devices = list(jax.devices() if devices is None else devices)

    def fits(mesh: MeshConfig) -> bool:
        try:
            check_mesh(dataclasses.replace(config, mesh=mesh), len(devices), check_batch=False)
        except ConfigError:
            return False
        return True

    fitted = fit_mesh(config.mesh, len(devices), fits)
    try:
        return make_mesh(dataclasses.replace(config, mesh=fitted), devices, check_batch=False)
    except MeshMismatch as e:  # eval.py has no mesh to change: the devices are what can
        raise ConfigError(
            f"this run's mesh does not fit {len(devices)} devices ({e.reason}); evaluate it on a "
            "device count that its sharding divides"
        ) from None


def model_param_shardings(config: Config, mesh: Mesh):
    """NamedShardings of the model's (unboxed) parameters under ``config``'s rules.
    How attention is computed makes no parameter: traced with the explicit path,
    which every backend runs (splash is refused off a TPU)."""
    from lexjax.model import Decoder  # the model is above this module

    model = Decoder(dataclasses.replace(config.model, attention_impl="explicit"))
    init = lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    return param_shardings(jax.eval_shape(init)["params"], mesh, rules(config))


def batch_shards(sharding: NamedSharding) -> int:
    """How many parts a ``[batch, ...]`` array is split into by ``sharding``."""
    axes = split_axes(sharding.spec[0] if len(sharding.spec) else None)
    return math.prod(sharding.mesh.shape[a] for a in axes)


def fit_batch(batch: int, sharding: NamedSharding | None) -> int:
    """``batch`` rounded up to a multiple of the parts ``sharding`` splits a batch
    into (unchanged without a sharding): every device gets the same rows."""
    if sharding is None:
        return batch
    parts = batch_shards(sharding)
    return -(-batch // parts) * parts


def process_rows(sharding: NamedSharding, batch_size: int) -> tuple[int, int]:
    """Which rows of a global ``[batch_size, ...]`` batch placed by ``sharding``
    this process feeds: ``(index, count)`` meaning rows [index·b, (index+1)·b),
    b = batch_size / count (what ``jax.make_array_from_process_local_data``
    expects from it: the block its devices hold). ``(0, 1)`` when every process
    holds the whole batch. The data pipeline's ``shard_index, shard_count``."""
    rows = [
        index[0].indices(batch_size)[:2]
        for index in sharding.addressable_devices_indices_map((batch_size, 1)).values()
    ]
    start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
    size = stop - start
    if batch_size % size or start % size:
        raise ConfigError(
            f"this process's devices hold rows {start}..{stop - 1} of the batch of {batch_size}, "
            "not an aligned block; change the mesh or batch_size"
        )
    return start // size, batch_size // size


def param_shardings(boxed_tree, mesh: Mesh, rules):
    """NamedShardings for a pytree of ``nn.LogicallyPartitioned`` values (or their shapes)."""
    specs = nn.get_partition_spec(boxed_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """``[batch, seq]`` inputs: batch split over the mesh axes of the ``batch`` rule."""
    return NamedSharding(mesh, P(dict(rules)["batch"], None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def host_array(x) -> np.ndarray:
    """The global value of ``x`` as a C-ordered numpy array on this host: an array
    sharded over other processes' devices too is gathered from them (every
    process must call this with its part of the same array)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True), order="C")
    return np.asarray(x, order="C")  # not ascontiguousarray: it makes scalars 1-d
