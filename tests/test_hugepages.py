"""The programs' restart with glibc's huge-page tunable (lexjax/hugepages.py)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from lexjax import hugepages

MADVISE = dict(glibc=(2, 36), thp="madvise")


def test_restarts_only_where_it_helps_and_is_wanted():
    assert hugepages.reason_to_skip({}, **MADVISE) is None
    assert (
        hugepages.reason_to_skip({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **MADVISE) is None
    )
    assert "LEXJAX_HUGEPAGES=0" in hugepages.reason_to_skip({"LEXJAX_HUGEPAGES": "0"}, **MADVISE)
    assert "already" in hugepages.reason_to_skip(
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, **MADVISE
    )
    assert "2.35" in hugepages.reason_to_skip({}, glibc=(2, 31), thp="madvise")
    for mode in ("always", "never"):
        assert mode in hugepages.reason_to_skip({}, glibc=(2, 36), thp=mode)


# A child that reports itself, restarts, and reports again: what survives the exec, and
# whether a 64 MiB malloc'd block (glibc mmaps it) is backed by huge pages afterwards.
CHILD = textwrap.dedent(
    """
    import ctypes, json, os, re, sys
    from lexjax import hugepages

    def huge_kib():
        with open("/proc/self/smaps_rollup") as f:
            return int(re.search(r"AnonHugePages:\\s+(\\d+) kB", f.read()).group(1))

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    size = 64 << 20
    before = huge_kib()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    print(json.dumps(dict(pid=os.getpid(), argv=sys.argv[1:], huge_kib=huge_kib() - before,
                          tunables=os.environ.get("GLIBC_TUNABLES", ""))), flush=True)
    hugepages.reexec_with_hugepages()
    print("done", flush=True)
    """
)


def _run_child(env):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "--flag=1", "x"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    return [json.loads(line) for line in out[:-1]], out[-1]


def _env_without_tunable():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LEXJAX_HUGEPAGES")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


# The tests that start a process which restarts: only where this machine would.
restarts_here = pytest.mark.skipif(
    hugepages.reason_to_skip(environ={}) is not None,
    reason=f"this machine cannot: {hugepages.reason_to_skip(environ={})}",
)


@restarts_here
def test_restart_keeps_pid_and_arguments_and_gives_huge_pages():
    env = _env_without_tunable()
    env["GLIBC_TUNABLES"] = "glibc.malloc.arena_max=4"
    (first, second), last = _run_child(env)
    assert last == "done"
    assert first["pid"] == second["pid"]
    assert first["argv"] == second["argv"] == ["--flag=1", "x"]
    assert first["tunables"] == "glibc.malloc.arena_max=4"
    assert second["tunables"] == "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"
    # Without the tunable the kernel (madvise mode) gives the block 4 KiB pages only.
    assert first["huge_kib"] == 0
    assert second["huge_kib"] >= 32 << 10

    env["LEXJAX_HUGEPAGES"] = "0"
    (only,), last = _run_child(env)
    assert last == "done" and only["tunables"] == "glibc.malloc.arena_max=4"


# A program as train.py starts: the restart first, then its work.
PROGRAM = textwrap.dedent(
    """
    if __name__ == "__main__":
        from lexjax import hugepages

        hugepages.reexec_with_hugepages()
    print("the program ran")
    """
)


@restarts_here
def test_run_in_a_jupyter_kernel_does_not_restart_the_kernel(tmp_path):
    """``%run train.py`` in a notebook: the restart re-executed sys.orig_argv, the
    kernel's, so the kernel restarted in place (its variables lost) and the cell never
    finished."""
    import nbformat
    from nbclient import NotebookClient

    (tmp_path / "prog.py").write_text(PROGRAM)
    cells = ["import os\npid = os.getpid()", "%run prog.py", "print(os.getpid() == pid)"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(notebook, timeout=60, resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_env_without_tunable())  # a cell that never ends: CellTimeoutError
    text = ["".join(o.get("text", "") for o in cell.outputs) for cell in notebook.cells]
    assert text == ["", "the program ran\n", "True\n"]


@restarts_here
def test_a_program_read_from_stdin_runs_without_restarting():
    """``python - < train.py``: the restart ran ``python -`` again on the stdin the
    first process had read to its end, an empty program: nothing done, exit status 0."""
    for argv in (["-", "--flag=1"], []):
        out = subprocess.run(
            [sys.executable, *argv],
            input=PROGRAM,
            env=_env_without_tunable(),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert out.stdout == "the program ran\n", argv


@restarts_here
def test_a_restart_that_cannot_exec_lets_the_program_run_on():
    """The restart is a speed-up: where it cannot exec, the program ran no further (a
    ValueError traceback, exit status 1, where a launcher's argv[0] names no file so
    that sys.executable is empty; an OSError where the exec fails)."""
    env = _env_without_tunable()
    out = subprocess.run(
        ["no-such-python", "-c", PROGRAM],  # sys.executable is then ""
        executable=sys.executable,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (0, "the program ran\n"), out.stderr
    gone = "import sys\nsys.executable = '/no/such/python'\n"
    out = subprocess.run(
        [sys.executable, "-c", gone + PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout) == (0, "the program ran\n"), out.stderr
    # An exec the system refuses (EACCES here; a sandbox's EPERM): a PermissionError.
    refused = f"import sys\nsys.executable = {os.devnull!r}\n"
    out = subprocess.run(
        [sys.executable, "-c", refused + PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (0, "the program ran\n"), out.stderr


@restarts_here
def test_a_restart_whose_tunable_glibc_drops_happens_once():
    """In a secure-execution process (AT_SECURE: an interpreter with file capabilities
    run by another user) glibc empties GLIBC_TUNABLES at the exec, so the restarted
    process saw no tunable and restarted again, forever (same pid, the program never
    ran). Simulated here by emptying it as glibc 2.36 does; the marker is not inherited."""
    program = textwrap.dedent(
        """
        import os
        starts = int(os.environ.get("STARTS", "0")) + 1
        os.environ["STARTS"] = str(starts)
        if starts > 3:
            raise SystemExit("restarted again and again")
        os.environ["GLIBC_TUNABLES"] = ""  # what glibc leaves of it under AT_SECURE
        """
    )
    after = "print(os.environ['STARTS'], sorted(k for k in os.environ if 'LEXJAX' in k))\n"
    out = subprocess.run(
        [sys.executable, "-c", program + PROGRAM + after],
        env=_env_without_tunable(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (0, "the program ran\n2 []\n"), out.stderr


def test_glibc_version_is_the_running_c_librarys(monkeypatch):
    """A misread version skipped the restart on every machine (and these tests with it,
    as "this machine cannot"). Oracle: glibc's own gnu_get_libc_version(), and
    hand-written confstr answers."""
    import ctypes

    try:
        get = ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        pytest.skip("not glibc")
    get.restype = ctypes.c_char_p
    major, minor = get().decode().split(".")[:2]
    assert hugepages._glibc_version() == (int(major), int(minor))
    for answer, version in [
        ("glibc 2.35", (2, 35)),
        ("glibc 2.39.9000", (2, 39)),
        ("musl 1.2.4", None),
    ]:
        monkeypatch.setattr(hugepages.os, "confstr", lambda name, answer=answer: answer)
        assert hugepages._glibc_version() == version, answer


def test_thp_mode_is_the_bracketed_word(tmp_path):
    """The kernel marks its mode in brackets (Documentation/admin-guide/mm/transhuge.rst)."""
    path = tmp_path / "enabled"
    for text, mode in [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("always madvise never\n", None),
    ]:
        path.write_text(text)
        assert hugepages._thp_mode(str(path)) == mode, text
    assert hugepages._thp_mode(str(tmp_path / "absent")) is None


def test_glibc_2_35_restarts_and_a_c_library_not_glibc_does_not(monkeypatch):
    """README: glibc ≥ 2.35 (the first with glibc.malloc.hugetlb), so 2.35 itself
    restarts; a C library that is not glibc (musl: no version) skips, not a traceback."""
    assert hugepages.reason_to_skip({}, glibc=(2, 35), thp="madvise") is None
    assert "2.35" in hugepages.reason_to_skip({}, glibc=(2, 34), thp="madvise")
    monkeypatch.setattr(hugepages, "_glibc_version", lambda: None)
    assert "2.35" in hugepages.reason_to_skip({}, thp="madvise")


def test_the_tunable_off_removes_it_and_keeps_the_others():
    """bench/train_processes.py's 4 KiB-page side (on=False) must not get huge pages."""
    tunables = "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    off = hugepages.environ_with_tunable({"GLIBC_TUNABLES": tunables, "A": "b"}, on=False)
    assert off == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "b"}
    assert (
        hugepages.environ_with_tunable({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, on=False) == {}
    )
    assert hugepages.environ_with_tunable({}, on=True) == {"GLIBC_TUNABLES": hugepages.TUNABLE}


@restarts_here
def test_what_a_program_printed_before_the_restart_is_not_lost():
    """The exec replaces the process, and with it what stdout buffered (a pipe: not
    flushed at each line)."""
    env = _env_without_tunable()
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as by default
    out = subprocess.run(
        [sys.executable, "-c", "print('said first')\n" + PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Said once by each of the two processes, then the program runs once.
    assert (out.returncode, out.stdout) == (0, "said first\nsaid first\nthe program ran\n")
