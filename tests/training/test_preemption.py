"""tfdist.training.fault_tolerance.preemption and .resume in one process:
signals, the watcher without peers, status records, the size-change policy, bad input.

The multi-worker agreement is tested with real processes in
tests/training/test_preempt_fit.py and tests/horovod/test_preempt_hvd.py.
"""

from __future__ import annotations

import json
import os
import signal

import keras
import numpy as np
import pytest

import tfdist
from tfdist.errors import ConfigError
from tfdist.training.fault_tolerance import resume
from tfdist.training.fault_tolerance.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    PreemptionWatcher,
    preemption_signal,
)

# TensorFlow starts here with the suite's logical CPUs, whatever runs first.
pytestmark = pytest.mark.usefixtures("tf_cpus")


def test_signal_names_numbers_and_the_environment(monkeypatch):
    assert preemption_signal("USR1") is signal.SIGUSR1
    assert preemption_signal("sigterm") is signal.SIGTERM
    assert preemption_signal(int(signal.SIGINT)) is signal.SIGINT
    monkeypatch.setenv("TFDIST_PREEMPT_SIGNAL", "SIGUSR2")
    assert preemption_signal() is signal.SIGUSR2
    monkeypatch.setenv("TFDIST_PREEMPT_SIGNAL", "SIGBOGUS")
    with pytest.raises(ConfigError, match=r"TFDIST_PREEMPT_SIGNAL.*'signal'.*SIGBOGUS"):
        preemption_signal()
    with pytest.raises(ConfigError, match="'signal'.*99999"):
        PreemptionWatcher(signals=99999)
    with pytest.raises(ConfigError, match="'fast_exit'.*'no'"):
        PreemptionWatcher(signals="TERM", fast_exit="no")


def test_one_process_stops_after_the_step_it_is_in_and_writes_its_record(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("TFDIST_LAUNCH_ATTEMPT", "2")
    before = signal.getsignal(signal.SIGUSR1)
    # (fast_exit would end this test process with 143 at its exit.)
    watcher = PreemptionWatcher(signals="USR1", fast_exit=False).start()
    try:
        assert [watcher.should_stop(s) for s in (1, 2, 3)] == [False] * 3
        os.kill(os.getpid(), signal.SIGUSR1)  # Handled at once: main thread, in Python.
        assert watcher.requested and watcher.signal_time is not None
        assert watcher.should_stop(4) and watcher.stopped_at == 4
        with pytest.raises(Preempted) as stopped:
            watcher.exit({"step": 4})
    finally:
        watcher.stop()
    assert stopped.value.code == PREEMPTED_EXIT_CODE == 143
    # The previous handler is back.
    assert signal.getsignal(signal.SIGUSR1) == before
    record = json.loads((tmp_path / "preempted" / "worker-0.json").read_text())
    assert record["step"] == 4 and record["attempt"] == 2 and record["stopped_after"] == 4
    assert record["exit_time"] >= record["signal_time"]
    assert not [n for n in os.listdir(tmp_path / "preempted") if n.startswith(".tmp")]


def test_a_signal_after_the_loop_goes_to_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with PreemptionWatcher(signals="USR1") as watcher:
            assert not watcher.should_stop(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and not watcher.requested
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_backup_and_restore_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="'save_on_preemption'.*'yes'"):
        tfdist.BackupAndRestore(str(tmp_path), save_on_preemption="yes")
    # Watching needs synchronous batch hooks (the exit is the main thread's).
    assert tfdist.BackupAndRestore(str(tmp_path)).async_safe is False
    assert tfdist.BackupAndRestore(str(tmp_path), save_on_preemption=False).async_safe is True


def test_resize_keeps_the_batch_when_the_global_batch_is_kept(caplog):
    meta = {"step": 6, "epoch": 1, "replicas": 2, "steps_per_epoch": 16}
    assert resume.resize(meta, 2, 16, None) == 6  # Same size: nothing to say.
    assert resume.resize(meta, 4, 16, None) == 6
    assert "2 -> 4 replicas" in caplog.text and "global batch kept" in caplog.text


def test_resize_keeps_the_epoch_fraction_and_scales_the_learning_rate(caplog):
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    # 4 workers with a per-worker batch of 8 (global 32): 16 steps per epoch;
    # now 2 workers, global 16: 32 steps per epoch. Batch 6 of 16 -> 12 of 32.
    meta = {"step": 6, "epoch": 0, "replicas": 4, "steps_per_epoch": 16}
    assert resume.resize(meta, 2, 32, optimizer) == 12
    assert float(optimizer.learning_rate) == pytest.approx(0.05)
    assert "fraction of the epoch" in caplog.text and "Goyal" in caplog.text
    # Not divisible: floor (an example may be seen twice, none skipped).
    assert resume.resize(dict(meta, step=5), 3, 21, None) == 6


def test_resize_leaves_a_schedule_alone(caplog):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = keras.optimizers.SGD(schedule)
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    meta = {"step": 4, "epoch": 0, "replicas": 1, "steps_per_epoch": 8}
    assert resume.resize(meta, 2, 4, optimizer) == 2
    assert optimizer._learning_rate is schedule
    assert "schedule is left as it is" in caplog.text


def test_state_file_names():
    assert (
        resume.state_file("ckpt-000003.weights.h5", "worker:1") == "ckpt-000003.state-worker-1.npz"
    )
