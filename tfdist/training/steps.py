"""``steps_per_execution`` > 1 under Mirrored and MultiWorkerMirrored (Keras 3).

Keras 3.15 runs several steps per call as a ``tf.while_loop`` whose body
calls the one-step ``tf.function`` inside a ``tf.cond``. Under a
tf.distribute strategy with replicas that graph fails at run time, both
under TensorFlow's MirroredStrategy on 2 logical CPUs and under
MultiWorkerMirroredStrategy::

    You must feed a value for placeholder tensor
    'while/body/_9/while/cond/then/_172/while/cond/Placeholder_1'

(keras-team/keras#19246, open). Tracing the one-step function inline into
the loop, instead of as a nested ``tf.function``, runs correctly: the same
steps, the same weights. :func:`install` does that for models compiled with
``steps_per_execution`` > 1 and without ``jit_compile`` under tfdist's
Mirrored and MultiWorkerMirrored strategies, and changes nothing else.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import tensorflow as tf

from tfdist import compat
from tfdist.compat.keras_src import tf_trainer_module as tf_trainer

__all__ = ["install", "needs_inline_step", "wrap_make_function"]

#: Keras's name for the one-step function ``_make_function`` wraps.
_STEP_NAME = "one_step_on_data"


def needs_inline_step(model: Any) -> bool:
    """Whether ``model``'s train/test function must trace its step inline."""
    from tfdist.strategies import TfdistStrategy

    strategy = getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
    return (
        isinstance(strategy, TfdistStrategy)
        and strategy.kind in ("mirrored", "multi_worker_mirrored")
        and (getattr(model, "steps_per_execution", 1) or 1) > 1
        and not getattr(model, "jit_compile", False)
        and not getattr(model, "run_eagerly", False)
    )


class _InlineStepTF:
    """``tf`` as the trainer module sees it while it builds its functions,
    except that ``tf.function`` leaves Keras's one-step function a plain
    Python function (traced inline into the multi-step loop)."""

    def __init__(self, real_tf: types.ModuleType) -> None:
        self._real = real_tf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def function(self, func=None, **kwargs):
        if func is not None and getattr(func, "__name__", "") == _STEP_NAME:
            return func
        return self._real.function(func, **kwargs)


def wrap_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        if not needs_inline_step(self):
            return original(self, step_function)
        real_tf = tf_trainer.tf
        tf_trainer.tf = _InlineStepTF(real_tf)
        try:
            return original(self, step_function)
        finally:
            tf_trainer.tf = real_tf

    return _make_function


def install() -> None:
    """Wraps ``TensorFlowTrainer._make_function`` once (the registry's
    ``inline_steps``); idempotent.

    Raises:
        tfdist.compat.PatchError: This Keras has no ``_make_function`` of
            the expected signature to wrap.
    """
    compat.install("inline_steps")
