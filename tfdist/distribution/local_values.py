"""Weights a file overwrites next, created without worker 0's broadcast.

MultiWorkerMirrored gives a variable worker 0's initial value: TensorFlow
computes it on every worker, then worker 0 sends it to the others over gRPC
(``CollectiveAllReduceExtended._get_variable_creator_initial_value``). For a
laid-out weight that ``from_preset`` or ``load_weights`` overwrites next,
each block is zeros on every worker, so the broadcast only costs memory:
its send and receive buffers made a 4-process load of a keras-hub preset
peak at 0.86x the whole model's size per process (issue 38).

Inside :func:`created_locally` the strategy's extended object is, for the
moment, a subclass whose method takes each worker's own value (the registry's
dynamic ``layouts.local_initial_values``). Outside it, and on any other
strategy, TensorFlow's behaviour is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

__all__ = ["created_locally", "wrap_initial_value"]

_PATCH = "layouts.local_initial_values"
_METHOD = "_get_variable_creator_initial_value"


@contextlib.contextmanager
def created_locally(strategy: Any) -> Iterator[None]:
    """Variables created inside take this worker's own initial value.

    Only for values every worker computes alike, or that are overwritten
    before they are read (a weights file loaded next): the workers'
    variables are not made equal. Nests; a no-op for any strategy but
    MultiWorkerMirrored, and where the patch does not fit this TensorFlow
    (the variables are then broadcast, as without it).
    """
    extended = getattr(strategy, "extended", None)
    if getattr(strategy, "kind", "") != "multi_worker_mirrored" or extended is None:
        yield
        return
    base = type(extended)
    local = _local_class(base)
    if local is None or base is local:
        yield
        return
    extended.__class__ = local
    try:
        yield
    finally:
        extended.__class__ = base


@functools.cache
def _local_class(base: type) -> type | None:
    """``base`` with the patch applied, or None where it does not fit."""
    from tfdist import compat

    if base.__module__ == __name__:  # Made here already.
        return base
    local = type(f"Local{base.__name__}", (base,), {"__module__": __name__})
    return local if compat.apply_to(_PATCH, local, _METHOD) else None


def wrap_initial_value(original):
    """The first replica of each worker computes its own value, without the
    broadcast; the other replicas copy it as TensorFlow's replicas do."""

    @functools.wraps(original)
    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        if replica_id != 0:
            return original(self, replica_id, device, primary_var, **kwargs)
        from tfdist.compat.tf_python import trackable_base

        def initial_value_fn():
            with tf.device(device):
                value = kwargs["initial_value"]
                if callable(value):
                    value = value()
                if isinstance(value, trackable_base.CheckpointInitialValue):
                    value = value.wrapped_value
                return tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))

        return initial_value_fn

    return _get_variable_creator_initial_value
