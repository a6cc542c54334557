""":func:`strategy_from_config`: the right strategy for wherever the script runs.

:func:`explain` says which one it would build and why, without building it;
:func:`describe` describes any strategy, tfdist's or TensorFlow's.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf
from absl import logging

from tfdist import plugins
from tfdist.compat import versions
from tfdist.errors import ConfigError
from tfdist.spec.compression import CompressionSetting, parse_compression, with_error_feedback
from tfdist.spec.detect import Choice, choose
from tfdist.spec.options import (
    StrategyOptions,
    canonical_strategy_name,
    check_model_parallel,
    make_options,
)
from tfdist.spec.tf_config import ClusterSource
from tfdist.strategies import provided
from tfdist.strategies.base import (
    ClusterJoinError,
    TfdistStrategy,
    TPUNotFoundError,
    communication_options,
    compression_for,
)
from tfdist.strategies.local import MirroredStrategy, OneDeviceStrategy, logical_cpus
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.parameter_server import ParameterServerStrategy, resolver_of, serve
from tfdist.strategies.tpu import TPUStrategy, check_tpu


def explain(config: Any = None, *, strategy: str = "auto", **options: Any) -> Choice:
    """Says which strategy :func:`strategy_from_config` would build, and why.

    Takes the same arguments (without ``compression``) and builds nothing.

    Raises:
        ConfigError: As strategy_from_config would, for a bad option or
            ``model_parallel`` > 1 under a strategy without a mesh.
    """
    opts = make_options(**options)
    choice = choose(_config_source(config)[0], strategy=strategy, options=opts)
    check_model_parallel(choice.name, opts.model_parallel, role=choice.role)
    return choice


def strategy_from_config(
    config: Any = None,
    *,
    strategy: str = "auto",
    compression: Any = None,
    error_feedback: bool | None = None,
    **options: Any,
) -> tf.distribute.Strategy:
    """Returns the right tf.distribute strategy for where this runs.

    Args:
        config: A TF_CONFIG dict, a JSON string, or a path to a spec file
            (names in ``cluster_specs/`` work too). None reads the
            ``TF_CONFIG`` environment variable; without one, a Slurm job
            step (``srun``) is used when there is one. Also what TensorFlow's
            constructors take, a ``ClusterResolver`` (handed to the strategy
            as is; for a cluster of workers and ps without a chief, as in
            TensorFlow's tutorial, this process is the coordinator), and the
            ``LocalCluster`` that :func:`tfdist.local_cluster` returns.
        strategy: ``"auto"`` or one of ``"default"``, ``"one_device"``,
            ``"mirrored"``, ``"multi_worker_mirrored"``,
            ``"parameter_server"``, ``"tpu"``.
        compression: Gradient compression, e.g. ``"bf16"``, ``"topk:0.01"``,
            ``"powersgd:4"``; None or ``"none"`` for none. Kept on the
            strategy as ``strategy.compression``. A compressor object
            (``TopKCompressor(0.05)``, ``PowerSGD(rank=2, warmup_steps=100)``,
            ``ErrorFeedback(SignCompressor())``) sets parameters. Only
            Mirrored and MultiWorkerMirrored compress; one replica sends
            nothing, so compression has no effect there.
        error_feedback: None for the compressor's default (on for top-k,
            random-k, sign and PowerSGD), True or False to force it.
        **options: See :class:`tfdist.spec.options.StrategyOptions`: ``devices``,
            ``cpu_replicas``, ``communication``, ``bytes_per_pack``,
            ``collective_timeout``, ``register_timeout``,
            ``variable_partitioner``, ``tpu``, ``slurm_port_base``,
            ``model_parallel``.

    ``model_parallel=T`` (also ``--model_parallel``, ``TFDIST_MODEL_PARALLEL``)
    arranges the replicas of a Mirrored or MultiWorkerMirrored strategy as a
    (data, tensor) mesh, tensor groups innermost, DP = replicas / T, for the
    layers of :mod:`tfdist.parallel`; ``describe()`` shows the mesh. T must
    divide the replicas; T > 1 under parameter_server, tpu, one_device or
    default is refused before anything is built. An evaluator task evaluates
    the full model on one device and ignores T.

    Auto-detection, first match wins: a TPU setting (``tpu=`` or
    ``TPU_NAME``); a TF_CONFIG with a ``ps`` job (ParameterServer); a
    TF_CONFIG with a cluster (MultiWorkerMirrored); a Slurm step of several
    tasks (MultiWorkerMirrored); several devices, ``cpu_replicas`` > 1 or
    several GPUs (Mirrored); a local TPU; several logical GPUs, or else
    logical CPUs, that the script configured with
    ``tf.config.set_logical_device_configuration`` before this call
    (Mirrored over them, as ``tf.distribute.MirroredStrategy()``); else one
    device. Detection reads the configuration without starting TensorFlow's
    runtime, so the script may still configure devices after ``explain``.

    On a ps or worker task of a parameter-server cluster this call serves
    the cluster and does not return: the chief runs the training.

    Inside a ``train_fn`` that ``tfdist.spark.run`` started, a call that
    names no other cluster returns the task's strategy (built with
    ``run``'s compression and options), not a second one.

    Returns:
        A tfdist strategy (a subclass of the matching tf.distribute one), or
        TensorFlow's default strategy for ``strategy="default"``.

    Raises:
        ConfigError: A bad TF_CONFIG, option or strategy name, or a
            ``model_parallel`` that does not divide the replicas; the message
            names the field and the value received.
        KerasDistributionError: A ``keras.distribution`` is set; on
            TensorFlow it would train unsharded (:mod:`tfdist.distribution.guard`).
        TPUNotFoundError: A TPU was asked for and none is reachable.
        ClusterJoinError: A peer did not join within ``register_timeout``.
    """
    opts = make_options(**options)
    setting = parse_compression(compression)
    comp = with_error_feedback(setting, error_feedback)
    # Inside a tfdist.spark task: the task's strategy, not a second one.
    task_strategy = provided.lookup(config, strategy, compression, error_feedback, options)
    if task_strategy is not None:
        return task_strategy
    config, resolver = _config_source(config)
    if opts.transport == "mpi":
        _check_mpi_setting(strategy, comp)
        if config is None and not os.environ.get("TF_CONFIG", "").strip():
            from tfdist.transport import tf_config_from_mpi

            # Started by an MPI launcher: the ranks agree on a TF_CONFIG.
            config = tf_config_from_mpi()
    choice = choose(config, strategy=strategy, options=opts)
    # A setting whose feature needs a newer Keras/TF than installed fails
    # here, naming it (tfdist.compat.versions.FEATURE_MINIMUMS), never later
    # inside Keras.
    versions.require(choice.name)
    if comp.enabled:
        versions.require("compression")
    if opts.model_parallel and opts.model_parallel > 1:
        versions.require("model_parallel")
    logging.info("tfdist: %s, because %s", choice.name, choice.reason)
    return _build(choice, opts, comp, resolver)


def _check_mpi_setting(strategy: str, comp: CompressionSetting) -> None:
    """Refuses what the MPI transport cannot carry, before MPI starts.

    Raises:
        ConfigError: ``strategy`` names another kind than
            multi_worker_mirrored, or ``compression="auto"`` (it measures
            TensorFlow's collectives, not MPI).
    """
    if canonical_strategy_name(strategy) not in ("auto", "multi_worker_mirrored"):
        raise ConfigError(
            "transport",
            "mpi",
            "strategy='auto' or 'multi_worker_mirrored' (MPI joins processes)",
            received=f"strategy={strategy!r}",
            source="strategy_from_config",
        )
    if comp.name == "auto":
        raise ConfigError(
            "compression",
            "auto",
            "a fixed setting (or none) with transport='mpi'",
            source="strategy_from_config",
            hint="'auto' times TensorFlow's collectives to choose; with MPI name the setting, "
            "e.g. compression='bf16' or 'powersgd:4'.",
        )


def _config_source(config: Any) -> tuple[Any, Any]:
    """``config`` as ``choose`` reads it, and the caller's resolver if any.

    A ``LocalCluster`` stands for its chief's TF_CONFIG; a ClusterResolver is
    also handed to TensorFlow's strategy as is, as TensorFlow's own
    constructors take it.
    """
    # A LocalCluster (tfdist.engines, a layer above).
    if isinstance(config, ClusterSource):
        return config.tf_config, None
    if isinstance(config, tf.distribute.cluster_resolver.TPUClusterResolver):
        raise ConfigError(
            "config",
            type(config).__name__,
            "a TF_CONFIG, a ClusterResolver of a chief/worker/ps cluster or a LocalCluster",
            source="strategy_from_config",
            hint="For a TPU pass tpu='NAME' (or 'local').",
        )
    if isinstance(config, tf.distribute.cluster_resolver.ClusterResolver):
        return config, config
    return config, None


def _build(
    choice: Choice, opts: StrategyOptions, comp: CompressionSetting, resolver: Any = None
) -> tf.distribute.Strategy:
    cfg = choice.tf_config
    # Refuse bad pairings before building anything.
    compression_for(choice.name, comp)
    if opts.transport != "tf" and choice.name != "multi_worker_mirrored":
        raise ConfigError(
            "transport",
            opts.transport,
            "'tf' for a strategy other than multi_worker_mirrored",
            received=f"transport={opts.transport!r} where {choice.name} was chosen "
            f"({choice.reason})",
            source="strategy_from_config",
            hint="MPI carries gradients between processes: start the script with mpiexec -n N.",
        )
    model_parallel = check_model_parallel(choice.name, opts.model_parallel, role=choice.role)
    if choice.name != "default" and choice.role != "server":
        plugins.run("refuse", choice.name)
    if choice.role == "server":
        serve(cfg)
        raise SystemExit(0)  # serve() only returns if the server is stopped.
    if choice.name == "default":
        return tf.distribute.get_strategy()
    if choice.name == "one_device" or choice.role == "evaluator":
        return _one_device(choice, opts, comp)
    if choice.name == "mirrored":
        return _mirrored(choice, opts, comp, model_parallel)
    if choice.name == "multi_worker_mirrored":
        return _multi_worker(choice, opts, comp, model_parallel, resolver)
    if choice.name == "parameter_server":
        return ParameterServerStrategy(
            resolver or resolver_of(cfg), opts.variable_partitioner, compression=comp, choice=choice
        )
    if choice.name == "tpu":
        return _tpu(choice, comp)
    raise AssertionError(f"unhandled strategy {choice.name!r}")


def _one_device(choice: Choice, opts: StrategyOptions, comp: CompressionSetting):
    if opts.devices:
        device = opts.devices[0]
    else:
        # Visible, as detection counted them: a GPU hidden with
        # tf.config.set_visible_devices cannot hold the replica.
        device = "/gpu:0" if tf.config.get_visible_devices("GPU") else "/cpu:0"
    return OneDeviceStrategy(device, compression=comp, choice=choice)


def _mirrored(choice: Choice, opts: StrategyOptions, comp: CompressionSetting, model_parallel: int):
    devices = list(opts.devices) if opts.devices else None
    if opts.cpu_replicas and opts.cpu_replicas > 1:
        devices = logical_cpus(opts.cpu_replicas)
    cross_device_ops = None
    if opts.communication == "NCCL":
        if not tf.config.list_physical_devices("GPU"):
            raise ConfigError(
                "communication",
                "NCCL",
                "RING or AUTO on a machine without GPUs",
                source="strategy_from_config",
            )
        cross_device_ops = tf.distribute.NcclAllReduce()
    return MirroredStrategy(
        devices,
        cross_device_ops,
        compression=comp,
        model_parallel=model_parallel,
        choice=choice,
    )


def _multi_worker(
    choice: Choice,
    opts: StrategyOptions,
    comp: CompressionSetting,
    model_parallel: int,
    resolver: Any,
):
    if choice.slurm:
        from tfdist.strategies.slurm import SlurmClusterResolver

        resolver = SlurmClusterResolver(port_base=opts.slurm_port_base)
    elif resolver is None:
        resolver = resolver_of(choice.tf_config)
    return MultiWorkerMirroredStrategy(
        resolver,
        communication_options(opts),
        compression=comp,
        register_timeout=opts.register_timeout,
        collective_timeout=opts.collective_timeout,
        model_parallel=model_parallel,
        transport=opts.transport,
        choice=choice,
    )


def _tpu(choice: Choice, comp: CompressionSetting):
    check_tpu(choice.tpu)
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
        tpu="" if choice.tpu == "local" else choice.tpu
    )
    if choice.tpu != "local":
        tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return TPUStrategy(resolver, compression=comp, choice=choice)


def describe(strategy: tf.distribute.Strategy) -> str:
    """Describes any strategy, tfdist's or TensorFlow's own."""
    if isinstance(strategy, TfdistStrategy):
        return strategy.describe()
    return (
        f"{type(strategy).__name__} (TensorFlow's): "
        f"{strategy.num_replicas_in_sync} replica(s) in sync"
    )


# Their public path, as before the strategies were split into modules: reprs,
# pickles and type names read "tfdist.strategies.<Class>".
for _cls in (
    TfdistStrategy,
    OneDeviceStrategy,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    ParameterServerStrategy,
    TPUStrategy,
    ClusterJoinError,
    TPUNotFoundError,
):
    _cls.__module__ = __name__.rpartition(".")[0]
del _cls
