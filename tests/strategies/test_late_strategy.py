"""A multi-worker strategy created after other TensorFlow work (issue 15, item 5).

TensorFlow refuses with "Collective ops must be configured at program
startup". tfdist carries tf.data datasets built first over to the worker's
device, and for a model built first raises an error that says what to move.
Two real worker processes through ``tfdist launch --workers 2``.
"""

from __future__ import annotations

import io
import json
import os

import pytest

from conftest import REPO
from tfdist.engines.launch import launch

SCRIPT = str(REPO / "tests" / "workers" / "late_strategy.py")


def run(mode: str):
    out = io.StringIO()
    result = launch(SCRIPT, [mode], workers=2, show_all=True, output=out,
                    handle_signals=False, stop_timeout=5,
                    env={"PYTHONPATH": os.pathsep.join([str(REPO)])})
    lines = out.getvalue().splitlines()
    results = {r["task"]: r for r in (json.loads(line.split("tfdist result: ", 1)[1])
                                      for line in lines if "tfdist result: " in line)}
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
    assert "StrategyOrderError: tfdist.strategy_from_config() (at late_strategy.py:" \
        in text
    assert "must create the multi-worker strategy before 2 variable(s) " \
        "(sequential/dense/bias, sequential/dense/kernel), e.g. a model built " \
        "before it" in text
    assert "Move the strategy line up" in text
    assert "TensorFlow said: Collective ops must be configured at program startup" in text
