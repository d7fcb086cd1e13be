"""Shared test setup: 8 simulated CPU devices (before JAX is imported) and small configs."""

import os
import shutil
import tempfile

import pytest

from tests.processes import FAST_COMPILE

# Added to flags set for other reasons (a dump flag gave 1 device: the mesh tests skipped).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# The programs the tests compile in this process are compiled for compile speed
# (tests/processes.py's FAST_COMPILE: XLA:CPU's backend optimization level 0 and, on
# jaxlib 0.10, its element-wise emitters): the suite is CPU-bound and mostly compiles
# small programs. Level 0: test_passkey.py took 39.0 s of CPU instead of 56.6 s, cold
# cache. The children of tests/processes.py, test_experiments, test_bench and
# test_notebook get the same (tests/processes.py's xla_flags): the smoke study compiles
# ~130 programs of its own, and test_experiments.py + test_notebook.py took 151 s of CPU
# instead of 201 s at level 0. test_eval_cli's eval.py children keep the default level:
# their evaluations run long enough that level 0's slower code cost more than it saved
# (232 s of CPU at level 0 against 217 s). A child given a copy of this environment
# (test_training's train.py run, the quick checks of test_config, test_fuzz, test_api)
# inherits it. The tests check meaning (equalities, oracles within tolerances), not
# generated code; the memory-use tests pass compiled so.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per pytest run, shared by its xdist workers (they
# inherit this environment) and by the train.py/eval.py subprocesses the tests start,
# so that the many runs of the same tiny model compile once: 13% less wall time for
# test_eval_cli.py + test_generation.py on 2 idle cores (375 s → 326 s, cold cache).
_OWN_CACHE = None  # the directory this process made, removed when the run ends
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="lexjax-tests-jaxcache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# JAX writes a cache entry in place: a process reading it meanwhile warns on stderr and
# compiles instead. That is this shared cache's noise, not the program's, and the tests
# of a subprocess's exact stderr must not see it. (A cache size limit would make JAX lock
# the cache, but then every write rescans the whole cache: CI took 12 minutes longer.)
_QUIET = "ignore:Error reading persistent compilation cache entry"
if _QUIET not in os.environ.get("PYTHONWARNINGS", ""):
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET])
    )

# The README's test command runs two pytest-xdist workers, each given one test file
# at a time in collection order. The files that take longest go first (longest
# processing time first), so that the two workers finish together instead of one
# running a long file alone at the end. Measured on 2 cores with --durations; a stale
# entry costs only time.
_LONGEST_FIRST = (
    "test_faults.py",
    "test_eval_cli.py",
    "test_experiments.py",
    "test_multihost.py",
    "test_training.py",
    "test_bench.py",
    "test_evaluation.py",
    "test_eval_mesh.py",
    "test_generation.py",
    "test_passkey.py",
    "test_api.py",
    "test_data.py",
)


@pytest.fixture
def program(monkeypatch):
    """``invoke(name, argv, capsys) -> (exit status or 'reached', stderr)``: train.py or
    eval.py run in this process up to where it would train or load (tests/programs.py)."""
    from tests.programs import invoker

    yield from invoker(monkeypatch)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:  # the controller (xdist workers inherit its directory)
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
