"""SIGTERM / Ctrl-C that arrive while a program is still starting (importing JAX,
parsing flags, joining its peers), before :func:`lexjax.training.train` installs
its own handlers.

``train.py`` calls :func:`defer` first thing; a signal then is only recorded, and
``train()`` acts on it as on one received while it sets up: it stops before the
first step and exits 0 with nothing to save, instead of the default handler's
status 143 (SIGTERM) or a KeyboardInterrupt traceback. This module imports
nothing heavy, so it is in place before JAX loads.
"""

from __future__ import annotations

import signal

__all__ = ["defer", "take_deferred"]

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
