"""One writer per workdir: the lease a training job holds on its workdir.

``WORKDIR/lease.json`` names the holder (host, pid, start time), the time of
its last heartbeat and the timeout it promises to heartbeat within. It is
created with ``O_CREAT | O_EXCL``, so of two jobs started on one workdir only
one gets it; the other raises :class:`CheckpointError` naming the holder.

A lease is stale when its holder is gone: on this host its pid no longer
exists or is now another process (pids are reused: a restarted container's
job is pid 1 again; the lease records when its holder process started), or
(any host, e.g. a shared or network filesystem) its heartbeat is older than
the holder's own timeout. A stale lease is taken over with a
one-line notice. A thread rewrites the heartbeat every ``timeout_s / 4``; if
it finds the lease no longer its own (a stalled holder was declared stale and
replaced), :attr:`WorkdirLease.held` turns False and training refuses to save
(fencing: two jobs never write the same checkpoints).

No step replaces a lease file in place after reading it: a lease is changed
by renaming it aside (of two renamers one wins), checking what was moved, and
installing the new one with a hard link, which fails rather than overwrite a
lease another job created meanwhile. So a heartbeat never writes over a
takeover, and a takeover never replaces a lease that was renewed after it was
judged stale.

Readers (``eval.py``, :func:`lexjax.checkpoint.load_params`) take no lease:
they only read complete, verified steps.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import jax

from lexjax import distributed
from lexjax.errors import CheckpointError

__all__ = ["WorkdirLease", "LEASE_FILE", "hold", "check_held"]

LEASE_FILE = "lease.json"

_HELD: set[str] = set()  # the tokens of the leases this process holds now


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``
    field 22); None without /proc or without such a process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat.rsplit(b")", 1)[1].split()[19])  # fields from 3 on follow "(comm)"
    except (OSError, ValueError, IndexError):
        return None


def _describe(record: dict) -> str:
    """The holder a lease record names ('' for an unreadable one: it names none)."""
    if not {"host", "pid"} <= record.keys():
        return ""
    return f"host {record['host']} pid {record['pid']} (started {record.get('started')})"


class WorkdirLease:
    """The lease of one training job on ``workdir`` (a context manager).

    ``with WorkdirLease(workdir, timeout_s=..., log=print):`` takes the lease
    (or raises :class:`CheckpointError` if a live job holds it) and releases it
    on every exit, exceptions included. Only the lease's owner deletes it.
    """

    def __init__(self, workdir: str, *, timeout_s: float = 120.0, log=print):
        if not timeout_s > 0:
            raise CheckpointError(f"lease timeout {timeout_s} s must be positive")
        self.path = os.path.join(os.path.abspath(workdir), LEASE_FILE)
        self.timeout_s = float(timeout_s)
        self.log = log
        self.token = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the heartbeat's renewal against owned() and release()
        self._thread: threading.Thread | None = None
        self._record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
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

    def _content(self) -> bytes:
        return json.dumps({**self._record, "heartbeat": time.time()}).encode()

    def _install(self, source: str) -> bool:
        """Puts the file ``source`` at the lease's path unless a file is there (then
        False): a hard link, all or nothing; where the filesystem has no hard links, an
        exclusive create and a copy."""
        try:
            os.link(source, self.path)
        except FileExistsError:
            return False
        except OSError:
            with open(source, "rb") as f:
                content = f.read()
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(content)
        return True

    def _create(self) -> bool:
        """Creates our lease file, complete, if there is none; True if this call created it."""
        tmp = f"{self.path}.{self.token}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(self._content())
            return self._install(tmp)
        except OSError as e:
            raise CheckpointError(
                f"cannot create the workdir lease {self.path}: {e.strerror or e}"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _stale_reason(self, record: dict) -> str | None:
        """Why the holder of ``record`` is gone, or None if it may be alive."""
        pid = record.get("pid")
        if record.get("host") == socket.gethostname() and isinstance(pid, int):
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

    # -- taking and releasing ------------------------------------------------------

    def acquire(self) -> None:
        """Takes the lease, taking over a stale one; raises CheckpointError if it is held."""
        for _ in range(3):  # a lost race against another newcomer is retried
            if self._create():
                break
            record = self._read()
            if record is None:
                continue  # released in between
            reason = self._stale_reason(record)
            holder = _describe(record)
            if reason is None and holder:
                raise CheckpointError(
                    f"workdir {os.path.dirname(self.path)} is in use by a training job on "
                    f"{holder}; wait for it to finish or use another --workdir"
                )
            if reason is None:
                raise CheckpointError(
                    f"the workdir lease {self.path} cannot be read; it is taken over once it "
                    f"is {self.timeout_s:g} s old (--lease_timeout_s), or delete it if no "
                    "training job uses this workdir"
                )
            if self._take_over(record):
                whose = f"the stale lease of {holder}" if holder else f"the unreadable {self.path}"
                self.log(f"note: took over {whose}: {reason}")
                break
        else:
            raise CheckpointError(f"could not take the workdir lease {self.path}; try again")
        self.held = True
        _HELD.add(self.token)
        self._thread = threading.Thread(target=self._heartbeat, name="lexjax-lease", daemon=True)
        self._thread.start()

    def _move_aside(self, suffix: str) -> tuple[str, dict] | None:
        """Renames the lease file aside (atomic: of two renamers one succeeds): its new
        path and its record ({} if unreadable); None if there is no lease file."""
        aside = f"{self.path}.{self.token}.{suffix}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return None
        try:
            with open(aside, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = {}
        return aside, record if isinstance(record, dict) else {}

    def _put_back(self, aside: str) -> None:
        """Returns a lease moved aside to its place, unless a newer one is there."""
        with contextlib.suppress(OSError):
            self._install(aside)
        os.unlink(aside)

    def _take_over(self, stale: dict) -> bool:
        """Replaces the stale lease ``stale`` by ours; False if another job got there first.

        The stale file is moved aside, then ours is created exclusively. If what
        was moved is not the record judged stale (another newcomer replaced it, or
        its holder renewed it since), it is put back.
        """
        moved = self._move_aside("stale")
        if moved is None:
            return False
        aside, record = moved
        if record != stale:
            self._put_back(aside)
            return False
        os.unlink(aside)
        return self._create()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            if not self._renew():
                return

    def _renew(self) -> bool:
        """Rewrites our heartbeat if the lease is still ours; else marks it lost.

        Ours is moved aside, then the renewed one linked into its place: a takeover
        that lands in between keeps its lease and this one is lost. (A lease file that
        is gone, moved aside by a newcomer still judging it, is simply recreated:
        whichever is created first holds.)
        """
        with self._lock:
            try:
                moved = self._move_aside("renew")
            except OSError:
                return True  # e.g. a full disk: the next beat tries again
            if moved is not None and moved[1].get("token") != self.token:
                self._put_back(moved[0])
                self.held = False
                return False
            try:
                self.held = self._create()
            except CheckpointError:  # e.g. a full disk: ours goes back; the next beat retries
                if moved is not None:
                    self._put_back(moved[0])
                return True
            if moved is not None:
                os.unlink(moved[0])
            return self.held

    def release(self) -> None:
        """Stops the heartbeat and deletes the lease file if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        record = self._read()
        if self.held and record and record.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.held = False
        _HELD.discard(self.token)

    def owned(self) -> bool:
        """Whether the lease file still holds this job's lease (re-read now)."""
        with self._lock:
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
    if not distributed.all_processes(error is None):
        raise error or CheckpointError(
            f"process 0 could not take the lease on workdir {workdir}; see its error"
        )
    try:
        yield lease
    finally:
        if lease is not None:
            lease.release()


def check_held(lease: WorkdirLease | None, workdir: str) -> None:
    """Raises CheckpointError on every process if process 0's lease was taken over
    (a collective: call it on every process before writing to the workdir)."""
    if not distributed.all_processes(lease is None or lease.owned()):
        raise CheckpointError(
            f"the lease on workdir {workdir} was taken over by another job while this one "
            "was stalled; stopped without saving"
        )
