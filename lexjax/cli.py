"""The boundary between the command-line programs and the library.

Errors a user can cause (:class:`lexjax.errors.LexjaxError`) are reported by
:func:`main` as one line on stderr with the exit status of their kind (the
table in :mod:`lexjax.errors`), never as a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import jax
from absl import logging as absl_logging

from lexjax import distributed, training
from lexjax.config import ConfigError, from_configdict
from lexjax.errors import LexjaxError, one_line

__all__ = ["main", "run_training", "fail"]


def main(program, *args, **kwargs) -> int:
    """Runs one program's body: the one place its user errors are caught.

    A :class:`lexjax.errors.LexjaxError` becomes ``error: <one line>`` on
    stderr and the exit status of its kind (see :mod:`lexjax.errors`).
    """
    quiet_checkpoint_io_noise()
    try:
        return program(*args, **kwargs) or 0
    except LexjaxError as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return e.exit_code


def fail(message: str, code: int = 1):
    """Old one-line exit, still used by the eval half until it raises LexjaxErrors."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


class _NoOrbaxErrors(logging.Filter):
    """Drops ERROR logs of orbax's background writes: its own, and asyncio's
    "Task exception was never retrieved" for orbax's tasks.

    The same failure reaches the Checkpointer as an exception at the next save or
    wait, and the user sees it once, as one line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if f"{os.sep}orbax{os.sep}" in record.pathname:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not (
            record.name == "asyncio"
            and (_from_checkpoint_io(exc) or f"{os.sep}orbax{os.sep}" in record.getMessage())
        )


def _from_checkpoint_io(exc: BaseException | None, obj=None) -> bool:
    """True for errors raised inside orbax/tensorstore's asynchronous plumbing."""
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return True
    code = getattr(obj, "cr_code", None)
    files = [code.co_filename] if code is not None else []
    tb = getattr(exc, "__traceback__", None)
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return any(f"{os.sep}orbax{os.sep}" in f or f"{os.sep}tensorstore{os.sep}" in f for f in files)


def quiet_checkpoint_io_noise() -> None:
    """Keeps orbax's background failures from printing tracebacks on stderr.

    A failed read or write surfaces three ways: as the exception the
    Checkpointer turns into one line, and as stray reports from the threads and
    coroutines that carried it (logged errors, "Exception ignored in
    <coroutine>", tensorstore callbacks hitting a closed event loop). Only the
    first is shown; every other error still reaches the default hooks.
    """
    # absl's handler joins the root logger only inside app.run, after this runs.
    for handler in {*logging.getLogger().handlers, absl_logging.get_absl_handler()}:
        handler.addFilter(_NoOrbaxErrors())
    default_unraisable, default_excepthook = sys.unraisablehook, sys.excepthook

    def unraisable(report):
        if not _from_checkpoint_io(report.exc_value, report.object):
            default_unraisable(report)

    def excepthook(exc_type, exc, tb):
        if not _from_checkpoint_io(exc):
            default_excepthook(exc_type, exc, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook


def run_training(configdict, workdir: str, cluster: distributed.ClusterOptions) -> int:
    """train.py: validates the config, joins the processes of ``cluster``, trains.

    Only process 0 prints the summary. Errors propagate to :func:`main`.
    """
    config = from_configdict(configdict)
    distributed.initialize(cluster)  # before anything touches the devices
    summary = training.train(config, workdir)
    if jax.process_index() != 0:
        return 0
    if summary["start_step"] == summary["step"] and summary.get("stopped_by") is None:
        print(f"already trained {summary['step']} steps; checkpoint: {summary['checkpoint_dir']}")
    elif summary.get("stopped_by") is None:
        print(
            f"trained {summary['step']} steps: loss {summary.get('loss', float('nan')):.4f}, "
            f"validation loss {summary.get('val_loss', float('nan')):.4f}"
        )
        print(f"checkpoint: {summary['checkpoint_dir']} (step {summary['step']})")
        print(f"next: python eval.py --workdir={workdir}")
    return 0


# --------------------------------------------------------------------------- eval.py


def parse_lengths(values) -> list[int] | None:
    """``--lengths`` strings → sorted positive ints; None or empty → None (the default)."""
    if not values:
        return None
    lengths = []
    for value in values:
        try:
            length = int(value)
        except ValueError:
            raise ValueError(f"--lengths={','.join(values)}: {value!r} is not an integer") from None
        if length <= 0:
            raise ValueError(f"--lengths: every length must be positive, got {length}")
        lengths.append(length)
    return sorted(set(lengths))


def load_run(workdir: str):
    """Latest good checkpoint of ``workdir`` with its own config: (config, params, step).

    Restores onto one device (the data-parallel mesh of one): evaluation and
    generation run the model unsharded.
    """
    import dataclasses
    import os

    import jax

    from lexjax import checkpoint as ckpt_lib
    from lexjax.config import MeshConfig
    from lexjax.steps import TrainSetup

    directory = os.path.join(os.path.abspath(workdir), "checkpoints")  # orbax needs absolute paths
    if not os.path.isdir(directory):
        raise ckpt_lib.CheckpointError(
            f"no checkpoint in {workdir} ({directory} does not exist); train first: "
            f"python train.py --workdir={workdir}"
        )
    checkpointer = ckpt_lib.Checkpointer(directory, read_only=True)
    try:
        stored = checkpointer.restore_config()
        if stored is None:
            raise ckpt_lib.CheckpointError(
                f"the latest checkpoint in {directory} has no config; "
                "it was not written by train.py"
            )
        config = from_configdict(stored)
        config = dataclasses.replace(config, mesh=MeshConfig(data=-1, fsdp=1, tensor=1))
        setup = TrainSetup(config, devices=jax.devices()[:1])
        state, _, step = checkpointer.restore(abstract_state=setup.abstract_state)
    finally:
        checkpointer.close()
    return config, state.params, int(step)


def _documents(config, eval_files: str | None, say):
    """(name, documents as token arrays) of the held-out text: the files of
    ``--eval_files`` or the run dataset's ``test`` split (``validation`` where
    the dataset has no test split)."""
    import os

    from lexjax import data as data_lib
    from lexjax.data.builders import glob_files

    if eval_files:
        root, relpaths = glob_files(eval_files)
        docs = []
        for rel in relpaths:
            with open(os.path.join(root, rel), "rb") as f:
                docs.append(data_lib.encode_document(f.read()))
        return f"{len(relpaths)} files of {eval_files}", docs
    d = config.data
    for split in ("test", "validation"):
        try:
            source = data_lib.load_source(
                d.name, split, data_dir=d.data_dir, files=d.files, text_feature=d.text_feature
            )
        except ValueError as e:
            if split == "validation":
                raise
            say(f"note: {e}; using the validation split")
            continue
        return f"{d.name} {split} split", [
            data_lib.as_document(source[i]) for i in range(len(source))
        ]


def _pick(documents, lengths, explicit: bool, max_docs: int, where: str, say):
    """Keeps lengths some document can serve (+1 token for the last target) and the
    first ``max_docs`` documents long enough for the largest of them."""
    longest = max((len(d) for d in documents), default=0)
    usable = [n for n in lengths if n + 1 <= longest]
    if len(usable) < len(lengths):
        dropped = [n for n in lengths if n not in usable]
        detail = (
            f"{where} has {len(documents)} documents, the longest {longest} tokens; "
            f"length {dropped[-1]} needs {dropped[-1] + 1}"
        )
        if explicit or not usable:
            raise ValueError(
                f"no document is long enough: {detail}; choose smaller --lengths "
                "or other --eval_files"
            )
        say(f"note: dropping lengths {', '.join(map(str, dropped))}: {detail}")
    chosen = [d for d in documents if len(d) >= usable[-1] + 1][:max_docs]
    return usable, chosen


class _ProgressLine:
    """A one-line progress indicator on a terminal (stderr); silent otherwise."""

    def __init__(self):
        import time

        self.tty = sys.stderr.isatty()
        self.clock = time.perf_counter
        self.t0 = self.clock()

    def __call__(self, done: int, total: int, label: str):
        if not self.tty:
            return
        width = 30
        filled = int(width * done / max(total, 1))
        rate = done / max(self.clock() - self.t0, 1e-9)
        print(
            f"\r[{'#' * filled}{'-' * (width - filled)}] {done}/{total} tokens {label} "
            f"{rate:,.0f} tok/s ",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def close(self):
        if self.tty:
            print(file=sys.stderr, flush=True)


def run_eval(
    workdir: str,
    *,
    lengths=None,
    bca: str = "both",
    eval_files: str | None = None,
    max_docs: int = 20,
    resolution: bool = False,
    figure: bool = False,
    generate: bool = False,
    prompt: str = "",
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> int:
    """eval.py: perplexity by length (and resolution, Figure 1) or generation.

    Writes ``WORKDIR/eval/perplexity.{json,png}`` (and ``resolution.json``,
    ``expectation.png``); user errors end in one line on stderr, exit status 1
    (2 for a bad flag value).
    """
    from lexjax import checkpoint as ckpt_lib
    from lexjax import evaluation

    quiet_checkpoint_io_noise()
    say = lambda message: print(message, file=sys.stderr, flush=True)
    if bca not in ("both", "on", "off"):
        fail(f"--bca={bca!r}: use both, on or off", 2)
    if max_docs < 1:
        fail(f"--max_docs={max_docs} must be positive", 2)
    try:
        requested = parse_lengths(lengths)
    except ValueError as e:
        fail(str(e), 2)
    try:
        config, params, step = load_run(workdir)
    except (ckpt_lib.CheckpointError, ConfigError) as e:
        fail(str(e).splitlines()[0])
    try:
        if generate:
            return _run_generate(
                config, params, prompt, max_new_tokens, temperature, top_k, top_p, seed
            )
        return _run_perplexity(
            config,
            params,
            step,
            workdir,
            requested,
            bca,
            eval_files,
            max_docs,
            resolution,
            figure,
            say,
        )
    except (evaluation.EvaluationError, ValueError, OSError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def _run_generate(config, params, prompt, max_new_tokens, temperature, top_k, top_p, seed):
    import jax
    import numpy as np

    from lexjax import data as data_lib
    from lexjax import generation
    from lexjax.model import Decoder

    tokens = np.concatenate([[data_lib.BOS], data_lib.encode(prompt)]).astype(np.int32)
    out = generation.generate(
        Decoder(config.model),
        params,
        tokens[None],
        block=config.block,
        max_new_tokens=max_new_tokens,
        rng=jax.random.key(seed),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    out = np.asarray(out[0])
    end = np.nonzero(out == data_lib.EOS)[0]
    if len(end):
        out = out[: end[0]]
    sys.stdout.write(prompt + data_lib.decode(out) + "\n")
    return 0


def _run_perplexity(
    config, params, step, workdir, requested, bca, eval_files, max_docs, resolution, figure, say
):
    import os

    from lexjax import evaluation, reports
    from lexjax.model import Decoder

    model = Decoder(config.model)
    train_len, position = config.train_len, config.model.position
    explicit = requested is not None
    lengths = requested or [m * train_len for m in (1, 2, 4, 8, 16)]
    where, documents = _documents(config, eval_files, say)
    lengths, chosen = _pick(documents, lengths, explicit, max_docs, where, say)
    modes = {"both": ["bca", "full"], "on": ["bca"], "off": ["full"]}[bca]
    out_dir = os.path.join(workdir, "eval")
    results = []
    for mode in modes:
        mode_lengths = lengths
        if mode == "full":
            mode_lengths = []
            for n in lengths:
                try:
                    evaluation.check_full_length(config.model, n)
                    mode_lengths.append(n)
                except evaluation.EvaluationError as e:
                    if bca == "off":
                        raise
                    say(f"note: skipping length {n} without BCA: {e}")
        if not mode_lengths:
            continue
        progress = _ProgressLine()
        try:
            results += evaluation.perplexity(
                model,
                params,
                chosen,
                mode_lengths,
                block=config.block,
                modes=[mode],
                progress=progress,
            )
        finally:
            progress.close()
    # Every length shares the largest's documents, so every cell scores the same tokens.
    print(
        f"perplexity of {workdir} (step {step}, position={position}, train_len={train_len}) "
        f"on {where}\n"
    )
    print(reports.perplexity_table(results, position))
    summary = reports.perplexity_json(
        results, train_len=train_len, position=position, step=step, source=where
    )
    reports.write_json(os.path.join(out_dir, "perplexity.json"), summary)
    reports.plot_perplexity(
        results,
        os.path.join(out_dir, "perplexity.png"),
        train_len=train_len,
        title=f"{position}, train_len {train_len}",
    )
    written = ["perplexity.json", "perplexity.png"]
    if resolution:
        _run_resolution(config, params, model, documents, modes, max_docs, where, out_dir, step)
        written.append("resolution.json")
    if figure:
        m = config.model
        reports.plot_expectation(
            os.path.join(out_dir, "expectation.png"),
            head_dim=m.head_dim,
            scale_base=m.scale_base,
            theta=m.theta,
            max_distance=max(8 * int(m.scale_base), 2 * train_len),
        )
        written.append("expectation.png")
    print(f"\nwrote {', '.join(os.path.join(out_dir, w) for w in written)}")
    return 0


def _run_resolution(config, params, model, documents, modes, max_docs, where, out_dir, step):
    import os

    import numpy as np

    from lexjax import evaluation, reports

    train_len = config.train_len
    longest = 2 * train_len
    chosen = [d for d in documents if len(d) >= longest][:max_docs]
    if not chosen:
        raise evaluation.EvaluationError(
            f"resolution needs documents of {longest} tokens; {where} has none "
            f"(longest {max((len(d) for d in documents), default=0)})"
        )
    results = []
    for mode in modes:
        for length in (train_len, longest):
            tokens = np.stack([d[:length] for d in chosen])
            try:
                results.append(
                    evaluation.measure_resolution(
                        model, params, tokens, block=config.block, mode=mode
                    )
                )
            except evaluation.EvaluationError as e:
                if len(modes) == 1:
                    raise
                print(
                    f"note: no resolution at length {length} without BCA: {e}",
                    file=sys.stderr,
                    flush=True,
                )
    print("\nattention resolution (paper eq. 3 with eq. 11)\n")
    print(reports.resolution_table(results, config.model.position))
    reports.write_json(
        os.path.join(out_dir, "resolution.json"),
        reports.resolution_json(
            results, train_len=train_len, position=config.model.position, step=step, source=where
        ),
    )
