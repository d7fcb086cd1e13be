"""Shared pieces of the benchmarks: configs, batches, alternating timing, summaries.

The machines these run on are shared and noisy, so no figure is a single
timing: :func:`alternate` runs every side of a comparison once per round, in
a rotating order, and the comparisons are per-round ratios summarised as the
median with min–max over rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from configs import paper  # noqa: E402  (needs ROOT on sys.path)

# What configs/paper.py changes from the defaults, as a plain dict: bench/accelerator.py
# builds the paper config from it on hosts without ml_collections.
PAPER = paper.OVERRIDES


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``error: …``, and exit status 2 (the
    README's "Errors and exit statuses"), not the usage text plus ``PROG: error: …``."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    def check_counts(self, args, *names: str) -> None:
        """Refuses ``--name`` below 1 for each of ``names`` (rounds, steps, files, ...):
        ``--rounds 0`` ran a minute, then failed on an empty list of rounds."""
        for name in names:
            if (value := getattr(args, name)) < 1:
                self.error(f"--{name}={value}: give a whole number of at least 1")

    def check_json(self, path: str | None) -> None:
        """Refuses a ``--json`` path that cannot be written, before anything runs."""
        if not path:
            return
        try:
            if os.path.isdir(path):
                raise IsADirectoryError(21, "Is a directory")
            directory = os.path.dirname(os.path.abspath(path))
            existing = directory
            while not os.path.lexists(existing):  # the nearest ancestor there (a link too)
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                what = "a file" if os.path.exists(existing) else "a link to nothing"
                raise NotADirectoryError(20, f"Not a directory: {existing} is {what}")
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):  # a read-only one refuses here
                pass
        except OSError as e:
            self.error(f"--json={path}: cannot write there ({e.strerror}); choose another path")


def error_text(e: BaseException) -> str:
    """An exception's first line for a JSON record (its type where the message is empty)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else '(no message)'}"[:300]


def config_dict(name: str) -> dict:
    """``configs/<name>.py`` as a plain nested dict."""
    import importlib

    return importlib.import_module(f"configs.{name}").get_config().to_dict()


def make_config(base: dict, *, model: dict | None = None, **top):
    """A validated :class:`lexjax.config.Config` from a dict plus overrides."""
    from lexjax.config import from_configdict

    values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    values["model"] = {**values.get("model", {}), **(model or {})}
    values.update(top)
    return from_configdict(values)


def tiny_config(**model):
    return make_config(config_dict("tiny"), model=model)


# Model overrides of a benchmark's --quick run, which checks the code path, not a
# speed: two layers compile in half the time. Recorded in its JSON as model_overrides.
QUICK_MODEL = {"num_layers": 2}


def text_tokens(count: int, seed: int = 0) -> np.ndarray:
    """``count`` byte tokens of real text: the standard library's own sources, concatenated.

    Real text rather than random ids so loss curves mean something; speed does
    not depend on it.
    """
    import sysconfig

    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = np.random.default_rng(seed)
    rng.shuffle(files)
    chunks, total = [], 0
    for path in files:
        data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)
        chunks.append(data)
        total += data.size
        if total >= count:
            break
    return np.concatenate(chunks)[:count]


def train_batches(batch: int, seq: int, count: int, seed: int = 0) -> list[dict]:
    """``count`` distinct ``[batch, seq]`` training batches of unpacked text rows."""
    stream = text_tokens(count * batch * (seq + 1), seed).reshape(count, batch, seq + 1)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    return [
        {
            "inputs": rows[:, :-1].copy(),
            "targets": rows[:, 1:].copy(),
            "segment_ids": np.ones((batch, seq), np.int32),
            "positions": positions,
        }
        for rows in stream
    ]


def train_timer(config, batches: list[dict], steps: int, **setup_kwargs):
    """``(setup, timer)``: the library's jitted train step on one device, warm;
    ``timer()`` runs ``steps`` steps (cycling over ``batches``) and returns their seconds.
    ``setup_kwargs`` go to :class:`lexjax.steps.TrainSetup` (e.g. ``compiler_options``)."""
    import jax

    from lexjax.steps import TrainSetup

    setup = TrainSetup(config, devices=jax.devices()[:1], **setup_kwargs)
    device_batches = [setup.global_batch(b) for b in batches]
    box = {"state": setup.init_state()}

    def work():
        state = box["state"]
        with jax.set_mesh(setup.mesh):
            for i in range(steps):
                state, _ = setup.train_step(state, device_batches[i % len(device_batches)])
        box["state"] = jax.block_until_ready(state)

    work()  # compile
    return setup, lambda: timed(work)


@dataclasses.dataclass
class Summary:
    median: float
    min: float
    max: float
    values: list[float]
    q25: float | None = None  # quartiles: the middle half of the rounds
    q75: float | None = None

    @classmethod
    def of(cls, values) -> Summary:
        values = [float(v) for v in values]
        # "inclusive": the quartiles of the rounds themselves, inside their min–max (the
        # default, "exclusive", extrapolated past them for 2 rounds, every --quick run).
        q25, q75 = (
            statistics.quantiles(values, n=4, method="inclusive")[::2]
            if len(values) > 1
            else (values[0],) * 2
        )
        return cls(statistics.median(values), min(values), max(values), values, q25, q75)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __format__(self, spec: str) -> str:
        spec = spec or ".3g"
        return f"{self.median:{spec}} [{self.min:{spec}}–{self.max:{spec}}]"


def alternate(
    sides: dict[str, Callable[[], float]], rounds: int, pause: float = 0.2, warm: bool = False
) -> dict[str, list[float]]:
    """Runs each side once per round and returns ``{name: [figure per round]}``.

    Each callable does its own work and returns what it measured (seconds,
    or a rate). The
    order rotates every round so no side always runs first (after another
    side's threads, or at the start of a slower period); ``pause`` lets the
    previous side's spinning worker threads go idle before the next starts.
    ``warm``: each side runs once untimed right before its timed call, so every
    figure is a side in steady state, as in a training loop, rather than its first
    call after another side, which swings from round to round (docs/benchmarks.md §12).
    """
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            time.sleep(pause)
            if warm:
                sides[name]()
            out[name].append(sides[name]())
    return out


def fmt(summary: dict, spec: str = ".3g", scale: float = 1.0) -> str:
    """``median [min–max]`` of a summary dict (from JSON), times ``scale``."""
    return format(Summary.of([v * scale for v in summary["values"]]), spec)


def ratios(numerators: list[float], denominators: list[float]) -> Summary:
    """Per-round ratios, summarised."""
    return Summary.of([a / b for a, b in zip(numerators, denominators)])


def timed(fn: Callable[[], object]) -> float:
    """Seconds for ``fn()``, which must block until its work is done."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def result(value, unit: str, target: str, met: bool | None, **raw) -> dict:
    """The JSON entry of one benchmark: headline value, unit, target and raw figures."""
    return {"value": value, "unit": unit, "target": target, "met": met, **raw}


def _cpuinfo() -> dict[str, str]:
    """The fields of /proc/cpuinfo's first processor ({} without /proc/cpuinfo)."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model(fields: dict[str, str] | None = None) -> str:
    fields = _cpuinfo() if fields is None else fields
    if "model name" in fields:
        return fields["model name"]
    import platform

    return platform.processor() or platform.machine()


# The vector extensions XLA:CPU and PyTorch pick kernels by; with the family and model,
# they tell apart hosts that cloud VMs all call "AMD EPYC" (a Zen 3 and a Zen 5).
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_details(fields: dict[str, str] | None = None) -> dict:
    """Family, model, cache size of /proc/cpuinfo's first processor, and which of
    :data:`_CPU_FLAGS` it has ({} without /proc/cpuinfo)."""
    fields = _cpuinfo() if fields is None else fields
    if not fields:
        return {}
    flags = set(fields.get("flags", "").split())
    return {
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "cache_size": fields.get("cache size"),
        "flags": [flag for flag in _CPU_FLAGS if flag in flags],
    }


def machine() -> dict:
    import jax

    cpuinfo = _cpuinfo()
    return {
        "cpu": cpu_model(cpuinfo),
        "cpu_details": cpu_details(cpuinfo),
        "cpu_count": os.cpu_count(),
        # Fewer than cpu_count when pinned (taskset): the cores this run could use.
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1m": os.getloadavg()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),  # lexjax/hugepages.py
        "git_commit": git_commit(),
    }


def git_commit() -> str | None:
    """The code's commit, ``+dirty`` with uncommitted changes; None outside a git checkout."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:  # no git
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if changed.stdout.strip() else "")


def model_shapes(config) -> dict:
    """What a benchmark's figures depend on, for its JSON: the model's shapes, dtype and
    position, the training length and batch."""
    m = config.model
    fields = ("num_layers", "d_model", "num_heads", "mlp_dim", "vocab_size", "position", "dtype")
    shapes = {name: getattr(m, name) for name in fields}
    return dict(shapes, train_len=config.train_len, batch_size=config.batch_size)


# Cores that other processes may keep busy before a run counts as taken on shared cores.
SHARED_THRESHOLD_CORES = 0.2


def _proc_stat_fields(pid) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_snapshot() -> dict | None:
    """Jiffies: every core's busy time, and that of this process with its
    descendants (children that exited and were waited for included); None
    where /proc is missing."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = values[3] + values[4]  # idle + iowait
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _proc_stat_fields(entry)) is not None:
            parents[int(entry)] = (int(fields[1]), fields)
    own, frontier = 0, [os.getpid()]
    seen = set()
    while frontier:
        pid = frontier.pop()
        if pid in seen or pid not in parents:
            continue
        seen.add(pid)
        fields = parents[pid][1]
        own += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
        frontier += [child for child, (ppid, _) in parents.items() if ppid == pid]
    return {"total": sum(values), "busy": sum(values) - idle, "own": own, "time": time.time()}


def other_cores_busy(before: dict | None, after: dict | None) -> float | None:
    """Mean number of cores other processes kept busy between two snapshots."""
    if before is None or after is None or after["total"] <= before["total"]:
        return None
    others = (after["busy"] - before["busy"]) - (after["own"] - before["own"])
    return max(0.0, others) / (after["total"] - before["total"]) * (os.cpu_count() or 1)


def shared_cores(busy: float | None) -> bool | None:
    """Whether other processes used more than SHARED_THRESHOLD_CORES; None when the
    load was not measured (no /proc): unknown, not idle."""
    return None if busy is None else busy > SHARED_THRESHOLD_CORES


def any_shared(a: bool | None, b: bool | None) -> bool | None:
    """Two ``shared_cores`` flags combined: True if either is, else None if either is unknown."""
    if a or b:
        return True
    return None if a is None or b is None else False


class Provenance:
    """How a benchmark ran, for its JSON: started at construction (a load check
    first, with a warning on stderr when other processes share the cores), then
    :meth:`record`: the command, that check, what other processes used during
    the run, and ``shared_cores`` (None: not measured, not "idle")."""

    def __init__(self):
        self.check = load_check()
        if self.check["shared"]:
            print(
                f"warning: other processes keep {self.check['other_cores_busy']:.2f} cores "
                "busy; this run will be flagged shared_cores",
                file=sys.stderr,
                flush=True,
            )
        elif self.check["shared"] is None:
            print(
                "warning: cannot measure other processes' load here (no /proc); "
                "shared_cores will be null",
                file=sys.stderr,
                flush=True,
            )
        self.command = " ".join(["python"] + sys.argv)
        self._before = cpu_snapshot()

    def record(self) -> dict:
        busy = other_cores_busy(self._before, cpu_snapshot())
        return {
            "command": self.command,
            "load_check": self.check,
            "other_cores_busy": busy,
            "shared_cores": any_shared(self.check["shared"], shared_cores(busy)),
        }


def load_check(seconds: float = 3.0) -> dict:
    """Samples what other processes use for ``seconds`` (this process and its
    children do not count); ``shared`` when that exceeds SHARED_THRESHOLD_CORES."""
    before = cpu_snapshot()
    time.sleep(seconds)
    busy = other_cores_busy(before, cpu_snapshot())
    return {
        "other_cores_busy": busy,
        "seconds": seconds,
        "shared": shared_cores(busy),
        "threshold_cores": SHARED_THRESHOLD_CORES,
        "load_average_1m": os.getloadavg()[0],
    }
