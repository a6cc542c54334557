"""A second multi-worker strategy in a process whose collectives already run.

Every ``MultiWorkerMirroredStrategy`` enables collective ops. The first one
starts this task's server; each later one (TensorFlow's own too) calls
``enable_collective_ops`` again, which replaces the server's collective
executor manager (``GrpcServer::UpdateServerDef``) and drops what the old
one held. Workers create their strategies at slightly different times, so
when a peer is ahead, its first collective of the new strategy (the
broadcast of the first variable's initial value) reaches this task's *old*
manager, which is then replaced under it. Measured on TF 2.21, 2 workers,
worker:0 behind: with tfdist's fresh group keys both tasks waited forever
at 0% CPU (the group request was lost with the old manager; 2 of 3 runs of
a corpus fit with a new strategy per model); with TensorFlow's own strategy,
which reuses its keys, worker:1 failed with "Delete called on non-empty
BufRendezvous".

:func:`in_step` makes every task swap managers together: a
coordination-service barrier before ``enable_collective_ops`` (no task still
uses the old manager) and one after (no task sends to a peer's old
manager). A task that never creates the matching strategy fails the
barrier after ``register_timeout`` with :class:`ClusterJoinError` instead
of waiting forever.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import Iterator

from tfdist.compat.tf_python import eager_context as context
from tfdist.strategies.base import ClusterJoinError

__all__ = ["collectives_running", "in_step"]

#: Strategies this process built on a running collective server; the same
#: sequence on every task, so each names the same barriers.
_rejoins = itertools.count(1)


def collectives_running() -> bool:
    """Whether this process already enabled collective ops (has a server)."""
    return getattr(context.context(), "_collective_ops_server_def", None) is not None


@contextlib.contextmanager
def in_step(task: str, register_timeout: float) -> Iterator[None]:
    """Runs a strategy's construction in step with every other task.

    Does nothing for the process's first multi-worker strategy (the
    coordination service's registration barrier already aligns the tasks).

    Args:
        task: This task, e.g. ``"worker:0"``, named in errors.
        register_timeout: Seconds every task has to reach each barrier.

    Raises:
        ClusterJoinError: A task did not create its matching strategy within
            ``register_timeout``.
    """
    if not collectives_running():
        yield
        return
    number = next(_rejoins)
    _meet(f"tfdist/strategy/{number}/before", number, task, register_timeout)
    yield
    _meet(f"tfdist/strategy/{number}/after", number, task, register_timeout)


#: A task in TensorFlow's barrier errors, e.g. ``/job:worker/replica:0/task:1``.
_TASK_NAME = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")


def _meet(barrier: str, number: int, task: str, timeout: float) -> None:
    started = time.monotonic()
    try:
        context.context().wait_at_barrier(barrier, int(timeout * 1000))
    except Exception as error:  # noqa: BLE001 - any failure: the tasks are out of step
        text = str(error).strip()
        tail = text.split("timed out task names:", 1)
        missing = (
            sorted({f"{job}:{i}" for job, i in _TASK_NAME.findall(tail[-1])} - {task})
            if len(tail) == 2
            else []
        )
        raise ClusterJoinError(
            f"Expected every task of the cluster to create its multi-worker strategy "
            f"#{number + 1} of this process within register_timeout={timeout:g}s; "
            f"this task ({task}) waited {time.monotonic() - started:.0f}s at barrier "
            f"{barrier!r} and {', '.join(missing) or 'not every task'} did not arrive. "
            "Every task must create the same "
            "strategies in the same order (a strategy per model in a loop is fine; a "
            "strategy only the chief creates is not), or raise register_timeout when "
            f"tasks do long uneven work between them. TensorFlow said: "
            f"{type(error).__name__}: {(text.splitlines() or [''])[0][:300]}"
        ) from None
