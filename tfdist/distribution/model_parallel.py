"""``keras.distribution.ModelParallel`` on TensorFlow: layouts honoured.

Set through ``keras.distribution.set_distribution`` (or entered with
``.scope()``) after ``import tfdist``, a ``ModelParallel`` trains on a tfdist
Mirrored strategy over its mesh's devices whose replicas form tfdist's
(data, tensor) mesh (:mod:`tfdist.parallel.mesh`): the mesh's batch axis is
the data-parallel axis, its other axis the tensor-parallel one. The devices
are ordered batch-major, so replica ``r`` sits at mesh coordinates
``divmod(r, T)`` whatever order the mesh names its axes in.

Every weight created while it is set takes its layout from the layout map
(:mod:`~tfdist.distribution.layouts`): split over the named axes, each
device holding its block of the weight and of the optimizer's slots.
Keras splits each batch over all replicas, as with ``DataParallel``; the
losses and weights are those of the unsharded model on the same global
batches.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.distribution.kept import keep_options, making, options_of, strategy_of
from tfdist.errors import ConfigError
from tfdist.record import record_of

__all__ = ["ModelParallel", "honours", "strategy_for", "current", "ordered_devices"]

_SOURCE = "keras.distribution.ModelParallel"


class ModelParallel(keras.distribution.ModelParallel):
    """Keras's ``ModelParallel``, with tfdist's gradient compression.

    Args:
        layout_map: As Keras's.
        batch_dim_name: As Keras's.
        compression: A ``compression=`` of ``tfdist.strategy_from_config``.
            Replicated weights and weights split over the model axis alone
            take any; a weight split over the batch axis has its gradient
            reduce-scattered, and takes only ``"fp16"`` or ``"bf16"`` (any
            other raises ConfigError naming the weight when it is created).
            Across processes the job's strategy is
            :func:`tfdist.distribution.initialize`'s: give it there (here
            it may only repeat it).
        error_feedback: As ``tfdist.strategy_from_config``'s.
        **kwargs: Keras's other arguments (``auto_shard_dataset``).
    """

    def __init__(
        self,
        *,
        layout_map=None,
        batch_dim_name=None,
        compression: Any = None,
        error_feedback: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name, **kwargs)
        keep_options(self, compression, error_feedback)


def honours(distribution: Any) -> bool:
    return isinstance(distribution, keras.distribution.ModelParallel)


def mesh_axes(distribution: Any) -> tuple[str, str | None]:
    """The (batch, model) axis names of a ModelParallel's 1-D or 2-D mesh."""
    mesh = distribution.device_mesh
    names = list(mesh.axis_names)
    batch = distribution.batch_dim_name
    others = [n for n in names if n != batch]
    return batch, (others[0] if others else None)


def ordered_devices(distribution: Any) -> tuple[list[str], int]:
    """The mesh's devices batch-major, and T (the model axis's size).

    Raises:
        ConfigError: The mesh has more than two axes, or its batch axis is
            not one of them.
    """
    mesh = distribution.device_mesh
    names = list(mesh.axis_names)
    devices = np.asarray(mesh.devices)
    if devices.ndim > 2:
        raise ConfigError(
            "device_mesh",
            f"shape {tuple(mesh.shape)}, axes {names}",
            "a 1-D (batch) or 2-D (batch, model) mesh",
            source=_SOURCE,
        )
    batch, model = mesh_axes(distribution)
    if batch not in names:
        raise ConfigError(
            "batch_dim_name", batch, f"one of the mesh's axes {names}", source=_SOURCE
        )
    if devices.ndim == 2 and names.index(batch) == 1:
        devices = devices.T
    tp = devices.shape[1] if devices.ndim == 2 else 1
    return [str(d) for d in devices.ravel()], int(tp)


def strategy_for(distribution: Any, check_devices: Any, local: bool = False) -> Any:
    """A tfdist Mirrored strategy with the mesh of ``distribution``.

    Args:
        distribution: The ModelParallel.
        check_devices: Checks device names against this process's and
            returns TensorFlow's names (raises ConfigError).
        local: The mesh is this process's alone (see
            :func:`tfdist.distribution.data_parallel.strategy_for`).
    """
    from tfdist.parallel.attach import attach as attach_mesh
    from tfdist.strategies import strategy_from_config

    names, tp = ordered_devices(distribution)
    options = options_of(distribution)
    if any("/job:" in d or "/task:" in d for d in names):
        if local:
            raise local_mesh_error(names)
        return _cluster_strategy_for(names, tp, options)
    devices = check_devices(names)
    with making():
        strategy = strategy_from_config(
            {} if local else None,
            strategy="mirrored",
            devices=devices,
            model_parallel=tp,
            **options,
        )
        if tp == 1:
            attach_mesh(strategy, 1, always=True)
    return strategy


def local_mesh_error(names: list[str]) -> ConfigError:
    """The error for a mesh that must be this process's but names others'."""
    return ConfigError(
        "device_mesh",
        names,
        "devices of this process only (keras.distribution.list_devices() before "
        "initialize(), or tf.config.list_logical_devices())",
        source=_SOURCE,
        hint="A pipeline stage lays its layers out over its own process's devices",
    )


def _cluster_strategy_for(names: list[str], tp: int, options: dict) -> Any:
    """The job's MultiWorkerMirrored strategy (``initialize()``'s), with the
    mesh's tensor groups attached.

    Raises:
        ConfigError: Before ``initialize()``; compression other than the
            job's; the mesh's devices are not
            every device of the job in process order (batch-major); another
            ModelParallel attached a different model axis to the job.
    """
    from tfdist.distribution import cluster
    from tfdist.parallel.attach import attach as attach_mesh

    strategy = cluster.cluster_strategy()
    if strategy is None:
        raise ConfigError(
            "device_mesh",
            names,
            "devices of this process, or keras.distribution.initialize() first",
            source=_SOURCE,
            hint="The mesh names devices of other processes: call "
            "keras.distribution.initialize() before building it",
        )
    cluster.check_options(options, "tfdist.distribution.ModelParallel")
    every = cluster.global_devices()
    if [d.lower() for d in names] != [d.lower() for d in every]:
        raise ConfigError(
            "device_mesh",
            names,
            f"every device of the job once, batch-major in process order: {every}",
            source=_SOURCE,
            hint="Build the mesh from keras.distribution.list_devices() as it lists them: "
            "replica r of the job is device r, at (batch, model) = divmod(r, model size)",
        )
    attached = record_of(strategy).mesh
    if attached is None:
        attach_mesh(strategy, tp, always=True)
    elif attached.mesh.tp != tp:
        raise ConfigError(
            "device_mesh",
            f"a model axis of {tp}",
            f"{attached.mesh.tp}, the model axis this job's first ModelParallel gave its processes",
            source=_SOURCE,
            hint="A job's tensor groups are fixed once made; start a new job for another",
        )
    return strategy


def current() -> tuple[Any, Any] | None:
    """The ModelParallel set now and its strategy, when that strategy is the
    current one; else None."""
    from tfdist.compat.keras_src import distribution_lib

    distribution = distribution_lib.distribution()
    if not honours(distribution):
        return None
    strategy = strategy_of(distribution)
    if (
        strategy is None
        or not tf.distribute.has_strategy()
        or tf.distribute.get_strategy() is not strategy
    ):
        return None
    return distribution, strategy
