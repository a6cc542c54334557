"""A pipeline stage laid out over a mesh of this process's devices
(tfdist.pipeline.laid_out), on the suite's 4 logical CPUs: its forward, the
gradients its recomputing backward gives (of its input, and of each weight
once the optimizer has reduced the per-device blocks) and its update equal
the stage's own on one device; its recompute draws the forward's random
numbers and updates batch statistics once; bad settings are refused."""

from __future__ import annotations

import contextlib

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


def _laid_out(keras, shape, make):
    """``make()``'s first stage (up to ``out``) made under the layouts of
    ``shape`` (h's kernel over "model"), its passes and trainable weights."""
    from tfdist.compat.deferred import deferred_build
    from tfdist.pipeline.laid_out import MeshPasses, build_stage, owners_of, strategy_for
    from tfdist.pipeline.split import split_model

    distribution = _distribution(keras, shape, {"h/kernel": (None, "model")})
    strategy = strategy_for(distribution)
    keras.utils.set_random_seed(3)
    model, deferred = deferred_build(make)
    stage = split_model(model, ["out"])[0]
    build_stage(distribution, deferred, owners_of(model))
    variables = [v for v in stage.variables if v.trainable]
    return stage, MeshPasses(stage.model, strategy, variables), variables


def _summed(per_device: list) -> np.ndarray:
    """A replicated weight's gradient: its devices' parts (each its rows') summed."""
    return sum(np.asarray(part) for part in per_device)


@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (2, 2), None])
@pytest.mark.parametrize("kind", ["Dropout", "GaussianDropout"])
def test_a_recomputed_forward_draws_the_forward_s_random_numbers(keras_mod, shape, kind):
    # out = h * noise, so the forward's outputs show the noise it drew
    # (out / h, 0 where dropped), and the gradients of that forward follow
    # from them: the backward's recompute must draw the same.
    import tensorflow as tf

    keras = keras_mod

    def make():
        x = keras.Input((12,))
        h = keras.layers.Dense(16, name="h")(x)
        h = getattr(keras.layers, kind)(0.4, name="noise")(h)
        return keras.Model(x, keras.layers.Dense(8, name="out")(h))

    stage, passes, variables = _laid_out(keras, shape, make)
    model = stage.model
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 12)).astype("float32") * np.geomspace(0.1, 3, 12)
    dy = rng.standard_normal((8, 16)).astype("float32")
    passes.forward([tf.constant(x)], None, training=True)  # The state moves on.
    state = passes.state()
    (out,), _, _ = passes.forward([tf.constant(x)], None, training=True)
    passes.forward([tf.constant(x)], None, training=True)  # As 1F1B: another forward first.
    before = [v.numpy() for v in passes.states]
    dx, grads = passes.backward([], [tf.constant(x)], [tf.constant(dy)], state)
    # The state is the one before the backward: the recompute's draws undone.
    for a, b in zip(before, [v.numpy() for v in passes.states]):
        np.testing.assert_array_equal(a, b)
    kernel = model.get_layer("h").kernel.numpy()
    h = x @ kernel + model.get_layer("h").bias.numpy()
    noise = out.numpy() / h  # What the forward drew.
    assert (noise == 0).any() == (kind == "Dropout") and float(np.std(noise)) > 0.1
    dh = dy * noise
    by_path = {v.path: g for v, g in zip(variables, grads)}
    np.testing.assert_allclose(_summed(by_path["h/bias"]), dh.sum(0), rtol=0, atol=1e-4)
    if shape is None or shape[1] == 1:  # The kernel whole on each device.
        np.testing.assert_allclose(_summed(by_path["h/kernel"]), x.T @ dh, rtol=0, atol=1e-4)
    np.testing.assert_allclose(dx[0].numpy(), dh @ kernel.T, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
def test_batch_normalization_is_recomputed_with_its_statistics_updated_once(keras_mod, shape):
    # Each device normalizes its rows of the micro-batch (as fit does under
    # the distribution): the gradients are the plain stage's over each
    # device's rows, summed; the moving averages move in the forward only.
    import tensorflow as tf

    from tfdist.pipeline.split import split_model

    keras = keras_mod

    def make():
        x = keras.Input((12,))
        frozen = keras.layers.Dense(12, name="frozen")
        frozen.trainable = False  # A base weight, as a LoRA's: read, never kept.
        h = keras.layers.Dense(16, name="h")(frozen(x))
        h = keras.layers.BatchNormalization(momentum=0.5, name="bn")(h)
        return keras.Model(x, keras.layers.Dense(8, name="out")(h))

    stage, passes, variables = _laid_out(keras, shape, make)
    model = stage.model
    assert sorted(v.path for v in passes.states) == ["bn/moving_mean", "bn/moving_variance"]
    keras.utils.set_random_seed(3)
    plain = split_model(make(), ["out"])[0].model
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((8, 12)) * 3 + 1).astype("float32")
    dy = rng.standard_normal((8, 16)).astype("float32")
    stats = model.get_layer("bn").moving_mean
    start = stats.numpy()
    state = passes.state()
    passes.forward([tf.constant(x)], None, training=True)
    moved = stats.numpy()
    assert float(np.abs(moved - start).max()) > 0.1
    dx, grads = passes.backward([], [tf.constant(x)], [tf.constant(dy)], state)
    np.testing.assert_array_equal(stats.numpy(), moved)
    blocks, want = [], [np.zeros(w.shape, "float32") for w in plain.trainable_weights]
    for rows, dys in zip(np.split(x, passes.count), np.split(dy, passes.count)):
        rows = tf.constant(rows)
        with tf.GradientTape() as tape:
            tape.watch(rows)
            y = plain(rows, training=True)
        got = tape.gradient(y, [rows, *plain.trainable_weights], output_gradients=dys)
        blocks.append(got[0].numpy())
        want = [a + b.numpy() for a, b in zip(want, got[1:])]
    np.testing.assert_allclose(dx[0].numpy(), np.concatenate(blocks), rtol=0, atol=1e-4)
    by_path = {v.path: g for v, g in zip(variables, grads)}
    for weight, expected in zip(plain.trainable_weights, want):
        if weight.path != "h/kernel" or shape[1] == 1:
            np.testing.assert_allclose(
                _summed(by_path[weight.path]), expected, rtol=0, atol=1e-4, err_msg=weight.path
            )


class _Recording:
    """A link that keeps what it receives (the runner's messages are real)."""

    def __init__(self, link):
        self.link, self.received = link, {}

    def recv(self, tag, timeout=None):
        arrays = self.link.recv(tag, timeout)
        self.received[tag] = [a.copy() for a in arrays]
        return arrays

    def __getattr__(self, name):
        return getattr(self.link, name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_laid_out_stage_with_dropout_trains_on_the_masks_its_forwards_drew(keras_mod, schedule):
    # Two stages in threads over real links: the first laid out over (1, 2)
    # with a Dropout, the second plain. The first stage's update must be the
    # one its forwards' masks give (seen in the activations it sent) with
    # the gradients it received, whatever the order of the passes.
    import concurrent.futures

    from tfdist.engines.net import free_ports
    from tfdist.pipeline.runtime import StageRunner
    from tfdist.pipeline.split import split_model
    from tfdist.transport.p2p import connect_stages

    keras = keras_mod

    def make():
        x = keras.Input((12,))
        h = keras.layers.Dropout(0.5, name="noise")(keras.layers.Dense(16, name="h")(x))
        return keras.Model(x, keras.layers.Dense(3, name="out")(h))

    first, passes, _ = _laid_out(keras, (1, 2), make)
    model = first.model
    keras.utils.set_random_seed(5)
    second = split_model(make(), ["out"])[1]
    rng = np.random.default_rng(9)
    x = rng.standard_normal((16, 12)).astype("float32")
    y = rng.standard_normal((16, 3)).astype("float32")
    kernel, bias = (model.get_layer("h").kernel.numpy(), model.get_layer("h").bias.numpy())
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    m, lr = 4, 0.5

    def run(k: int) -> _Recording:
        links = {
            p: _Recording(link) for p, link in connect_stages(k, addresses, timeout=30).items()
        }
        stage = first if k == 0 else second
        strategy = passes.strategy if k == 0 else None
        with strategy.scope() if strategy else contextlib.nullcontext():
            optimizer = keras.optimizers.SGD(lr)
        runner = StageRunner(
            stage,
            2,
            links,
            schedule,
            m,
            keras.losses.MeanSquaredError(),
            optimizer,
            strategy=strategy,
        )
        try:
            runner.train_step(0, [x], y)
        finally:
            runner.close()
        return links[1 - k]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        to_first, to_second = [f.result(timeout=120) for f in [pool.submit(run, k) for k in (0, 1)]]
    step = np.zeros_like(bias)
    for i, rows in enumerate(np.split(x, m)):
        (sent,) = to_second.received["F", 0, 1, i]  # Stage 0's output: h * mask / 0.5.
        (dy,) = to_first.received["B", 0, 0, i]
        mask = sent / (rows @ kernel + bias)
        assert set(np.round(mask, 4).ravel()) == {0.0, 2.0}
        step += (dy * mask).sum(0)
    np.testing.assert_allclose(
        model.get_layer("h").bias.numpy(), bias - lr * step, rtol=0, atol=1e-5
    )


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
    ]
    for kwargs, field in cases:
        with pytest.raises(ConfigError) as caught:
            PipelineModel(**kwargs, **given, addresses=addresses)
        assert caught.value.field == field, (field, caught.value)


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
