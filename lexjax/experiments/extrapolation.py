"""The paper's length-extrapolation experiment (Tables 2–5; Figure 1), resumable.

    python -m lexjax.experiments.extrapolation --out=runs/extrapolation
    python -m lexjax.experiments.extrapolation --out=DIR --config=configs/extrapolation.py:paper

Flags: ``--out=DIR``, ``--config=FILE[:PRESET]`` (default configs/extrapolation.py)
and ``--config.FIELD=VALUE``; ``--helpfull`` lists every flag.

The configuration (``configs/extrapolation.py``) holds one training config
shared by every run and a list of runs that differ only in position encoding,
XPOS scale_base and seed. Each run is trained, then evaluated at every
length of ``multipliers × train_len`` with BCA and without, and its attention
resolution is measured at 1× and 2× train_len (paper Table 3).

Layout of ``OUT``::

    runs/<run>/                     train.py workdir: checkpoints/, metrics.jsonl
    runs/<run>/train_started.json   its training config and the seconds trained so far,
                                    written when its training starts
    runs/<run>/train.json           written when its training has finished
    runs/<run>/perplexity_bca.json, perplexity_full.json, perplexity_sinks.json,
                perplexity_full_<scaling>.json (RoPE scalings), resolution.json, passkey.json
    table2.md table3.md table4.md table5.md scalings.md passkey.md seeds.md
    results.json summary.md perplexity.png scalings.png passkey.png figure1.png
    scores.png timing.json

Every stage writes its file when it completes, and a stage whose file exists
is skipped, so running the command again continues where it stopped (an
interrupted training resumes from its checkpoint). A stage's file records the
training config it belongs to; a different config in the same ``OUT`` is
refused rather than mixed, also for a training that has started but not finished.
An evaluation stage's file also records what it was measured with (documents,
lengths, sinks, passkey settings): with other evaluation settings it is measured
again, its training kept.

SIGTERM or Ctrl-C during a training finishes its step, saves and stops the
study, exit status 0; a SIGTERM elsewhere stops it at once, also with 0 (SIGHUP,
a closed terminal, is a SIGTERM, unless ignored as under ``nohup``); a
Ctrl-C elsewhere ends it with ``interrupted (Ctrl-C)`` (status 130). Each is
recorded in ``timing.json``, and the same command resumes.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX loads, as train.py does
    from lexjax import errors, hugepages, signals

    errors.closed_std_streams_to_devnull()  # before anything opens a file
    hugepages.reexec_with_hugepages()  # see lexjax/hugepages.py
    signals.defer()  # a stop while JAX loads ends the study at its start (SIGTERM: exit 0)

import contextlib
import dataclasses
import fractions
import hashlib
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from lexjax import checkpoint, distributed, evaluation, generation, lease, passkey, reports, signals
from lexjax import data as data_lib
from lexjax.config import (
    ROPE_SCALINGS,
    ROTARY_ENCODINGS,
    Config,
    ConfigError,
    dotted,
    from_configdict,
    to_dict,
    upgraded,
)
from lexjax.errors import CheckpointError, TrainingError, counted, one_line, stdout_failures
from lexjax.evaluation import MODES
from lexjax.model import Decoder

__all__ = ["ExperimentError", "RunSpec", "parse_runs", "eval_lengths", "run_experiment"]

# The evaluation protocol of the stage files. 2: every cell scores the same tokens of
# one budget, and resolution is also given at equal N. Evaluations written by another
# protocol are redone when the command runs again; trainings are kept.
PROTOCOL = 2
# The passkey stage's protocol: 3 adds the key's teacher-forced nats (answer_nats).
PASSKEY = 3


class ExperimentError(ConfigError):
    """The experiment cannot run as configured; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training of the experiment: what differs from the shared training config."""

    position: str
    scale_base: float
    seed: int

    @property
    def name(self) -> str:
        """Directory name, complete whatever the defaults: ``xpos_b64_s0``, ``rope_s1``."""
        base = f"{self.position}_b{self.scale_base:g}" if self.position == "xpos" else self.position
        return f"{base}_s{self.seed}"

    @property
    def variant(self) -> tuple[str, float | None]:
        """What a table row stands for; seeds of one variant are pooled."""
        return self.position, self.scale_base if self.position == "xpos" else None


def parse_runs(text: str, *, scale_base: float, seed: int) -> list[RunSpec]:
    """``"rope/seeds=3,xpos/b=512,xpos/seed=1"`` → run specs (see configs/extrapolation.py);
    ``/seeds=N`` stands for N runs with seeds S … S+N−1 (S: ``/seed=``, default ``seed``)."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        position, *options = item.split("/")
        values = {"b": scale_base, "seed": seed, "seeds": 1}
        for option in options:
            key, _, value = option.partition("=")
            if key not in values or not value:
                raise ExperimentError(
                    f"runs: {item!r}: options are /b=NUMBER, /seed=INTEGER and /seeds=COUNT"
                )
            try:
                values[key] = float(value) if key == "b" else int(value)
            except ValueError:
                raise ExperimentError(f"runs: {item!r}: {value!r} is not a number") from None
        if position != "xpos" and values["b"] != scale_base:
            raise ExperimentError(f"runs: {item!r}: /b= applies to xpos only")
        if values["seeds"] < 1:
            raise ExperimentError(f"runs: {item!r}: /seeds= must be at least 1")
        for offset in range(values["seeds"]):
            spec = RunSpec(position, values["b"], values["seed"] + offset)
            if spec in specs:
                raise ExperimentError(f"runs: {item!r} repeats run {spec.name}")
            specs.append(spec)
    if not specs:
        raise ExperimentError("runs is empty; list positions such as 'rope,xpos'")
    return specs


def eval_lengths(multipliers: str, train_len: int, field: str = "multipliers") -> list[int]:
    """``"0.25,1,2"`` × train_len → sorted integer lengths; each product must be a whole
    number, computed exactly (1.1 × 100 is 110, where floats give 110.00000000000001)."""
    lengths = []
    for item in filter(None, (part.strip() for part in multipliers.split(","))):
        try:
            value = fractions.Fraction(item) * train_len
        except (ValueError, ZeroDivisionError):
            raise ExperimentError(f"{field}: {item!r} is not a number") from None
        if value < 1 or value.denominator != 1:
            raise ExperimentError(
                f"{field}: {item} × train_len {train_len} = {float(value):g} is "
                "not a positive whole number of tokens"
            )
        lengths.append(int(value))
    if not lengths:
        raise ExperimentError(f"{field} is empty; e.g. '1,2,4'")
    return sorted(set(lengths))


def _run_config(shared: dict, spec: RunSpec) -> Config:
    values = _plain(shared)
    values["model"].update(position=spec.position, scale_base=spec.scale_base)
    values["seed"] = spec.seed
    try:
        return from_configdict(values)
    except ConfigError as e:
        raise ExperimentError(f"run {spec.name}: {e}") from None


def _plain(value):
    """``value`` as JSON reads it back (tuples become lists): what a file compares equal to."""
    return json.loads(json.dumps(value))


# Training settings that change no number the study reports: how often it logs and
# saves, how many checkpoints it keeps, what it does with a damaged one.
_BOOKKEEPING = ("log_every", "checkpoint_every", "keep_checkpoints", "on_corrupt_checkpoint")


def _stage_done(
    path: str, config: Config, *, protocol: int | None = None, measured: dict | None = None
) -> dict | None:
    """The stage's stored result if it exists and belongs to ``config``; refuses another
    config. A result of another evaluation ``protocol``, or of other evaluation
    settings than ``measured`` (documents, lengths, sinks, passkey trials, ...), is
    not done: it is redone, so the reports never state settings their numbers were
    not measured with."""
    if not os.path.exists(path):
        return None
    try:
        stored = reports.read_json(path)
    except (OSError, ValueError) as e:  # damaged outside the study (its writes are atomic)
        if protocol is not None:  # a measurement: made again, and its file replaced
            return None
        raise ExperimentError(
            f"cannot read {path} ({one_line(e)}); remove it to train that run again from its "
            "checkpoints, or use a new --out"
        ) from None
    ours = _plain(to_dict(config))
    theirs = upgraded(stored.get("config") or {})  # no note of a removed field: not the user's
    with contextlib.suppress(ConfigError):  # today's form: fields added since take defaults
        theirs = _plain(to_dict(from_configdict(theirs)))
    for name in _BOOKKEEPING:  # a resume may change them: no reported number depends on them
        ours.pop(name, None)
        theirs.pop(name, None)
    if theirs != ours:
        ours_flat, theirs_flat = dotted(ours), dotted(theirs)
        keys = set(ours_flat) | set(theirs_flat)
        diff = sorted(k for k in keys if ours_flat.get(k) != theirs_flat.get(k))
        shown = [f"{k}: {theirs_flat.get(k)!r} there, {ours_flat.get(k)!r} now" for k in diff]
        raise ExperimentError(
            f"{path} was written for another training config (differs in "
            f"{'; '.join(shown[:3])}{'; …' * (len(shown) > 3)}); use a new --out or the "
            "same config"
        )
    if protocol not in (None, stored.get("protocol")):
        return None
    if measured is not None and _plain(_recorded(stored, measured)) != _plain(measured):
        return None
    return stored


def _recorded(stored: dict, measured: dict) -> dict:
    """The evaluation settings a stage file was measured with. Files written before
    they were recorded hold some at the top or in their results (max_length, sinks,
    documents, the passkey settings); the rest are taken as unchanged."""
    if "measured" in stored:  # a setting recorded since (the corpus) is taken as unchanged
        return {k: stored["measured"].get(k, v) for k, v in measured.items()}
    first = (stored.get("results") or [{}])[0]
    return {k: stored.get(k, first.get(k, v)) for k, v in measured.items()}


def machine() -> dict:
    """What the numbers were measured on (CPU model, usable cores, JAX devices)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = jax.devices()[0]
    return {
        "cpu": model,
        "cores": cores,
        "backend": jax.default_backend(),
        "devices": f"{jax.device_count()} × {device.device_kind}",
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def _train_stage(spec, config, workdir, log) -> dict | None:
    """Trains (or resumes) one run; None when a signal stopped it before the last step.

    ``train_started.json`` holds the config the training started with, so a resumed
    training under another config is refused as a finished one is (once it has
    saved a step), and the seconds of its earlier invocations, which ``train.json``
    adds to its own."""
    from lexjax import training  # the trainer's imports stay off evaluation-only runs

    path = os.path.join(workdir, "train.json")
    done = _stage_done(path, config)
    if done is not None:
        log(f"[{spec.name}] trained already ({counted(done['summary']['step'], 'step')})")
        return done
    started_path = os.path.join(workdir, STARTED)
    earlier = _earlier_training(started_path, config, workdir)
    log(
        f"[{spec.name}] training {counted(config.num_train_steps, 'step')} of "
        f"{config.batch_size}×{config.train_len} tokens"
    )

    def started(seconds: float) -> None:
        record = {"config": to_dict(config), "run": spec.name, "seconds": seconds}
        reports.write_json(started_path, record)

    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"run {spec.name}: cannot make {workdir} ({e.strerror})") from None
    started(earlier)
    start, finished = time.perf_counter(), False
    try:
        summary = training.train(config, workdir, log=log)
        finished = not summary.get("stopped_by")
    except (TrainingError, CheckpointError) as e:
        raise _run_error(spec, e) from None
    finally:
        seconds = earlier + time.perf_counter() - start
        if not finished:  # this invocation's seconds, for the one that finishes
            started(seconds)
    if not finished:
        return None
    summary.pop("checkpoint_dir", None)
    record = {
        "config": to_dict(config),
        "run": spec.name,
        "summary": summary,
        "tokens": summary["step"] * config.batch_size * config.train_len,
        "seconds": seconds,
    }
    reports.write_json(path, record)
    return reports.read_json(path)


# Written when a run's training starts (see _train_stage).
STARTED = "train_started.json"


def _refuse_another_config(out: str, shared: dict, listed: dict[str, Config]) -> None:
    """Before anything is trained: every run under ``OUT/runs``, finished or started
    (with a saved step), was trained under the config it gets now, ``listed[name]``,
    or, for a run not listed, under ``shared`` with its own position, b and seed
    (and a scale_base it does not use, if not XPOS); else :func:`_stage_done`'s
    ExperimentError. Checked only as each run came up, a changed config trained the
    runs before the first old one, and with no old run listed it wrote its tables
    over the study's. A record that cannot be read is named."""
    runs = os.path.join(out, "runs")
    for name in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
        workdir = os.path.join(runs, name)
        for path in (os.path.join(workdir, "train.json"), os.path.join(workdir, STARTED)):
            if not os.path.isfile(path) or not (
                path.endswith("train.json") or checkpoint.has_steps(workdir)
            ):
                continue
            try:
                record = reports.read_json(path)
                stored = upgraded(record.get("config") or {})
                model = stored.get("model") or {}
                spec = RunSpec(
                    model.get("position", shared["model"]["position"]),
                    model.get("scale_base", shared["model"]["scale_base"]),
                    stored.get("seed", shared["seed"]),
                )
            except (OSError, ValueError, AttributeError) as e:
                raise ExperimentError(
                    f"cannot read {path} ({one_line(e)}); remove that run's directory or "
                    "use a new --out"
                ) from None
            _stage_done(path, listed[name] if name in listed else _run_config(shared, spec))
            break


def _earlier_training(path: str, config: Config, workdir: str) -> float:
    """The seconds trained by earlier invocations of a run whose training has not
    finished; refuses another config once the run has saved a step. Without a saved
    step nothing of the earlier config is kept: its record is replaced, and its
    seconds, which made nothing that is kept, are not counted."""
    if not os.path.exists(path):
        return 0.0
    if not checkpoint.has_steps(workdir):
        return 0.0
    stored = _stage_done(path, config)  # raises ExperimentError for another config
    return float(stored.get("seconds", 0.0))


@contextlib.contextmanager
def _only_study(out: str):
    """Holds ``OUT/.study.lock`` (an flock, released however the process ends); a
    second study on ``out`` is refused at once, in one line (exit 4)."""
    try:
        lock = lease.open_lock(os.path.join(out, ".study.lock"))
    except OSError as e:
        raise CheckpointError(
            f"cannot write in --out {out} ({e.strerror}); choose another directory"
        ) from None
    with lock:
        if lease.try_flock(lock) is False:  # None: no flock here, unlocked as before
            raise CheckpointError(
                f"another study is writing --out {out}; wait for it to finish or use another --out"
            )
        yield


def _run_error(spec: RunSpec, error: Exception) -> Exception:
    """A run's CheckpointError or TrainingError, its kind (exit status) kept, in the
    study's terms: its workdir is OUT/runs/<run>, which the study has no flag for."""
    text = one_line(error, limit=4000)
    if isinstance(error, CheckpointError) and " is in use by " in text:
        text = (
            f"{text.split('; ')[0]}: another study (or train.py) is writing this --out; "
            "wait for it to finish or use another --out"
        )
    else:
        for what in ("another", "a new", "a writable", "a directory for"):
            text = text.replace(f"{what} workdir", f"{what} --out")
    return type(error)(f"run {spec.name}: {text}")


def evaluations(exp, spec: RunSpec, specs: list[RunSpec]) -> list[tuple[str, str, str]]:
    """The perplexity evaluations of one run of the study's ``specs``: ``[(key, mode,
    rope_scaling)]``. Every run is evaluated in each of ``modes``; the lowest
    ``scaling_seeds`` seeds of each rotary variant (RoPE, XPOS with its b) also with each
    RoPE extension of ``scalings``, without BCA (with BCA no position reaches train_len,
    so an extension has nothing to extend). The seeds are the variant's own: with
    ``rope/seed=4/seeds=2`` and ``scaling_seeds`` 1, seed 4."""
    modes = _names(exp.get("modes", "bca,full"), "modes", MODES, required=True)
    keys = [(mode, mode, "none") for mode in modes]
    scalings = _names(exp.get("scalings", ""), "scalings", ROPE_SCALINGS)
    seeds = sorted(s.seed for s in specs if s.variant == spec.variant)
    first = spec.seed in seeds[: max(0, int(exp.get("scaling_seeds", 1)))]
    if spec.position in ROTARY_ENCODINGS and first:
        keys += [(f"full+{s}", "full", s) for s in scalings if s != "none"]
    return keys


def _names(text: str, field: str, allowed, *, required: bool = False, why: str = "") -> list[str]:
    """The comma-separated names of ``text``, each one of ``allowed``; with ``required``
    at least one (``why``: what requires it)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ExperimentError(f"{field}: {unknown[0]!r} is not one of {', '.join(allowed)}")
    if required and not names:
        raise ExperimentError(f"{field} is empty{why}; list some of {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def _check_scalings(exp, specs: list[RunSpec], lengths: list[int], train_len: int) -> None:
    """A RoPE extension is evaluated at the lengths from train_len on (below it its
    factor is 1): refuses scalings that apply to some run when no length reaches it."""
    runs = {}
    for spec in specs:
        for _, _, scaling in evaluations(exp, spec, specs):
            if scaling != "none":
                runs.setdefault(scaling, []).append(spec.name)
    if runs and lengths[-1] < train_len:
        names = sorted({name for names in runs.values() for name in names})
        raise ExperimentError(
            f"scalings {', '.join(runs)} (evaluated on {', '.join(names)}) are measured at "
            f"lengths of at least train_len {train_len}, and multipliers {exp['multipliers']} "
            "give none; add a multiplier of at least 1, or set scalings= (none)"
        )


def _load_run(spec, workdir: str, plan: dict):
    """``(config, params, step)`` of a trained run, refused when the run trained on
    another build of the corpus than its files make now (its held-out split may then
    hold text it trained on, and its numbers would not compare with the others')."""
    try:
        loaded = checkpoint.load_params_and_tokenizer(workdir)
    except CheckpointError as e:
        raise _run_error(spec, e) from None
    if None not in (loaded.corpus, plan["corpus"]) and loaded.corpus != plan["corpus"]:
        raise ExperimentError(
            f"run {spec.name} trained on the corpus build {loaded.corpus}, and its files make "
            f"{plan['corpus']} now: they changed since; restore them, or use a new --out"
        )
    return loaded.config, loaded.params, loaded.step


def _eval_stage(spec, config, workdir, plan, log) -> None:
    """Perplexity per evaluation (:func:`evaluations`) and attention resolution of one
    trained run, each stage once."""
    docs = plan["documents"][: plan["docs"]["perplexity"]]
    shared = {"eval_split": plan["eval_split"]}
    measured_perplexity = lambda mode: {
        **shared,
        "corpus": plan["corpus"],
        "lengths": list(plan["lengths"]),
        "max_length": plan["max_length"],
        "documents": len(docs),
        **({"sinks": plan["sinks"]} if mode == "sinks" else {}),
    }
    # Which documents resolution measures depends on the longest evaluated length (the
    # plan's documents have all of it): the tokens it reads are recorded.
    chosen = evaluation.resolution_documents(
        plan["documents"],
        config.train_len,
        max_docs=plan["docs"]["resolution"],
        where=f"the {plan['eval_split']} split",
    )
    measured_resolution = {
        **shared,
        "corpus": plan["corpus"],
        "resolution_docs": plan["docs"]["resolution"],
        "documents": len(chosen),
        "tokens": _digest(chosen, 2 * config.train_len),
    }

    def done(path, measured):
        return _stage_done(path, config, protocol=PROTOCOL, measured=measured) is not None

    todo = [
        e
        for e in plan["evaluations"](spec)
        if not done(_perplexity_path(workdir, e[0]), measured_perplexity(e[1]))
    ]
    resolution_path = os.path.join(workdir, "resolution.json")
    measure_resolution = not done(resolution_path, measured_resolution)
    if not todo and not measure_resolution:
        log(f"[{spec.name}] evaluated already")
        return
    stored_config, params, step = _load_run(spec, workdir, plan)
    model = Decoder(stored_config.model)
    say = lambda message: log(f"[{spec.name}] {message}")

    def write(path, start, results, **extra):
        record = {"config": to_dict(config), "run": spec.name, "step": step, **extra}
        record["protocol"] = PROTOCOL
        record["seconds"] = time.perf_counter() - start
        reports.write_json(path, {**record, "results": [r.as_dict() for r in results]})

    for key, mode, scaling in todo:
        say(f"perplexity {key}: {counted(len(docs), 'document')} × {plan['max_length']} tokens")
        start = time.perf_counter()
        scaled = dataclasses.replace(stored_config.model, rope_scaling=scaling, rope_factor=0.0)
        results = evaluation.perplexity(
            model if scaling == "none" else Decoder(scaled),
            params,
            docs,
            # An extension changes nothing below train_len (its factor is 1 there).
            [n for n in plan["lengths"] if scaling == "none" or n >= config.train_len],
            block=config.block,
            max_length=plan["max_length"],
            modes=[mode],
            sinks=plan["sinks"],
            strict=False,
            say=say,
            tokens_per_batch=plan["tokens_per_batch"],
            tokenizer=plan["tokenizer"],
        )
        for r in results:
            say(f"  {key} {r.length:>6}: perplexity {r.perplexity:.4f} ({r.seconds:.0f} s)")
        extra = {"mode": mode, "rope_scaling": scaling, "sinks": plan["sinks"]}
        extra["measured"] = measured_perplexity(mode)
        write(
            _perplexity_path(workdir, key), start, results, max_length=plan["max_length"], **extra
        )
    if measure_resolution:
        start = time.perf_counter()
        results = evaluation.resolution_protocol(
            model,
            params,
            chosen,
            train_len=config.train_len,
            block=config.block,
            max_docs=plan["docs"]["resolution"],
            say=say,
        )
        for r in results:
            say(f"  resolution {r.mode} {r.length}: {r.mean:.3g}")
        write(resolution_path, start, results, measured=measured_resolution)


def _digest(documents, length: int) -> str:
    """A digest of the first ``length`` tokens of each of ``documents``, in order."""
    h = hashlib.sha256()
    for d in documents:
        h.update(np.asarray(d[:length], dtype=np.int64).tobytes())
        h.update(b"\0")
    return f"sha256:{h.hexdigest()[:16]}"


def _passkey_stage(spec, config, workdir, plan, log) -> None:
    """Passkey retrieval of one trained run (lexjax.passkey) by length, depth and mode."""
    settings = plan["passkey"]
    path = os.path.join(workdir, "passkey.json")
    if settings is None:
        return
    if _stage_done(path, config, protocol=PASSKEY, measured=settings) is not None:
        return
    stored_config, params, step = _load_run(spec, workdir, plan)
    say = lambda message: log(f"[{spec.name}] {message}")
    say(
        f"passkey: lengths {settings['lengths']}, depths {settings['depths']}, "
        f"{settings['trials']} keys each"
    )
    start = time.perf_counter()
    results = passkey.passkey_accuracy(
        Decoder(stored_config.model),
        params,
        block=config.block,
        lengths=settings["lengths"],
        depths=settings["depths"],
        trials=settings["trials"],
        modes=settings["modes"],
        tokenizer=plan["tokenizer"],
        seed=settings["seed"],
        tokens_per_batch=plan["tokens_per_batch"],
        strict=False,
        say=say,
    )
    for mode in settings["modes"]:
        cells = [r for r in results if r.mode == mode]
        by_length = {n: [r.accuracy for r in cells if r.length == n] for n in settings["lengths"]}
        shown = ", ".join(f"{n}: {sum(a) / len(a):.2f}" for n, a in by_length.items() if a)
        say(f"  passkey {mode}: {shown}")
    # The cells passkey_accuracy skipped, with why (as eval.py's passkey.json lists them):
    # the report's "–" cells said nothing of it.
    skipped = passkey.skipped_cells(
        stored_config.model, settings["modes"], settings["lengths"], plan["tokenizer"], config.block
    )
    record = {"config": to_dict(config), "run": spec.name, "step": step, "protocol": PASSKEY}
    record.update(settings, seconds=time.perf_counter() - start, skipped=skipped)
    reports.write_json(path, {**record, "results": [r.as_dict() for r in results]})


def _passkey_plan(exp, train_len: int) -> dict | None:
    """The passkey settings of the study, or None when ``passkey_trials`` is 0."""
    trials = int(exp.get("passkey_trials", 0))
    if trials == 0:
        return None
    if trials < 0:
        raise ExperimentError(f"passkey_trials={trials} must be 0 (off) or positive")
    lengths = eval_lengths(
        exp.get("passkey_multipliers", "1,2,4,8"), train_len, "passkey_multipliers"
    )
    try:  # sorted, once each, as passkey_accuracy measures them: "1,0" is "0,1"'s stage
        text = exp.get("passkey_depths", "0,0.5,1")
        depths = sorted({float(d) for d in text.split(",") if d.strip()})
    except ValueError:
        raise ExperimentError(f"passkey_depths={text!r}: not numbers") from None
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise ExperimentError(f"passkey_depths={text!r}: use numbers in [0, 1]")
    modes = _names(
        exp.get("passkey_modes", "bca,full"),
        "passkey_modes",
        generation.MODES,
        required=True,
        why=f" (passkey_trials={trials}; 0 measures no passkey)",
    )
    return {
        "lengths": lengths,
        "depths": depths,
        "trials": trials,
        "modes": [mode for mode in generation.MODES if mode in modes],  # "full,bca" is "bca,full"
        "seed": 0,
        "chance_nats": passkey.CHANCE_NATS,
    }


def _perplexity_path(workdir: str, key: str) -> str:
    """``perplexity_bca.json``, ``perplexity_full_yarn.json``, ..."""
    return os.path.join(workdir, f"perplexity_{key.replace('+', '_')}.json")


def _plan(exp, shared_config: Config, specs: list[RunSpec]) -> dict:
    """Lengths and held-out documents shared by every run; the evaluation settings are
    checked first, before the documents are read (and long before any training)."""
    lengths = eval_lengths(exp["multipliers"], shared_config.train_len)
    for spec in specs:  # a misspelt mode or scaling fails before any training
        evaluations(exp, spec, specs)
    _check_scalings(exp, specs, lengths, shared_config.train_len)
    passkey_plan = _passkey_plan(exp, shared_config.train_len)
    # Both modes score the same documents and budget: every cell of a table the same tokens.
    docs = {"perplexity": int(exp["eval_docs"]), "resolution": int(exp["resolution_docs"])}
    if min(docs.values()) < 1:
        raise ExperimentError("eval_docs and resolution_docs must be positive")
    max_length = lengths[-1]
    uneven = [n for n in lengths if max_length % n]
    if uneven:
        raise ExperimentError(
            f"multipliers: lengths {uneven} do not divide the largest, {max_length}: they "
            "would score fewer tokens than the other cells; use powers of two"
        )
    sinks = int(exp.get("sinks", evaluation.DEFAULT_SINKS))
    if "sinks" in _names(exp.get("modes", "bca,full"), "modes", MODES, required=True):
        evaluation.sink_window(shared_config.block, sinks)  # not after the first training
    longest = max(max_length + 1, 2 * shared_config.train_len)
    d = shared_config.data  # every run shares the corpus, so its tokenizer
    tokenizer = data_lib.load_tokenizer(d.tokenizer, d.vocab_size, d.name, **d.corpus())
    # A length below the format is skipped with a note; with none above it the study
    # measured no passkey at all, after every training.
    if passkey_plan and max(passkey_plan["lengths"]) < passkey.min_length(tokenizer):
        raise ExperimentError(
            f"passkey_multipliers={exp.get('passkey_multipliers', '1,2,4,8')}: no length "
            f"reaches the {passkey.min_length(tokenizer)} tokens of a passkey sample (the "
            f"longest is {max(passkey_plan['lengths'])}); add a larger multiplier"
        )
    _, documents = evaluation.held_out_documents(
        shared_config, splits=(exp["eval_split"],), tokenizer=tokenizer
    )
    documents = [d for d in documents if len(d) >= longest]
    if not documents:
        raise ExperimentError(
            f"no {exp['eval_split']} document of {shared_config.data.name} has "
            f"{longest} tokens; use smaller multipliers"
        )
    documents = documents[: max(docs.values())]
    return {
        "lengths": lengths,
        "documents": documents,
        "tokenizer": tokenizer,
        "docs": docs,
        "eval_split": exp["eval_split"],
        "tokens_per_batch": int(exp["tokens_per_batch"]),
        "sinks": sinks,
        "corpus": data_lib.planned_build(d),
        "evaluations": lambda spec: evaluations(exp, spec, specs),
        "passkey": passkey_plan,
        "longest": longest,
        "max_length": max_length,
    }


def _record_invocation(out, started, wall_start, load_start, outcome) -> dict:
    """Appends this invocation's wall time and load averages to ``out/timing.json``."""
    path = os.path.join(out, "timing.json")
    timing = reports.read_json(path) if os.path.exists(path) else {"invocations": []}
    timing["invocations"].append(
        {
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "wall_seconds": time.perf_counter() - wall_start,
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
            "outcome": outcome,
            "argv": sys.argv,
            "machine": machine(),  # a study resumed elsewhere: each part's own machine
        }
    )
    timing["machine"] = timing["invocations"][-1]["machine"]
    reports.write_json(path, timing)
    return timing


class _Terminated(BaseException):
    """A SIGTERM outside a training: ends the invocation. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` swallows it."""


class _TerminateOutsideTraining:
    """SIGTERM raises :class:`_Terminated` in the main thread while the study runs.

    ``lexjax.training.train`` installs its own handlers for the time it runs (it
    finishes the step, saves and returns stopped) and puts this one back. Inside
    :meth:`held` a SIGTERM is only noted, and raised when it ends. One that a
    callback swallowed (a gc callback of JAX's) is delivered again. Off the main
    thread signals are left alone."""

    def __init__(self):
        self.armed, self.pending, self._previous = False, False, {}
        self.deferred: str | None = None
        self.name = "SIGTERM"  # the signal that stopped the study (SIGHUP too)

    def __enter__(self):
        self.deferred = signals.end_deferral()  # one while the program started
        for sig in signals.STOP_SIGNALS:  # SIGHUP (a closed terminal) as SIGTERM
            if sig == signal.SIGINT or signals.ignored(sig):  # Ctrl-C: KeyboardInterrupt
                continue
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self._handle)
        signals.on_swallowed(_Terminated, self._again)
        self.armed = True
        return self

    def raise_deferred(self) -> None:
        """A SIGTERM or Ctrl-C that came while the program started (importing JAX,
        :func:`lexjax.signals.defer`) stops the study now, as one a moment later would."""
        name, self.deferred = self.deferred, None
        if name in {s.name for s in signals.STOP_SIGNALS} - {"SIGINT"}:
            self.name = name
            raise _Terminated
        if name == "SIGINT":
            raise KeyboardInterrupt

    def _handle(self, signum, frame):
        self.name = signal.Signals(signum).name
        if not self.armed:
            self.pending = True
            return
        raise _Terminated

    def _again(self) -> bool:
        if self.armed:
            return signals.interrupt_main_later(signal.Signals[self.name])
        self.pending = True
        return True

    @contextlib.contextmanager
    def held(self):
        armed, self.armed = self.armed, False
        try:
            yield
        finally:
            self.armed = armed
        if armed and self.pending:
            self.pending = False
            raise _Terminated

    def __exit__(self, *exc):
        self.armed = False
        for sig, handler in self._previous.items():
            # None: a handler not set from Python, which cannot be put back
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def run_experiment(exp, out: str, *, log: Callable[[str], None] = print) -> dict | None:
    """Trains and evaluates every run of ``exp`` (a ConfigDict or dict shaped like
    configs/extrapolation.py) in ``out``, skipping finished stages, then writes the
    tables, JSON and figures. Returns the collected results, or None when a signal
    stopped it (run again to continue): SIGTERM or Ctrl-C in a training, which saves
    its step first, or a SIGTERM elsewhere (in the main thread)."""
    global _stopped_by_sigterm
    _stopped_by_sigterm = False
    with _TerminateOutsideTraining() as stop:
        try:
            stop.raise_deferred()
            return _run_experiment(exp, out, log, stop)
        except _Terminated:
            _stopped_by_sigterm = True
            where = f" ({os.path.abspath(os.path.expanduser(out))})" if out.strip() else ""
            log(f"stopped by {stop.name}; run the same command again to continue{where}")
            return None


# Whether run_experiment was last stopped by a SIGTERM outside a training (see main).
_stopped_by_sigterm = False


def _run_experiment(exp, out: str, log, stop: _TerminateOutsideTraining) -> dict | None:
    exp = exp.to_dict() if hasattr(exp, "to_dict") else dict(exp)
    if not out.strip():
        raise ExperimentError("--out is empty; name the directory of the study")
    out = os.path.abspath(os.path.expanduser(out))  # a shell leaves "--out=~/x" so
    checkpoint.check_workdir_path(out, what="--out")  # its runs' workdirs are inside it
    if checkpoint.has_steps(out):  # its runs/ and reports would sit inside that run
        raise ExperimentError(
            f"--out {out} is a training run's workdir (it holds checkpoints); choose another "
            "directory"
        )
    if inside := checkpoint.misplaced_workdir(out, study=False):
        raise ExperimentError(f"--out {out} is inside a training run: {inside}; choose another")
    if "train" not in exp or "runs" not in exp:  # train.py's config has neither
        raise ExperimentError(
            "--config is not a study's config (it has no train and runs fields; a config "
            "of train.py's?); use configs/extrapolation.py[:PRESET]"
        )
    started, wall_start, load_start = time.time(), time.perf_counter(), os.getloadavg()
    shared = exp["train"].to_dict() if hasattr(exp["train"], "to_dict") else dict(exp["train"])
    try:
        shared_config = from_configdict(shared)
    except ConfigError as e:
        raise ExperimentError(f"train.{e}") from None
    shared = _plain(to_dict(shared_config))
    shared.pop("sharding_rules", None)
    specs = parse_runs(
        exp["runs"], scale_base=shared_config.model.scale_base, seed=shared_config.seed
    )
    configs = [_run_config(shared, spec) for spec in specs]
    plan = _plan(exp, shared_config, specs)
    log(
        f"{len(specs)} runs: {', '.join(s.name for s in specs)}; lengths "
        f"{', '.join(map(str, plan['lengths']))}; {len(plan['documents'])} held-out documents "
        f"of ≥ {plan['longest']} tokens"
    )
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:  # a file there, or a file above it
        raise CheckpointError(
            f"cannot make --out {out} ({e.strerror}); choose another directory"
        ) from None
    # One study per --out for its whole run: another with other settings evaluated
    # runs while this one trained, and this one's tables mixed the two's numbers.
    with _only_study(out):
        _refuse_another_config(out, shared, {s.name: c for s, c in zip(specs, configs)})
        stopped, outcome = False, "error"
        try:
            for spec, config in zip(specs, configs):
                workdir = os.path.join(out, "runs", spec.name)
                if _train_stage(spec, config, workdir, log) is None:
                    stopped = True
                    break
                _eval_stage(spec, config, workdir, plan, log)
                _passkey_stage(spec, config, workdir, plan, log)
            outcome = "stopped" if stopped else "completed"
        except _Terminated:
            outcome = "stopped"
            raise
        except KeyboardInterrupt:
            outcome = "interrupted"
            raise
        finally:
            with stop.held():  # recorded also when a SIGTERM comes now
                timing = _record_invocation(out, started, wall_start, load_start, outcome)
        if stopped:
            log(f"stopped; run the same command again to continue ({out})")
            return None
        with stop.held():  # a SIGTERM now ends it after the reports, not between two
            collected = reports.collect(out, specs, shared_config, plan, timing)
            reports.write_all(out, collected)
        log(f"wrote {', '.join(reports.OUTPUTS)} in {out}")
        return collected


@stdout_failures(to_stderr=True)  # as train.py's: a closed stdout loses no training
def main(argv) -> int:
    """The program's body, run through :func:`lexjax.errors.report` as train.py's is."""
    import logging as py_logging

    from absl import flags, logging

    del argv
    # orbax logs every save and warns that evaluation opens checkpoints read-only;
    # lexjax's own warnings (a damaged checkpoint skipped) still show.
    logging.set_verbosity(logging.ERROR)
    py_logging.getLogger("lexjax").setLevel(py_logging.WARNING)
    distributed.start_backend()  # one JAX_PLATFORMS names and this machine lacks: one line
    collected = run_experiment(flags.FLAGS.config, _OUT.value)
    if _stopped_by_sigterm:
        # XLA may still be compiling what the SIGTERM interrupted, in threads of its own;
        # Python's finalization under them crashed (SIGSEGV, 1 in 3 stops in the
        # smoke study's evaluation). Everything is written: the process ends here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if collected is not None:
        summary = os.path.join(os.path.expanduser(_OUT.value), "summary.md")  # as written
        with open(summary, encoding="utf-8") as f:
            print(f.read())
    return 0


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OUT = None


def run(argv: list[str] | None = None) -> int:
    """The program on ``argv`` (default ``sys.argv``), run as train.py's main runs
    it (this module does not import the command-line boundary): orbax's background failures
    kept off stderr, a Ctrl-C that a callback swallowed delivered again, lexjax's logged
    notes without absl's prefix, and a user's error one line with the exit status of its
    kind. Raises SystemExit like ``app.run``."""
    global _OUT
    from absl import app, flags

    from lexjax.config import flags_parser
    from lexjax.errors import plain_own_log_lines, report

    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)  # configs/*.py import each other
    if _OUT is None:
        _OUT = flags.DEFINE_string(
            "out",
            os.path.join("runs", "extrapolation"),
            "Output directory (resumable: finished stages are skipped).",
        )
    # --config=FILE[:PRESET] (small, paper, smoke, ...) and --config.FIELD overrides; a bad
    # one is one line and exit status 2, as for train.py.
    parse = flags_parser(os.path.join(_ROOT, "configs", "extrapolation.py"), path_flag="out")
    checkpoint.quiet_background_errors()
    signals.redeliver_swallowed_interrupts()
    plain_own_log_lines()
    return report(app.run, main, argv=argv, flags_parser=parse)


if __name__ == "__main__":
    sys.exit(run())
