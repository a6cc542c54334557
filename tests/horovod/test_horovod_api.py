"""tfdist.horovod's API: one process (fast) and 2 ranks (one job, slow).

The 2-rank worker (tests/workers/hvd_api.py) reports what each collective
returned from each rank's own inputs; the expected values are computed here
from the same inputs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfdist.horovod as hvd
from conftest import finish, results_by_task, start
from tfdist.errors import ConfigError
from tfdist.horovod import runtime


@pytest.fixture
def fresh(monkeypatch):
    """tfdist.horovod as before init() (one process, no launcher)."""
    monkeypatch.setattr(runtime, "_state", None)
    return hvd


def test_queries_before_init_say_so(fresh):
    with pytest.raises(hvd.NotInitializedError, match=r"hvd.init\(\)"):
        hvd.rank()
    assert hvd.is_initialized() is False


def test_one_process_without_a_launcher(fresh, tf_cpus):
    tf = tf_cpus
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    x = tf.constant([1.0, 2.0])
    np.testing.assert_array_equal(hvd.allreduce(x).numpy(), [1.0, 2.0])
    assert hvd.allgather(tf.ones([3, 2])).shape == (3, 2)
    assert hvd.broadcast_object({"a": 1}) == {"a": 1}
    assert hvd.allgather_object(5) == [5]
    assert hvd.join() == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"comm": [0, 1]}, "comm"),
        ({"process_sets": ["a"]}, "process_sets"),
    ],
)
def test_init_refuses_what_it_cannot_honour(fresh, kwargs, field):
    with pytest.raises(ConfigError) as info:
        hvd.init(**kwargs)
    assert info.value.field == field


def _sgd():
    return keras.optimizers.SGD(0.1)


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        ({"op": hvd.Adasum}, "op", "Adasum"),
        ({"op": 42}, "op", "42"),
        ({"backward_passes_per_step": 0}, "backward_passes_per_step", "0"),
        ({"backward_passes_per_step": 1.5}, "backward_passes_per_step", "1.5"),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor", "0"),
        ({"gradient_predivide_factor": 2.0, "op": hvd.Sum}, "gradient_predivide_factor", "2.0"),
        ({"compression": "fp17"}, "compression", "fp17"),
        ({"process_set": object()}, "process_set", "object"),
    ],
)
def test_distributed_optimizer_bad_input_names_the_field(fresh, kwargs, field, text):
    hvd.init()
    with pytest.raises(ConfigError) as info:
        hvd.DistributedOptimizer(_sgd(), **kwargs)
    assert info.value.field == field
    assert text in str(info.value)


def test_adasum_error_says_what_to_use(fresh):
    hvd.init()
    with pytest.raises(ConfigError, match="hvd.Average") as info:
        hvd.DistributedGradientTape(__import__("tensorflow").GradientTape(), op=hvd.Adasum)
    assert "Adasum" in str(info.value)


def test_distributed_optimizer_refuses_other_optimizers(fresh):
    hvd.init()
    with pytest.raises(ConfigError, match="Keras 3 optimizer") as info:
        hvd.DistributedOptimizer("adam")
    assert info.value.field == "optimizer"
    with pytest.raises(ConfigError, match="inner optimizer"):
        hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(_sgd()))


def test_allreduce_refuses_stateful_compression(fresh, tf_cpus):
    hvd.init()
    with pytest.raises(ConfigError, match="DistributedOptimizer") as info:
        hvd.allreduce(tf_cpus.ones([4]), compression="powersgd:2")
    assert info.value.field == "compression"


def test_one_process_trains_like_the_plain_optimizer_and_saves_it_plain(fresh, tf_cpus, tmp_path):
    hvd.init()
    x = np.random.RandomState(0).rand(32, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    trained = []
    for wrap in (False, True):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        opt = keras.optimizers.Adam(0.05)
        if wrap:
            opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1)
            assert isinstance(opt, keras.optimizers.Adam)
        model.compile(opt, "mse")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        trained.append(np.concatenate([v.numpy().ravel() for v in model.trainable_variables]))
    np.testing.assert_array_equal(trained[0], trained[1])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is keras.optimizers.Adam  # Saved as the plain class.
    again = hvd.load_model(str(tmp_path / "m.keras"))
    assert isinstance(again.optimizer, keras.optimizers.Adam)
    assert hvd.optimizer.is_distributed(again.optimizer)
    assert int(again.optimizer.iterations.numpy()) == 8  # State carried over.


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    where = tmp_path_factory.mktemp("hvd_api")
    proc = start(
        [
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            "tests/workers/hvd_api.py",
            str(where),
        ]
    )
    [(code, out, err)] = finish([proc], timeout=600)
    assert code == 0, (out + err)[-5000:]
    results = results_by_task(out)
    assert sorted(results) == ["worker:0", "worker:1"], out[-4000:]
    return results["worker:0"], results["worker:1"]


@pytest.mark.slow
def test_collectives_give_every_rank_the_same_reduction(job):
    inputs = [np.array([1.0 + r, 10.0 * r]) for r in range(2)]  # As the worker builds them.
    for res in job:
        assert res["avg"] == (sum(inputs) / 2).tolist()
        assert res["sum"] == sum(inputs).tolist()
        assert res["min"] == np.minimum(*inputs).tolist()
        assert res["max"] == np.maximum(*inputs).tolist()
        assert res["scaled"] == (sum(2 * i for i in inputs) * 0.5).tolist()
        assert res["fp16_allreduce"] == res["avg"]  # Exact in float16 for these values.
        assert res["int_sum"] == [1 + 2]
        assert res["grouped"] == [sum(inputs).tolist(), [[0.0 + 1.0]], [0 + 1]]
        # First dimensions differ (1 and 2 rows), concatenated in rank order.
        assert res["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert res["bcast_bool"] == [True, True] and res["bcast_i64"] == [2**40 + 1]
        assert res["object"] == {"from": 1, "text": "é" * 5}
        assert res["objects"] == [["rank", 0, []], ["rank", 1, [1]]]
        # IndexedSlices are gathered and averaged: row 0 gets (1 + 2) / 2, row 1 2 / 2.
        assert res["slices"] == [[1.5] * 3, [1.0] * 3, [0.0] * 3, [0.0] * 3]
        assert res["graph"] == [
            sum(inputs).tolist(),
            np.concatenate(inputs).tolist(),
            inputs[0].tolist(),
        ]
        assert res["join"] in (0, 1)


@pytest.mark.slow
def test_distributed_optimizer_with_each_compression(job):
    r0, r1 = job
    for setting, res in r0["fits"].items():
        other = r1["fits"][setting]
        assert res["spread"] == 0.0 and other["spread"] == 0.0, setting
        assert res["loss"][-1] < res["loss"][0], setting
        assert res["sent"] == other["sent"] == res["stats_sent"], setting
    fits = r0["fits"]
    dense = fits["none"]["dense"]
    assert fits["none"]["sent"] == dense
    assert fits["fp16"]["sent"] == fits["bf16"]["sent"] == dense / 2
    # 25% of the entries, each a value and an index: about half the bytes.
    assert fits["topk"]["sent"] < 0.55 * dense and fits["topk"]["state"] > 0  # Residuals.
    assert fits["powersgd:2"]["sent"] < dense / 2 and fits["powersgd:2"]["state"] > 0
    # "auto" measured the link between the ranks and both chose the same.
    assert r0["auto_choice"] == r1["auto_choice"] and r0["auto_choice"].startswith("auto ->")


@pytest.mark.slow
def test_load_model_and_tape(job):
    for res in job:
        assert res["loaded_distributed"] and res["loaded_iterations"] == 12
        assert res["loaded_spread"] == 0.0
        assert res["tape_isinstance"] and res["tape_spread"] == 0.0
        assert 0 < res["tape_sent"] < res["tape_dense"]
        assert res["tape_losses"][1] < res["tape_losses"][0]


def test_tape_state_created_when_a_step_is_traced_again(fresh, tf_cpus):
    # Horovod's elastic TF2 example traces its step with allreduce=False, then
    # again with the DistributedGradientTape: the tape's state (PowerSGD's Q
    # and residuals, its step) is created at that second trace.
    tf = tf_cpus
    hvd.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, allreduce):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape, compression="powersgd:1")
        opt.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
        return loss

    losses = [float(step(tf.ones([2, 4]), flag)) for flag in (False, True, True)]
    assert losses[2] < losses[1] < losses[0]
    traffic = hvd.tape_traffic(model.trainable_variables, compression="powersgd:1")
    assert traffic.dense_sent == 0  # One rank sends nothing...
    from tfdist.horovod.tape import _AGGREGATORS, tape_state

    assert int(tape_state(_AGGREGATORS["powersgd:1"])["step"].numpy()) == 2  # ...but counted.


def test_init_after_tensorflow_started_says_what_to_move():
    # With several ranks init() must configure collectives before TensorFlow's
    # runtime starts; afterwards TensorFlow would re-point existing tensors.
    import json
    import subprocess
    import sys

    from conftest import REPO, subprocess_env
    from tfdist.engines.net import free_ports

    tf_config = {
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]},
        "task": {"type": "worker", "index": 0},
    }
    code = (
        "import tensorflow as tf; tf.constant(1.0); import tfdist.horovod as hvd\n"
        "from tfdist.errors import ConfigError\n"
        "try:\n    hvd.init()\nexcept ConfigError as e:\n    print('ERROR', e)\n"
        "print('INITIALIZED', hvd.is_initialized())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=subprocess_env(TF_CONFIG=json.dumps(tf_config)),
        timeout=120,
    )
    assert "ERROR" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "hvd.init() before any other TensorFlow work" in done.stdout
    assert "INITIALIZED False" in done.stdout
