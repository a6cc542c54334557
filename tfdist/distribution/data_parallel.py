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
reuses it, so models built under it keep training on it. A mesh over every
process's devices, after ``keras.distribution.initialize()``, trains on the
job's MultiWorkerMirrored strategy (:mod:`~tfdist.distribution.cluster`).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribution import layouts, model_parallel
from tfdist.distribution.kept import (
    is_mapped,
    keep_options,
    kept,
    making,
    mark,
    options_of,
    strategy_of,
)
from tfdist.errors import ConfigError

__all__ = [
    "DataParallel",
    "honours",
    "is_mapped",
    "making",
    "mark",
    "release",
    "strategy_for",
    "strategy_of",
    "use",
]

#: The strategy made current by :func:`use`, if it still is.
_current: list[Any] = []


class DataParallel(keras.distribution.DataParallel):
    """Keras's ``DataParallel``, with tfdist's gradient compression.

    Args:
        device_mesh: A 1-D ``keras.distribution.DeviceMesh``, as Keras's.
        devices: Device names instead of a mesh, e.g. ``["cpu:0", "cpu:1"]``.
        auto_shard_dataset: As Keras's.
        compression: Any ``compression=`` of ``tfdist.strategy_from_config``,
            e.g. ``"powersgd:4"``. Across processes the job's strategy is
            :func:`tfdist.distribution.initialize`'s: give it there (here
            it may only repeat it).
        error_feedback: As ``tfdist.strategy_from_config``'s.
    """

    def __init__(
        self,
        device_mesh=None,
        devices=None,
        auto_shard_dataset=True,
        *,
        compression: Any = None,
        error_feedback: bool | None = None,
    ) -> None:
        super().__init__(
            device_mesh=device_mesh, devices=devices, auto_shard_dataset=auto_shard_dataset
        )
        keep_options(self, compression, error_feedback)


def honours(distribution: Any) -> bool:
    """Whether tfdist can train as ``distribution`` says on TensorFlow."""
    return isinstance(distribution, keras.distribution.DataParallel) or model_parallel.honours(
        distribution
    )


def _device(name: Any) -> str:
    """Keras's device names ("cpu:0") as TensorFlow's ("/cpu:0")."""
    text = str(name)
    return text if text.startswith("/") else "/" + text


def strategy_for(distribution: Any, local: bool = False) -> Any:
    """The tfdist strategy that trains as ``distribution`` says (made once).

    Args:
        local: The mesh is this process's alone, whatever job it is part of
            (a pipeline stage's): the job's TF_CONFIG or Slurm step is not
            read, and devices of other processes are refused.

    Raises:
        ConfigError: The mesh names devices this process lacks, or devices
            of other processes before ``keras.distribution.initialize()``,
            not all of them, or with ``local``.
    """
    strategy = strategy_of(distribution)
    if strategy is not None:
        return strategy
    from tfdist.strategies import strategy_from_config

    if model_parallel.honours(distribution):
        strategy = model_parallel.strategy_for(distribution, _local_devices, local)
        layouts.install()
        mark(strategy)
        kept(distribution).strategy = strategy
        return strategy
    devices = [_device(d) for d in np.asarray(distribution.device_mesh.devices).ravel()]
    if any("/job:" in d or "/task:" in d for d in devices):
        if local:
            raise model_parallel.local_mesh_error(devices)
        return _cluster_strategy_for(distribution, devices)
    devices = _local_devices(devices)
    options = options_of(distribution)
    with making():
        strategy = strategy_from_config(
            {} if local else None, strategy="mirrored", devices=devices, **options
        )
    mark(strategy)
    kept(distribution).strategy = strategy
    return strategy


def _local_devices(names: list) -> list[str]:
    """TensorFlow's names of mesh devices ("cpu:0" -> "/cpu:0").

    Raises:
        ConfigError: A device does not exist in this process.
    """
    devices = [_device(d) for d in names]

    def kind_and_index(name: str) -> tuple[str, int]:
        spec = tf.DeviceSpec.from_string(name)
        return spec.device_type.upper(), spec.device_index

    local = {kind_and_index(d.name) for d in tf.config.list_logical_devices()}
    missing = [d for d in devices if kind_and_index(d) not in local]
    if missing:
        raise ConfigError(
            "device_mesh",
            devices,
            "devices that exist in this process",
            source="keras.distribution",
            hint=f"{', '.join(missing)} not found; keras.distribution.list_devices() names them",
        )
    return devices


def _cluster_strategy_for(distribution: Any, devices: list[str]) -> Any:
    """The job's strategy, for a mesh over every process's devices."""
    from tfdist.distribution import cluster

    strategy = cluster.cluster_strategy()
    if strategy is None:
        raise ConfigError(
            "device_mesh",
            devices,
            "devices of this process, or keras.distribution.initialize() first",
            source="keras.distribution",
            hint="The mesh names devices of other processes: call "
            "keras.distribution.initialize() (from TF_CONFIG, or job_addresses, "
            "num_processes and process_id) before building it",
        )
    every = cluster.global_devices()
    if sorted(d.lower() for d in devices) != sorted(d.lower() for d in every):
        raise ConfigError(
            "device_mesh",
            devices,
            f"every device of the job, once: {every}",
            source="keras.distribution",
            hint="Data parallelism across processes runs on all of them; "
            "keras.distribution.list_devices() names them",
        )
    cluster.check_options(options_of(distribution), "tfdist.distribution.DataParallel")
    kept(distribution).strategy = strategy
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
