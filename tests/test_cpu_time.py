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


def test_a_server_counts_from_the_start_or_from_0_when_it_was_replaced():
    # Stands for the warm pool's server: not this process's child to reap yet.
    code = BURN.format(seconds=0.4) + "import sys\nprint('burnt', flush=True)\nsys.stdin.read()\n"
    server = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline() == "burnt\n"
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
