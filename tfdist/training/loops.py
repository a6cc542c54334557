"""Custom training loops under tfdist's Mirrored and MultiWorkerMirrored.

A custom loop (``strategy.run(step)`` with ``optimizer.apply_gradients``,
no ``model.fit``) creates variables lazily, inside its first step: in
replica context, while the loop's ``tf.function`` traces. ``model.fit``
builds the model and the optimizer before its first step instead, eagerly
and in cross-replica context. Keras 3.15 under TensorFlow 2.21 fails on the
lazy creation with several replicas:

* Variables created inside the traced step (the optimizer's slots of Adam or
  SGD with momentum; the weights of a model without an ``Input``, such as
  the model of TensorFlow's custom_training tutorial) get their initializers
  lifted into a ``tf.cond`` that fails at run time with "You must feed a
  value for placeholder tensor 'cond/else/_1/cond/Placeholder'", under
  TensorFlow's own MirroredStrategy too (keras-team/keras#23085). Keras PR
  #23087, merged after 3.15, creates optimizer variables under
  ``tf.init_scope``; a model built inside the step still fails with it.
  :func:`install` creates every Keras variable made in the replica context
  of a tfdist strategy while a function traces under ``tf.init_scope``
  (eagerly, as the replicas' shared variable), which covers both; where Keras
  already enters ``init_scope`` the nested one changes nothing.
* tfdist's compression state (error-feedback residuals, PowerSGD's Q) is
  created in cross-replica context, and ``compression="auto"`` measures the
  link eagerly before it chooses: both failed in replica context ("Method
  requires being in cross-replica context"). Under a strategy that
  compresses, the first ``apply`` of an optimizer not built yet now builds
  it as ``fit`` does: once for all replicas (``merge_call``), eagerly
  (``tf.init_scope``), inside the strategy's scope.

The user's loop stays as it is; ``optimizer.build(model.trainable_variables)``
before the loop is no longer needed (and still works). Nothing changes in
cross-replica context or under other strategies.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from tfdist.compat.keras_src import backend
from tfdist.record import record_of

__all__ = [
    "install",
    "in_tfdist_replica_context",
    "needs_cross_replica_build",
    "wrap_initialize",
    "wrap_apply",
]


def in_tfdist_replica_context() -> bool:
    """Whether this runs in the replica context of tfdist's Mirrored or
    MultiWorkerMirrored strategy."""
    from tfdist.strategies import TfdistStrategy

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return False
    strategy = tf.distribute.get_strategy()
    return isinstance(strategy, TfdistStrategy) and strategy.kind in (
        "mirrored",
        "multi_worker_mirrored",
    )


def needs_cross_replica_build(optimizer: Any) -> bool:
    """Whether ``optimizer``'s first ``apply`` here must build it for all replicas:
    not built yet, created under the tfdist strategy whose replica context this
    is, and that strategy compresses."""
    if getattr(optimizer, "built", True) or hasattr(optimizer, "inner_optimizer"):
        return False
    if not in_tfdist_replica_context():
        return False
    strategy = tf.distribute.get_strategy()
    return (
        getattr(optimizer, "_distribution_strategy", None) is strategy
        and record_of(strategy).aggregator is not None
    )


def wrap_initialize(original):
    @functools.wraps(original)
    def _initialize(self, value):
        if tf.inside_function() and in_tfdist_replica_context():
            with tf.init_scope():
                return original(self, value)
        return original(self, value)

    return _initialize


def wrap_apply(original):
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None and needs_cross_replica_build(self):
            trainable_variables = list(trainable_variables)
            variables = trainable_variables

            def build(distribution):
                # Every replica waits here; this runs once, as fit's build.
                if self.built:
                    return
                with (
                    tf.init_scope(),
                    distribution.scope(),
                    backend.name_scope(self.name, caller=self),
                ):
                    self.build(variables)
                self.built = True

            tf.distribute.get_replica_context().merge_call(build)
        return original(self, grads, trainable_variables)

    return apply


def install() -> None:
    """Wraps Keras's TensorFlow ``Variable._initialize`` and
    ``BaseOptimizer.apply`` once; idempotent.

    Raises:
        tfdist.compat.PatchError: This Keras lacks one of the methods, or
            their signatures changed.
    """
    from tfdist import compat

    compat.install("loops")
