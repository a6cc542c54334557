"""tests/cpu_time.py: a test's CPU counts its reaped children and the pool server's jobs."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import cpu_time

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def _item():
    return types.SimpleNamespace(stash=pytest.Stash())


def test_a_reaped_child_counts():
    item = _item()
    cpu_time.start(item, None)
    subprocess.run([sys.executable, "-c", BURN.format(seconds=0.5)], check=True)
    assert cpu_time.spent(item, None) >= 0.5


def _burnt_server(seconds: float) -> subprocess.Popen:
    """A process that burnt ``seconds`` of CPU and waits for its stdin to close."""
    code = (
        BURN.format(seconds=seconds) + "import sys\nprint('burnt', flush=True)\nsys.stdin.read()\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert server.stdout.readline() == "burnt\n"
    return server


def test_a_server_reaped_during_the_test_is_not_counted_twice():
    # The last test of a worker stops the session's pool in its teardown: the
    # server, reaped here, brings all its CPU into this process's children's
    # time. Its CPU before the test was counted by the tests before (a full
    # run counted 1,158 CPU-s for a 17-s test this way).
    server = _burnt_server(0.6)
    item = _item()
    cpu_time.start(item, server.pid)
    server.stdin.close()
    server.wait()  # Reaped: its 0.6 s are in os.times() children's now.
    assert cpu_time.spent(item, None) < 0.3


def test_a_server_counts_from_the_start_or_from_0_when_it_was_replaced():
    # Stands for the warm pool's server: not this process's child to reap yet.
    server = _burnt_server(0.4)
    try:
        burnt = cpu_time._server_seconds(server.pid)
        assert burnt >= 0.4
        same = _item()
        cpu_time.start(same, server.pid)
        assert cpu_time.spent(same, server.pid) < 0.2  # Its earlier CPU is not this test's.
        replaced = _item()
        cpu_time.start(replaced, None)  # No server at the start: one came since.
        assert cpu_time.spent(replaced, server.pid) >= burnt
    finally:
        server.stdin.close()
        server.wait()
    assert cpu_time._server_seconds(server.pid) == 0.0  # Gone: nothing to read.
