"""``keras.distribution.DataParallel`` on TensorFlow: tfdist's Mirrored strategy.

Keras on TensorFlow ignores a ``DataParallel`` distribution: the model
trains on one device. Set through ``keras.distribution.set_distribution``
(or ``DataParallel.scope()``) after ``import tfdist``, it makes a tfdist
Mirrored strategy over the mesh's devices the current strategy
(``tf.distribute.experimental_set_strategy``), so that a model built and fit
while it is set is replicated and its gradients all-reduced, with every fix
tfdist's Mirrored brings. ``set_distribution(None)`` (the end of the scope)
clears it. :class:`DataParallel` takes tfdist's compression too.

One strategy per distribution object: setting the same distribution again
reuses it, so models built under it keep training on it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["DataParallel", "honours", "is_mapped", "release", "strategy_for", "strategy_of",
           "use"]

#: Strategies made for a distribution: not the user's (the guard lets them be).
_mapped: "weakref.WeakSet[Any]" = weakref.WeakSet()
_local = threading.local()
#: The strategy made current by :func:`use`, if it still is.
_current: list[Any] = []


class DataParallel(keras.distribution.DataParallel):
    """Keras's ``DataParallel``, with tfdist's gradient compression.

    Args:
        device_mesh: A 1-D ``keras.distribution.DeviceMesh``, as Keras's.
        devices: Device names instead of a mesh, e.g. ``["cpu:0", "cpu:1"]``.
        auto_shard_dataset: As Keras's.
        compression: Any ``compression=`` of ``tfdist.strategy_from_config``,
            e.g. ``"powersgd:4"``.
        error_feedback: As ``tfdist.strategy_from_config``'s.
    """

    def __init__(self, device_mesh=None, devices=None, auto_shard_dataset=True, *,
                 compression: Any = None, error_feedback: bool | None = None) -> None:
        super().__init__(device_mesh=device_mesh, devices=devices,
                         auto_shard_dataset=auto_shard_dataset)
        self._tfdist_options = {"compression": compression, "error_feedback": error_feedback}


def honours(distribution: Any) -> bool:
    """Whether tfdist can train as ``distribution`` says on TensorFlow."""
    return isinstance(distribution, keras.distribution.DataParallel)


def is_mapped(strategy: Any) -> bool:
    """Whether ``strategy`` was made for a distribution (or is being made)."""
    return getattr(_local, "making", False) or strategy in _mapped


@contextlib.contextmanager
def _making():
    _local.making = True
    try:
        yield
    finally:
        _local.making = False


def _device(name: Any) -> str:
    """Keras's device names ("cpu:0") as TensorFlow's ("/cpu:0")."""
    text = str(name)
    return text if text.startswith("/") else "/" + text


def strategy_of(distribution: Any) -> Any:
    """The strategy made for ``distribution``, or None."""
    return getattr(distribution, "_tfdist_strategy", None)


def strategy_for(distribution: Any) -> Any:
    """The tfdist strategy that trains as ``distribution`` says (made once).

    Raises:
        ConfigError: The mesh names devices of other processes (several
            processes are not supported yet) or devices this process lacks.
    """
    strategy = strategy_of(distribution)
    if strategy is not None:
        return strategy
    from tfdist.strategies import strategy_from_config
    devices = [_device(d) for d in np.asarray(distribution.device_mesh.devices).ravel()]
    remote = [d for d in devices if "/job:" in d or "/task:" in d]
    if remote:
        raise ConfigError(
            "device_mesh", devices, "devices of this process", source="keras.distribution",
            hint="keras.distribution across several processes (initialize()) is not "
                 "supported by tfdist yet; run tfdist.strategy_from_config() in each "
                 "process for multi-worker data parallelism")
    local = {d.name.lower() for d in tf.config.list_logical_devices()}
    missing = [d for d in devices
               if not any(name.endswith(d.lower().replace("/", "").replace("device:", ""))
                          for name in local)]
    if missing:
        raise ConfigError(
            "device_mesh", devices, "devices that exist in this process",
            source="keras.distribution",
            hint=f"{', '.join(missing)} not found; keras.distribution.list_devices() "
                 "names them")
    options = dict(getattr(distribution, "_tfdist_options", {}))
    with _making():
        strategy = strategy_from_config(strategy="mirrored", devices=devices, **options)
    _mapped.add(strategy)
    distribution._tfdist_strategy = strategy
    return strategy


def use(strategy: Any) -> None:
    """Makes ``strategy`` the current strategy outside any scope."""
    tf.distribute.experimental_set_strategy(strategy)
    _current[:] = [strategy]


def release() -> None:
    """Clears the strategy :func:`use` set, if it is still the current one."""
    if _current and tf.distribute.get_strategy() is _current[0]:
        tf.distribute.experimental_set_strategy(None)
    _current.clear()
