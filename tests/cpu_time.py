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
them).
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
    item.stash[_START] = (_own_seconds(), server, _server_seconds(server))


def spent(item: pytest.Item, server: int | None) -> float:
    """CPU seconds since :func:`start`. A server started since (the pool
    died and was replaced) counts from 0; the one that died was reaped here."""
    own, before, base = item.stash.get(_START, (_own_seconds(), server, 0.0))
    base = base if server == before else 0.0
    return _own_seconds() - own + _server_seconds(server) - base
