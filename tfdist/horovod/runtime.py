"""``hvd.init()`` and the ranks: TensorFlow collectives between processes, no strategy.

Horovod runs one process per device with no ``tf.distribute`` strategy, and
its scripts call ``hvd.init()`` *before* their device set-up
(``tf.config.set_visible_devices(gpus[hvd.local_rank()])``). A
MultiWorkerMirroredStrategy created there would start TensorFlow's runtime,
and the set-up would then fail. :func:`init` therefore only *configures*
TensorFlow: the coordination service (which notices a dead peer), and
collective ops with this task's server definition. TensorFlow applies both
when its runtime starts, at the first op the script runs, after the device
set-up. The collectives themselves go through TensorFlow's
``CollectiveReplicaLauncher``, created at the first collective.

TensorFlow matches collectives by the order in which each process issues
them; Horovod matched them by name. Two guards keep a mismatch from hanging:

* collectives run outside a ``tf.function`` (broadcasts, metric averages,
  objects) first exchange a short signature (kind, name, dtype, shape), so
  ranks that disagree fail at once with :class:`CollectiveMismatchError`
  naming what each rank issued;
* a collective that some rank never issues fails after
  ``collective_timeout`` seconds (``TFDIST_COLLECTIVE_TIMEOUT``, or
  Horovod's ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``) with
  :class:`CollectiveTimeoutError`, and a peer that dies or stops answering
  is caught by the coordination service and :mod:`tfdist.strategies.watchdog`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from tfdist.compat import tf_private
from tfdist.errors import ConfigError, TfdistError
from tfdist.strategies import topology as ranks_lib
from tfdist.strategies.topology import Topology

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "topology",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "NotInitializedError",
]

log = logging.getLogger("tfdist.horovod")

#: Group keys far above MultiWorkerMirroredStrategy's (which start at 1 and
#: grow by 10,000 per strategy in tfdist). A multi-worker strategy still
#: cannot join the same process (tfdist.strategies refuses it).
_GROUP_KEY = 0x3FFF0000


class NotInitializedError(TfdistError, ValueError):
    """A rank query or collective ran before ``hvd.init()``."""


class CollectiveMismatchError(TfdistError, RuntimeError):
    """The ranks issued different collectives at the same point."""


class CollectiveTimeoutError(TfdistError, RuntimeError):
    """A collective waited longer than ``collective_timeout`` for the other ranks."""


class _State:
    def __init__(self, topo: Topology, collective_timeout: float | None):
        self.topo = topo
        self.collective_timeout = collective_timeout
        self.lock = threading.Lock()
        self.launcher = None
        #: (started, finished) counts of collectives run inside tf.functions.
        self.counters: tuple | None = None
        self.device: str | None = None
        self.inflight: dict[int, tuple[str, float]] = {}
        self.ids = itertools.count()
        self.aborted: str | None = None
        self.stall_thread: threading.Thread | None = None
        self.peer_watchdog = None
        self.stop = threading.Event()


_state: _State | None = None


def _timeout_from_env() -> float | None:
    from tfdist.spec.options import make_options

    stall = os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    if stall and "TFDIST_COLLECTIVE_TIMEOUT" not in os.environ:
        try:
            value = float(stall)
        except ValueError:
            raise ConfigError(
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                stall,
                "a number of seconds",
                source="environment",
            ) from None
        return value if value > 0 else None
    return make_options().collective_timeout


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Joins this process to the job, as ``hvd.init()``.

    Reads where this process sits from the environment (see
    :mod:`tfdist.strategies.topology`) and configures TensorFlow's collectives
    without starting its runtime, so that the script's device set-up may
    follow. Calling it again does nothing.

    Args:
        comm: Horovod's MPI communicator or list of ranks. Only None (every
            rank) is supported.
        process_sets: Horovod's process sets. Only None is supported.

    Raises:
        ConfigError: A launcher variable is malformed, or ``comm`` /
            ``process_sets`` was given.
    """
    global _state
    if comm is not None:
        raise ConfigError(
            "comm",
            comm,
            "None: tfdist.horovod runs every rank in one "
            "communicator and takes the ranks from the launcher's environment",
            source="hvd.init",
        )
    if process_sets is not None:
        raise ConfigError(
            "process_sets", process_sets, "None: process sets are not supported", source="hvd.init"
        )
    if _state is not None:
        return
    topo = ranks_lib.discover()
    state = _State(topo, _timeout_from_env())
    if topo.size > 1:
        _configure(topo)
    _state = state
    log.info("tfdist.horovod: %s", ranks_lib.describe(topo))


def _configure(topo: Topology) -> None:
    """Configures coordination and collectives; starts nothing."""
    from tfdist.compat.tf_python import ClusterSpec, eager_context as context, tensorflow_server_pb2
    from tfdist.spec.options import make_options
    from tfdist.strategies.multi_worker import configure_coordination

    ctx = context.context()
    spec = ClusterSpec(topo.cluster)
    if tf_private.context_started(ctx):
        # TensorFlow would re-point every existing tensor at a new device
        # name ("unknown device" later); say what to move.
        raise ConfigError(
            "hvd.init",
            "called after TensorFlow started",
            "hvd.init() before any other "
            "TensorFlow work (a tensor, a dataset, tf.config.list_logical_devices)",
            source="tfdist.horovod",
            hint="Move `hvd.init()` to the top of the script, as Horovod's examples do; "
            "tf.config.list_physical_devices and set_visible_devices may come after it.",
        )
    configure_coordination(spec, make_options().register_timeout)
    ctx.configure_collective_ops(
        collective_leader=topo.leader,
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(f"/job:{topo.task_type}/task:{topo.task_id}",),
    )
    config = copy.deepcopy(ctx.config)  # As MultiWorkerMirroredStrategy does.
    config.experimental.collective_group_leader = topo.leader
    port = int(topo.cluster[topo.task_type][topo.task_id].rsplit(":", 1)[1])
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=spec.as_cluster_def(),
        default_session_config=config,
        job_name=topo.task_type,
        task_index=topo.task_id,
        protocol="grpc",
        port=port,
    )
    ctx.enable_collective_ops(server_def)


def _require() -> _State:
    if _state is None:
        raise NotInitializedError(
            "tfdist.horovod has not been initialized: expected `hvd.init()` before this "
            "call. Received: a call before init()"
        )
    return _state


def is_initialized() -> bool:
    """Whether :func:`init` has run."""
    return _state is not None


def topology() -> Topology:
    """This process's :class:`~tfdist.strategies.topology.Topology`."""
    return _require().topo


def rank() -> int:
    """This process's rank, 0 to ``size() - 1``."""
    return _require().topo.rank


def size() -> int:
    """The number of processes in the job."""
    return _require().topo.size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _require().topo.local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return _require().topo.local_size


def cross_rank() -> int:
    """This process's rank among the processes with its ``local_rank``."""
    return _require().topo.cross_rank


def cross_size() -> int:
    """The number of processes with this ``local_rank`` (hosts, usually)."""
    return _require().topo.cross_size


def shutdown() -> None:
    """Stops the watchdogs. TensorFlow's collectives cannot be configured
    twice in a process, so :func:`init` after this keeps the same ranks."""
    state = _state
    if state is None:
        return
    state.stop.set()
    if state.peer_watchdog is not None:
        state.peer_watchdog.stop()
        state.peer_watchdog = None


# --- the launcher, created at the first collective --------------------------


def launcher():
    """TensorFlow's collective launcher for this rank (created on first use,
    after the script's device set-up)."""
    state = _require()
    if state.launcher is not None:
        return state.launcher
    with state.lock:
        if state.launcher is None:
            import tensorflow as tf

            from tfdist.compat.tf_python import collective_util, cross_device_utils

            topo = state.topo
            # One process, one device: the GPU the script made visible, else the CPU.
            kind = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
            state.device = f"/job:{topo.task_type}/replica:0/task:{topo.task_id}/device:{kind}:0"
            keys = cross_device_utils.CollectiveKeys(group_key_start=_GROUP_KEY)
            # The first collective may come in any trace of a tf.function.
            with tf.init_scope(), created_eagerly():
                state.launcher = cross_device_utils.CollectiveReplicaLauncher(
                    keys.get_group_key([state.device]),
                    topo.size,
                    keys,
                    state.device,
                    collective_util.Options(),
                )
                with tf.device("/cpu:0"):
                    state.counters = (
                        tf.Variable(0, dtype=tf.int64, trainable=False),
                        tf.Variable(0, dtype=tf.int64, trainable=False),
                    )
            _start_watchdogs(state)
    return state.launcher


def _start_watchdogs(state: _State) -> None:
    timeout = state.collective_timeout
    if not timeout:
        return
    from tfdist.strategies.watchdog import PeerWatchdog

    me = (state.topo.task_type, state.topo.task_id)
    peers = [f"/job:{job}/replica:0/task:{i}" for job, i, _ in state.topo.tasks if (job, i) != me]
    state.peer_watchdog = PeerWatchdog(peers, timeout).start()
    state.stall_thread = threading.Thread(
        target=_watch_stalls, args=(state,), name="tfdist-hvd-stall", daemon=True
    )
    state.stall_thread.start()


def _watch_stalls(state: _State) -> None:
    """Aborts this process's collectives when one has waited too long.

    Collectives run eagerly are registered by :func:`inflight`; those inside
    a ``tf.function`` (``fit``'s DistributedOptimizer, a tape, ``hvd.*`` in
    the user's step) are bracketed by two counters (:func:`watched`): a
    ``started`` ahead of ``finished`` that does not move for the timeout is a
    collective some rank never joined.
    """
    from tfdist.compat.tf_python import eager_context as context, framework_errors as errors

    interval = min(1.0, state.collective_timeout / 4)
    seen, since = None, time.monotonic()
    while not state.stop.wait(interval):
        now = time.monotonic()
        with state.lock:
            late = [
                (what, now - start)
                for what, start in state.inflight.values()
                if now - start > state.collective_timeout
            ]
        counts = tuple(int(c.numpy()) for c in state.counters) if state.counters else None
        if counts != seen:
            seen, since = counts, now
        elif counts and counts[0] > counts[1] and now - since > state.collective_timeout:
            late.append(
                (
                    "a collective inside a tf.function (DistributedOptimizer, "
                    "DistributedGradientTape or hvd.* in a traced step)",
                    now - since,
                )
            )
        if late and state.aborted is None:
            what, waited = late[0]
            state.aborted = (
                f"{what} waited {waited:.0f} s for the other ranks (collective_timeout="
                f"{state.collective_timeout:g} s): some rank did not issue it. TensorFlow "
                "matches collectives by the order each rank issues them (Horovod matched "
                "them by name): every rank must issue the same collectives in the same order; "
                "keep rank-0-only work (checkpoints, logging) free of collectives"
            )
            log.error("tfdist.horovod: %s", state.aborted)
            context.context().abort_collective_ops(errors.DEADLINE_EXCEEDED, state.aborted)
            return


@contextlib.contextmanager
def inflight(what: str) -> Iterator[None]:
    """Marks an eager collective as waiting, for the stall watchdog; turns an
    abort into :class:`CollectiveTimeoutError`."""
    state = _require()
    if state.aborted is not None:
        raise CollectiveTimeoutError(state.aborted)
    token = next(state.ids)
    with state.lock:
        state.inflight[token] = (what, time.monotonic())
    try:
        yield
    except Exception as error:  # Re-raised with the reason.
        if state.aborted is not None:
            raise CollectiveTimeoutError(state.aborted) from error
        raise
    finally:
        with state.lock:
            state.inflight.pop(token, None)


def watched(run):
    """Runs ``run()``, which issues one collective; inside a ``tf.function``
    it is bracketed by the stall watchdog's counters (see :func:`_watch_stalls`)."""
    import tensorflow as tf

    state = _require()
    if tf.executing_eagerly() or state.counters is None:
        return run()
    started, finished = state.counters
    with tf.control_dependencies([started.assign_add(1)]):
        out = run()
    with tf.control_dependencies([out]):
        done = finished.assign_add(1)
    with tf.control_dependencies([done]):
        return tf.identity(out)


def created_eagerly():
    """Lets variables be created eagerly (under ``init_scope``) during any
    trace of a ``tf.function``, not only its first.

    A step function is often traced again (a Python argument changes) after
    a first trace that created nothing; tf.function then refuses new
    variables ("Creating variables on a non-first call"). Variables created
    under init_scope live outside the graph and need none of tf.function's
    lifting: a creator that goes straight to TensorFlow's default one skips
    that check.
    """
    from tfdist.compat.tf_python import resource_variable_ops, variable_scope

    def direct(next_creator, **kwargs):
        return resource_variable_ops.default_variable_creator_v2(None, **kwargs)

    return variable_scope.variable_creator_scope(direct)
