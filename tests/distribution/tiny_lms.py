"""keras-hub's Llama, Gemma and Qwen CausalLMs at tiny sizes, and their data.

Shared by tests/distribution/test_model_parallel.py and its 4-process worker
(tests/workers/keras_model_parallel_job.py). Built from constructors: nothing
is downloaded.
"""

from __future__ import annotations

import keras_hub
import numpy as np


def causal_lm(keras, family: str, **sizes):
    """``sizes`` override the common ones (e.g. ``num_key_value_heads=4``)."""
    common = dict(
        vocabulary_size=256,
        num_layers=2,
        hidden_dim=32,
        num_query_heads=4,
        num_key_value_heads=2,
        intermediate_dim=64,
    )
    common.update(sizes)
    models = keras_hub.models
    if family == "gemma":
        lm = models.GemmaCausalLM(models.GemmaBackbone(**common, head_dim=8), preprocessor=None)
    elif family == "llama":
        lm = models.LlamaCausalLM(models.LlamaBackbone(**common), preprocessor=None)
    else:
        lm = models.QwenCausalLM(models.QwenBackbone(**common), preprocessor=None)
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


def batches(skewed: bool = False):
    """16 rows of 8 ids, uniform over the vocabulary; ``skewed``: the first
    batch of 8 rows from its first 96 ids only, as text at a large
    vocabulary gives (a block of the vocabulary that no id hits)."""
    ids = np.random.default_rng(0).integers(0, 256, (16, 8)).astype("int32")
    if skewed:
        ids[:8] %= 96
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, axis=1)


def fit(lm, skewed: bool = False):
    x, y = batches(skewed)
    return lm.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history["loss"]


def prompts(rows: int = 4, width: int = 10):
    """``rows`` prompts of 3, 5, 2 and 4 tokens (uneven, as users' are), with
    room up to ``width``."""
    x, _ = batches()
    lengths = np.resize([3, 5, 2, 4], rows)
    mask = np.arange(width)[None, :] < lengths[:, None]
    ids = np.zeros((rows, width), "int32")
    ids[:, :8] = x["token_ids"][:rows]
    return {"token_ids": np.where(mask, ids, 0), "padding_mask": mask}


def generations(lm) -> dict:
    """``generate()``'s tokens for :func:`prompts`: greedy; top-k with a seed;
    greedy again with stop tokens that end each row by its second generated
    token (so the loop ends before the width), with its padding mask.
    Recompiles ``lm`` (a new optimizer)."""
    out = {}
    lengths = np.asarray(prompts()["padding_mask"]).sum(axis=1)
    for name, sampler in (
        ("greedy", keras_hub.samplers.GreedySampler()),
        ("top_k", keras_hub.samplers.TopKSampler(k=5, seed=7)),
        ("stop", keras_hub.samplers.GreedySampler()),
    ):
        stop = None
        if name == "stop":
            stop = sorted({int(row[n + 1]) for row, n in zip(out["greedy"], lengths)})
            out["stop_token_ids"] = stop
        lm.compile(sampler=sampler)
        result = lm.generate(prompts(), stop_token_ids=stop)
        out[name] = np.asarray(result["token_ids"]).tolist()
    out["stop_mask"] = np.asarray(result["padding_mask"]).tolist()
    return out
