"""Saving on preemption inside ``fit``: real 2-worker jobs, real SIGTERMs.

Each job is two worker processes of tfdist's MultiWorkerMirrored on
127.0.0.1 running tests/workers/preempt_fit.py (3 epochs of 16 batches,
fixed data, an SGD with momentum and a decaying learning rate). A run that
is preempted twice, at different workers and epochs, then resumed, must end
with the weights of an uninterrupted run: exactly the planned 48 optimizer
steps, each batch trained once, in order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import numpy as np
import pytest

from conftest import finish, result_line, start
from tfdist.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

WORKER = "tests/workers/preempt_fit.py"
EPOCHS, BATCHES = 3, 16
PLANNED = EPOCHS * BATCHES


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _batches_seen(progress: str) -> list[tuple[int, int]]:
    if not os.path.exists(progress):
        return []
    with open(progress) as f:
        return [tuple(map(int, line.split())) for line in f if line.strip()]


def run_job(tmp, env: dict, signal_at: tuple[int, int] | None = None, who: int = 1,
            timeout: float = 150.0) -> dict:
    """Runs the 2-worker job; with ``signal_at=(epoch, batch)``, SIGTERMs
    worker ``who`` once both workers reported that batch done."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _ports(2)]}
    progress = str(tmp / "progress")
    if os.path.exists(progress):
        os.remove(progress)
    procs = [start([WORKER], tf_config={"cluster": cluster, "task": {"type": "worker", "index": i}},
                   TFDIST_TEST_PROGRESS=progress, TFDIST_JOB_DIR=str(tmp / "job"), **env)
             for i in range(2)]
    sent = None
    deadline = time.monotonic() + timeout
    while signal_at and sent is None and time.monotonic() < deadline:
        if _batches_seen(progress).count(signal_at) >= 2:
            procs[who].send_signal(signal.SIGTERM)
            sent = time.monotonic()
        elif any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    results = finish(procs, timeout)
    return {"codes": [r[0] for r in results], "out": [r[1] for r in results],
            "err": [r[2] for r in results], "signal_to_exit": time.monotonic() - sent if sent else None,
            "seen": _batches_seen(progress)}


def _pointer(backup_dir) -> dict:
    with open(os.path.join(backup_dir, "checkpoint.json")) as f:
        return json.load(f)


def _status(tmp) -> dict:
    directory = tmp / "job" / "preempted"
    records = {}
    for name in sorted(os.listdir(directory)):
        with open(directory / name) as f:
            records[name] = json.load(f)
    for name in os.listdir(directory):
        os.remove(directory / name)
    return records


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, per compression setting, computed once."""
    cache = {}

    def get(compression: str | None) -> dict:
        if compression not in cache:
            tmp = tmp_path_factory.mktemp("reference")
            env = {"TFDIST_TEST_BACKUP_DIR": str(tmp / "backup")}
            if compression:
                env["TFDIST_TEST_COMPRESSION"] = compression
            job = run_job(tmp, env)
            assert job["codes"] == [0, 0], job["err"][0][-3000:]
            cache[compression] = result_line(job["out"][0])
        return cache[compression]
    return get


@pytest.mark.parametrize("compression", [None, "powersgd"])
def test_preempted_twice_then_resumed_equals_uninterrupted(tmp_path, reference, compression):
    env = {"TFDIST_TEST_BACKUP_DIR": str(tmp_path / "backup"), "TFDIST_TEST_BATCH_SLEEP": "0.03"}
    if compression:
        env["TFDIST_TEST_COMPRESSION"] = compression
    stops = []
    # First preemption: worker 1 in epoch 0; second: worker 0 in epoch 1.
    for signal_at, who in (((0, 9), 1), ((1, 4), 0)):
        job = run_job(tmp_path, env, signal_at=signal_at, who=who)
        assert job["codes"] == [PREEMPTED_EXIT_CODE] * 2, job["err"][who][-3000:]
        pointer = _pointer(tmp_path / "backup")
        assert pointer["preempted"] is True
        records = _status(tmp_path)
        assert sorted(records) == ["worker-0.json", "worker-1.json"]
        steps = {r["step"] for r in records.values()}
        assert steps == {pointer["global_step"]}, records
        # Stopped within two steps of the signal: it came once both
        # workers had done B+1 batches of epoch E; the signalled worker sees
        # it at its next step boundary (B+2 done, or B+1 if it was still
        # there) and asks every worker to stop after one more step.
        epoch, batch = signal_at
        assert pointer["epoch"] == epoch and pointer["step"] in (batch + 2, batch + 3), pointer
        assert records[f"worker-{who}.json"]["signal_time"] is not None
        stops.append((pointer["global_step"], job["signal_to_exit"]))
        # The job trained no batch beyond the one it saved at.
        assert max(job["seen"]) == (pointer["epoch"], pointer["step"] - 1), job["seen"][-4:]

    job = run_job(tmp_path, env)
    assert job["codes"] == [0, 0], job["err"][0][-3000:]
    results = [result_line(out) for out in job["out"]]
    want = reference(compression)
    for result in results:
        # Resumed exactly at the second stop, and ran the planned steps in all.
        assert result["start_iterations"] == stops[-1][0]
        assert result["iterations"] == PLANNED == want["iterations"]
        assert result["resumed_from"]["preempted"] is True
        np.testing.assert_allclose(result["weights"], want["weights"], rtol=0, atol=1e-6)
    # Each stop came well within a 30 s grace period.
    assert all(seconds < 30 for _, seconds in stops), stops
