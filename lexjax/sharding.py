"""Device mesh and logical-axis sharding rules.

Parameters are annotated with logical axis names (``embed``, ``heads``,
``kv``, ``mlp``, ``vocab``, ``layers``, ``positions``) in ``lexjax.model``;
the config's rules table maps them to the mesh axes ``data``, ``fsdp`` and
``tensor``, so one flag (``--config.sharding=data|fsdp|tensor``) switches
between data parallel, FSDP and tensor parallel without touching model code.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lexjax.config import Config, check_mesh

__all__ = ["MESH_AXES", "make_mesh", "param_shardings", "batch_sharding", "replicated"]

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(config: Config, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all) with Auto axes.

    Auto axes let XLA propagate shardings from the annotated parameters and
    inputs; ``-1`` in ``config.mesh`` fills with the remaining devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = check_mesh(config, len(devices), jax.process_count())
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def param_shardings(boxed_tree, mesh: Mesh, rules):
    """NamedShardings for a pytree of ``nn.LogicallyPartitioned`` values (or their shapes)."""
    specs = nn.get_partition_spec(boxed_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """``[batch, seq]`` inputs: batch split over the mesh axes of the ``batch`` rule."""
    return NamedSharding(mesh, P(dict(rules)["batch"], None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
