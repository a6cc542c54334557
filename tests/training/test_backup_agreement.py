"""Workers resume Keras's own BackupAndRestore at one point, or fail together.

With one ``backup_dir`` per task (hosts without a shared filesystem), a job
restarted after a SIGKILL used to resume worker 0 at its backup and worker 1
from scratch, which then failed with "Socket closed" in its next collective.
The rule (tfdist.training.fault_tolerance.backup_agreement) is tested as a pure function;
the per-task files (tfdist.training.fault_tolerance.backup_dirs) on disk; and two real
2-worker jobs (tests/workers/backup_dirs_fit.py): one under ``tfdist launch``
with a SIGKILL, one of plain TF_CONFIG processes whose backups disagree.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, finish, result_line, start, subprocess_env
from tfdist.training.callbacks import BackupError
from tfdist.training.fault_tolerance.backup_agreement import (
    BackupDisagreementError,
    agree,
    describe,
)

WORKER = str(REPO / "tests" / "workers" / "backup_dirs_fit.py")
BATCHES = 8  # Per epoch, in the worker.


# --------------------------------------------------------------------------
# The rule.


def test_no_backup_anywhere_is_a_fresh_start():
    assert agree({"worker:0": [], "worker:1": []}) is None


def test_the_same_backup_everywhere_is_the_point():
    assert agree({"worker:0": [(2, 0)], "worker:1": [(2, 0)]}) == (2, 0)


def test_a_task_ahead_resumes_with_the_others_at_the_newest_common_point():
    held = {
        "worker:0": [(3, 0), (2, 0)],
        "worker:1": [(2, 0), (1, 0)],
        "worker:2": [(2, 0), (1, 0)],
    }
    assert agree(held) == (2, 0)
    # Mid-epoch points order by batch within the epoch.
    assert agree({"a": [(1, 6), (1, 3)], "b": [(1, 3), (1, 0)]}) == (1, 3)


def test_no_common_point_fails_naming_every_task_and_what_it_holds():
    with pytest.raises(BackupDisagreementError) as caught:
        agree(
            {"worker:0": [(2, 0), (1, 4)], "worker:1": []},
            where={"worker:0": "/b/task0 on h0", "worker:1": "/b/task1 on h1"},
        )
    message = str(caught.value)
    assert isinstance(caught.value, BackupError)
    assert "expected every training task to hold a backup of one common point" in message
    assert "worker:0 holds epoch 2 and epoch 1, batch 4 in /b/task0 on h0" in message
    assert "worker:1 holds no backup in /b/task1 on h1" in message
    with pytest.raises(
        BackupDisagreementError,
        match=r"received: worker:0 holds epoch 2; worker:1 holds epoch 1\. ",
    ):
        agree({"worker:0": [(2, 0)], "worker:1": [(1, 0)]})
    assert describe((3, 0)) == "epoch 3" and describe((3, 2)) == "epoch 3, batch 2"


def test_a_backup_counts_only_if_its_weights_match_its_metadata(tmp_path):
    import keras

    from tfdist.training.fault_tolerance import backup_dirs

    callback = keras.callbacks.BackupAndRestore(str(tmp_path), double_checkpoint=True)

    def write(weights: str, metadata: str, content: bytes, epoch: int, batches: int = 0):
        Path(weights).write_bytes(content)
        Path(metadata).write_text(
            json.dumps(
                {
                    "epoch": epoch,
                    "batch": 0,
                    "tfdist_batches_done": batches,
                    **backup_dirs.weights_digest(weights),
                }
            )
        )

    write(callback._weights_path, callback._training_metadata_path, b"new", 2, 3)
    write(callback._prev_weights_path, callback._prev_training_metadata_path, b"old", 1)
    assert backup_dirs.held(callback) == {"latest": (2, 3), "previous": (1, 0)}
    # A kill between the weights and the metadata: the latest weights are
    # another save's; only the previous backup can be restored.
    Path(callback._weights_path).write_bytes(b"nex")
    assert backup_dirs.held(callback) == {"previous": (1, 0)}
    backup_dirs.roll_back(callback)
    assert backup_dirs.held(callback) == {"latest": (1, 0), "previous": (1, 0)}


# --------------------------------------------------------------------------
# Real jobs.


def _progress(directory: Path, task: str) -> list[tuple[int, int, int]]:
    path = directory / f"progress-{task}"
    if not path.exists():
        return []
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict, str]:
    """The issue's job: backup_dir=DIR/task<index>, `tfdist launch --workers 2
    --max-restarts 1`, worker 1 SIGKILLed in epoch 2 (double_checkpoint, the
    backups kept for the next test). Returns DIR, the tasks' final results
    and the launcher's output."""
    directory = tmp_path_factory.mktemp("launched")
    env = subprocess_env(
        TFDIST_TEST_BATCH_SLEEP="0.05", TFDIST_TEST_DOUBLE="1", TFDIST_TEST_DELETE="0"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--max-restarts",
            "1",
            WORKER,
            str(directory),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(e == 2 and b >= 2 for _, e, b in _progress(directory, "worker-1")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.02)
        os.kill(int((directory / "worker-1-0.pid").read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-5000:]
    return (
        directory,
        {
            t: json.loads((directory / f"result-1-{t}.json").read_text())
            for t in ("worker-0", "worker-1")
        },
        out,
    )


@pytest.mark.slow
def test_launch_after_a_sigkill_resumes_every_task_at_the_same_epoch(launched):
    """Both tasks resume at epoch 2 (the last epoch-end backup; worker 1 used
    to start over at epoch 0 and fail with "Socket closed") and end with one model."""
    directory, final, out = launched
    for result in final.values():
        assert result["epochs_run"] == [2, 3], out[-3000:]
        assert result["iterations"] == 4 * BATCHES
    assert final["worker-0"]["weights"] == final["worker-1"]["weights"]
    # Each task wrote its own directory.
    for task in ("task0", "task1"):
        with open(directory / task / "training_metadata.json") as f:
            assert json.load(f)["epoch"] == 4


def _plain_job(directory: Path, epochs: int, delete: bool) -> list[tuple[int, str, str]]:
    from tfdist.engines.net import local_spec

    cluster = local_spec(2)["cluster"]
    procs = [
        start(
            [WORKER, directory],
            tf_config={"cluster": cluster, "task": {"type": "worker", "index": i}},
            TFDIST_TEST_DOUBLE="1",
            TFDIST_TEST_DELETE="1" if delete else "0",
            TFDIST_TEST_EPOCHS=str(epochs),
        )
        for i in range(2)
    ]
    return finish(procs, 150)


@pytest.mark.slow
def test_plain_processes_fail_at_once_or_agree_on_the_common_backup(launched):
    """Plain TF_CONFIG processes restarted on the launched job's backups
    (both tasks hold epochs 4 and 3): (1) worker 1's directory lost: both
    fail before training, saying what each holds; (2) worker 1 holds only
    epoch 3: both resume there, and each deletes its directory at the end."""
    directory = launched[0]
    task1 = directory / "task1"
    kept = {name: (task1 / name).read_bytes() for name in os.listdir(task1)}
    trained = len(_progress(directory, "worker-0"))
    shutil.rmtree(task1)
    failed = _plain_job(directory, epochs=5, delete=False)
    assert [code for code, _, _ in failed] == [1, 1]
    for _, _, err in failed:
        [line] = [
            text
            for text in err.splitlines()
            if text.startswith("tfdist.training.fault_tolerance.backup_agreement.")
        ]
        assert "BackupDisagreementError: The workers cannot resume at the same point" in line
        assert f"worker:0 holds epoch 4 and epoch 3 in {directory / 'task0'} on " in line
        assert f"worker:1 holds no backup in {task1} on " in line
    assert len(_progress(directory, "worker-0")) == trained  # Not one batch trained.

    assert os.listdir(task1) == []  # Made for the probe, left empty.
    for name, content in kept.items():
        if not name.startswith(("latest.weights.h5", "training_metadata.json")) or name.endswith(
            ".bkp"
        ):
            (task1 / name).write_bytes(content)  # Its previous backup only: epoch 3.
    resumed = _plain_job(directory, epochs=5, delete=True)
    assert [code for code, _, _ in resumed] == [0, 0], resumed[1][2][-3000:]
    results = [result_line(out) for _, out, _ in resumed]
    assert [r["epochs_run"] for r in results] == [[3, 4], [3, 4]]
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["iterations"] == 5 * BATCHES
    assert not (directory / "task0").exists() and not task1.exists()
