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
from absl import flags as absl_flags
from absl import logging as absl_logging

from lexjax import api, distributed, evaluation, generation, passkey
from lexjax.config import ConfigError, from_configdict
from lexjax.errors import LexjaxError, one_line

__all__ = ["main", "parse_flags", "run_training", "run_eval", "parse_lengths"]


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


def parse_flags(argv: list[str]) -> list[str]:
    """absl ``flags_parser`` of a program without ``--config`` (eval.py): a bad flag is a
    one-line ConfigError (exit status 2), as :func:`lexjax.config.flags_parser` makes it."""
    try:
        return absl_flags.FLAGS(argv)
    except absl_flags.Error as e:
        raise ConfigError(one_line(e)) from None


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


def run_training(
    configdict, workdir: str, cluster: distributed.ClusterOptions, lease_timeout_s: float = 120.0
) -> int:
    """train.py: validates the config, joins the processes of ``cluster``, trains.

    Only process 0 prints the summary. Errors propagate to :func:`main`.
    """
    _check_workdir_flag(workdir)
    config = from_configdict(configdict)
    distributed.initialize(cluster)  # before anything touches the devices
    summary = api.train(config, workdir, lease_timeout_s=lease_timeout_s)
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


def _check_workdir_flag(workdir: str) -> None:
    if not workdir.strip():
        raise ConfigError("--workdir is empty; name the run's directory")


# --------------------------------------------------------------------------- eval.py

BCA_MODES = {"both": evaluation.MODES, "on": ("bca",), "off": ("full",)}


def parse_lengths(values) -> list[int] | None:
    """``--lengths`` strings → sorted positive ints; None (not given) → None (the default)."""
    if values is None:
        return None
    if not values:
        raise ConfigError("--lengths is empty; give lengths such as 256,1024 or leave it out")
    lengths = []
    for value in values:
        try:
            lengths.append(int(value))
        except ValueError:
            raise ConfigError(
                f"--lengths={','.join(values)}: {value!r} is not an integer"
            ) from None
        if lengths[-1] <= 0:
            raise ConfigError(f"--lengths: every length must be positive, got {lengths[-1]}")
    return sorted(set(lengths))


def run_eval(
    workdir: str,
    *,
    lengths=None,
    max_length: int | None = None,
    bca: str = "both",
    eval_files: str | None = None,
    max_docs: int = 20,
    resolution: bool = False,
    figure: bool = False,
    generate: bool = False,
    prompt: str = "",
    passkey_run: bool = False,
    passkey_depths=None,
    passkey_trials: int = 10,
    passkey_filler: str = "repeat",
    **sampling,
) -> int:
    """eval.py (run it through :func:`main`): perplexity by length, resolution and
    Figure 1 (:meth:`lexjax.api.Run.evaluate`), with ``generate`` a continuation
    of ``prompt`` on stdout (``sampling``: max_new_tokens, temperature, top_k,
    top_p, seed; :meth:`lexjax.api.Run.generate`), or with ``passkey_run``
    passkey retrieval (:meth:`lexjax.api.Run.passkey`; keys from ``seed``)."""
    _check_workdir_flag(workdir)
    if bca not in BCA_MODES:
        raise ConfigError(f"--bca={bca!r}: use both, on or off")
    if max_docs < 1:
        raise ConfigError(f"--max_docs={max_docs} must be positive")
    if max_length is not None and max_length < 1:
        raise ConfigError(f"--max_length={max_length} must be positive")
    if eval_files is not None and not eval_files.strip():
        raise ConfigError("--eval_files is empty; give a glob of text files or leave it out")
    requested = parse_lengths(lengths)
    generation.check_sampling(**sampling)  # also without --generate: a bad flag is never ignored
    depths = passkey.parse_depths(passkey_depths)
    passkey.check_settings(trials=passkey_trials, filler=passkey_filler)
    run = api.load(workdir)
    # Like train.py's; on stderr with --generate, whose stdout is the text alone.
    print(f"mesh {dict(run.mesh.shape)}", file=sys.stderr if generate else sys.stdout, flush=True)
    if generate:
        sys.stdout.write(prompt + run.generate(prompt, **sampling) + "\n")
        return 0
    if passkey_run:
        settings = dict(depths=depths, trials=passkey_trials, filler=passkey_filler)
        seed = sampling.get("seed", 0)
        run.passkey(requested, modes=BCA_MODES[bca], eval_files=eval_files, seed=seed, **settings)
        return 0
    run.evaluate(
        requested,
        max_length=max_length,
        modes=BCA_MODES[bca],
        eval_files=eval_files,
        max_docs=max_docs,
        resolution=resolution,
        figure=figure,
    )
    return 0
