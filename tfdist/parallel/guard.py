"""A guard against ``keras.distribution`` beside a tfdist strategy.

On the TensorFlow backend ``keras.distribution`` is a prototype: Keras's
``keras/src/backend/tensorflow/distribution_lib.py`` opens with "!!!DO NOT
USE!!! ... just a prototype", and the layouts of ``ModelParallel`` and
``DataParallel`` are never applied. Measured on TF 2.21 / Keras 3.15.1 with
2 logical CPUs: after ``set_distribution(ModelParallel(layout_map=...))``
with the Dense kernels laid out ``(None, "model")`` on a (1, 2) mesh,
building, compiling and fitting a 8-16-4 MLP gave every weight (kernel
``(8, 16)``, bias ``(16,)``, ...) and every Adam slot as an ordinary
full-shape ``ResourceVariable`` on ``CPU:0``, with no DTensor layout, and
Keras said nothing: the model trained unsharded.

Used together with a tfdist strategy that is worse than useless, so this
module makes it an error (:class:`KerasDistributionError`) in each order:

* ``keras.distribution.set_distribution(d)`` (or ``with d.scope():``) while a
  tfdist strategy of this process is alive: Keras's ``set_distribution`` is
  wrapped once, by :func:`install`;
* a tfdist strategy created while a Keras distribution is set
  (:func:`check_no_distribution`, from the strategy's constructor);
* ``model.compile`` or ``model.fit`` under a tfdist strategy with a Keras
  distribution set: this covers a ``set_distribution`` imported by name
  before the wrapper was installed, and the global state set directly.

``set_distribution(None)`` (what a ``scope()`` restores) always passes.
"""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from typing import Any

from tfdist.errors import TfdistError

__all__ = ["KerasDistributionError", "install", "check_no_distribution",
           "register_strategy", "wrap_set_distribution", "wrap_entry"]

#: The tfdist strategies of this process that are alive, with the order they
#: were made in (the error names the newest: an older one may wait for the
#: garbage collector).
_strategies: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_made = itertools.count()


class KerasDistributionError(TfdistError, RuntimeError):
    """A ``keras.distribution`` setting beside a tfdist strategy.

    On the TensorFlow backend it would train unsharded, silently.
    """


def _on_tensorflow() -> bool:
    import keras
    return keras.backend.backend() == "tensorflow"


def _error(distribution: Any, when: str) -> KerasDistributionError:
    name = type(distribution).__name__
    return KerasDistributionError(
        f"keras.distribution.{name} {when}. Received: {distribution!r}. On the "
        "TensorFlow backend keras.distribution does nothing: Keras's tensorflow "
        "distribution_lib is a prototype ('DO NOT USE'), the layouts are ignored "
        "and every weight stays whole on one device, so the model would train "
        "unsharded without a word. Call keras.distribution.set_distribution(None) "
        "and use tfdist instead: tfdist.strategy_from_config(model_parallel=T) "
        "with the layers of tfdist.parallel (ColumnParallelDense, RowParallelDense, "
        "...) for tensor parallelism; tfdist.strategy_from_config() alone for data "
        "parallelism.")


def _current_distribution() -> Any:
    from tfdist.compat.keras_src import distribution_lib
    return distribution_lib.distribution()


def check_no_distribution(kind: str = "tfdist") -> None:
    """Raises if a Keras distribution is set (TensorFlow backend only).

    Args:
        kind: The strategy about to be built, for the message.

    Raises:
        KerasDistributionError: ``keras.distribution.distribution()`` is set.
    """
    current = _current_distribution()
    if current is not None and _on_tensorflow():
        raise _error(current, f"is set while a tfdist {kind} strategy is created")


def register_strategy(strategy: Any) -> None:
    """Records a live tfdist strategy, so that ``set_distribution`` refuses."""
    _strategies[strategy] = next(_made)


def wrap_set_distribution(original):
    @functools.wraps(original)
    def set_distribution(value):
        if value is not None and _on_tensorflow():
            alive = sorted(_strategies.items(), key=lambda item: item[1])
            if alive:
                newest = type(alive[-1][0]).__name__
                others = f", and {len(alive) - 1} older" if len(alive) > 1 else ""
                raise _error(value, "was set while a tfdist strategy exists in this "
                             f"process ({newest}{others})")
        return original(value)
    return set_distribution


def _model_strategy(model: Any) -> Any:
    import tensorflow as tf
    from tfdist.strategies import TfdistStrategy
    for strategy in (getattr(model, "_distribute_strategy", None),
                     tf.distribute.get_strategy()):
        if isinstance(strategy, TfdistStrategy):
            return strategy
    return None


def wrap_entry(original):
    @functools.wraps(original)
    def entry(self, *args, **kwargs):
        strategy = _model_strategy(self)
        if strategy is not None:
            current = _current_distribution()
            if current is not None and _on_tensorflow():
                raise _error(current, f"is set while model.{original.__name__} runs "
                             f"under a tfdist strategy ({type(strategy).__name__})")
        return original(self, *args, **kwargs)
    return entry


def install() -> None:
    """Wraps Keras's ``set_distribution``, ``compile`` and ``fit`` once (the
    registry's ``distribution_guard``).

    ``set_distribution`` is replaced where Keras defines it (which
    ``Distribution.scope()`` calls) and in every module that re-exports it,
    such as ``keras.distribution``. Idempotent.

    Raises:
        tfdist.compat.PatchError: This Keras lacks a function the guard
            wraps, or its signature changed.
    """
    from tfdist import compat
    from tfdist.compat.keras_src import distribution_lib

    if not compat.install("distribution_guard"):
        return
    original = compat.pristine(distribution_lib, "set_distribution")
    # Every namespace that re-exports it (keras.distribution,
    # keras.src.distribution, tf_keras's); later imports copy the wrapped
    # one from distribution_lib.
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        if names.get("set_distribution") is original or (
                module is distribution_lib):
            if not compat.apply_to("distribution_guard.set_distribution", module):
                raise compat.PatchError(
                    f"tfdist's keras.distribution guard cannot wrap {module.__name__}."
                    "set_distribution: it no longer takes (value)")
