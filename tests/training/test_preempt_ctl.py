"""Saving on preemption in a custom training loop under tfdist's MultiWorkerMirrored.

Real 2-worker jobs on 127.0.0.1 (tests/workers/preempt_ctl.py): SIGTERM to
one worker mid-epoch makes both save at the same step and exit; running the
same command again resumes at exactly that step, and the weights at the end
equal those of an uninterrupted run. Two ways to write the loop:
TensorFlow's own ``PreemptionCheckpointHandler`` (its exit code 42 off
Google Cloud becomes 143 with a status record under tfdist), and
``tfdist.PreemptionWatcher`` (exit code 143, with a status
record). The dataset position goes into the checkpoint through
``tfdist.CheckpointableIterator``, which is also tested here in one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import REPO, subprocess_env
from tfdist import spec as spec_lib
from tfdist.engines.net import local_spec

SCRIPT = REPO / "tests" / "workers" / "preempt_ctl.py"
TOTAL_STEPS, STEPS_PER_EPOCH, SIGNAL_AT = 48, 16, 20


def run_job(
    mode: str, workdir, victim: int | None = None, at: int = SIGNAL_AT, timeout: float = 120.0
) -> dict:
    """Runs a 2-worker job; SIGTERM to worker ``victim`` once it printed step ``at``."""
    os.makedirs(workdir, exist_ok=True)
    env = dict(
        # TensorFlow's handler asks the GCE metadata server whether it runs on
        # Google Cloud: keep that question on this machine (a closed port).
        GCE_METADATA_IP="127.0.0.1:9",
        TFDIST_JOB_DIR=str(workdir / "job"),
        TFDIST_TEST_TOTAL_STEPS=str(TOTAL_STEPS),
        TFDIST_TEST_STEPS_PER_EPOCH=str(STEPS_PER_EPOCH),
        TFDIST_TEST_STEP_SLEEP="0.05",
    )
    procs, lines = [], []
    for _, _, config in spec_lib.all_task_configs(local_spec(2)):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), mode, str(workdir)],
                cwd=REPO,
                env=subprocess_env(TF_CONFIG=json.dumps(config), **env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        lines.append([])
    sent: dict = {}
    exited: dict = {}

    def pump(i: int) -> None:
        for line in procs[i].stdout:
            lines[i].append(line.rstrip("\n"))
            if (
                i == victim
                and "time" not in sent
                and line.startswith("tfdist step: ")
                and int(line.split()[2]) >= at
            ):
                procs[i].send_signal(signal.SIGTERM)
                sent.update(time=time.monotonic(), step=int(line.split()[2]))
        procs[i].wait()
        exited[i] = time.monotonic()

    threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for thread in threads:
        thread.join(10)
    job = {
        "codes": [p.returncode for p in procs],
        "lines": lines,
        "signal": sent,
        "results": [],
        "steps": [],
        "starts": [],
    }
    for out in lines:
        found = [
            json.loads(x.split("tfdist result: ", 1)[1])
            for x in out
            if x.startswith("tfdist result: ")
        ]
        job["results"].append(found[0] if found else None)
        steps = [int(x.split()[2]) for x in out if x.startswith("tfdist step: ")]
        job["steps"].append(steps[-1] if steps else None)
        starts = [int(x.split()[2]) for x in out if x.startswith("tfdist start: ")]
        job["starts"].append(starts[0] if starts else None)
    if sent:
        job["exit_after"] = [exited[i] - sent["time"] for i in range(2) if i in exited]
    return job


def show(job: dict) -> str:
    return "\n".join(
        f"--- worker {i} (code {code}) ---\n" + "\n".join(out[-40:])
        for i, (code, out) in enumerate(zip(job["codes"], job["lines"]))
    )


def assert_same_weights(a: dict, b: dict) -> float:
    worst = 0.0
    for x, y in zip(a["weights"], b["weights"]):
        worst = max(worst, float(np.max(np.abs(np.asarray(x) - np.asarray(y)))))
    assert worst <= 1e-6, f"weights differ by {worst}"
    return worst


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    job = run_job("plain", tmp_path_factory.mktemp("plain"))
    assert job["codes"] == [0, 0], show(job)
    return job["results"][0]


@pytest.mark.slow
def test_tf_preemption_checkpoint_handler_saves_and_resumes_exactly(tmp_path, uninterrupted):
    # TensorFlow's handler under tfdist's strategy, SIGTERM to the non-chief.
    first = run_job("tf_handler", tmp_path, victim=1)
    assert first["signal"], show(first)
    # Off Google Cloud the handler's own exit is sys.exit(42); under a tfdist
    # strategy it exits with 143 and writes the status record, on every
    # worker, after the same step: the one after the signal, mid-epoch.
    assert first["codes"] == [143, 143], show(first)
    stopped = first["steps"][0]
    assert first["steps"] == [stopped, stopped], show(first)
    assert first["signal"]["step"] <= stopped <= first["signal"]["step"] + 2
    assert stopped % STEPS_PER_EPOCH, "should stop mid-epoch"
    for task in ("worker-0", "worker-1"):
        with open(tmp_path / "job" / "preempted" / f"{task}.json") as f:
            record = json.load(f)
        assert record["step"] == stopped and record["source"] == "PreemptionCheckpointHandler"
    assert record["signal_time"] is not None  # worker:1 got the signal.
    assert max(first["exit_after"]) < 10, first["exit_after"]
    print(
        f"tf_handler: signal at step {first['signal']['step']}, saved at {stopped}, "
        f"exit after {max(first['exit_after']):.2f} s"
    )

    again = run_job("tf_handler", tmp_path)
    assert again["codes"] == [0, 0], show(again)
    assert again["starts"] == [stopped, stopped], show(again)
    for result in again["results"]:
        assert result["step"] == TOTAL_STEPS and result["iterations"] == TOTAL_STEPS
        assert_same_weights(result, uninterrupted)


@pytest.mark.slow
def test_preemption_watcher_custom_loop_saves_and_resumes_exactly(tmp_path, uninterrupted):
    # tfdist's watcher, SIGTERM to the chief.
    first = run_job("watcher", tmp_path, victim=0)
    assert first["signal"], show(first)
    assert first["codes"] == [143, 143], show(first)
    records = {}
    for task in ("worker-0", "worker-1"):
        with open(tmp_path / "job" / "preempted" / f"{task}.json") as f:
            records[task] = json.load(f)
    stopped = records["worker-0"]["step"]
    assert records["worker-1"]["step"] == stopped
    assert first["steps"] == [stopped, stopped], show(first)
    assert first["signal"]["step"] <= stopped <= first["signal"]["step"] + 2
    assert records["worker-0"]["batch"] == stopped % STEPS_PER_EPOCH != 0
    assert records["worker-0"]["backup"].endswith(f"ckpt-{stopped}")
    assert max(first["exit_after"]) < 10, first["exit_after"]
    # Only the chief wrote in the checkpoint directory.
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "checkpoint",
        f"ckpt-{stopped}.data-00000-of-00001",
        f"ckpt-{stopped}.index",
    ]
    print(
        f"watcher: signal at step {first['signal']['step']}, saved at {stopped}, "
        f"exit after {max(first['exit_after']):.2f} s"
    )

    again = run_job("watcher", tmp_path)
    assert again["codes"] == [0, 0], show(again)
    assert again["starts"] == [stopped, stopped], show(again)
    for result in again["results"]:
        assert result["step"] == TOTAL_STEPS and result["iterations"] == TOTAL_STEPS
        assert_same_weights(result, uninterrupted)


# --------------------------------------------------------------------------
# CheckpointableIterator in one process.


def _dataset():
    import tensorflow as tf

    return (
        tf.data.Dataset.range(100)
        .shuffle(100, seed=3, reshuffle_each_iteration=True)
        .repeat()
        .batch(4)
    )


def _values(batch, strategy) -> list:
    parts = strategy.experimental_local_results(batch)
    return np.concatenate([np.asarray(p) for p in parts]).tolist()


def test_checkpointable_iterator_resumes_with_the_next_batch(tf_cpus, tmp_path):
    import tfdist

    tf = tf_cpus
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    reference = tfdist.CheckpointableIterator(_dataset(), strategy)
    expected = [_values(next(reference), strategy) for _ in range(8)]

    iterator = tfdist.CheckpointableIterator(_dataset(), strategy)

    @tf.function
    def take(it):
        return next(it)

    seen = [_values(take(iterator), strategy) for _ in range(5)]
    assert seen == expected[:5] and iterator.batches == 5
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "it"))

    restored = tfdist.CheckpointableIterator(_dataset(), strategy)
    tf.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    assert restored.batches == 5
    assert [_values(take(restored), strategy) for _ in range(3)] == expected[5:8]

    # A step traced over the old iterator would keep reading it: refused.
    from tfdist.training.fault_tolerance.resumable import IteratorRestoreError

    take(iterator)
    with pytest.raises(IteratorRestoreError, match="before the first training step"):
        tf.train.Checkpoint(iterator=iterator).restore(path)


def test_checkpointable_iterator_rejects_what_it_cannot_resume(tf_cpus):
    import tfdist
    from tfdist.errors import ConfigError

    with pytest.raises(ConfigError, match="data"):
        tfdist.CheckpointableIterator([1, 2, 3])
