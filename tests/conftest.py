"""Shared test setup: 8 simulated CPU devices (before JAX is imported) and small configs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The README's test command runs two pytest-xdist workers, each given one test file
# at a time in collection order. The files that take longest go first (longest
# processing time first), so that the two workers finish together instead of one
# running a long file alone at the end. Measured on 2 cores with --durations; a stale
# entry costs only time.
_LONGEST_FIRST = (
    "test_eval_cli.py",
    "test_training.py",
    "test_multihost.py",
    "test_bench.py",
    "test_experiments.py",
    "test_evaluation.py",
    "test_faults.py",
    "test_docs.py",
    "test_eval_mesh.py",
    "test_model.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
