"""The CPU seconds a test costs, recorded as its ``cpu`` property for
tests/suite_times.py.

On a 2-core machine the suite is bound by CPU, not by waits: a test's wall
time swings with what runs beside it, its CPU time does not. A test's CPU is
what its pytest process spent, what its reaped children spent (a launcher and
its tasks, a fresh interpreter), and what the warm pool's server and the jobs
it forked and reaped spent (its ``/proc`` record counts its reaped children),
from the start of the test's setup to the end of its teardown.

Not counted: daemons that are no one's child here (Slurm's, Ray's), and
children still running when the test ends (counted by the test that reaps
them). A pool server that this process reaps (at the end of the session, or
after it died) brings all its CPU into this process's children's time: the
share counted before the test began is taken off (:func:`spent`).
"""

from __future__ import annotations

import os

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_START = pytest.StashKey[tuple]()


def _server_seconds(pid: int | None) -> float:
    """CPU of ``pid`` and of the children it reaped; 0 for none or gone."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the name: state is field 3 of proc(5), utime..cstime 14..17.
    return sum(int(v) for v in fields[11:15]) / _TICK


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def start(item: pytest.Item, server: int | None) -> None:
    """Notes the CPU spent so far, before ``item``'s setup."""
    item.stash[_START] = (_own_seconds(), _server_seconds(server))


def spent(item: pytest.Item, server: int | None) -> float:
    """CPU seconds since :func:`start`.

    The server's CPU at the start is subtracted even when another server
    runs now (or none): the one that ran then was reaped by this process,
    so all its CPU, the start's share included, is in this process's
    children's time (the last test of a worker stops the session's pool in
    its teardown; a test after a dead server's start replaces it).
    """
    own, base = item.stash.get(_START, (_own_seconds(), 0.0))
    return _own_seconds() - own + _server_seconds(server) - base
