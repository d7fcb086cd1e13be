"""SIGTERM / Ctrl-C (and SIGHUP, a closed terminal or dropped ssh session, which
the programs treat as SIGTERM) that arrive while a program is still starting (importing JAX,
parsing flags, joining its peers), before :func:`lexjax.training.train` installs
its own handlers (and eval.py's Ctrl-C while it imports, :func:`end_on_interrupt`).

``train.py`` calls :func:`defer` first thing; a signal then is only recorded, and
``train()`` acts on it as on one received while it sets up: it stops before the
first step and exits 0 with nothing to save, instead of the default handler's
status 143 (SIGTERM) or a KeyboardInterrupt traceback. This module imports
nothing heavy, so it is in place before JAX loads.

A signal handler's exception that lands in a callback (a gc callback, a
``__del__``) is only reported by Python; :func:`on_swallowed` is the one
``sys.unraisablehook`` that has such a signal delivered again instead.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "STOP_SIGNALS",
    "defer",
    "ignored",
    "take_deferred",
    "end_deferral",
    "end_on_interrupt",
    "restore_interrupt",
    "say_interrupted",
    "on_swallowed",
    "redeliver_swallowed_interrupts",
    "interrupt_main_later",
]

# The signals that stop a training (finish the step, save, return) or the study. SIGHUP,
# a terminal that closed (a dropped ssh session), is one more SIGTERM: by default it
# ended the process at once, losing the save under way.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_received: list[str] = []


def _record(signum, frame):
    if _received and signum == signal.SIGINT:
        # A second Ctrl-C stops at once, as eval.py's while it loads (nothing is written
        # yet): a KeyboardInterrupt raised inside JAX's import was a traceback, and one
        # inside its gc callback was lost (the run went on and exited 0).
        _end(signum, frame)
    _received.append(signal.Signals(signum).name)


def defer() -> None:
    """Records the :data:`STOP_SIGNALS` from now on (main thread only) until ``train()``
    takes them over (:func:`take_deferred`). A SIGINT or SIGHUP that whoever started
    the program ignores (a shell's background job, ``nohup … &``) stays ignored,
    here and in ``train()``: a Ctrl-C meant for the terminal's foreground program, or
    the hangup ``nohup`` is for, does not stop the run."""
    for sig in STOP_SIGNALS:
        if not ignored(sig):
            signal.signal(sig, _record)


def ignored(sig: signal.Signals) -> bool:
    """Whether ``sig`` is SIGINT or SIGHUP and ignored (inherited so: a background
    job's Ctrl-C, ``nohup``'s hangup; Python itself then keeps SIGINT ignored instead
    of raising KeyboardInterrupt). Other signals: False."""
    return sig in (signal.SIGINT, signal.SIGHUP) and signal.getsignal(sig) is signal.SIG_IGN


def take_deferred() -> str | None:
    """The name of the first signal recorded since :func:`defer` (None: none), forgotten
    once taken."""
    name = _received[0] if _received else None
    _received.clear()
    return name


def end_deferral() -> str | None:
    """Ends :func:`defer` for a program that keeps no handlers of its own (the study
    outside its trainings): Python's own SIGTERM and Ctrl-C again. Returns what
    :func:`take_deferred` does."""
    for sig, handler in (
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGHUP, signal.SIG_DFL),
        (signal.SIGINT, signal.default_int_handler),
    ):
        if signal.getsignal(sig) is _record:
            signal.signal(sig, handler)
    return take_deferred()


def end_on_interrupt() -> None:
    """eval.py while it loads JAX, where nothing is written yet: a Ctrl-C prints
    ``interrupted (Ctrl-C)`` and ends the process by SIGINT at once, as one later
    does through :func:`lexjax.errors.report` (and not a KeyboardInterrupt inside
    an import, which can crash it). :func:`restore_interrupt` ends this. A SIGINT
    that whoever started the program ignores (a shell's background job) stays so."""
    if not ignored(signal.SIGINT):
        signal.signal(signal.SIGINT, _end)


def restore_interrupt() -> None:
    """Python's own Ctrl-C (KeyboardInterrupt) again, where :func:`end_on_interrupt`
    took it over."""
    if signal.getsignal(signal.SIGINT) is _end:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def say_interrupted() -> None:
    """``interrupted (Ctrl-C)`` on stderr, where it can be said: its reader may be gone
    (`2>&1 | tee log`, tee ended by the same Ctrl-C), and the BrokenPipeError raised
    in its place ended the program with status 1, not by SIGINT."""
    with contextlib.suppress(OSError, ValueError):
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)


def _end(signum, frame):
    say_interrupted()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_again: dict[type[BaseException], Callable[[], bool]] = {}
_in_hook = False  # the main thread is in the hook: a signal delivered now is swallowed too


def on_swallowed(kind: type[BaseException], again: Callable[[], bool]) -> None:
    """``again()`` runs when a callback swallowed a ``kind`` exception (Python only
    reports what a gc callback or ``__del__`` raises, and JAX's gc callback runs
    often, so a signal handler's exception can land there); it returns whether it
    had the signal delivered anew. Every other report goes to the hook found. One
    ``sys.unraisablehook`` per process, installed by the first call."""
    if not _again:
        previous = sys.unraisablehook

        def unraisable(report):
            global _in_hook
            _in_hook = True
            try:
                act = next((f for k, f in _again.items() if isinstance(report.exc_value, k)), None)
                if act is None or not act():
                    previous(report)
            finally:
                _in_hook = False  # last: no call after it, where a signal could land

        sys.unraisablehook = unraisable
    _again[kind] = again


def redeliver_swallowed_interrupts() -> None:
    """A Ctrl-C's KeyboardInterrupt that a callback swallowed is raised again in the
    main thread a moment later, after the callback, so a Ctrl-C always stops the
    program (seen lost in eval.py)."""
    on_swallowed(KeyboardInterrupt, _interrupt_again)


def _interrupt_again() -> bool:
    """A swallowed Ctrl-C raised anew in the main thread; while the interpreter shuts
    down (no main thread to raise it in: an atexit callback's) the process ends as a
    Ctrl-C ends it (it exited 0, silently, and a shell loop went on)."""
    if sys.is_finalizing() or not threading.main_thread().is_alive():
        _end(signal.SIGINT, None)
    return interrupt_main_later(signal.SIGINT)


def interrupt_main_later(signum: int) -> bool:
    """``signum`` to the main thread 10 ms from now, from another thread: once the
    callback that swallowed the last one (and the hook reporting it, where a
    handler's exception would be swallowed too) is done. True.

    The thread is started without waiting for it (``threading.Timer.start`` waits,
    and on a loaded machine its signal landed in that wait, inside the hook)."""
    _thread.start_new_thread(_interrupt_main, (signum,))
    return True


def _interrupt_main(signum: int) -> None:
    """``signum`` to the main thread, 10 ms on and once it has left the hook: a real
    signal also wakes it from a blocking call (a sleep, a wait), which
    ``_thread.interrupt_main`` does not."""
    time.sleep(0.01)
    while _in_hook:
        time.sleep(0.005)
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(threading.main_thread().ident, signum)
    else:
        _thread.interrupt_main(signum)
