"""lexjax/signals.py in this process: which handlers defer(), end_deferral(),
end_on_interrupt() and restore_interrupt() set and leave, and what a deferred signal
records. (The programs that receive real signals: tests/test_faults.py,
tests/test_experiments.py, tests/test_eval_cli.py.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from lexjax import signals
from tests.processes import ROOT, interruptible


@pytest.fixture
def handlers():
    """The stop signals' handlers as the test found them, put back after it; a
    Python-default start (SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP end)."""
    found = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signals.take_deferred()
    yield
    signals.take_deferred()
    for sig, handler in found.items():
        signal.signal(sig, handler)


def _send(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the main thread's next bytecode


def test_the_first_deferred_signal_is_taken_once(handlers):
    """take_deferred: "the first signal recorded since defer (None: none), forgotten
    once taken"; the handlers stay until end_deferral gives Python's back."""
    signals.defer()
    _send(signal.SIGTERM)
    _send(signal.SIGHUP)  # a second stop: still the first is the one taken
    assert signals.take_deferred() == "SIGTERM"
    assert signals.take_deferred() is None
    _send(signal.SIGHUP)
    assert signals.end_deferral() == "SIGHUP"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    assert signals.end_deferral() is None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_a_signal_ignored_at_the_start_stays_ignored(handlers, sig):
    """README: a Ctrl-C in a background job and nohup's hangup stop nothing: defer()
    neither records nor takes over an ignored SIGINT or SIGHUP, and end_deferral()
    leaves it ignored (the study under nohup must survive the hangup)."""
    signal.signal(sig, signal.SIG_IGN)
    signals.defer()
    assert signal.getsignal(sig) is signal.SIG_IGN
    _send(sig)
    assert signals.end_deferral() is None
    assert signal.getsignal(sig) is signal.SIG_IGN
    # SIGTERM is never left ignored: it was taken over and is given back as found.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_eval_py_s_ctrl_c_while_it_loads_and_after(handlers):
    """end_on_interrupt takes Ctrl-C over while eval.py loads; restore_interrupt gives
    back Python's KeyboardInterrupt (which eval.py turns into its one line), and both
    leave an ignored SIGINT (a background job's) ignored."""
    signals.end_on_interrupt()
    assert signal.getsignal(signal.SIGINT) is signals._end
    signals.restore_interrupt()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        _send(signal.SIGINT)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signals.end_on_interrupt()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    signals.restore_interrupt()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


class _Handled(Exception):
    pass


class _Declined(Exception):
    pass


def test_a_swallowed_exception_goes_to_its_action_and_every_other_report_on(monkeypatch):
    """on_swallowed: again() runs for a swallowed exception of its kind (a subclass
    too); one it did not deliver anew (False), and any other kind, is reported by the
    hook found, as Python reports it."""
    reported, acted = [], []
    monkeypatch.setattr(signals, "_again", {})  # as in a fresh process: the hook not yet set
    monkeypatch.setattr("sys.unraisablehook", lambda report: reported.append(report.exc_type))
    signals.on_swallowed(_Handled, lambda: acted.append("handled") or True)
    signals.on_swallowed(_Declined, lambda: acted.append("declined") or False)

    class Sub(_Handled):
        pass

    def swallowed(kind):
        class Callback:
            def __del__(self):
                raise kind

        Callback()  # its __del__ runs here; Python hands the exception to the hook

    for kind in (_Handled, Sub, _Declined, ValueError):
        swallowed(kind)
    assert acted == ["handled", "handled", "declined"]
    assert reported == [_Declined, ValueError]


# A program that stops at once on a Ctrl-C (argv[1]: "defer", the second one while
# train.py starts; "end_on_interrupt", eval.py's first while it loads JAX).
_STOPS_AT_ONCE = """
import os, signal, sys, time
from lexjax import signals
if sys.argv[1] == "defer":
    signals.defer()
    os.kill(os.getpid(), signal.SIGINT)  # the first: only recorded
else:
    signals.end_on_interrupt()
print("ready", flush=True)
time.sleep(30)
"""
# errors.report running a program that a Ctrl-C interrupts (eval.py's, the study's).
_REPORTED = """
import time
from lexjax import errors
def program():
    print("ready", flush=True)
    time.sleep(30)
errors.report(program)
"""


@pytest.mark.parametrize("start", ["defer", "end_on_interrupt", "errors.report"])
def test_a_ctrl_c_that_stops_at_once_ends_by_sigint_also_when_stderr_is_gone(start):
    """README: such a Ctrl-C ends the process by SIGINT, so a shell loop stops too.
    With `2>&1 | tee log` the same Ctrl-C ends tee, and writing its line raised
    BrokenPipeError: status 1 (a bug's), the loop went on (in signals' handler, and
    in errors.report, where eval.py's and the study's Ctrl-C ends)."""
    read_end, write_end = os.pipe()
    code = [_REPORTED] if start == "errors.report" else [_STOPS_AT_ONCE, start]
    child = subprocess.Popen(
        interruptible([sys.executable, "-c", *code]),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=write_end,
        text=True,
    )
    os.close(write_end)
    os.close(read_end)  # stderr's reader is gone before the Ctrl-C
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=60) == -signal.SIGINT
    finally:
        child.kill()
        child.communicate()
