"""TensorFlow's parameter-server tutorial with tfdist's strategy line.

The tutorial (tensorflow/docs, site/en/tutorials/distribute/
parameter_server_training) hands TensorFlow's strategy a
``SimpleClusterResolver`` of workers and ps, with no chief: the calling
process is the coordinator. It trains with ``model.fit`` on a dataset
function, and with its own ``ClusterCoordinator`` loop over an embedding
sharded by a ``MinSizePartitioner``. tests/workers/ps_tutorial.py does each
step for step, in our own code on synthetic data of the same shapes; here
the only tfdist-specific line is ``tfdist.strategy_from_config(resolver,
variable_partitioner=...)``.

The two tutorial scenarios share one cluster (2 workers, 2 ps) started by
this module, each coordinator a subprocess in turn.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import tfdist
from conftest import finish, result_line, start
from tfdist import spec as spec_lib
from tfdist.errors import ConfigError
from tfdist.spec import detect


@pytest.fixture(scope="module")
def shared_cluster():
    """Worker and ps servers for every coordinator of this module."""
    with tfdist.local_cluster(workers=2, ps=2) as cluster:
        yield cluster


def run(scenario: str, workdir, cluster=None, timeout: float = 300):
    args = ["tests/workers/ps_tutorial.py", scenario, workdir]
    if cluster is not None:
        args.append(json.dumps(cluster.cluster))
    [(code, out, err)] = finish([start(args)], timeout=timeout)
    assert code == 0 and "tfdist result: " in out, (
        f"{scenario} exited {code}\n{out[-3000:]}\n{err[-5000:]}"
    )
    return result_line(out), err


@pytest.mark.slow
def test_model_fit_under_the_parameter_server_strategy(shared_cluster, tmp_path):
    result, _ = run("fit", tmp_path, shared_cluster)
    assert result["strategy"] == "tfdist.strategies.ParameterServerStrategy"
    # This process is the coordinator, outside the resolver's cluster.
    assert result["task"] is None and result["is_chief"] is True
    # Keras's model.fit failed here ("pass this dataset to
    # ClusterCoordinator.create_per_worker_dataset"); tfdist runs tfdist.fit.
    loss = result["loss"]
    assert len(loss) == 5 and loss[-1] < 0.7 * loss[0]
    # Every step counted: 5 epochs of 20, then 2 of 10 on a plain dataset.
    assert result["iterations_after_creator"] == 100
    assert result["iterations"] == 120
    assert result["plain_loss"][-1] < loss[-1]
    # model.evaluate ran on the coordinator, on the weights held by the ps.
    assert result["evaluate"]["loss"] == pytest.approx(result["reference_loss"], rel=1e-5)
    # model.predict too, in batches of 4 (Keras's failed like fit).
    assert result["predict_shape"] == [10, 10] and result["predict_gap"] < 1e-5
    # The stock callbacks of the tutorial worked.
    assert result["reloaded_equal"] is True
    assert result["tensorboard_files"] > 0
    assert result["backup_left"] is False  # BackupAndRestore cleans up at the end.
    assert result["refused"] == "class_weight"


@pytest.mark.slow
def test_the_tutorial_loop_trains_an_embedding_sharded_over_two_ps(shared_cluster, tmp_path):
    result, _ = run("ctl", tmp_path, shared_cluster)
    assert result["strategy"] == "ParameterServerStrategy"
    # The partitioner split the (8, 16384) table over both ps: tape.gradient
    # used to fail on it ("'ShardedVariable' object has no attribute 'handle'").
    assert result["shard_rows"] == [4, 4]
    assert [d.split("/task:")[1][0] for d in result["shard_devices"]] == ["0", "1"]
    assert all(result["changed"])
    losses = result["epoch_losses"]
    assert losses[-1] < 0.1 * losses[0]
    assert result["epoch_accuracy"][-1] > 0.9
    # No step lost: 4 epochs of 5 scheduled steps plus the fetched one, each
    # applied once; the accuracy of the last epoch (not reset before the
    # fetched step) counts 6 batches of 32.
    assert result["iterations"] == 21
    assert result["accuracy_count"] == 6 * 32
    assert result["direct_accuracy"] > 0.9
    assert result["distributed_count"] == 2 * 8
    assert result["distributed_accuracy"] > 0.9


#: What a successful run must not print: gRPC or remote-function errors.
_GRPC_ERROR = re.compile(
    r"grpc|Failed to remove function|Connection refused|"
    r"UNAVAILABLE",
    re.IGNORECASE,
)


@pytest.mark.slow
def test_strategy_from_a_local_cluster_trains_and_exits_cleanly(tmp_path):
    result, err = run("local_cluster", tmp_path)
    assert result["strategy"] == "ParameterServerStrategy"
    assert result["task"] == "chief:0"
    assert result["iterations"] == 2 * 256 // 32
    assert result["loss"][-1] < result["loss"][0]
    for pid in result["server_pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The servers stopped before the process exited; the coordinator used to
    # print "Failed to remove function remotely ... Connection refused" for
    # every function and server.
    assert not [line for line in err.splitlines() if _GRPC_ERROR.search(line)], err[-3000:]


# --------------------------------------------------------------------------
# What strategy_from_config reads from a resolver (no cluster needed).


def _resolver(cluster: dict, **kwargs):
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), **kwargs
    )


_PS_CLUSTER = {
    "worker": ["localhost:2001", "localhost:2002"],
    "ps": ["localhost:2003", "localhost:2004"],
}


def test_a_resolver_of_workers_and_ps_makes_this_process_the_coordinator():
    resolver = _resolver(_PS_CLUSTER, rpc_layer="grpc")
    choice = detect.choose(resolver)
    assert choice.name == "parameter_server" and choice.role == "trainer"
    assert choice.tf_config.source == spec_lib.RESOLVER_SOURCE
    assert choice.tf_config.cluster == {job: tuple(a) for job, a in _PS_CLUSTER.items()}
    assert choice.tf_config.task_type is None


def test_the_same_cluster_without_a_chief_is_still_refused_from_tf_config():
    # From TF_CONFIG every process is a worker or a ps: nobody would
    # coordinate, and they would wait forever.
    for task in ("worker", "ps"):
        with pytest.raises(ConfigError) as caught:
            detect.choose({"cluster": _PS_CLUSTER, "task": {"type": task, "index": 0}})
        assert caught.value.field == "cluster.chief"


def test_a_multi_worker_resolver_is_read_like_its_tf_config():
    cluster = {"worker": ["localhost:2001", "localhost:2002"]}
    resolver = _resolver(cluster, task_type="worker", task_id=1, rpc_layer="grpc")
    choice = detect.choose(resolver)
    assert choice.name == "multi_worker_mirrored"
    assert (choice.tf_config.task_type, choice.tf_config.task_index) == ("worker", 1)
    # A bad resolver gets the same errors as a bad TF_CONFIG.
    with pytest.raises(ConfigError) as caught:
        detect.choose(_resolver(cluster, task_type="worker", task_id=5))
    assert caught.value.field == "task.index"


def test_a_local_cluster_stands_for_its_chief_tf_config():
    from tfdist.engines.worker.local_cluster import LocalCluster

    # A cluster that was never started: only its addresses matter here.
    cluster = LocalCluster(
        1, 1, "process", start_timeout=1.0, python="python", env={}, log_dir=None
    )
    cluster.cluster = {
        "chief": ["127.0.0.1:2001"],
        "worker": ["127.0.0.1:2002"],
        "ps": ["127.0.0.1:2003"],
    }
    choice = tfdist.explain(cluster)  # What strategy_from_config(cluster) builds.
    assert choice.name == "parameter_server" and choice.role == "trainer"
    assert choice.tf_config.task_id == "chief:0"
    assert choice.tf_config.cluster == {job: tuple(a) for job, a in cluster.cluster.items()}
    cluster.stop()


# --------------------------------------------------------------------------
# GradientTape on Keras variables backed by a ShardedVariable.


@pytest.mark.usefixtures("tf_cpus")
def test_tape_gradient_of_keras_variables_holding_shards_equals_the_whole():
    import keras
    import tensorflow as tf
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    from tfdist.training.ps import patches as keras_ps

    keras_ps.install()  # What tfdist's ParameterServerStrategy installs.
    rs = np.random.RandomState(0)
    table, dense = rs.randn(10, 3).astype("float32"), rs.randn(6, 2).astype("float32")
    ids, x = tf.constant([1, 7, 7, 9]), tf.constant(rs.randn(5, 6).astype("float32"))

    def loss(emb, w):
        return tf.reduce_sum(tf.gather(tf.convert_to_tensor(emb), ids) ** 2) + tf.reduce_sum(
            tf.matmul(x, tf.convert_to_tensor(w)) ** 2
        )

    whole = [keras.Variable(table), keras.Variable(dense)]
    sharded = [keras.Variable(table), keras.Variable(dense)]
    # As under a variable_partitioner: the Keras variable holds the shards.
    sharded[0]._value = ShardedVariable([tf.Variable(table[:4]), tf.Variable(table[4:])])
    sharded[1]._value = ShardedVariable([tf.Variable(dense[:3]), tf.Variable(dense[3:])])

    with tf.GradientTape() as tape:
        reference_loss = loss(*whole)
    reference = tape.gradient(reference_loss, whole)

    @tf.function  # As in a scheduled step.
    def grads():
        with tf.GradientTape() as tape:
            value = loss(*sharded)
        return tape.gradient(value, {"emb": sharded[0], "w": sharded[1]})

    got = grads()
    np.testing.assert_allclose(
        tf.convert_to_tensor(got["emb"]).numpy(),
        tf.convert_to_tensor(reference[0]).numpy(),
        rtol=1e-6,
    )
    np.testing.assert_allclose(got["w"].numpy(), reference[1].numpy(), rtol=1e-6)
    assert isinstance(got["emb"], tf.IndexedSlices)  # Still sparse, whole-table rows.
