"""``keras.distribution`` on TensorFlow, after ``import tfdist``.

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

Keras's ``set_distribution``, ``initialize`` and ``list_devices`` are
wrapped (:func:`install`: when Keras is imported, or at ``import tfdist`` if
it already is, and when a strategy is made) so that on TensorFlow:

* ``DataParallel`` trains on tfdist's Mirrored strategy over the mesh's
  devices (:mod:`~tfdist.distribution.data_parallel`): models built and fit
  while it is set are replicated and their gradients all-reduced, as the
  distribution says;
* ``initialize()`` and ``list_devices()`` work across processes
  (:mod:`~tfdist.distribution.cluster`);
* ``ModelParallel`` honours its layout map
  (:mod:`~tfdist.distribution.model_parallel`);
* a distribution tfdist cannot honour (a ``Distribution`` other than those
  two) raises :class:`KerasDistributionError` instead of training
  unsharded;
* a distribution mixed with a tfdist strategy of the user's raises too, in
  each order: ``set_distribution`` inside the strategy's scope; a strategy
  created while a distribution is set (:func:`check_no_distribution`);
  ``model.compile`` or ``model.fit`` of a model under the strategy while a
  distribution is set (also one set through a ``set_distribution`` imported
  by name before the wrapper existed).

``set_distribution(None)`` (what a ``scope()`` restores) always passes.
"""

from __future__ import annotations

import functools
import gc
import itertools
import sys
import weakref
from typing import Any

from tfdist.errors import TfdistError

__all__ = [
    "KerasDistributionError",
    "install",
    "install_at_import",
    "check_no_distribution",
    "register_strategy",
    "wrap_set_distribution",
    "wrap_initialize",
    "wrap_list_devices",
    "wrap_entry",
    "new_num_processes",
    "new_process_id",
    "new_distribute_tensor",
]

#: The tfdist strategies of this process that are alive, with the order they
#: were made in (the error names the newest: an older one may wait for the
#: garbage collector).
_strategies: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_made = itertools.count()


class KerasDistributionError(TfdistError, RuntimeError):
    """A ``keras.distribution`` setting tfdist cannot honour on TensorFlow,
    or one beside a tfdist strategy.

    Keras alone would train unsharded, silently.
    """


def _on_tensorflow() -> bool:
    import keras

    return keras.backend.backend() == "tensorflow"


def _error(distribution: Any, when: str) -> KerasDistributionError:
    name = type(distribution).__name__
    return KerasDistributionError(
        f"keras.distribution.{name} {when}. Received: {distribution!r}. On the "
        "TensorFlow backend Keras does not apply keras.distribution layouts: its "
        "tensorflow distribution_lib is a prototype ('DO NOT USE'), and every weight "
        "stays whole on one device, so the model would train unsharded without a "
        "word. Call keras.distribution.set_distribution(None) and use tfdist "
        "instead: keras.distribution.ModelParallel alone (tfdist honours its layout "
        "map), or tfdist.strategy_from_config(model_parallel=T) with the layers of "
        "tfdist.parallel (ColumnParallelDense, RowParallelDense, ...), for model "
        "parallelism; keras.distribution.DataParallel alone, or "
        "tfdist.strategy_from_config(), for data parallelism."
    )


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
    from tfdist.distribution import data_parallel

    current = _current_distribution()
    if current is not None and _on_tensorflow() and not data_parallel.is_mapped(None):
        raise _error(current, f"is set while a tfdist {kind} strategy is created")


def register_strategy(strategy: Any) -> None:
    """Records a live tfdist strategy of the user's, so that
    ``set_distribution`` refuses (not one made for a ``DataParallel``)."""
    from tfdist.distribution import data_parallel

    if not data_parallel.is_mapped(strategy):
        _strategies[strategy] = next(_made)


def wrap_set_distribution(original):
    @functools.wraps(original)
    def set_distribution(value):
        import tensorflow as tf

        from tfdist.distribution import data_parallel

        if value is None or not _on_tensorflow():
            data_parallel.release()
            return original(value)
        current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        if current is not None and not data_parallel.is_mapped(current):
            raise _error(value, f"was set inside the scope of {type(current).__name__}")
        if not data_parallel.honours(value):
            raise _error(value, _refusal())
        # Made first, so that a bad mesh changes nothing. A DataParallel gets
        # its own strategy, beside any of the user's: a model under theirs
        # still refuses compile and fit (wrap_entry).
        strategy = data_parallel.strategy_for(value)
        data_parallel.release()
        result = original(value)
        data_parallel.use(strategy)
        return result

    return set_distribution


def wrap_initialize(original):
    @functools.wraps(original)
    def initialize(job_addresses=None, num_processes=None, process_id=None):
        if not _on_tensorflow():
            return original(job_addresses, num_processes, process_id)
        from tfdist.distribution import cluster

        cluster.initialize(*cluster.keras_defaults(job_addresses, num_processes, process_id))

    return initialize


def wrap_list_devices(original):
    @functools.wraps(original)
    def list_devices(device_type=None):
        if _on_tensorflow():
            from tfdist.distribution import cluster

            every = cluster.global_devices(device_type)
            if every is not None:
                return every
        return original(device_type)

    return list_devices


def new_num_processes(missing):
    """Keras < 3.15 on TensorFlow: the process count its Distribution asks for.

    1 also across processes: the job's strategy shards the data, and Keras
    must not shard it again (Keras 3.15 lacks it too and assumes 1).
    """
    del missing

    def num_processes() -> int:
        return 1

    return num_processes


def new_process_id(missing):
    """Keras < 3.15 on TensorFlow: this process's index, for the same (0)."""
    del missing

    def process_id() -> int:
        return 0

    return process_id


def new_distribute_tensor(missing):
    """``distribute_tensor`` for Keras's TensorFlow backend, which lacks it.

    Keras calls it for ``keras.distribution.distribute_tensor`` (keras-hub's
    ``CausalLM.generate`` does, for its prompts). Under tfdist the
    distribution's strategy places the data and each weight keeps its own
    layout, so the tensor is returned as it is, as JAX's returns a value
    whose layout is already the one asked for.
    """
    del missing

    def distribute_tensor(tensor, layout):
        del layout
        return tensor

    return distribute_tensor


def _refusal() -> str:
    """Why a distribution tfdist cannot honour is refused, naming a live
    tfdist strategy of the user's if there is one."""
    alive = sorted(_strategies.items(), key=lambda item: item[1])
    if alive:  # Only the ones really alive: unreachable ones wait in cycles.
        gc.collect()
        alive = sorted(_strategies.items(), key=lambda item: item[1])
    if not alive:
        return "is not one tfdist honours on TensorFlow (DataParallel and ModelParallel are)"
    newest = type(alive[-1][0]).__name__
    others = f", and {len(alive) - 1} older" if len(alive) > 1 else ""
    return f"was set while a tfdist strategy exists in this process ({newest}{others})"


def _model_strategy(model: Any) -> Any:
    import tensorflow as tf

    from tfdist.strategies import TfdistStrategy

    for strategy in (getattr(model, "_distribute_strategy", None), tf.distribute.get_strategy()):
        if isinstance(strategy, TfdistStrategy):
            return strategy
    return None


def wrap_entry(original):
    @functools.wraps(original)
    def entry(self, *args, **kwargs):
        from tfdist.distribution import data_parallel

        strategy = _model_strategy(self)
        if strategy is not None:
            current = _current_distribution()
            if (
                current is not None
                and _on_tensorflow()
                and data_parallel.strategy_of(current) is not strategy
            ):
                raise _error(
                    current,
                    f"is set while model.{original.__name__} runs "
                    f"under a tfdist strategy ({type(strategy).__name__})",
                )
        return original(self, *args, **kwargs)

    return entry


def install() -> None:
    """Wraps Keras's ``set_distribution``, ``initialize``, ``list_devices``,
    ``compile`` and ``fit`` once, and on Keras < 3.15 supplies the TensorFlow
    backend's ``num_processes`` and ``process_id``, and its missing
    ``distribute_tensor`` (the registry's ``distribution_guard``).

    The three public functions are replaced where Keras defines them (which
    ``Distribution.scope()`` calls) and in every module that re-exports them,
    such as ``keras.distribution``. Idempotent.

    Raises:
        tfdist.compat.PatchError: This Keras lacks a function the guard
            wraps, or its signature changed.
    """
    from tfdist import compat
    from tfdist.compat.keras_src import distribution_lib

    if not compat.install("distribution_guard"):
        return
    # Every namespace that re-exports them (keras.distribution,
    # keras.src.distribution, tf_keras's); later imports copy the wrapped
    # ones from distribution_lib.
    for name in ("set_distribution", "initialize", "list_devices"):
        original = compat.pristine(distribution_lib, name)
        for module in list(sys.modules.values()):
            names = getattr(module, "__dict__", {})
            if names.get(name) is original or module is distribution_lib:
                if not compat.apply_to(f"distribution_guard.{name}", module):
                    raise compat.PatchError(
                        f"tfdist's keras.distribution support cannot wrap "
                        f"{module.__name__}.{name}: its parameters changed"
                    )


def install_at_import(keras_module: Any = None) -> None:
    """:func:`install` once Keras is imported, on the TensorFlow backend only
    (``tfdist/__init__.py`` calls it when Keras finishes importing, or at
    once if Keras already had)."""
    del keras_module
    if _on_tensorflow():
        install()
