"""One writer per workdir: the lease a training job holds on its workdir.

``WORKDIR/lease.json`` names the holder (host, pid, start time), the time of
its last heartbeat and the timeout it promises to heartbeat within. It is
created with ``O_CREAT | O_EXCL``, so of two jobs started on one workdir only
one gets it; the other raises :class:`CheckpointError` naming the holder.

A lease is stale when its holder is gone: on this host (the same boot and PID
namespace, which the lease records) its pid no longer exists or is now another
process (pids are reused: the lease records when its holder process started), or
(any host, e.g. a shared or network filesystem) its heartbeat is older than
the holder's own timeout — for another host's lease, by this host's clock and
not renewed while the newcomer watches it for 1.5 heartbeat intervals (the two
clocks may differ). A lease on this host that names another directory
(device and inode numbers) was copied with its workdir: its holder trains the
original, so it is stale here. A holder on this host in another PID namespace (a
restarted container's job, or one in a container sharing the hostname) cannot
be checked by pid: the newcomer watches its heartbeat, for at most its timeout.
A stale lease is taken over with a one-line notice. A thread rewrites the
heartbeat every ``timeout_s / 4``; if it finds the lease no longer its own (a
stalled holder was declared stale and replaced), :attr:`WorkdirLease.held` turns
False and training refuses to save (fencing: checked as each save starts).

Every change of the lease file (take, take over, renew, release) reads, checks
and writes it under an exclusive ``flock`` of the workdir, so a heartbeat never
writes over a takeover that landed after its check, nor a takeover over a lease
renewed after it was judged stale; the file is replaced atomically and is never
absent while held. (On a filesystem without ``flock`` the steps run unlocked.)

Readers (``eval.py``, :func:`lexjax.checkpoint.load_params`) take no lease:
they only read complete, verified steps; ``eval.py`` and :func:`lexjax.api.load`
say when a live job still trains the run they read (:func:`live_holder`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import jax

from lexjax import distributed
from lexjax.errors import CheckpointError, arg, refused_by

__all__ = [
    "WorkdirLease",
    "LEASE_FILE",
    "DEFAULT_TIMEOUT_S",
    "hold",
    "check_held",
    "live_holder",
    "try_flock",
]

LEASE_FILE = "lease.json"
# A job's heartbeat timeout unless given (train.py's --lease_timeout_s): another job
# takes over a lease whose holder has sent no heartbeat for this long.
DEFAULT_TIMEOUT_S = 120.0
# The longest: a week. (inf ended the heartbeat thread, whose waits take at most
# threading.TIMEOUT_MAX, at once: a newcomer in another PID namespace then waited forever.)
MAX_TIMEOUT_S = 7 * 24 * 3600.0

_HELD: set[str] = set()  # the tokens of the leases this process holds now
_LOCK_WAIT_S = 10.0  # a lease change holds the lock for a few file operations


def open_lock(path: str):
    """The lock file at ``path`` (made if missing, rw for all less the umask, as any
    file) opened for :func:`try_flock`: for writing, or for reading where its mode
    refuses another user that (a data_dir a group shares, the lock made under umask 022)."""
    try:
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666), "ab")
    except PermissionError as e:
        refused = e
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # none to read (a directory this user cannot write)
        raise refused from None
    try:  # NFS locks only files open for writing (EBADF): the refusal above, then
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        pass  # held by another: locking works on this descriptor
    except OSError as e:
        if e.errno == errno.EBADF:
            os.close(fd)
            raise refused from None
    return os.fdopen(fd, "rb")


def try_flock(file) -> bool | None:
    """An exclusive ``flock`` on ``file`` (a descriptor or an open file), not waiting:
    True (held until it closes, however the process ends), False (another holder
    has it), or None on a filesystem without ``flock`` (some NFS): nothing held."""
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            return None
        raise


@contextlib.contextmanager
def _locked(directory: str, wait_s: float = _LOCK_WAIT_S) -> Iterator[bool]:
    """Holds an exclusive ``flock`` on ``directory`` for the block: True, or False if
    another holder kept it for ``wait_s`` (then nothing is held). True without a lock
    on a filesystem that has no ``flock``."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        deadline = time.monotonic() + wait_s
        while try_flock(fd) is False:
            if time.monotonic() > deadline:
                yield False
                return
            time.sleep(0.005)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie (killed, not yet reaped by its
    parent, e.g. a supervisor about to restart it; ``kill(pid, 0)`` still succeeds)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return _stat_field(pid, 0) not in (b"Z", b"X")


def _stat_field(pid: int, index: int) -> bytes | None:
    """Field ``index + 3`` of ``/proc/PID/stat`` (those from 3 on follow "(comm)", which
    may hold spaces); None without /proc or without such a process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``
    field 22); None without /proc or without such a process."""
    field = _stat_field(pid, 19)
    return int(field) if field is not None and field.isdigit() else None


def _pid_space() -> dict[str, str]:
    """What makes a pid name one process: this boot of the kernel (``boot_id``) and
    this PID namespace (``pid_ns``). Two containers that share a hostname (``docker
    run --network host``, Kubernetes ``hostNetwork``) do not share their pids.
    Empty without /proc."""
    space = {}
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        space["boot_id"] = f.read().strip()
    with contextlib.suppress(OSError):
        space["pid_ns"] = os.readlink("/proc/self/ns/pid")
    return space


class _Unverifiable(Exception):
    """A fresh lease whose holder's pid means nothing here (another PID namespace or
    boot on this host), or another host's lease that looks stale by this host's clock
    (``by_clock``): only a renewal of its heartbeat tells whether it is alive."""

    def __init__(self, record: dict, by_clock: bool = False):
        super().__init__(record)
        self.record, self.by_clock = record, by_clock


def _describe(record: dict) -> str:
    """The holder a lease record names ('' for an unreadable one: it names none)."""
    if not {"host", "pid"} <= record.keys():
        return ""
    return f"host {record['host']} pid {record['pid']} (started {record.get('started')})"


def _renewal_wait(timeout: float) -> float:
    """Seconds a newcomer watches another host's lease, stale by this host's clock, for
    a renewal before taking it over: 1.5 heartbeat intervals (``timeout_s / 4`` each)."""
    return 1.5 * max(timeout, 0.0) / 4 + 1.0


class WorkdirLease:
    """The lease of one training job on ``workdir`` (a context manager).

    ``with WorkdirLease(workdir, timeout_s=..., log=print):`` takes the lease
    (or raises :class:`CheckpointError` if a live job holds it) and releases it
    on every exit, exceptions included. Only the lease's owner deletes it.
    """

    def __init__(self, workdir: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, log=print):
        if not 0 < timeout_s <= MAX_TIMEOUT_S:  # inf ended the heartbeat thread at once
            raise CheckpointError(f"lease timeout {timeout_s} s must be in (0, {MAX_TIMEOUT_S:g}]")
        self.path = os.path.join(os.path.abspath(workdir), LEASE_FILE)
        self.timeout_s = float(timeout_s)
        self.log = log
        self.token = uuid.uuid4().hex
        self.held = False
        self._watched: dict[tuple[str, object], float] = {}  # (token, beat): s seen unrenewed
        self._taken_in: list[int] | None = None  # the workdir's device and inode then
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            **_pid_space(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "token": self.token,
            "timeout_s": self.timeout_s,
        }

    # -- the file ----------------------------------------------------------------

    def _read(self) -> dict | None:
        """The current lease record, None if there is none; {} if unreadable."""
        try:
            with open(self.path, encoding="utf-8") as f:
                record = json.load(f)
            return record if isinstance(record, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # half-written by a holder killed mid-write: judged by its mtime

    def _directory(self) -> list[int] | None:
        """The workdir's device and inode numbers: a copied workdir (``cp -a``) holds
        the lease of the original's job, which renews the original's file only."""
        try:
            stat = os.stat(os.path.dirname(self.path))
        except OSError:
            return None
        return [stat.st_dev, stat.st_ino]

    def _content(self) -> bytes:
        record = {**self._record, "directory": self._directory(), "heartbeat": time.time()}
        return json.dumps(record).encode()

    def _write(self, *, replace: bool) -> bool:
        """Puts our lease, complete, at its path (written aside, then renamed or
        linked into place): over the file there if ``replace``, else only if there is
        none (False if there is one)."""
        tmp, content = f"{self.path}.{self.token}.tmp", self._content()
        try:
            with open(tmp, "wb") as f:
                with contextlib.suppress(OSError):  # a filesystem without modes: as it is
                    os.fchmod(f.fileno(), 0o644)  # readable by all (umask 077 too): whose job
                f.write(content)
            if replace:
                os.replace(tmp, self.path)
                return True
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError:  # a filesystem without hard links: exclusive create
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(content)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _stale_reason(self, record: dict) -> str | None:
        """Why the holder of ``record`` is gone, or None if it may be alive."""
        pid = record.get("pid")
        if self._pids_comparable(record) and record.get("directory", self._directory()) != (
            self._directory()
        ):  # (device and inode numbers compare on one host, not across a network)
            start = record.get("pid_start")
            alive = isinstance(pid, int) and _pid_alive(pid)
            # not a pid reused since (a start time unknown here: taken as the same)
            alive = alive and (start is None or _process_start(pid) in (None, start))
            return f"it was copied from another workdir{f', which pid {pid} trains' * alive}"
        if self._pids_comparable(record) and isinstance(pid, int):
            reused = "(the holder is gone and its pid was reused)"
            if pid == os.getpid() and record.get("token") not in _HELD:
                return f"pid {pid} is this process {reused}"
            if not _pid_alive(pid):
                return f"pid {pid} is gone"
            start = record.get("pid_start")
            if start is not None and _process_start(pid) not in (None, start):
                return f"pid {pid} is another process now {reused}"
        try:
            beat, timeout = float(record["heartbeat"]), float(record["timeout_s"])
        except (KeyError, TypeError, ValueError):  # unreadable: judged by the file's age
            try:
                beat, timeout = os.path.getmtime(self.path), self.timeout_s
            except FileNotFoundError:
                return "released"
        age = time.time() - beat
        if age > timeout:
            return f"no heartbeat for {age:.0f} s (timeout {timeout:g} s)"
        return None

    def _pids_comparable(self, record: dict) -> bool:
        """Whether ``record``'s pid names a process here: the same host, boot and PID
        namespace (a lease of an older lexjax, which records neither: the same host)."""
        if record.get("host") != self._record["host"]:
            return False
        return all(record[k] == self._record.get(k) for k in ("boot_id", "pid_ns") if k in record)

    # -- taking and releasing ------------------------------------------------------

    def acquire(self) -> None:
        """Takes the lease, taking over a stale one; raises CheckpointError if it is held.

        A holder on this host whose pid cannot be checked here (another PID namespace,
        e.g. a restarted container's job, or one in another container) is watched, at
        most until its heartbeat is older than its timeout: a renewed heartbeat means it
        is alive (CheckpointError), none means it is gone (taken over)."""
        while True:
            try:
                with _locked(os.path.dirname(self.path)) as locked:
                    taken = locked and self._take()
                break
            except OSError as e:
                raise CheckpointError(
                    f"cannot create the workdir lease {self.path}: {e.strerror or e}"
                ) from None
            except _Unverifiable as unverifiable:  # outside the lock: the holder renews under it
                if unverifiable.by_clock:
                    self._watch_renewal(unverifiable.record)
                else:
                    self._watch(unverifiable.record)
        if not taken:
            raise CheckpointError(f"could not take the workdir lease {self.path}; try again")
        self.held = True
        self._taken_in = self._directory()
        _HELD.add(self.token)
        self._thread = threading.Thread(target=self._heartbeat, name="lexjax-lease", daemon=True)
        self._thread.start()

    def _take(self) -> bool:
        """Under the lock: creates the lease, or takes over a stale one; raises
        CheckpointError if it is held. (Without flock a lost race returns False.)"""
        for _ in range(3):  # unlocked, a lease released in between is retried
            if self._write(replace=False):
                return True
            record = self._read()
            if record is None:
                continue
            if not record and (why := refused_by(self.path)):  # another user's, umask 077
                raise CheckpointError(  # its age cannot tell: its holder's timeout is unread
                    f"the workdir lease {self.path} cannot be read{why}; it may be a live "
                    "job's: ask its owner, who can delete it if no training job uses this workdir"
                )
            reason = self._stale_reason(record)
            holder = _describe(record)
            if reason and self._judged_by_clock(record):
                raise _Unverifiable(record, by_clock=True)
            if watched := self._watched.get((record.get("token"), record.get("heartbeat"))):
                reason = f"not renewed while watched for {watched:.1f} s ({reason} by our clock)"
            if reason is None and holder:
                if record.get("host") == self._record["host"] and not self._pids_comparable(record):
                    raise _Unverifiable(record)
                raise self._in_use(record, copy_hint=True)
            if reason is None:
                raise CheckpointError(
                    f"the workdir lease {self.path} cannot be read; it is taken over once it "
                    f"is {self.timeout_s:g} s old (--lease_timeout_s), or delete it if no "
                    "training job uses this workdir"
                )
            if self._take_over(record):
                whose = f"the stale lease of {holder}" if holder else f"the unreadable {self.path}"
                self.log(f"note: took over {whose}: {reason}")
                return True
        return False

    def _in_use(self, record: dict, copy_hint: bool = False) -> CheckpointError:
        """``copy_hint``: the lease was not seen renewed. Another host's may have come with
        a copy of the workdir that job trains (cp -r, rsync): then it goes stale unrenewed,
        and the message says when, not only "wait for it to finish"."""
        hint = ""
        if copy_hint and record.get("host") != self._record["host"]:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                beat, timeout = float(record["heartbeat"]), float(record["timeout_s"])
                left = max(beat + timeout - time.time(), 0.0) + _renewal_wait(timeout)
                hint = (
                    "; if this is a copy of that job's workdir, the lease copied with it goes "
                    f"stale unrenewed: training here can start in about {math.ceil(left)} s"
                )
        return CheckpointError(
            f"workdir {os.path.dirname(self.path)} is in use by a training job on "
            f"{_describe(record)}; wait for it to finish or use another {arg('workdir')}{hint}"
        )

    def _judged_by_clock(self, record: dict) -> bool:
        """Whether ``record`` is another host's lease, stale by its heartbeat's time and
        not yet watched: that time is the holder's clock, and a clock behind ours by
        more than the timeout made a live job's lease look stale at once."""
        if record.get("host") == self._record["host"] or not record.get("token"):
            return False
        try:
            float(record["heartbeat"]), float(record["timeout_s"])
        except (KeyError, TypeError, ValueError):
            return False
        return (record["token"], record["heartbeat"]) not in self._watched

    def _watch_renewal(self, record: dict) -> None:
        """Waits 1.5 heartbeat intervals (``timeout_s / 4`` each) by this host's clock:
        raises the in-use CheckpointError if the holder renews its lease meanwhile;
        else the lease is judged again, now as stale as its heartbeat says."""
        wait = _renewal_wait(float(record["timeout_s"]))
        self.log(
            f"note: the lease of {os.path.dirname(self.path)} held by {_describe(record)} "
            f"looks stale by this host's clock; watching it {wait:.1f} s for a heartbeat "
            "(clocks of two hosts may differ; a renewed one means the job is alive)"
        )
        renewed = self._renewed(record, wait, poll=min(0.25, wait / 20))
        if renewed:
            raise self._in_use(record)
        if renewed is False:  # (None: released or replaced, judged again as it is now)
            self._watched[record["token"], record["heartbeat"]] = wait

    def _watch(self, record: dict) -> None:
        """Returns once the lease ``record`` is gone, replaced or past its timeout
        without a heartbeat (then the caller judges the lease again); raises the
        in-use CheckpointError once its holder renews it."""
        try:
            beat, timeout = float(record["heartbeat"]), float(record["timeout_s"])
        except (KeyError, TypeError, ValueError):  # nothing to watch: as on another host
            raise self._in_use(record) from None
        left = beat + timeout - time.time()
        self.log(
            f"note: the lease of {os.path.dirname(self.path)} is held by "
            f"{_describe(record)} in another PID namespace (or boot) of this host, whose "
            f"pids this process cannot check; waiting up to {max(left, 0):.0f} s for its heartbeat "
            "(a renewed one means the job is alive)"
        )
        if self._renewed(record, left, poll=min(0.25, timeout / 20)):
            raise self._in_use(record)

    def _renewed(self, record: dict, seconds: float, *, poll: float) -> bool | None:
        """Reads the lease every ``poll`` s for ``seconds``: True once ``record``'s
        holder renews it, None once it is released or replaced, False if neither."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(poll)
            now = self._read()
            if not now or now.get("token") != record.get("token"):
                return None
            if now.get("heartbeat") != record.get("heartbeat"):
                return True
        return False

    def _take_over(self, stale: dict) -> bool:
        """Replaces the stale lease ``stale`` by ours; False if another job got there first.

        The stale file is renamed aside (atomic: of two newcomers one succeeds),
        then ours is created exclusively. If what was renamed aside is not the
        stale lease (another newcomer replaced it in between), it is put back.
        """
        aside = f"{self.path}.{self.token}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:  # unreadable (torn, or replaced meanwhile by one this user may not read): as torn
            with open(aside, encoding="utf-8", errors="replace") as f:
                moved_token = json.loads(f.read()).get("token")
        except (OSError, ValueError, AttributeError):
            moved_token = None
        if moved_token != stale.get("token"):
            with contextlib.suppress(OSError):  # FileExistsError: never over a newer lease
                os.link(aside, self.path)
            os.unlink(aside)
            return False
        os.unlink(aside)
        return self._write(replace=False)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            if not self._renew():
                return

    def _renew(self) -> bool:
        """Rewrites our heartbeat if the lease is still ours; else marks it lost."""
        try:
            with _locked(os.path.dirname(self.path), self.timeout_s / 4) as locked:
                if not locked:
                    return True  # another job is judging it: the next beat tries again
                record = self._read()
                if not record or record.get("token") != self.token:
                    self.held = False
                    return False
                self._write(replace=True)
        except OSError:
            pass  # e.g. a full disk: the next beat tries again; saving reports the disk
        return True

    def release(self) -> None:
        """Stops the heartbeat and deletes the lease file if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError), _locked(os.path.dirname(self.path)) as locked:
            record = self._read()
            if locked and self.held and record and record.get("token") == self.token:
                os.unlink(self.path)
        self.held = False
        _HELD.discard(self.token)

    def moved(self) -> bool:
        """Whether the workdir this lease was taken in is no longer at its path (moved,
        renamed or deleted; another directory there since is not it). A path that
        cannot be read for another reason (permissions) is not called moved."""
        if self._taken_in is None:
            return False
        try:
            stat = os.stat(os.path.dirname(self.path))
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:
            return False
        return [stat.st_dev, stat.st_ino] != self._taken_in

    def owned(self) -> bool:
        """Whether the lease file still holds this job's lease (re-read now)."""
        record = self._read() if self.held else None
        self.held = bool(record) and record.get("token") == self.token
        return self.held

    def __enter__(self) -> WorkdirLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def hold(workdir: str, *, timeout_s: float, log=print) -> Iterator[WorkdirLease | None]:
    """Process 0's lease on ``workdir`` for the ``with`` block (None on other processes).

    Every process raises the CheckpointError if process 0 cannot take it, so a
    refused multi-process job stops at once everywhere (a collective).
    """
    lease = (
        WorkdirLease(workdir, timeout_s=timeout_s, log=log) if jax.process_index() == 0 else None
    )
    error = None
    if lease is not None:
        try:
            lease.acquire()
        except CheckpointError as e:
            error = e
    try:
        agreed = distributed.all_processes(error is None)
    except BaseException:  # a peer gone (or a stop) before the block: nothing is held for it
        if lease is not None and error is None:
            lease.release()
        raise
    if not agreed:
        raise error or CheckpointError(
            f"process 0 could not take the lease on workdir {workdir}; see its error"
        )
    try:
        yield lease
    except (CheckpointError, OSError) as e:  # a write that failed (others pass unchanged)
        if lease is not None and lease.moved():  # what failed is the missing workdir
            raise CheckpointError(
                f"workdir {workdir} was moved, renamed or deleted while this job trained; "
                "stopped without saving (a directory written there since holds only fragments "
                f"of the save in progress); resume the run where it is now, with "
                f"{arg('workdir')} its new path"
            ) from e  # what failed, for a traceback's reader
        raise
    finally:
        if lease is not None:
            lease.release()


def live_holder(workdir: str) -> str | None:
    """The training job that holds ``workdir``'s lease and may be alive, described as
    a refused job names it ("host … pid … (started …)"); None where there is no lease
    or its holder is gone. A reader's look: nothing is written, taken or waited for
    (a holder in another PID namespace counts as alive while its heartbeat is fresh)."""
    probe = WorkdirLease(workdir)
    record = probe._read()
    if record is None or probe._stale_reason(record) is not None:
        return None
    return _describe(record) or "a job whose lease file is being written"


def check_held(lease: WorkdirLease | None, workdir: str) -> None:
    """Raises CheckpointError on every process if process 0's lease was taken over
    (a collective: call it on every process before writing to the workdir)."""
    if not distributed.all_processes(lease is None or lease.owned()):
        raise CheckpointError(
            f"the lease on workdir {workdir} was taken over by another job while this one "
            "was stalled; stopped without saving"
        )
