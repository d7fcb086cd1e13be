"""One writer per workdir: the lease (lexjax.lease) in-process, then with real train.py
processes — a second job is refused while the first finishes untouched, readers need
no lease and read only complete, verified steps, a killed holder's lease is taken over."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from lexjax import checkpoint as ckpt_lib
from lexjax import config as cfg
from lexjax import evaluation, training
from lexjax import lease as lease_lib
from lexjax.errors import CheckpointError, DataError
from tests import processes as P

HOST = socket.gethostname()


def write_lease(workdir, **fields):
    """Another job's lease, written as a job writes its lease."""
    record = {"host": HOST, "pid": os.getpid(), "started": "then", "token": "old"}
    record |= {"heartbeat": time.time(), "timeout_s": 60.0} | fields
    with lease_lib._locked(str(workdir)):  # as every change of a lease is made
        pathlib.Path(workdir, lease_lib.LEASE_FILE).write_text(json.dumps(record))


def lease_record(workdir) -> dict:
    return json.loads(pathlib.Path(workdir, lease_lib.LEASE_FILE).read_text())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


def refused(workdir) -> CheckpointError:
    """The error a newcomer's acquire on ``workdir`` ends in. One that never ends (it
    missed each renewal and watched the renewed lease again) fails the test instead
    of hanging it."""
    outcome = []

    def acquire():
        try:
            lease_lib.WorkdirLease(workdir, log=lambda _: None).acquire()
            outcome.append("taken")
        except CheckpointError as e:
            outcome.append(e)

    newcomer = threading.Thread(target=acquire, daemon=True)
    newcomer.start()
    newcomer.join(120)  # a hang guard only
    assert outcome, "the newcomer still watches a lease whose holder renews it"
    assert isinstance(outcome[0], CheckpointError), "the newcomer took a live job's lease"
    return outcome[0]


def test_a_held_lease_refuses_a_second_job_naming_the_holder(tmp_path):
    with lease_lib.WorkdirLease(tmp_path) as first:
        record = lease_record(tmp_path)
        assert (record["host"], record["pid"], record["token"]) == (HOST, os.getpid(), first.token)
        with pytest.raises(CheckpointError) as e:
            lease_lib.WorkdirLease(tmp_path).acquire()
        assert f"is in use by a training job on host {HOST} pid {os.getpid()}" in str(e.value)
        assert "\n" not in str(e.value)
    assert not (tmp_path / lease_lib.LEASE_FILE).exists()  # released on exit
    with lease_lib.WorkdirLease(tmp_path):
        pass


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    pid = dead_pid()
    write_lease(tmp_path, pid=pid)  # fresh heartbeat, but the process is gone
    notes = []
    with lease_lib.WorkdirLease(tmp_path, log=notes.append) as lease:
        assert lease_record(tmp_path)["token"] == lease.token
    assert notes == [
        f"note: took over the stale lease of host {HOST} pid {pid} (started then): "
        f"pid {pid} is gone"
    ]


def test_a_killed_holder_not_yet_reaped_is_taken_over_at_once(tmp_path):
    """A zombie (killed, its parent not yet waiting: a supervisor about to restart the
    job) still answers kill(pid, 0): the restarted job was refused as in use."""
    holder = subprocess.Popen(["sleep", "60"])
    try:
        write_lease(tmp_path, pid=holder.pid, pid_start=lease_lib._process_start(holder.pid))
        with pytest.raises(CheckpointError, match=f"in use by .* pid {holder.pid}"):
            lease_lib.WorkdirLease(tmp_path).acquire()  # alive: refused
        holder.kill()
        stat = pathlib.Path(f"/proc/{holder.pid}/stat")
        while stat.read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":  # not waited for
            time.sleep(0.01)
        notes = []
        with lease_lib.WorkdirLease(tmp_path, log=notes.append):
            assert lease_lib.live_holder(tmp_path) is not None  # this one
        assert notes[0].endswith(f"pid {holder.pid} is gone"), notes
    finally:
        holder.kill()
        holder.wait()


def test_a_collective_that_fails_after_the_lease_is_taken_releases_it(tmp_path, monkeypatch):
    """Process 0 took the lease, then the agreement with the other processes failed (a
    peer gone): the lease stayed, and a job in another PID namespace waited its timeout."""
    from lexjax import distributed
    from lexjax.errors import DistributedError

    def peer_gone(_):
        assert lease_record(tmp_path)["pid"] == os.getpid()  # taken before the collective
        raise DistributedError("process 1 is gone")

    monkeypatch.setattr(distributed, "all_processes", peer_gone)
    held = lease_lib.hold(str(tmp_path), timeout_s=60.0)
    with pytest.raises(DistributedError, match="process 1 is gone"), held:
        pass
    assert not (tmp_path / lease_lib.LEASE_FILE).exists()


@pytest.mark.parametrize("process", [0, 1])
def test_a_lease_process_0_cannot_take_stops_every_process(tmp_path, monkeypatch, process):
    """Two processes (their agreement simulated: process 0 refused, process 1 ready):
    both raise before the block, process 0 its own refusal, so no process trains a
    workdir another job holds."""
    import jax

    from lexjax import distributed

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(distributed, "_gather_flags", lambda _: np.array([0, 1], np.int32))
    entered = []
    with lease_lib.WorkdirLease(tmp_path):  # another job's, alive
        said = "in use by a training job" if process == 0 else "process 0 could not take"
        held = lease_lib.hold(str(tmp_path), timeout_s=60.0, log=lambda _: None)
        with pytest.raises(CheckpointError, match=said), held:
            entered.append(process)
    assert not entered
    # The agreement itself, by hand: any and all of (False, True).
    assert distributed.any_process(True) and not distributed.all_processes(True)


def test_a_reader_is_told_of_a_live_holder_only(tmp_path):
    """live_holder (what eval.py's note names) judges a lease as a newcomer would, and
    writes nothing: no lease, a gone holder, a silent other host: None."""
    assert lease_lib.live_holder(tmp_path) is None
    with lease_lib.WorkdirLease(tmp_path) as lease:  # this process, holding it
        started = lease_record(tmp_path)["started"]
        assert (
            lease_lib.live_holder(tmp_path) == f"host {HOST} pid {os.getpid()} (started {started})"
        )
        assert lease_record(tmp_path)["token"] == lease.token
    write_lease(tmp_path, pid=dead_pid())
    before = (tmp_path / lease_lib.LEASE_FILE).read_bytes()
    assert lease_lib.live_holder(tmp_path) is None
    assert (tmp_path / lease_lib.LEASE_FILE).read_bytes() == before  # nothing taken over
    write_lease(tmp_path, host="elsewhere", pid=1)  # its heartbeat fresh
    assert lease_lib.live_holder(tmp_path) == "host elsewhere pid 1 (started then)"
    write_lease(tmp_path, host="elsewhere", pid=1, heartbeat=time.time() - 600)
    assert lease_lib.live_holder(tmp_path) is None  # silent beyond its 60 s timeout


def killed_holders_lease(workdir) -> dict:
    """The lease.json a holder leaves when it is SIGKILLed: taken by a real WorkdirLease
    in another process that then kills itself."""
    take = (
        "import os, signal, sys; from lexjax import lease; "
        "lease.WorkdirLease(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)"
    )
    env = {**os.environ, "PYTHONPATH": str(P.ROOT), "JAX_PLATFORMS": "cpu"}
    holder = subprocess.run([sys.executable, "-c", take, str(workdir)], env=env, timeout=120)
    assert holder.returncode == -signal.SIGKILL
    return lease_record(workdir)


def test_a_reused_pid_is_not_the_holder(tmp_path):
    """A restart that gets the killed holder's pid (a restarted container's job is pid 1
    again) takes its lease over at once: that pid is now this process, or another live
    process, one that started after the holder."""
    record = killed_holders_lease(tmp_path)
    assert record["host"] == HOST and isinstance(record["pid_start"], int)
    later = subprocess.Popen(["sleep", "60"])  # a live process with a reused pid
    try:
        cases = [
            (os.getpid(), record["pid_start"], "is this process"),
            (os.getpid(), None, "is this process"),  # no /proc, or an older lexjax's lease
            (later.pid, record["pid_start"], "is another process now"),
        ]
        for pid, start, what in cases:
            pathlib.Path(tmp_path, lease_lib.LEASE_FILE).write_text(
                json.dumps({**record, "pid": pid, "pid_start": start})
            )
            notes = []
            with lease_lib.WorkdirLease(tmp_path, log=notes.append) as lease:
                assert lease_record(tmp_path)["token"] == lease.token
            assert notes == [
                f"note: took over the stale lease of host {HOST} pid {pid} (started "
                f"{record['started']}): pid {pid} {what} (the holder is gone and its pid "
                "was reused)"
            ]
        # The live process that holds the lease is still its holder.
        alive = {**record, "pid": later.pid, "pid_start": lease_lib._process_start(later.pid)}
        pathlib.Path(tmp_path, lease_lib.LEASE_FILE).write_text(json.dumps(alive))
        with pytest.raises(CheckpointError, match=f"in use by a training job on host {HOST} pid"):
            lease_lib.WorkdirLease(tmp_path).acquire()
    finally:
        later.kill()
        later.wait()


def test_a_holder_in_another_pid_namespace_is_judged_by_its_heartbeat(tmp_path):
    """Two containers that share a hostname (docker --network host, Kubernetes
    hostNetwork) do not share pids: a live job's lease naming pid 1 was taken over
    at once ("pid 1 is another process now"), and the job lost its steps since its
    last checkpoint. A holder whose pid cannot be checked here is watched until its
    heartbeat is renewed (in use) or is older than its timeout (taken over)."""
    other = {"pid": 1, "pid_start": 12345, "pid_ns": "pid:[1]", "timeout_s": 4.0}
    path = tmp_path / lease_lib.LEASE_FILE
    write_lease(tmp_path, heartbeat=time.time(), **other)
    stop = threading.Event()

    def renew():  # the holder's heartbeat thread
        while not stop.wait(1.0):
            path.write_text(json.dumps({**json.loads(path.read_text()), "heartbeat": time.time()}))

    renewer = threading.Thread(target=renew)
    renewer.start()
    notes = []
    try:
        with pytest.raises(
            CheckpointError, match=f"is in use by a training job on host {HOST} pid 1 "
        ):
            lease_lib.WorkdirLease(tmp_path, log=notes.append).acquire()
    finally:
        stop.set()
        renewer.join()
    assert len(notes) == 1 and "in another PID namespace (or boot) of this host" in notes[0], notes
    notes.clear()
    write_lease(tmp_path, heartbeat=time.time(), **other)  # a holder that is gone
    started = time.monotonic()
    with lease_lib.WorkdirLease(tmp_path, log=notes.append) as lease:
        assert lease_record(tmp_path)["token"] == lease.token
    assert 3.5 < time.monotonic() - started < 30
    # The age is rounded and the wait polls: 4 s or a little more (the bound above times it).
    assert len(notes) == 2 and re.search(r"no heartbeat for \d+ s \(timeout 4 s\)$", notes[1])


def test_a_live_job_in_another_pid_namespace_keeps_its_lease(tmp_path):
    """The same with a real holder: a WorkdirLease taken inside `unshare --pid` (pid 1
    there), refused here; once it is killed, taken over after its timeout."""
    take = (
        "import sys, time; from lexjax import lease; "
        "lease.WorkdirLease(sys.argv[1], timeout_s=4).acquire(); print('held', flush=True); "
        "time.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": str(P.ROOT), "JAX_PLATFORMS": "cpu"}
    argv = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        sys.executable,
        "-c",
        take,
        str(tmp_path),
    ]
    try:
        holder = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    except FileNotFoundError:
        pytest.skip("needs unshare")
    try:
        if holder.stdout.readline() != "held\n":
            pytest.skip(f"cannot make a PID namespace here: {holder.communicate()[1][-300:]}")
        assert lease_record(tmp_path)["pid"] == 1
        assert f"in use by a training job on host {HOST} pid 1 " in str(refused(tmp_path))
    finally:
        holder.kill()  # unshare, and with it its namespace's pid 1
        holder.wait()
    notes = []
    with lease_lib.WorkdirLease(tmp_path, log=notes.append):
        pass
    assert re.search(r"no heartbeat for \d+ s \(timeout 4 s\)$", notes[-1]), notes


def test_another_hosts_lease_is_stale_only_after_its_own_timeout(tmp_path):
    write_lease(tmp_path, host="elsewhere", heartbeat=time.time() - 50, timeout_s=60.0)
    with pytest.raises(CheckpointError, match="in use by a training job on host elsewhere"):
        lease_lib.WorkdirLease(tmp_path, timeout_s=1).acquire()  # the holder's timeout counts
    write_lease(tmp_path, host="elsewhere", heartbeat=time.time() - 7, timeout_s=4.0)
    notes = []
    start = time.monotonic()
    with lease_lib.WorkdirLease(tmp_path, log=notes.append):
        pass
    # Watched for 1.5 heartbeat intervals first (its clock may be behind ours).
    assert time.monotonic() - start >= 2.5
    assert "looks stale by this host's clock; watching it 2.5 s" in notes[0]
    said = r"not renewed while watched for 2\.5 s \(no heartbeat for \d+ s \(timeout 4 s\) by our"
    assert len(notes) == 2 and re.search(said + r" clock\)$", notes[1]), notes


def test_a_clock_behind_ours_makes_no_renewed_lease_of_another_host_stale(tmp_path):
    """Its heartbeat's time is its host's clock: 130 s behind ours, a live job's lease
    (timeout 120 s) was taken over at once, and two jobs trained one workdir."""
    behind = time.time() - 130
    write_lease(tmp_path, host="elsewhere", heartbeat=behind, timeout_s=4.0)
    done = threading.Event()

    def renew():  # as its heartbeat thread does, every timeout / 4, by its own clock
        beat = behind
        while not done.wait(1.0):
            beat += 1.0
            write_lease(tmp_path, host="elsewhere", heartbeat=beat, timeout_s=4.0)

    holder = threading.Thread(target=renew)
    holder.start()
    try:
        assert "in use by a training job on host elsewhere" in str(refused(tmp_path))
    finally:
        done.set()
        holder.join()
    assert lease_record(tmp_path)["token"] == "old"


def test_a_copied_workdir_is_not_held_by_the_original_job(tmp_path, monkeypatch):
    """``cp -a`` of a workdir a job trains copies its lease too: the copy was "in use by"
    the original's job, which renews only its own file, until the copy's heartbeat
    timed out. The lease records which directory it belongs to; another host's lease
    is still judged by its heartbeat (device numbers differ between hosts)."""
    original, copy = tmp_path / "original", tmp_path / "copy"
    original.mkdir()
    with lease_lib.WorkdirLease(original):
        shutil.copytree(original, copy)
        notes = []
        with lease_lib.WorkdirLease(copy, log=notes.append):
            assert lease_record(copy)["directory"] != lease_record(original)["directory"]
        assert notes == [
            f"note: took over the stale lease of host {HOST} pid {os.getpid()} (started "
            f"{lease_record(original)['started']}): it was copied from another workdir, "
            f"which pid {os.getpid()} trains"
        ]
        # The original's job gone too, or its pid another process's now: not said to train.
        for gone in ({"pid": dead_pid()}, {"pid_start": -1}):
            record = lease_record(original) | gone
            (copy / lease_lib.LEASE_FILE).write_text(json.dumps(record))
            notes = []
            with lease_lib.WorkdirLease(copy, log=notes.append):
                pass
            assert notes[0].endswith(
                f"pid {record['pid']} (started {record['started']}): it was copied from another "
                "workdir"
            ), notes
        # A start time this host cannot read (no /proc) is no sign of another process.
        monkeypatch.setattr(lease_lib, "_process_start", lambda pid: None)
        (copy / lease_lib.LEASE_FILE).write_text(json.dumps(lease_record(original)))
        notes = []
        with lease_lib.WorkdirLease(copy, log=notes.append):
            pass
        assert notes[0].endswith(f"which pid {os.getpid()} trains"), notes
        monkeypatch.undo()
        (copy / lease_lib.LEASE_FILE).write_text(
            json.dumps(lease_record(original) | {"host": "elsewhere"})
        )
        with pytest.raises(CheckpointError, match="in use by a training job on host elsewhere"):
            lease_lib.WorkdirLease(copy).acquire()


def test_an_unreadable_lease_says_so_and_when_it_is_taken_over(tmp_path):
    path = tmp_path / lease_lib.LEASE_FILE
    path.write_text("garbage{")
    with pytest.raises(CheckpointError) as e:
        lease_lib.WorkdirLease(tmp_path, timeout_s=60).acquire()
    assert str(e.value) == (
        f"the workdir lease {path} cannot be read; it is taken over once it is 60 s old "
        "(--lease_timeout_s), or delete it if no training job uses this workdir"
    )
    then = time.time() - 70
    os.utime(path, (then, then))
    notes = []
    with lease_lib.WorkdirLease(tmp_path, timeout_s=60, log=notes.append):
        pass
    assert len(notes) == 1 and re.fullmatch(
        rf"note: took over the unreadable {re.escape(str(path))}: no heartbeat for 7\d s "
        r"\(timeout 60 s\)",
        notes[0],
    ), notes


def test_another_users_unreadable_lease_names_its_owner_and_is_never_taken_over(
    tmp_path, monkeypatch
):
    """A lease this user may not read (another user's, umask 077): "cannot be read"
    named no reason and invited deleting it; once old its takeover failed after renaming
    it aside, leaving no lease and a .stale file. Its age proves nothing (the holder's
    timeout is in it, unread): it is refused, naming its owner. Leases are now written
    readable by all, so only older ones are so."""
    path = tmp_path / lease_lib.LEASE_FILE
    path.write_text(json.dumps({"token": "theirs", "host": HOST, "pid": os.getpid()}))
    real_open, real_access = open, os.access
    refused = lambda p: str(p) == str(path)
    monkeypatch.setattr(
        "builtins.open",
        lambda p, *a, **k: (
            (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied", str(p)))
            if refused(p)
            else real_open(p, *a, **k)
        ),
    )
    monkeypatch.setattr(os, "access", lambda p, mode: not refused(p) and real_access(p, mode))
    monkeypatch.setattr(os, "getuid", lambda: os.stat(path).st_uid + 1)  # another user here
    owner = pwd.getpwuid(os.stat(path).st_uid).pw_name
    for age in (0, 7000):
        then = time.time() - age
        os.utime(path, (then, then))
        with pytest.raises(CheckpointError) as e:
            lease_lib.WorkdirLease(tmp_path, timeout_s=60).acquire()
        assert str(e.value) == (
            f"the workdir lease {path} cannot be read (Permission denied: user {owner}'s); it "
            "may be a live job's: ask its owner, who can delete it if no training job uses "
            "this workdir"
        )
        assert os.listdir(tmp_path) == [lease_lib.LEASE_FILE]  # nothing renamed aside
    monkeypatch.undo()
    new = tmp_path / "new"
    new.mkdir()
    umask = os.umask(0o077)  # a private umask: the lease is still readable by all
    try:
        with lease_lib.WorkdirLease(new, timeout_s=60):
            assert os.stat(new / lease_lib.LEASE_FILE).st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)


def test_a_write_that_fails_in_a_moved_workdir_says_it_moved_and_nothing_else_changes(tmp_path):
    """Only a failed write (a CheckpointError or OSError) in a workdir no longer at its path
    becomes "was moved"; the failure stays its cause, and any other error, or one in a
    workdir still in place (moved and moved back included), is raised as it was."""
    workdir, away = tmp_path / "run", tmp_path / "away"
    workdir.mkdir()
    failed = CheckpointError("writing checkpoint step 4 failed: No such file or directory")
    moved = r"^workdir .*/run was moved, renamed or deleted while this job trained; stopped"
    with (
        pytest.raises(CheckpointError, match=moved) as e,
        lease_lib.hold(str(workdir), timeout_s=60),
    ):
        workdir.rename(away)
        raise failed
    assert e.value.__cause__ is failed
    away.rename(workdir)
    for error in (ValueError("a bug"), MemoryError()):  # not a write: unchanged
        with pytest.raises(type(error)) as e, lease_lib.hold(str(workdir), timeout_s=60):
            workdir.rename(away)
            raise error
        assert e.value is error
        away.rename(workdir)
    with pytest.raises(CheckpointError) as e, lease_lib.hold(str(workdir), timeout_s=60):
        workdir.rename(away)
        away.rename(workdir)  # back where it was
        raise failed
    assert e.value is failed


def test_a_lock_file_follows_the_umask_and_another_users_can_still_be_held(tmp_path, monkeypatch):
    """The corpus build's and the study's locks were made 0644 whatever the umask: in a
    data_dir a group shares (umask 002), a second member could not open the first's lock
    for writing, "cannot create … .lock (Permission denied)"; a read-only open is enough."""
    path = str(tmp_path / ".build.lock")
    old = os.umask(0o002)
    try:
        with lease_lib.open_lock(path) as lock:
            assert lease_lib.try_flock(lock) is True
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o664
    real_open = os.open

    def another_users(name, flags, *mode):  # the file's mode refuses this user writing
        if flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real_open(name, flags, *mode)

    monkeypatch.setattr(os, "open", another_users)
    with lease_lib.open_lock(path) as lock, lease_lib.open_lock(path) as other:
        assert lease_lib.try_flock(lock) is True and lease_lib.try_flock(other) is False
    # No lock there to read (a directory this user cannot write): the refusal, not ENOENT.
    with pytest.raises(PermissionError):
        lease_lib.open_lock(str(tmp_path / "none.lock"))
    # NFS locks only files open for writing (EBADF): the refusal, not a traceback later.
    monkeypatch.setattr(
        lease_lib.fcntl, "flock", lambda *_: (_ for _ in ()).throw(OSError(errno.EBADF, "nfs"))
    )
    with pytest.raises(PermissionError):
        lease_lib.open_lock(path)


def test_the_heartbeat_keeps_a_lease_fresh_and_a_lost_lease_stops_saving(tmp_path):
    with lease_lib.WorkdirLease(tmp_path, timeout_s=0.4) as lease:
        first = lease_record(tmp_path)["heartbeat"]
        time.sleep(0.5)  # longer than the timeout: only heartbeats keep it live
        assert lease_record(tmp_path)["heartbeat"] > first
        assert lease.owned()
        lease_lib.check_held(lease, str(tmp_path))
        # A job that judged this one stale replaced the lease while it was stalled.
        write_lease(tmp_path, host="elsewhere", token="new")
        with pytest.raises(CheckpointError, match="was taken over by another job"):
            lease_lib.check_held(lease, str(tmp_path))
    assert lease_record(tmp_path)["token"] == "new"  # never deleted by the old holder


def test_a_lease_lost_on_process_0_stops_the_other_processes_saving_too(tmp_path, monkeypatch):
    """Process 1 holds no lease (None): it learns from process 0 (the agreement
    simulated, process 0's flag given) whether the lease is still held, so every
    process stops before a save when process 0's was taken over."""
    import jax

    from lexjax import distributed

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    for held in (True, False):
        gather = lambda flag, held=held: np.array([int(held), int(flag)], np.int32)
        monkeypatch.setattr(distributed, "_gather_flags", gather)
        if held:
            lease_lib.check_held(None, str(tmp_path))
            continue
        with pytest.raises(CheckpointError, match="was taken over by another job"):
            lease_lib.check_held(None, str(tmp_path))


def test_a_takeover_that_comes_during_a_heartbeat_waits_for_it_and_then_holds(tmp_path):
    """The heartbeat checks the lease is its own, then writes the renewed one: another job
    replacing the lease meanwhile waits for the heartbeat to finish and is never written
    over; the old holder then knows it lost the lease."""
    with lease_lib.WorkdirLease(tmp_path, timeout_s=60) as lease:  # beats every 15 s
        renewed, other = (
            lease._content,
            threading.Thread(
                target=write_lease, args=(tmp_path,), kwargs={"host": "elsewhere", "token": "new"}
            ),
        )

        def a_takeover_meanwhile():  # called after the check, before the write
            other.start()
            other.join(0.3)
            assert other.is_alive()  # it waits for the lease's lock
            return renewed()

        lease._content = a_takeover_meanwhile
        assert lease._renew() and lease.held
        other.join()
        assert lease_record(tmp_path)["token"] == "new" and not lease.owned()
        assert not lease._renew()
    assert lease_record(tmp_path)["token"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [lease_lib.LEASE_FILE]


def test_a_takeover_of_a_lease_replaced_since_it_was_judged_leaves_the_new_one(tmp_path):
    """Two newcomers (or any on a filesystem without flock) may both judge a lease
    stale: one replaces it first, and the other's takeover, which renames the file
    aside, finds there not the lease it judged. It puts the new lease back and does
    not take it."""
    write_lease(tmp_path, pid=dead_pid(), token="stale")
    stale = lease_record(tmp_path)
    write_lease(tmp_path, host="elsewhere", token="newer")  # the first newcomer's, since
    assert not lease_lib.WorkdirLease(tmp_path)._take_over(stale)
    assert lease_record(tmp_path)["token"] == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == [lease_lib.LEASE_FILE]


def test_a_lease_being_renewed_is_always_there_whole_and_refuses_newcomers(tmp_path):
    # Counted, not timed: on loaded cores one second held as few as 4 reads.
    with lease_lib.WorkdirLease(tmp_path, timeout_s=60) as lease:
        stop, beats = threading.Event(), []

        def beat():  # heartbeats back to back, as the heartbeat thread makes them
            while not stop.is_set():
                beats.append(lease._renew())

        beating = threading.Thread(target=beat)
        beating.start()
        reads, deadline = 0, time.monotonic() + 120  # a hang guard only
        try:
            while (reads < 30 or len(beats) < 30) and time.monotonic() < deadline:
                assert lease_record(tmp_path)["token"] == lease.token
                with pytest.raises(CheckpointError, match="in use by a training job"):
                    lease_lib.WorkdirLease(tmp_path).acquire()
                reads += 1
        finally:
            stop.set()
            beating.join()
        assert lease.owned() and reads >= 30 and len(beats) >= 30 and all(beats)


def test_an_exception_inside_train_releases_the_lease(tmp_path):
    """A notebook cell that fails inside train() can simply be run again."""
    config = cfg.from_configdict(
        {
            "model": {"num_layers": 1, "d_model": 16},
            "data": {"name": "textfiles", "files": str(tmp_path / "none" / "*.txt")},
            "train_len": 16,
            "batch_size": 8,
        }
    )
    for _ in range(2):  # the second call fails the same way, not on the lease
        with pytest.raises(DataError):
            training.train(config, str(tmp_path / "run"), progress=False)
        assert not (tmp_path / "run" / lease_lib.LEASE_FILE).exists()


# --------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return P.context(tmp_path_factory, "lease", 2)


def args(ctx, workdir, **overrides):
    base, files, data_dir, _ = ctx
    return P.train_args(workdir, files, data_dir, **overrides)


def test_one_writer_while_readers_read_and_a_killed_holder_is_taken_over(ctx, capsys):
    workdir = ctx[0] / "shared"
    overrides = {"checkpoint_every": 4, "keep_checkpoints": 100}
    # The first job is killed long before its last step: it must still be running (and
    # holding the lease) however fast the machine trains while the others start and read.
    first = P.start(args(ctx, workdir, num_train_steps=100_000, **overrides), ctx[3])
    P.wait_until(lambda: P.last_step(workdir) >= 2, first)

    second = P.run(args(ctx, workdir, num_train_steps=100_000, **overrides), ctx[3])
    assert second.returncode == CheckpointError.exit_code, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines() == [
        f"error: workdir {workdir} is in use by a training job on host {HOST} pid "
        f"{first.pid} (started {lease_record(workdir)['started']}); wait for it to finish "
        "or use another --workdir"
    ]

    # Readers take no lease, and read the newest complete step, verified, while it writes.
    reads = []
    while first.poll() is None and len(reads) < 3:
        if not P.complete_steps(workdir):
            continue
        newest = P.complete_steps(workdir)[-1]
        _, _, step = ckpt_lib.load_params(workdir)  # checksums verified inside
        assert newest <= step <= P.complete_steps(workdir)[-1]
        reads.append(step)
    assert reads and first.poll() is None, "the run ended before the readers read"
    assert lease_record(workdir)["pid"] == first.pid
    # What eval.py and api.load read while the job trains, they say they read (eval.py
    # used to give a mid-run step's numbers as the run's).
    capsys.readouterr()
    loaded, _ = evaluation.load_on_mesh(str(workdir))
    assert first.poll() is None, "the run ended while the reader read"
    started = lease_record(workdir)["started"]
    assert capsys.readouterr().err.splitlines() == [
        f"note: {workdir} is still being trained by host {HOST} pid {first.pid} (started "
        f"{started}): this reads step {loaded.step} of 100000, its newest complete "
        "checkpoint, and no later one"
    ]

    code, out, err = P.kill(first)  # leaves its lease behind
    assert code == -signal.SIGKILL
    assert lease_record(workdir)["pid"] == first.pid
    evaluation.load_on_mesh(str(workdir))  # a lease its holder left behind: nothing said
    assert capsys.readouterr().err == ""
    logged = [s for s, _ in P.losses(workdir)]
    assert logged == list(range(1, len(logged) + 1)), "the refused job wrote metrics"
    assert not (workdir / "checkpoints" / "superseded").exists()  # nothing saved over

    steps = P.complete_steps(workdir)[-1] + 8  # the third job resumes and trains a little more
    third = P.run(args(ctx, workdir, num_train_steps=steps, **overrides), ctx[3])
    assert third.returncode == 0, third.stderr[-3000:]
    assert (
        f"note: took over the stale lease of host {HOST} pid {first.pid} "
        in third.stdout.splitlines()[0]
    )
    assert third.stdout.splitlines()[0].endswith(f"pid {first.pid} is gone")
    assert P.complete_steps(workdir)[-1] == steps
    assert not (workdir / lease_lib.LEASE_FILE).exists()


@pytest.mark.parametrize(
    "failure, want",
    [
        (BlockingIOError(errno.EAGAIN, "held"), False),
        # A filesystem without flock: some NFS (ENOLCK), FUSE (EINVAL), Lustre (ENOSYS).
        (OSError(errno.ENOLCK, "no locks"), None),
        (OSError(errno.ENOSYS, "not implemented"), None),
        (OSError(errno.EBADF, "bad descriptor"), OSError),
    ],
)
def test_try_flock_tells_held_busy_and_no_flock_apart(tmp_path, monkeypatch, failure, want):
    with open(tmp_path / "lock", "a") as lock:
        assert lease_lib.try_flock(lock) is True
        monkeypatch.setattr(lease_lib.fcntl, "flock", lambda *_: (_ for _ in ()).throw(failure))
        if want is OSError:
            with pytest.raises(OSError, match="bad descriptor"):
                lease_lib.try_flock(lock)
        else:
            assert lease_lib.try_flock(lock) is want


def test_a_reader_of_a_run_being_extended_does_not_call_its_last_step_the_end(tmp_path, capsys):
    """A run of 2 steps resumed to train on: its step 2 was saved as "2 of 2", but the
    job now extending it trains past it, so the note says only the step it reads."""
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    config = cfg.from_configdict(
        {
            "model": {"num_layers": 1, "d_model": 16, "num_heads": 2, "mlp_dim": 32},
            "data": {"name": "textfiles", "files": str(tmp_path / "*.txt")},
            "train_len": 16,
            "batch_size": 8,
            "num_train_steps": 2,
            "checkpoint_every": 2,
            "eval_every": 2,
            "eval_batches": 1,
        }
    )
    workdir = str(tmp_path / "run")
    training.train(config, workdir, progress=False)
    capsys.readouterr()
    with lease_lib.WorkdirLease(workdir, log=lambda _: None):  # the job extending the run
        started = lease_record(workdir)["started"]
        loaded, _ = evaluation.load_on_mesh(workdir)
    assert loaded.step == loaded.config.num_train_steps == 2
    assert capsys.readouterr().err.splitlines() == [
        f"note: {workdir} is still being trained by host {HOST} pid {os.getpid()} (started "
        f"{started}): this reads step 2, its newest complete checkpoint, and no later one"
    ]


def test_a_workdir_copied_from_another_hosts_live_run_says_when_it_frees(tmp_path):
    """rsync of a run another host trains brings its lease along: training the copy was
    "in use …; wait for it to finish" (the original's job, days perhaps), though the
    copied lease goes stale unrenewed after its timeout and 1.5 heartbeats watched."""
    write_lease(tmp_path, host="elsewhere", heartbeat=time.time() - 20, timeout_s=60.0)
    said = str(refused(tmp_path))
    assert said.startswith(
        f"workdir {tmp_path} is in use by a training job on host elsewhere pid {os.getpid()} "
        "(started then); wait for it to finish or use another workdir; if this is a copy of "
        "that job's workdir, the lease copied with it goes stale unrenewed: training here can "
        "start in about "
    ), said
    assert 60 - 20 + 22.5 + 1 - 5 <= int(said.split()[-2]) <= 60 - 20 + 22.5 + 2, said
    (tmp_path / lease_lib.LEASE_FILE).unlink()
    with lease_lib.WorkdirLease(tmp_path) as held:  # this host's live holder: no such advice
        assert "copy" not in str(refused(tmp_path))
        assert lease_record(tmp_path)["token"] == held.token
