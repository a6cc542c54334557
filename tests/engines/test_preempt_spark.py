"""Preemption on Spark: a barrier job whose task gets SIGTERM saves at one
step, and :func:`tfdist.spark.run`'s next attempt resumes at that step.

Spark does not retry a failed barrier result stage (it retries a barrier
stage only behind a shuffle, and ``BarrierTaskContext`` has no stage attempt
number), so ``run`` submits the job again itself (``max_retries``). The
quick tests check how a preempted task's failure reaches the driver; the
slow one runs on a real ``local-cluster`` (the fixtures of
tests/engines/test_spark.py, skipped without pyspark or Java as there): in the middle
of an epoch of a Keras fit with ``tfdist.BackupAndRestore``, the test sends
SIGTERM to worker 1's process (a host being preempted). Every task must stop
after the same step, the chief save there, and the second attempt resume at
exactly that step, end with the planned number of optimizer steps and the
weights of an uninterrupted run.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import signal
import sys
import threading
import time

import pytest

from conftest import REPO
from test_spark import spark, spark_cluster  # noqa: F401 - the fixtures
from tfdist.engines import spark_session
from tfdist.engines.worker import spark_task
from tfdist.training.fault_tolerance.preemption import PREEMPTED_EXIT_CODE, Preempted

WORKERS = REPO / "tests" / "workers"


def _load(name: str):
    """tests/workers/NAME.py as module NAME: Spark pickles its functions by
    reference, and the executors import it by that name."""
    spec = importlib.util.spec_from_file_location(name, WORKERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault(name, module)
    return sys.modules[name]


spark_preempt = _load("spark_preempt")
PLANNED = spark_preempt.EPOCHS * spark_preempt.STEPS_PER_EPOCH
#: Signal worker 1 once the chief has done this many steps: mid-epoch 1.
SIGNAL_AT = spark_preempt.STEPS_PER_EPOCH + 5


# --------------------------------------------------------------------------
# Quick: what the driver makes of a preempted task (no Spark started).


def _task_failure(error: BaseException, partition: int = 1) -> str:
    """The message a task's RuntimeError carries, as run_task builds it."""
    spec = spark_task.TaskSpec(
        train_fn=None,
        pass_context=True,
        train_kwargs={},
        num_workers=2,
        attempt=0,
        compression=None,
        error_feedback=None,
        options={},
        env={},
        host=None,
        backup_dir="/b",
    )
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001 - as in run_task
        return spark_task._encode_failure(spec, partition, caught)


def test_a_preempted_task_reaches_the_driver_as_a_preemption():
    record = {
        "task": "worker:1",
        "step": 27,
        "epoch": 1,
        "batch": 7,
        "signal_time": 1.0,
        "saved_time": 1.5,
        "exit_time": 1.6,
    }
    text = "org.apache.spark.SparkException: Job aborted due to stage failure: " + _task_failure(
        Preempted(record)
    )
    error = spark_session._job_error(RuntimeError(text), 0, 2, 2)
    assert error.preempted == record
    assert error.partition == 1
    assert "preempted on attempt 1 of 2" in str(error)
    assert "stopped after step 27 (epoch 1, batch 7)" in str(error)
    assert f"exited with code {PREEMPTED_EXIT_CODE}" in str(error)


def test_other_failures_and_exits_are_not_preemptions():
    for raised in (RuntimeError("boom"), SystemExit(PREEMPTED_EXIT_CODE), SystemExit(1)):
        text = _task_failure(raised, partition=0)
        error = spark_session._job_error(RuntimeError(text), 0, 1, 2)
        assert error.preempted is None, raised
        assert "Spark task 0 (worker 0 of 2" in str(error)


# --------------------------------------------------------------------------
# A real local Spark cluster.


def _read_int(path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_a_preempted_attempt_resumes_at_the_saved_step(spark, tmp_path, caplog):  # noqa: F811
    pid_dir, backup_dir = tmp_path / "pids", tmp_path / "backup"
    pid_dir.mkdir()
    sent: dict = {}
    done = threading.Event()

    def preempt_worker_1() -> None:
        # Worker 1's host is taken away: SIGTERM to its process, mid-epoch 1.
        chief = pid_dir / "attempt-0" / "task-0.step"
        while not done.is_set():
            step = _read_int(chief)
            pid = _read_int(pid_dir / "task-1.pid")
            if step is not None and step >= SIGNAL_AT and pid:
                sent.update(step=step, pid=pid, time=time.time())
                os.kill(pid, signal.SIGTERM)
                return
            time.sleep(0.05)

    signaller = threading.Thread(target=preempt_worker_1, daemon=True)
    signaller.start()
    started = time.time()
    try:
        with caplog.at_level(logging.WARNING):
            reports = spark.run(
                functools.partial(spark_preempt.train, pid_dir=str(pid_dir)),
                max_retries=1,
                backup_dir=str(backup_dir),
            )
    finally:
        done.set()
        signaller.join(5)
    context = f"\nsignal: {sent}\nreports: {reports}\n{spark.logs()}"
    assert sent, f"worker 1 was never signalled (the chief never reached step {SIGNAL_AT})"

    # The first attempt stopped after one step on every task, saved there...
    chief, other = reports
    backup = chief["resumed_from"]
    assert backup is not None and backup["preempted"] is True, context
    stopped = backup["global_step"]
    assert sent["step"] <= stopped < PLANNED, context
    assert (backup["epoch"], backup["step"]) == divmod(stopped, spark_preempt.STEPS_PER_EPOCH)
    assert backup["writer"] == "worker:0"
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        f"attempt 1 of 2 was preempted and saved at step {stopped}" in m for m in messages
    ), f"{messages}{context}"
    # ...and the second attempt resumed at exactly that step, on both tasks.
    for report in reports:
        assert report["attempt"] == 1, context
        assert report["first"]["iterations"] == stopped, context
        assert (report["first"]["epoch"], report["first"]["batch"]) == divmod(
            stopped, spark_preempt.STEPS_PER_EPOCH
        ), context
        assert report["trained"] == PLANNED - stopped, context
        assert report["iterations"] == report["planned_steps"] == PLANNED, context
    assert chief["weights_sha256"] == other["weights_sha256"], context

    # The same fit without a preemption ends with the same weights, bit for bit.
    reference = spark.run(
        functools.partial(spark_preempt.train, pid_dir=str(pid_dir), step_sleep=0.0),
        backup_dir=str(tmp_path / "backup-ref"),
    )
    assert reference[0]["trained"] == PLANNED
    assert chief["weights_sha256"] == reference[0]["weights_sha256"], context

    figures = {
        "signalled_at_step": sent["step"],
        "stopped_step": stopped,
        "steps_lost": stopped - chief["first"]["iterations"],
        "signal_to_saved_s": round(backup["time"] - sent["time"], 3),
        "signal_to_resumed_training_s": round(chief["first"]["time"] - sent["time"], 3),
        "first_attempt_started_to_signal_s": round(sent["time"] - started, 3),
    }
    print("tfdist spark preemption: " + str(figures))
