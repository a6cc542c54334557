"""``MultiWorkerMirroredStrategy`` that Keras 3 ``fit`` works with.

It adds the fix for Keras 3 ``fit`` (keras-team/keras#20585), a registration
timeout that names the task that did not join, a watchdog that fails the
collectives of a job whose peer stopped answering, a strategy built after
TensorFlow's runtime started (:mod:`~tfdist.strategies.late_start`), later
strategies of a process created in step on every task
(:mod:`~tfdist.strategies.rejoin`), and workers that leave the cluster
together at exit (:mod:`~tfdist.strategies.exit_barrier`).
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any

import tensorflow as tf
from absl import logging

from tfdist import plugins
from tfdist.compat.tf_python import (
    coordination_config_pb2,
    eager_context as context,
    multi_worker_util,
)
from tfdist.errors import ConfigError
from tfdist.spec.detect import Choice
from tfdist.spec.options import make_options
from tfdist.strategies import exit_barrier, late_start, rejoin
from tfdist.strategies.base import ClusterJoinError, TfdistStrategy, next_key_base
from tfdist.strategies.watchdog import PeerWatchdog


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


class MultiWorkerMirroredStrategy(TfdistStrategy, tf.distribute.MultiWorkerMirroredStrategy):
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
            :mod:`tfdist.strategies.watchdog`); None: wait forever. Prefer it to
            ``communication_options.timeout_seconds``, which costs one
            sleeping thread per collective for the whole timeout.
        model_parallel: The tensor-parallel group size T, dividing the
            replicas of the whole job (see :mod:`tfdist.parallel.mesh`).
        transport: ``"tf"``, or ``"mpi"``: the gradients' all-reduce goes
            through MPI (:mod:`tfdist.transport.mpi`; the job's processes are
            the MPI ranks, one replica each). Needs a fixed compression
            setting or none, not ``"auto"``.
        choice: Why it was chosen (set by strategy_from_config).
    """

    kind = "multi_worker_mirrored"

    def __init__(
        self,
        cluster_resolver=None,
        communication_options=None,
        *,
        compression: Any = None,
        register_timeout: float | None = None,
        collective_timeout: float | None = None,
        model_parallel: int = 1,
        transport: str = "tf",
        choice: Choice | None = None,
    ):
        self._collective_key_base = next_key_base()
        if cluster_resolver is None:
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        if register_timeout is None:
            register_timeout = make_options().register_timeout
        spec = cluster_resolver.cluster_spec()
        multi = sum(len(spec.as_dict().get(job, ())) for job in ("chief", "worker")) > 1
        member = cluster_resolver.task_type in ("chief", "worker")
        if multi and member:
            _refuse_beside_horovod()
            configure_coordination(spec, register_timeout)
        self._join(cluster_resolver, communication_options, register_timeout, multi, choice)
        self._set_up(
            compression,
            choice,
            _mpi_transport(self, collective_timeout, model_parallel)
            if transport == "mpi"
            else None,
        )
        self._attach_mesh(model_parallel)
        # Keras's own saves and checkpoint callbacks: the chief writes; see
        # tfdist.training.saving.
        plugins.run("multi_worker", self)
        _warn_of_timeout_seconds(communication_options)
        self.watchdog: PeerWatchdog | None = None
        if multi and member:
            self._watch_peers(cluster_resolver, collective_timeout)

    def _join(
        self,
        cluster_resolver: Any,
        communication_options: Any,
        register_timeout: float,
        multi: bool,
        choice: Choice | None,
    ) -> None:
        """TensorFlow's own constructor, which joins the cluster, with
        tfdist's errors for a late start and a peer that does not come."""
        spec = cluster_resolver.cluster_spec()
        member = cluster_resolver.task_type in ("chief", "worker")
        call = (
            "tfdist.strategy_from_config()"
            if choice is not None
            else "tfdist.MultiWorkerMirroredStrategy()"
        )
        late = contextlib.nullcontext()
        if spec.as_dict() and member:
            # TensorFlow refuses once its runtime started (a dataset built
            # first); late_start carries datasets over or says what to move.
            late = late_start.after_start(
                spec, cluster_resolver.task_type, cluster_resolver.task_id, call
            )
        in_step = contextlib.nullcontext()
        if multi and member:
            # A later strategy replaces the collective server's state: all
            # tasks together, or a peer's first collective is lost.
            in_step = rejoin.in_step(
                f"{cluster_resolver.task_type}:{cluster_resolver.task_id}", register_timeout
            )
        try:
            with late, in_step:
                super().__init__(
                    cluster_resolver=cluster_resolver, communication_options=communication_options
                )
        except tf.errors.DeadlineExceededError as error:
            raise _join_error(error, spec, cluster_resolver, register_timeout) from None
        except late_start.StrategyOrderError:
            raise
        except RuntimeError as error:
            if late_start.TF_MESSAGE not in str(error):
                raise
            raise late_start.order_error(call, "any other TensorFlow work") from None

    def _watch_peers(self, cluster_resolver: Any, collective_timeout: float | None) -> None:
        """The peer watchdog (with ``collective_timeout``), and leaving the
        coordination service together at exit."""
        spec = cluster_resolver.cluster_spec()
        if collective_timeout:
            this = (cluster_resolver.task_type, cluster_resolver.task_id)
            peers = [
                f"/job:{job}/replica:0/task:{i}"
                for job in ("chief", "worker")
                for i in range(len(spec.as_dict().get(job, ())))
                if (job, i) != this
            ]
            self.watchdog = PeerWatchdog(peers, collective_timeout).start()
        # A task that just exits looks crashed to the peers still alive
        # 10 s later: leave the coordination service together.
        watchdog = self.watchdog
        exit_barrier.leave_together(lambda: watchdog is not None and watchdog.failure is not None)

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


def _warn_of_timeout_seconds(communication_options: object) -> None:
    timeout = getattr(communication_options, "timeout_seconds", None)
    if timeout:
        logging.warning(
            "tfdist: CommunicationOptions(timeout_seconds=%s) makes TensorFlow start "
            "one thread per collective that sleeps for the whole timeout (thousands "
            "in a long job); pass collective_timeout= to tfdist instead",
            timeout,
        )


def _mpi_transport(strategy, timeout: float | None, model_parallel: int):
    """The MPI transport of ``strategy``: one replica per rank, as many as ranks.

    Raises:
        ConfigError: Field ``'transport'``: mpi4py or MPI is missing, the MPI
            world is not this job (another number of processes), a process
            holds several replicas, or ``model_parallel`` > 1.
    """
    from tfdist.transport import MpiTransport

    transport = MpiTransport(timeout)
    replicas = strategy.num_replicas_in_sync
    local = len(strategy.extended.worker_devices)
    if transport.size != replicas or local != 1 or model_parallel != 1:
        raise ConfigError(
            "transport",
            "mpi",
            "one replica per process, one process per MPI rank, and model_parallel=1",
            received=f"{replicas} replicas, {local} in this process, {transport.size} MPI "
            f"ranks, model_parallel={model_parallel}",
            source="MultiWorkerMirroredStrategy",
            hint="Start one process per device with the MPI launcher (mpiexec -n N), without "
            "cpu_replicas or several GPUs per process.",
        )
    return transport


def _refuse_beside_horovod() -> None:
    """A multi-worker strategy cannot join a process that ``tfdist.horovod``
    already joined: both configure TensorFlow's one set of collectives, and
    the second re-enables them under the first (measured: the strategy's
    first fit hung in 2 of 9 runs)."""
    runtime = sys.modules.get("tfdist.horovod.runtime")
    if runtime is not None and runtime.is_initialized() and runtime.size() > 1:
        raise ConfigError(
            "strategy",
            "MultiWorkerMirroredStrategy",
            "no multi-worker strategy in a process where hvd.init() joined a job of several ranks",
            source="tfdist",
            hint="Use either the Horovod API (one process per rank, no strategy) or a tfdist "
            "strategy in one script, not both.",
        )


def configure_coordination(
    spec, register_timeout: float, heartbeat_timeout: float | None = None
) -> None:
    """Sets up TF's coordination service with a registration deadline.

    This is what MultiWorkerMirroredStrategy configures itself, plus
    ``cluster_register_timeout_in_ms`` and a registration barrier: without
    the barrier the leader waits forever in ``ensure_initialized`` for a
    peer that never starts, even with a timeout.

    Args:
        spec: The cluster (a ``tf.train.ClusterSpec``).
        register_timeout: Seconds every task has to join.
        heartbeat_timeout: Seconds without a heartbeat before the service
            declares a task crashed; None: TensorFlow's default (10 s).
    """
    ctx = context.context()
    if ctx.coordination_service is not None:
        return  # Someone (a launcher, a test) configured it already.
    jobs = [
        coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(addrs))
        for job, addrs in spec.as_dict().items()
        if job in ("chief", "worker")
    ]
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=int(register_timeout * 1000),
        heartbeat_timeout_in_ms=int((heartbeat_timeout or 0) * 1000),
    )
    ctx.coordination_service.cluster_register_with_barrier = True


def _join_error(error, spec, resolver, register_timeout) -> ClusterJoinError:
    """Turns TF's DeadlineExceeded into a message that names the missing tasks."""
    text = str(error)
    this = f"{resolver.task_type}:{resolver.task_id}"
    tail = text.split("timed out task names:", 1)
    missing = (
        sorted({f"{j}:{i}" for j, i in _TASK_NAME.findall(tail[1])} - {this})
        if len(tail) == 2
        else []
    )
    if not missing:
        # We are not the leader: the leader itself never answered.
        leader = _TASK_NAME.search(multi_worker_util.coordination_leader(spec))
        missing = [f"{leader.group(1)}:{leader.group(2)}"] if leader else []
    where = {
        f"{job}:{i}": addr for job, addrs in spec.as_dict().items() for i, addr in enumerate(addrs)
    }
    named = ", ".join(f"{t} ({where.get(t, '?')})" for t in missing) or "a peer"
    return ClusterJoinError(
        f"{named} did not join the cluster within register_timeout="
        f"{register_timeout:g}s (this task: {this}). Start every task with its "
        "own TF_CONFIG, check that the addresses are reachable from each "
        "other, or raise register_timeout (TFDIST_REGISTER_TIMEOUT). "
        f"TensorFlow said: {text.splitlines()[0]}"
    )
