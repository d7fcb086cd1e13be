"""What an FSDP step sends between devices: parameters, never activations.

Compiled on 8 simulated devices, mesh (data 2, fsdp 4), preset ``fsdp``: every
collective in the optimized HLO of the train step and of the evaluation's block
scan carries a parameter (gathered before use, its gradient reduced) or a
scalar. An activation — anything with a token axis (training's 40 tokens, the
scan's blocks of 20 and windows of 40), a length no parameter has — stays
sharded over the batch. (Without the model's activation
constraints XLA:CPU followed the parameters' ``embed`` shards instead: it
gathered the batch's embeddings, q/k/v, MLP activations and logits over
``fsdp``.)

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (as CI does).
"""

import re

import jax
import numpy as np
import pytest

from lexjax import blockwise
from lexjax import sharding as shard_lib
from lexjax.model import Decoder
from lexjax.steps import TrainSetup
from tests.helpers import small_config

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
T = 40  # no parameter has a dimension of 40 or 20 (d_model 48, head_dim 12, mlp 96, vocab 264)
COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\("
)


def _config():
    return small_config(
        sharding="fsdp",
        train_len=T,
        batch_size=16,
        **{"mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1},
        **{"model.d_model": 48, "model.mlp_dim": 96, "model.max_len": T},
    )


def _collective_shapes(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, dims) of every array each collective of ``hlo`` produces."""
    found = []
    for result, kind in COLLECTIVE.findall(hlo):
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", result):
            found.append((kind, tuple(int(d) for d in dims.split(",") if d)))
    return found


def _check_parameters_only(hlo: str, params) -> None:
    found = _collective_shapes(hlo)
    assert any(kind == "all-gather" for kind, _ in found)  # FSDP gathers its weights
    sizes = {d for p in jax.tree.leaves(params) for d in p.shape}
    assert not {T, T // 2} & sizes
    activations = [(kind, dims) for kind, dims in found if {T, T // 2} & set(dims)]
    assert activations == [], activations


@needs_8
def test_the_fsdp_train_step_moves_parameters_not_activations():
    setup = TrainSetup(_config(), jax.devices()[:8])
    state = setup.abstract_state
    batch = {
        k: jax.ShapeDtypeStruct((16, T), np.int32, sharding=setup.batch_sharding)
        for k in ("inputs", "targets", "segment_ids", "positions")
    }
    with jax.set_mesh(setup.mesh):
        hlo = setup.train_step.lower(state, batch).compile().as_text()
    _check_parameters_only(hlo, state.params)


@needs_8
def test_the_fsdp_block_scan_moves_parameters_not_activations():
    config = _config()
    setup = TrainSetup(config, jax.devices()[:8])
    model = Decoder(config.model, shard_lib.rules(config))
    params = setup.abstract_state.params
    tokens = jax.ShapeDtypeStruct((16, 4 * T), np.int32, sharding=setup.batch_sharding)
    scan = blockwise.compiled_scan(model, config.block)  # inputs, targets: 8 blocks
    with jax.set_mesh(setup.mesh):
        hlo = scan.lower(params, tokens, tokens).compile().as_text()
    _check_parameters_only(hlo, params)
