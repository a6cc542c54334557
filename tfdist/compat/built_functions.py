"""Wrappers for the train, test and predict functions Keras builds.

Keras's TensorFlow trainer builds them in ``_make_function`` (train, test)
and ``make_predict_function`` (which stores the function and returns
nothing on Keras 3.15). Features that act on every call of those functions
(tfdist.training.on_batch splits a plain batch, tfdist.parallel.batches
names an uneven one) take their two wrappers from :func:`around_built_functions`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["around_built_functions"]


def around_built_functions(
    wrap: Callable[[Any, Callable], Callable], applies: Callable[[Any], bool] = lambda model: True
):
    """The ``_make_function`` and ``make_predict_function`` wrappers that pass
    each function Keras builds through ``wrap(model, function)`` when
    ``applies(model)``.

    Returns:
        ``(wrap_make_function, wrap_make_predict_function)``, for the registry.
    """

    def wrap_make_function(original):
        @functools.wraps(original)
        def _make_function(self, step_function):
            function = original(self, step_function)
            return wrap(self, function) if applies(self) else function

        return _make_function

    def wrap_make_predict_function(original):
        @functools.wraps(original)
        def make_predict_function(self, force=False):
            before = self.predict_function
            result = original(self, force)
            if (
                applies(self)
                and self.predict_function is not None
                and self.predict_function is not before
            ):
                self.predict_function = wrap(self, self.predict_function)
            return result

        return make_predict_function

    return wrap_make_function, wrap_make_predict_function
