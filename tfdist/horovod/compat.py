"""Horovod-era Keras spellings, accepted in Keras 3 while tfdist.horovod is imported.

Horovod's examples and most scripts written for it were written for Keras 2 and
use spellings that Keras 3 rejects, for reasons that have nothing to do with
distribution:

* ``model.compile(..., experimental_run_tf_function=False)``: Keras 3 raises
  ``TypeError: Trainer.compile() got an unexpected keyword argument
  'experimental_run_tf_function'``. Keras 3 always trains through the
  optimizer's ``apply``, which is where ``DistributedOptimizer`` all-reduces,
  so the argument is dropped.
* ``opt.variables()``: in Keras 3 ``variables`` is a list property, so the call
  fails with ``TypeError: 'list' object is not callable``. The property now
  returns a list that can also be called (returning a plain list).
* ``opt.lr`` (read and assign): Keras 3 raises ``AttributeError: 'Adam' object
  has no attribute 'lr'``. ``lr`` becomes an alias of ``learning_rate``.
* ``tf.keras.backend.set_value(opt.lr, value)`` (Horovod's Keras elastic
  example): Keras 3's legacy ``set_value`` reads ``x.dtype.name``, but a Keras 3
  variable's dtype is a string, so it raises ``AttributeError: 'str' object has
  no attribute 'name'``. ``set_value`` and ``batch_set_value`` accept both.

:func:`install` patches Keras's classes once per process. Each spelling warns
once per process (a :class:`HorovodSpellingWarning`) saying what to write
instead. Everything Keras itself does is unchanged: ``compile`` with any other
unknown argument still raises Keras's own ``TypeError``, and ``opt.variables``
is still a ``list`` (``len``, iteration, indexing, ``+``, ``keras.tree`` and
``tf.nest`` all treat it as one).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

__all__ = [
    "HorovodSpellingWarning",
    "install",
    "is_installed",
    "wrap_compile",
    "wrap_variables",
    "wrap_init_subclass",
    "wrap_lr",
    "wrap_set_value",
    "wrap_batch_set_value",
]

#: The Keras 2 ``compile`` argument that Keras 3 dropped.
RUN_TF_FUNCTION_ARG = "experimental_run_tf_function"

#: Frames in these directories are wrappers, not the script: all of tfdist
#: (its other wrappers of compile and fit, e.g. tfdist.parallel's guard);
#: Keras's and TensorFlow's are added by install().
_SKIP_DIRS: tuple[str, ...] = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)

_lock = threading.Lock()
_installed = False
_warned: set[str] = set()

_ADVICE = {
    "compile": (
        "model.compile(experimental_run_tf_function=...) is a Keras 2 argument that "
        "Keras 3 rejects; tfdist.horovod drops it (Keras 3 always calls the optimizer's "
        "apply, where DistributedOptimizer all-reduces). Remove the argument."
    ),
    "variables()": (
        "optimizer.variables() is Keras 2; in Keras 3 `variables` is a list property. "
        "tfdist.horovod accepts the call; write `optimizer.variables`."
    ),
    "set_value": (
        "tf.keras.backend.set_value() fails on Keras 3 variables; tfdist.horovod "
        "assigns the value. Write `variable.assign(value)`."
    ),
    "lr": (
        "optimizer.lr is Keras 2; Keras 3 calls it `learning_rate`. tfdist.horovod "
        "treats `lr` as `learning_rate`; write `optimizer.learning_rate`."
    ),
}


class HorovodSpellingWarning(UserWarning):
    """A Keras 2 spelling from a Horovod-era script was accepted in Keras 3."""


def _warn_once(spelling: str) -> None:
    """Warns about ``spelling`` the first time this process uses it.

    The warning names the first line outside tfdist and Keras: the script's
    own line, however many wrappers lie in between.
    """
    with _lock:
        if spelling in _warned:
            return
        _warned.add(spelling)
    # Our caller's frame: inspect.stack() would read every frame's source.
    level, frame = 2, inspect.currentframe().f_back
    while frame is not None and _is_wrapper(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(_ADVICE[spelling], HorovodSpellingWarning, stacklevel=level)


def _is_wrapper(filename: str) -> bool:
    # Inside a tf.function, autograph runs converted copies from temporary
    # files; the script's line that called the tf.function is the useful one.
    return filename.startswith(_SKIP_DIRS) or "__autograph_generated_file" in filename


class _CallableVariables(list):
    """A list of optimizer variables that can also be called, as in Keras 2."""

    __slots__ = ()

    def __call__(self) -> list:
        _warn_once("variables()")
        return list(self)

    # keras.tree (optree) treats an unregistered list subclass as one leaf;
    # registered, it flattens like the list it is.
    def tree_flatten(self):
        return list(self), None, None

    @classmethod
    def tree_unflatten(cls, metadata, children):
        return list(children)


def wrap_compile(original: Callable) -> Callable:
    """``Trainer.compile`` that drops ``experimental_run_tf_function``."""

    @functools.wraps(original)
    def compile(self, *args, **kwargs):  # noqa: A001 - Keras's own name
        if RUN_TF_FUNCTION_ARG in kwargs:
            kwargs.pop(RUN_TF_FUNCTION_ARG)
            _warn_once("compile")
        return original(self, *args, **kwargs)

    return compile


def wrap_variables(prop: property) -> property:
    """Wraps a ``variables`` property so that its list is also callable."""
    getter: Callable[[Any], Any] = prop.fget

    @functools.wraps(getter)
    def variables(self):
        value = getter(self)
        if isinstance(value, list) and not isinstance(value, _CallableVariables):
            value = _CallableVariables(value)
        return value

    return property(variables, prop.fset, prop.fdel, prop.__doc__)


def _patch_variables(cls: type) -> None:
    """Wraps ``cls.variables`` if ``cls`` itself defines it as a property."""
    from tfdist import compat

    if isinstance(cls.__dict__.get("variables"), property):
        compat.apply_to("horovod_spellings.variables", cls, "variables")


def _all_subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


def wrap_init_subclass(original: Any) -> classmethod:
    """``BaseOptimizer.__init_subclass__`` that also patches each new class.

    Keras's LossScaleOptimizer and MultiOptimizer override ``variables``; a
    subclass made later (tfdist's DistributedOptimizer, a user's optimizer)
    may too.
    """

    def __init_subclass__(cls, **kwargs):
        original.__get__(None, cls)(**kwargs)
        _patch_variables(cls)

    return classmethod(__init_subclass__)


def wrap_lr(_absent: Any) -> property:
    """The ``lr`` property Keras 3 does not have."""

    def lr(self):
        _warn_once("lr")
        return self.learning_rate

    def set_lr(self, value):
        _warn_once("lr")
        self.learning_rate = value

    return property(lr, set_lr, doc="Keras 2 name of `learning_rate` (Horovod-era scripts).")


def _assign(variable, value) -> None:
    """Assigns ``value`` to a TF or Keras 3 variable (dtype object or string)."""
    import numpy as np

    dtype = variable.dtype
    if isinstance(dtype, str):
        _warn_once("set_value")
    variable.assign(np.asarray(value, dtype=getattr(dtype, "name", dtype)))


def _set_value(x, value) -> None:
    """Keras's legacy ``set_value``, also for Keras 3 variables."""
    _assign(x, value)


def _batch_set_value(tuples) -> None:
    """Keras's legacy ``batch_set_value``, also for Keras 3 variables."""
    import tensorflow as tf

    if tf.executing_eagerly() or tf.inside_function():
        for x, value in tuples:
            _assign(x, value)


def wrap_set_value(_original: Callable) -> Callable:
    return _set_value


def wrap_batch_set_value(_original: Callable) -> Callable:
    return _batch_set_value


def _patch_legacy_backend() -> None:
    """Replaces ``set_value``/``batch_set_value`` where Keras exports them."""
    from tfdist import compat
    from tfdist.compat import keras_src

    legacy = keras_src.legacy_backend
    modules = [legacy]
    if "tf_keras_backend" not in keras_src.unresolved():  # tf.keras.backend, TF >= 2.16
        modules.append(keras_src.tf_keras_backend)
    for name in ("set_value", "batch_set_value"):
        if name not in legacy.__dict__:
            continue
        original = compat.pristine(legacy, name)
        for module in modules:
            if module is legacy or module.__dict__.get(name) is original:
                compat.apply_to(f"horovod_spellings.{name}", module, name)


def _register_tree_node() -> None:
    from tfdist.compat.keras_src import tree_api

    try:
        tree_api.register_tree_node_class(_CallableVariables)
    except ValueError:  # optree: already registered (a reloaded module).
        pass


def install() -> None:
    """Accepts the Horovod-era Keras spellings in this process (the registry's
    ``horovod_spellings``); idempotent.

    Imports Keras (and so TensorFlow), but does not start the TF runtime.
    """
    global _installed, _SKIP_DIRS
    with _lock:
        if _installed:
            return
        import keras
        import tensorflow as tf

        from tfdist import compat
        from tfdist.compat.keras_src import BaseOptimizer

        _SKIP_DIRS += tuple(
            os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (keras, tf)
        )
        # Not converted by autograph inside a tf.function (Horovod's examples
        # call opt.variables() there): plain Python, run once at trace time.
        _CallableVariables.__call__ = tf.autograph.experimental.do_not_convert(
            _CallableVariables.__call__
        )
        if not compat.install("horovod_spellings"):
            return  # Switched off, with a warning naming the target.
        _register_tree_node()
        for cls in [BaseOptimizer, *_all_subclasses(BaseOptimizer)]:
            _patch_variables(cls)
        if not any("lr" in vars(cls) for cls in BaseOptimizer.__mro__):
            compat.apply_to("horovod_spellings.lr", BaseOptimizer, "lr")
        _patch_legacy_backend()
        _installed = True


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed
