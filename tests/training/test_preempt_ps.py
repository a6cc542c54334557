"""Saving on preemption in parameter-server training (``tfdist.fit``).

Each run is the chief of a real local cluster (tests/workers/preempt_ps.py:
2 worker and 1 ps server subprocesses on 127.0.0.1), training 3 epochs of 24
steps with ``tfdist.BackupAndRestore``:

* SIGTERM to the coordinator mid-epoch: the steps in flight finish, the
  backup is taken at that step boundary, the status record is written, and
  the process exits with 143; the next run resumes at that step and ends
  with exactly the planned number of optimizer steps.
* SIGTERM to the ps: it serves on and leaves a notice; the coordinator saves
  the same way while the variables are still there, and exits 143; the ps
  exits once the coordinator's record is written.
* SIGTERM to a worker server: the job goes on without it and finishes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "workers" / "preempt_ps.py"
PLANNED, STEPS = 72, 24


def run_chief(
    workdir,
    what: str = "none",
    sigterm_at: tuple | None = None,
    grace: float = 20.0,
    timeout: float = 120.0,
) -> dict:
    """Runs the chief script; SIGTERM to it after batch ``sigterm_at`` = (epoch, batch)."""
    workdir.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), what, str(workdir)],
        cwd=REPO,
        env=subprocess_env(TFDIST_JOB_DIR=str(workdir / "job"), TFDIST_GRACE=str(grace)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list = []
    sent: dict = {}

    def pump() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.startswith("tfdist batch: ") and sigterm_at and "time" not in sent:
                epoch, batch = (int(v) for v in line.split()[2:4])
                if (epoch, batch) >= sigterm_at:
                    proc.send_signal(signal.SIGTERM)
                    sent.update(time=time.monotonic(), at=[epoch, batch])
            if line.startswith("tfdist signalled: "):
                sent.update(time=time.monotonic())
        proc.wait()
        sent["exit"] = time.monotonic()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    thread.join(timeout)
    if proc.poll() is None:
        proc.kill()
        thread.join(10)
    run = {
        "code": proc.returncode,
        "lines": lines,
        "sent": sent,
        "result": None,
        "start": None,
        "batches": [],
    }
    for line in lines:
        if line.startswith("tfdist result: "):
            run["result"] = json.loads(line.split(": ", 1)[1])
        elif line.startswith("tfdist start: "):
            run["start"] = json.loads(line.split(": ", 1)[1])
        elif line.startswith("tfdist batch: "):
            run["batches"].append(tuple(int(v) for v in line.split()[2:4]))
    if "time" in sent:
        run["exit_after"] = sent["exit"] - sent["time"]
    return run


def show(run: dict) -> str:
    return f"code {run['code']}:\n" + "\n".join(run["lines"][-60:])


def status_record(workdir) -> dict:
    with open(workdir / "job" / "preempted" / "chief-0.json") as f:
        return json.load(f)


def check_resume(workdir, record: dict) -> dict:
    """Runs again: it resumes at the preempted step and ends with PLANNED steps."""
    again = run_chief(workdir)
    assert again["code"] == 0, show(again)
    pointer = again["start"]
    assert pointer["preempted"] is True
    assert (pointer["epoch"], pointer["step"], pointer["global_step"]) == (
        record["epoch"],
        record["batch"],
        record["step"],
    )
    # The first batch trained is the one after the backup, mid-epoch.
    assert again["batches"][0] == (record["epoch"], record["batch"]), again["batches"][:3]
    result = again["result"]
    assert result["iterations"] == result["planned"] == PLANNED, result
    assert len(again["batches"]) == PLANNED - record["step"]
    return again


def test_sigterm_to_the_coordinator_saves_at_a_step_boundary_and_resumes(tmp_path):
    first = run_chief(tmp_path, sigterm_at=(1, 5))
    assert first["code"] == 143, show(first)
    record = status_record(tmp_path)
    assert record["task"] == "chief:0" and record["epoch"] == 1
    assert 0 < record["batch"] < STEPS
    assert record["step"] == record["epoch"] * STEPS + record["batch"]
    # The in-flight steps finished before the save: at most one window of
    # steps (4 per worker) after the batch at which the signal came.
    assert first["sent"]["at"][1] < record["batch"] <= first["sent"]["at"][1] + 1 + 8
    assert first["exit_after"] < 15, first["exit_after"]
    print(
        f"coordinator: SIGTERM after batch {first['sent']['at']}, saved at epoch "
        f"{record['epoch']} batch {record['batch']} (step {record['step']}), exit after "
        f"{first['exit_after']:.2f} s, saved {record['saved_time'] - record['signal_time']:.2f}"
        " s after the signal"
    )
    check_resume(tmp_path, record)


def test_sigterm_to_the_ps_makes_the_coordinator_save_before_the_ps_leaves(tmp_path):
    first = run_chief(tmp_path, "ps:0@1:5")
    assert first["code"] == 143, show(first)
    assert any("ps:0 was preempted" in line for line in first["lines"]), show(first)
    record = status_record(tmp_path)
    assert record["epoch"] == 1 and 5 < record["batch"] < STEPS
    with open(tmp_path / "logs-0" / "ps-0.log") as f:
        ps_log = f.read()
    assert "ps:0 exits (the coordinator saved)" in ps_log, ps_log[-2000:]
    print(
        f"ps: signal -> coordinator exit {first['exit_after']:.2f} s, saved at "
        f"step {record['step']}"
    )
    check_resume(tmp_path, record)


def test_sigterm_to_a_worker_server_leaves_the_job_running(tmp_path):
    run = run_chief(tmp_path, "worker:1@0:5", grace=4.0)
    assert run["code"] == 0, show(run)
    result = run["result"]
    # At-least-once: a step the leaving worker was running may run again.
    assert PLANNED <= result["iterations"] <= PLANNED + 1, result
    assert len(run["batches"]) == PLANNED
    with open(tmp_path / "logs-0" / "worker-1.log") as f:
        worker_log = f.read()
    assert "worker:1 received SIGTERM" in worker_log, worker_log[-2000:]
    assert "worker:1 exits" in worker_log, worker_log[-2000:]
    assert not (tmp_path / "job" / "preempted").exists()
