"""keras-hub's from_preset under ModelParallel reads blocks, not whole
weights (issue 38, part 3), on 4 logical CPUs.

keras-hub builds a backbone with its initializers, then loads the preset's
``model.weights.h5`` over it; Keras's store reads each weight whole. Under a
layout, tfdist builds only each device's blocks when the weights are loaded
next, and reads each split weight from the file block by block (h5py reads
slices), so a process holds no whole split weight while it loads. Memory
across 4 processes: ``benchmarks/preset_memory.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist

keras_hub = pytest.importorskip("keras_hub")


def _backbone():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=1024,
        num_layers=2,
        hidden_dim=32,
        num_query_heads=4,
        num_key_value_heads=2,
        intermediate_dim=64,
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize("piece_bytes", [None, 200], ids=["whole-blocks", "200-byte-pieces"])
def test_from_preset_reads_each_devices_blocks_only(keras_mod, tmp_path, monkeypatch, piece_bytes):
    """``piece_bytes``: each block is written in pieces of a few rows, the
    last one shorter (a large model's blocks come in 4 MiB pieces)."""
    from tfdist.distribution import layouts
    from tfdist.parallel import saving, sharding

    keras = keras_mod
    if piece_bytes:
        monkeypatch.setattr(sharding, "PIECE_BYTES", piece_bytes)
    keras.utils.set_random_seed(0)
    saved = _backbone()
    saved.save_to_preset(str(tmp_path / "preset"))
    ids = np.random.default_rng(0).integers(0, 1024, (4, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    want = np.asarray(saved(x))

    # What the file gives: each read's shape, and whole reads (np.asarray).
    blocks, wholes, initialized = [], [], []
    read, whole = saving._Sliced.__getitem__, saving._Sliced.__array__
    monkeypatch.setattr(
        saving._Sliced, "__getitem__", lambda s, i: blocks.append(read(s, i).shape) or read(s, i)
    )
    monkeypatch.setattr(
        saving._Sliced,
        "__array__",
        lambda s, dtype=None, copy=None: wholes.append(s.shape) or whole(s, dtype),
    )
    # Every laid-out weight is made while keras-hub's loader says weights come next.
    plan = layouts.plan
    monkeypatch.setattr(
        layouts,
        "plan",
        lambda *a: initialized.append(layouts.loading_next()) or plan(*a),
    )

    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], keras.distribution.list_devices("cpu")
    )
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
            batch_dim_name="batch",
        )
    )
    loaded = keras_hub.models.LlamaBackbone.from_preset(str(tmp_path / "preset"))
    table = tfdist.distribution.report(loaded)
    split = [row for row in table.rows if row.how != "replicated"]

    assert initialized and all(initialized)
    assert len(split) == 1 + 2 * 7
    # 4 devices, one block each, of every split weight: read as blocks, or
    # in pieces of whole rows that make up the blocks.
    if piece_bytes is None:
        assert sorted(blocks) == sorted(row.block for row in split for _ in range(4))
    else:
        assert len(blocks) > 4 * len(split)
        assert all(np.prod(b) * 4 <= piece_bytes or b[0] == 1 for b in blocks), blocks
    # Whole reads only for weights the map leaves whole (the untied logits
    # table; norms are small enough that Keras's store hands them over read).
    replicated = {row.shape for row in table.rows if row.how == "replicated"}
    assert wholes and set(wholes) <= replicated
    assert not {row.shape for row in split} & set(wholes)
    for a, b in zip(saved.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.asarray(loaded(x)), want, rtol=0, atol=1e-5)


def test_a_preset_whose_weight_shape_the_layout_cannot_split_is_refused(keras_mod, tmp_path):
    """A mesh that does not divide a weight: a ConfigError naming the
    weight, its shape and the layout, raised while the backbone is built,
    before its weights are read."""
    from tfdist.errors import ConfigError

    keras = keras_mod
    _backbone().save_to_preset(str(tmp_path / "preset"))
    mesh = keras.distribution.DeviceMesh(
        (1, 4), ["batch", "model"], keras.distribution.list_devices("cpu")
    )
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    # A vocabulary the model axis (4) does not divide.
    config = tmp_path / "preset" / "config.json"
    config.write_text(
        config.read_text().replace('"vocabulary_size": 1024', '"vocabulary_size": 1022')
    )
    with pytest.raises(ConfigError) as info:
        keras_hub.models.LlamaBackbone.from_preset(str(tmp_path / "preset"))
    text = str(info.value)
    assert "token_embedding/embeddings" in text and "(1022, 32)" in text, text
    assert "('model', 'batch')" in text and "1022" in text, text


def test_a_large_weight_no_rule_splits_is_named_before_it_is_made(keras_mod, monkeypatch):
    """keras-hub#2806: a renamed weight matched no rule and loaded replicated,
    out of memory with no word. A weight the map leaves whole is named in a
    LayoutWarning, with its size, before it is allocated (the threshold
    lowered here for a small model)."""
    from tfdist.distribution import layouts

    keras = keras_mod
    monkeypatch.setattr(layouts, "LARGE_REPLICATED_BYTES", 100_000)
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], keras.distribution.list_devices("cpu")
    )
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    # The rule a rename leaves behind: it names a path the model no longer has.
    layout_map["token_embeddings/embeddings"] = layout_map.pop("token_embedding/embeddings")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    with pytest.warns(layouts.LayoutWarning) as caught:
        backbone = _backbone()
    named = [str(w.message) for w in caught]
    # The table (1024 x 32 float32) and the untied logits table, whole; the
    # kernels the map splits are not named.
    assert any("token_embedding/embeddings (shape (1024, 32), 0.1 MiB)" in m for m in named), named
    assert any("token_embedding/reverse_embeddings" in m for m in named), named
    assert not any("kernel" in m for m in named), named
    row = tfdist.distribution.report(backbone).row("token_embedding/embeddings")
    assert row.how == "replicated"


def test_load_model_builds_each_devices_blocks_only(keras_mod, tmp_path, monkeypatch):
    """keras.models.load_model builds the model from its config, then reads
    the file over it: under a layout every split weight is made as its
    blocks only (no initializer draws it whole), and the model equals the
    saved one."""
    from tfdist.distribution import layouts

    keras = keras_mod
    keras.utils.set_random_seed(0)
    saved = _backbone()
    saved.save(tmp_path / "backbone.keras")
    made = []
    plan = layouts.plan
    monkeypatch.setattr(layouts, "plan", lambda *a: made.append(layouts.loading_next()) or plan(*a))
    mesh = keras.distribution.DeviceMesh(
        (1, 4), ["batch", "model"], keras.distribution.list_devices("cpu")
    )
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
            batch_dim_name="batch",
        )
    )
    loaded = keras.models.load_model(tmp_path / "backbone.keras")
    split = [r for r in tfdist.distribution.report(loaded).rows if r.how != "replicated"]
    assert len(split) == 1 + 2 * 7
    assert made and all(made), made
    assert not layouts.loading_next()  # Only while load_model runs.
    for a, b in zip(saved.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
