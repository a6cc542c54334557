"""tfdist's tf.distribute strategies, and :func:`strategy_from_config`.

Each class subclasses TensorFlow's own strategy, so everything that accepts a
``tf.distribute.Strategy`` accepts it, and adds:

* a readable description (:meth:`TfdistStrategy.describe`): kind, replicas,
  cluster, this task, chief or not, compression, and why it was chosen;
* the compression setting (``strategy.compression``);
* a fresh collective-key range per instance, so that several strategies in one
  process (tests, notebooks) do not join each other's collectives;
* for MultiWorkerMirrored: the fix for Keras 3 ``fit`` (keras-team/keras#20585)
  and a registration timeout that names the task that did not join.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import socket
import sys
from typing import Any

import tensorflow as tf
from absl import logging
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context

from tfdist import cluster as cluster_lib
from tfdist import keras_accumulation, keras_loops, keras_steps, late_start
from tfdist.compression import CompressionSetting, parse_compression
from tfdist.detect import Choice, choose
from tfdist.errors import ConfigError, TfdistError
from tfdist.late_start import StrategyOrderError
from tfdist.options import StrategyOptions, check_model_parallel, make_options
from tfdist.watchdog import PeerWatchdog

__all__ = [
    "ClusterJoinError",
    "StrategyOrderError",
    "TPUNotFoundError",
    "TfdistStrategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "TPUStrategy",
    "strategy_from_config",
    "explain",
    "describe",
]


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


def _next_key_base() -> int:
    return next(_key_bases) * _KEY_STRIDE


def _communication_options(options: StrategyOptions):
    # No timeout_seconds: TensorFlow's per-collective timeout costs one
    # sleeping thread per collective for the whole timeout (see
    # tfdist.watchdog); collective_timeout is enforced by the watchdog.
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=options.bytes_per_pack,
        implementation=getattr(
            tf.distribute.experimental.CommunicationImplementation,
            options.communication))


def compression_for(kind: str, compression: Any) -> CompressionSetting:
    """Parses a compression setting and checks that it fits the strategy.

    Raises:
        ConfigError: Compression under parameter_server or tpu, where
            gradients are not all-reduced between replicas by Keras.
    """
    setting = parse_compression(compression)
    if setting.enabled and kind in ("parameter_server", "tpu"):
        raise ConfigError(
            "compression", str(setting),
            "None or 'none' under the parameter_server and tpu strategies",
            source="strategy_from_config",
            hint="Gradient compression works under 'mirrored' and "
            "'multi_worker_mirrored'.")
    return setting


class TfdistStrategy:
    """What every tfdist strategy adds to its tf.distribute base class."""

    #: Canonical strategy name, as accepted by ``strategy=``.
    kind: str = ""

    def _tfdist_init(self, compression: Any = None,
                     choice: Choice | None = None) -> None:
        setting = compression_for(self.kind, compression)
        # keras.distribution trains unsharded on TensorFlow, silently: refuse
        # it beside a tfdist strategy, in either order (tfdist.parallel.guard).
        from tfdist.parallel import guard
        guard.install()
        guard.check_no_distribution(self.kind)
        keras_steps.install()
        keras_loops.install()
        keras_accumulation.install()
        # TF's PreemptionCheckpointHandler exits with 143 and a status record.
        from tfdist import tf_handler
        tf_handler.install()
        # Keras's BackupAndRestore saves on preemption and resumes mid-epoch
        # (tfdist.keras_preemption), over the chief-only saves of
        # tfdist.keras_saving, which must be wrapped first.
        from tfdist import keras_preemption, keras_saving
        keras_saving.install()
        keras_preemption.install()
        if os.environ.get("TFDIST_TIMELINE", "").strip():
            # HOROVOD_TIMELINE's counterpart: every fit gets a StepProfile.
            from tfdist.profiling.callback import install_timeline
            install_timeline()
        if self.kind in ("mirrored", "multi_worker_mirrored"):
            from tfdist.compression import keras_hook, make_aggregator
            # Installed without compression too: it records which gradients
            # are IndexedSlices, for step_traffic, and otherwise hands over
            # to Keras.
            keras_hook.install()
            if setting.enabled:
                # Built now so that a bad setting fails here, not while fit
                # traces its first step.
                self._tfdist_aggregator = make_aggregator(setting, setting.error_feedback)
        self._tfdist_compression = setting
        self._tfdist_choice = choice
        guard.register_strategy(self)

    def _tfdist_attach(self, model_parallel: Any) -> None:
        """Arranges the replicas as a (data, tensor) mesh for T > 1."""
        from tfdist.parallel import mesh as mesh_lib
        mesh_lib.attach(self, model_parallel)

    @property
    def model_parallel(self) -> int:
        """The tensor-parallel group size T (1: no mesh)."""
        from tfdist.parallel import mesh as mesh_lib
        mesh = mesh_lib.mesh_of(self)
        return mesh.tp if mesh is not None else 1

    @property
    def compression(self) -> CompressionSetting:
        """The gradient-compression setting kept on this strategy."""
        return getattr(self, "_tfdist_compression", parse_compression(None))

    @property
    def choice(self) -> Choice | None:
        """Why strategy_from_config chose this strategy (None if built directly)."""
        return getattr(self, "_tfdist_choice", None)

    def _tfdist_resolver(self):
        # ParameterServerStrategy keeps its resolver private.
        return (getattr(self, "cluster_resolver", None)
                or getattr(self, "_cluster_resolver", None))

    @property
    def task(self) -> str | None:
        """This task, e.g. ``"worker:1"``; None outside a cluster."""
        resolver = self._tfdist_resolver()
        if resolver is None or resolver.task_type is None:
            return None
        return f"{resolver.task_type}:{resolver.task_id}"

    @property
    def is_chief(self) -> bool:
        """Whether this task writes checkpoints and logs for the job."""
        resolver = self._tfdist_resolver()
        if resolver is None or resolver.task_type is None:
            return True
        spec = resolver.cluster_spec()
        if not spec.as_dict():
            return True
        return multi_worker_util.is_chief(spec, resolver.task_type,
                                          resolver.task_id)

    def _cluster_dict(self) -> dict:
        resolver = self._tfdist_resolver()
        return resolver.cluster_spec().as_dict() if resolver else {}

    def describe(self) -> str:
        """A few lines: kind, replicas, cluster, this task, chief, compression."""
        lines = [f"{type(self).__name__} ({self.kind}): "
                 f"{self.num_replicas_in_sync} replica(s) in sync"]
        devices = getattr(self.extended, "worker_devices", None)
        if devices:
            lines.append("  devices: " + ", ".join(devices))
        cluster = self._cluster_dict()
        if cluster:
            jobs = "; ".join(f"{job}={list(addrs)}"
                             for job, addrs in sorted(cluster.items()))
            lines.append(f"  cluster: {jobs}")
            lines.append(f"  this task: {self.task} "
                         f"({'chief' if self.is_chief else 'not chief'})")
        else:
            lines.append("  cluster: none (this process only)")
        from tfdist.parallel import mesh as mesh_lib
        mesh_line = mesh_lib.describe_line(self)
        if mesh_line:
            lines.append(mesh_line)
        note = ""
        aggregator = getattr(self, "_tfdist_aggregator", None)
        if self.compression.enabled and self.num_replicas_in_sync < 2:
            note = " (no effect: one replica)"
        elif aggregator is not None:
            note = f" ({aggregator.describe()})"
        lines.append(f"  compression: {self.compression}{note}")
        if self.choice is not None:
            lines.append(f"  why: {self.choice.reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        task = f" task={self.task}" if self.task else ""
        tp = self.model_parallel
        mp = f" model_parallel={tp}" if tp > 1 else ""
        return (f"<tfdist.{type(self).__name__} "
                f"replicas={self.num_replicas_in_sync}{mp}{task} "
                f"chief={self.is_chief} compression={self.compression}>")


class OneDeviceStrategy(TfdistStrategy, tf.distribute.OneDeviceStrategy):
    """``tf.distribute.OneDeviceStrategy`` with a description."""

    kind = "one_device"

    def __init__(self, device: str = "/cpu:0", *, compression: Any = None,
                 choice: Choice | None = None):
        super().__init__(device)
        self._tfdist_init(compression, choice)


class MirroredStrategy(TfdistStrategy, tf.distribute.MirroredStrategy):
    """``tf.distribute.MirroredStrategy`` that is safe to create repeatedly.

    ``model_parallel=T`` arranges the replicas as a (data, tensor) mesh for
    the layers of :mod:`tfdist.parallel`; T must divide the replicas.
    """

    kind = "mirrored"

    def __init__(self, devices=None, cross_device_ops=None, *,
                 compression: Any = None, model_parallel: int = 1,
                 choice: Choice | None = None):
        self._collective_key_base = _next_key_base()
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        self._tfdist_init(compression, choice)
        self._tfdist_attach(model_parallel)


def _rank(strategy: tf.distribute.Strategy, value: Any) -> int | None:
    """Rank of a per-replica value or tensor, read from its first component.

    tf.nest treats a PerReplica as a leaf and it has no ``.shape``, so the rank
    comes from its first local result.
    """
    if isinstance(value, tf.distribute.DistributedValues):
        value = strategy.experimental_local_results(value)[0]
    shape = getattr(value, "shape", None)
    if shape is None:
        return 0 if isinstance(value, (int, float)) else None
    return tf.TensorShape(shape).rank


_TASK_NAME = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


class MultiWorkerMirroredStrategy(TfdistStrategy,
                                  tf.distribute.MultiWorkerMirroredStrategy):
    """``MultiWorkerMirroredStrategy`` that Keras 3 ``fit`` works with.

    Args:
        cluster_resolver: Where the cluster comes from; defaults to TF_CONFIG.
        communication_options: ``tf.distribute.experimental.CommunicationOptions``.
        compression: The gradient-compression setting.
        register_timeout: Seconds every task has to join. TensorFlow waits
            forever for a peer that never starts; this fails with
            :class:`ClusterJoinError` naming the missing tasks.
        collective_timeout: Seconds a peer may stop answering before this
            task's collectives fail with a message naming it (see
            :mod:`tfdist.watchdog`); None: wait forever. Prefer it to
            ``communication_options.timeout_seconds``, which costs one
            sleeping thread per collective for the whole timeout.
        model_parallel: The tensor-parallel group size T, dividing the
            replicas of the whole job (see :mod:`tfdist.parallel.mesh`).
        choice: Why it was chosen (set by strategy_from_config).
    """

    kind = "multi_worker_mirrored"

    def __init__(self, cluster_resolver=None, communication_options=None, *,
                 compression: Any = None, register_timeout: float | None = None,
                 collective_timeout: float | None = None,
                 model_parallel: int = 1, choice: Choice | None = None):
        self._collective_key_base = _next_key_base()
        if cluster_resolver is None:
            cluster_resolver = (
                tf.distribute.cluster_resolver.TFConfigClusterResolver())
        if register_timeout is None:
            register_timeout = make_options().register_timeout
        spec = cluster_resolver.cluster_spec()
        multi = sum(len(spec.as_dict().get(job, ()))
                    for job in ("chief", "worker")) > 1
        if multi and cluster_resolver.task_type in ("chief", "worker"):
            _refuse_beside_horovod()
            _configure_coordination(spec, register_timeout)
        call = ("tfdist.strategy_from_config()" if choice is not None
                else "tfdist.MultiWorkerMirroredStrategy()")
        late = contextlib.nullcontext()
        if spec.as_dict() and cluster_resolver.task_type in ("chief", "worker"):
            # TensorFlow refuses once its runtime started (a dataset built
            # first); late_start carries datasets over or says what to move.
            late = late_start.after_start(spec, cluster_resolver.task_type,
                                          cluster_resolver.task_id, call)
        try:
            with late:
                super().__init__(cluster_resolver=cluster_resolver,
                                 communication_options=communication_options)
        except tf.errors.DeadlineExceededError as error:
            raise _join_error(error, spec, cluster_resolver,
                              register_timeout) from None
        except late_start.StrategyOrderError:
            raise
        except RuntimeError as error:
            if late_start.TF_MESSAGE not in str(error):
                raise
            raise late_start.order_error(call, "any other TensorFlow work") from None
        self._tfdist_init(compression, choice)
        self._tfdist_attach(model_parallel)
        # Keras's own saves and checkpoint callbacks: the chief writes; see
        # tfdist.keras_saving.
        from tfdist import keras_saving
        keras_saving.install()
        keras_saving.set_job_strategy(self)
        timeout = getattr(communication_options, "timeout_seconds", None)
        if timeout:
            logging.warning(
                "tfdist: CommunicationOptions(timeout_seconds=%s) makes TensorFlow start "
                "one thread per collective that sleeps for the whole timeout (thousands "
                "in a long job); pass collective_timeout= to tfdist instead", timeout)
        self.watchdog: PeerWatchdog | None = None
        if multi and collective_timeout and cluster_resolver.task_type in ("chief", "worker"):
            this = (cluster_resolver.task_type, cluster_resolver.task_id)
            peers = [f"/job:{job}/replica:0/task:{i}"
                     for job in ("chief", "worker")
                     for i in range(len(spec.as_dict().get(job, ())))
                     if (job, i) != this]
            self.watchdog = PeerWatchdog(peers, collective_timeout).start()

    def reduce(self, reduce_op, value, axis):
        """Reduces ``value`` across replicas, as Keras 3 ``fit`` calls it.

        Keras 3 calls ``reduce`` with a tuple of per-replica values (TF 2.21
        stacks them: "Shapes of all inputs must match", or "unsupported type
        PerReplica") and with ``axis=0`` on scalars ("Invalid reduction
        dimension 0"). Map over the structure, and reduce
        scalars with ``axis=None``, which means the same thing for them.
        """
        base = super()

        def reduce_one(v):
            one_axis = axis
            if axis is not None and _rank(self, v) == 0:
                one_axis = None
            return base.reduce(reduce_op, v, one_axis)

        return tf.nest.map_structure(reduce_one, value)


def _refuse_beside_horovod() -> None:
    """A multi-worker strategy cannot join a process that ``tfdist.horovod``
    already joined: both configure TensorFlow's one set of collectives, and
    the second re-enables them under the first (measured: the strategy's
    first fit hung in 2 of 9 runs)."""
    runtime = sys.modules.get("tfdist.horovod.runtime")
    if runtime is not None and runtime.is_initialized() and runtime.size() > 1:
        raise ConfigError(
            "strategy", "MultiWorkerMirroredStrategy", "no multi-worker strategy in a process "
            "where hvd.init() joined a job of several ranks", source="tfdist",
            hint="Use either the Horovod API (one process per rank, no strategy) or a tfdist "
                 "strategy in one script, not both.")


def _configure_coordination(spec, register_timeout: float) -> None:
    """Sets up TF's coordination service with a registration deadline.

    This is what MultiWorkerMirroredStrategy configures itself, plus
    ``cluster_register_timeout_in_ms`` and a registration barrier: without
    the barrier the leader waits forever in ``ensure_initialized`` for a
    peer that never starts, even with a timeout.
    """
    ctx = context.context()
    if ctx.coordination_service is not None:
        return  # Someone (a launcher, a test) configured it already.
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(addrs))
            for job, addrs in spec.as_dict().items()
            if job in ("chief", "worker")]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=int(register_timeout * 1000))
    ctx.coordination_service.cluster_register_with_barrier = True


def _join_error(error, spec, resolver, register_timeout) -> ClusterJoinError:
    """Turns TF's DeadlineExceeded into a message that names the missing tasks."""
    text = str(error)
    this = f"{resolver.task_type}:{resolver.task_id}"
    tail = text.split("timed out task names:", 1)
    missing = sorted({f"{j}:{i}" for j, i in _TASK_NAME.findall(tail[1])}
                     - {this}) if len(tail) == 2 else []
    if not missing:
        # We are not the leader: the leader itself never answered.
        leader = _TASK_NAME.search(multi_worker_util.coordination_leader(spec))
        missing = [f"{leader.group(1)}:{leader.group(2)}"] if leader else []
    where = {f"{job}:{i}": addr for job, addrs in spec.as_dict().items()
             for i, addr in enumerate(addrs)}
    named = ", ".join(f"{t} ({where.get(t, '?')})" for t in missing) or "a peer"
    return ClusterJoinError(
        f"{named} did not join the cluster within register_timeout="
        f"{register_timeout:g}s (this task: {this}). Start every task with its "
        "own TF_CONFIG, check that the addresses are reachable from each "
        "other, or raise register_timeout (TFDIST_REGISTER_TIMEOUT). "
        f"TensorFlow said: {text.splitlines()[0]}")


def _partitioner(value: Any, num_ps: int):
    if not isinstance(value, str):
        return value
    kind, _, number = value.partition(":")
    parts = tf.distribute.experimental.partitioners
    if kind == "fixed":
        return parts.FixedShardsPartitioner(int(number))
    if kind == "min_size":
        # TF's default max_shards=1 would never shard: allow one per ps.
        return parts.MinSizePartitioner(min_shard_bytes=int(number),
                                        max_shards=max(1, num_ps))
    return parts.MaxSizePartitioner(max_shard_bytes=int(number))


class ParameterServerStrategy(TfdistStrategy,
                              tf.distribute.experimental.ParameterServerStrategy):
    """``ParameterServerStrategy`` that Keras 3 can train under.

    Creating one installs :mod:`tfdist.keras_ps` (atomic increments on the
    ps, gradients of sharded variables). Train with :func:`tfdist.fit`.
    """

    kind = "parameter_server"

    def __init__(self, cluster_resolver, variable_partitioner=None, *,
                 compression: Any = None, choice: Choice | None = None):
        num_ps = len(cluster_resolver.cluster_spec().as_dict().get("ps", ()))
        super().__init__(cluster_resolver,
                         variable_partitioner=_partitioner(variable_partitioner, num_ps))
        self._tfdist_init(compression, choice)
        # Keras 3 loses concurrent increments and cannot differentiate
        # sharded variables under this strategy; see tfdist.keras_ps.
        from tfdist import keras_ps
        keras_ps.install()


class TPUStrategy(TfdistStrategy, tf.distribute.TPUStrategy):
    """``TPUStrategy`` with a description. Use :func:`strategy_from_config`
    to get one: it checks for a TPU before TensorFlow can hang looking."""

    kind = "tpu"

    def __init__(self, tpu_cluster_resolver, *, compression: Any = None,
                 choice: Choice | None = None):
        super().__init__(tpu_cluster_resolver)
        self._tfdist_init(compression, choice)


def _no_tpu(tpu: str, why: str) -> TPUNotFoundError:
    return TPUNotFoundError(
        f"No TPU found for tpu={tpu!r}: {why}. To train without a TPU, pass "
        "strategy='auto' (or 'mirrored', 'one_device', ...) and unset "
        "TPU_NAME.")


def _on_google_cloud() -> bool:
    """Whether this is a Google Cloud VM, read locally (no network call)."""
    try:
        with open("/sys/class/dmi/id/product_name", encoding="ascii") as f:
            return "Google" in f.read()
    except OSError:
        return False


def check_tpu(tpu: str, connect_timeout: float = 3.0) -> None:
    """Fails fast, before TensorFlow is asked, when no TPU can be reached.

    TensorFlow fails late or hangs: ``tpu="local"`` without a TPU gives an
    IndexError; an unknown name makes a call to the cloud metadata server,
    which hangs where that address does not answer; a ``grpc://`` address on
    a closed port hangs in ``experimental_connect_to_cluster``.

    Raises:
        TPUNotFoundError: No TPU at ``tpu``; the message says what to do.
    """
    if tpu == "local":
        if not tf.config.list_physical_devices("TPU"):
            raise _no_tpu(tpu, "this machine has no local TPU device")
        return
    if tpu.startswith("grpc://"):
        try:
            host, port = cluster_lib.parse_address(tpu[len("grpc://"):])
        except ConfigError as error:
            raise ConfigError("tpu", tpu, "'grpc://host:port'",
                              source="strategy_from_config") from error
        try:
            socket.create_connection((host, port), timeout=connect_timeout).close()
        except OSError as error:
            raise _no_tpu(tpu, f"nothing answers at {host}:{port} ({error})") from None
        return
    if not _on_google_cloud():
        raise _no_tpu(tpu, "a TPU name is resolved through the Google Cloud "
                      "metadata server, and this machine is not a Google Cloud "
                      "VM")


def _logical_cpus(count: int) -> list[str]:
    """Splits the CPU into ``count`` logical devices and returns their names."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is None or len(current) < count:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            raise ConfigError(
                "cpu_replicas", count,
                f"at most {have}, the logical CPUs TensorFlow already started "
                "with", source="strategy_from_config",
                hint="The CPU can only be split before TensorFlow starts: call "
                "strategy_from_config before any other TensorFlow work.") from None
    return [d.name for d in tf.config.list_logical_devices("CPU")[:count]]


def _resolver(cfg: cluster_lib.TFConfig):
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(a) for job, a in cfg.cluster.items()}),
        task_type=cfg.task_type, task_id=cfg.task_index,
        rpc_layer=cfg.rpc_layer or "grpc")


def serve(cfg: cluster_lib.TFConfig) -> None:
    """Runs this ps or worker task as a server of a parameter-server job.

    The chief drives training; ps and worker tasks only serve it. This never
    returns: the chief's side ends the job. On the preemption signal the
    server serves on until the coordinator has saved, then exits with code
    143 (:mod:`tfdist.ps_preemption`).
    """
    logging.info("tfdist: %s serves the parameter-server cluster; the chief "
                 "runs the training.", cfg.task_id)
    print(f"tfdist: {cfg.task_id} is serving the parameter-server cluster "
          f"at {cfg.task_address}", file=sys.stderr, flush=True)
    server = tf.distribute.Server(
        _resolver(cfg).cluster_spec(), job_name=cfg.task_type,
        task_index=cfg.task_index, protocol=cfg.rpc_layer or "grpc", start=True)
    from tfdist import ps_preemption
    # Not server.join(): it never returns, so no Python signal handler runs.
    ps_preemption.serve_until_preempted(cfg.task_type, cfg.task_index, server)


def explain(config: Any = None, *, strategy: str = "auto",
            **options: Any) -> Choice:
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


def strategy_from_config(config: Any = None, *, strategy: str = "auto",
                         compression: Any = None, error_feedback: bool | None = None,
                         **options: Any) -> tf.distribute.Strategy:
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
        **options: See :class:`tfdist.options.StrategyOptions`: ``devices``,
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

    Returns:
        A tfdist strategy (a subclass of the matching tf.distribute one), or
        TensorFlow's default strategy for ``strategy="default"``.

    Raises:
        ConfigError: A bad TF_CONFIG, option or strategy name, or a
            ``model_parallel`` that does not divide the replicas; the message
            names the field and the value received.
        KerasDistributionError: A ``keras.distribution`` is set; on
            TensorFlow it would train unsharded (:mod:`tfdist.parallel.guard`).
        TPUNotFoundError: A TPU was asked for and none is reachable.
        ClusterJoinError: A peer did not join within ``register_timeout``.
    """
    opts = make_options(**options)
    comp = dataclasses.replace(parse_compression(compression), error_feedback=error_feedback)
    config, resolver = _config_source(config)
    choice = choose(config, strategy=strategy, options=opts)
    logging.info("tfdist: %s, because %s", choice.name, choice.reason)
    return _build(choice, opts, comp, resolver)


def _config_source(config: Any) -> tuple[Any, Any]:
    """``config`` as ``choose`` reads it, and the caller's resolver if any.

    A ``LocalCluster`` stands for its chief's TF_CONFIG; a ClusterResolver is
    also handed to TensorFlow's strategy as is, as TensorFlow's own
    constructors take it.
    """
    from tfdist.ps_cluster import LocalCluster
    if isinstance(config, LocalCluster):
        return config.tf_config, None
    if isinstance(config, tf.distribute.cluster_resolver.TPUClusterResolver):
        raise ConfigError("config", type(config).__name__, "a TF_CONFIG, a "
                          "ClusterResolver of a chief/worker/ps cluster or a "
                          "LocalCluster", source="strategy_from_config",
                          hint="For a TPU pass tpu='NAME' (or 'local').")
    if isinstance(config, tf.distribute.cluster_resolver.ClusterResolver):
        return config, config
    return config, None


def _build(choice: Choice, opts: StrategyOptions, comp: CompressionSetting,
           resolver: Any = None) -> tf.distribute.Strategy:
    cfg = choice.tf_config
    # Refuse bad pairings before building anything.
    compression_for(choice.name, comp)
    model_parallel = check_model_parallel(choice.name, opts.model_parallel,
                                          role=choice.role)
    if choice.name != "default" and choice.role != "server":
        from tfdist.parallel import guard
        guard.check_no_distribution(choice.name)
    if choice.role == "server":
        serve(cfg)
        raise SystemExit(0)  # serve() only returns if the server is stopped.
    if choice.name == "default":
        return tf.distribute.get_strategy()
    if choice.name == "one_device" or choice.role == "evaluator":
        if opts.devices:
            device = opts.devices[0]
        else:
            # Visible, as detection counted them: a GPU hidden with
            # tf.config.set_visible_devices cannot hold the replica.
            device = "/gpu:0" if tf.config.get_visible_devices("GPU") else "/cpu:0"
        return OneDeviceStrategy(device, compression=comp, choice=choice)
    if choice.name == "mirrored":
        devices = list(opts.devices) if opts.devices else None
        if opts.cpu_replicas and opts.cpu_replicas > 1:
            devices = _logical_cpus(opts.cpu_replicas)
        cross_device_ops = None
        if opts.communication == "NCCL":
            if not tf.config.list_physical_devices("GPU"):
                raise ConfigError("communication", "NCCL", "RING or AUTO on a "
                                  "machine without GPUs",
                                  source="strategy_from_config")
            cross_device_ops = tf.distribute.NcclAllReduce()
        return MirroredStrategy(devices, cross_device_ops, compression=comp,
                                model_parallel=model_parallel, choice=choice)
    if choice.name == "multi_worker_mirrored":
        if choice.slurm:
            from tfdist.slurm import SlurmClusterResolver
            resolver = SlurmClusterResolver(port_base=opts.slurm_port_base)
        elif resolver is None:
            resolver = _resolver(cfg)
        return MultiWorkerMirroredStrategy(
            resolver, _communication_options(opts), compression=comp,
            register_timeout=opts.register_timeout,
            collective_timeout=opts.collective_timeout,
            model_parallel=model_parallel, choice=choice)
    if choice.name == "parameter_server":
        return ParameterServerStrategy(
            resolver or _resolver(cfg), opts.variable_partitioner,
            compression=comp, choice=choice)
    if choice.name == "tpu":
        check_tpu(choice.tpu)
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu="" if choice.tpu == "local" else choice.tpu)
        if choice.tpu != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return TPUStrategy(resolver, compression=comp, choice=choice)
    raise AssertionError(f"unhandled strategy {choice.name!r}")


def describe(strategy: tf.distribute.Strategy) -> str:
    """Describes any strategy, tfdist's or TensorFlow's own."""
    if isinstance(strategy, TfdistStrategy):
        return strategy.describe()
    return (f"{type(strategy).__name__} (TensorFlow's): "
            f"{strategy.num_replicas_in_sync} replica(s) in sync")
