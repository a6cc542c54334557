"""The keras-hub Llama the memory benchmarks size, and the layouts they compare
(benchmarks/lora_capacity.py, benchmarks/preset_limit.py)."""

from __future__ import annotations

from typing import Any


def sizes(hidden: int, vocabulary: int, layers: int) -> dict:
    """A Llama of width ``hidden``: 128-wide heads, half as many key/value
    heads, a feed-forward of 2.75x the width (a multiple of 64), untied
    embeddings."""
    heads = max(4, hidden // 128)
    return {
        "vocabulary_size": vocabulary,
        "num_layers": layers,
        "hidden_dim": hidden,
        "num_query_heads": heads,
        "num_key_value_heads": max(2, heads // 2),
        "intermediate_dim": max(64, round(2.75 * hidden / 64) * 64),
        "tie_word_embeddings": False,
    }


def distribution(keras: Any, keras_hub: Any, layout: str) -> Any:
    """``DataParallel`` over every device, or ``ModelParallel`` on a (1, N)
    mesh with Llama's map plus the rule tfdist's ``LayoutWarning`` asks for
    (the untied logits table, which keras-hub's map leaves whole)."""
    devices = keras.distribution.list_devices()
    if layout == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    layout_map["token_embedding/reverse_embeddings"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
