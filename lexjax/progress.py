"""The one progress display of every program: a bar on a terminal, plain lines elsewhere.

On a terminal, and in a Jupyter or Colab cell (ipykernel's output streams
honour a carriage return too), a single line is redrawn in place (with a rate
and an ETA). When the stream is neither (Colab's ``!python``, nohup, CI logs) it
prints plain ``label done/total ...`` lines, at most one per
``min_interval_s`` seconds and always the last one, so a long evaluation is
never silent and a log holds no escape codes.

What it prints is a view of the work, never the work: a stream that fails (its
reader gone, ``eval.py 2>&1 | head``) ends the display, and the program goes on
to its results and its own status (the stdout it shares fails there too).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "end_open_line", "note"]

# The display whose line is drawn on a terminal and not yet ended (see end_open_line).
_open: Progress | None = None


def _redraws_lines(stream: TextIO) -> bool:
    return stream.isatty() or type(stream).__module__.startswith("ipykernel.")


class Progress:
    """``update(done, text)`` as work advances; ``close()`` at the end.

    Args:
      total: the amount of work (steps, tokens).
      label: what is counted, printed before ``done/total``.
      start: work already done before this display began (a resumed run):
        rates and ETAs count from here.
      stream: where to print (default stderr).
      enabled: False makes every call a no-op (non-zero processes).
      min_interval_s: off a terminal, the least time between two lines.
    """

    def __init__(
        self,
        total: int,
        *,
        label: str = "",
        start: int = 0,
        stream: TextIO | None = None,
        enabled: bool = True,
        min_interval_s: float = 10.0,
    ):
        self.total, self.label, self.start = max(int(total), 1), label, start
        self.stream = stream or sys.stderr
        # None: the program started without a stderr (`2>&-`), and there is nowhere to draw.
        self.enabled = enabled and self.stream is not None
        self.tty = self.enabled and _redraws_lines(self.stream)
        self.min_interval_s = min_interval_s
        self.t0 = time.perf_counter()
        self._last_line = -float("inf")
        self._drawn = False
        self._width = 0  # of the longest line drawn on a terminal

    def update(self, done: int, text: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.t0
        eta = elapsed / max(done - self.start, 1) * max(self.total - done, 0)
        label = f"{self.label} " if self.label else ""
        status = f"{label}{done}/{self.total} {text}".rstrip() + f" eta {eta:.0f}s"
        if self.tty:
            width = 30
            filled = int(width * min(done, self.total) / self.total)
            bar = "#" * filled + "-" * (width - filled)
            # Padded to the longest line drawn: a shorter one (a rate one digit shorter)
            # left the end of the one before on the screen.
            line = f"[{bar}] {status} "
            self._width = max(self._width, len(line))
            self._drawn = self._print("\r" + line.ljust(self._width), end="")
            global _open
            _open = self if self._drawn else None
        elif now - self._last_line >= self.min_interval_s or done >= self.total:
            self._print(status)
            self._last_line = now

    def close(self) -> None:
        global _open
        if self.tty and self._drawn:
            self._print()
        self._drawn = False
        if _open is self:
            _open = None

    def _print(self, *text: str, end: str = "\n") -> bool:
        """Prints ``text``; where the stream fails, the display ends (returns False)."""
        if _said(self.stream, *text, end=end):
            return True
        self.enabled = self.tty = False
        return False


def _said(stream, *text: str, end: str = "\n") -> bool:
    """Prints ``text`` on ``stream``; False where the stream cannot take it (its reader
    gone, a full disk, a closed file). Another error is raised: a guarded stdout's own
    one-line error (:mod:`lexjax.errors`, a ValueError) stays the program's."""
    try:
        print(*text, end=end, file=stream, flush=True)
        return True
    except OSError:
        return False
    except ValueError:
        if getattr(stream, "closed", False):
            return False
        raise


def note(message: str) -> None:
    """``message`` as a line on stderr, where it can still be said: like the display,
    a note is not the work, and a stderr whose reader went away
    (``eval.py 2>&1 | head``) is no reason to stop it. Without a stderr (`2>&-`), nowhere
    (print would take stdout instead)."""
    if sys.stderr is not None:
        _said(sys.stderr, message)


def end_open_line() -> None:
    """Ends the line of a display left drawn (a Ctrl-C or an error came between its
    updates and its close), so what a program says next starts a line of its own."""
    if _open is not None:
        _open.close()
