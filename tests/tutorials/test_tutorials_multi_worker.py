"""TensorFlow's two multi-worker tutorials, through ``tfdist launch --workers 2``.

tests/workers/tutorial_multi_worker_keras.py follows multi_worker_with_keras.ipynb
(fit, then model.save / load_model, CheckpointManager, ModelCheckpoint and
BackupAndRestore on every worker with a shared directory) and
tests/workers/tutorial_multi_worker_ctl.py follows multi_worker_with_ctl.ipynb
(the custom loop with its CheckpointManager). The Keras one runs without
compression in 3 launches (the tutorial's main part and saving; the two
BackupAndRestore fits; ModelCheckpoint), so that a collective left unmatched
by an error in one part cannot fail the others, and with compression
(PowerSGD: both models have matrix weights) in one launch of all parts. The
custom loop runs once without and once with compression. Every check on a
job reads the results of its one launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow

_JOBS: dict = {}


def launch_job(script: str, compression: str | None, sections: str, workdir) -> dict:
    """Runs ``tfdist launch --workers 2 SCRIPT WORKDIR [SECTIONS]``; results by task."""
    env = subprocess_env(
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "workers")]),
        TFDIST_COLLECTIVE_TIMEOUT="120",
    )
    if compression:
        env["TFDIST_TEST_COMPRESSION"] = compression
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            str(REPO / "tests" / "workers" / script),
            str(workdir),
            *([sections] if sections else []),
        ],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # The launcher stops its tasks.
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"{script} did not finish in 600 s:\n{out[-6000:]}")  # noqa: B904 - the timeout is the failure; its traceback stays as context
    results = {}
    for line in out.splitlines():
        if "tfdist result: " in line:
            found = json.loads(line.split("tfdist result: ", 1)[1])
            results[found["task"]] = found
    assert proc.returncode == 0 and len(results) == 2, (
        f"{script} exited {proc.returncode}, results from {sorted(results)}:\n{out[-8000:]}"
    )
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Launches each (script, compression, sections) once, when a test first needs it."""

    def get(script: str, compression: str | None, sections: str = "") -> dict:
        if compression and script == KERAS:
            sections = ""  # One launch runs all sections with compression.
        key = (script, compression, sections)
        if key not in _JOBS:
            workdir = tmp_path_factory.mktemp(script.split(".")[0] + f"_{compression}")
            try:
                _JOBS[key] = launch_job(script, compression, sections, workdir)
            except AssertionError as error:
                _JOBS[key] = error
        if isinstance(_JOBS[key], AssertionError):
            raise _JOBS[key]
        return _JOBS[key]

    return get


COMPRESSION = [None, "powersgd"]
KERAS = "tutorial_multi_worker_keras.py"
CTL = "tutorial_multi_worker_ctl.py"
MAIN, BACKUP = "fit,save,checkpoint", "backup_epoch,backup_steps"


def workers(results: dict) -> tuple[dict, dict]:
    """The chief's (worker:0) and the other worker's results."""
    return results["worker:0"], results["worker:1"]


def no_error(chief: dict, other: dict, name: str) -> tuple[dict, dict]:
    """Both workers' results of section NAME; fails with both errors if any."""
    errors = {w["task"]: w["errors"][name] for w in (chief, other) if name in w["errors"]}
    assert not errors, "\n".join(f"{task}: {error}" for task, error in errors.items())
    return chief[name], other[name]


@pytest.mark.parametrize("compression", COMPRESSION)
def test_keras_tutorial_fit_trains_in_sync(job, compression):
    chief, other = workers(job(KERAS, compression, MAIN))
    assert chief["replicas"] == other["replicas"] == 2
    chief_fit, other_fit = no_error(chief, other, "fit")
    # Synchronous training: both workers computed the same losses and weights.
    assert chief_fit == other_fit
    assert chief_fit["loss"][-1] < chief_fit["loss"][0], chief_fit["loss"]
    assert chief_fit["checksum"] != chief["initial_checksum"]


@pytest.mark.parametrize("compression", COMPRESSION)
def test_keras_tutorial_save_on_every_worker_then_load(job, compression):
    for saved in no_error(*workers(job(KERAS, compression, MAIN)), "save"):
        # Every worker loads the chief's complete file, with the trained
        # weights, and the non-chief's temporary copy is gone.
        assert saved["loaded_checksum"] == pytest.approx(saved["model_checksum"], rel=1e-6)
        assert saved["temp_left"] is False
        assert np.all(np.isfinite(saved["loaded_fit_loss"]))


@pytest.mark.parametrize("compression", COMPRESSION)
def test_keras_tutorial_checkpoint_manager_restores(job, compression):
    chief, other = workers(job(KERAS, compression, MAIN))
    for ckpt in no_error(chief, other, "checkpoint"):
        assert ckpt["latest"] is not None
        assert ckpt["restored_checksum"] == pytest.approx(ckpt["saved_checksum"], rel=1e-6)
    assert chief["checkpoint"]["loss"] == other["checkpoint"]["loss"]


@pytest.mark.parametrize("compression", COMPRESSION)
def test_keras_tutorial_stock_model_checkpoint(job, compression):
    chief, other = workers(job(KERAS, compression, "model_checkpoint"))
    for saved in no_error(chief, other, "model_checkpoint"):
        assert "ckpt_0002.weights.h5" in saved["files"] and "model.keras" in saved["files"]
        # What the files hold is the trained model.
        assert saved["weights_file_checksum"] == pytest.approx(saved["checksum"], rel=1e-6)
        assert saved["model_file_checksum"] == pytest.approx(saved["checksum"], rel=1e-6)
    assert chief["model_checkpoint"]["checksum"] == other["model_checkpoint"]["checksum"]


@pytest.mark.parametrize("frequency", ["backup_epoch", "backup_steps"])
@pytest.mark.parametrize("compression", COMPRESSION)
def test_keras_tutorial_stock_backup_and_restore(job, compression, frequency):
    chief, other = workers(job(KERAS, compression, BACKUP))
    for run in no_error(chief, other, frequency):
        assert run["epochs_run"] == [0, 1]
        assert run["backup_left"] is False  # Deleted once training finished.
    assert chief[frequency]["loss"] == other[frequency]["loss"]
    assert chief[frequency]["checksum"] == other[frequency]["checksum"]


@pytest.mark.parametrize("compression", COMPRESSION)
def test_ctl_tutorial_trains_checkpoints_and_restores(job, compression):
    chief, other = workers(job(CTL, compression))
    errors = {w["task"]: w["error"] for w in (chief, other) if w["error"]}
    assert not errors, "\n".join(f"{task}: {error}" for task, error in errors.items())
    for worker in (chief, other):
        assert worker["replicas"] == 2
        assert worker["restored_at_start"] is None
        assert worker["changed"]
    # Synchronous training: the same losses, accuracies and weights.
    assert chief["loss"] == other["loss"] and chief["accuracy"] == other["accuracy"]
    assert chief["weights_sum"] == other["weights_sum"]
    assert len(chief["loss"]) == 2 and chief["loss"][-1] < chief["loss"][0], chief["loss"]
    # Only the chief's checkpoint stays (max_to_keep=1); the non-chief's
    # temporary directory is deleted.
    assert "checkpoint" in chief["checkpoint_files"]
    assert len([f for f in chief["checkpoint_files"] if f.endswith(".index")]) == 1
    assert other["temp_left"] is False
    # A restarted worker restores the last epoch's counters and the weights.
    for worker in (chief, other):
        assert worker["restart"] == {"epoch": 1, "step_in_epoch": 3, "weights_equal": True}
