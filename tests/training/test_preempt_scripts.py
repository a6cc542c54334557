"""The example scripts' ``--backup_dir``: SIGTERM saves and exits 143, and the
same command resumes (the command of the Slurm page's batch script).

One process (``strategies/mirrored.py``, 2 logical CPUs), so no lock and no
engine: the Slurm test (tests/engines/test_preempt_slurm.py) covers the multi-worker
step. The epochs are long enough (1,000 steps) that the signal lands
mid-epoch.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, subprocess_env
from tfdist.training.callbacks import read_backup_pointer
from tfdist.training.fault_tolerance.preemption import PREEMPTED_EXIT_CODE

EPOCHS = 3
EXAMPLES = 64_000  # 1,000 steps of 64 (32 per replica x 2) per epoch.


def _command(backup_dir) -> list[str]:
    return [
        sys.executable,
        "strategies/mirrored.py",
        f"--epochs={EPOCHS}",
        f"--examples={EXAMPLES}",
        f"--backup_dir={backup_dir}",
    ]


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("tfdist result: ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][len("tfdist result: ") :])


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_resumes(tmp_path):
    backup_dir = tmp_path / "backup"
    proc = subprocess.Popen(
        _command(backup_dir),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # BackupAndRestore creates the directory as fit starts; its watcher
        # is installed a moment later.
        deadline = time.monotonic() + 120
        while not backup_dir.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backup_dir.exists(), "fit never started"
        time.sleep(2.0)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    context = f"\n--- stdout:\n{out[-3000:]}\n--- stderr:\n{err[-3000:]}"
    assert proc.returncode == PREEMPTED_EXIT_CODE, context
    assert took < 30, f"took {took:.1f} s from the signal to the exit{context}"
    pointer = read_backup_pointer(backup_dir)
    assert pointer is not None and pointer["preempted"] is True, context
    steps_per_epoch = EXAMPLES // 64
    assert 0 < pointer["global_step"] < EPOCHS * steps_per_epoch, pointer
    assert (pointer["epoch"], pointer["step"]) == divmod(pointer["global_step"], steps_per_epoch)

    again = subprocess.run(
        _command(backup_dir),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    context = f"\n--- stdout:\n{again.stdout[-3000:]}\n--- stderr:\n{again.stderr[-3000:]}"
    assert again.returncode == 0, context
    # Keras's history holds the epochs this run trained: from the saved one on.
    assert len(_result(again.stdout)["loss"]) == EPOCHS - pointer["epoch"], context
    assert not backup_dir.exists(), "expected the backup to be removed after a full run"
