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
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

__all__ = ["full_shapes", "reporting_full_shapes", "wrap"]

_local = threading.local()
_ATTR = "_tfdist_lora_shapes"


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
    if original is None or getattr(layer, _ATTR, False):
        return

    @functools.wraps(original)
    def enable_lora(*args, **kwargs):
        with reporting_full_shapes():
            return original(*args, **kwargs)

    # An instance attribute, as regather.wrap sets `call`: keras-hub's
    # backbone.enable_lora calls layer.enable_lora on each target.
    object.__setattr__(layer, "enable_lora", enable_lora)
    object.__setattr__(layer, _ATTR, True)
