"""Running train.py as real processes in tests: a tiny model, a generated corpus, a
shared compilation cache (so each process compiles the train step once per
session, not once per run), and helpers to watch, signal and read a run."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

TINY = {
    "model.num_layers": 1,
    "model.d_model": 32,
    "model.num_heads": 4,
    "model.mlp_dim": 64,
    "train_len": 32,
    "model.max_len": 32,
    "batch_size": 8,
    "eval_batches": 1,
    "eval_every": 1000,
    "log_every": 1,
    "warmup_steps": 2,
    "data.name": "textfiles",
    # A window of 64 packed rows, not the default 1,024: filling the default window
    # (and the validation split's) took 0.6–0.9 s of each tiny run's ~6 s of CPU.
    "data.shuffle_rows": 64,
}


def write_corpus(directory: pathlib.Path, count: int = 40) -> str:
    """`count` small text files of random words; returns their glob."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "\n"]
    for i in range(count):
        text = " ".join(rng.choice(words, size=int(rng.integers(20, 200))))
        (directory / f"doc{i}.txt").write_text(text)
    return str(directory / "*.txt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(workdir, files, data_dir, **overrides) -> list[str]:
    """train.py arguments: the tiny model on `files`; `overrides` use dotted config keys
    (a key without a dot that is not a config field is passed as a plain flag)."""
    values = {**TINY, "data.files": files, "data.data_dir": data_dir, **overrides}
    flags = [f"--workdir={workdir}"]
    for key, value in values.items():
        flags.append(f"--{key}={value}" if key.startswith("-") else f"--config.{key}={value}")
    return [flag.replace("---", "--") for flag in flags]


def _jaxlib_release() -> tuple[int, int]:
    """(major, minor) of the installed jaxlib, read without importing it."""
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    numbers = [int(part) for part in version.split(".")[:2] if part.isdigit()]
    major, minor = (numbers + [0, 0])[:2]
    return major, minor


# XLA:CPU's element-wise code generators, instead of its MLIR fusion emitters, where
# jaxlib still has the choice (0.10; later releases dropped the flag, and XLA aborts a
# process given an unknown flag). The suite is CPU-bound and mostly compiles small
# programs: the MLIR emitters took up to twice the CPU time, 230.5 s of user time
# against 121.6 s for test_evaluation.py + test_generation.py in one process (53.7 s
# against 45.1 s for test_model.py), the same tests passing; the whole suite on 2 idle
# cores took 987 s instead of 1,426 s.
ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false" if _jaxlib_release() < (0, 11) else ""
# What this process (tests/conftest.py) and most children compile with: the emitters
# above, and XLA:CPU's backend optimization level 0 (LLVM's code generation; XLA's HLO
# passes are the same).
FAST_COMPILE = f"--xla_backend_optimization_level=0 {ELEMENTAL_EMITTERS}".strip()


def xla_flags(devices: int = 1) -> str:
    """A child's XLA_FLAGS: ``devices`` simulated CPU devices, compiled as this process
    compiles (:data:`FAST_COMPILE`): a child's programs compile faster and run the same
    computation (the tests check meaning)."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


def env(devices: int, cache_dir) -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "XLA_FLAGS": xla_flags(devices),
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def context(tmp_path_factory, name: str, devices: int):
    """(base dir, corpus glob, TFDS data dir, environment) shared by a module's runs."""
    base = tmp_path_factory.mktemp(name)
    files = write_corpus(base / "corpus")
    environ = env(devices, tmp_path_factory.getbasetemp() / "jax-cache")
    return base, files, str(base / "tfds"), environ


def interruptible(argv: list[str], action: str = "SIG_DFL") -> list[str]:
    """``argv`` run with SIGINT's ``action`` (default: the default action, as a
    terminal's foreground program has it) and SIGHUP's default action. A test run as a
    background job hands its children SIGINT ignored, and one run under ``nohup``
    SIGHUP ignored, which train.py, eval.py and the study keep. (A Python that sets
    them and execs ``argv``, same process: a ``preexec_fn`` would run Python in a fork
    of multithreaded JAX.)"""
    reset = (
        f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{action}); "
        "signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    )
    return [sys.executable, "-c", reset + "os.execv(sys.argv[1], sys.argv[1:])", *argv]


def start(args, environ, program="train.py", sigint="SIG_DFL", **kwargs) -> subprocess.Popen:
    """Starts ``program`` with SIGINT's action ``sigint`` (:func:`interruptible`)."""
    return subprocess.Popen(
        interruptible([sys.executable, str(ROOT / program), *args], sigint),
        cwd=ROOT,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def limited(argv: list[str], rlimits: dict[str, int]) -> list[str]:
    """``argv`` run under the resource limits ``rlimits`` ({"RLIMIT_AS": bytes, ...};
    SIGXFSZ ignored, so a write past RLIMIT_FSIZE fails with EFBIG), set by a Python
    that execs ``argv``: same reason as :func:`interruptible`."""
    limit = "".join(f"resource.setrlimit(resource.{k}, ({v}, {v})); " for k, v in rlimits.items())
    setup = "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    return [sys.executable, "-c", setup + limit + "os.execv(sys.argv[1], sys.argv[1:])", *argv]


def run(
    args, environ, timeout=240, program="train.py", rlimits=None, **kwargs
) -> subprocess.CompletedProcess:
    """Runs ``program`` (train.py, or tests/poisoned_train.py STEP) to completion,
    under the resource limits ``rlimits`` if given (:func:`limited`)."""
    argv = [sys.executable, str(ROOT / program), *args]
    return subprocess.run(
        limited(argv, rlimits) if rlimits else argv,
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def records(workdir) -> list[dict]:
    path = pathlib.Path(workdir, "metrics.jsonl")
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def losses(workdir) -> list[tuple[int, float]]:
    """(step, loss) of every logged step in order, repeats included."""
    return [(r["step"], r["loss"]) for r in records(workdir) if "loss" in r]


def last_step(workdir) -> int:
    logged = losses(workdir)
    return logged[-1][0] if logged else 0


def settled_step(workdir, proc: subprocess.Popen, quiet: float = 4.0, timeout: float = 60) -> int:
    """The last logged step once it has not changed for ``quiet`` seconds (a run
    whose data was held has drained what it had and waits for more). 1.5 s was too
    short on loaded cores: a run still between its steps was taken as waiting, and a
    SIGTERM then stopped it a step before the one the test expected."""
    deadline, last, since = time.monotonic() + timeout, last_step(workdir), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited ({proc.returncode}) while its data was held")
        if (now := last_step(workdir)) != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return last
    raise AssertionError("the run's steps did not settle while its data was held")


def complete_steps(workdir) -> list[int]:
    """The steps whose checkpoint is finished (integrity record written), ascending.
    Digits only: a step orbax is still writing is ``<step>.orbax-checkpoint-tmp…``."""
    root = pathlib.Path(workdir, "checkpoints")
    return sorted(
        int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "integrity").is_dir()
    )


def wait_until(predicate, proc: subprocess.Popen, timeout: float = 180, poll: float = 0.02):
    """Polls `predicate()` until true; fails if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(
                f"train.py exited ({proc.returncode}) before the condition:"
                f"\n{out[-2000:]}\n{err[-3000:]}"
            )
        time.sleep(poll)
    proc.kill()
    raise AssertionError("timed out waiting for the training process")


def grain_workers(pid: int) -> list[int]:
    """The grain worker processes of `pid` (multiprocessing's spawn children; its
    resource tracker is a child too)."""
    tasks = pathlib.Path(f"/proc/{pid}/task").iterdir()
    children = " ".join(t.joinpath("children").read_text() for t in tasks).split()
    return [
        int(c) for c in children if b"spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def kill(proc: subprocess.Popen, sig=signal.SIGKILL, timeout: float = 120):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@contextlib.contextmanager
def tmpfs(path: pathlib.Path, size: str):
    """A tmpfs of `size` at `path`, or None where this process may not mount."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        yield None
        return
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=True)


def make_read_only(mount: pathlib.Path | None, tree: pathlib.Path) -> None:
    """Makes ``tree`` read-only: a remount of its tmpfs ``mount`` (from :func:`tmpfs`),
    else, for a non-root user, a chmod (which does not stop root: then the test skips)."""
    if mount is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    elif os.geteuid() != 0:
        for p in [tree, *tree.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
    else:
        pytest.skip("root without mount rights: nothing makes a directory read-only")
