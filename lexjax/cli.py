"""The boundary between the command-line programs and the library.

User errors (:class:`lexjax.errors.LexjaxError`) are reported by :func:`main` as one
line on stderr with their kind's exit status (:mod:`lexjax.errors`), never a traceback.
"""

from __future__ import annotations

import os
import shlex
import sys

import jax
from absl import flags as absl_flags

from lexjax import api, checkpoint, distributed, errors, evaluation, generation, passkey, signals
from lexjax import config as cfg
from lexjax.config import ConfigError, from_configdict
from lexjax.errors import report
from lexjax.progress import note

__all__ = ["main", "parse_flags", "run_training", "run_eval", "parse_lengths", "parse_modes"]


def main(program, *args, **kwargs) -> int:
    """Runs one program's body: the one place its user errors are caught.

    A :class:`lexjax.errors.LexjaxError` becomes ``error: <one line>`` on
    stderr and the exit status of its kind (see :mod:`lexjax.errors`).
    """
    checkpoint.quiet_background_errors()
    signals.redeliver_swallowed_interrupts()
    errors.plain_own_log_lines()
    return report(program, *args, **kwargs)


def parse_flags(argv: list[str]) -> list[str]:
    """absl ``flags_parser`` of a program without ``--config`` (eval.py): a bad flag is a
    one-line ConfigError (exit status 2), as :func:`lexjax.config.flags_parser` makes it."""
    cfg.exit_if_help(argv)
    try:
        return cfg.no_arguments(absl_flags.FLAGS(argv))
    except (absl_flags.Error, ValueError) as e:  # (absl's ValueError: --noresolution=x)
        raise cfg.flag_error(e) from None


@errors.naming_flags()  # the library's messages name train.py's flags
@errors.stdout_failures(to_stderr=True)  # a closed stdout (`| tee` after Ctrl-C) loses no step
def run_training(
    configdict, workdir: str, cluster: distributed.ClusterOptions, lease_timeout_s: float
) -> int:
    """train.py: validates the config, joins the processes of ``cluster``, trains.

    Only process 0 prints the summary. Errors propagate to :func:`main`.
    """
    _check_workdir_flag(workdir)
    config = from_configdict(configdict)
    distributed.initialize(cluster)  # before anything touches the devices
    settings = {"--workdir": os.path.abspath(workdir), **cfg.dotted(cfg.to_dict(config))}
    distributed.check_same_settings(settings, "train.py")
    summary = api.train(config, workdir, lease_timeout_s=lease_timeout_s)
    if jax.process_index() != 0 or summary.get("stopped_by") is not None:
        return 0
    start, step, where = summary["start_step"], summary["step"], summary["checkpoint_dir"]
    if start == step:
        print(f"already trained {errors.counted(step, 'step')}; checkpoint: {where}")
    else:  # after a resume: the steps this run trained, and from where to where
        loss, val_loss = (summary.get(key, float("nan")) for key in ("loss", "val_loss"))
        steps = errors.counted(step - start, "step") + f" ({start} → {step})" * bool(start)
        print(f"trained {steps}: loss {loss:.4f}, validation loss {val_loss:.4f}")
        print(f"checkpoint: {where} (step {step})")
    print(f"next: python eval.py --workdir={shlex.quote(workdir)}")
    return 0


def _check_workdir_flag(workdir: str) -> None:
    if not workdir.strip():
        raise ConfigError("--workdir is empty; name the run's directory")


# --------------------------------------------------------------------------- eval.py

BCA_MODES = {"both": ("bca", "full"), "on": ("bca",), "off": ("full",)}
_SAMPLED = {"prompt", *generation.SAMPLING}  # the flags of --generate, of --passkey:
_KEYED = {"passkey_depths", "passkey_trials", "passkey_filler"}


def parse_modes(values, bca="both", allowed=evaluation.MODES, run="") -> tuple[str, ...]:
    """``--modes`` (some of ``allowed``, for ``run``; None: not given), else ``--bca`` → modes."""
    if bca not in BCA_MODES:
        raise ConfigError(f"--bca={bca!r}: use both, on or off")
    if values is None:
        return BCA_MODES[bca]
    if bca != "both":
        raise ConfigError(f"--modes and --bca={bca} both choose modes; give --modes alone")
    with errors.naming_flags():
        try:
            return evaluation.check_modes(values, allowed=allowed)
        except ConfigError as e:
            raise ConfigError(f"{e}{run and f' with {run}'}") from None


def parse_lengths(values) -> list[int] | None:
    """``--lengths`` strings → ints (checked by :func:`lexjax.evaluation.check_settings`)."""
    for value in values or ():
        try:
            int(value)
        except ValueError:
            message = f"--lengths={','.join(values)}: {value!r} is not an integer"
            raise ConfigError(message) from None
    return None if values is None else [int(value) for value in values]


@errors.naming_flags()  # the library's messages name eval.py's flags
def run_eval(
    workdir: str,
    *,
    lengths=None,
    max_length: int | None = None,
    bca: str = "both",
    modes=None,
    sinks: int = evaluation.DEFAULT_SINKS,
    eval_files: str | None = None,
    max_docs: int = evaluation.DEFAULT_MAX_DOCS,
    resolution: bool = False,
    figure: bool = False,
    generate: bool = False,
    prompt: str = "",
    rope_scaling: str = "none",
    rope_factor: float = 0.0,
    passkey_run: bool = False,
    passkey_depths=None,
    passkey_trials: int = passkey.DEFAULT_TRIALS,
    passkey_filler: str = passkey.FILLERS[0],
    cluster: distributed.ClusterOptions | None = None,
    **sampling,
) -> int:
    """eval.py (run it through :func:`main`): perplexity by length, resolution and Figure 1
    (:meth:`lexjax.api.Run.evaluate`; ``rope_scaling``/``rope_factor``: an inference-time
    RoPE extension), with ``generate`` a continuation of ``prompt`` on stdout (``sampling``:
    max_new_tokens, temperature, top_k, top_p, seed; :meth:`lexjax.api.Run.generate`), or
    with ``passkey_run`` passkey retrieval (:meth:`lexjax.api.Run.passkey`; keys from
    ``seed``). Joins ``cluster``'s processes first: all compute, process 0 alone speaks."""
    _check_workdir_flag(workdir)
    if generate and passkey_run:
        raise ConfigError("--generate and --passkey are two different runs; give one of them")
    modes_given = modes is not None or bca != "both"
    run = "--generate" if generate else "--passkey" if passkey_run else ""
    modes = parse_modes(modes, bca, generation.MODES if run else evaluation.MODES, run)
    requested = evaluation.check_settings(
        parse_lengths(lengths), max_length, sinks=sinks, max_docs=max_docs, eval_files=eval_files
    )
    cfg.check_rope_scaling(rope_scaling, rope_factor, names=("--rope_scaling", "--rope_factor"))
    # Each run refuses the flags given (not at their defaults) that it would ignore.
    given = dict(rope_scaling=rope_scaling != "none", max_length=max_length is not None)
    given.update(resolution=resolution, figure=figure, eval_files=eval_files is not None)
    given.update(max_docs=max_docs != evaluation.DEFAULT_MAX_DOCS, lengths=lengths is not None)
    given.update(sinks=sinks != evaluation.DEFAULT_SINKS, prompt=prompt != "")
    given.update({k: v != generation.SAMPLING[k] for k, v in sampling.items()})
    given.update(passkey_depths=passkey_depths is not None)
    given.update(passkey_trials=passkey_trials != passkey.DEFAULT_TRIALS)
    given.update(passkey_filler=passkey_filler != passkey.FILLERS[0])
    verb, uses = "eval.py without --generate or --passkey", set(given) - _SAMPLED - _KEYED
    if generate:
        modes = modes if modes_given else ("bca",)  # generation's default: with BCA
        if len(modes) != 1 or modes[0] not in generation.MODES:
            raise ConfigError(
                f"--generate decodes in one mode (--bca=on or off), not {','.join(modes)}"
            )
        t, greedy = sampling.get("temperature", 1.0), generation.is_greedy
        verb = f"--generate with --temperature={t:g} (greedy)" if greedy(t) else "--generate"
        uses = _SAMPLED - ({"top_k", "top_p", "seed"} if greedy(t) else set())
    if passkey_run:  # uses --lengths, and --eval_files and --max_docs with held-out text
        text = passkey_filler == "text"
        verb = "--passkey" + ("" if text else " with --passkey_filler=repeat")
        uses = {"lengths", "seed", *_KEYED, *(("eval_files", "max_docs") if text else ())}
    if not (generate or passkey_run):
        evaluation.check_modes(modes, sinks=sinks, resolution=resolution)
    if names := [f"--{name}" for name, value in given.items() if value and name not in uses]:
        them = "it" if len(names) == 1 else "them"
        raise ConfigError(f"{verb} does not use {', '.join(names)}; leave {them} out")
    generation.check_sampling(prompt=prompt, **sampling)  # a bad flag is never ignored
    depths = passkey.parse_depths(passkey_depths)
    keyed = dict(modes=modes, lengths=requested) if passkey_run else {}
    passkey.check_settings(trials=passkey_trials, filler=passkey_filler, **keyed)
    distributed.initialize(cluster or distributed.ClusterOptions())  # before any device use
    flags = dict(lengths=lengths, max_length=max_length, bca=bca, modes=modes, sinks=sinks)
    flags.update(eval_files=eval_files, max_docs=max_docs, resolution=resolution, figure=figure)
    flags.update(generate=generate, prompt=prompt, rope_scaling=rope_scaling)
    flags.update(rope_factor=rope_factor, passkey=passkey_run, passkey_depths=passkey_depths)
    flags.update(passkey_trials=passkey_trials, passkey_filler=passkey_filler, **sampling)
    flags = {f"--{name}": value for name, value in flags.items()}
    distributed.check_same_settings({"--workdir": os.path.abspath(workdir), **flags}, "eval.py")
    with distributed.first_process_speaks(), errors.stdout_failures():
        check = None
        if "sinks" in modes and not (generate or passkey_run):  # refused before loading
            check = lambda config: evaluation.sink_window(config.block, sinks)
        if generate:  # a length mode full cannot reach, too
            new = sampling.get("max_new_tokens", generation.SAMPLING["max_new_tokens"])
            check = lambda config: generation.check_stored_run(config, prompt, new, modes[0])
        run = api.load(workdir, check=check)
        mesh = f"mesh {dict(run.mesh.shape)}"  # as train.py's; --generate's stdout is its text:
        if generate:  # the mesh a note on stderr (which may fail), then the text as it comes
            note(mesh)
            sampling.update(progress=not sys.stdout.isatty())  # (a terminal's text: progress)
            generation.print_continuation(
                prompt, lambda show: run.generate(prompt, mode=modes[0], on_text=show, **sampling)
            )
            return 0
        print(mesh, flush=True)
        if passkey_run:
            settings = dict(depths=depths, trials=passkey_trials, filler=passkey_filler)
            settings.update(eval_files=eval_files, seed=sampling.get("seed", 0))
            settings.update(max_docs=max_docs if passkey_filler == "text" else None)
            run.passkey(requested, modes=modes, **settings)
            return 0
        settings = dict(max_length=max_length, modes=modes, sinks=sinks, eval_files=eval_files)
        settings.update(max_docs=max_docs, resolution=resolution, figure=figure)
        run.evaluate(requested, rope_scaling=rope_scaling, rope_factor=rope_factor, **settings)
        return 0
