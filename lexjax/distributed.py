"""Joining a multi-process run: one process per host, joined by ``jax.distributed``.

TPU pod slices and GPU clusters run one copy of ``train.py`` per host; the
copies find each other through a coordinator (process 0) and then act as one
program over all devices. :func:`initialize` must run before anything touches
a JAX backend. Three ways in:

- ``mode='auto'`` (default): explicit ``coordinator_address``/
  ``num_processes``/``process_id`` if given; else, if a cluster launcher is
  detected in the environment (see :func:`detect_cluster`), JAX's own
  detection fills them in; else a single process.
- ``mode='on'``: always call ``jax.distributed.initialize`` (JAX detects
  what was not given) — for clusters :func:`detect_cluster` does not know.
- ``mode='off'``: never; one process.

Failure is bounded in time. Every process sends heartbeats to the coordinator;
if one dies (SIGKILL, a lost host), the others are told within
``heartbeat_timeout_s`` and JAX terminates them with the fatal log line
"Terminating process because the JAX distributed service detected fatal
errors ... another task died" (exit status 134), instead of leaving them
blocked in a collective forever. Restart every process: training resumes from
the last checkpoint. On CPU the cross-process collectives are gloo over TCP.

Joining is bounded too, but JAX aborts (status 134) rather than raising when a
process has not registered within ``initialization_timeout_s``. So a process
given the coordinator's address first waits, in Python, for process 0 to accept
connections, and stops with one line and status 7 if it never does (a wrong
address or port, process 0 not started); process 0 checks that it can listen on
the port (JAX's own failure there is sometimes a segfault). Where a peer never
registers (another ``--num_processes``, a process never started), a timer ends each
waiting process with one line and status 7 just after the timeout, before JAX's
abort; with a cluster's auto-detection, whose own waits share that timeout, JAX's
abort remains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from lexjax.errors import ConfigError, DistributedError, LexjaxError, one_line

__all__ = [
    "ClusterOptions",
    "DistributedError",
    "define_flags",
    "detect_cluster",
    "initialize",
    "any_process",
    "all_processes",
    "check_same_settings",
    "first_process_speaks",
]


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    mode: str = "auto"  # auto | on | off
    coordinator_address: str | None = None  # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = 100  # a silent peer is declared dead after this
    initialization_timeout_s: int = 300  # waiting for every process to join
    shutdown_timeout_s: int = 120  # waiting for the others at exit


def define_flags():
    """Defines the multi-process flags train.py and eval.py share; returns a
    function that reads them into :class:`ClusterOptions` (after parsing)."""
    from absl import flags

    mode = flags.DEFINE_enum(
        "distributed",
        "auto",
        ["auto", "on", "off"],
        "auto: join a multi-process run if the coordinator flags are given or a cluster "
        "(Cloud TPU, SLURM, Open MPI, Kubernetes) is detected; on: always call "
        "jax.distributed.initialize(); off: single process.",
    )
    address = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
    count = flags.DEFINE_integer("num_processes", None, "Number of processes.")
    index = flags.DEFINE_integer("process_id", None, "This process's id, 0..num_processes-1.")
    heartbeat = flags.DEFINE_integer(
        "heartbeat_timeout_s",
        100,
        "A process that sends no heartbeat for this long is dead; "
        "the others then stop (exit status 134) instead of waiting forever.",
        lower_bound=1,
    )
    joining = flags.DEFINE_integer(
        "initialization_timeout_s",
        300,
        "How long to wait for every process to join.",
        lower_bound=1,
    )
    return lambda: ClusterOptions(
        mode=mode.value,
        coordinator_address=address.value,
        num_processes=count.value,
        process_id=index.value,
        heartbeat_timeout_s=heartbeat.value,
        initialization_timeout_s=joining.value,
    )


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


def _tpu_runtime_installed() -> bool:
    """Whether JAX can find a TPU runtime here (the ``libtpu`` package of ``jax[tpu]``,
    or ``TPU_LIBRARY_PATH``). VFIO device files alone are no TPU: any host that passes
    a device through to a VM has them, and a GPU machine taken for a Cloud TPU tried to
    join a cluster that was not there."""
    return (
        bool(os.environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None
    )


def detect_cluster() -> str | None:
    """The multi-process launcher this process runs under, or None.

    Detected: a Cloud TPU VM (TPU devices present with a TPU runtime installed,
    or the worker variables GKE sets), a SLURM job step with more than one task
    (``srun``), Open MPI (``mpirun``) with more than one rank, and a Kubernetes
    Indexed Job. JAX's
    ``jax.distributed.initialize()`` then finds the coordinator and this
    process's id by itself.
    """
    if os.environ.get("TPU_WORKER_HOSTNAMES") or (
        (glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))
        and _tpu_runtime_installed()
        and not os.environ.get("TPU_SKIP_MDS_QUERY")
    ):
        return "Cloud TPU"
    if os.environ.get("SLURM_STEP_NODELIST") and _int_env("SLURM_NTASKS") > 1:
        return "SLURM"
    if _int_env("OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("JOB_COMPLETION_INDEX"):
        return "Kubernetes"
    return None


def _check(options: ClusterOptions) -> bool:
    """Validates the options; True if explicit coordinator flags were given."""
    if options.mode not in ("auto", "on", "off"):
        raise ConfigError(f"--distributed={options.mode!r}: use auto, on or off")
    given = {
        "coordinator_address": options.coordinator_address,
        "num_processes": options.num_processes,
        "process_id": options.process_id,
    }
    named = [k for k, v in given.items() if v is not None]
    if options.mode == "off" and named:
        raise ConfigError(f"--{named[0]} was given with --distributed=off; drop one of them")
    if named and len(named) < 3 and options.mode == "auto":
        missing = [k for k in given if k not in named]
        raise ConfigError(
            f"--{', --'.join(named)} given without --{', --'.join(missing)}; "
            "pass all three, or none to let JAX detect the cluster"
        )
    address = options.coordinator_address
    port = address.rsplit(":", 1)[1] if address is not None and ":" in address else ""
    if address is not None and not (port.isascii() and port.isdigit()):  # int("²") raises
        raise ConfigError(f"--coordinator_address={address!r}: use HOST:PORT of process 0")
    if address is not None and not 1 <= int(port) <= 65535:
        # 99999 was a bind() traceback on process 0, and port 34463 (mod 2^16) elsewhere
        raise ConfigError(f"--coordinator_address={address!r}: its port must be in [1, 65535]")
    n, i = options.num_processes, options.process_id
    if n is not None and n < 1:
        raise ConfigError(f"--num_processes={n} must be positive")
    if i is not None and not 0 <= i < (n if n is not None else i + 1):
        raise ConfigError(f"--process_id={i} must be in [0, --num_processes)")
    return len(named) == 3


def _await_coordinator(address: str, timeout_s: float) -> None:
    """Returns once ``address`` (process 0's coordinator) accepts a TCP connection;
    raises :class:`DistributedError` if it does not within ``timeout_s``."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"the coordinator {address} did not accept a connection within {timeout_s}s "
                    f"({e.strerror or e}); start process 0 with the same --coordinator_address, "
                    "or correct the address"
                ) from e
            time.sleep(0.5)


def _check_port_free(address: str) -> None:
    """Raises :class:`DistributedError` if process 0 cannot listen on ``address``'s port
    on every interface, as JAX's coordinator service does."""
    port = int(address.rsplit(":", 1)[1])
    dual = socket.has_dualstack_ipv6()
    family = socket.AF_INET6 if dual else socket.AF_INET
    try:
        socket.create_server(("", port), family=family, dualstack_ipv6=dual).close()
    except OSError as e:
        raise DistributedError(
            f"process 0 cannot serve --coordinator_address={address}: port {port} "
            f"({os.strerror(e.errno) if e.errno else e}); give every process a free port "
            "(a process already started with --process_id=0 holds it: give each process "
            "its own --process_id)"
        ) from e


def _exit_joining(message: str) -> None:
    """Ends the process as a :class:`DistributedError` would (``error: <message>``,
    status 7): from a timer thread, while the main thread waits inside jaxlib."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(DistributedError.exit_code)


def initialize(options: ClusterOptions = ClusterOptions()) -> str | None:
    """Joins the multi-process run ``options`` describe (:func:`join`), then starts
    JAX's backend (:func:`start_backend`; joining may start it first)."""
    with _named_backend():
        how = join(options)
        jax.devices()
    return how


def start_backend() -> None:
    """Starts JAX's backend: one that ``JAX_PLATFORMS`` names and this machine lacks
    is a one-line :class:`ConfigError` (it was a traceback, for ``cuda`` a bare
    AssertionError from inside JAX)."""
    with _named_backend():
        jax.devices()


@contextlib.contextmanager
def _named_backend():
    """JAX's failure to start a backend ``JAX_PLATFORMS`` names, as a ConfigError."""
    try:
        yield
    except (RuntimeError, AssertionError) as e:
        wanted = os.environ.get("JAX_PLATFORMS", "").strip()
        # Not a peer's failure while a joined run creates its backend (jaxlib re-raises
        # any as "Unable to initialize backend"): that is no JAX_PLATFORMS problem.
        peers = ("DEADLINE_EXCEEDED", "oordination", "KeyValue", "arrier", "UNAVAILABLE")
        about_backend = isinstance(e, AssertionError) or (
            "backend" in str(e).lower() and not any(word in str(e) for word in peers)
        )
        if not wanted or isinstance(e, LexjaxError) or not about_backend:
            raise
        reason = one_line(e) if str(e).strip() else "it is not installed"  # cuda's: no text
        raise ConfigError(
            f"JAX_PLATFORMS={wanted}: JAX cannot start that backend here ({reason}); unset "
            "JAX_PLATFORMS, or install JAX for that accelerator"
        ) from None


def join(options: ClusterOptions = ClusterOptions()) -> str | None:
    """Joins the multi-process run ``options`` describe; returns how, or None if single.

    Call once, before any JAX computation. Raises :class:`ConfigError` for
    contradictory flags, and :class:`DistributedError` when process 0's coordinator
    does not answer within ``initialization_timeout_s`` or cannot start (its port is
    taken). Where not every process registers in time (another ``--num_processes``,
    a peer that never started) jaxlib aborts the process, so with explicit flags a
    timer ends it first, just after that timeout: ``error: <one line>`` on stderr,
    status 7. (Not with auto-detection: a cluster's detection, waiting for its
    coordinator's address, spends part of the same timeout before JAX's own count
    starts, so a timer could end a start that would succeed.)
    """
    explicit = _check(options)
    if options.mode == "off":
        return None
    how = "flags" if explicit else detect_cluster()
    if options.mode == "auto" and how is None:
        return None
    # gloo is JAX's default for CPU collectives today; set it so a change of
    # default cannot leave a CPU run without cross-process collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit and options.process_id != 0:
        _await_coordinator(options.coordinator_address, options.initialization_timeout_s)
    elif explicit:
        _check_port_free(options.coordinator_address)
    where = options.coordinator_address or how or "jax auto-detection"
    timeout, n = options.initialization_timeout_s, options.num_processes
    unjoined = (
        f"could not join the multi-process run via {where} within {timeout}s: not every "
        f"process registered{f' (--num_processes={n} here)' if n else ''}; start every "
        "process with the same --coordinator_address and --num_processes, and distinct "
        "--process_id"
    )
    # jaxlib aborts about 4 s after its deadline: this ends the process in one line first.
    watchdog = threading.Timer(timeout + 1, _exit_joining, (unjoined,))
    watchdog.daemon = True
    if explicit:
        watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=options.coordinator_address,
            num_processes=options.num_processes,
            process_id=options.process_id,
            initialization_timeout=options.initialization_timeout_s,
            heartbeat_timeout_seconds=options.heartbeat_timeout_s,
            shutdown_timeout_seconds=options.shutdown_timeout_s,
        )
    except Exception as e:  # jaxlib raises its own runtime errors; report any in one line
        reason = one_line(e)
        if how is None:  # --distributed=on without all the flags, and no launcher here
            missing = [
                f"--{name}"
                for name in ("coordinator_address", "num_processes", "process_id")
                if getattr(options, name) is None
            ]
            unnamed = ", ".join(missing[:-1]) + " or " + missing[-1] if missing[1:] else missing[0]
            raise DistributedError(
                f"could not join a multi-process run ({reason}): no {unnamed} was given and "
                "no cluster launcher was detected; give --coordinator_address, "
                "--num_processes and --process_id, or leave --distributed at auto"
            ) from e
        timed_out = any(w in reason.lower() for w in ("deadline", "timed out", "timeout"))
        within = f" within {options.initialization_timeout_s}s" if timed_out else ""
        raise DistributedError(
            f"could not join the multi-process run via {where}{within} ({reason}); start "
            "every process with the same --coordinator_address and --num_processes, and "
            "distinct --process_id"
        ) from e
    finally:
        watchdog.cancel()
    # jaxlib's preemption notifier took SIGTERM from Python: it logged the signal and
    # went on (eval.py ignored it; a stop train.py deferred while starting was lost).
    # lexjax's programs agree on their stops themselves: Python's handler back.
    with contextlib.suppress(ValueError):  # (not the main thread: leave it)
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
    _no_cache_on_cpu_processes()
    # One collective while every process is here: CPU (gloo) contexts are set up on
    # first use and give up after 30 s if a peer is late, e.g. still building data.
    any_process(False)
    return how or "jax auto-detection"


# The first JAX release seen to hang below (jax 0.10.2 and 0.12.0.1 do not).
CACHE_HANGS_FROM = (0, 12, 1)


def _no_cache_on_cpu_processes() -> None:
    """Turns JAX's persistent compilation cache off for a joined run on CPUs under
    jax ≥ :data:`CACHE_HANGS_FROM`, saying so on process 0. Only process 0 writes
    the cache and the others' keys differ, so process 0 alone runs an entry that
    another program compiled (eval.py after train.py, a resume after an evaluation,
    with one ``JAX_COMPILATION_CACHE_DIR``) while its peers compile their own: under
    jax 0.12.1 the first collective of such a pair waits forever. Call before the
    first compilation."""
    if jax.__version_info__ < CACHE_HANGS_FROM or not jax.config.jax_compilation_cache_dir:
        return
    if not jax.config.jax_enable_compilation_cache or jax.process_count() == 1:
        return
    if jax.default_backend() != "cpu":
        return
    jax.config.update("jax_enable_compilation_cache", False)
    if jax.process_index() == 0:
        print(
            "note: JAX's persistent compilation cache is off for this run: on CPUs with "
            "several processes, jax 0.12.1 and newer (this is "
            f"{jax.__version__}) can hang when process 0 reads an entry another program "
            f"wrote (JAX_COMPILATION_CACHE_DIR={jax.config.jax_compilation_cache_dir})",
            file=sys.stderr,
            flush=True,
        )


def check_same_settings(settings: Mapping[str, Any], started: str) -> None:
    """Raises :class:`DistributedError` on every process unless every process was
    given the same ``settings`` (name → JSON-able value; a collective: call it on
    every process). Processes started with other values (a step count, a seed, a
    length) ran other programs in lockstep: a collective that never matches (a
    hang no heartbeat ends), silently different data, or an abort inside gloo.
    ``started``: what to start alike, for the message (e.g. "train.py")."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(settings)

    def digest(text: str) -> np.ndarray:
        return np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.uint8)

    # The names first, in a fixed shape: differing shapes would abort inside gloo.
    header = np.concatenate(
        [digest(json.dumps(names)), np.array([len(names)], np.int64).view(np.uint8)]
    )
    headers = np.asarray(multihost_utils.process_allgather(header[None], tiled=True))
    if not (headers == headers[0]).all():
        raise DistributedError(
            f"the processes were started with different lexjax versions or settings; start "
            f"every process of {started} with the same code and flags"
        )
    rows = np.stack([digest(json.dumps(settings[n], sort_keys=True, default=str)) for n in names])
    gathered = np.asarray(multihost_utils.process_allgather(rows[None], tiled=True))
    differ = [n for i, n in enumerate(names) if not (gathered[:, i] == gathered[0, i]).all()]
    if differ:
        which = [str(p) for p in range(len(gathered)) if not (gathered[p] == gathered[0]).all()]
        raise DistributedError(
            f"{', '.join(differ)} differ between processes (process {', '.join(which)} from "
            f"process 0); start every process of {started} with the same flags"
        )


def _gather_flags(flag: bool) -> np.ndarray:
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(np.array([int(flag)], np.int32))


def any_process(flag: bool) -> bool:
    """True if ``flag`` is true on any process (a collective: call it on every process)."""
    return flag if jax.process_count() == 1 else bool(np.any(_gather_flags(flag)))


def all_processes(flag: bool) -> bool:
    """True only if ``flag`` is true on every process (a collective)."""
    return flag if jax.process_count() == 1 else bool(np.all(_gather_flags(flag)))


def process_0s(values: list[int]) -> list[int]:
    """Process 0's ``values`` (int32 integers) on every process (a collective): one
    decision where each process's own view (a directory listing) may differ."""
    if jax.process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    # The length first: the broadcast array must have one shape everywhere.
    count = int(multihost_utils.broadcast_one_to_all(np.array([len(values)], np.int32))[0])
    mine = values if jax.process_index() == 0 else [0] * count
    shared = multihost_utils.broadcast_one_to_all(np.array(mine, np.int32).reshape(count))
    return [int(v) for v in np.asarray(shared)]


@contextlib.contextmanager
def first_process_speaks():
    """On processes other than 0, stdout and stderr go nowhere inside the block (the
    reports are written by process 0 alone); an error still leaves the block and
    reaches the program's :func:`lexjax.errors.report`, on every process."""
    if jax.process_index() == 0:
        yield
        return
    with (
        open(os.devnull, "w") as sink,
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
    ):
        yield
