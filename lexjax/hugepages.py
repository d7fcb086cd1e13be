"""Transparent huge pages for XLA:CPU's temporaries: restart a program once with glibc's
``glibc.malloc.hugetlb=1`` tunable.

XLA:CPU allocates all temporaries of one execution as one block: about 730 MiB for
configs/tiny.py's train step. glibc serves a block that large with a fresh ``mmap``
and unmaps it when it is freed, so at every step the kernel faults the block in again
4 KiB at a time: about 187,000 page faults a step (docs/benchmarks.md §10). With the
tunable, glibc ≥ 2.35 asks for transparent huge pages (``madvise``) on such mappings:
2 MiB pages, so a few hundred faults, and fewer TLB misses in every kernel that reads
them.

glibc reads tunables when a process starts, so :func:`reexec_with_hugepages` re-executes
the program (``os.execve``: same pid, same arguments) with the tunable added to
``GLIBC_TUNABLES``. The programs that train — ``train.py``, the experiment, ``bench/run.py``
and ``bench/profile_step.py`` — call it first; importing lexjax never does, nor does ``%run
train.py`` in a notebook, which would restart the kernel. In a notebook,
start Jupyter with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` instead.
``LEXJAX_HUGEPAGES=0`` turns the restart off. ``eval.py`` does not restart: the block
scan's temporaries are a few MiB that glibc reuses, and short ``eval.py`` runs measured
slower with the tunable (its compilation's allocations get huge pages too). This module
imports nothing heavy, so the restart happens before JAX loads.
"""

from __future__ import annotations

import os
import sys

__all__ = ["OPT_OUT", "TUNABLE", "environ_with_tunable", "reason_to_skip", "reexec_with_hugepages"]

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "LEXJAX_HUGEPAGES"  # "0": never restart
# Set for the restarted process only (it removes it): a program restarts at most once,
# also where glibc drops the tunable at the exec (a secure-execution process: an
# interpreter with file capabilities), which restarted it again and again.
_RESTARTED = "LEXJAX_HUGEPAGES_RESTARTED"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_MIN_GLIBC = (2, 35)  # the first glibc with glibc.malloc.hugetlb


def _glibc_version() -> tuple[int, ...] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    except (AttributeError, OSError, ValueError):
        return None
    if name != "glibc":
        return None
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def _thp_mode(path: str = _THP_MODE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def reason_to_skip(
    environ=None, glibc: tuple[int, ...] | None = None, thp: str | None = None
) -> str | None:
    """Why this process should not restart with the tunable, or None if it should.

    ``glibc`` and ``thp`` default to this machine's glibc version and kernel mode."""
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT, "1") == "0":
        return f"{OPT_OUT}=0"
    if "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES already sets glibc.malloc.hugetlb"
    glibc = _glibc_version() if glibc is None else glibc
    if glibc is None or glibc < _MIN_GLIBC:
        return "not glibc ≥ 2.35"
    thp = _thp_mode() if thp is None else thp
    if thp != "madvise":
        # always: every mapping gets huge pages already; never/unknown: none can.
        return f"transparent huge pages are {thp or 'unavailable'}, not madvise"
    return None


def environ_with_tunable(environ, on: bool = True) -> dict:
    """A copy of ``environ`` whose ``GLIBC_TUNABLES`` keeps its other tunables and has
    :data:`TUNABLE` appended (``on``) or any ``glibc.malloc.hugetlb`` setting removed."""
    env = dict(environ)
    kept = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and "hugetlb" not in t]
    if on:
        kept.append(TUNABLE)
    if kept:
        env["GLIBC_TUNABLES"] = ":".join(kept)
    return env


def _not_this_program() -> str | None:
    """Why ``sys.orig_argv`` would not start the program that runs now, or None."""
    ipython = sys.modules.get("IPython")
    if ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None:
        # %run train.py in Jupyter or IPython: orig_argv starts the kernel (or the shell).
        return "inside an IPython shell or Jupyter kernel"
    if sys.argv[:1] in ([""], ["-"]):
        return "the program came from stdin, which the interpreter has read"
    if not sys.executable:  # started with an argv[0] that names no file (exec -a NAME)
        return "the interpreter does not know its own executable"
    return None


def reexec_with_hugepages() -> None:
    """Re-executes this program with ``GLIBC_TUNABLES`` += ``glibc.malloc.hugetlb=1``
    unless :func:`reason_to_skip` finds a reason, or the interpreter's own command line
    would not start this program again (``%run`` in a Jupyter kernel, a program read
    from stdin); returns only when it skips, or when the exec fails."""
    if os.environ.pop(_RESTARTED, None) is not None:
        return  # this is the restart
    if _not_this_program() is not None or reason_to_skip() is not None:
        return
    for stream in (sys.stdout, sys.stderr):  # None where the program started without it
        if stream is not None:
            stream.flush()
    try:
        env = {**environ_with_tunable(os.environ), _RESTARTED: "1"}
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # e.g. a sandbox that forbids execve: the program runs on, 4 KiB pages
        return
