"""A pipeline stage laid out over a mesh of this process's devices
(tfdist.pipeline.laid_out), on the suite's 4 logical CPUs: its forward, the
gradients its recomputing backward gives (of its input, and of each weight
once the optimizer has reduced the per-device blocks) and its update equal
the stage's own on one device, and what it cannot run exactly is refused."""

from __future__ import annotations

import numpy as np
import pytest

from tfdist.errors import ConfigError

pytestmark = pytest.mark.usefixtures("tf_cpus")

#: float32 sums taken over other splits of the rows and blocks.
TOL = 1e-5


def _distribution(keras, shape, rules):
    """A ModelParallel over a (batch, model) mesh of ``shape``; with no
    ``shape``, a DataParallel over 2 devices."""
    import tfdist

    if shape is None:
        return keras.distribution.DataParallel(devices=keras.distribution.list_devices("cpu")[:2])
    devices = keras.distribution.list_devices("cpu")[: shape[0] * shape[1]]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    layouts = keras.distribution.LayoutMap(mesh)
    for pattern, layout in rules.items():
        layouts[pattern] = layout
    return tfdist.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")


#: Megatron's column then row split over "model", the kernels' other axis
#: over "batch" (FSDP), and an embedding's vocabulary over "model".
RULES = {
    "emb/embeddings": ("model", None),
    "h1/kernel": ("batch", "model"),
    "h1/bias": ("model",),
    "h2/kernel": ("model", "batch"),
    "out/kernel": (None, "model"),
}


def _make(keras):
    """A stage with a skewed-token embedding beside dense features."""
    ids = keras.Input((6,), dtype="int32", name="ids")
    feats = keras.Input((12,), name="feats")
    e = keras.layers.GlobalAveragePooling1D(name="pool")(
        keras.layers.Embedding(64, 12, name="emb")(ids)
    )
    h = keras.layers.Dense(16, activation="tanh", name="h1")(keras.layers.Add()([e, feats]))
    h = keras.layers.Dense(12, activation="relu", name="h2")(h)
    return keras.Model([ids, feats], keras.layers.Dense(8, name="out")(h))


def _stage_pair(keras, shape):
    """The same first stage (up to ``out``) twice, with the same values:
    plain, and made by stage under the layouts."""
    from tfdist.compat.deferred import deferred_build
    from tfdist.pipeline.laid_out import build_stage, owners_of, strategy_for
    from tfdist.pipeline.split import split_model

    distribution = _distribution(keras, shape, RULES)
    strategy = strategy_for(distribution)
    keras.utils.set_random_seed(11)
    plain = split_model(_make(keras), ["out"])[0].model
    keras.utils.set_random_seed(11)
    model, deferred = deferred_build(lambda: _make(keras))
    stage = split_model(model, ["out"])[0]
    build_stage(distribution, deferred, owners_of(model))
    return plain, stage, distribution, strategy


def _inputs(rows, seed=0):
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.4, (rows, 6)) - 1, 63).astype("int32")  # Mostly row 0.
    feats = rng.standard_normal((rows, 12)).astype("float32") * np.geomspace(0.1, 3, 12)
    return [tf.constant(ids), tf.constant(feats.astype("float32"))]


@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (2, 2), None])
def test_a_laid_out_stage_computes_and_trains_as_on_one_device(keras_mod, shape):
    import tensorflow as tf

    from tfdist.parallel import sharding
    from tfdist.pipeline.laid_out import MeshPasses, apply_on

    keras = keras_mod
    plain, stage, _, strategy = _stage_pair(keras, shape)
    split = [v.path for v in stage.variables if sharding.spec_of(v) is not None]
    if shape is None:  # DataParallel: every weight whole on each device.
        assert split == [] and strategy.num_replicas_in_sync == 2
    else:  # Laid out, as asked (over "batch" on every mesh here).
        assert "h1/kernel" in split
        assert ("emb/embeddings" in split) == (shape[1] > 1)  # Its vocabulary over "model".
    for a, b in zip(stage.variables, plain.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # The same values, whole.
    variables = [v for v in stage.variables if v.trainable]
    passes = MeshPasses(stage.model, strategy, variables)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(variables)
    reference = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(1)
    for step in range(2):  # Two micro-batches' gradients, summed, then one update.
        grads, want = None, None
        for i in range(2):
            x = _inputs(8, seed=10 * step + i)
            outs, loss, upstream = passes.forward(x, None, training=True)
            assert loss is None and upstream is None
            dy = tf.constant(rng.standard_normal((8, 12)).astype("float32"))
            with tf.GradientTape() as tape:
                tape.watch(x[1])
                y = plain(x, training=True)
            np.testing.assert_allclose(outs[0].numpy(), y.numpy(), rtol=0, atol=TOL)
            got = tape.gradient(y, [x[1], *plain.trainable_weights], output_gradients=dy)
            dx, per_device = passes.backward([x[0]], [x[1]], [dy])
            np.testing.assert_allclose(dx[0].numpy(), got[0].numpy(), rtol=0, atol=TOL)
            assert all(len(g) == strategy.num_replicas_in_sync for g in per_device)
            grads = (
                per_device
                if grads is None
                else [passes.add(a, b) for a, b in zip(grads, per_device)]
            )
            want = (
                got[1:]
                if want is None
                else [tf.convert_to_tensor(a) + b for a, b in zip(want, got[1:])]
            )
        tf.function(lambda g: apply_on(strategy, optimizer, g, variables))(grads)
        reference.apply(want, plain.trainable_weights)
        for a, b in zip(variables, plain.trainable_weights):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=TOL, err_msg=a.path)
    keras.utils.set_random_seed(11)
    initial = _make(keras).get_layer("h1").kernel.numpy()
    assert float(np.abs(stage.model.get_layer("h1").kernel.numpy() - initial).max()) > 1e-3


def test_the_last_stage_s_loss_and_its_gradient_come_from_the_whole_micro_batch(keras_mod):
    import tensorflow as tf

    from tfdist.pipeline.laid_out import MeshPasses

    keras = keras_mod
    plain, stage, _, strategy = _stage_pair(keras, (1, 2))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    y = tf.constant(np.minimum(np.random.default_rng(4).zipf(1.6, 8) - 1, 11).astype("int32"))
    weight = tf.constant(np.linspace(0, 2, 8).astype("float32"))  # One example weighs 0.

    def head(out, targets):
        return loss(targets[0], out, sample_weight=targets[1]) / 2

    passes = MeshPasses(stage.model, strategy, stage.model.trainable_weights, head)
    x = _inputs(8, seed=5)
    outs, got, upstream = passes.forward(x, [y, weight], training=True)
    out = tf.convert_to_tensor(plain(x, training=True))
    with tf.GradientTape() as tape:
        tape.watch(out)
        want = head(out, [y, weight])
    np.testing.assert_allclose(float(got), float(want), rtol=0, atol=TOL)
    np.testing.assert_allclose(upstream[0].numpy(), tape.gradient(want, out).numpy(), atol=1e-7)
    inferred = passes.inference(x, [y, weight])
    assert len(inferred) == 2
    np.testing.assert_allclose(float(inferred[0]), float(want), rtol=0, atol=TOL)


def test_micro_batches_the_mesh_does_not_divide_are_refused_naming_both(keras_mod):
    from tfdist.pipeline.laid_out import MeshPasses

    _, stage, _, strategy = _stage_pair(keras_mod, (2, 2))
    passes = MeshPasses(stage.model, strategy, stage.model.trainable_weights)
    with pytest.raises(ConfigError) as caught:
        passes.forward(_inputs(6), None, training=True)
    assert caught.value.field == "batch" and caught.value.value == 6
    assert "multiple of 4" in str(caught.value)


@pytest.mark.parametrize(
    "layer",
    ["dropout", "batch_norm", "noise"],
)
def test_layers_a_recomputed_forward_would_change_are_refused_naming_them(keras_mod, layer):
    from tfdist.pipeline.laid_out import check_recomputable

    keras = keras_mod
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="d")(inp)
    made = {
        "dropout": keras.layers.Dropout(0.1, name="drop"),
        "batch_norm": keras.layers.BatchNormalization(name="bn"),
        "noise": keras.layers.GaussianNoise(0.1, name="noise"),
    }[layer]
    model = keras.Model(inp, made(h))
    with pytest.raises(ConfigError) as caught:
        check_recomputable(model, 3)
    assert caught.value.field == "distribution"
    assert f"stage 3's layer {made.name!r}" in str(caught.value.value)
    # A dropout of rate 0 (keras-hub's default) draws nothing: it runs.
    quiet = keras.Model(inp, keras.layers.Dropout(0.0)(h))
    check_recomputable(quiet, 0)


def test_bad_distribution_settings_name_the_field(keras_mod):
    from tfdist.pipeline import PipelineModel

    keras = keras_mod

    def build(rate=0.0):
        inp = keras.Input((4,))
        h = keras.layers.Dropout(rate, name="drop")(keras.layers.Dense(4)(inp))
        return keras.Model(inp, keras.layers.Dense(2, name="d2")(h))

    distribution = _distribution(keras, (1, 2), {})
    given = {"split_points": ["d2"], "microbatches": 2, "stage": 0}
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]  # Never reached: refused before.
    cases = [
        (dict(model=build(), distribution=distribution), "model"),
        (dict(model=build, distribution="model_parallel"), "distribution"),
        # Found in this worker's stage before any of its weights is made.
        (dict(model=lambda: build(0.3), distribution=distribution), "distribution"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ConfigError) as caught:
            PipelineModel(**kwargs, **given, addresses=addresses)
        assert caught.value.field == field, (field, caught.value)
    assert "'drop' (Dropout)" in str(caught.value)


def test_a_stage_s_mesh_is_its_own_process_s_under_a_job_s_tf_config(keras_mod, monkeypatch):
    # Under `tfdist launch`, every stage's process has the job's TF_CONFIG;
    # the stage's strategy is still its own devices' (a Mirrored of them).
    import json

    from tfdist.pipeline.laid_out import strategy_for

    keras = keras_mod
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker"}}))
    strategy = strategy_for(_distribution(keras, (1, 2), RULES))
    assert strategy.num_replicas_in_sync == 2
    assert [d.lower() for d in strategy.extended.worker_devices] == [
        "/job:localhost/replica:0/task:0/device:cpu:0",
        "/job:localhost/replica:0/task:0/device:cpu:1",
    ]
    # A mesh naming another process's devices is refused, naming them.
    names = [
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:1",
    ]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], names)
    import tfdist

    other = tfdist.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
    )
    with pytest.raises(ConfigError) as caught:
        strategy_for(other)
    assert caught.value.field == "device_mesh" and "task:1" in str(caught.value.value)
