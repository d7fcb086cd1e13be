"""``restore_memory``: what loading a run for evaluation costs, parameters only vs the full state.

    python -m bench.restore_memory --out=restore_memory.json

Three measurements, written as JSON:

- ``abstract``: bytes of ``configs/paper.py``-shaped parameters against
  parameters + Adam moments (``jax.eval_shape``; nothing is allocated);
- ``measured``: peak resident memory (VmHWM) and bytes read
  (``/proc/self/io`` rchar) of a fresh process that loads a checkpoint either
  with :func:`lexjax.checkpoint.load_params` (parameters only, verified) or by
  restoring and checksumming the whole saved state, as evaluation did before
  (parameters, Adam moments, step). Two checkpoints: the committed tiny run
  ``tests/fixtures/run_v1`` and a synthetic one of ``--medium_layers`` layers of
  d_model ``--medium_d_model``, written here with real Adam moments.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import struct

_OUT = flags.DEFINE_string("out", "restore_memory.json", "Where the JSON goes.")
_MEDIUM_LAYERS = flags.DEFINE_integer("medium_layers", 8, "Layers of the synthetic checkpoint.")
_MEDIUM_D_MODEL = flags.DEFINE_integer("medium_d_model", 512, "d_model of the synthetic one.")
_CHILD = flags.DEFINE_enum("child", None, ["params", "full"], "Internal: one measured load.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Internal: the workdir a child loads.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@struct.dataclass
class _State:
    """Shaped like the trainer's state: its leaves are named ``.params[...]``."""

    step: jax.Array
    params: dict
    opt_state: tuple


def _config(path: str, **model):
    sys.path.insert(0, ROOT)
    from configs import paper, tiny
    from lexjax.config import from_configdict

    c = (paper if path == "paper" else tiny).get_config()
    c.model.update(model)
    return from_configdict(c)


def _adam(config):
    o = config.optim
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(config.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )


def _bytes(tree) -> int:
    return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _abstract() -> dict:
    from lexjax.checkpoint import abstract_params

    config = _config("paper")
    params = abstract_params(config)
    opt_state = jax.eval_shape(_adam(config).init, params)
    count = sum(x.size for x in jax.tree.leaves(params))
    return {
        "config": "configs/paper.py",
        "parameters": count,
        "params_bytes": _bytes(params),
        "params_and_adam_bytes": _bytes(params) + _bytes(opt_state),
    }


def _write_medium(workdir: str) -> None:
    from lexjax.checkpoint import Checkpointer
    from lexjax.config import to_dict
    from lexjax.model import Decoder

    config = _config(
        "tiny",
        num_layers=_MEDIUM_LAYERS.value,
        d_model=_MEDIUM_D_MODEL.value,
        num_heads=8,
        mlp_dim=4 * _MEDIUM_D_MODEL.value,
    )
    model = Decoder(config.model)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    opt_state = _adam(config).init(params)
    # Random moments, as after training (constants would compress to nothing on disk).
    rng = np.random.default_rng(0)
    opt_state = jax.tree.map(
        lambda x: rng.standard_normal(x.shape, np.float32) if x.ndim else x, opt_state
    )
    state = _State(jnp.asarray(1, jnp.int32), params, opt_state)
    writer = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    writer.save(1, state, config=to_dict(config))
    writer.close()


def _child(kind: str, workdir: str) -> dict:
    """One load in this process; its peak RSS and bytes read."""
    if kind == "params":
        from lexjax.checkpoint import load_params

        _, params, _ = load_params(workdir)
        loaded = _bytes(params)
    else:
        import orbax.checkpoint as ocp
        from etils import epath

        from lexjax.checkpoint import Checkpointer

        directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        step = Checkpointer(directory, read_only=True).latest_step()
        handler = ocp.PyTreeCheckpointHandler()
        path = epath.Path(directory) / str(step) / "state"
        tree = handler.metadata(path).tree
        sharding = jax.sharding.make_single_device_sharding(jax.devices()[0])
        args = jax.tree.map(
            lambda m: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=m.shape, dtype=m.dtype),
            tree,
        )
        state = handler.restore(path, args=ocp.args.PyTreeRestore(item=tree, restore_args=args))
        for x in jax.tree.leaves(state):  # the full restore verified every leaf
            hashlib.sha256(np.asarray(x).tobytes()).hexdigest()
        loaded = _bytes(state)
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child would
    # report its parent's peak.
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines())
    return {
        "loaded_bytes": loaded,
        "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024,
        "read_bytes": int(io["rchar"]),
    }


def _measure(workdir: str) -> dict:
    result = {}
    for kind in ("full", "params"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.restore_memory",
                f"--child={kind}",
                f"--workdir={workdir}",
            ],
            cwd=ROOT,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            check=True,
        )
        result[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv):
    del argv
    if _CHILD.value:
        print(json.dumps(_child(_CHILD.value, _WORKDIR.value)))
        return
    report = {"abstract": _abstract(), "measured": {}}
    report["measured"]["tiny (tests/fixtures/run_v1)"] = _measure(
        os.path.join(ROOT, "tests", "fixtures", "run_v1")
    )
    with tempfile.TemporaryDirectory() as tmp:
        _write_medium(tmp)
        name = f"synthetic {_MEDIUM_LAYERS.value} layers × d_model {_MEDIUM_D_MODEL.value}"
        report["measured"][name] = _measure(tmp)
    with open(_OUT.value, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    app.run(main)
