"""Strategies on this machine: one device, or mirrored over its GPUs or logical CPUs."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.spec.detect import Choice
from tfdist.strategies.base import TfdistStrategy, next_key_base


class OneDeviceStrategy(TfdistStrategy, tf.distribute.OneDeviceStrategy):
    """``tf.distribute.OneDeviceStrategy`` with a description."""

    kind = "one_device"

    def __init__(
        self, device: str = "/cpu:0", *, compression: Any = None, choice: Choice | None = None
    ):
        super().__init__(device)
        self._set_up(compression, choice)


class MirroredStrategy(TfdistStrategy, tf.distribute.MirroredStrategy):
    """``tf.distribute.MirroredStrategy`` that is safe to create repeatedly.

    ``model_parallel=T`` arranges the replicas as a (data, tensor) mesh for
    the layers of :mod:`tfdist.parallel`; T must divide the replicas.
    """

    kind = "mirrored"

    def __init__(
        self,
        devices=None,
        cross_device_ops=None,
        *,
        compression: Any = None,
        model_parallel: int = 1,
        choice: Choice | None = None,
    ):
        self._collective_key_base = next_key_base()
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        self._set_up(compression, choice)
        self._attach_mesh(model_parallel)


def logical_cpus(count: int) -> list[str]:
    """Splits the CPU into ``count`` logical devices and returns their names."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is None or len(current) < count:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * count
            )
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            raise ConfigError(
                "cpu_replicas",
                count,
                f"at most {have}, the logical CPUs TensorFlow already started with",
                source="strategy_from_config",
                hint="The CPU can only be split before TensorFlow starts: call "
                "strategy_from_config before any other TensorFlow work.",
            ) from None
    return [d.name for d in tf.config.list_logical_devices("CPU")[:count]]
