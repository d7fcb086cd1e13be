"""Configuration: the one home of every default, and its validation.

The frozen dataclasses below hold every field's default (the CPU run of
``configs/tiny.py``). :func:`default_configdict` turns them into an
``ml_collections.ConfigDict``, so every field is overridable from the command
line (``--config.model.position=rope``) whatever a config file states;
``configs/*.py`` start from it and state only what differs.
:func:`from_configdict` turns a ConfigDict (or nested dict, e.g. the config a
checkpoint stored, also by an older lexjax) back into a validated :class:`Config`;
:func:`flags_parser` reads ``--config`` files and overrides for the programs. A
bad value raises :class:`ConfigError` (exit status 2) whose one line names the
field and the fix.

This module imports no compute code: the names of the position encodings and
attention implementations are defined here, and the model imports them.
Mesh shapes and sharding presets live in :mod:`lexjax.sharding`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import glob
import inspect
import math
import numbers
import os
import re
import runpy
import sys
import traceback
import typing
from collections.abc import Iterable, Mapping

import numpy as np

from lexjax import errors as errors_lib
from lexjax.errors import ConfigError, LexjaxError, one_line

__all__ = [
    "RELATIVE_ENCODINGS",
    "ABSOLUTE_ENCODINGS",
    "POSITION_KINDS",
    "ROTARY_ENCODINGS",
    "PAIRED_ENCODINGS",
    "DECAYING_ENCODINGS",
    "ROPE_SCALINGS",
    "check_rope_scaling",
    "check_int",
    "check_seed",
    "ATTENTION_IMPLS",
    "REMAT_POLICIES",
    "TOKENIZER_VOCAB_SIZE",
    "TOKENIZERS",
    "MESH_AXES",
    "SHARDINGS",
    "check_mesh_sizes",
    "LOGICAL_AXES",
    "tokenizer_vocab_size",
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "MeshConfig",
    "Config",
    "default_configdict",
    "flags_parser",
    "from_configdict",
    "REMOVED_FIELDS",
    "RENAMED_FIELDS",
    "upgraded",
    "unknown_field",
    "to_dict",
    "dotted",
]

# xpos_norotate: XPOS's decay without its rotation (θ_i = 0), the paper's Table 4 ablation.
RELATIVE_ENCODINGS = ("xpos", "rope", "alibi", "xpos_norotate")
ABSOLUTE_ENCODINGS = ("sinusoidal", "learned")
POSITION_KINDS = RELATIVE_ENCODINGS + ABSOLUTE_ENCODINGS + ("none",)
# The encodings that rotate query/key pairs; the only ones a RoPE scaling applies to.
ROTARY_ENCODINGS = ("xpos", "rope")
# The encodings applied as tables on query/key pairs (head_dim must be even), and those
# of them that decay with distance (their positions have a dtype-set range). A new kind
# goes in these lists, lexjax.attention.PositionKind and the branch of
# lexjax.attention.context that builds its tables (docs/design.md, "Adding a position
# encoding").
PAIRED_ENCODINGS = ROTARY_ENCODINGS + ("xpos_norotate",)
DECAYING_ENCODINGS = ("xpos", "xpos_norotate")
# Inference-time RoPE extensions (lexjax.positions.rope_scaling; the same tuple there).
ROPE_SCALINGS = ("none", "pi", "ntk", "dynamic_ntk", "yarn")
# "explicit": scores materialised (and available for resolution measurements);
# "fused": jax.nn.dot_product_attention, cuDNN's fused kernel on NVIDIA GPUs;
# "splash": Pallas splash attention, TPUs only.
ATTENTION_IMPLS = ("explicit", "fused", "splash")
# Per-layer rematerialisation (lexjax.model.remat_policy): none; full (recompute the
# layer in the backward); dots_except_mlp (keep the attention's matmul outputs).
REMAT_POLICIES = ("none", "full", "dots_except_mlp")
# lexjax.data.tokenizer.VOCAB_SIZE: 256 bytes + BOS + EOS. Importing lexjax.data here
# would load grain and TFDS into every program; tests/test_config.py checks they agree.
TOKENIZER_VOCAB_SIZE = 258
TOKENIZERS = ("bytes", "sentencepiece")
# The embedding table is padded to a multiple of this many rows, so the vocabulary
# axis shards evenly over any tensor axis up to 64 devices (258 bytes → 320).
VOCAB_MULTIPLE = 64
# SentencePiece's smallest vocabulary here: 256 byte pieces, padding, unknown, BOS,
# EOS and the newline piece (lexjax.data.tokenizer).
_MIN_SENTENCEPIECE_VOCAB = 261
# Top-level fields an older lexjax stored with its checkpoints; ignored on loading.
# poison_step: fault injection, now a test hook (tests/), not a production setting.
REMOVED_FIELDS = ("poison_step",)
# Fields an older lexjax stored under another name (old → new): its checkpoints'
# configs, and a dict written for it, still load.
RENAMED_FIELDS = {"optim.learning_rate": "learning_rate", "optim.warmup_steps": "warmup_steps"}
# The device mesh's axes (lexjax.sharding builds the mesh) and the logical axes the
# model names, weights' and activations' (act_*), that config.sharding_rules maps to them.
MESH_AXES = ("data", "fsdp", "tensor")
# The names of lexjax.sharding.SHARDING_PRESETS (checked there), for validation here.
SHARDINGS = ("data", "fsdp", "tensor")
LOGICAL_AXES = ("embed", "heads", "kv", "mlp", "vocab", "layers", "positions", "batch")
LOGICAL_AXES += ("length", "act_embed", "act_heads", "act_kv", "act_mlp", "act_vocab")
_DTYPES = ("float32", "bfloat16", "float16")
_SCHEDULES = ("cosine", "polynomial", "constant")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    position: str = "xpos"  # one of POSITION_KINDS
    num_layers: int = 6
    d_model: int = 256
    num_heads: int = 4
    mlp_dim: int = 1024
    # None: the tokenizer's vocabulary (data.tokenizer) padded to VOCAB_MULTIPLE; a
    # stored config keeps the resolved number, so its checkpoints load with it.
    vocab_size: int | None = None
    scale_base: float = 512.0  # XPOS b; must be the same in training and inference
    theta: float = 10000.0
    max_len: int | None = None  # table size of learned absolute positions; None: train_len
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute dtype; bfloat16 on accelerators
    # bfloat16 halves the parameters' memory (training notes what it costs); float16
    # is refused for training (AdamW's moments underflow in it)
    param_dtype: str = "float32"
    remat_policy: str = "none"  # one of REMAT_POLICIES
    remat: bool | None = None  # older configs: True means remat_policy=full, False none
    scan_layers: bool = False
    attention_impl: str = "explicit"  # one of ATTENTION_IMPLS
    # An inference-time RoPE extension of an xpos/rope model (lexjax.positions): one of
    # ROPE_SCALINGS. rope_factor: its s ≥ 1; 0 = each evaluated length / rope_train_len
    # (dynamic_ntk always follows the positions processed, so 0 only).
    rope_scaling: str = "none"
    rope_factor: float = 0.0
    rope_train_len: int | None = None  # the length the scalings extend; None: train_len

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: str = "python_stdlib"  # python_stdlib | textfiles | a TFDS dataset in ArrayRecord form
    files: str | None = None  # textfiles: a glob of the corpus files
    validation_files: str | None = None  # a glob: these files are the validation split
    test_files: str | None = None  # a glob: these files are the test split
    tokenizer: str = "bytes"  # bytes | sentencepiece (learned from the train split)
    vocab_size: int = 8192  # sentencepiece: ids to learn (bytes: always 258)
    data_dir: str | None = None
    text_feature: str = "text"
    worker_count: int = 0
    # Fraction of training rows that are passkey documents of train_len (lexjax.passkey).
    passkey_fraction: float = 0.0
    # Fraction of training rows that are copy documents of train_len (random strings of
    # letters and digits, each repeated: lexjax.passkey.copy_document), which teach the
    # copying a passkey needs.
    copy_fraction: float = 0.0
    # Packed rows are shuffled in windows of this many rows before batching (0: off).
    shuffle_rows: int = 1024
    # Chunks are taken in turn from this many documents read at once (1: one document's
    # chunks after another), so a book-length file shares its batches with others.
    open_documents: int = 16

    def corpus(self) -> dict[str, typing.Any]:
        """The keyword arguments naming this corpus for ``data.load_source`` and
        ``data.load_tokenizer`` (after the dataset name)."""
        keys = ("data_dir", "files", "validation_files", "test_files", "text_feature")
        return {k: getattr(self, k) for k in keys}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    schedule: str = "cosine"  # cosine | polynomial | constant (after the warmup)
    end_lr_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    grad_accum_steps: int = 1


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one of them may be -1: the devices left (see lexjax.sharding)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train_len: int = 256
    batch_size: int = 16
    num_train_steps: int = 200
    learning_rate: float = 2e-3  # peak, after a linear warmup from 0 (optim.learning_rate_schedule)
    warmup_steps: int = 20
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    sharding: str = "tensor"  # logical-axis preset of lexjax.sharding: data | fsdp | tensor
    sharding_rules: tuple = ()  # (logical axis, mesh axes) pairs that override the preset
    on_corrupt_checkpoint: str = "fallback"  # fallback | error
    peak_flops: float | None = None  # per-device peak FLOP/s for MFU; None: known chips only

    @property
    def block(self) -> int:
        """Blockwise-attention block size w = train_len / 2 (paper §3.3)."""
        return self.train_len // 2


def default_configdict(overrides: Mapping | None = None):
    """An ``ml_collections.ConfigDict`` of every field's default, updated with ``overrides``.

    Fields whose default is None become typed placeholders, so the command line
    can set them too (``--config.data.files=...``).
    """
    # Imported here so the library (and bench/accelerator.py) runs without ml_collections.
    from ml_collections import config_dict

    def build(cls):
        c, defaults, hints = config_dict.ConfigDict(), cls(), typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            default = getattr(defaults, field.name)
            if dataclasses.is_dataclass(default):
                c[field.name] = build(type(default))
            elif default is None:
                c[field.name] = config_dict.placeholder(_base_type(hints[field.name]))
            else:
                c[field.name] = dict(default) if field.name == "sharding_rules" else default
        return c

    c = build(Config)
    c.update(overrides or {})
    return c


def no_arguments(rest: list[str], path_flag: str = "workdir") -> list[str]:
    """``rest``, absl's leftover argv (the program name, then what is not a flag),
    if it holds nothing but the name: the programs take flags only, and one left
    over was ignored (``eval.py runs/x`` evaluated the default workdir). Else a
    one-line ConfigError, suggesting ``--path_flag=`` for a path-like argument, or
    quotes for a file (``--config.data.files novels/*.txt``: the shell expanded the
    glob, the flag took the first file and the others were left over)."""
    if len(rest) > 1:
        extra = rest[1]
        hint = "" if extra.startswith("-") else f" (did you mean --{path_flag}={extra}?)"
        if os.path.isfile(extra):
            example = os.path.join(os.path.dirname(extra), "*" + os.path.splitext(extra)[1])
            hint = (
                f" (a file: a glob the shell expanded? quote it, --FLAG='{example}', so that "
                "the program reads every file it matches)"
            )
        raise ConfigError(f"unexpected argument {extra!r}: flags are --name=value{hint}")
    return rest


def flags_parser(default_file: str, path_flag: str = "workdir"):
    """An absl ``flags_parser`` for ``app.run`` that adds the ``--config`` file flag.

    As with ml_collections' ``DEFINE_config_file``: ``--config=FILE[:PRESET]``
    (default ``default_file``) is ``get_config([PRESET])`` of FILE, read as
    ``absl.flags.FLAGS.config``, and ``--config.FIELD=VALUE`` overrides a field.
    Unlike it, a missing file (or one with a syntax error, no ``get_config``, no
    presets but a ``:PRESET``, or a ``get_config`` that returns no ConfigDict), an
    unknown field (with the closest known name) or a value of the wrong type raises a
    one-line :class:`ConfigError`, not a traceback from inside flag parsing.
    """
    # Imported here so the library (and bench/accelerator.py) runs without ml_collections.
    from absl import flags
    from ml_collections import config_dict, config_flags

    def parse(argv: list[str]) -> list[str]:
        path, rest, args = default_file, argv[:1], iter(argv[1:])
        for arg in args:
            if match := re.fullmatch(r"--?config(?:=(.*))?", arg):
                path = next(args, "") if match[1] is None else match[1]
            else:
                rest.append(arg)
        if not path.strip():  # "--config" last, or "--config=": it said "there is no file "
            raise ConfigError(
                f"--config needs a file: give --config=FILE[:PRESET], such as "
                f"--config={os.path.relpath(default_file)}, or leave --config out"
            )
        config = _load_file(path)
        if not isinstance(config, config_dict.ConfigDict):  # its fields could not be overridden
            raise ConfigError(
                f"--config={path}: get_config() returned a {type(config).__name__}, not a "
                "ConfigDict; start from lexjax.config.default_configdict()"
            )
        # Another program's config (the study's given to train.py) named its first field
        # as a typo of this program's ("unknown config field eval_docs").
        if path != default_file and not set(config) & set(_load_file(default_file)):
            raise ConfigError(
                f"--config={path}: none of its fields is one of this program's (a config "
                f"for another program?); name a config like {os.path.relpath(default_file)}"
            )
        for arg in rest:
            if match := re.match(r"--?(?:no)?config\.([^=]+)", arg):
                _check_field(config, match[1])
        config_flags.DEFINE_config_dict(
            "config",
            config,
            f"--config=FILE[:PRESET]: get_config() of FILE (default {default_file})",
            sys_argv=rest,  # without --config=FILE, which names no flag of its own here
        )
        exit_if_help(rest)
        try:
            rest = flags.FLAGS(rest)
        except (flags.Error, ValueError) as e:  # (absl's ValueError: --noremat=x)
            field_flag = _field_as_flag(config, e)
            raise field_flag or flag_error(e) from None
        return no_arguments(rest, path_flag)

    return parse


def flag_error(error: Exception) -> ConfigError:
    """absl's error for a bad flag value as a one-line :class:`ConfigError`; a
    switch's says what it takes (absl wrote the tuple ``('Non-boolean argument to
    boolean flag', 'maybe')``, and a ValueError traceback for ``--noremat=maybe``)."""
    message = one_line(error)
    pattern = r"flag --(\S+?)=(.*): \('Non-boolean argument to boolean flag', .*\)"
    if switch := re.fullmatch(pattern, message):
        name, value = switch.groups()
        message = (
            f"flag --{name}={value}: a switch is true or false "
            f"(--{name}, --no{name} or --{name}=false)"
        )
    elif negated := re.fullmatch(r"--no(\S+?)=(.*) does not take an argument", message):
        name, value = negated.groups()
        message = (
            f"flag --no{name}={value}: --no{name} takes no value; give --no{name} or --{name}=false"
        )
    return ConfigError(message)


def _field_as_flag(config, error) -> ConfigError | None:
    """The error for a config field given as a flag of its own (``--num_train_steps=3``,
    ``--d_model=64``) without ``--config.``: absl said "Unknown command line flag
    'num_train_steps'. Did you mean: num_processes ?", a flag of another meaning."""
    from absl import flags

    if not isinstance(error, flags.UnrecognizedFlagError):
        return None
    name, leaves = error.flagname, list(_leaf_paths(config))
    fields = [p for p in leaves if p == name] or [p for p in leaves if p.endswith("." + name)]
    if not fields:
        return None
    _, given, value = str(error.flagvalue).partition("=")
    meant = " or ".join(f"--config.{f}={value if given else 'VALUE'}" for f in fields)
    return ConfigError(
        f"unknown flag --{name}: config fields are set as --config.FIELD (did you mean {meant}?)"
    )


# What each help flag prints: this program's flags, every module's, or every module's
# as XML.
_HELP = {"h": "short", "help": "short", "helpshort": "short", "helpfull": "full", "helpxml": "xml"}


def exit_if_help(argv: list[str]) -> None:
    """Prints the program's help and exits 0 if ``argv`` asks for it: ``-h``,
    ``--help`` or ``--helpshort`` (this program's flags), ``--helpfull`` (every
    module's), ``--helpxml`` (every module's, as XML), as absl reads them too (one
    dash, ``=true`` or ``=1``). absl exits 1 after help, which the exit statuses
    reserve for a bug, and knows no ``-h``."""
    from absl import app, flags

    asked = []
    for arg in argv[1:]:
        name, given, value = arg.partition("=")
        dashes = len(name) - len(name.lstrip("-"))
        wanted = _HELP.get(name.lstrip("-")) if dashes in (1, 2) else None
        if wanted is not None and (not given or value.lower() in ("true", "t", "1")):
            asked.append(wanted)
    if "xml" in asked:
        flags.FLAGS.write_help_in_xml_format(sys.stdout)
        sys.exit(0)
    if asked:
        app.usage(shorthelp=set(asked) == {"short"}, writeto_stdout=True, exitcode=0)


def _load_file(path: str):
    """``get_config(preset)`` of the file of ``path`` = ``FILE[:PRESET]``: FILE is the
    shortest prefix before a ``:`` that is a file (a directory's name may hold one, a
    preset too), else the part before the first ``:``."""
    cuts = [i for i, c in enumerate(path) if c == ":"] + [len(path)]
    end = next((i for i in cuts if os.path.isfile(path[:i])), cuts[0])
    file, preset = path[:end], path[end + 1 :]
    if os.path.isdir(file):
        raise ConfigError(f"--config={path}: {file} is a directory; name a config file in it")
    if os.path.exists(file) and not os.path.isfile(file):  # /dev/null, a pipe: it said "no file"
        raise ConfigError(f"--config={path}: {file} is not a regular file; name a config file")
    if not os.path.isfile(file):
        siblings = glob.glob(os.path.join(glob.escape(os.path.dirname(file)), "*.py"))
        close = difflib.get_close_matches(file, siblings, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"--config={path}: there is no file {file}{hint}")
    try:
        get_config = runpy.run_path(file).get("get_config")
    except SyntaxError as e:
        raise ConfigError(f"--config={path}: {file} line {e.lineno}: {e.msg}") from None
    except Exception as e:  # an import it cannot make, a computation that fails
        raise _failed_in(path, file, e) from None
    if not callable(get_config):
        raise ConfigError(
            f"--config={path}: {file} defines no get_config(); a config file's "
            "get_config() returns lexjax.config.default_configdict() with changes"
        )
    if preset and not inspect.signature(get_config).parameters:
        raise ConfigError(f"--config={path}: {file} has no presets; drop ':{preset}'")
    try:
        return get_config(*[preset][: bool(preset)])
    except LexjaxError:
        raise  # a field check of lexjax's own, already one line
    except Exception as e:
        raise _failed_in(path, file, e) from None


def _failed_in(path: str, file: str, error: Exception) -> ConfigError:
    """A config file's own exception as one line, at its innermost line in that file."""
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == file]
    where = f"{file} line {lines[-1]}" if lines else file
    return ConfigError(f"--config={path}: {where}: {type(error).__name__}: {one_line(error)}")


def _check_field(config, path: str) -> None:
    """Raises the error of :func:`unknown_field` unless ``path`` (``a.b.c``) is in ``config``."""
    node, parts = config, path.split(".")
    for depth, key in enumerate(parts):
        known = list(node.keys()) if hasattr(node, "keys") else []
        if key not in known:
            leaves = list(_leaf_paths(config))
            # The field named last, wherever it is (train.num_train_steps, optim.learning_rate:
            # the config is flat there), the closest of several (model.vocab_size, not
            # data.vocab_size); under a wrong section or a value, else the closest path.
            same = [p for p in leaves if p.split(".")[-1] == parts[-1]]
            close = difflib.get_close_matches(path, same, n=1, cutoff=0) if same else []
            if not close and (depth < len(parts) - 1 or not known):
                close = difflib.get_close_matches(path, leaves, n=1, cutoff=0.6)
            prefix = ".".join(parts[:depth] + [""])
            if not close and depth == len(parts) - 1 and known:
                # A near name in this section, else in another (optim.learning_rat); else
                # a name that begins with it (model.pos, optim.warmup).
                names = {p.rsplit(".", 1)[-1]: p for p in reversed(leaves)}
                begins = [k for k in names if len(key) >= 3 and k.startswith(key)]
                close = [prefix + k for k in difflib.get_close_matches(key, known, 1, 0.6)]
                close = close or [names[k] for k in difflib.get_close_matches(key, names, 1, 0.8)]
                close = close or [prefix + k for k in known if k in begins]
                close = close or [names[k] for k in begins]
            if close:  # several only where several names begin with it: each is named
                raise ConfigError(
                    f"unknown config field {path}; did you mean {' or '.join(close)}?"
                )
            raise unknown_field(prefix + key, [prefix + k for k in known])
        node = node[key]


def _leaf_paths(node, prefix: str = ""):
    """The dotted paths of every field (not section) under ``node``."""
    for key, value in node.items():
        if hasattr(value, "keys"):
            yield from _leaf_paths(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def unknown_field(name: str, known) -> ConfigError:
    """The error for a field that does not exist, naming the closest known field."""
    # Names compared without their shared section (model.dropout is not model.rope_factor).
    last = {k.rsplit(".", 1)[-1]: k for k in known}
    close = [last[c] for c in difflib.get_close_matches(name.rsplit(".", 1)[-1], last, 1, 0.6)]
    hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(known)}" * bool(known)
    return ConfigError(f"unknown config field {name}{hint}")


def from_configdict(values) -> Config:
    """Builds and validates a :class:`Config` from a ConfigDict or nested dict.

    Missing fields take their defaults; an unknown field is an error, except
    the fields an older lexjax stored in its checkpoints (:data:`REMOVED_FIELDS`),
    which are ignored with a one-line note on stderr, so old workdirs still load.
    """
    values = _plain(values)
    removed = [name for name in REMOVED_FIELDS if name in values]
    if removed:
        print(
            f"note: ignoring config field {', '.join(removed)} of an older lexjax",
            file=sys.stderr,
            flush=True,
        )
    return _validated(_build(Config, upgraded(_nested(values)), ""))


def upgraded(values: Mapping) -> dict:
    """A config dict in today's field names: fields an older lexjax stored under
    another name moved (:data:`RENAMED_FIELDS`; a value under the new name wins)
    and removed ones dropped (:data:`REMOVED_FIELDS`). A new dict; missing fields
    stay missing."""
    values = {k: dict(v) if isinstance(v, Mapping) else v for k, v in values.items()}
    for old, new in RENAMED_FIELDS.items():
        parent, key = old.split(".")
        if isinstance(values.get(parent), dict) and key in values[parent]:
            values.setdefault(new, values[parent].pop(key))
    return {k: v for k, v in values.items() if k not in REMOVED_FIELDS}


def to_dict(config: Config) -> dict:
    """Plain nested dict (JSON-able) of a Config, e.g. to store with a checkpoint."""
    out = dataclasses.asdict(config)
    out["sharding_rules"] = dict(config.sharding_rules)
    return out


def dotted(tree: dict, prefix: str = "") -> dict:
    """A nested config dict (:func:`to_dict`) as ``{"model.d_model": 64, ...}``, the
    fields as ``--config.FIELD`` names them; an empty dict is a field of its own."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# The user-level fields a model field follows when left unset (see _validated).
_DERIVED_FROM = {
    "max_len": ("train_len",),
    "rope_train_len": ("train_len",),
    "vocab_size": ("data.tokenizer", "data.vocab_size"),
}


def field_at(values, name: str):
    """The value of dotted field ``name`` (``optim.schedule``) in a config dict; None
    where it or a parent is missing or not a mapping (an older checkpoint's record)."""
    for key in name.split("."):
        values = values.get(key) if isinstance(values, Mapping) else None
    return values


def model_differences(stored: dict, config: Config) -> list[str]:
    """The fields to change in ``config`` to get the model of ``stored`` (a config
    dict stored with a checkpoint): ``model.*`` fields, or for one that follows
    another the field the user sets (``train_len`` for ``model.max_len``).
    How the model runs (remat, attention_impl, the compute and parameter dtypes) does
    not count; with no stored model there is nothing to compare."""
    theirs, now = stored.get("model"), to_dict(config)
    if not theirs:
        return []
    # With today's defaults for fields added since (None in the dict), derived ones too;
    # a config this version cannot read is compared as stored.
    with contextlib.suppress(ConfigError):  # upgraded first: no note of a removed field
        theirs = to_dict(from_configdict(upgraded(stored)))["model"]
    ours = now["model"]
    # param_dtype too: a restore casts every array to the dtype asked for (a float16
    # run, refused since, continues in float32).
    for how_it_runs in ("remat", "remat_policy", "attention_impl", "dtype", "param_dtype"):
        ours.pop(how_it_runs)

    differences = set()
    for key in (k for k in ours if theirs.get(k) != ours[k]):
        sources = [s for s in _DERIVED_FROM.get(key, ()) if field_at(stored, s) != field_at(now, s)]
        differences.update(sources or [f"model.{key}"])
    return sorted(differences)


def model_changes(stored: dict, config: Config) -> list[str]:
    """:func:`model_differences` as "<field> is A there, B here", the stored value first,
    so that a refusal says which value to resume with (it named only the field)."""
    names = model_differences(stored, config)
    if not names:  # (every resume of the same model: no second conversion)
        return []
    theirs = stored
    with contextlib.suppress(ConfigError):  # as model_differences compares them
        theirs = to_dict(from_configdict(upgraded(stored)))
    now = to_dict(config)
    return [
        f"{name} is {field_at(theirs, name)} there, {field_at(now, name)} here" for name in names
    ]


def _plain(values, path: str = "config") -> dict:
    if isinstance(values, Config):  # a loaded run's config, or one built by hand
        return to_dict(values)
    if hasattr(values, "to_dict"):
        return values.to_dict()
    if not isinstance(values, Mapping):
        shown = repr(values)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ConfigError(
            f"{path}={shown}: expected a mapping of fields, e.g. {{'train_len': 64}}, or a Config"
        )
    return dict(values)


def _base_type(hint):
    """``int | None`` → ``int``; other hints unchanged."""
    return next((t for t in typing.get_args(hint) if t is not type(None)), hint)


def _build(cls, values: Mapping, prefix: str):
    """An instance of dataclass ``cls`` from ``values``, type-checked field by field."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in _nested(values).items():
        path = prefix + str(name)  # a key such as 1 or b'x' is a field name unknown
        if name not in names:
            raise unknown_field(path, [prefix + n for n in names])
        if dataclasses.is_dataclass(hints[name]):
            section = {} if value is None else value  # None: the defaults
            kwargs[name] = _build(hints[name], _plain(section, path), path + ".")
        else:
            kwargs[name] = _checked(path, value, hints[name])
    return cls(**kwargs)


def _nested(values: Mapping) -> dict:
    """``values`` with dotted names, the flags' and the messages' (``{"model.num_layers":
    1}``), moved into their section (``{"model": {"num_layers": 1}}``), over its
    nested entries."""
    out = {k: v for k, v in values.items() if "." not in str(k)}
    for key, value in values.items():
        if "." in str(key):
            head, rest = str(key).split(".", 1)
            section = out.get(head)
            out[head] = {**_plain({} if section is None else section, head), rest: value}
    return out


# Fields naming files or a directory: os.PathLike is taken there as its string, as the
# API's workdir and out_dir take it.
_PATH_FIELDS = ("data.files", "data.validation_files", "data.test_files", "data.data_dir")


def _checked(path: str, value, hint):
    """``value`` as the type of ``hint``, or a ConfigError naming ``path``."""
    value = as_python(value)
    if path in _PATH_FIELDS and isinstance(value, os.PathLike):  # a pathlib.Path
        value = os.fspath(value)
    if value is None and type(None) in typing.get_args(hint):
        return None
    kind = _base_type(hint)
    if kind is tuple:
        return _sharding_rules(value)
    if isinstance(value, Mapping) and value:  # {"train_len": {"x": 1}}: not a section
        raise unknown_field(f"{path}.{next(iter(value))}", [])
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # also NumPy's
    ok = {
        bool: isinstance(value, (bool, np.bool_)),
        int: number and isinstance(value, numbers.Integral),
        float: number,
        str: isinstance(value, str),
    }[kind]
    if not ok:
        expected = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
        raise ConfigError(f"{path}={value!r}: expected {expected[kind]}")
    if kind is float and not math.isfinite(value):  # NaN passes every range check
        raise ConfigError(f"{path}={value!r}: expected a finite number")
    return kind(value) if number or kind is bool else value


def _sharding_rules(value) -> tuple:
    """``sharding_rules``, a mapping or (logical axis, mesh axes) pairs, as pairs whose
    every name is known (a misspelt one would shard nothing, or fail at mesh time)."""
    try:
        table = dict(value.items() if isinstance(value, Mapping) else value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"sharding_rules={value!r}: expected a table such as {{'mlp': 'tensor'}}"
        ) from None
    for logical, axes in table.items():
        _known_name("sharding_rules: logical axis", logical, LOGICAL_AXES)
        named = list(axes) if isinstance(axes, (list, tuple)) else [] if axes is None else [axes]
        for axis in named:
            _known_name(f"sharding_rules[{logical!r}]: mesh axis", axis, MESH_AXES)
        if twice := next((a for a in named if named.count(a) > 1), None):
            raise ConfigError(
                f"sharding_rules[{logical!r}]={axes!r} names mesh axis {twice!r} twice; "
                "name each axis once"
            )
    return tuple(table.items())


def _known_name(what: str, name, known: tuple[str, ...]) -> None:
    if name not in known:
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(known)}"
        raise ConfigError(f"{what} {name!r} is unknown; {hint}")


def check_rope_scaling(
    scaling: str,
    factor: float,
    position: str | None = None,
    *,
    names: tuple[str, str] = ("rope_scaling", "rope_factor"),
) -> None:
    """Raises a one-line :class:`ConfigError` naming ``names`` (the scaling's and the
    factor's setting) unless the RoPE extension ``scaling`` with ``factor`` applies to
    a model whose position encoding is ``position`` (None: not known yet)."""
    scaling_name, factor_name = names
    if not isinstance(scaling, str) or scaling not in ROPE_SCALINGS:
        raise ConfigError(f"{scaling_name}={scaling!r}: choose one of {', '.join(ROPE_SCALINGS)}")
    if not is_real(factor) or not (factor == 0 or (factor >= 1 and factor != float("inf"))):
        raise ConfigError(
            f"{factor_name}={factor} must be ≥ 1, or 0 for each evaluated length / train_len"
        )
    if factor and scaling == "none":
        raise ConfigError(
            f"{factor_name}={factor:g} needs a scaling: set {scaling_name} to pi, ntk or yarn"
        )
    if factor and scaling == "dynamic_ntk":
        raise ConfigError(
            f"{factor_name}={factor:g} does not apply to dynamic_ntk, whose factor follows "
            "the positions processed; leave it 0"
        )
    if scaling != "none" and position is not None and position not in ROTARY_ENCODINGS:
        raise ConfigError(
            f"{scaling_name}={scaling} extends a rotary encoding "
            f"({' or '.join(ROTARY_ENCODINGS)}); "
            f"position {position} has no rotation to scale"
        )


def check_int(name: str, value, low: int = 1, high: int | None = None, bound: str = "") -> int:
    """``value`` as an int (numpy's integers too) if it is an integer in [low, high);
    else a one-line :class:`ConfigError` naming ``name`` and ``bound`` (default: the range)."""
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or value < low or (high is not None and value >= high):
        default = f"an integer in [{low}, {high})" if high is not None else f"an integer ≥ {low}"
        bound = bound or ("a positive integer" if (low, high) == (1, None) else default)
        raise ConfigError(f"{name}={value!r} must be {bound}")
    return int(value)


def check_bool(name: str, value) -> bool:
    """``value`` as a bool (numpy's too) if it is one; else a one-line
    :class:`ConfigError` naming ``name``: ``"no"`` or ``0`` is not read as a switch."""
    value = as_python(value)
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False")
    return value


def as_python(value):
    """A concrete NumPy or JAX array or scalar as Python values (0-d: its one value,
    e.g. ``np.array(256)``, ``jnp.int32(8)``, ``x.sum()``; more dimensions: lists);
    anything else, a tracer included, as it is."""
    if not isinstance(value, np.generic) and not hasattr(value, "__array__"):
        return value
    try:
        return value.tolist()
    except Exception:  # a tracer has no value; the caller's check names it
        return value


def is_sequence(value) -> bool:
    """Whether ``value`` holds a sequence of values: iterable, yet not a str or bytes
    and not a 0-d array (a PRNG key, ``np.array(256)``), whose ``__iter__`` raises
    TypeError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return False
    return getattr(value, "ndim", None) != 0


def is_real(value) -> bool:
    """Whether ``value`` is a real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_path(name: str, value) -> str:
    """``value`` (a str or ``os.PathLike``) as a str, ``~`` expanded; else a one-line
    :class:`ConfigError`."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a path (a str or os.PathLike), got {value!r}")
    if not os.fspath(value).strip():  # not the current directory by accident
        raise ConfigError(f"{name} is empty; give a path")
    return os.path.expanduser(os.fspath(value))  # a shell leaves "--workdir=~/x" as it is


def check_dtypes(m: ModelConfig) -> None:
    """:class:`ConfigError` unless ``model.dtype`` and ``param_dtype`` are known."""
    for name in ("dtype", "param_dtype"):
        if getattr(m, name) not in _DTYPES:
            raise ConfigError(f"model.{name}={getattr(m, name)!r}: use {', '.join(_DTYPES)}")


def check_seed(seed, name: str = "seed") -> int:
    """A seed as an int; :class:`ConfigError` naming ``name`` outside [0, 2**32), the
    data shuffle's range."""
    return check_int(name, seed, 0, 2**32, "an integer in [0, 2**32)")


def tokenizer_vocab_size(data: DataConfig) -> int:
    """The number of ids ``data.tokenizer`` produces (a SentencePiece model has
    exactly ``data.vocab_size``)."""
    return TOKENIZER_VOCAB_SIZE if data.tokenizer == "bytes" else data.vocab_size


def check_mesh_sizes(mesh: MeshConfig) -> None:
    """Refuses mesh axis sizes that fit no device count: each axis positive or -1
    (the devices left), at most one -1 (``lexjax.sharding.mesh_shape`` fits the rest)."""
    sizes = [mesh.data, mesh.fsdp, mesh.tensor]
    for axis, size in zip(MESH_AXES, sizes):
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: use a positive size or -1")
    if sizes.count(-1) > 1:
        filled = " and ".join(f"mesh.{a}=-1" for a, s in zip(MESH_AXES, sizes) if s == -1)
        raise ConfigError(
            "at most one of mesh.data/fsdp/tensor may be -1 (fill with the remaining "
            f"devices), got {filled}; set the others' sizes (the config's default may be -1)"
        )


def _validated(config: Config) -> Config:
    """Checks every value a user can get wrong; resolves ``model.max_len`` and
    ``model.vocab_size`` = None, and makes the data paths absolute."""
    if config.sharding not in SHARDINGS:
        raise ConfigError(f"sharding={config.sharding!r}: choose one of {', '.join(SHARDINGS)}")
    check_mesh_sizes(config.mesh)
    d = config.data
    if d.tokenizer not in TOKENIZERS:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: use {' or '.join(TOKENIZERS)}")
    if d.tokenizer == "sentencepiece" and d.vocab_size < _MIN_SENTENCEPIECE_VOCAB:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} is too small for sentencepiece: its 256 byte "
            f"pieces and 5 markers need at least {_MIN_SENTENCEPIECE_VOCAB}"
        )
    if d.tokenizer == "sentencepiece" and d.vocab_size >= 2**31:  # its trainer's int32
        raise ConfigError(f"data.vocab_size={d.vocab_size} is beyond sentencepiece's 2^31 - 1")
    needed = tokenizer_vocab_size(d)
    m = config.model
    if m.vocab_size is None:
        m = dataclasses.replace(m, vocab_size=-(-needed // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    elif m.vocab_size < needed:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is below the {d.tokenizer} tokenizer's "
            f"{needed} ids; leave it unset (it follows the tokenizer)"
        )
    if m.max_len is not None and m.max_len < config.train_len:
        raise ConfigError(
            f"model.max_len={m.max_len} is below train_len={config.train_len}; "
            "raise it or leave it unset (it follows train_len)"
        )
    if m.rope_train_len is not None and m.rope_train_len < 1:
        raise ConfigError(
            f"model.rope_train_len={m.rope_train_len} must be positive (or unset: train_len)"
        )
    m = dataclasses.replace(
        m,
        max_len=m.max_len or config.train_len,
        rope_train_len=m.rope_train_len or config.train_len,
    )
    config = dataclasses.replace(config, model=m)
    if m.position not in POSITION_KINDS:
        raise ConfigError(
            f"model.position={m.position!r} is unknown; choose one of {', '.join(POSITION_KINDS)}"
        )
    check_rope_scaling(
        m.rope_scaling, m.rope_factor, m.position, names=("model.rope_scaling", "model.rope_factor")
    )
    if m.attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(
            f"model.attention_impl={m.attention_impl!r}: choose one of {', '.join(ATTENTION_IMPLS)}"
        )
    if m.attention_impl == "splash" and m.position == "alibi":
        raise ConfigError(
            "model.attention_impl=splash takes no logit bias, so no model.position=alibi; "
            "use fused or explicit attention for ALiBi"
        )
    if m.remat_policy not in REMAT_POLICIES:
        raise ConfigError(
            f"model.remat_policy={m.remat_policy!r}: choose one of {', '.join(REMAT_POLICIES)}"
        )
    if m.remat is not None:
        implied = "full" if m.remat else "none"
        if m.remat_policy not in ("none", implied):
            raise ConfigError(
                f"model.remat={m.remat} contradicts model.remat_policy={m.remat_policy}; "
                "set only model.remat_policy"
            )
        policy = implied if m.remat else m.remat_policy
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, remat_policy=policy, remat=None)
        )
    for name in ("num_layers", "d_model", "num_heads", "mlp_dim"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.d_model % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.d_model="
            f"{m.d_model}; pick heads that divide it"
        )
    if m.position in PAIRED_ENCODINGS and m.head_dim % 2:
        raise ConfigError(
            f"head_dim = d_model/num_heads = {m.head_dim} is odd, but "
            f"model.position={m.position} rotates pairs; make it even"
        )
    if m.position in ABSOLUTE_ENCODINGS and m.d_model % 2:
        raise ConfigError(f"model.d_model={m.d_model} must be even for {m.position} positions")
    for name in ("scale_base", "theta"):
        if not getattr(m, name) > 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.position in ROTARY_ENCODINGS and m.theta < 1 and m.head_dim > 2:
        # The fastest pair turns θ^(−(d−2)/d) radians per position: past float32's range
        # the angles are infinite and the loss NaN from step 1.
        log_angle = -(m.head_dim - 2) / m.head_dim * math.log(m.theta) + math.log(config.train_len)
        if log_angle > math.log(float(np.finfo(np.float32).max)):
            raise ConfigError(
                f"model.theta={m.theta:g} turns rotary angles past float32's range "
                f"(about 1e{log_angle / math.log(10):.0f} radians by position {config.train_len}); "
                "use theta ≥ 1 (RoPE's is 10000)"
            )
    check_dtypes(m)
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
    if o.schedule not in _SCHEDULES:
        raise ConfigError(f"optim.schedule={o.schedule!r}: use {', '.join(_SCHEDULES)}")
    if not config.learning_rate > 0:
        raise ConfigError(f"learning_rate={config.learning_rate} must be positive")
    if config.warmup_steps < 0:
        raise ConfigError(f"warmup_steps={config.warmup_steps} must be ≥ 0 (0: no warmup)")
    if o.grad_accum_steps < 1:
        raise ConfigError(f"optim.grad_accum_steps={o.grad_accum_steps} must be ≥ 1 (1: none)")
    if config.batch_size % o.grad_accum_steps:
        raise ConfigError(
            f"optim.grad_accum_steps={o.grad_accum_steps} must divide "
            f"batch_size={config.batch_size}"
        )
    if not 0 <= o.end_lr_fraction <= 1:
        raise ConfigError(f"optim.end_lr_fraction={o.end_lr_fraction} must be in [0, 1]")
    for name in ("b1", "b2"):
        if not 0 <= getattr(o, name) < 1:
            raise ConfigError(f"optim.{name}={getattr(o, name)} must be in [0, 1)")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps={o.eps} must be positive")
    for name, what in (("weight_decay", "0: none"), ("grad_clip", "0: no clipping")):
        if getattr(o, name) < 0:
            raise ConfigError(f"optim.{name}={getattr(o, name)} must be ≥ 0 ({what})")
    check_seed(config.seed)
    if config.on_corrupt_checkpoint not in ("fallback", "error"):
        raise ConfigError("on_corrupt_checkpoint must be 'fallback' or 'error'")
    if config.peak_flops is not None and not config.peak_flops > 0:
        raise ConfigError(f"peak_flops={config.peak_flops} must be positive (FLOP/s per device)")
    d = config.data
    for name in ("name", "text_feature"):
        if not getattr(d, name).strip():
            raise ConfigError(f"data.{name} is empty")
    if d.worker_count < 0:
        raise ConfigError(
            f"data.worker_count={d.worker_count} must be ≥ 0 (0: no worker processes)"
        )
    if d.shuffle_rows < 0:
        raise ConfigError(f"data.shuffle_rows={d.shuffle_rows} must be ≥ 0 (0: packing order)")
    if d.open_documents < 1:
        raise ConfigError(
            f"data.open_documents={d.open_documents} must be ≥ 1 (1: one document after another)"
        )
    if not 0 <= d.passkey_fraction < 1:
        raise ConfigError(f"data.passkey_fraction={d.passkey_fraction} must be in [0, 1) (0: none)")
    if not 0 <= d.copy_fraction < 1 or d.passkey_fraction + d.copy_fraction >= 1:
        raise ConfigError(
            f"data.copy_fraction={d.copy_fraction} must be in [0, 1) and leave text rows: "
            f"with data.passkey_fraction={d.passkey_fraction} they must sum to less than 1"
        )
    if d.name == "textfiles" and not d.files:
        # The API's argument, or train.py's flag (it was the flag in make_config's error too).
        example = errors_lib.arg("data.files='/path/*.txt'", "'--config.data.files=/path/*.txt'")
        raise ConfigError(f"data.name=textfiles needs data.files, a glob such as {example}")
    # Fixed where the config is made, so a run (stored with them) and a loaded Run still
    # find their corpus and its build once the working directory changes (a notebook's
    # %cd). A URL (gs://…) stays as it is.
    paths = {
        name: os.path.abspath(os.path.expanduser(value))
        for name in ("files", "validation_files", "test_files", "data_dir")
        if isinstance(value := getattr(d, name), str) and value.strip() and "://" not in value
    }
    return dataclasses.replace(config, data=dataclasses.replace(d, **paths))
