"""keras.distribution beside a tfdist strategy is an error (tfdist.distribution.guard)."""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from conftest import REPO, finish, result_line, start
from tfdist.distribution import guard


def unguarded_set(keras_mod):
    """``set_distribution`` as taken before tfdist wrapped it (e.g. imported
    by name before ``import tfdist``): the guard cannot see its calls."""
    from keras.src.distribution import distribution_lib

    return distribution_lib.set_distribution.__wrapped__


def model_parallel(keras_mod, devices):
    dist = keras_mod.distribution
    mesh = dist.DeviceMesh((1, len(devices)), ("batch", "model"), devices)
    layouts = dist.LayoutMap(mesh)
    layouts[".*dense.*kernel"] = (None, "model")
    return dist.ModelParallel(layout_map=layouts, batch_dim_name="batch")


def test_keras_before_3_15_lacks_the_process_count(keras_mod):
    """The canary of the registry's distribution_guard.num_processes and
    process_id: Keras 3.10-3.14's Distribution calls them on its TensorFlow
    backend, which lacks them (no keras.distribution could be built there);
    3.15 checks for them first. When Keras adds them, the patches can go."""
    from tfdist.compat import pristine
    from tfdist.compat.keras_src import tf_distribution_lib
    from tfdist.compat.patching import MISSING
    from tfdist.compat.versions import satisfies

    if satisfies(keras_mod.__version__, "<3.15"):
        assert pristine(tf_distribution_lib, "num_processes") is MISSING
        assert pristine(tf_distribution_lib, "process_id") is MISSING
        assert tf_distribution_lib.num_processes() == 1  # tfdist's.
    else:
        assert not hasattr(tf_distribution_lib, "num_processes")
    # Either way a distribution builds after import tfdist, for one process.
    dist = keras_mod.distribution.DataParallel(devices=["cpu:0", "cpu:1"])
    assert getattr(dist, "num_processes", getattr(dist, "_num_process", None)) == 1


def assert_points_to_tfdist(error, name):
    text = str(error)
    assert isinstance(error, tfdist.KerasDistributionError)
    assert isinstance(error, tfdist.TfdistError) and isinstance(error, RuntimeError)
    assert f"keras.distribution.{name} " in text and f"Received: <{name}" in text
    assert "prototype" in text and "every weight stays whole" in text
    assert "tfdist.parallel" in text and "ColumnParallelDense" in text
    assert "strategy_from_config(model_parallel=T)" in text


def test_set_distribution_after_a_strategy_is_refused(keras_mod):
    strategy = tfdist.strategy_from_config(cpu_replicas=2, model_parallel=2)
    devices = [d.split("device:")[-1].lower() for d in strategy.extended.worker_devices]
    dist = model_parallel(keras_mod, devices)
    with strategy.scope():
        with pytest.raises(tfdist.KerasDistributionError) as info:
            keras_mod.distribution.set_distribution(dist)
        assert_points_to_tfdist(info.value, "ModelParallel")
        assert "inside the scope of MirroredStrategy" in str(info.value)
        assert keras_mod.distribution.distribution() is None
        # The way Keras's own docs set it for a block.
        with pytest.raises(tfdist.KerasDistributionError), dist.scope():
            pass
    # Inside the strategy's scope, DataParallel too.
    data_parallel = keras_mod.distribution.DataParallel(devices=devices)
    with strategy.scope(), pytest.raises(tfdist.KerasDistributionError) as info:
        keras_mod.distribution.set_distribution(data_parallel)
    assert_points_to_tfdist(info.value, "DataParallel")
    assert "inside the scope of MirroredStrategy" in str(info.value)
    assert keras_mod.distribution.distribution() is None
    # Outside it, each gets a strategy of its own (test_data_parallel.py,
    # test_model_parallel.py).
    for other in (data_parallel, dist):
        keras_mod.distribution.set_distribution(other)
        assert tfdist.distribution.data_parallel.strategy_of(other) is not strategy
    keras_mod.distribution.set_distribution(None)  # Resetting is always fine.


def test_a_strategy_created_while_a_distribution_is_set_is_refused(keras_mod):
    unguarded_set(keras_mod)(model_parallel(keras_mod, ["cpu:0", "cpu:1"]))
    for kwargs in ({"cpu_replicas": 2}, {"strategy": "one_device"}):
        with pytest.raises(tfdist.KerasDistributionError) as info:
            tfdist.strategy_from_config(**kwargs)
        assert_points_to_tfdist(info.value, "ModelParallel")
    # Built directly, not through strategy_from_config.
    with pytest.raises(tfdist.KerasDistributionError):
        tfdist.MirroredStrategy(["/cpu:0", "/cpu:1"])


def test_compile_and_fit_under_a_strategy_with_a_distribution_set(keras_mod):
    keras = keras_mod
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    before = [w.copy() for w in model.get_weights()]
    data = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    unguarded_set(keras)(keras.distribution.DataParallel(devices=["cpu:0", "cpu:1"]))
    with pytest.raises(tfdist.KerasDistributionError) as info:
        model.fit(*data, epochs=1, verbose=0)
    assert_points_to_tfdist(info.value, "DataParallel")
    assert "model.fit" in str(info.value)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)  # Nothing was trained.
    with pytest.raises(tfdist.KerasDistributionError) as info:
        model.compile("sgd", "mse")
    assert "model.compile" in str(info.value)
    # A model outside any tfdist strategy is Keras's business.
    alone = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    alone.compile("sgd", "mse")
    # Reset, the same model trains.
    keras.distribution.set_distribution(None)
    model.fit(*data, epochs=1, verbose=0)
    assert any(not np.array_equal(o, n) for o, n in zip(before, model.get_weights()))


def test_install_is_idempotent(keras_mod):
    from tfdist.compat.keras_src import TensorFlowTrainer, distribution_lib

    guard.install()
    wrapped, fit = distribution_lib.set_distribution, TensorFlowTrainer.fit
    public = keras_mod.distribution.set_distribution
    guard.install()
    assert distribution_lib.set_distribution is wrapped
    assert keras_mod.distribution.set_distribution is public
    assert TensorFlowTrainer.fit is fit
    # One layer of wrapping in each namespace, around Keras's own function.
    for function in (wrapped, public):
        assert function.__tfdist_patches__ == ("distribution_guard.set_distribution",)
        assert not hasattr(function.__wrapped__, "__wrapped__")
        assert function.__wrapped__.__module__ == "keras.src.distribution.distribution_lib"
        assert function.__wrapped__ is public.__wrapped__


def test_a_fresh_process_in_the_order_users_write_it(keras_mod):
    proc = start([REPO / "tests" / "workers" / "keras_distribution_fresh.py"], fresh=True)
    [(code, out, err)] = finish([proc], timeout=120)
    assert code == 0, err[-3000:]
    result = result_line(out)
    # The fact the guard rests on: Keras on TensorFlow ignores the layout.
    # If this fails, Keras shards on TensorFlow now: revisit the guard.
    kernel = result["unguarded_kernel"]
    from tfdist.compat.versions import satisfies

    if satisfies(keras_mod.__version__, "<3.15"):
        assert "num_processes" in kernel["error"]  # Not even buildable there.
    else:
        assert kernel["shape"] == [8, 16] and kernel["type"] == "ResourceVariable"
        assert kernel["device"].endswith("CPU:0")
    assert result["strategy_after_distribution"]["error"] == "KerasDistributionError"
    assert "ModelParallel" in result["strategy_after_distribution"]["message"]
    # No strategy alive: the layout is honoured, each device holding a block.
    assert result["model_parallel_alone"]["error"] is None
    kernel = result["laid_out_kernel"]
    assert kernel["shape"] == [8, 8] and kernel["full"] == [8, 16], kernel
    assert [d.split(":")[-1] for d in kernel["devices"]] == ["0", "1"], kernel
    assert kernel["distinct"], kernel
    assert result["distribution_after_alone"] == "None"
    assert result["public_set_after_strategy"]["error"] == "KerasDistributionError"
    assert result["distribution_after_refusal"] == "None"
    assert result["compile_with_early_set"]["error"] == "KerasDistributionError"
