"""keras.distribution.initialize() on TensorFlow (tfdist.distribution.cluster):
its arguments, a 2-process DataParallel job on 127.0.0.1, and
tfdist.distribution.initialize()'s compression on a 2-process ModelParallel."""

from __future__ import annotations

import numpy as np
import pytest

import fsdp_mlp
import tfdist
from conftest import finish, result_line, start
from test_data_parallel import _fit
from tfdist import spec as spec_lib
from tfdist.distribution import cluster
from tfdist.engines.net import local_spec

ADDRESSES = "127.0.0.1:2222,127.0.0.1:2223"


def test_stock_initialize_fails_on_tensorflow(tf_cpus):
    # Keras's TensorFlow backend has no initialize (keras-team/keras#18983).
    # When this fails, Keras has one: narrow the patch's versions.
    from tfdist.compat import pristine
    from tfdist.compat.keras_src import distribution_lib

    with pytest.raises(AttributeError, match="initialize"):
        pristine(distribution_lib, "initialize")(ADDRESSES, 2, 0)


def test_keras_arguments_make_a_tf_config():
    assert cluster.cluster_config(ADDRESSES, 2, 1) == {
        "cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
        "task": {"type": "worker", "index": 1},
    }
    assert cluster.cluster_config(ADDRESSES.split(","), None, 0)["task"]["index"] == 0
    assert cluster.cluster_config(None, None, None) is None  # TF_CONFIG, if any.


@pytest.mark.parametrize(
    "args, field, shown",
    [
        ((None, 2, 0), "job_addresses", "Received: None"),
        (("127.0.0.1", 1, 0), "job_addresses", "Received: '127.0.0.1'"),
        ((ADDRESSES, 3, 0), "num_processes", "expected 2, the number of job_addresses"),
        ((ADDRESSES, 2, 2), "process_id", "expected an integer in [0, 1]. Received: 2"),
        ((ADDRESSES, 2, None), "process_id", "Received: None"),
        ((ADDRESSES, 2, True), "process_id", "Received: True"),
    ],
)
def test_bad_arguments_name_the_field(args, field, shown):
    with pytest.raises(tfdist.ConfigError) as caught:
        cluster.cluster_config(*args)
    assert caught.value.field == field
    assert "keras.distribution.initialize" in str(caught.value) and shown in str(caught.value)


def test_without_a_job_initialize_leaves_one_process(tf_cpus, monkeypatch):
    import keras

    for name in (
        "TF_CONFIG",
        "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        "KERAS_DISTRIBUTION_NUM_PROCESSES",
        "KERAS_DISTRIBUTION_PROCESS_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    before = keras.distribution.list_devices("cpu")
    assert keras.distribution.initialize() is None
    assert cluster.cluster_strategy() is None
    assert keras.distribution.list_devices("cpu") == before
    # A mesh naming another process's devices needs initialize() first.
    remote = [
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
    ]
    with pytest.raises(tfdist.ConfigError) as caught:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=remote))
    assert caught.value.field == "device_mesh" and "initialize() first" in str(caught.value)
    assert keras.distribution.distribution() is None


@pytest.mark.slow
def test_two_processes_train_as_the_keras_docs_write_it(tf_cpus):
    import keras

    spec = local_spec(2)
    addresses = ",".join(spec["cluster"]["worker"])
    configs = [config for _, _, config in spec_lib.all_task_configs(spec)]
    # Worker 0 as Keras's docs set it up, worker 1 as tfdist launch does.
    procs = [
        start(
            ["tests/workers/keras_distribution_job.py"],
            TFDIST_REGISTER_TIMEOUT="60",
            KERAS_DISTRIBUTION_JOB_ADDRESSES=addresses,
            KERAS_DISTRIBUTION_NUM_PROCESSES="2",
            KERAS_DISTRIBUTION_PROCESS_ID="0",
        ),
        start(
            ["tests/workers/keras_distribution_job.py"],
            tf_config=configs[1],
            TFDIST_REGISTER_TIMEOUT="60",
        ),
    ]
    results = finish(procs, timeout=240)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    first, second = (result_line(out) for _, out, _ in results)
    assert (
        first["devices"]
        == second["devices"]
        == [
            "/job:worker/replica:0/task:0/device:CPU:0",
            "/job:worker/replica:0/task:1/device:CPU:0",
        ]
    )
    assert (first["task"], second["task"]) == ("worker:0", "worker:1")
    assert first["kind"] == "multi_worker_mirrored" and first["replicas"] == 2
    # Synchronous: both workers end with the same weights and losses.
    assert first["sha256"] == second["sha256"] and first["loss"] == second["loss"]
    # The same training as DataParallel over 2 devices of one process.
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"]))
    try:
        _, losses = _fit(keras)
    finally:
        keras.distribution.set_distribution(None)
    np.testing.assert_allclose(first["loss"], losses, rtol=1e-3)
    assert first["loss"][-1] < 0.5 * first["loss"][0]
    # Compression across processes is the job's, given to initialize().
    assert first["compressed"]["field"] == "compression"
    assert "tfdist.distribution.initialize()" in first["compressed"]["message"]


@pytest.mark.slow
def test_compression_given_to_initialize_reaches_model_parallel(tf_cpus):
    """tfdist.distribution.initialize(compression="bf16") on 2 processes: a
    ModelParallel splitting both kernels over the batch axis trains as the
    same ModelParallel(compression="bf16") on 2 logical CPUs of one process,
    not as the uncompressed one, and sends that one's data-parallel bytes."""
    import keras

    configs = [config for _, _, config in spec_lib.all_task_configs(local_spec(2))]
    procs = [
        start(
            ["tests/workers/keras_compressed_job.py"],
            tf_config=config,
            TFDIST_REGISTER_TIMEOUT="60",
        )
        for config in configs
    ]
    results = finish(procs, timeout=240)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    first, second = (result_line(out) for _, out, _ in results)
    assert (first["task"], second["task"]) == ("worker:0", "worker:1")
    assert first["weights"] == second["weights"] and first["loss"] == second["loss"]
    # The job's strategy is made once: other options later are refused.
    assert first["again"]["field"] == "compression" and "'bf16'" in first["again"]["message"]

    local = {}
    for compression in (None, "bf16"):
        keras.distribution.set_distribution(
            fsdp_mlp.model_parallel(keras, ["cpu:0", "cpu:1"], compression=compression)
        )
        try:
            local[compression] = fsdp_mlp.fit(keras)[1:]
        finally:
            keras.distribution.set_distribution(None)
    (_, plain, plain_sent), (bf16_loss, bf16, bf16_sent) = local.values()
    np.testing.assert_allclose(first["loss"], bf16_loss, rtol=0, atol=1e-6)
    for got, want in zip(first["weights"], bf16):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    moved = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(first["weights"], plain))
    assert moved > 1e-5, moved  # bfloat16 sums: not the uncompressed training.
    assert first["sent"]["data_parallel"] == bf16_sent["data_parallel"]
    assert bf16_sent["data_parallel"] < 0.9 * plain_sent["data_parallel"]
