"""keras-hub's distributed tuning recipe on TensorFlow (issue 38, part 2).

"Distributed tuning with Gemma using Keras" on JAX: a ``DeviceMesh``, the
backbone's ``get_layout_map``, ``ModelParallel``, ``backbone.enable_lora``,
``fit``, then ``generate``. Here for Gemma, Llama and Qwen at tiny sizes on 4
logical CPUs, against the same recipe with no distribution: the losses and
every weight within 1e-5, the frozen base weights still split and
unchanged, and ``generate()`` (greedy, and top-k with a seed; the KV cache)
returning the same tokens.

Llama runs on a (2, 2) mesh (adapters over kernels split on both axes, the
batch axis data-parallel too), Gemma and Qwen with a model axis of 4 (Gemma's
4 key/value heads one per device). Gemma's (2, 2) case was merged away: the
batch axis of a (2, 2) mesh acts alike whatever the family (Llama's case
covers it) and Gemma's map is exercised on its (1, 4) mesh. Each family's
one-device reference (``_one_device``) is computed once per session.
"""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np
import pytest

import tfdist

keras_hub = pytest.importorskip("keras_hub")
from tiny_lms import batches, causal_lm  # noqa: E402

TOLERANCE = 1e-5
RANK = 4


def _model(keras, family: str):
    # Gemma's map splits the key/value heads over "model": 4 of them, as the
    # issue's recipe has, let a model axis of 4 divide them.
    return causal_lm(keras, family, **({"num_key_value_heads": 4} if family == "gemma" else {}))


def _recipe(keras, family: str):
    """The recipe's model: built, LoRA enabled, compiled as its guide does."""
    lm = _model(keras, family)
    lm.backbone.enable_lora(rank=RANK)
    lm.compile(
        optimizer=keras.optimizers.Adam(5e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


def _prompts():
    """4 prompts of 3 tokens, room for 5 more."""
    x, _ = batches()
    mask = np.zeros((4, 8), bool)
    mask[:, :3] = True
    return {"token_ids": np.where(mask, x["token_ids"][:4], 0), "padding_mask": mask}


def _generate(keras, lm) -> dict:
    out = {}
    for name, sampler in (
        ("greedy", keras_hub.samplers.GreedySampler()),
        ("top_k", keras_hub.samplers.TopKSampler(k=5, seed=7)),
    ):
        lm.compile(sampler=sampler)
        out[name] = np.asarray(lm.generate(_prompts(), stop_token_ids=None)["token_ids"])
    return out


def _tune(keras, lm):
    x, y = batches()
    return lm.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]


def _merged(keras, family: str, lm, directory) -> list:
    """The weights ``lm`` saves (Keras merges the adapters into the kernels),
    read back by the model without LoRA, on one device."""
    path = os.path.join(directory, f"{family}.weights.h5")
    lm.save_weights(path)
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        plain = _model(keras, family)
        plain.load_weights(path)
        return plain.get_weights()
    finally:
        keras.distribution.set_distribution(distribution)


@functools.cache
def _one_device(family: str):
    import keras

    keras.utils.set_random_seed(2)
    lm = _recipe(keras, family)
    initial = lm.get_weights()
    trainable = {v.path for v in lm.trainable_weights}
    losses = _tune(keras, lm)
    with tempfile.TemporaryDirectory() as directory:
        merged = _merged(keras, family, lm, directory)
    return initial, trainable, losses, lm.get_weights(), _generate(keras, lm), merged


def _mesh_distribution(keras, family: str, shape):
    dist = keras.distribution
    mesh = dist.DeviceMesh(shape, ["batch", "model"], dist.list_devices("cpu")[:4])
    backbone = {
        "gemma": keras_hub.models.GemmaBackbone,
        "llama": keras_hub.models.LlamaBackbone,
        "qwen": keras_hub.models.QwenBackbone,
    }[family]
    return dist.ModelParallel(layout_map=backbone.get_layout_map(mesh), batch_dim_name="batch")


@pytest.mark.parametrize(
    "family, shape",
    [
        # A model axis of 4 over Gemma's 4 heads: a block-sized adapter
        # broadcast silently over the full kernel here.
        ("gemma", (1, 4)),
        ("llama", (2, 2)),
        ("qwen", (1, 4)),
    ],
    ids=["gemma-1x4", "llama-2x2", "qwen-1x4"],
)
def test_lora_tunes_generates_and_saves_as_one_device(keras_mod, tmp_path, family, shape):
    keras = keras_mod
    initial, trainable, want_losses, want_weights, want_tokens, want_merged = _one_device(family)
    keras.distribution.set_distribution(_mesh_distribution(keras, family, shape))
    lm = _recipe(keras, family)
    lm.set_weights(initial)
    table = tfdist.distribution.report(lm)
    by_path = {v.path: v for v in lm.weights}

    # The adapters have the unsharded model's shapes (Keras sizes them from
    # the kernel's shape, a block's on the mesh); the same weights train as
    # on one device: the adapters, and the biases keras-hub leaves trainable
    # (Qwen's query and value).
    lora = [v for v in lm.weights if "lora_kernel" in v.path]
    assert len(lora) == 2 * 2 * 2  # 2 layers x (query, value) x (a, b)
    kernels = {v.path.rsplit("/", 1)[0]: v for v in lm.weights if v.path.endswith("/kernel")}
    for v in lora:
        base = kernels[v.path.rsplit("/", 1)[0]]
        full = table.row(base.path).shape
        want = full[:-1] + (RANK,) if v.path.endswith("_a") else (RANK, full[-1])
        assert table.row(v.path).shape == want, v.path
    assert {v.path for v in lm.trainable_weights} == trainable
    assert {v.path for v in lora} <= trainable

    losses = _tune(keras, lm)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=TOLERANCE)
    after = lm.get_weights()
    for path, got, want, start in zip(by_path, after, want_weights, initial):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=path)
        if "lora_kernel_b" in path:
            assert np.abs(got - start).max() > 1e-4, f"{path} did not train"
        elif path not in trainable:
            np.testing.assert_array_equal(got, start, err_msg=f"{path}: a frozen weight moved")
    # The frozen base weights are still split: each device holds its block,
    # and no optimizer slot was made for them.
    strategy = lm.distribute_strategy
    split = [row for row in table.rows if row.how != "replicated"]
    assert len(split) >= 1 + 2 * 6
    for row in split:
        blocks = strategy.experimental_local_results(by_path[row.path].value)
        assert [tuple(b.shape) for b in blocks] == [row.block] * 4, row.path
    slots = {id(s) for s in lm.optimizer.variables}
    assert not any(
        id(s) in slots
        for s in lm.optimizer.variables
        if tfdist.parallel.spec_of(s) is not None and "lora" not in s.path
    )

    tokens = _generate(keras, lm)
    for sampler, want in want_tokens.items():
        np.testing.assert_array_equal(tokens[sampler], want, err_msg=sampler)
    assert not np.array_equal(tokens["greedy"], tokens["top_k"])  # The samplers differ.

    # Saved, the adapters are merged into the split kernels block by block,
    # as one device merges them whole; the model keeps its split base
    # weights and its adapters, unchanged by the save.
    merged = _merged(keras, family, lm, tmp_path)
    plain = {v.path for v in _model(keras, family).weights}
    assert len(merged) == len(plain) == len(want_merged)
    for got, want in zip(merged, want_merged):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    for path, got, was in zip(by_path, lm.get_weights(), after):
        np.testing.assert_array_equal(got, was, err_msg=f"{path}: changed by the save")
    adapted = [
        layer
        for layer in lm._flatten_layers()  # Every sublayer.
        if getattr(layer, "lora_kernel_a", None) is not None
    ]
    assert len(adapted) == 2 * 2 and all(layer.lora_enabled for layer in adapted)


def test_stock_tensorflow_backend_lacks_distribute_tensor(keras_mod):
    """The canary of the registry's distribution_guard.distribute_tensor:
    Keras's TensorFlow backend has no distribute_tensor, so
    keras.distribution.distribute_tensor (keras-hub's generate calls it)
    raised AttributeError. After tfdist it returns the tensor as it is."""
    from tfdist.compat import pristine
    from tfdist.compat.keras_src import tf_distribution_lib
    from tfdist.compat.patching import MISSING

    keras = keras_mod
    assert pristine(tf_distribution_lib, "distribute_tensor") is MISSING
    mesh = keras.distribution.DeviceMesh((4,), ["batch"], keras.distribution.list_devices("cpu"))
    layout = keras.distribution.TensorLayout(["batch", None], mesh)
    x = keras.ops.convert_to_tensor(np.arange(8.0).reshape(4, 2))
    assert keras.distribution.distribute_tensor(x, layout) is x
