"""Keras's ``gradient_accumulation_steps`` under Mirrored and MultiWorkerMirrored.

A Keras 3 optimizer created with ``gradient_accumulation_steps=k`` adds each
step's gradients to per-replica accumulators and, every k-th step, applies
their mean: the same update as one step on a k times larger batch. Keras
3.15 decides between the two with an ``ops.cond`` in replica context whose
applying branch all-reduces the gradients and updates the variables through
``merge_call``. Under TensorFlow's MirroredStrategy that fails while tracing
(keras-team/keras#20582: "`merge_call` called while defining a new graph or
a tf.function"; the fix, keras PR #23592, is not released), in ``fit`` and
in custom loops alike.

:func:`install` gives Keras's optimizer module a ``cond`` that, in the
replica context of a tfdist Mirrored or MultiWorkerMirrored strategy,
branches the way Keras's own LossScaleOptimizer does: from cross-replica
context (one ``merge_call``), running the chosen branch on every replica.
All replicas take the same branch (it depends on the step count only).
Everything else is Keras's own code: the accumulators stay per replica (each
adds its own gradients), and the gradients are all-reduced, or compressed
and sent by tfdist's aggregator, only in the applying branch, once every k
steps. MultiWorkerMirrored on CPUs all-reduces through ``merge_call`` too
and fails the same way without this; a strategy that runs without
``merge_call`` (XLA on GPUs) keeps Keras's plain ``cond``.

Anywhere else (other strategies, cross-replica context, a Keras whose
TensorFlow optimizer handles accumulation under distribution itself) Keras's
``ops.cond`` runs unchanged.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfdist.compat.keras_src import TFOptimizer
from tfdist.compression.applied import applies_this_step  # Re-exported.
from tfdist.training.loops import in_tfdist_replica_context

__all__ = [
    "install",
    "keras_has_accumulation_fix",
    "replica_cond",
    "applies_this_step",
    "wrap_ops",
    "wrap_backend",
]
#: TFOptimizer methods of Keras 3.15 about accumulation; a Keras that adds
#: others there (keras PR #23592 overrides the applying branch for
#: tf.distribute) handles accumulation under distribution itself.
_KNOWN_ACCUMULATION_METHODS = frozenset({"_backend_increment_gradient_accumulators"})


def keras_has_accumulation_fix() -> bool:
    """Whether this Keras's TensorFlow optimizer overrides more of gradient
    accumulation than Keras 3.15 does (a sign of keras PR #23592)."""
    return any(
        "accumulat" in name and name not in _KNOWN_ACCUMULATION_METHODS
        for name in vars(TFOptimizer)
    )


def replica_cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> None:
    """``tf.cond`` in replica context whose branches may call ``merge_call``.

    ``pred`` must be the same on every replica. Branches return nothing
    (Keras's accumulation branches only update variables).
    """
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        tf.cond(pred, true_fn, false_fn)
        return

    def merged(distribution, pred, true_fns, false_fns):
        # Each replica passed its own closures (over its own gradients):
        # call_for_each_replica hands every replica its own again.
        pred = distribution.experimental_local_results(pred)[0]
        run = distribution.extended.call_for_each_replica

        def branch(fns):
            return lambda: run(lambda fn: fn(), args=(fns,))

        tf.cond(pred, branch(true_fns), branch(false_fns))

    tf.distribute.get_replica_context().merge_call(merged, args=(pred, true_fn, false_fn))


class _OptimizerOps(types.ModuleType):
    """``keras.src.ops`` as Keras's optimizer module sees it, but with a
    ``cond`` that works in the replica context of tfdist's strategies."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def cond(self, pred, true_fn, false_fn):
        if not in_tfdist_replica_context():
            return self._real.cond(pred, true_fn, false_fn)
        return replica_cond(pred, true_fn, false_fn)


def install() -> None:
    """Gives Keras's optimizer module the distribution-aware ``cond``, once.

    Does nothing when this Keras handles accumulation under distribution
    itself (:func:`keras_has_accumulation_fix`).

    Raises:
        tfdist.compat.PatchError: Keras's optimizer module has no ``ops``
            with a ``cond`` to wrap.
    """
    from tfdist import compat

    if keras_has_accumulation_fix():
        return
    compat.install("accumulation")


def wrap_ops(original: types.ModuleType) -> types.ModuleType:
    """Keras's optimizer ``ops`` (Keras < 3.16) with the distribution-aware ``cond``.

    Raises:
        tfdist.compat.PatchError: ``ops`` has no ``cond``.
    """
    _check_cond(original)
    return _OptimizerOps(original)


class _OptimizerBackend(types.ModuleType):
    """``keras.src.backend`` as Keras's optimizer module sees it (Keras >= 3.16,
    which calls ``backend.ops.cond``), with :class:`_OptimizerOps` as ``ops``."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        self.ops = _OptimizerOps(real.ops)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def wrap_backend(original: types.ModuleType) -> types.ModuleType:
    """Keras's optimizer ``backend`` (Keras >= 3.16) whose ``ops.cond`` is
    distribution-aware; everything else is Keras's own.

    Raises:
        tfdist.compat.PatchError: ``backend.ops`` has no ``cond``.
    """
    _check_cond(getattr(original, "ops", None))
    return _OptimizerBackend(original)


def _check_cond(ops: Any) -> None:
    if not callable(getattr(ops, "cond", None)):
        from tfdist import compat

        raise compat.PatchError(
            "tfdist's gradient accumulation wraps Keras's ops.cond, which the ops module "
            f"Keras's optimizer uses ({ops!r}) does not have"
        )
