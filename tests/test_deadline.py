"""The deadline per test (tests/deadline.py), in a pytest run of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import deadline
from conftest import REPO

HANGS = textwrap.dedent(
    """
    import subprocess, time

    def test_hangs(tmp_path_factory):
        child = subprocess.Popen(["sleep", "600"])
        with open({pid_file!r}, "w") as f:
            f.write(str(child.pid))
        time.sleep(600)

    def test_after_it():
        assert 1 + 1 == 2
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_test_fails_alone_and_leaves_no_process(tmp_path):
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_hang.py").write_text(HANGS.format(pid_file=str(pid_file)))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "deadline", "-p", "no:cacheprovider", "-n", "1"]
        + ["-q", "test_hang.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests"), deadline.ENV: "3"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    took, out = time.monotonic() - start, done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "test_hang.py::test_hangs passed its deadline of 3 s" in out
    assert 'File "' in out and "in test_hangs" in out  # The stack.
    assert "sleep 600" in out  # The processes it started, named.
    # xdist reports the crash as the test's failure, and the next test runs.
    assert "crashed while running 'test_hang.py::test_hangs'" in out, out
    assert "1 failed, 1 passed" in out, out
    assert not _alive(int(pid_file.read_text())), "the hung test's child outlived it"
    assert took < 120, out


def test_a_deadline_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv(deadline.ENV, "ten")
    with pytest.raises(pytest.UsageError, match=r"TFDIST_TEST_DEADLINE .*received 'ten'"):
        deadline.seconds()
    monkeypatch.setenv(deadline.ENV, "-1")
    with pytest.raises(pytest.UsageError, match=r">= 0 seconds.*received '-1'"):
        deadline.seconds()
    monkeypatch.setenv(deadline.ENV, "0")
    assert deadline.seconds() == 0


def test_descendants_are_found_through_every_generation():
    code = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline_at = time.monotonic() + 60
        # (Between its fork and its exec, the grandchild is still "python".)
        while not (below := deadline.descendants(parent.pid)) or not _is_sleep(below[0]):
            assert time.monotonic() < deadline_at, "the child's own child never started"
            time.sleep(0.05)
        [grandchild] = below
        assert {parent.pid, grandchild} <= set(deadline.descendants(os.getpid()))
    finally:
        for pid in deadline.descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def _is_sleep(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"sleep\0")
    except FileNotFoundError:
        return False
