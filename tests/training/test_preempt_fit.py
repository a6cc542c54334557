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
import time

import numpy as np
import pytest

from conftest import finish, result_line, start
from tfdist.engines.net import local_spec
from tfdist.training.fault_tolerance.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

WORKER = "tests/workers/preempt_fit.py"
EPOCHS, BATCHES = 3, 16
PLANNED = EPOCHS * BATCHES


def _batches_seen(progress: str) -> list[tuple[int, int]]:
    if not os.path.exists(progress):
        return []
    with open(progress) as f:
        return [tuple(map(int, line.split())) for line in f if line.strip()]


def run_job(
    tmp, env: dict, signal_at: tuple[int, int] | None = None, who: int = 1, timeout: float = 150.0
) -> dict:
    """Runs the 2-worker job; with ``signal_at=(epoch, batch)``, SIGTERMs
    worker ``who`` once both workers reported that batch done."""
    cluster = local_spec(2)["cluster"]
    progress = str(tmp / "progress")
    if os.path.exists(progress):
        os.remove(progress)
    procs = [
        start(
            [WORKER],
            tf_config={"cluster": cluster, "task": {"type": "worker", "index": i}},
            TFDIST_TEST_PROGRESS=progress,
            TFDIST_JOB_DIR=str(tmp / "job"),
            **env,
        )
        for i in range(2)
    ]
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
    return {
        "codes": [r[0] for r in results],
        "out": [r[1] for r in results],
        "err": [r[2] for r in results],
        "signal_to_exit": time.monotonic() - sent if sent else None,
        "seen": _batches_seen(progress),
    }


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


@pytest.mark.parametrize("compression", [None, "powersgd", "topk"])
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


def test_keras_own_backup_and_restore_saves_on_preemption_and_resumes_mid_epoch(
    tmp_path, reference
):
    """The stock keras.callbacks.BackupAndRestore, under a tfdist strategy,
    with no other change: same agreement, same exact resume."""
    env = {
        "TFDIST_TEST_BACKUP_DIR": str(tmp_path / "backup"),
        "TFDIST_TEST_BATCH_SLEEP": "0.03",
        "TFDIST_TEST_CALLBACK": "keras",
    }
    job = run_job(tmp_path, env, signal_at=(1, 6), who=1)
    assert job["codes"] == [PREEMPTED_EXIT_CODE] * 2, job["err"][1][-3000:]
    with open(tmp_path / "backup" / "training_metadata.json") as f:
        saved = json.load(f)
    records = _status(tmp_path)
    assert saved["tfdist_preempted"] is True and saved["epoch"] == 1
    assert saved["tfdist_batches_done"] in (8, 9)
    assert max(job["seen"]) == (1, saved["tfdist_batches_done"] - 1)
    assert {r["batch"] for r in records.values()} == {saved["tfdist_batches_done"]}

    job = run_job(tmp_path, env)
    assert job["codes"] == [0, 0], job["err"][0][-3000:]
    want = reference(None)
    for out in job["out"]:
        result = result_line(out)
        assert result["start_iterations"] == BATCHES + saved["tfdist_batches_done"]
        assert result["iterations"] == PLANNED
        np.testing.assert_allclose(result["weights"], want["weights"], rtol=0, atol=1e-6)
    # Keras deletes its backup after a complete fit.
    assert not os.path.exists(tmp_path / "backup")


def _single(tmp, env: dict, timeout: float = 120.0):
    proc = start([WORKER], TFDIST_JOB_DIR=str(tmp / "job"), **env)
    return finish([proc], timeout)[0]


def test_preemption_during_a_backup_write_keeps_the_previous_backup(tmp_path):
    """One process (no agreement needed). (1) SIGTERM while the periodic
    backup after batch 8 is written: the save completes, the job stops
    right there, no second save. (2) The rerun resumes there; SIGTERM after
    batch 3 of epoch 1, then SIGKILL inside that preempted save: the
    pointer still names the complete backup before it. (3) The rerun resumes
    from that one and ends with the weights of an unbroken run."""
    reference = _single(tmp_path, {"TFDIST_TEST_BACKUP_DIR": str(tmp_path / "ref")})
    assert reference[0] == 0, reference[2][-3000:]
    env = {"TFDIST_TEST_BACKUP_DIR": str(tmp_path / "backup")}
    code, _, err = _single(tmp_path, dict(env, TFDIST_TEST_SIGNAL_IN_SAVE="1"))
    assert code == PREEMPTED_EXIT_CODE, err[-3000:]
    pointer = _pointer(tmp_path / "backup")
    assert (pointer["epoch"], pointer["step"], pointer["preempted"]) == (0, 8, True)
    assert pointer["save_count"] == 1

    code, _, err = _single(
        tmp_path, dict(env, TFDIST_TEST_SELF_SIGNAL="1 3", TFDIST_TEST_KILL_IN_SAVE="2")
    )
    assert code == -signal.SIGKILL, err[-3000:]
    assert "received SIGTERM" in err
    pointer = _pointer(tmp_path / "backup")
    # Save 1 of this run was the periodic one at the end of epoch 0.
    assert (pointer["epoch"], pointer["step"], pointer["preempted"]) == (1, 0, False)
    # The killed save left only a temp file behind.
    assert any(n.startswith(".tmp-") for n in os.listdir(tmp_path / "backup"))

    code, out, err = _single(tmp_path, env)
    assert code == 0, err[-3000:]
    result, want = result_line(out), result_line(reference[1])
    assert (result["resumed_from"]["epoch"], result["resumed_from"]["step"]) == (1, 0)
    assert result["start_iterations"] == BATCHES
    assert result["iterations"] == PLANNED
    np.testing.assert_allclose(result["weights"], want["weights"], rtol=0, atol=1e-6)


def test_resume_at_another_size_names_the_policy_and_keeps_the_residuals(tmp_path):
    """Saved by 2 replicas with top-k (error feedback), resumed by 4: the
    global batch is kept (same 16 steps per epoch, same batch to resume
    at), the residuals are carried over with their sum kept, and the log
    says so."""
    env = {"TFDIST_TEST_BACKUP_DIR": str(tmp_path / "backup"), "TFDIST_TEST_COMPRESSION": "topk"}
    code, _, err = _single(
        tmp_path, dict(env, TFDIST_CPU_REPLICAS="2", TFDIST_TEST_SELF_SIGNAL="0 5")
    )
    assert code == PREEMPTED_EXIT_CODE, err[-3000:]
    pointer = _pointer(tmp_path / "backup")
    assert (pointer["replicas"], pointer["epoch"], pointer["step"]) == (2, 0, 6)

    code, out, err = _single(tmp_path, dict(env, TFDIST_CPU_REPLICAS="4"))
    assert code == 0, err[-3000:]
    assert "2 -> 4 replicas" in err and "global batch kept" in err
    assert "carried over to 4" in err and "times 2/4" in err
    result = result_line(out)
    assert result["start_iterations"] == 6 and result["iterations"] == PLANNED
    assert np.isfinite(result["weights"]).all()


def test_a_hung_peer_makes_the_signalled_worker_fail_in_time_with_a_message(tmp_path):
    """Worker 1 is stopped (SIGSTOP) just as worker 0 gets SIGTERM between
    two steps: worker 0 cannot get worker 1's acknowledgement, so it must
    neither save a backup the two did not agree on nor wait forever. It
    fails within the acknowledgement timeout (half of TFDIST_GRACE) and
    names the missing worker."""
    cluster = local_spec(2)["cluster"]
    progress = str(tmp_path / "progress")
    env = {
        "TFDIST_TEST_BACKUP_DIR": str(tmp_path / "backup"),
        "TFDIST_TEST_BATCH_SLEEP": "0.3",
        "TFDIST_GRACE": "10",
        "TFDIST_TEST_PROGRESS": progress,
    }
    procs = [
        start(
            [WORKER], tf_config={"cluster": cluster, "task": {"type": "worker", "index": i}}, **env
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while _batches_seen(progress).count((0, 3)) < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs)
            time.sleep(0.01)
        # Both are in their 0.3 s pause after batch 3: between steps.
        procs[1].send_signal(signal.SIGSTOP)
        procs[0].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode not in (0, PREEMPTED_EXIT_CODE), err[-3000:]
    assert "PreemptionError" in err and "training task 1 of 2 did not acknowledge" in err
    assert took < 30, took
    assert not os.path.exists(tmp_path / "backup" / "checkpoint.json")
