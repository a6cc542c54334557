"""A multi-worker strategy created after other TensorFlow work (issue 15, item 5).

TensorFlow refuses with "Collective ops must be configured at program
startup". tfdist carries tf.data datasets built first over to the worker's
device, and for a model built first raises an error that says what to move.
A later strategy in a process whose collectives already run swaps every
task's collective state together (tfdist.strategies.rejoin).
Two real worker processes through ``tfdist launch --workers 2``.
"""

from __future__ import annotations

import io
import json
import os

import pytest

from conftest import REPO, finish, result_line, start
from tfdist import spec as spec_lib
from tfdist.engines.launch import launch
from tfdist.engines.net import local_spec

SCRIPT = str(REPO / "tests" / "workers" / "late_strategy.py")


def run(mode: str):
    out = io.StringIO()
    result = launch(
        SCRIPT,
        [mode],
        workers=2,
        show_all=True,
        output=out,
        handle_signals=False,
        stop_timeout=5,
        env={"PYTHONPATH": os.pathsep.join([str(REPO)])},
    )
    lines = out.getvalue().splitlines()
    results = {
        r["task"]: r
        for r in (
            json.loads(line.split("tfdist result: ", 1)[1])
            for line in lines
            if "tfdist result: " in line
        )
    }
    return result, lines, results


@pytest.mark.slow
def test_a_dataset_built_before_the_strategy_is_carried_over_and_trains():
    result, lines, results = run("dataset")
    assert result.ok, "\n".join(lines[-40:])
    assert sorted(results) == ["worker:0", "worker:1"]
    one, two = results["worker:0"], results["worker:1"]
    assert one["replicas"] == two["replicas"] == 2
    # Synchronous training: both workers end with the same weights, and learn.
    assert one["kernel_sum"] == pytest.approx(two["kernel_sum"], rel=1e-6)
    assert one["loss"][-1] < 0.5 * one["loss"][0]
    assert one["accuracy"][-1] > 0.8
    # The dataset built first still yields its data, now on the worker's device.
    for task, r in results.items():
        assert r["base_matches"], task
        assert r["generated"] == [0, 1, 2], task  # a Python generator's too
        assert r["base_device"].startswith(f"/job:worker/replica:0/task:{task[-1]}/")
    assert any("rebuilt on this worker's device" in line for line in lines)


@pytest.mark.slow
def test_a_model_built_before_the_strategy_says_what_to_move():
    result, lines, results = run("model")
    assert not result.ok and not results
    text = "\n".join(lines)
    assert "StrategyOrderError: tfdist.strategy_from_config() (at late_strategy.py:" in text
    assert (
        "must create the multi-worker strategy before 2 variable(s) "
        "(sequential/dense/bias, sequential/dense/kernel), e.g. a model built "
        "before it" in text
    )
    assert "Move the strategy line up" in text
    assert "TensorFlow said: Collective ops must be configured at program startup" in text


@pytest.mark.slow
def test_strategies_created_in_sequence_each_train_and_an_unmatched_one_fails():
    # worker:0 lags 2 s before each later strategy: before tfdist.strategies.rejoin
    # the two waited forever at the second model's first variable.
    count = 3
    procs = [
        start(["tests/workers/strategy_sequence.py", count, 2], tf_config=config)
        for _, _, config in spec_lib.all_task_configs(local_spec(2))
    ]
    results = finish(procs, timeout=180)
    for code, _, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    one, two = (result_line(out) for _, out, _ in results)
    assert [one["task"], two["task"]] == ["worker:0", "worker:1"]
    assert len(one["fits"]) == len(two["fits"]) == count
    for first, second in zip(one["fits"], two["fits"]):
        assert first["replicas"] == second["replicas"] == 2
        # Each worker fits its own half of every batch: equal weights only
        # if the new strategy's all-reduces ran.
        assert first["kernel"] == pytest.approx(second["kernel"], abs=1e-6)
        assert first["loss"] == pytest.approx(second["loss"], rel=1e-6)
        assert first["loss"][-1] < first["loss"][0]
    # A strategy worker:1 never creates fails on worker:0 after its
    # register_timeout of 3 s, naming the task, instead of waiting forever.
    assert two["unmatched"] is None
    error = one["unmatched"]["error"]
    assert f"multi-worker strategy #{count + 1} of this process" in error
    assert "this task (worker:0)" in error and "worker:1 did not arrive" in error
    assert 3 <= one["unmatched"]["seconds"] < 30
