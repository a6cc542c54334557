"""Real strategies built in this process, on logical CPU devices."""

from __future__ import annotations

import socket
import sys
import threading

import numpy as np
import pytest

import tfdist
from tfdist.errors import ConfigError

sys.path.insert(0, str(__import__("conftest").REPO / "strategies"))
import _common  # The scripts' model and data.


def fit_losses(strategy, epochs=2, global_batch=64):
    """Fits the scripts' model with the same global batch under ``strategy``."""
    return _common.train(
        strategy,
        epochs=epochs,
        per_replica_batch_size=global_batch // strategy.num_replicas_in_sync,
        examples=1024,
        learning_rate=0.01,
        seed=3,
    )


def all_reduce_sum(strategy, tf):
    """Each replica contributes replica_id + 1; returns what every replica sees."""

    def step():
        ctx = tf.distribute.get_replica_context()
        value = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
        return ctx.all_reduce("SUM", value)

    results = strategy.experimental_local_results(strategy.run(tf.function(step)))
    return [float(r) for r in results]


def test_auto_mirrors_over_the_logical_cpus_this_process_started_with(tf_cpus):
    # The tf_cpus fixture split the CPU into LOGICAL_CPUS devices before
    # TensorFlow started, as TF's input tutorial does; TF's MirroredStrategy()
    # mirrors over them, and so does the automatic choice.
    from conftest import LOGICAL_CPUS

    strategy = tfdist.strategy_from_config()
    assert isinstance(strategy, tfdist.MirroredStrategy)
    assert strategy.num_replicas_in_sync == LOGICAL_CPUS
    assert all_reduce_sum(strategy, tf_cpus) == [10.0] * LOGICAL_CPUS
    text = strategy.describe()
    assert f"why: {LOGICAL_CPUS} logical CPUs, as tf.config." in text
    assert "cluster: none" in text


def test_one_cpu_replica_when_asked_for(tf_cpus):
    strategy = tfdist.strategy_from_config(cpu_replicas=1)
    assert isinstance(strategy, tfdist.OneDeviceStrategy)
    assert isinstance(strategy, tf_cpus.distribute.OneDeviceStrategy)
    assert strategy.num_replicas_in_sync == 1
    text = strategy.describe()
    assert "one_device" in text
    assert "why: no TF_CONFIG cluster, cpu_replicas=1 and one device" in text


def test_default_is_tensorflows_default_strategy(tf_cpus):
    strategy = tfdist.strategy_from_config(strategy="default")
    assert strategy is tf_cpus.distribute.get_strategy()
    assert "1 replica" in tfdist.describe(strategy)


def test_mirrored_fit_matches_single_device(tf_cpus):
    mirrored = tfdist.strategy_from_config(cpu_replicas=2, compression="bf16")
    assert isinstance(mirrored, tfdist.MirroredStrategy)
    assert isinstance(mirrored, tf_cpus.distribute.MirroredStrategy)
    assert mirrored.num_replicas_in_sync == 2
    assert mirrored.compression.name == "bf16"
    assert (
        "compression: bf16 (BF16Compressor(prescale=1.0), error_feedback=False)"
        in mirrored.describe()
    )
    assert "cpu_replicas=2" in mirrored.describe()
    single = tfdist.strategy_from_config(strategy="one_device")
    mirrored_result = fit_losses(mirrored)
    single_result = fit_losses(single)
    # Same global batch, same data and weights: the mean of per-replica
    # gradients equals the full-batch gradient, up to float rounding.
    np.testing.assert_allclose(mirrored_result["loss"], single_result["loss"], rtol=1e-3)
    assert mirrored_result["loss"][-1] < 0.7 * mirrored_result["loss"][0]


def test_several_strategies_in_one_process_keep_their_collectives(tf_cpus):
    # Without a fresh key range per strategy, the second group joins the
    # first one's collective ("joining a group with size 4, but that group
    # has size 2") and the all-reduce fails or hangs.
    four = tfdist.strategy_from_config(cpu_replicas=4)
    assert all_reduce_sum(four, tf_cpus) == [10.0] * 4
    two = tfdist.strategy_from_config(cpu_replicas=2)
    assert all_reduce_sum(two, tf_cpus) == [3.0] * 2
    three = tfdist.MirroredStrategy(["/cpu:1", "/cpu:2", "/cpu:3"])
    assert all_reduce_sum(three, tf_cpus) == [6.0] * 3
    assert all_reduce_sum(four, tf_cpus) == [10.0] * 4


def test_cpu_replicas_beyond_the_started_runtime_is_a_clear_error(tf_cpus):
    with pytest.raises(ConfigError) as info:
        tfdist.strategy_from_config(cpu_replicas=8)
    assert info.value.field == "cpu_replicas"
    assert "Received: 8" in str(info.value)
    assert "before any other TensorFlow work" in str(info.value)


def test_local_multi_worker_strategy_reduces_structures_and_scalars(tf_cpus):
    tf = tf_cpus
    strategy = tfdist.strategy_from_config(strategy="multi_worker_mirrored")
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    assert strategy.num_replicas_in_sync == 1 and strategy.is_chief
    batch = strategy.run(lambda: (tf.ones([2, 3]), tf.constant(4.0)))
    mean = strategy.reduce("MEAN", batch, axis=None)
    np.testing.assert_allclose(mean[0], np.ones([2, 3]))
    assert float(mean[1]) == 4.0
    # Keras 3 asks for axis=0 on scalars; for a scalar that is axis=None.
    assert float(strategy.reduce("MEAN", batch[1], axis=0)) == 4.0
    np.testing.assert_allclose(strategy.reduce("SUM", batch[0], axis=0), [2.0, 2.0, 2.0])


def run_with_deadline(fn, seconds):
    """Runs ``fn`` in a thread; fails the test if it has not returned in time."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds}s: a hang"
    return outcome


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"strategy": "tpu"}, "no local TPU device"),
        ({"tpu": f"grpc://127.0.0.1:{closed_port()}"}, "nothing answers at 127.0.0.1"),
        ({"tpu": "my-tpu-v4"}, "not a Google Cloud VM"),
    ],
)
def test_tpu_without_a_tpu_fails_fast_and_says_what_to_do(tf_cpus, kwargs, says):
    outcome = run_with_deadline(lambda: tfdist.strategy_from_config(**kwargs), 30)
    error = outcome.get("error")
    assert isinstance(error, tfdist.TPUNotFoundError), outcome
    assert says in str(error)
    assert "No TPU found" in str(error) and "strategy='auto'" in str(error)


def test_nccl_without_gpus_is_refused(tf_cpus):
    with pytest.raises(ConfigError) as info:
        tfdist.strategy_from_config(cpu_replicas=2, communication="nccl")
    assert info.value.field == "communication"


def test_strategy_from_flags(tf_cpus):
    from absl import flags

    values = flags.FlagValues()
    tfdist.define_flags(values)
    values(
        [
            "prog",
            "--cpu_replicas=2",
            "--compression=topk:0.05",
            "--register_timeout=30",
            "--noerror_feedback",
        ]
    )
    from tfdist.strategies.flags import options_from_flags

    kwargs = options_from_flags(values)
    assert kwargs == {
        "cpu_replicas": 2,
        "register_timeout": 30.0,
        "strategy": "auto",
        "compression": "topk:0.05",
        "error_feedback": False,
        "config": None,
    }
    strategy = tfdist.strategy_from_flags(values)
    assert isinstance(strategy, tfdist.MirroredStrategy)
    assert (strategy.compression.name, strategy.compression.param) == ("topk", 0.05)
    assert "error_feedback=False" in strategy.describe()


@pytest.mark.parametrize(
    "config, kwargs",
    [
        (
            {
                "cluster": {
                    "chief": ["127.0.0.1:1"],
                    "worker": ["127.0.0.1:2"],
                    "ps": ["127.0.0.1:3"],
                },
                "task": {"type": "chief", "index": 0},
            },
            {},
        ),
        (None, {"strategy": "tpu"}),
    ],
)
def test_compression_under_ps_or_tpu_is_refused_before_building(tf_cpus, config, kwargs):
    outcome = run_with_deadline(
        lambda: tfdist.strategy_from_config(config, compression="topk:0.01", **kwargs), 30
    )
    error = outcome.get("error")
    assert isinstance(error, ConfigError), outcome
    assert error.field == "compression" and "'topk:0.01'" in str(error)


#: The input tutorial's set-up, then the automatic choice, in a fresh process:
#: ``explain`` first must not start TensorFlow (the split would then fail).
LOGICAL_CPUS_SCRIPT = """
import json
import tensorflow as tf
import tfdist
before = tfdist.explain()
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(2)])
configured = tfdist.explain()
started = len(tf.config.list_logical_devices("CPU"))  # starts the runtime
data = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(8).batch(4)
strategy = tfdist.strategy_from_config()
ctx = tf.distribute.get_replica_context
sums = strategy.experimental_local_results(strategy.run(tf.function(
    lambda: ctx().all_reduce("SUM", tf.cast(ctx().replica_id_in_sync_group + 1,
                                            tf.float32)))))
batches = [strategy.experimental_local_results(b[0])
           for b in strategy.experimental_distribute_dataset(data)]
print("tfdist result: " + json.dumps({
    "before": [before.name, before.reason],
    "configured": [configured.name, configured.reason],
    "started": started,
    "type": type(strategy).__name__,
    "mirrored": isinstance(strategy, tf.distribute.MirroredStrategy),
    "replicas": strategy.num_replicas_in_sync,
    "devices": list(strategy.extended.worker_devices),
    "sums": [float(s) for s in sums],
    "per_replica_rows": [[int(t.shape[0]) for t in b] for b in batches],
    "describe": strategy.describe()}))
"""


def test_auto_uses_the_logical_cpus_configured_before_the_call():
    from conftest import finish, result_line, start

    [(code, out, err)] = finish([start(["-c", LOGICAL_CPUS_SCRIPT])], timeout=300)
    assert code == 0, err[-3000:]
    result = result_line(out)
    assert result["before"][0] == "one_device"
    assert result["configured"][0] == "mirrored"
    assert "2 logical CPUs" in result["configured"][1]
    assert result["started"] == 2
    assert result["type"] == "MirroredStrategy" and result["mirrored"]
    assert result["replicas"] == 2
    assert [d.rsplit("/", 1)[1] for d in result["devices"]] == ["device:CPU:0", "device:CPU:1"]
    assert result["sums"] == [3.0, 3.0]  # 1 + 2 on each replica: a real all-reduce
    assert result["per_replica_rows"] == [[2, 2], [2, 2]]
    assert "why: 2 logical CPUs" in result["describe"]
