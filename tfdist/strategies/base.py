"""What every tfdist strategy adds to its tf.distribute base class (:class:`TfdistStrategy`).

A readable description, the compression setting, why it was chosen, this task and
whether it is the chief, and a fresh collective-key range per instance, so that
several strategies in one process (tests, notebooks) do not join each other's
collectives. The layers above plug in through :mod:`tfdist.plugins`.
"""

from __future__ import annotations

import itertools
from typing import Any

import tensorflow as tf

from tfdist import plugins
from tfdist.compat.tf_python import multi_worker_util
from tfdist.compression import CompressionSetting, parse_compression
from tfdist.errors import ConfigError, TfdistError
from tfdist.record import record_of
from tfdist.spec.detect import Choice
from tfdist.spec.options import StrategyOptions


class ClusterJoinError(TfdistError, RuntimeError):
    """A task of the cluster did not join within the registration timeout."""


class TPUNotFoundError(TfdistError, RuntimeError):
    """No TPU is reachable from here."""


# Collective group and instance keys are process-global in TensorFlow. Two
# strategies over different device sets that start from the same key join
# each other's groups ("joining a group with size 4, but that group has size
# 2"). TensorFlow's own tests bump the key base by 100000 per strategy.
_KEY_STRIDE = 100_000
_key_bases = itertools.count(1)


def next_key_base() -> int:
    """A fresh base for a strategy's collective instance keys."""
    return next(_key_bases) * _KEY_STRIDE


def communication_options(options: StrategyOptions):
    """The CommunicationOptions of ``options``, without a per-collective timeout."""
    # No timeout_seconds: TensorFlow's per-collective timeout costs one
    # sleeping thread per collective for the whole timeout (see
    # tfdist.strategies.watchdog); collective_timeout is enforced by the watchdog.
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.bytes_per_pack,
        implementation=getattr(
            tf.distribute.experimental.CommunicationImplementation, options.communication
        ),
    )


def compression_for(kind: str, compression: Any) -> CompressionSetting:
    """Parses a compression setting and checks that it fits the strategy.

    Raises:
        ConfigError: Compression under parameter_server or tpu, where
            gradients are not all-reduced between replicas by Keras.
    """
    setting = parse_compression(compression)
    if setting.enabled and kind in ("parameter_server", "tpu"):
        raise ConfigError(
            "compression",
            str(setting),
            "None or 'none' under the parameter_server and tpu strategies",
            source="strategy_from_config",
            hint="Gradient compression works under 'mirrored' and 'multi_worker_mirrored'.",
        )
    return setting


class TfdistStrategy:
    """What every tfdist strategy adds to its tf.distribute base class.

    What it carries beyond TensorFlow's strategy is its
    :class:`~tfdist.record.StrategyRecord` (:func:`tfdist.record.record_of`).
    """

    #: Canonical strategy name, as accepted by ``strategy=``.
    kind: str = ""

    def _set_up(
        self, compression: Any = None, choice: Choice | None = None, transport: Any = None
    ) -> None:
        """Fills the strategy's record; the subclasses call it once built.

        Args:
            compression: The ``compression=`` setting (parsed here unless
                :func:`tfdist.strategy_from_config` already did).
            choice: Why :func:`tfdist.strategy_from_config` chose it.
            transport: What carries the gradients between processes when not
                TensorFlow's collectives (a :class:`tfdist.record.Transport`).
        """
        record = record_of(self)
        record.compression = compression_for(self.kind, compression)
        record.choice = choice
        record.transport = transport
        # The layers above install here, in order (tfdist.plugins):
        # the guard against keras.distribution (tfdist.parallel), the Keras
        # fit fixes (tfdist.training.plugin), the timeline (tfdist.profiling).
        plugins.run("install", self)
        if self.kind in ("mirrored", "multi_worker_mirrored"):
            from tfdist.compression import keras_hook, make_aggregator

            # Installed without compression too: it records which gradients
            # are IndexedSlices, for step_traffic, and otherwise hands over
            # to Keras.
            keras_hook.install()
            setting = record.compression
            if setting.enabled:
                # Built now so that a bad setting fails here, not while fit
                # traces its first step.
                record.aggregator = make_aggregator(setting, setting.error_feedback)
            elif transport is not None:
                # Another transport carries even uncompressed gradients: Keras's
                # own all-reduce would use TensorFlow's collectives.
                record.aggregator = make_aggregator("none")
        plugins.run("created", self)

    def _attach_mesh(self, model_parallel: object) -> None:
        """Arranges the replicas as a (data, tensor) mesh for T > 1."""
        plugins.run("attach", self, model_parallel)

    @property
    def model_parallel(self) -> int:
        """The tensor-parallel group size T (1: no mesh)."""
        return record_of(self).model_parallel

    @property
    def compression(self) -> CompressionSetting:
        """The gradient-compression setting kept on this strategy."""
        return record_of(self).compression

    @property
    def choice(self) -> Choice | None:
        """Why strategy_from_config chose this strategy (None if built directly)."""
        return record_of(self).choice

    def _resolver(self):
        # ParameterServerStrategy keeps its resolver private.
        return getattr(self, "cluster_resolver", None) or getattr(self, "_cluster_resolver", None)

    @property
    def task(self) -> str | None:
        """This task, e.g. ``"worker:1"``; None outside a cluster."""
        resolver = self._resolver()
        if resolver is None or resolver.task_type is None:
            return None
        return f"{resolver.task_type}:{resolver.task_id}"

    @property
    def is_chief(self) -> bool:
        """Whether this task writes checkpoints and logs for the job."""
        resolver = self._resolver()
        if resolver is None or resolver.task_type is None:
            return True
        spec = resolver.cluster_spec()
        if not spec.as_dict():
            return True
        return multi_worker_util.is_chief(spec, resolver.task_type, resolver.task_id)

    def _cluster_dict(self) -> dict:
        resolver = self._resolver()
        return resolver.cluster_spec().as_dict() if resolver else {}

    def describe(self) -> str:
        """A few lines: kind, replicas, cluster, this task, chief, compression."""
        lines = [
            f"{type(self).__name__} ({self.kind}): {self.num_replicas_in_sync} replica(s) in sync"
        ]
        devices = getattr(self.extended, "worker_devices", None)
        if devices:
            lines.append("  devices: " + ", ".join(devices))
        cluster = self._cluster_dict()
        if cluster:
            jobs = "; ".join(f"{job}={list(addrs)}" for job, addrs in sorted(cluster.items()))
            lines.append(f"  cluster: {jobs}")
            lines.append(f"  this task: {self.task} ({'chief' if self.is_chief else 'not chief'})")
        else:
            lines.append("  cluster: none (this process only)")
        lines.extend(plugins.run("describe", self))
        note = ""
        record = record_of(self)
        aggregator = record.aggregator
        if self.compression.enabled and self.num_replicas_in_sync < 2:
            note = " (no effect: one replica)"
        elif aggregator is not None:
            note = f" ({aggregator.describe()})"
        if aggregator is not None and not self.compression.enabled:
            note = ""
        lines.append(f"  compression: {self.compression}{note}")
        if record.transport is not None:
            lines.append(f"  transport: {record.transport.describe()}")
        if self.choice is not None:
            lines.append(f"  why: {self.choice.reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        task = f" task={self.task}" if self.task else ""
        tp = self.model_parallel
        mp = f" model_parallel={tp}" if tp > 1 else ""
        return (
            f"<tfdist.{type(self).__name__} "
            f"replicas={self.num_replicas_in_sync}{mp}{task} "
            f"chief={self.is_chief} compression={self.compression}>"
        )
