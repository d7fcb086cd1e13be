"""The verbs of the public API: make a config, train it into a workdir, load the run,
evaluate and generate from it.

``train.py`` and ``eval.py`` call these same functions (through ``cli.py``),
so a notebook gets the checkpoints, ``metrics.jsonl``, progress display, tables
and files of the programs::

    config = lexjax.make_config({"train_len": 64, "num_train_steps": 200})
    lexjax.train(config, "runs/nb")
    run = lexjax.load("runs/nb")
    results = run.evaluate([64, 256, 1024])
    print(run.generate("def ", max_new_tokens=1000))

Errors a user can cause raise :class:`lexjax.errors.LexjaxError` subclasses
with a one-line message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from lexjax import checkpoint, evaluation, generation, passkey, training
from lexjax import sharding as shard_lib
from lexjax.config import Config, as_python, check_path, from_configdict, is_real, is_sequence
from lexjax.data import Tokenizer
from lexjax.errors import (
    CheckpointError,
    ConfigError,
    EvaluationError,
    arg,
    one_line,
    out_of_memory,
)
from lexjax.metrics import read_metrics
from lexjax.model import Decoder

__all__ = ["make_config", "train", "load", "Run"]

train = training.train


def make_config(overrides: Mapping[str, Any] | None = None) -> Config:
    """A validated :class:`lexjax.config.Config`: every field's default
    (``lexjax/config.py`` lists them) updated with ``overrides``, a nested
    mapping such as ``{"train_len": 64, "model": {"num_layers": 2}}`` (or with the
    flags' dotted names, ``{"model.num_layers": 2}``), an
    ``ml_collections.ConfigDict`` (the ``get_config()`` of ``configs/*.py``), or
    a :class:`lexjax.config.Config` (a loaded run's ``run.config``), checked again.

    Raises :class:`lexjax.errors.ConfigError` naming an unknown field (with the
    closest known one) or a value out of range.
    """
    return from_configdict({} if overrides is None else overrides)


class _DropOrbaxNotices(logging.Filter):
    """Drops orbax's below-ERROR records (a read-only directory "is read only")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not checkpoint.logged_by_orbax(record)


@contextlib.contextmanager
def _on_mesh(mesh, lower: str):
    """``jax.set_mesh(mesh)``; an allocation that fails inside is one
    :class:`EvaluationError` that says to lower ``lower`` or use BCA."""
    try:
        with jax.set_mesh(mesh):
            yield
    except Exception as e:
        if not out_of_memory(e):
            raise
        bca = arg("mode 'bca'", "--bca=on")
        raise EvaluationError(
            f"out of memory ({one_line(e)}); lower {lower}, or use {bca}, whose memory does "
            "not grow with the length"
        ) from None


def _listed(value):
    """One value where a sequence is expected (``lengths=256``, ``modes="bca"``) as a
    list of it; a string is one mode, not a sequence of letters."""
    value = as_python(value)
    one = isinstance(value, (str, numbers.Integral)) and not isinstance(value, bool)
    return [value] if one else _elements(value)


def _elements(value):
    """A sequence's JAX and NumPy scalars (``list(jnp.array([16, 32]))``) as Python
    numbers in a list; anything else as :func:`lexjax.config.as_python` gives it (a
    string stays one, to be refused where a sequence is asked)."""
    value = as_python(value)
    if not is_sequence(value):
        return value
    return [as_python(v) for v in value]


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    """A trained run loaded by :func:`load`: the parameters of its newest good
    checkpoint (``step``), the config stored with them and its tokenizer.

    ``params`` is the Flax parameter pytree of ``Decoder(config.model)``
    (:attr:`model`), float arrays in ``config.model.param_dtype`` sharded on :attr:`mesh`.
    """

    workdir: str
    config: Config
    # Not in the repr: a notebook showing ``run`` printed every parameter array
    # (17,874 characters on 307 lines for a model of 18,720 parameters).
    params: Any = dataclasses.field(repr=False)
    step: int
    tokenizer: Tokenizer  # the one it was trained with: encode, decode, bos, eos, num_bytes
    mesh: jax.sharding.Mesh  # the run's mesh re-fitted to the devices here; params live on it
    # The corpus build it trained on (name/fingerprint/version; None: not recorded).
    # Evaluating on its held-out split refuses another build, which may hold trained text.
    corpus: str | None = None

    @property
    def model(self) -> Decoder:
        """The Flax module: ``run.model.apply({"params": run.params}, tokens_BxT)``
        returns ``(logits_BxTxV, new_kv)`` (see :class:`lexjax.Decoder`)."""
        return Decoder(self.config.model, shard_lib.rules(self.config))

    def metrics(self) -> list[dict[str, float]]:
        """The records of ``WORKDIR/metrics.jsonl`` in the order training wrote them
        (``{"step", "loss", "learning_rate", ...}`` or ``{"step", "val_loss"}``).
        A resumed run trains the steps after its checkpoint again and first drops
        their earlier records, so each step has one. A record torn by a killed
        writer is skipped, with a note. A run copied without its metrics.jsonl gives
        none, with a note; one moved since it was loaded, a CheckpointError."""
        self._check_there(writes=False)
        return read_metrics(self.workdir)

    def evaluate(
        self,
        lengths: Sequence[int] | None = None,
        *,
        max_length: int | None = None,
        modes: Sequence[str] = evaluation.DEFAULT_MODES,
        sinks: int = evaluation.DEFAULT_SINKS,
        eval_files: str | None = None,
        max_docs: int = evaluation.DEFAULT_MAX_DOCS,
        resolution: bool = False,
        figure: bool = False,
        rope_scaling: str = "none",
        rope_factor: float = 0.0,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> list[evaluation.PerplexityResult]:
        """Perplexity by length exactly as ``eval.py`` computes it.

        Args:
          lengths: evaluated lengths in tokens (default 1, 2, 4, 8, 16 × train_len).
          max_length: the token budget scored at every length (default 16 ×
            train_len, or the largest length if larger); a length that does not
            divide it is reported missing, and at least one must divide it.
          modes: some of ``"bca"`` (blockwise causal attention), ``"full"`` (plain
            causal attention over the whole length) and ``"sinks"`` (StreamingLLM:
            ``sinks`` attention sinks and a sliding window of ``train_len − sinks``
            tokens); default bca and full.
          sinks: the sink count of mode ``"sinks"`` (0 … train_len/2).
          eval_files: a glob of text files instead of the run's held-out split.
          max_docs: at most this many documents of at least ``max_length + 1`` tokens.
          resolution, figure: also measure attention resolution / draw Figure 1.
          rope_scaling, rope_factor: an inference-time RoPE extension of an
            xpos/rope run (``pi``, ``ntk``, ``dynamic_ntk``, ``yarn``; factor 0:
            each length / train_len), in the results and the files' names.
          out_dir: where the reports go instead of ``WORKDIR/eval`` (a run on
            read-only storage).

        Prints the table, shows progress on stderr and writes
        ``WORKDIR/eval/perplexity.{json,png}`` (see
        :func:`lexjax.evaluation.evaluate_run`). Returns one
        :class:`lexjax.evaluation.PerplexityResult` per (mode, length) that could
        be evaluated; the others are listed in the table with the reason.
        Arguments eval.py would refuse raise :class:`lexjax.errors.ConfigError`
        (:func:`lexjax.evaluation.check_settings`); numpy integers are integers.
        """
        # JAX's and NumPy's scalars (jnp.int32(8), x.sum()) as Python numbers.
        max_length, sinks, max_docs, rope_factor = map(
            as_python, (max_length, sinks, max_docs, rope_factor)
        )
        self._check_there(out_dir)
        with _on_mesh(self.mesh, f"{arg('lengths')} and {arg('max_length')}"):
            results, _ = evaluation.evaluate_run(
                self.config,
                self.params,
                self.step,
                self.workdir,
                lengths=_listed(lengths),
                max_length=max_length,
                modes=_listed(modes),
                sinks=sinks,
                eval_files=eval_files,
                max_docs=max_docs,
                resolution=resolution,
                figure=figure,
                tokenizer=self.tokenizer,
                corpus=self.corpus,
                mesh=self.mesh,
                rope_scaling=rope_scaling,
                rope_factor=rope_factor,
                out_dir=out_dir,
            )
        return results

    def _check_there(self, out_dir=None, *, writes: bool = True) -> None:
        """Refuses a run whose workdir is gone (renamed, deleted since it was loaded):
        writing WORKDIR/eval would put the reports in an empty directory beside no run,
        and reading the workdir would find nothing there as if the run had none.
        ``writes``: the call writes WORKDIR/eval, which ``out_dir`` replaces."""
        if out_dir is None and not os.path.isdir(self.workdir):
            again = "lexjax.load the run again where it is now"
            if writes:
                again += ", or pass out_dir=DIR"
            again = arg(again, "run eval.py again with --workdir where the run is now")
            raise CheckpointError(
                f"workdir {self.workdir} is gone (moved or deleted since its run was loaded); "
                + again
            )

    def passkey(
        self,
        lengths: Sequence[int] | None = None,
        *,
        depths: Sequence[float] | None = None,
        trials: int = passkey.DEFAULT_TRIALS,
        modes: Sequence[str] = evaluation.DEFAULT_MODES,
        filler: str = passkey.FILLERS[0],
        eval_files: str | None = None,
        max_docs: int | None = None,
        seed: int = 0,
        out_dir: str | os.PathLike[str] | None = None,
    ) -> list[passkey.PasskeyResult]:
        """Passkey retrieval exactly as ``eval.py --passkey`` measures it: the
        fraction of ``trials`` keys the model's greedy continuation gives, at each
        length (default 1, 2, 4, 8 × train_len), depth (default 0, 0.25, … 1) and
        mode; ``filler`` ``"repeat"`` (a sentence) or ``"text"`` (the first
        ``max_docs`` held-out documents, default 20, or ``eval_files``). Prints the tables and
        writes ``WORKDIR/eval/passkey.json`` and a heat map per mode
        (:func:`lexjax.passkey.evaluate_passkey`), or in ``out_dir``."""
        depths, trials, max_docs, seed = map(as_python, (depths, trials, max_docs, seed))
        self._check_there(out_dir)
        with _on_mesh(self.mesh, arg("lengths")):
            results, _ = passkey.evaluate_passkey(
                self.config,
                self.params,
                self.step,
                self.workdir,
                lengths=_listed(lengths),
                depths=[depths] if is_real(depths) else _elements(depths),  # no list for one
                trials=trials,
                modes=_listed(modes),
                filler=filler,
                eval_files=eval_files,
                max_docs=max_docs,
                seed=seed,
                tokenizer=self.tokenizer,
                corpus=self.corpus,
                mesh=self.mesh,
                out_dir=out_dir,
            )
        return results

    def generate(
        self,
        prompt: str = "",
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        mode: str = "bca",
        on_text=None,
        progress: bool | None = None,
    ) -> str:
        """The text the model writes after ``prompt``, up to its first end-of-document.

        The prompt is a document's beginning (the tokenizer's BOS is put before it
        here). Decoding keeps a key/value cache of one training length, so any
        ``max_new_tokens`` runs in constant memory per token. ``temperature`` 0
        is greedy; ``top_k`` 0 and ``top_p`` 1 mean no limit. ``mode="full"``
        decodes without BCA: plain causal attention over every earlier token,
        whose cache grows with the text (:func:`lexjax.generation.generate`).
        More than ``generation.CHUNK`` (1024) tokens show progress on stderr, unless
        ``on_text`` takes the text, which is its own progress (``progress=True``: shown
        then too, every 64 tokens; ``False``: never). ``on_text`` (e.g.
        ``functools.partial(print, end="")``) is given the text as it comes, in pieces
        that join to the result
        (on every process of a multi-process run), e.g. ``sys.stdout.write``; where it
        returns ``True`` (or numpy's; any other value goes on), on any process, the writing ends
        there (every process stops after that chunk).
        """
        sampling = (max_new_tokens, temperature, top_k, top_p, seed)
        max_new_tokens, temperature, top_k, top_p, seed = map(as_python, sampling)
        with _on_mesh(self.mesh, arg("max_new_tokens")):
            return generation.complete(
                self.config,
                self.params,
                prompt,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                tokenizer=self.tokenizer,
                mode=mode,
                on_text=on_text,
                progress=progress,
            )


def load(
    workdir: str | os.PathLike[str],
    *,
    check: Callable[[Config], None] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Run:
    """Loads the newest good checkpoint of a training workdir (params only,
    checksums verified; a damaged step falls back to the one before). ``check``:
    called with the run's :class:`lexjax.config.Config` before its parameters are
    read, to refuse settings that do not suit the run early (its exception
    propagates). ``devices``: the devices its mesh spans, a list or one device
    (default all of them);
    ``devices=jax.devices()[:1]`` gives parameters on one device, to mix with arrays
    placed there in code of your own.

    Raises :class:`lexjax.errors.CheckpointError` when there is none. Needs no
    lease: it reads while training runs, and only complete steps.
    """
    # Absolute: the run's files stay where they are after a notebook's %cd.
    workdir = os.path.abspath(check_path("workdir", workdir))
    if check is not None and not callable(check):
        raise ConfigError(f"check must be a function of the run's Config or None, got {check!r}")
    if devices is not None:
        given = devices
        if isinstance(devices, jax.Device):  # one device: devices=jax.devices()[0]
            devices = [devices]
        devices = list(devices) if isinstance(devices, Iterable) else []
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise ConfigError(f"devices must be a non-empty list of jax devices, got {given!r}")
        if len(set(devices)) < len(devices):
            raise ConfigError(f"devices names a device twice: {given!r}; give each once")
        if jax.process_count() > 1:  # a mesh of some processes' devices hangs the others
            raise ConfigError("devices= is for one process; a multi-process job loads on all")
    # A damaged step's failed reads end in one warning, not in tracebacks of orbax's
    # threads and coroutines (a kernel collects them later, while it runs).
    checkpoint.quiet_background_errors()
    # lexjax's own warnings (a damaged step skipped) come from the "lexjax" loggers.
    with checkpoint.absl_filter(_DropOrbaxNotices()):
        loaded, mesh = evaluation.load_on_mesh(workdir, devices, check=check)
    return Run(
        workdir, loaded.config, loaded.params, loaded.step, loaded.tokenizer, mesh, loaded.corpus
    )
