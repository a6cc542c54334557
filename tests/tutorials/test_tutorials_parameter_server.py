"""TensorFlow's "Parameter server training" tutorial, as a test.

tests/workers/tutorial_parameter_server.py runs the tutorial's steps in one
process: its in-process cluster of 3 workers and 2 ps with a
``SimpleClusterResolver`` and no chief, ``strategy_from_config(resolver,
variable_partitioner=...)`` in place of TensorFlow's constructor, then
``model.fit`` with the stock callbacks, the ``ClusterCoordinator`` loop over a
sharded Embedding, and both evaluations. Parameter-server training does not
all-reduce gradients, so there is no compressed variant.
"""

from __future__ import annotations

import math

import pytest

from conftest import finish, result_line, start

pytestmark = pytest.mark.slow  # 5 servers and a coordinator in one process.


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ps_tutorial")
    [(code, out, err)] = finish(
        [start(["tests/workers/tutorial_parameter_server.py", workdir])], timeout=600
    )
    assert code == 0 and "tfdist result: " in out, f"exited {code}:\n{out[-2000:]}\n{err[-6000:]}"
    return result_line(out), err


def no_error(result: dict, name: str):
    assert name not in result["errors"], result["errors"][name]
    return result[name]


def expected_shards(shape: list[int], partitions: list[int]) -> list[list[int]]:
    """The shard shapes TensorFlow makes of ``shape`` for ``partitions`` (a
    partitioner's answer): rows split along axis 0, the first ones one longer."""
    count = partitions[0]
    rows, rest = divmod(shape[0], count)
    return [[rows + (i < rest), *shape[1:]] for i in range(count)]


def test_ps_tutorial_strategy_from_the_resolver_shards_the_embedding(tutorial):
    result, _ = tutorial
    assert result["strategy"] == "ParameterServerStrategy"
    # Keras 3 lists one weight for the table, the whole (vocabulary, 16384)
    # (the tutorial, on TF-Keras, checks for the shards in layer.weights).
    [table_shape] = result["layer_weights"]
    # The partitioner shards this table over both ps (vocabulary 7 + 1 OOV
    # rows x 16384 float32 = 512 KiB, 256 KiB at least per shard)...
    assert result["partitions"][0] == 2, result["partitions"]
    # ...and the shards behind that weight are the ones it asked for, one per ps.
    assert [shape for shape, _ in result["shards"]] == expected_shards(
        table_shape, result["partitions"]
    )
    assert sorted(device.split("/task:")[1][0] for _, device in result["shards"]) == ["0", "1"]


def test_ps_tutorial_model_fit_with_the_stock_callbacks(tutorial):
    fit = no_error(tutorial[0], "fit")
    assert fit["loss"][-1] < fit["loss"][0], fit["loss"]
    assert fit["iterations"] == 2 * 10  # Every step once.
    assert fit["checkpoint_equal"] is True  # ModelCheckpoint's file holds the model.
    assert fit["tensorboard_files"] > 0
    assert fit["backup_left"] is False  # BackupAndRestore deletes it at the end.


def test_ps_tutorial_coordinator_loop_trains_the_sharded_model(tutorial):
    loop = no_error(tutorial[0], "loop")
    # 4 epochs of 5 scheduled steps, then one more whose loss is fetched:
    # every optimizer step counted once.
    assert loop["iterations"] == 21
    # The trained model, on the 200 training examples: the label is learnt,
    # and the cross-entropy is below an untrained model's (it predicts 0.5:
    # ln 2). Not bounded, as they are noise under asynchronous RMSprop at 0.1:
    # the fetched step loss, which adds the L2 term (1.32 in one CI run at
    # accuracy 1.0), and the last 5 steps' accuracy (0.66 in 1 run of 11).
    assert loop["data_accuracy"] > 0.9 and loop["data_loss"] < math.log(2), loop
    assert len(loop["accuracy"]) == 4 and all(0 < a <= 1 for a in loop["accuracy"]), loop
    assert loop["final_loss"] > 0 and loop["regularization"] > 0, loop
    # RMSprop's slot of the table, built in a scheduled step, is sharded as
    # the table is.
    table_shards = [shape for shape, _ in tutorial[0]["shards"]]
    assert loop["slot_shards"] == [table_shards], loop


def test_ps_tutorial_evaluations(tutorial):
    result, _ = tutorial
    assert no_error(result, "inline_eval") > 0.8
    distributed = no_error(result, "distributed_eval")
    assert distributed["count"] == 16  # 2 scheduled steps of 8 examples.
    assert distributed["accuracy"] > 0.8


def test_ps_tutorial_exits_without_grpc_errors(tutorial):
    _, err = tutorial
    assert "Failed to remove function remotely" not in err
    assert "Connection refused" not in err
