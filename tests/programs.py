"""train.py, eval.py and the study (:data:`STUDY`) run in-process, through their own
``run(argv)``: absl parsing, the ``--config`` parser, the one catch site, config and
mesh validation, with only the work after validation replaced: training by the mesh
check ``TrainSetup`` does first, joining processes by the check of the cluster flags,
loading a checkpoint or the study's first training by a marker (status
``"reached"``). The ``program`` fixture (tests/conftest.py) hands out
:func:`invoker`; a refusal costs no new Python with JAX, and tests of exit statuses
that a shell sees keep a real process beside."""

from __future__ import annotations

import importlib.util
import logging
import pathlib

import jax
from absl import flags
from absl import logging as absl_logging

from lexjax import checkpoint, cli, distributed, sharding

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS
STUDY = "lexjax.experiments.extrapolation"  # `python -m` it; its training is replaced too


class _Reached(Exception):
    """Validation passed: the program went on to load a checkpoint."""


def load_script(path: str):
    """The script at ``path`` (from the repository root: "train.py", "bench/run.py")
    loaded as a new module; its ``__main__`` part (a re-exec with huge pages) does not run."""
    name = path.removesuffix(".py").replace("/", "_") + "_in_process"
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(name: str):
    if name == STUDY:  # a module, not a script; its --out is defined at its first run
        return importlib.import_module(name)
    return load_script(f"{name}.py")


def _check_mesh(config, workdir, **_):
    sharding.check_mesh(config, jax.device_count(), jax.process_count())
    return {"start_step": 0, "step": 0, "stopped_by": None, "checkpoint_dir": workdir}


def _raise_reached(*args, **kwargs):
    raise _Reached


def invoker(monkeypatch):
    """``invoke(name, argv, capsys) -> (exit status or 'reached', stderr)`` with the
    program loaded once (``invoke.own_flags[name]``: the flags it defines); they are
    removed afterwards (train.py and eval.py share flag names). What a program sets for
    its whole process is put back afterwards: log levels and handlers, absl's handler
    format (a later test's caplog saw no lexjax INFO line once eval.py had set the
    lexjax logger to WARNING). Not the unraisable-exception hook: lexjax.signals
    installs it once per process, and a later stop swallowed in a gc callback was not
    raised again once a first version here had put the old hook back (CI)."""
    monkeypatch.setattr(checkpoint, "quiet_background_errors", lambda: None)  # once per process
    root, own = logging.getLogger(), logging.getLogger("lexjax")
    levels, handlers = (root.level, own.level, absl_logging.get_verbosity()), root.handlers[:]
    absl_handler = absl_logging.get_absl_handler()
    formatter = absl_handler.formatter
    monkeypatch.setattr(cli.api, "train", _check_mesh)
    monkeypatch.setattr(cli.distributed, "initialize", distributed._check)
    monkeypatch.setattr(cli.api, "load", _raise_reached)
    before = set(FLAGS)
    loaded = {}

    def invoke(name: str, argv: list[str], capsys):
        if name not in loaded:
            known = set(FLAGS)
            loaded[name] = _load(name)
            invoke.own_flags[name] = set(FLAGS) - known
        if name == STUDY:  # its --out, removed below with the flags defined per run
            monkeypatch.chdir(ROOT)  # its documented command's relative --config, as there
            monkeypatch.setattr(loaded[name], "_OUT", None)
            monkeypatch.setattr(loaded[name], "_train_stage", _raise_reached)
        defined = set(FLAGS)
        FLAGS.unparse_flags()
        capsys.readouterr()
        try:
            code = loaded[name].run([f"{name}.py", *argv])
        except SystemExit as e:
            code = e.code
        except _Reached:
            code = "reached"
        finally:
            for flag in set(FLAGS) - defined:  # --config and its fields, defined per parse
                delattr(FLAGS, flag)
        return code, capsys.readouterr().err

    invoke.own_flags = {}
    yield invoke
    FLAGS.unparse_flags()
    for flag in set(FLAGS) - before:
        delattr(FLAGS, flag)
    root.setLevel(levels[0])
    own.setLevel(levels[1])
    absl_logging.set_verbosity(levels[2])
    root.handlers[:] = handlers
    absl_handler.setFormatter(formatter)
