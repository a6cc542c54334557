"""LoRA on a laid-out layer: adapters of the unsharded weight's shape.

Keras's ``enable_lora`` (``Dense``, ``EinsumDense``, ``Embedding``; keras-hub's
``backbone.enable_lora(rank)`` calls it on the attention's query and value
layers) sizes the adapters from the kernel's ``shape``. A laid-out weight's
``shape`` is its block's (:mod:`~tfdist.distribution.layouts`), so the
adapters would be sized for one block: on a (2, 2) mesh the call then adds
a block-sized update to the full kernel and fails; on a (1, 4) mesh the
update broadcasts and trains the wrong model, silently.

While a laid-out layer's ``enable_lora`` runs, its laid-out weights report
their full shape, so the adapters are those of the model unsharded. The
layout map lays them out as any weight (keras-hub's maps match none of
them: replicated, as on JAX). The frozen base weight stays split; the
regathered call (:mod:`~tfdist.distribution.regather`) takes no gradient
for it.

Saving merges the adapters into the weight, as Keras does (``save_own_variables``
writes ``kernel + alpha / rank * a @ b``), but block by block: Keras's sum
would add the full update to the local block and fail. While a laid-out
layer with LoRA saves, each local block holds its merged value, computed
from its slices of the adapters, and the layer saves as without LoRA, its
weight written block by block (:mod:`tfdist.parallel.saving`); then the
blocks get their exact values back.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from tfdist.record import attach, slot

__all__ = ["full_shapes", "reporting_full_shapes", "wrap", "merged_into_blocks"]

#: Keras's adapters of each LoRA layer: (a, b), the update is ``a @ b``.
_ADAPTERS = (("lora_kernel_a", "lora_kernel_b"), ("lora_embeddings_a", "lora_embeddings_b"))

_local = threading.local()


class _FullShapes:
    """Marks a layer whose ``enable_lora`` sizes from full shapes (a
    :mod:`tfdist.record` slot)."""


def full_shapes() -> bool:
    """Whether laid-out weights report their full shape on this thread now."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def reporting_full_shapes():
    """While it is open, laid-out weights report their full shape."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def wrap(layer: Any) -> None:
    """Makes ``layer.enable_lora`` size its adapters from full shapes (once
    per layer; a layer without LoRA is left as it is)."""
    original = getattr(layer, "enable_lora", None)
    if original is None or slot(layer, _FullShapes) is not None:
        return

    @functools.wraps(original)
    def enable_lora(*args, **kwargs):
        with reporting_full_shapes():
            return original(*args, **kwargs)

    def save_own_variables(store):
        # Looked up at each call: tfdist.parallel.saving covers the class.
        save = type(layer).save_own_variables
        if not getattr(layer, "lora_enabled", False):
            return save(layer, store)
        with merged_into_blocks(layer):
            return save(layer, store)

    # Instance attributes, as regather.wrap sets `call`: keras-hub's
    # backbone.enable_lora calls layer.enable_lora on each target, and
    # Keras's saving calls layer.save_own_variables.
    object.__setattr__(layer, "enable_lora", enable_lora)
    object.__setattr__(layer, "save_own_variables", save_own_variables)
    attach(layer, _FullShapes())


@contextlib.contextmanager
def merged_into_blocks(layer: Any) -> Iterator[None]:
    """While it is open, ``layer``'s laid-out weight holds the LoRA update
    merged in, block by block, and the layer reads as without LoRA.

    Each local block gets ``block + alpha / rank * a[rows] @ b[:, cols]``
    (its slices of Keras's ``a @ b``), so no process computes the whole
    update. After, the blocks get their values back exactly (copies, not a
    subtraction) and LoRA is on again. A layer whose weight no layout splits
    is left as it is: Keras merges it.
    """
    import keras
    import tensorflow as tf

    from tfdist.parallel import sharding

    found = next(
        (
            (getattr(layer, a), getattr(layer, b))
            for a, b in _ADAPTERS
            if getattr(layer, a, None) is not None
        ),
        None,
    )
    a, b = (None, None) if found is None else (tf.convert_to_tensor(v.value) for v in found)
    full = None if a is None else tuple(a.shape[:-1]) + tuple(b.shape[1:])
    base = next(
        (
            v
            for v in layer.weights
            if (spec := sharding.spec_of(v)) is not None and spec.full_shape == full
        ),
        None,
    )
    if base is None:
        yield
        return
    spec = sharding.spec_of(base)
    scale = getattr(layer, "lora_alpha", layer.lora_rank) / layer.lora_rank
    components = list(spec.strategy.experimental_local_results(sharding.inner_variable(base)))
    kept = [tf.identity(c.read_value()) for c in components]
    for i, (component, block) in enumerate(zip(components, kept)):
        where = spec.slices(spec.index(spec.runtime.first + i))
        rows, cols = where[:-1] + (slice(None),), (slice(None), where[-1])
        with tf.device(component.device):
            update = keras.ops.matmul(a[rows], b[cols])  # Keras's a @ b, on slices.
            component.assign(block + tf.cast(scale * update, block.dtype))
    layer.lora_enabled = False
    try:
        yield
    finally:
        layer.lora_enabled = True
        for component, block in zip(components, kept):
            component.assign(block)
