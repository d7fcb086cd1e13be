"""Typed, validated configuration built from ``configs/*.py`` ConfigDicts.

``configs/*.py`` files return an ``ml_collections.ConfigDict`` (overridable
from the command line). :func:`from_configdict` turns it into frozen
dataclasses and checks every value a user can get wrong; a bad value raises
:class:`ConfigError` whose message names the field and the fix, which the
programs print as one line before exiting with status 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from lexjax.attention import ABSOLUTE_ENCODINGS, ATTENTION_IMPLS, POSITION_KINDS
from lexjax.errors import ConfigError

__all__ = [
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "MeshConfig",
    "Config",
    "from_configdict",
    "to_dict",
    "SHARDING_PRESETS",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    position: str = "xpos"
    num_layers: int = 6
    d_model: int = 256
    num_heads: int = 4
    mlp_dim: int = 1024
    vocab_size: int = 320
    scale_base: float = 512.0
    theta: float = 10000.0
    max_len: int = 256  # table size of learned absolute positions (= train_len)
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    scan_layers: bool = False
    attention_impl: str = "explicit"  # explicit | fused (cuDNN flash attention on GPUs)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: str = "python_stdlib"
    files: str | None = None
    data_dir: str | None = None
    text_feature: str = "text"
    worker_count: int = 0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    schedule: str = "cosine"  # cosine | polynomial | constant
    end_lr_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    grad_accum_steps: int = 1


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """Resolves a single −1 to the devices left; checks the product."""
        sizes = [self.data, self.fsdp, self.tensor]
        names = ["mesh.data", "mesh.fsdp", "mesh.tensor"]
        fill = [i for i, s in enumerate(sizes) if s == -1]
        if len(fill) > 1:
            raise ConfigError(
                "at most one of mesh.data/fsdp/tensor may be -1 (fill with the remaining devices)"
            )
        for n, s in zip(names, sizes):
            if s == 0 or s < -1:
                raise ConfigError(f"{n}={s}: use a positive size or -1")
        known = math.prod(s for s in sizes if s != -1)
        if fill:
            if num_devices % known:
                raise ConfigError(
                    f"mesh {tuple(sizes)} cannot fill {num_devices} devices: "
                    f"{known} does not divide {num_devices}"
                )
            sizes[fill[0]] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ConfigError(
                f"mesh data×fsdp×tensor = {'×'.join(map(str, sizes))} = "
                f"{math.prod(sizes)} but there are {num_devices} devices; set "
                "one axis to -1 or make the product match"
            )
        return tuple(sizes)


# Logical axis name → mesh axis (or None = replicated). One preset per
# parallelism; ``config.sharding`` picks one and ``config.sharding_rules`` may
# override single entries.
SHARDING_PRESETS: dict[str, dict[str, Any]] = {
    "data": {
        "batch": ("data", "fsdp"),
        "embed": None,
        "heads": None,
        "kv": None,
        "mlp": None,
        "vocab": None,
        "layers": None,
        "positions": None,
    },
    "fsdp": {
        "batch": ("data", "fsdp"),
        "embed": "fsdp",
        "heads": None,
        "kv": None,
        "mlp": None,
        "vocab": None,
        "layers": None,
        "positions": None,
    },
    "tensor": {
        "batch": ("data", "fsdp"),
        "embed": "fsdp",
        "heads": "tensor",
        "kv": None,
        "mlp": "tensor",
        "vocab": "tensor",
        "layers": None,
        "positions": None,
    },
}


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    mesh: MeshConfig
    train_len: int = 256
    batch_size: int = 16
    num_train_steps: int = 200
    learning_rate: float = 1e-3  # peak, after linear warmup
    warmup_steps: int = 20
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    sharding: str = "tensor"
    sharding_rules: tuple = ()
    on_corrupt_checkpoint: str = "fallback"
    poison_step: int = -1  # fault-injection only: make this step's loss NaN

    @property
    def block(self) -> int:
        """Blockwise-attention block size w = train_len / 2 (paper §3.3)."""
        return self.train_len // 2

    def rules(self) -> tuple[tuple[str, Any], ...]:
        table = dict(SHARDING_PRESETS[self.sharding])
        table.update(dict(self.sharding_rules))
        return tuple(table.items())


def _checked_fields(cls, values: Mapping[str, Any], prefix: str, skip=()) -> dict:
    """Type-checks ``values`` against the fields of dataclass ``cls`` (minus ``skip``)."""
    names = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown config field {prefix}{unknown[0]}; known fields: "
            f"{', '.join(prefix + n for n in names)}"
        )
    kwargs = {}
    for name, value in values.items():
        default = names[name].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{prefix}{name}={value!r}: expected True or False")
        if isinstance(default, int) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{prefix}{name}={value!r}: expected an integer")
        if isinstance(default, float) and not isinstance(value, (int, float)):
            raise ConfigError(f"{prefix}{name}={value!r}: expected a number")
        kwargs[name] = float(value) if isinstance(default, float) else value
    return kwargs


def _plain(value):
    return value.to_dict() if hasattr(value, "to_dict") else dict(value)


def from_configdict(cd) -> Config:
    """Builds and validates a :class:`Config` from a ConfigDict or nested dict."""
    values = _plain(cd)
    sections = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "mesh": MeshConfig}
    parts = {}
    for key, cls in sections.items():
        sub = values.pop(key, {}) or {}
        parts[key] = cls(**_checked_fields(cls, _plain(sub), key + "."))
    rules = tuple(tuple(kv) for kv in dict(values.pop("sharding_rules", {}) or {}).items())
    top = _checked_fields(Config, values, "", skip=set(sections) | {"sharding_rules"})
    config = Config(**parts, **top, sharding_rules=rules)
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(
            config.model, max_len=max(config.model.max_len, config.train_len)
        ),
    )
    validate(config)
    return config


def validate(config: Config) -> None:
    m = config.model
    if m.position not in POSITION_KINDS:
        raise ConfigError(
            f"model.position={m.position!r} is unknown; choose one of {', '.join(POSITION_KINDS)}"
        )
    if m.attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(
            f"model.attention_impl={m.attention_impl!r}: choose one of {', '.join(ATTENTION_IMPLS)}"
        )
    for name in ("num_layers", "d_model", "num_heads", "mlp_dim", "vocab_size"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.d_model % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.d_model="
            f"{m.d_model}; pick heads that divide it"
        )
    if m.position in ("xpos", "rope") and m.head_dim % 2:
        raise ConfigError(
            f"head_dim = d_model/num_heads = {m.head_dim} is odd, but "
            f"model.position={m.position} rotates pairs; make it even"
        )
    if m.position in ABSOLUTE_ENCODINGS and m.d_model % 2:
        raise ConfigError(f"model.d_model={m.d_model} must be even for {m.position} positions")
    if not m.scale_base > 0:
        raise ConfigError(f"model.scale_base={m.scale_base} must be positive")
    for name in ("dtype", "param_dtype"):
        if getattr(m, name) not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"model.{name}={getattr(m, name)!r}: use float32, bfloat16 or float16"
            )
    if config.train_len < 2 or config.train_len % 2:
        raise ConfigError(
            f"train_len={config.train_len} must be an even integer ≥ 2 (the "
            "blockwise block is train_len/2)"
        )
    for name in (
        "batch_size",
        "num_train_steps",
        "checkpoint_every",
        "eval_every",
        "log_every",
        "keep_checkpoints",
        "eval_batches",
    ):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name}={getattr(config, name)} must be positive")
    o = config.optim
    if o.schedule not in ("cosine", "polynomial", "constant"):
        raise ConfigError(f"optim.schedule={o.schedule!r}: use cosine, polynomial or constant")
    if not config.learning_rate > 0:
        raise ConfigError(f"learning_rate={config.learning_rate} must be positive")
    if config.warmup_steps < 0 or o.grad_accum_steps < 1:
        raise ConfigError("warmup_steps must be ≥ 0 and optim.grad_accum_steps ≥ 1")
    if config.batch_size % o.grad_accum_steps:
        raise ConfigError(
            f"optim.grad_accum_steps={o.grad_accum_steps} must divide "
            f"batch_size={config.batch_size}"
        )
    if config.sharding not in SHARDING_PRESETS:
        raise ConfigError(
            f"sharding={config.sharding!r}: choose one of {', '.join(SHARDING_PRESETS)}"
        )
    if config.on_corrupt_checkpoint not in ("fallback", "error"):
        raise ConfigError("on_corrupt_checkpoint must be 'fallback' or 'error'")
    d = config.data
    if d.name == "textfiles" and not d.files:
        raise ConfigError(
            "data.name=textfiles needs data.files, a glob such as '--config.data.files=/path/*.txt'"
        )


def check_mesh(config: Config, num_devices: int, num_processes: int = 1) -> tuple[int, int, int]:
    """Resolves the mesh shape for ``num_devices`` and checks the batch divides it."""
    shape = config.mesh.shape(num_devices)
    batch_shards = shape[0] * shape[1]
    per_step = config.batch_size // config.optim.grad_accum_steps
    if per_step % batch_shards:
        raise ConfigError(
            f"batch_size/grad_accum_steps = {per_step} is not divisible by "
            f"mesh data×fsdp = {batch_shards}; change batch_size or the mesh"
        )
    if per_step % num_processes:
        raise ConfigError(
            f"batch_size={config.batch_size} is not divisible by the {num_processes} processes"
        )
    m = config.model
    rules = dict(config.rules())
    for logical, size in (
        ("heads", m.num_heads),
        ("mlp", m.mlp_dim),
        ("vocab", m.vocab_size),
        ("embed", m.d_model),
    ):
        axes = rules.get(logical)
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        n = math.prod(shape[("data", "fsdp", "tensor").index(a)] for a in axes)
        if size % n:
            raise ConfigError(
                f"model {logical} size {size} is not divisible by its mesh "
                f"axes {axes} of size {n}; change the model or the mesh"
            )
    return shape


def to_dict(config: Config) -> dict:
    """Plain nested dict (JSON-able) of a Config, e.g. to store with a checkpoint."""
    out = dataclasses.asdict(config)
    out["sharding_rules"] = {k: v for k, v in config.sharding_rules}
    return out
