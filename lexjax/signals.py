"""SIGTERM / Ctrl-C that arrive while a program is still starting (importing JAX,
parsing flags, joining its peers), before :func:`lexjax.training.train` installs
its own handlers (and eval.py's Ctrl-C while it imports, :func:`end_on_interrupt`).

``train.py`` calls :func:`defer` first thing; a signal then is only recorded, and
``train()`` acts on it as on one received while it sets up: it stops before the
first step and exits 0 with nothing to save, instead of the default handler's
status 143 (SIGTERM) or a KeyboardInterrupt traceback. This module imports
nothing heavy, so it is in place before JAX loads.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading

__all__ = [
    "defer",
    "ignored",
    "take_deferred",
    "end_on_interrupt",
    "restore_interrupt",
    "redeliver_swallowed_interrupts",
]

_received: list[str] = []


def _record(signum, frame):
    if _received and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C stops at once
    _received.append(signal.Signals(signum).name)


def defer() -> None:
    """Records SIGTERM and SIGINT from now on (main thread only) until ``train()``
    takes them over (:func:`take_deferred`). A SIGINT that whoever started the
    program ignores (a shell's background job, ``nohup … &``) stays ignored, here
    and in ``train()``: a Ctrl-C meant for the terminal's foreground program does
    not stop the run."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if not ignored(sig):
            signal.signal(sig, _record)


def ignored(sig: signal.Signals) -> bool:
    """Whether ``sig`` is SIGINT and ignored (inherited so; Python itself then keeps
    it ignored instead of raising KeyboardInterrupt). Other signals: False."""
    return sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN


def take_deferred() -> str | None:
    """The name of the first signal recorded since :func:`defer` (None: none), forgotten
    once taken."""
    name = _received[0] if _received else None
    _received.clear()
    return name


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


def _end(signum, frame):
    print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def redeliver_swallowed_interrupts(installed: list[bool] = []) -> None:  # noqa: B006 (once)
    """Once per process: a Ctrl-C's KeyboardInterrupt that a callback swallowed
    (Python only reports what a gc callback or ``__del__`` raises: JAX's gc callback
    runs often) is raised again in the main thread a moment later, after the
    callback, so a Ctrl-C always stops the program (seen lost in eval.py)."""
    if installed:
        return
    previous = sys.unraisablehook

    def unraisable(report):
        if isinstance(report.exc_value, KeyboardInterrupt):
            threading.Timer(0.01, _interrupt_main).start()
        else:
            previous(report)

    sys.unraisablehook = unraisable
    installed.append(True)


def _interrupt_main() -> None:
    """SIGINT to the main thread: a real signal also wakes it from a blocking call
    (a sleep, a wait), which ``_thread.interrupt_main`` does not."""
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    else:
        _thread.interrupt_main(signal.SIGINT)
