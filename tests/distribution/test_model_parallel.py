"""keras.distribution.ModelParallel honours keras-hub's layout maps on
TensorFlow (tfdist.distribution.model_parallel, layouts), on 4 logical CPUs.

Each family's tiny CausalLM trains under its own ``get_layout_map`` from the
weights of an unsharded twin, and must end where the twin ends: the same
losses and every full weight within 1e-5. Llama trains on a (2, 2) mesh (the
batch axis splits weights too), Gemma and Qwen on a (1, 2) mesh (their maps'
model axis alone): the batch axis of a (2, 2) mesh acts alike whatever the
family, so the other 2x2 and 1x2 pairs were merged into these three. Llama's
map on a (1, 2) mesh is still exercised, by the save test's loads.

One-device twins (``_unsharded``) and sharded fits (the ``sharded`` fixture)
are computed once per module: Llama's (2, 2) fit serves the layout-map test,
the save test and the compression test's uncompressed run, which each made
that same fit.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

import tfdist
from tfdist.errors import ConfigError

keras_hub = pytest.importorskip("keras_hub")
from tiny_lms import batches as _batches, causal_lm as _causal_lm, fit as _fit  # noqa: E402

TOLERANCE = 1e-5
STEPS = 2  # Batches of 8 from 16 rows: Adam's second step sees the first's moments.


@functools.cache
def _unsharded(family: str):
    """The twin: initial weights, losses and final weights, with no distribution."""
    import keras

    keras.utils.set_random_seed(1)
    lm = _causal_lm(keras, family)
    initial = lm.get_weights()
    losses = _fit(lm)
    return initial, losses, lm.get_weights(), [v.path for v in lm.weights]


#: How each family's split kernels compute (by path suffix) with a model axis > 1.
#: Llama's and Qwen's q/k/v put "model" on the hidden dimension they sum over
#: (rows), Gemma's on the heads (columns).
_LLAMA = {
    "query/kernel": "row",
    "key/kernel": "row",
    "value/kernel": "row",
    "attention_output/kernel": "row",
    "feedforward_intermediate_dense/kernel": "column",
    "feedforward_gate_dense/kernel": "column",
    "feedforward_output_dense/kernel": "row",
}
MEGATRON = {
    "llama": _LLAMA,
    "qwen": _LLAMA,
    "gemma": {
        "query/kernel": "column",
        "key/kernel": "column",
        "value/kernel": "column",
        "attention_output/kernel": "row",
        "ffw_gating/kernel": "column",
        "ffw_gating_2/kernel": "column",
        "ffw_linear/kernel": "row",
    },
}


def _model_parallel(keras, family: str, shape: tuple[int, int]):
    dist = keras.distribution
    mesh = dist.DeviceMesh(shape, ["batch", "model"], dist.list_devices("cpu")[: np.prod(shape)])
    backbone = {
        "gemma": keras_hub.models.GemmaBackbone,
        "llama": keras_hub.models.LlamaBackbone,
        "qwen": keras_hub.models.QwenBackbone,
    }[family]
    return dist.ModelParallel(layout_map=backbone.get_layout_map(mesh), batch_dim_name="batch")


def _sharded_fit(keras, family: str, shape: tuple[int, int]) -> SimpleNamespace:
    """``family`` trained under its layout map on a ``shape`` mesh, from its
    twin's initial weights: the model, its distribution, its losses, weights
    and the bytes each replica sent during the fit."""
    keras.distribution.set_distribution(None)
    initial = _unsharded(family)[0]
    distribution = _model_parallel(keras, family, shape)
    keras.distribution.set_distribution(distribution)
    lm = _causal_lm(keras, family)
    lm.set_weights(initial)
    tfdist.parallel.reset_traffic(lm.distribute_strategy)
    losses = _fit(lm)
    return SimpleNamespace(
        lm=lm,
        distribution=distribution,
        losses=losses,
        weights=lm.get_weights(),
        sent=tfdist.parallel.traffic(lm.distribute_strategy),
    )


@pytest.fixture(scope="module")
def sharded(tf_cpus):
    """``sharded(family, shape)``: ``_sharded_fit``, once per module for each
    (family, shape); sets that fit's distribution for the calling test."""
    import keras

    runs = {}

    def get(family: str, shape: tuple[int, int]) -> SimpleNamespace:
        if (family, shape) not in runs:
            runs[family, shape] = _sharded_fit(keras, family, shape)
        keras.distribution.set_distribution(runs[family, shape].distribution)
        return runs[family, shape]

    yield get
    keras.distribution.set_distribution(None)


# One family on (2, 2) (Llama: its fit is shared with the save and compression
# tests), the others on (1, 2): the (2, 2) batch axis is family-independent.
@pytest.mark.parametrize(
    "family, shape",
    [("llama", (2, 2)), ("gemma", (1, 2)), ("qwen", (1, 2))],
    ids=["llama-2x2", "gemma-1x2", "qwen-1x2"],
)
def test_keras_hub_layout_map_trains_as_the_unsharded_model(keras_mod, sharded, family, shape):
    _, losses, final, paths = _unsharded(family)
    run = sharded(family, shape)
    lm, sharded_losses = run.lm, run.losses
    strategy = lm.distribute_strategy
    assert strategy.num_replicas_in_sync == shape[0] * shape[1]
    table = tfdist.distribution.report(lm)

    np.testing.assert_allclose(sharded_losses, losses, rtol=0, atol=TOLERANCE)
    assert [v.path for v in lm.weights] == paths
    for path, want, got in zip(paths, final, lm.get_weights()):
        assert got.shape == want.shape, path
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=path)

    # Each device holds its block of the weight and of Adam's moments.
    split = [v for v in lm.weights if table.row(v.path).how != "replicated"]
    embeddings = table.row("token_embedding/embeddings")
    assert embeddings.layout == ("model", "batch")
    assert embeddings.block == (256 // shape[1], 32 // shape[0])
    assert len(split) >= 1 + 2 * 6, [r.path for r in table.rows if r.how == "replicated"]
    for v in split:
        row = table.row(v.path)
        blocks = strategy.experimental_local_results(v.value)
        assert [tuple(b.shape) for b in blocks] == [row.block] * len(blocks), v.path
        sizes = {"batch": shape[0], "model": shape[1]}
        parts = int(np.prod([sizes[axis] for axis in row.layout if axis]))
        assert row.bytes_per_device * parts == row.full_bytes, v.path
        slots = [
            s
            for s in lm.optimizer.variables
            if tfdist.parallel.spec_of(s) is tfdist.parallel.spec_of(v)
        ]
        assert len(slots) == 2 and all(tuple(s.shape) == row.block for s in slots), v.path
    # Replicated exactly where the map has no rule (norms, Llama's untied
    # reverse_embeddings, Qwen's biases) or one that splits nothing.
    for row in table.rows:
        splits = any(
            axis and {"batch": shape[0], "model": shape[1]}[axis] > 1 for axis in row.layout or ()
        )
        assert (row.how != "replicated") == splits, row
    assert "token_embedding/embeddings" in str(table)
    # Kernels split along a letter only the output (column) or only the input
    # (row) has compute with their block; so does the table split along its
    # vocabulary over the model axis.
    hows = {row.path: row.how for row in table.rows}
    kinds = {**MEGATRON[family], "token_embedding/embeddings": "vocabulary"}
    for path, how in hows.items():
        kind = next((k for suffix, k in kinds.items() if path.endswith(suffix)), None)
        expected = (
            f"tensor-parallel ({kind})"
            if kind and shape[1] > 1
            else "gathered when used (FSDP)"
            if kind
            else None
        )
        if expected:
            assert how == expected, (path, how)
    assert hows["token_embedding/embeddings"] == (
        "tensor-parallel (vocabulary)" if shape[1] > 1 else "gathered when used (FSDP)"
    )


def _mlp_distribution(keras, layouts: dict, shape=(2, 2)):
    dist = keras.distribution
    mesh = dist.DeviceMesh(shape, ["batch", "model"], dist.list_devices("cpu")[: np.prod(shape)])
    layout_map = dist.LayoutMap(mesh)
    for key, axes in layouts.items():
        layout_map[key] = axes
    return dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _mlp(keras, **dense):
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, name="dense_a", **dense),
            keras.layers.Dense(4, name="dense_b"),
        ]
    )


@pytest.mark.parametrize(
    "layout, expected",
    [
        ((None, "model", None), "one entry per dimension of the weight (2)"),
        (("model", "model"), "each mesh axis at most once"),
        (("batch", None), "dimension 0 has 6, which the 'batch' axis (4 devices) does not divide"),
    ],
)
def test_a_layout_tfdist_cannot_honour_names_the_weight(keras_mod, layout, expected):
    # (An axis name the mesh lacks is Keras's own ValueError, in LayoutMap.)
    keras = keras_mod
    shape = (4, 1) if "divide" in expected else (2, 2)
    keras.distribution.set_distribution(
        _mlp_distribution(keras, {".*dense_a/kernel": layout}, shape)
    )
    with pytest.raises(ConfigError) as info:
        _mlp(keras)
    text = str(info.value)
    assert "dense_a/kernel" in text and "(6, 8)" in text and str(layout) in text, text
    assert expected in text, text


def test_a_regularizer_on_a_split_weight_is_refused(keras_mod):
    keras = keras_mod
    keras.distribution.set_distribution(
        _mlp_distribution(keras, {".*dense_a/kernel": (None, "model")})
    )
    with pytest.raises(ConfigError) as info:
        _mlp(keras, kernel_regularizer="l2")
    assert "regularizer of sequential" in str(info.value) and "/dense_a/kernel" in str(info.value)
    assert "would see one block" in str(info.value)
    # Replicated weights keep theirs; the split one without it builds.
    model = _mlp(keras, bias_regularizer="l2")
    assert model.layers[0].bias.regularizer is not None


def _fit_twice(keras, build, distribution, x, y, batch_size, seed):
    """``build()`` trained unsharded, then again under ``distribution`` from
    the same initial weights on the same batches; asserts both end alike
    (losses and every weight within 1e-6). Returns (reference, model)."""
    keras.utils.set_random_seed(seed)
    reference = build()
    initial = reference.get_weights()
    want = reference.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    keras.distribution.set_distribution(distribution)
    model = build()
    model.set_weights(initial)
    got = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=0, atol=1e-6)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    return reference, model


def test_keras_docs_layout_on_a_dense_model(keras_mod):
    """The layout of Keras's own ModelParallel docstring, kernels and biases
    on "model", with SGD and momentum: equal to the same model unsharded."""
    keras = keras_mod
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")

    def fit():
        model = _mlp(keras, activation="relu")
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        return model

    reference, model = _fit_twice(
        keras,
        fit,
        _mlp_distribution(keras, {".*dense.*kernel": (None, "model"), ".*dense.*bias": ("model",)}),
        x,
        y,
        batch_size=16,
        seed=2,
    )
    assert model.layers[0].kernel.shape == (6, 4)  # A block: (6, 8) over 2.
    np.testing.assert_allclose(
        model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=0, atol=1e-5
    )
    # Called directly, outside fit: the full weights from the local blocks.
    np.testing.assert_allclose(
        np.asarray(model(x[:4])), reference.predict(x[:4], verbose=0), rtol=0, atol=1e-5
    )


def test_a_keras_embedding_split_along_its_vocabulary(keras_mod):
    """Keras's own Embedding (mask_zero: the mask reaches the pooling) with
    its table split over "model" along the vocabulary and over "batch" along
    its width: vocabulary-parallel lookups, equal to the model unsharded."""
    keras = keras_mod
    rng = np.random.default_rng(5)
    x = rng.integers(0, 16, (32, 5)).astype("int32")
    x[:, -2:] = 0  # Padding the mask hides.
    y = rng.normal(size=(32, 3)).astype("float32")

    def fit():
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(16, 6, mask_zero=True, name="emb"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(3, name="head"),
            ]
        )
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        return model

    distribution = _mlp_distribution(keras, {".*emb/embeddings": ("model", "batch")})
    reference, model = _fit_twice(keras, fit, distribution, x, y, batch_size=16, seed=4)
    table = tfdist.distribution.report(model)
    row = table.row(model.layers[0].embeddings.path)
    assert (row.how, row.block) == ("tensor-parallel (vocabulary)", (8, 3))
    # The reference's pooling skips the padded positions: equal predictions
    # mean the sharded lookup's output carries the mask too.
    np.testing.assert_allclose(
        model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=0, atol=1e-5
    )
    unmasked = keras.layers.GlobalAveragePooling1D()(
        keras.ops.take(reference.layers[0].embeddings, x, axis=0)
    )
    assert not np.allclose(reference.layers[1](reference.layers[0](x)), unmasked, atol=1e-3)


def test_a_sharded_model_saves_whole_and_loads_under_any_mesh(keras_mod, sharded, tmp_path):
    """model.save, save_weights, a tf.train.Checkpoint and keras-hub's preset
    written on a (2, 2) mesh hold full weights: they load with no
    distribution and on a (1, 2) mesh, and predict the same."""
    keras = keras_mod
    import tensorflow as tf

    x, _ = _batches()
    lm = sharded("llama", (2, 2)).lm  # Trained on the (2, 2) mesh.
    want = lm.predict(x, batch_size=8, verbose=0)
    trained = lm.get_weights()
    lm.save(tmp_path / "lm.keras")
    lm.save_weights(tmp_path / "lm.weights.h5")
    checkpoint = tf.train.Checkpoint(model=lm).write(str(tmp_path / "ckpt" / "lm"))
    # The backbone's preset (keras-hub 0.25's task preset cannot save preprocessor=None).
    lm.backbone.save_to_preset(str(tmp_path / "preset"))

    def from_preset():
        backbone = keras_hub.models.LlamaBackbone.from_preset(str(tmp_path / "preset"))
        return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)

    def same(model, where):
        for path, a, b in zip([v.path for v in model.weights], trained, model.get_weights()):
            np.testing.assert_array_equal(a, b, err_msg=f"{where}: {path}")
        np.testing.assert_allclose(
            model.predict(x, batch_size=8, verbose=0), want, rtol=0, atol=1e-5, err_msg=where
        )

    keras.distribution.set_distribution(None)
    same(keras.models.load_model(tmp_path / "lm.keras"), "load_model, no distribution")
    plain = _causal_lm(keras, "llama")
    plain.load_weights(tmp_path / "lm.weights.h5")
    same(plain, "load_weights, no distribution")
    restored = _causal_lm(keras, "llama")
    tf.train.Checkpoint(model=restored).read(checkpoint).assert_existing_objects_matched()
    same(restored, "tf.train.Checkpoint, no distribution")
    same(from_preset(), "from_preset, no distribution")

    keras.distribution.set_distribution(_model_parallel(keras, "llama", (1, 2)))
    other = keras.models.load_model(tmp_path / "lm.keras")
    assert other.distribute_strategy.num_replicas_in_sync == 2
    assert tuple(other.backbone.token_embedding.embeddings.shape) == (128, 32)
    same(other, "load_model, (1, 2) mesh")
    same(from_preset(), "from_preset, (1, 2) mesh")


@pytest.mark.slow
def test_four_processes_under_tfdist_launch(keras_mod, tmp_path):
    """keras-hub's recipe across 4 worker processes (one device each) on a
    (2, 2) mesh: every worker ends where the unsharded twin ends. Its saves
    gather no whole weight, and restore here, in one process, on a (1, 4)
    mesh and with no distribution, optimizer state included. The preset
    loads back across the 4 processes, each block made locally. Then
    ``generate()`` gives the twin's tokens (greedy, top-k, stop tokens)."""
    import hashlib
    import io

    from conftest import REPO, result_line
    from tfdist.engines.launch import launch

    out = io.StringIO()
    result = launch(
        str(REPO / "tests" / "workers" / "keras_model_parallel_job.py"),
        [],
        workers=4,
        show_all=True,
        output=out,
        handle_signals=False,
        stop_timeout=5,
        env={
            "PYTHONPATH": str(REPO),
            "TMPDIR": str(tmp_path),
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TFDIST_CHECKPOINT_DIR": str(tmp_path),
        },
    )
    lines = out.getvalue().splitlines()
    assert result.ok, "\n".join(lines[-60:])
    runs = sorted(
        (result_line(line.partition("] ")[2]) for line in lines if "] tfdist result: " in line),
        key=lambda r: r["task"],
    )
    assert [r["task"] for r in runs] == [f"worker:{i}" for i in range(4)]
    # Worker 0 trained the twin; every worker's model equals worker 0's.
    twin = runs[0]
    assert twin["largest_difference"] < TOLERANCE, twin
    assert twin["predict_difference"] < TOLERANCE, twin
    for run in runs:
        assert run["replicas"] == 4
        assert run["mesh"] == "data 2 x tensor 2; tensor groups [0, 1] [2, 3]"
        assert run["devices"][3].startswith("/job:worker/replica:0/task:3/")
        np.testing.assert_allclose(run["losses"], twin["twin_losses"], rtol=0, atol=TOLERANCE)
        assert run["logits_sha256"] == twin["logits_sha256"], run["task"]
        assert run["block"] == [128, 16] and run["local_block"] == [[128, 16]]
        assert run["traffic"]["tensor_parallel"] > 0 and run["traffic"]["data_parallel"] > 0
        assert run["sha256"] == runs[0]["sha256"]
        assert run["gathers_while_saving"] == [], run["gathers_while_saving"]
        assert run["initial_difference_from_worker_0"] == 0.0
        # TF broadcasts worker 0's initial value; created_locally keeps each
        # worker's own, and gives the strategy back as it was.
        task = int(run["task"].split(":")[1])
        assert run["initial_values"] == [0.0, float(task)], run["initial_values"]
        assert run["extended_after"] == "CollectiveAllReduceExtended"
        assert run["preset_block"] == [128, 16]
        assert run["preset_difference"] == 0.0, run["preset_difference"]
        # generate() across the processes gives the twin's tokens; the stop
        # tokens ended every row early (the while loop ran alike everywhere).
        assert run["tokens"] == twin["twin_tokens"], (run["tokens"], twin["twin_tokens"])
        assert run["tokens"]["greedy"] != run["tokens"]["top_k"]
        mask = np.asarray(run["tokens"]["stop_mask"])
        assert mask.shape == (4, 10) and not mask[:, -1].any(), mask

    def digest(arrays):
        return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()

    keras = keras_mod
    for shape in ((1, 4), None):
        keras.distribution.set_distribution(shape and _model_parallel(keras, "llama", shape))
        restored = _causal_lm(keras, "llama")
        restored.optimizer.build(restored.trainable_variables)
        restored.load_weights(tmp_path / "lm.weights.h5")
        assert digest(restored.get_weights()) == runs[0]["sha256"], shape
        slots = tfdist.parallel.saving.full_weights(restored.optimizer.variables)
        assert digest(slots) == runs[0]["optimizer_sha256"], shape
        backbone = keras_hub.models.LlamaBackbone.from_preset(str(tmp_path / "preset"))
        want = dict(zip([v.path for v in restored.weights], restored.get_weights()))
        for v, value in zip(backbone.weights, backbone.get_weights()):
            np.testing.assert_array_equal(value, want[v.path], err_msg=f"{shape}: {v.path}")
    keras.distribution.set_distribution(None)
    assert digest(keras.models.load_model(tmp_path / "lm.keras").get_weights()) == runs[0]["sha256"]
    print(
        f"\nmeasured: 4 workers on a (2, 2) mesh, losses {runs[0]['losses']} (twin "
        f"{runs[0]['twin_losses']}), largest weight difference "
        f"{twin['largest_difference']:.1e}; weights per device "
        f"{runs[0]['bytes_per_device']:,} of {runs[0]['full_bytes']:,} bytes; bytes sent "
        f"per replica {runs[0]['traffic']}"
    )


def test_compression_on_the_data_axis(keras_mod, sharded):
    """tfdist.distribution.ModelParallel(compression="bf16"): the gradients of
    weights split over the batch axis are reduce-scattered in bfloat16 (half
    the data-parallel bytes of the same fit uncompressed); a compressor that
    needs the whole gradient is refused, naming the weight."""
    keras = keras_mod
    # The same fit uncompressed: the module's (2, 2) Llama fit (Keras's
    # ModelParallel, the strategy tfdist's makes with compression=None), its
    # bytes counted from its first step as the bf16 fit's are here.
    plain = sharded("llama", (2, 2))
    keras.distribution.set_distribution(None)
    initial, _, _, _ = _unsharded("llama")
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], keras.distribution.list_devices("cpu")
    )
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        tfdist.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch", compression="bf16"
        )
    )
    lm = _causal_lm(keras, "llama")
    lm.set_weights(initial)
    tfdist.parallel.reset_traffic(lm.distribute_strategy)
    bf16 = _fit(lm)
    bf16_weights = lm.get_weights()
    bf16_sent, plain_sent = tfdist.parallel.traffic(lm.distribute_strategy), plain.sent
    np.testing.assert_allclose(bf16, plain.losses, rtol=0, atol=1e-2)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(bf16_weights, plain.weights))
    assert 0 < moved < 1e-2, moved
    # The weights' gathers are the same; the gradient sums over the batch
    # axis (and the replicated weights' all-reduce) go in 16 bits.
    assert bf16_sent["tensor_parallel"] == plain_sent["tensor_parallel"]
    assert bf16_sent["data_parallel"] < 0.9 * plain_sent["data_parallel"], (bf16_sent, plain_sent)
    keras.distribution.set_distribution(
        tfdist.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch", compression="topk:0.1"
        )
    )
    with pytest.raises(ConfigError) as info:
        _causal_lm(keras, "llama")
    text = str(info.value)
    assert "compression" in text and "topk" in text and "token_embedding/embeddings" in text
    assert "reduce-scattered" in text and "bf16" in text


def test_a_layer_with_sublayers_keeps_its_gathered_weight(keras_mod):
    """A split weight of a layer that also calls a sublayer with weights is
    gathered for the call and kept for the backward pass (its call is not
    recomputed); it trains as unsharded, and the report says so."""
    keras = keras_mod

    class Outer(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(4, name="inner")

        def build(self, input_shape):
            self.w = self.add_weight(name="w", shape=(input_shape[-1], 8))
            self.inner.build((None, 8))

        def call(self, x):
            return self.inner(keras.ops.tanh(keras.ops.matmul(x, self.w)))

    def fit():
        model = keras.Sequential(
            [keras.Input((6,)), Outer(name="outer"), keras.layers.Dense(2, name="head")]
        )
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        return model

    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    _, model = _fit_twice(
        keras,
        fit,
        _mlp_distribution(
            keras,
            {
                ".*outer/w": ("batch", "model"),
                ".*inner/kernel": (None, "model"),
                ".*head/kernel": ("batch", None),
            },
        ),
        x,
        y,
        batch_size=8,
        seed=4,
    )
    table = tfdist.distribution.report(model)
    hows = {row.path.split("/", 1)[1]: row.how for row in table.rows}
    assert hows["outer/w"] == "gathered when used, kept for backward (FSDP)", hows
    assert hows["outer/inner/kernel"] == "tensor-parallel (column)"
    assert hows["head/kernel"] == "gathered when used (FSDP)"
    assert hows["outer/inner/bias"] == "replicated"


def test_a_batch_only_mesh_splits_weights_over_the_data_axis(keras_mod):
    """A 1-D mesh of 4 devices: ModelParallel is FSDP alone (no tensor
    group), each device holding a quarter of the split kernels."""
    keras = keras_mod
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")

    def fit():
        model = _mlp(keras, activation="tanh")
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        return model

    dist = keras.distribution
    mesh = dist.DeviceMesh((4,), ["batch"], dist.list_devices("cpu"))
    layout_map = dist.LayoutMap(mesh)
    layout_map[".*dense_a/kernel"] = (None, "batch")
    layout_map[".*dense_b/kernel"] = ("batch", None)
    _, model = _fit_twice(
        keras,
        fit,
        dist.ModelParallel(layout_map=layout_map, batch_dim_name="batch"),
        x,
        y,
        batch_size=8,
        seed=7,
    )
    assert (
        tfdist.parallel.mesh_of(model.distribute_strategy)
        .describe()
        .startswith("data 4 x tensor 1")
    )
    assert tuple(model.layers[0].kernel.shape) == (6, 2)
    assert tuple(model.layers[1].kernel.shape) == (2, 4)


def test_report_names_the_shards_of_tfdist_parallel_layers(keras_mod):
    keras = keras_mod
    strategy = tfdist.strategy_from_config(cpu_replicas=4, model_parallel=2)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                tfdist.parallel.ColumnParallelDense(8, name="col"),
                tfdist.parallel.RowParallelDense(4, name="row"),
            ]
        )
    hows = {
        row.path.split("/", 1)[1]: (row.how, row.block, row.layout)
        for row in tfdist.distribution.report(model).rows
    }
    assert hows["col/kernel"] == ("tensor-parallel (tfdist.parallel layer)", (6, 4), None)
    assert hows["row/kernel"] == ("tensor-parallel (tfdist.parallel layer)", (4, 4), None)
    assert hows["row/bias"] == ("replicated", (4,), None)
