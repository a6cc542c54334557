"""PipelineModel's settings: stage and addresses from TF_CONFIG, and a
ConfigError naming the field for each bad one (before any connection)."""

from __future__ import annotations

import json

import pytest

from tests.models.pipeline_models import make_model

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")


def test_the_stage_and_addresses_come_from_tf_config():
    from tfdist.pipeline import stage_from_environment

    cluster = {"chief": ["h0:1"], "worker": ["h1:2", "h2:3"]}
    for task, stage in ((("chief", 0), 0), (("worker", 0), 1), (("worker", 1), 2)):
        env = {
            "TF_CONFIG": json.dumps(
                {"cluster": cluster, "task": dict(zip(("type", "index"), task))}
            )
        }
        assert stage_from_environment(env) == (stage, ["h0:1", "h1:2", "h2:3"])
    only = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}
    assert stage_from_environment({"TF_CONFIG": json.dumps(only)}) == (1, ["a:1", "b:2"])


def test_mpi_s_ranks_give_the_stage_and_addresses():
    # mpiexec -n 3 on one host: Open MPI's rank variables, ports from
    # TFDIST_PORT_BASE (no TF_CONFIG, no Slurm step).
    from tfdist.pipeline import stage_from_environment

    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "TFDIST_PORT_BASE": "25000",
    }
    assert stage_from_environment(env) == (
        2,
        ["127.0.0.1:25000", "127.0.0.1:25001", "127.0.0.1:25002"],
    )


def test_a_slurm_step_gives_the_stage_and_addresses(monkeypatch, tmp_path):
    # srun -n2 on one node: SLURM_PROCID and the step's node list, read by
    # tfdist's Slurm resolver (its ports from the job id).
    import os

    from tfdist.pipeline import stage_from_environment
    from tfdist.strategies import slurm

    step = {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
    }
    for name, value in step.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # No nvidia-smi.
    base = slurm.default_port_base()
    assert stage_from_environment(dict(os.environ)) == (
        1,
        [f"localhost:{base}", f"localhost:{base + 1}"],
    )


def test_tf_config_without_a_stage_is_refused():
    from tfdist.errors import ConfigError
    from tfdist.pipeline import stage_from_environment

    with pytest.raises(ConfigError, match="srun -n P") as caught:
        stage_from_environment({})
    assert caught.value.field == "stage"
    ps = {"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, "task": {"type": "ps", "index": 0}}
    with pytest.raises(ConfigError) as caught:
        stage_from_environment({"TF_CONFIG": json.dumps(ps)})
    assert (caught.value.field, caught.value.value) == ("task.type", "ps")


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        ({"schedule": "zero-bubble"}, "schedule", "zero-bubble"),
        ({"microbatches": 0}, "microbatches", 0),
        ({"microbatches": True}, "microbatches", True),
        ({"addresses": ["127.0.0.1:1"]}, "addresses", ["127.0.0.1:1"]),
        ({"addresses": ["127.0.0.1:1"] * 3}, "addresses", ["127.0.0.1:1"] * 3),
        ({"replicas": 0}, "replicas", 0),
        ({"replicas": 2.0}, "replicas", 2.0),
        # Two replicas of two stages need four processes.
        ({"replicas": 2}, "addresses", ["127.0.0.1:1", "127.0.0.1:2"]),
        ({"replica": 1}, "replica", 1),
        ({"stage": 2}, "stage", 2),
        # Compression is for the replicas' all-reduce: with one replica it
        # would be silently unused.
        ({"compression": "fp16"}, "compression", "fp16"),
        ({"replicas": 2, "compression": "zip"}, "compression", "zip"),
        ({"replicas": 2, "compression": "auto"}, "compression", "auto"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field, value):
    from tfdist.errors import ConfigError
    from tfdist.pipeline import PipelineModel

    settings = {"microbatches": 2, "stage": 0, "addresses": ["127.0.0.1:1", "127.0.0.1:2"]}
    settings.update(kwargs)
    with pytest.raises(ConfigError) as caught:
        PipelineModel(make_model("mlp"), ["d3"], **settings)
    assert caught.value.field == field and caught.value.value == value


def test_the_split_balance_found_is_taken_as_it_is():
    from tfdist.errors import ConfigError
    from tfdist.pipeline import PipelineModel, balance

    model = make_model("mlp")
    found = balance(model, 2, by="parameters")
    # One address for two stages: refused after the cut, naming the split
    # points the Balance gave (before any connection is tried).
    with pytest.raises(ConfigError) as caught:
        PipelineModel(model, found, microbatches=2, stage=0, addresses=["127.0.0.1:1"])
    assert caught.value.field == "addresses"
    assert f"split_points={list(found.split_points)}" in str(caught.value)
    assert len(found.split_points) == 1


def test_a_batch_the_micro_batches_do_not_divide_names_both():
    import numpy as np

    from tfdist.errors import ConfigError
    from tfdist.pipeline.runtime import microbatches

    with pytest.raises(ConfigError) as caught:
        microbatches([np.zeros((10, 3)), np.zeros((10,))], 4)
    assert caught.value.value == 10
    assert "the 4 micro-batches divide evenly" in str(caught.value)
    parts = microbatches([np.arange(12).reshape(6, 2), None], 3)
    assert [p[0].numpy().tolist() for p in parts] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[8, 9], [10, 11]],
    ]
    assert all(p[1] is None for p in parts)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_batch_normalization_takes_each_micro_batch_s_statistics(count):
    # As docs/guide/pipeline.md says: in training, a BatchNormalization
    # layer updates its moving mean once per micro-batch, with that
    # micro-batch's mean (one stage here: the micro-batches as in a pipeline).
    import keras
    import numpy as np

    from tfdist.pipeline import Stage
    from tfdist.pipeline.runtime import StageRunner

    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    bn = keras.layers.BatchNormalization(momentum=0.9)
    model = keras.Model(inp, keras.layers.Dense(2)(bn(inp)))
    stage = Stage(0, model, ("bn", "dense"), (0,), 0, tuple(model.weights))
    loss = keras.losses.MeanSquaredError()
    runner = StageRunner(stage, 1, {}, "gpipe", count, loss, keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 3)) * [1, 5, 20] + [0, 3, -7]).astype("float32")
    runner.train_step(0, [x], np.zeros((8, 2), "float32"))
    expected = np.zeros(3)
    for part in np.split(x, count):
        expected = 0.9 * expected + 0.1 * part.mean(axis=0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "given",
    [
        "sparse_categorical_crossentropy",
        "sparse_categorical_crossentropy-function",
        "loss-object",
    ],
)
def test_a_loss_named_or_a_function_is_keras_s_mean_over_the_batch(given):
    import keras
    import numpy as np

    from tfdist.pipeline.model import _as_loss

    fn = keras.losses.sparse_categorical_crossentropy
    loss = {
        "sparse_categorical_crossentropy": "sparse_categorical_crossentropy",
        "sparse_categorical_crossentropy-function": fn,
        "loss-object": keras.losses.SparseCategoricalCrossentropy(),
    }[given]
    y = np.array([2, 0, 1, 1])
    p = np.array([[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]], "float32")
    weight = np.array([1.0, 0.0, 2.0, 1.0], "float32")
    per_example = np.asarray(fn(y, p))
    got = _as_loss(loss)
    assert float(got(y, p)) == pytest.approx(per_example.mean(), rel=1e-6)
    assert float(got(y, p, sample_weight=weight)) == pytest.approx(
        (per_example * weight).sum() / 4, rel=1e-6
    )


def test_a_loss_per_output_is_refused():
    from tfdist.errors import ConfigError
    from tfdist.pipeline.model import _as_loss

    with pytest.raises(ConfigError) as caught:
        _as_loss({"a": "mse"})
    assert caught.value.field == "loss" and caught.value.value == {"a": "mse"}


def test_the_grid_places_each_process_and_links_only_neighbours():
    from tfdist.pipeline.replicas import Grid

    grid = Grid(stages=3, replicas=2)
    assert [grid.place(r) for r in range(grid.size)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert all(grid.rank(*grid.place(r)) == r for r in range(grid.size))
    # Stage 1 of replica 1: its pipeline neighbours and stage 1 of replica 0.
    assert grid.pipeline_peers(4) == {0: 3, 2: 5}
    assert grid.ring_peers(4) == {0: 1}
    assert grid.peers(4) == {3, 5, 1}
    # Every link is wanted from both sides.
    for rank in range(grid.size):
        assert all(rank in grid.peers(other) for other in grid.peers(rank))
    assert grid.name(4) == "stage 1 of replica 1"
    assert Grid(stages=2).name(1) == "stage 1"
    ring = Grid(stages=2, replicas=4)
    assert ring.ring_peers(3) == {0: 1, 2: 5}


def test_a_batch_the_replicas_and_micro_batches_do_not_divide_names_both():
    import numpy as np

    from tfdist.errors import ConfigError
    from tfdist.pipeline import split_model
    from tfdist.pipeline.runtime import StageRunner

    class Group:
        size, rank = 2, 0

    stage = split_model(make_model("mlp"), ["d3"])[0]
    runner = StageRunner(stage, 2, {}, "gpipe", 4, None, None)
    runner.replicas = type("R", (), {"replicas": 2, "group": Group, "close": lambda self: None})()
    with pytest.raises(ConfigError) as caught:
        runner.train_step(0, [np.zeros((12, 24), "float32")], np.zeros(12, "int32"))
    assert (caught.value.field, caught.value.value) == ("batch", 12)
    assert "replicas x microbatches = 2 x 4" in str(caught.value)
