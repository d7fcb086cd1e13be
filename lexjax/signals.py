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

import os
import signal
import sys

__all__ = ["defer", "take_deferred", "end_on_interrupt", "restore_interrupt"]

_received: list[str] = []


def _record(signum, frame):
    if _received and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C stops at once
    _received.append(signal.Signals(signum).name)


def defer() -> None:
    """Records SIGTERM and SIGINT from now on (main thread only) until ``train()``
    takes them over (:func:`take_deferred`)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _record)


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
    an import, which can crash it). :func:`restore_interrupt` ends this."""
    signal.signal(signal.SIGINT, _end)


def restore_interrupt() -> None:
    """Python's own Ctrl-C (KeyboardInterrupt) again."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _end(signum, frame):
    print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
