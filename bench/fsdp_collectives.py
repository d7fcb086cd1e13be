"""What configs/paper.py's FSDP train step sends between devices, and the memory it
keeps, with the model's activation constraints and without them.

    python bench/fsdp_collectives.py --json docs/benchmarks_fsdp_collectives.json

Compiles (never runs) the train step for 8 simulated CPU devices on the config's
own mesh (data 1 × fsdp 8, preset ``fsdp``, batch 512 × 1024 tokens): once as
lexjax builds it (``Decoder(config.model, rules)``: activations pinned to the
batch axes, embedding table gathered like every other weight) and once with a
``Decoder(config.model)`` that carries no constraints. From each optimized HLO
it sums, per kind, the bytes every collective produces on one device, and
reads XLA's temporary memory per device (``memory_analysis``). Collectives are
counted with the 24 layers unrolled (``scan_layers=False``: the HLO then holds
each layer's collectives, as a step runs them, where a scan's body appears once);
memory with the config's own layer scan (unrolled, XLA:CPU keeps every recomputed
activation alive at once: benchmarks §7). Counts, not
timings: exact and load-independent, though XLA:CPU's SPMD partitioner, not a
GPU's or TPU's, made the choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from configs import paper
from lexjax import sharding as shard_lib
from lexjax import steps
from lexjax.config import from_configdict
from lexjax.model import Decoder

_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\("
)
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2, "s8": 1, "u8": 1}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes each kind of collective produces per device in an optimized HLO module."""
    total: dict[str, int] = {}
    for result, kind in _COLLECTIVE.findall(hlo):
        for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", result):
            size = int(np.prod([int(d) for d in dims.split(",") if d]))
            total[kind] = total.get(kind, 0) + size * _BYTES.get(dtype, 4)
    return total


def _compiled(config, setup, model):
    step = jax.jit(
        functools.partial(steps.train_step, model=model, tx=setup.tx, config=config),
        in_shardings=(setup.state_shardings, setup.batch_sharding),
        out_shardings=(setup.state_shardings, None),
        donate_argnums=(0,),
    )
    shape = (config.batch_size, config.train_len)
    batch = {
        k: jax.ShapeDtypeStruct(shape, np.int32, sharding=setup.batch_sharding)
        for k in ("inputs", "targets", "segment_ids", "positions")
    }
    with jax.set_mesh(setup.mesh):
        return step.lower(setup.abstract_state, batch).compile()


def measure(setups, pinned: bool) -> dict:
    """``setups``: the TrainSetups of the layers unrolled (collectives) and scanned (memory)."""
    unrolled, scanned = setups
    rules = shard_lib.rules(scanned.config) if pinned else None
    model = Decoder(unrolled.config.model, rules)
    moved = collective_bytes(_compiled(unrolled.config, unrolled, model).as_text())
    model = Decoder(scanned.config.model, rules)
    memory = _compiled(scanned.config, scanned, model).memory_analysis()
    return {
        "collective_MiB_per_device": {k: v / 2**20 for k, v in sorted(moved.items())},
        "collective_MiB_per_device_total": sum(moved.values()) / 2**20,
        "temp_MiB_per_device": memory.temp_size_in_bytes / 2**20,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    config = from_configdict(paper.get_config())
    model = dataclasses.replace(config.model, scan_layers=False)
    devices = jax.devices()[:8]
    setups = (
        steps.TrainSetup(dataclasses.replace(config, model=model), devices),
        steps.TrainSetup(config, devices),
    )
    result = {
        "benchmark": "fsdp_collectives",
        "config": "configs/paper.py",
        "mesh": dict(setups[1].mesh.shape),
        "batch": [config.batch_size, config.train_len],
        "vocab_size": config.model.vocab_size,
        "param_dtype": config.model.param_dtype,
        "parameters": setups[1].num_params,
        "jax": jax.__version__,
        "pinned": measure(setups, pinned=True),
        "unpinned": measure(setups, pinned=False),
    }
    pinned, unpinned = result["pinned"], result["unpinned"]
    result["value"] = (
        unpinned["collective_MiB_per_device_total"] / pinned["collective_MiB_per_device_total"]
    )
    result["unit"] = "x fewer collective bytes per device with the activation constraints"
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
