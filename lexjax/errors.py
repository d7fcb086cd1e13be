"""Errors a user can cause, their exit statuses, and the one-line report.

Every error lexjax raises for something the user can change derives from
:class:`LexjaxError` and carries the exit status of its kind. The programs
(``train.py``, ``eval.py``, the experiment) catch it in one place,
:func:`report` (through ``cli.main`` for train.py and eval.py), which prints
``error: <one line>`` on stderr and returns the exit status of its kind:

======  =============================================  ======================
status  kind                                           class
======  =============================================  ======================
0       success (also: stopped by SIGTERM or SIGHUP and saved)
1       an unexpected failure (a bug): a traceback
2       configuration, flags, a missing config file     :class:`ConfigError`
3       data: corpus, files, documents                  :class:`DataError`
4       checkpoint or workdir                           :class:`CheckpointError`
5       training stopped (a non-finite loss, out of     :class:`TrainingError`
        memory)
6       evaluation or generation cannot be done as      :class:`EvaluationError`
        asked
7       the processes of a multi-host run cannot join   :class:`DistributedError`
130     interrupted by Ctrl-C where the program does
        not stop cleanly itself (eval.py; the study
        outside a training; train.py's second
        Ctrl-C): ``interrupted (Ctrl-C)``, then
        the process ends by SIGINT, as Python does, so
        that a shell loop running it stops too
141     stdout's reader went away (``eval.py
        --generate | head``): quiet, as a program
        ended by SIGPIPE
======  =============================================  ======================
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import io
import os
import re
import signal
import sys

from absl import logging as absl_logging

from lexjax.progress import end_open_line, note
from lexjax.signals import say_interrupted

__all__ = [
    "LexjaxError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "TrainingError",
    "EvaluationError",
    "DistributedError",
    "one_line",
    "counted",
    "out_of_memory",
    "arg",
    "naming_flags",
    "report",
    "plain_own_log_lines",
    "stdout_failures",
]


class LexjaxError(Exception):
    """Something the user can change; the message says what, on one line.

    A message's line breaks (a value's repr, such as a JAX key array's or a 2-D
    NumPy array's, spans lines) become single spaces: ``run.generate(seed=key)``
    was refused in two lines, and ``error:`` showed the first only."""

    exit_code = 1

    def __init__(self, *args):
        super().__init__(*(_one_line_text(a) if isinstance(a, str) else a for a in args))


def _one_line_text(text: str) -> str:
    """``text`` with each line break (and the spaces around it) as one space."""
    return re.sub(r"\s*[\r\n]\s*", " ", text) if "\n" in text or "\r" in text else text


class ConfigError(LexjaxError, ValueError):
    """A configuration value or flag is invalid."""

    exit_code = 2


class DataError(LexjaxError, ValueError):
    """The data cannot be read or does not serve the request."""

    exit_code = 3


class CheckpointError(LexjaxError, RuntimeError):
    """A checkpoint or workdir cannot be written or read."""

    exit_code = 4


class TrainingError(LexjaxError, RuntimeError):
    """Training cannot continue (e.g. a non-finite loss)."""

    exit_code = 5


class EvaluationError(LexjaxError, ValueError):
    """An evaluation or generation that cannot be done as asked."""

    exit_code = 6


class DistributedError(LexjaxError, RuntimeError):
    """The processes of a multi-process run could not join."""

    exit_code = 7


_NAMING_FLAGS = contextvars.ContextVar("lexjax_naming_flags", default=False)


def refused_by(path, access: int = os.R_OK) -> str:
    """`` (Permission denied: user U's)`` where ``path`` exists but this process may not
    use it so (another user's file or directory, umask 077; a directory needs
    ``os.R_OK | os.X_OK`` to be listed and entered), naming its owner; else ``""``."""
    if not os.path.exists(path) or os.access(path, access):
        return ""
    try:
        import pwd

        uid = os.stat(path).st_uid
        if uid == os.getuid():
            return " (Permission denied; it is yours)"
        owner = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError, OSError):
        owner = "another"
    return f" (Permission denied: user {owner}'s)"


def globs_to_itself(path: str) -> bool:
    """Whether ``path`` read as a glob pattern (as orbax and TFDS read their paths)
    matches itself: False where a ``[…]`` set stands for other characters."""
    return fnmatch.fnmatchcase(path, path)


def nearest_existing(path) -> str:
    """``path`` made absolute, or its nearest ancestor that exists (a path to be made, or
    one this user cannot see into: what is there decides why)."""
    there = os.path.abspath(path)
    while not os.path.exists(there) and there != os.path.dirname(there):
        there = os.path.dirname(there)
    return there


def arg(name: str, flag: str | None = None) -> str:
    """How a message names an argument of the API: ``name`` (the Python API's), or
    inside :func:`naming_flags` the program's flag (``flag``, default ``--name``),
    so that one message serves both."""
    return (flag or f"--{name}") if _NAMING_FLAGS.get() else name


@contextlib.contextmanager
def naming_flags():
    """Messages raised in the block name the program's flags (train.py's, eval.py's:
    :func:`arg`)."""
    token = _NAMING_FLAGS.set(True)
    try:
        yield
    finally:
        _NAMING_FLAGS.reset(token)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA's report of an allocation that failed (device
    memory, or host memory on CPU)."""
    if type(error).__name__ != "JaxRuntimeError":  # (jax is not imported here)
        return False
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


def counted(n: int, noun: str) -> str:
    """``"1 step"``, ``"2 steps"``: a count and its noun, plural unless one."""
    return f"{n} {noun}{'s' * (n != 1)}"


def one_line(error: BaseException, *, innermost: bool = False, limit: int = 300) -> str:
    """The first line of an error's message (its type name if it has none).

    ``innermost`` follows ``__cause__``/``__context__`` to the deepest error
    first: for library failures (orbax, tensorstore) that is where the
    operating system's reason is. A context its raiser suppressed (``raise ...
    from None``, as json's decode error does over a StopIteration) is not followed.
    Past ``limit`` characters its middle is cut, not its end: a path near PATH_MAX
    took the whole line, and the reason and the advice after it were lost.
    """
    if innermost:
        seen = {id(error)}
        while True:
            cause = error.__cause__
            if cause is None and not error.__suppress_context__:
                cause = error.__context__
            if cause is None or id(cause) in seen:
                break
            seen.add(id(cause))
            error = cause
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    if innermost and lines:
        text = f"{type(error).__name__}: {text}"
    limit = max(limit, 3)
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head) :]


# The shell's status of a program ended by SIGPIPE (128 + 13).
STDOUT_CLOSED = 141


class StdoutClosed(Exception):
    """What a program printed to could not take it: stdout's reader went away."""


def closed_std_streams_to_devnull() -> None:
    """Gives a program started with stdin, stdout or stderr closed (``2>&-``) /dev/null
    in its place, as ``2>/dev/null`` would: a program's first call.

    Python leaves a closed standard descriptor free and its ``sys`` stream None. The next
    file the program opened then took the descriptor (the lowest free one: train.py's
    ArrayRecord shard became descriptor 2, where XLA's C++ code writes its warnings),
    and ``print(..., file=sys.stderr)`` wrote to stdout: ``eval.py --generate 2>&-`` put
    its mesh line, or its ``error:`` line, into the generated text."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
        if null != fd:  # (the lower ones are open by now, so it is fd unless a race)
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            mode = "r" if fd == 0 else "w"  # (the process's, open while it lives)
            stream = open(fd, mode, buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
            setattr(sys, name, stream)  # and as the process's own (_ends_process compares)
            setattr(sys, f"__{name}__", stream)


def _to_devnull(fd: int) -> None:
    """Points file descriptor ``fd`` at /dev/null (no descriptor left open)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class _Nowhere(io.TextIOBase):
    """A text stream that discards what it is given: the last place for output once
    stdout and stderr have both failed (it holds no file)."""

    def write(self, text: str) -> int:
        return len(text)


class _GuardedStdout:
    """stdout whose failures are the program's: a reader gone (``eval.py | head``)
    is :class:`StdoutClosed` (a quiet exit 141), any other (a full disk, ``>
    /dev/full``) one line (EvaluationError), instead of a traceback and exit 1.

    With ``fallback`` (train.py: its product is the checkpoints, the log a view of
    them) each line is flushed as it is written, and a failure says so on
    ``fallback`` and sends the line being written and every later one there: the
    program goes on, and stops by Ctrl-C as it would have (``train.py | tee log``:
    the Ctrl-C ends tee first). Should ``fallback`` fail too, the lines go nowhere.
    (A non-blocking stdout's momentary ``EAGAIN`` counts as a failure too.)"""

    def __init__(self, stream, fallback=None):
        self._stream = stream
        self._next = None if fallback is None else [fallback, None]  # None: nowhere
        self._unflushed: list[str] = []  # written since the last flush (the last 100)

    def write(self, text):
        self._unflushed = [*self._unflushed[-99:], text]
        try:
            written = self._stream.write(text)
            if self._next is not None and "\n" in text:  # what is pending: a part line at most
                self.flush()
        except OSError as e:
            self._fail(e)
            return len(text)
        return written

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self._fail(e)
        self._unflushed.clear()

    def _fail(self, error: OSError) -> None:
        if self._next is None and isinstance(error, BrokenPipeError):
            raise StdoutClosed from None
        if self._next is None:
            raise EvaluationError(
                f"cannot write to stdout ({error.strerror or error}); send it to a file or "
                "device with room"
            ) from None
        with contextlib.suppress(OSError, ValueError):  # what it still holds goes nowhere
            _to_devnull(self._stream.fileno())
        self._stream = self._next.pop(0) or _Nowhere()
        text = "".join(self._unflushed)
        if self._next:  # on the fallback
            reason = error.strerror or error
            text = f"stdout failed ({reason}); printing to stderr from here on\n{text}"
        try:
            self._stream.write(text)
            self._stream.flush()
        except OSError as e:
            self._fail(e)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def stdout_failures(to_stderr: bool = False):
    """:class:`_GuardedStdout` in the block (``to_stderr``: stderr its fallback),
    flushed at its end (a pipe's buffer fails there, not at exit). Also a decorator."""
    real = sys.stdout
    if real is None:  # started without one (`>&-`): print() writes nowhere, as it should
        yield
        return
    sys.stdout = guarded = _GuardedStdout(real, sys.stderr if to_stderr else None)
    try:
        yield
        guarded.flush()
    finally:
        if to_stderr:  # also after an error: the lines it holds reach stderr (it never raises)
            guarded.flush()
        sys.stdout = real


class _PlainOwnLines(absl_logging.PythonFormatter):
    """lexjax's logged notes (a damaged step skipped, a step moved aside) print as
    the one line they are; absl's prefix (level, time, thread, file:line) stays on
    the libraries' lines."""

    def format(self, record):
        if record.name.split(".")[0] == "lexjax":
            return record.getMessage()
        return super().format(record)


def plain_own_log_lines() -> None:
    """A program's choice, made at its start: :class:`_PlainOwnLines` on absl's handler."""
    absl_logging.get_absl_handler().setFormatter(_PlainOwnLines())


# Set by stopped_mid_work (a stop that interrupted work); report() reads and resets it.
_stopped_mid_work = False


def stopped_mid_work() -> None:
    """A stop ended work that may go on in jaxlib's threads (a compilation the stop's
    exception interrupted; the main thread only waited for it): :func:`report` then
    ends the program without Python's finalization, which crashed in those threads
    (train.py stopped while compiling its initial state: "stopped by SIGTERM", then
    SIGSEGV, exit 139 instead of 0)."""
    global _stopped_mid_work
    _stopped_mid_work = True


def _ends_process() -> bool:
    """Whether :func:`report` runs a program of its own: its own stderr (not a test's
    captured one), outside an interactive session (whose interpreter must go on)."""
    interactive = hasattr(sys, "ps1") or "IPython" in sys.modules
    return sys.stderr is sys.__stderr__ and not interactive


def _exit_now(status: int) -> None:
    """Ends the process with ``status`` once what it printed and logged is out, without
    Python's finalization (see :func:`stopped_mid_work`)."""
    import logging

    _flush(sys.stdout)
    _flush(sys.stderr)
    logging.shutdown()
    os._exit(status)


def _flush(stream) -> None:
    """What ``stream`` holds, out before the process ends, as far as it can go."""
    if stream is not None:  # (None: started without one, `>&-`)
        with contextlib.suppress(OSError, ValueError, StdoutClosed):
            stream.flush()


def report(program, *args, **kwargs) -> int:
    """``program(*args, **kwargs)`` (None: 0); a :class:`LexjaxError` becomes
    ``error: <one line>`` on stderr and the exit status of its kind.

    A Ctrl-C that reaches here prints ``interrupted (Ctrl-C)`` and ends a program
    by SIGINT at once (status 130 in a shell, which then stops a loop that ran it,
    as it would have without lexjax): Python's finalization ran while jaxlib's
    threads still compiled, and ended 6 of 36 interrupted eval.py runs on loaded
    cores by SIGSEGV. In an interactive session, or a caller with its own stderr
    (a test's), it is raised again, without its traceback.
    :class:`StdoutClosed` returns :data:`STDOUT_CLOSED`, quietly. After a stop that
    interrupted work (:func:`stopped_mid_work`) the process ends at once, with the
    program's status.
    """
    global _stopped_mid_work
    _stopped_mid_work = False
    try:
        status = program(*args, **kwargs) or 0
    except KeyboardInterrupt:
        end_open_line()
        ends = _ends_process()  # (an interactive session's interpreter must go on)
        if ends:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a flush stuck on a pipe: Ctrl-C
            _flush(sys.stdout)  # what it printed, before the process ends
        say_interrupted()
        sys.excepthook = _quiet_interrupt(sys.excepthook)
        if ends:
            os.kill(os.getpid(), signal.SIGINT)
        raise
    except StdoutClosed:
        # Python would flush stdout once more at exit, and fail again: it goes nowhere.
        _to_devnull(sys.stdout.fileno())
        return STDOUT_CLOSED
    except LexjaxError as e:
        end_open_line()
        # Whole: the message is ours, and its advice comes last, after paths that may
        # be long (a foreign reason inside it was cut already). A stderr whose reader
        # went away (`2>&1 | head`) takes no line, and the status still says the kind.
        note(f"error: {one_line(e, limit=4000)}")
        return e.exit_code
    except SystemExit as e:  # absl's app.run ends its program so, with its status
        if _stopped_mid_work and _ends_process() and isinstance(e.code, int | None):
            _exit_now(e.code or 0)
        raise
    except BaseException:  # a bug's traceback, too, starts a line of its own
        end_open_line()
        raise
    if _stopped_mid_work and _ends_process():
        _exit_now(status)
    return status


def _quiet_interrupt(hook):
    def quiet(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            hook(kind, value, traceback)

    return quiet
