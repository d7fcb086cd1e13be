"""``train_vs_reference``: lexjax's jitted train step against torchscale's Decoder in PyTorch.

Same shape (the tiny config: 6 layers, d_model 256, 4 heads, MLP 1024,
vocab 320, 16 × 256 tokens), XPOS, AdamW with global-norm clipping, on the
same CPU with the same number of threads. The reference runs in its own
process (``bench/reference_train.py``) with an interpreter that has torch;
each round runs a few steps of lexjax float32, lexjax bfloat16 and the
reference, in rotating order, while the other sides wait idle.

It also shows what bfloat16 compute does to the loss: float32 and bfloat16
lexjax trained from the same initial parameters on the same text batches.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from bench import common

REFERENCE_SCRIPT = pathlib.Path(__file__).resolve().parent / "reference_train.py"
INSTALL_HINT = "bash tests/reference/install.sh PY"


class ReferenceUnavailable(RuntimeError):
    """No interpreter with torch + torchscale; the message says how to get one."""


EXPECTED_ERRORS = (ReferenceUnavailable,)


def _has_reference(python: str) -> bool:
    probe = "import torch, torchscale; print('ok')"  # printed: /bin/true exits 0 too
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.splitlines()[-1:] == ["ok"]  # after any notices


def resolve_python(requested: str | None) -> str:
    """The interpreter for the reference: ``requested``, else this one if it has torch."""
    python = requested or sys.executable
    if os.sep in python:  # a path: the reference runs from the repository's root
        python = os.path.abspath(os.path.expanduser(python))
    where = f"--reference_python={requested}" if requested else f"this Python ({python})"
    try:
        found = _has_reference(python)
    except OSError as e:  # no such file, not executable: was a traceback
        raise ReferenceUnavailable(
            f"{where} cannot be run ({e.strerror}); pass an interpreter with torch and "
            f"torchscale (`{INSTALL_HINT}` makes one)"
        ) from None
    if not found:
        raise ReferenceUnavailable(
            f"{where} cannot import torch and torchscale; install them into an environment "
            f"with `{INSTALL_HINT}` (torch CPU 2.13 + torchscale, kept out of lexjax's venv) and "
            "pass --reference_python=PY"
        )
    return python


def reference_settings(config, threads: int) -> dict:
    """The torchscale process's settings (``bench/reference_train.py``'s argv[1]) for
    lexjax ``config``'s shape, batch and learning rate."""
    m = config.model
    return dict(
        layers=m.num_layers,
        d_model=m.d_model,
        heads=m.num_heads,
        mlp=m.mlp_dim,
        vocab=m.vocab_size,
        seq=config.train_len,
        batch=config.batch_size,
        threads=threads,
        lr=config.learning_rate,
        seed=0,
    )


class Reference:
    """The torchscale training process, driven one request per line."""

    def __init__(self, python: str, settings: dict):
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(settings["threads"]),
            MKL_NUM_THREADS=str(settings["threads"]),
        )
        self.proc = subprocess.Popen(
            [python, str(REFERENCE_SCRIPT), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=common.ROOT,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise ReferenceUnavailable(
                f"the reference process exited with status "
                f"{self.proc.wait()} (see its stderr above)"
            )
        return json.loads(line)

    def run(self, steps: int) -> dict:
        self.proc.stdin.write(json.dumps({"steps": steps}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def loss_curves(num_steps: int, model: dict) -> dict:
    """float32 vs bfloat16 lexjax from the same init on the same text batches."""
    import jax

    from lexjax.steps import TrainSetup

    config = common.tiny_config(**model)
    batches = common.train_batches(config.batch_size, config.train_len, num_steps, seed=1)
    curves = {}
    for dtype in ("float32", "bfloat16"):
        setup = TrainSetup(common.tiny_config(dtype=dtype, **model), devices=jax.devices()[:1])
        state = setup.init_state(seed=0)
        losses = []
        with jax.set_mesh(setup.mesh):
            for b in batches:
                state, m = setup.train_step(state, setup.global_batch(b))
                losses.append(m["loss"])
        curves[dtype] = [float(x) for x in jax.device_get(losses)]
    f32, bf16 = np.asarray(curves["float32"]), np.asarray(curves["bfloat16"])
    tail = max(1, num_steps // 5)
    return {
        "steps": num_steps,
        "float32": curves["float32"],
        "bfloat16": curves["bfloat16"],
        "max_abs_diff": float(np.max(np.abs(f32 - bf16))),
        "final_mean_float32": float(f32[-tail:].mean()),
        "final_mean_bfloat16": float(bf16[-tail:].mean()),
        "first": float(f32[0]),
    }


def run(args) -> dict:
    python = resolve_python(args.reference_python)
    model = common.QUICK_MODEL if args.quick else {}
    config = common.tiny_config(dtype="float32", **model)  # the reference trains in float32
    rounds, steps = (2, 1) if args.quick else (7, 2)
    batches = common.train_batches(config.batch_size, config.train_len, 4)
    settings = reference_settings(config, args.threads)
    reference = Reference(python, settings)
    try:
        setup, f32 = common.train_timer(config, batches, steps)
        _, bf16 = common.train_timer(common.tiny_config(dtype="bfloat16", **model), batches, steps)
        sides = {"lexjax_float32": f32, "lexjax_bfloat16": bf16}
        if setup.compiler_options:  # the library's XLA options against XLA's defaults
            sides["lexjax_float32_xla_defaults"] = common.train_timer(
                config, batches, steps, compiler_options={}
            )[1]
        ref_losses = []

        def reference_side():
            reply = reference.run(steps)
            ref_losses.extend(reply["losses"])
            return reply["seconds"]

        seconds = common.alternate({**sides, "reference": reference_side}, rounds, warm=True)
    finally:
        reference.close()
    tokens = steps * config.batch_size * config.train_len
    rate = {k: common.Summary.of([tokens / s for s in v]) for k, v in seconds.items()}
    ratio = {
        k: common.ratios(seconds["reference"], seconds[k]) for k in seconds if k != "reference"
    }
    best = max(("lexjax_float32", "lexjax_bfloat16"), key=lambda k: ratio[k].median)
    options_gain = None
    if "lexjax_float32_xla_defaults" in seconds:  # > 1: the library's options are faster
        options_gain = common.ratios(
            seconds["lexjax_float32_xla_defaults"], seconds["lexjax_float32"]
        ).as_dict()
    curves = loss_curves(6 if args.quick else 30, model)
    return common.result(
        ratio[best].median,
        "× reference tokens/s",
        "≥ 1.0× (parity; aim 1.2×)",
        ratio[best].median >= 1.0,
        best=best,
        model_overrides=model,
        compiler_options=setup.compiler_options,
        compiler_options_gain=options_gain,
        ratio={k: v.as_dict() for k, v in ratio.items()},
        tokens_per_sec={k: v.as_dict() for k, v in rate.items()},
        rounds=rounds,
        steps_per_round=steps,
        tokens_per_step=config.batch_size * config.train_len,
        reference=dict(reference.info, python=python, losses=ref_losses),
        threads=args.threads,
        loss_curves=curves,
    )


def rows(entry: dict) -> list[tuple[str, str]]:
    r, t, c = entry["ratio"], entry["tokens_per_sec"], entry["loss_curves"]
    out = [
        ("lexjax f32 tokens/s", common.fmt(t["lexjax_float32"], ".0f")),
        ("lexjax bf16 tokens/s", common.fmt(t["lexjax_bfloat16"], ".0f")),
        ("torchscale tokens/s", common.fmt(t["reference"], ".0f")),
        ("ratio f32 / torchscale", common.fmt(r["lexjax_float32"], ".2f")),
        ("ratio bf16 / torchscale", common.fmt(r["lexjax_bfloat16"], ".2f")),
    ]
    if entry.get("compiler_options_gain"):
        out += [
            (
                "lexjax f32, XLA default options",
                common.fmt(t["lexjax_float32_xla_defaults"], ".0f"),
            ),
            ("f32 speed-up from the options", common.fmt(entry["compiler_options_gain"], ".3f")),
        ]
    return out + [
        (
            f"loss f32 vs bf16 ({c['steps']} steps)",
            f"{c['first']:.3f} → {c['final_mean_float32']:.3f} vs {c['final_mean_bfloat16']:.3f}; "
            f"max |Δ| {c['max_abs_diff']:.3f}",
        )
    ]
