"""lexjax/distributed.py in this one process: the cluster flags' checks, the detection
of a launcher, the waits before joining, joining with ``jax.distributed.initialize``
replaced, and the collectives with several processes simulated (each peer's part
recorded from the same function run as that peer). The real joined runs are
tests/test_multihost.py's."""

from __future__ import annotations

import contextlib
import socket
import sys

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

from lexjax import distributed
from lexjax.errors import ConfigError, DistributedError

CLUSTER_VARIABLES = (
    "TPU_WORKER_HOSTNAMES",
    "TPU_SKIP_MDS_QUERY",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
)


@pytest.fixture
def no_cluster(monkeypatch):
    """No launcher's variables and no TPU device files, whatever this machine has."""
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(distributed, "_tpu_runtime_installed", lambda: True)
    return monkeypatch


@pytest.mark.parametrize(
    "environ,devices,expected",
    [
        ({}, False, None),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1"}, False, "Cloud TPU"),
        ({}, True, "Cloud TPU"),
        ({"TPU_SKIP_MDS_QUERY": "1"}, True, None),
        ({"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2"}, False, "SLURM"),
        ({"SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1"}, False, None),  # one task
        ({"SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "x"}, False, None),
        ({"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NTASKS": "4"}, False, None),  # no srun step
        ({"OMPI_COMM_WORLD_SIZE": "2"}, False, "Open MPI"),
        ({"OMPI_COMM_WORLD_SIZE": "1"}, False, None),
        ({"OMPI_COMM_WORLD_RANK": "3"}, False, None),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"}, False, "Kubernetes"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, False, None),  # any pod: not an Indexed Job
        ({"JOB_COMPLETION_INDEX": "0"}, False, None),
    ],
)
def test_detect_cluster_finds_the_launchers_its_docstring_names_and_no_other(
    no_cluster, environ, devices, expected
):
    """A launcher wrongly detected makes a single process wait for peers that never come."""
    for name, value in environ.items():
        no_cluster.setenv(name, value)
    accel = lambda pattern: ["/dev/accel0"] if pattern.startswith("/dev/accel") else []
    no_cluster.setattr(distributed.glob, "glob", accel if devices else lambda pattern: [])
    assert distributed.detect_cluster() == expected


@pytest.mark.parametrize("device", ["/dev/accel0", "/dev/vfio/12"])
def test_device_files_are_a_cloud_tpu_only_where_a_tpu_runtime_is_installed(monkeypatch, device):
    """A GPU host passing devices to VMs has /dev/vfio/N: taken for a Cloud TPU, a
    single process there tried to join a cluster that did not exist (exit 7). JAX
    needs libtpu (jax[tpu]) or TPU_LIBRARY_PATH to use a TPU at all."""
    for name in CLUSTER_VARIABLES + ("TPU_LIBRARY_PATH",):
        monkeypatch.delenv(name, raising=False)
    pattern = device.rstrip("0123456789") + "[0-9]*"
    monkeypatch.setattr(distributed.glob, "glob", lambda p: [device] if p == pattern else [])
    installed = set()
    find_spec = lambda name: object() if name in installed else None
    monkeypatch.setattr(distributed.importlib.util, "find_spec", find_spec)
    assert distributed.detect_cluster() is None
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/lib/libtpu.so")
    assert distributed.detect_cluster() == "Cloud TPU"
    monkeypatch.delenv("TPU_LIBRARY_PATH")
    installed.add("libtpu")
    assert distributed.detect_cluster() == "Cloud TPU"


@pytest.mark.parametrize(
    "options,explicit",
    [
        (dict(), False),
        (dict(mode="on"), False),
        (dict(mode="on", num_processes=2, process_id=1), False),  # JAX finds the address
        (dict(mode="on", process_id=1), False),
        (dict(coordinator_address="h:1", num_processes=2, process_id=1), True),
        (dict(mode="on", coordinator_address="[::1]:1234", num_processes=1, process_id=0), True),
    ],
)
def test_cluster_options_accepted(options, explicit):
    assert distributed._check(distributed.ClusterOptions(**options)) is explicit


@pytest.mark.parametrize(
    "options,said",
    [
        (dict(mode="maybe"), "--distributed='maybe': use auto, on or off"),
        (dict(mode="off", process_id=0), "--process_id was given with --distributed=off"),
        (dict(process_id=0, num_processes=2), "--num_processes, --process_id given without"),
        (dict(mode="on", num_processes=0), "--num_processes=0 must be positive"),
        (
            dict(coordinator_address="h:1", num_processes=0, process_id=0),
            "--num_processes=0 must be positive",
        ),
        (dict(mode="on", process_id=-1), "--process_id=-1 must be in [0, --num_processes)"),
    ],
)
def test_cluster_options_refused_in_one_line_naming_the_flag(options, said):
    with pytest.raises(ConfigError) as raised:
        distributed._check(distributed.ClusterOptions(**options))
    assert str(raised.value).startswith(said) and "\n" not in str(raised.value)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:  # a container without IPv6
        return False
    return socket.has_dualstack_ipv6()


LOOPBACKS = [
    ("127.0.0.1", "127.0.0.1"),
    pytest.param(
        "::1", "[::1]", marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6")
    ),
]


def _listening(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family)
    server.bind((host, 0))
    server.listen()
    return server


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("host,address", LOOPBACKS)
def test_process_0_refuses_a_port_taken_on_any_interface(host, address):
    """JAX's coordinator listens on every interface, IPv6 too: a port another program
    holds on one of them fails it (a segfault, seen)."""
    with _listening(host) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(DistributedError, match=f"port {port} "):
            distributed._check_port_free(f"{address}:{port}")
    distributed._check_port_free(f"{address}:{_unused_port()}")


@pytest.mark.parametrize("host,address", LOOPBACKS)
def test_a_worker_goes_on_once_the_coordinator_listens(host, address):
    with _listening(host) as server:
        distributed._await_coordinator(f"{address}:{server.getsockname()[1]}", 0)


def test_a_worker_waits_for_a_coordinator_that_starts_late(monkeypatch):
    """Process 0 not listening yet at the first try: the worker retries until it is
    (here it starts during the first pause), and goes on connected to it."""
    port, started = _unused_port(), []

    def pause(_):
        if not started:
            started.append(socket.create_server(("127.0.0.1", port)))

    monkeypatch.setattr(distributed.time, "sleep", pause)
    distributed._await_coordinator(f"127.0.0.1:{port}", 60)
    assert started, "went on before the coordinator listened"
    with started[0] as coordinator:
        coordinator.settimeout(60)
        coordinator.accept()[0].close()  # the worker's connection


def test_a_worker_stops_once_the_coordinator_misses_its_deadline(monkeypatch):
    """Timeout 0: the first refused connection ends the wait, with no retry."""

    def retry(_):
        raise AssertionError("retried past the deadline")

    monkeypatch.setattr(distributed.time, "sleep", retry)
    address = f"127.0.0.1:{_unused_port()}"
    with pytest.raises(DistributedError, match=f"^the coordinator {address} did not accept"):
        distributed._await_coordinator(address, 0)


def test_the_joining_timer_ends_the_process_with_status_7_in_one_line(monkeypatch, capsys):
    class Exited(Exception):
        pass

    def exit_(status):
        raise Exited(status)

    monkeypatch.setattr(distributed.os, "_exit", exit_)
    with pytest.raises(Exited) as exited:
        distributed._exit_joining("no peer came")
    assert exited.value.args == (DistributedError.exit_code,) == (7,)
    assert capsys.readouterr().err == "error: no peer came\n"


class _Joining:
    """jax.distributed.initialize replaced: its calls, the joining timers and what
    they would have ended the process with."""

    def __init__(self, monkeypatch, fail=None, hang=False):
        self.calls, self.timers, self.exits, self.fail, self.hang = [], [], [], fail, hang
        joining = self

        class Timer(distributed.threading.Timer):
            def start(self):
                joining.timers.append(self)
                super().start()

        def exit_joining(message):
            self.exits.append(message)

        monkeypatch.setattr(jax.distributed, "initialize", self.initialize)
        monkeypatch.setattr(distributed.threading, "Timer", Timer)
        monkeypatch.setattr(distributed, "_exit_joining", exit_joining)
        before = jax.config.jax_cpu_collectives_implementation
        monkeypatch.setattr(distributed.jax.config, "update", self.config_update(before))

    def config_update(self, collectives):
        original = jax.config.update
        self.collectives = collectives

        def update(name, value):  # this process's own collectives stay as they are
            if name == "jax_cpu_collectives_implementation":
                self.collectives = value
                return
            original(name, value)

        return update

    def initialize(self, **kwargs):
        self.calls.append(kwargs)
        if self.hang:  # until the timer would have ended the process
            self.timers[0].join(timeout=60)
        if self.fail:
            raise RuntimeError(self.fail)


def test_joining_with_the_flags_passes_them_on_and_leaves_no_timer(no_cluster):
    """The timer ends a process that could not join; one that joined must live on
    past the timeout."""
    joining = _Joining(no_cluster)
    address = f"127.0.0.1:{_unused_port()}"
    options = distributed.ClusterOptions(
        coordinator_address=address,
        num_processes=1,
        process_id=0,
        heartbeat_timeout_s=7,
        initialization_timeout_s=1,
        shutdown_timeout_s=9,
    )
    assert distributed.join(options) == "flags"
    assert joining.calls == [
        dict(
            coordinator_address=address,
            num_processes=1,
            process_id=0,
            initialization_timeout=1,
            heartbeat_timeout_seconds=7,
            shutdown_timeout_seconds=9,
        )
    ]
    assert joining.collectives == "gloo" and len(joining.timers) == 1
    joining.timers[0].join(timeout=60)  # cancelled: at once; else it fires after 2 s
    assert joining.exits == []


def test_joining_on_cpus_turns_the_compilation_cache_off_where_it_hangs(no_cluster, tmp_path):
    """Before the first compilation (the collective that ends joining compiles)."""
    _Joining(no_cluster)
    no_cluster.setattr(jax, "__version_info__", (0, 13, 0))
    no_cluster.setattr(jax, "process_count", lambda: 2)
    no_cluster.setattr(distributed, "_gather_flags", lambda flag: np.array([0, 0], np.int32))
    settings = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    before = {name: getattr(jax.config, name) for name in settings}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_enable_compilation_cache", True)
        options = distributed.ClusterOptions(
            coordinator_address=f"127.0.0.1:{_unused_port()}", num_processes=2, process_id=0
        )
        distributed.join(options)
        assert not jax.config.jax_enable_compilation_cache
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_a_worker_waits_for_process_0_and_does_not_serve_its_port(no_cluster):
    joining = _Joining(no_cluster)
    with _listening("127.0.0.1") as coordinator:  # process 0, joining
        address = f"127.0.0.1:{coordinator.getsockname()[1]}"
        options = distributed.ClusterOptions(
            coordinator_address=address, num_processes=2, process_id=1
        )
        assert distributed.join(options) == "flags"
    assert [call["process_id"] for call in joining.calls] == [1]


def test_a_peer_that_never_registers_ends_the_process_just_after_the_timeout(no_cluster):
    joining = _Joining(no_cluster, hang=True)
    address = f"127.0.0.1:{_unused_port()}"
    options = distributed.ClusterOptions(
        coordinator_address=address, num_processes=2, process_id=0, initialization_timeout_s=1
    )
    distributed.join(options)
    assert joining.exits == [
        f"could not join the multi-process run via {address} within 1s: not every process "
        "registered (--num_processes=2 here); start every process with the same "
        "--coordinator_address and --num_processes, and distinct --process_id"
    ]


@pytest.mark.parametrize(
    "mode,environ,joined",
    [
        ("auto", {}, None),
        ("off", {"OMPI_COMM_WORLD_SIZE": "2"}, None),
        ("auto", {"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI"),
        ("on", {}, "jax auto-detection"),
    ],
)
def test_joining_without_the_flags_follows_the_mode_and_the_launcher(
    no_cluster, mode, environ, joined
):
    """Without the flags JAX finds the coordinator, and no timer runs: a launcher's
    detection spends part of the same timeout first."""
    for name, value in environ.items():
        no_cluster.setenv(name, value)
    joining = _Joining(no_cluster)
    assert distributed.join(distributed.ClusterOptions(mode=mode)) == joined
    assert len(joining.calls) == (joined is not None) and joining.timers == []
    for call in joining.calls:
        assert (call["coordinator_address"], call["num_processes"], call["process_id"]) == (
            None,
            None,
            None,
        )


@pytest.mark.parametrize(
    "given,reason,unnamed",
    [
        (
            dict(),
            "coordinator_address should be defined.",
            "--coordinator_address, --num_processes or --process_id",
        ),
        (
            dict(num_processes=2, process_id=1),
            "coordinator_address should be defined.",
            "--coordinator_address",
        ),
        (
            dict(coordinator_address="h:1", process_id=0),
            "Number of processes must be defined.",
            "--num_processes",
        ),
    ],
)
def test_distributed_on_with_nothing_to_join_says_what_is_missing(
    no_cluster, given, reason, unnamed
):
    """It said "no --coordinator_address was given" also where that flag was given."""
    _Joining(no_cluster, fail=reason)
    with pytest.raises(DistributedError) as raised:
        distributed.join(distributed.ClusterOptions(mode="on", **given))
    assert str(raised.value) == (
        f"could not join a multi-process run ({reason}): no {unnamed} was given and no "
        "cluster launcher was detected; give --coordinator_address, --num_processes and "
        "--process_id, or leave --distributed at auto"
    )


@pytest.mark.parametrize(
    "reason,within",
    [("DEADLINE_EXCEEDED: Barrier timed out", True), ("UNAVAILABLE: connection reset", False)],
)
def test_a_failed_join_says_whether_it_timed_out(no_cluster, reason, within):
    _Joining(no_cluster, fail=reason)
    address = f"127.0.0.1:{_unused_port()}"
    options = distributed.ClusterOptions(
        coordinator_address=address, num_processes=2, process_id=0, initialization_timeout_s=5
    )
    with pytest.raises(DistributedError) as raised:
        distributed.join(options)
    head = f"could not join the multi-process run via {address}"
    assert str(raised.value).startswith(f"{head} within 5s ({reason})" if within else head)
    assert ("within" in str(raised.value)) == within


def _simulated(monkeypatch, function, names, own, peers, index=0):
    """``function(own)`` run as process ``index`` of ``1 + len(peers)``: each peer's
    contributions to the gathers ``names`` (of multihost_utils) recorded first from
    ``function(peer)`` run as that peer. The gathers check that every process gives
    arrays of one shape, as gloo's need."""
    count = 1 + len(peers)
    monkeypatch.setattr(jax, "process_count", lambda: count)
    order = list(range(count))
    others = order[:index] + order[index + 1 :]
    given = {}
    for peer, settings in zip(others, peers):
        given[peer] = []
        monkeypatch.setattr(jax, "process_index", lambda peer=peer: peer)
        for name in names:
            monkeypatch.setattr(multihost_utils, name, _recording(name, given[peer]))
        with contextlib.suppress(DistributedError):
            function(settings)
    monkeypatch.setattr(jax, "process_index", lambda: index)
    calls = []

    def collective(name):
        def run(x, *args, **kwargs):
            k = len(calls)
            calls.append(name)
            parts = {p: np.asarray(given[p][k][1]) for p in others}
            parts[index] = np.asarray(x)
            for part in parts.values():
                assert part.shape == parts[index].shape, (name, part.shape, parts[index].shape)
            tiled = kwargs.get("tiled", args[0] if args else False)
            rows = [parts[p] for p in order]
            return np.concatenate(rows) if tiled else np.stack(rows)

        return run

    for name in names:
        monkeypatch.setattr(multihost_utils, name, collective(name))
    return function(own)


def _recording(name, into):
    def record(x, *args, **kwargs):
        into.append((name, np.array(x)))
        tiled = kwargs.get("tiled", args[0] if args else False)
        return np.concatenate([x, x]) if tiled else np.stack([x, x])

    return record


def _check_same(settings):
    distributed.check_same_settings(settings, "train.py")


@pytest.mark.parametrize(
    "own,peers,said",
    [
        ({"seed": 0, "steps": 3}, [{"seed": 0, "steps": 3}], None),
        (
            {"seed": 0, "steps": 3, "len": 64},
            [{"seed": 7, "steps": 3, "len": 32}],
            "len, seed differ between processes (process 1 from process 0); "
            "start every process of train.py with the same flags",
        ),
        (
            {"seed": 0, "steps": 3},
            [{"seed": 0, "steps": 3}, {"seed": 0, "steps": 5}],
            "steps differ between processes (process 2 from process 0); "
            "start every process of train.py with the same flags",
        ),
        (
            {"seed": 0},
            [{"seed": 0, "steps": 3}],
            "the processes were started with different lexjax versions or settings; start "
            "every process of train.py with the same code and flags",
        ),
    ],
)
def test_settings_are_compared_across_processes(monkeypatch, own, peers, said):
    names = ["process_allgather"]
    if said is None:
        _simulated(monkeypatch, _check_same, names, own, peers)
        return
    with pytest.raises(DistributedError) as raised:
        _simulated(monkeypatch, _check_same, names, own, peers)
    assert str(raised.value) == said


def test_process_0s_list_reaches_every_process(monkeypatch):
    """Process 1 listed late (step 3 already gone): it gets process 0's list, through
    broadcasts of one shape on every process."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    sent = []

    def from_process_0(x):
        sent.append(np.array(x))
        return np.asarray(x)

    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", from_process_0)
    assert distributed.process_0s([3, 6]) == [3, 6]
    received = iter(sent)

    def to_process_1(x):
        x, sent = np.asarray(x), next(received)
        assert x.shape == sent.shape, (x.shape, sent.shape)
        return sent

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", to_process_1)
    assert distributed.process_0s([6]) == [3, 6]


@pytest.mark.parametrize("flags,anyone,everyone", [((0, 0), 0, 0), ((1, 0), 1, 0), ((1, 1), 1, 1)])
def test_any_and_all_processes(monkeypatch, flags, anyone, everyone):
    names = ["process_allgather"]
    got = _simulated(monkeypatch, distributed.any_process, names, flags[0], [flags[1]])
    assert got is bool(anyone)
    got = _simulated(monkeypatch, distributed.all_processes, names, flags[0], [flags[1]])
    assert got is bool(everyone)


def test_only_process_0_speaks_and_an_error_still_leaves_the_block(monkeypatch, capsys):
    for index in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        with pytest.raises(ValueError, match="bad"), distributed.first_process_speaks():
            print("out")
            print("err", file=sys.stderr)
            raise ValueError("bad")
        said = capsys.readouterr()
        assert (said.out, said.err) == (("out\n", "err\n") if index == 0 else ("", ""))


@pytest.mark.parametrize("index", [0, 1])  # process 0 alone says so (README)
@pytest.mark.parametrize(
    "backend,enabled,off", [("cpu", True, True), ("gpu", True, False), ("cpu", False, False)]
)
def test_the_compilation_cache_is_turned_off_on_cpus_only_and_said_only_when_it_was_on(
    monkeypatch, capsys, tmp_path, backend, enabled, off, index
):
    settings = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    before = {name: getattr(jax.config, name) for name in settings}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: index)
    monkeypatch.setattr(jax, "__version_info__", (0, 13, 0))
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_enable_compilation_cache", enabled)
        distributed._no_cache_on_cpu_processes()
        assert jax.config.jax_enable_compilation_cache is (enabled and not off)
        assert capsys.readouterr().err.startswith("note: ") is (off and index == 0)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
