"""The PyTorch side of ``train_vs_reference``: torchscale's Decoder trained with AdamW.

Run by ``bench/run.py`` as a subprocess with an interpreter that has torch and
torchscale (``bash tests/reference/install.sh PY``); it never imports lexjax
or JAX, so the two sides share nothing but the CPU. Protocol, one JSON object
per line:

- argv[1]: the shape and settings (``layers d_model heads mlp vocab seq batch
  threads lr seed``);
- it answers ``{"ready": true, "params": N, "optimizer": "..."}`` once the
  model is built and one step has run;
- each ``{"steps": n}`` on stdin runs n steps and answers
  ``{"seconds": t, "losses": [...]}``; ``{"quit": true}`` (or EOF) ends it.

The model has the shape of lexjax's tiny decoder, for a like-for-like speed:
pre-LayerNorm blocks (``subln=False``, no DeepNorm), GELU MLP, XPOS
(``xpos_rel_pos=True``, scale base 512) and tied input/output embeddings. It is
not the same function: torchscale adds biases to the attention projections,
uses the exact GELU and LayerNorm ε 1e-5, and leaves the tied logits unscaled
(lexjax: no biases, tanh GELU, ε 1e-6, logits × d_model^−½; docs/design.md).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

# Appended, not prepended: real fairscale / timm packages win over the stubs.
sys.path.append(str(pathlib.Path(__file__).resolve().parent / "reference_stubs"))

import numpy as np
import torch
import torch.nn.functional as F
from torchscale.architecture.config import DecoderConfig
from torchscale.architecture.decoder import Decoder


def build(settings: dict):
    torch.manual_seed(settings["seed"])
    config = DecoderConfig(
        decoder_layers=settings["layers"],
        decoder_embed_dim=settings["d_model"],
        decoder_attention_heads=settings["heads"],
        decoder_ffn_embed_dim=settings["mlp"],
        vocab_size=settings["vocab"],
        xpos_rel_pos=True,
        xpos_scale_base=512,
        subln=False,
        deepnorm=False,
        decoder_normalize_before=True,
        activation_fn="gelu",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        drop_path_rate=0.0,
        share_decoder_input_output_embed=True,
        no_scale_embedding=True,
    )
    embed = torch.nn.Embedding(settings["vocab"], settings["d_model"])
    torch.nn.init.normal_(embed.weight, std=settings["d_model"] ** -0.5)  # tied: sane logits
    model = Decoder(config, embed_tokens=embed)
    model.train()
    kwargs = dict(lr=settings["lr"], betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    try:  # the fastest AdamW torch has for CPU tensors
        optimizer = torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
        kind = "AdamW(fused=True)"
    except (RuntimeError, TypeError, ValueError):
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True, **kwargs)
        kind = "AdamW(foreach=True)"
    return model, optimizer, kind


def batches(settings: dict, count: int = 8):
    rng = np.random.default_rng(settings["seed"])
    out = []
    for _ in range(count):
        tokens = rng.integers(0, 258, (settings["batch"], settings["seq"] + 1), dtype=np.int64)
        out.append(
            (torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(tokens[:, 1:].copy()))
        )
    return out


def step(model, optimizer, inputs, targets) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    logits, _ = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


def main() -> None:
    settings = json.loads(sys.argv[1])
    torch.set_num_threads(settings["threads"])
    model, optimizer, kind = build(settings)
    data = batches(settings)
    step(model, optimizer, *data[0])
    count = sum(p.numel() for p in model.parameters())
    reply = {
        "ready": True,
        "params": count,
        "optimizer": kind,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    print(json.dumps(reply), flush=True)
    done = 0
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        losses = []
        start = time.perf_counter()
        for _ in range(request["steps"]):
            losses.append(step(model, optimizer, *data[done % len(data)]))
            done += 1
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "losses": [float(x) for x in losses]}), flush=True)


if __name__ == "__main__":
    main()
