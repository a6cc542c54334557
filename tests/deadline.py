"""A deadline per test: a test that hangs ends its test process, not the run.

A hung collective, a deadlocked iterator's destructor or a peer that never
answers would otherwise hold the run until CI's limit, with nothing said.
When a test (its setup, call and teardown) passes its deadline, this prints
which test, every thread's stack and the processes the test process started,
kills those processes (by PID: only this process's descendants), and ends the
test process. Under pytest-xdist the controller then reports the test as
failed ("worker ... crashed while running ...") and starts a new worker for
the remaining tests. A test process's descendants are found from /proc
before any is killed, so none is left behind to reparent and run on.

``TFDIST_TEST_DEADLINE`` sets the seconds (default :data:`SECONDS`; 0 turns
the deadline off). ``--pdb`` and ``--trace`` turn it off too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

#: The slowest test took 413 s in a full run on 2 loaded cores (the first of
#: test_keras_hub_compression.py, which makes the module's 9 GPT-2 fits); the
#: slowest multi-process one 219 s. A hang is told from a slow test by a
#: margin of about 3x.
SECONDS = 1200.0
ENV = "TFDIST_TEST_DEADLINE"
#: The exit code of a test process that ended a test past its deadline.
EXIT_CODE = 70


def seconds() -> float:
    """The deadline per test from the environment, or :data:`SECONDS`."""
    raw = os.environ.get(ENV, "")
    try:
        value = float(raw) if raw else SECONDS
    except ValueError:
        raise pytest.UsageError(
            f"{ENV} must be a number of seconds (0: no deadline); received {raw!r}"
        ) from None
    if value < 0:
        raise pytest.UsageError(f"{ENV} must be >= 0 seconds (0: no deadline); received {raw!r}")
    return value


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # Ended while we looked.
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def expire(nodeid: str, limit: float, config=None) -> None:
    """What happens at the deadline: report, kill the descendants, exit."""
    capture = config.pluginmanager.getplugin("capturemanager") if config else None
    if capture is not None:
        # During a test, fd 2 is pytest's capture file, lost at the exit.
        try:
            capture.suspend_global_capture(in_=False)
        except Exception:  # noqa: BLE001 (the report matters more than the capture)
            pass
    out = sys.__stderr__
    pids = descendants(os.getpid())
    out.write(
        f"\n[tfdist tests] {nodeid} passed its deadline of {limit:g} s ({ENV}); "
        f"ending test process {os.getpid()} and the {len(pids)} process(es) it started:\n"
    )
    for pid in pids:
        out.write(f"    {pid}: {_command(pid)}\n")
    out.write("Every thread's stack:\n")
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    out.flush()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(EXIT_CODE)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = seconds()
    timer = None
    # Not under a debugger (--pdb, --trace): a prompt may wait for hours.
    debugging = item.config.getoption("usepdb", False) or item.config.getoption("trace", False)
    if limit and not debugging:
        timer = threading.Timer(limit, expire, args=(item.nodeid, limit, item.config))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
