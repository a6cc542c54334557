"""The Spark side of :func:`tfdist.spark.run`: what each barrier task does.

Each task picks a port, exchanges addresses with the others, builds its
``TF_CONFIG`` and strategy, calls ``train_fn`` with a :class:`TrainContext`, and
encodes a failure (partition, traceback, preemption record) in its exception
message for the driver. Pickled to the executors by reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tfdist.errors import ConfigError, TfdistError

# A failing task puts its partition and traceback in its exception message
# (see _encode_failure); the driver finds them in Spark's error text.
_MARK = "tfdist-task-error"
MARK_RE = re.compile(_MARK + r" (\{.*\})")
_TB_START = "--- traceback of the failed task ---"
_TB_END = "--- end of the traceback ---"
TB_RE = re.compile(re.escape(_TB_START) + r"\n(.*?)\n" + re.escape(_TB_END), re.S)
RESULT_TASK_RE = re.compile(r"ResultTask\(\d+, (\d+)\)")
#: Longest task traceback carried back to the driver, in characters.
_MAX_TRACEBACK = 20_000
# --------------------------------------------------------------------------
# What train_fn gets.


@dataclasses.dataclass
class TrainContext:
    """What ``train_fn`` receives on each Spark task (or reads from
    :func:`context`, when it takes no context argument).

    Attributes:
        strategy: tfdist's ``MultiWorkerMirroredStrategy`` for this task,
            built by :func:`tfdist.strategy_from_config` (with the
            ``compression`` and options given to :func:`run`). Build the
            model and optimizer inside ``strategy.scope()``. In the task,
            ``tfdist.strategy_from_config()`` returns this same strategy.
        worker_index: This task's worker index, equal to its Spark
            partition id. Worker 0 is the chief.
        num_workers: Number of tasks (workers) of the job.
        is_chief: Whether this task is the chief (worker 0): the one whose
            return value :func:`run` returns, and the one that writes
            backups.
        attempt: 0 for the first submission of the job, ``k`` for the k-th
            retry (see ``max_retries``).
        backup_dir: The ``backup_dir`` given to :func:`run` (None if none):
            pass it to :class:`tfdist.training.callbacks.BackupAndRestore` so that a
            retry resumes where the failed attempt left off.
        tf_config: This task's ``TF_CONFIG`` (also set in ``os.environ``).
    """

    strategy: Any
    worker_index: int
    num_workers: int
    is_chief: bool
    attempt: int
    backup_dir: str | None
    tf_config: dict
    _barrier_context: Any = dataclasses.field(default=None, repr=False)

    def all_gather(self, message: str) -> list[str]:
        """Exchanges a string with every task; returns them by worker index.

        Every task must call it the same number of times, or the job waits
        (until :func:`run`'s ``timeout``).
        """
        if not isinstance(message, str):
            raise ConfigError("message", message, "a string", source="TrainContext.all_gather")
        return list(self._barrier_context.allGather(message))

    def barrier(self) -> None:
        """Waits until every task reached this call (same rule as all_gather)."""
        self._barrier_context.barrier()


# --------------------------------------------------------------------------
# The Spark task.


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs; pickled to the executors."""

    train_fn: Callable[..., Any]
    pass_context: bool
    train_kwargs: dict
    num_workers: int
    attempt: int
    compression: Any
    error_feedback: bool | None
    options: dict
    env: dict
    host: str | None
    backup_dir: str | None


def _executor_host(barrier_context: Any, partition: int) -> str:
    """The host of this task's executor, as Spark knows it."""
    address = barrier_context.getTaskInfos()[partition].address
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"


def _preemption_record(error: BaseException) -> dict | None:
    """The status record of a task that saved on preemption and exits
    (tfdist.training.fault_tolerance.preemption.Preempted, a SystemExit), else None."""
    from tfdist.training.fault_tolerance.preemption import Preempted  # No TensorFlow.

    return dict(error.record) if isinstance(error, Preempted) else None


def _encode_failure(spec: TaskSpec, partition: int, error: BaseException) -> str:
    """The message of the exception a failing task raises.

    Readable in Spark's logs as it is, and parsed by the driver: one line of
    JSON after ``tfdist-task-error``, then the task's traceback between two
    marker lines.
    """
    text = traceback.format_exc()
    if len(text) > _MAX_TRACEBACK:
        text = "...\n" + text[-_MAX_TRACEBACK:]
    info = {
        "partition": partition,
        "attempt": spec.attempt,
        "type": type(error).__qualname__,
        "message": str(error)[:2000],
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    record = _preemption_record(error)
    what = f"failed: {type(error).__name__}: {error}"
    if record is not None:
        info["preempted"] = record
        info["message"] = f"saved at step {record.get('step')} and exited with code {error.code}"
        what = f"was preempted: {info['message']}"
    return (
        f"tfdist.spark: task {partition} (worker {partition} of "
        f"{spec.num_workers}) {what}\n"
        f"{_MARK} {json.dumps(info)}\n{_TB_START}\n{text.rstrip()}\n{_TB_END}"
    )


_CURRENT: TrainContext | None = None


def context() -> TrainContext:
    """The :class:`TrainContext` of the Spark task that runs this code.

    For a ``train_fn`` that takes no context argument (as
    spark-tensorflow-distributor's ``train_fn(**kwargs)``): call it inside
    ``train_fn``, e.g. ``tfdist.spark.context().is_chief``.

    Raises:
        TfdistError: Called outside a ``train_fn`` that :func:`run` started.
    """
    if _CURRENT is None:
        raise TfdistError(
            "tfdist.spark.context() works only inside train_fn, on a Spark "
            "task started by tfdist.spark.run(train_fn, ...). Received: a "
            f"call in process {os.getpid()}, outside such a task."
        )
    return _CURRENT


def _call_train_fn(spec: TaskSpec, ctx: TrainContext) -> Any:
    """Calls train_fn in ``ctx.strategy.scope()``, as the anchor's runner does,
    with ``tfdist.spark.context()`` answering ``ctx`` meanwhile, and
    ``tfdist.strategy_from_config()`` answering ``ctx.strategy`` (a train_fn
    that makes its own strategy gets the task's, whose scope it is in)."""
    from tfdist.strategies.provided import provide

    global _CURRENT
    _CURRENT = ctx
    try:
        with (
            provide(
                ctx.strategy,
                tf_config=ctx.tf_config,
                compression=spec.compression,
                error_feedback=spec.error_feedback,
                options=spec.options,
                source="tfdist.spark.run",
            ),
            ctx.strategy.scope(),
        ):
            if spec.pass_context:
                return spec.train_fn(ctx, **spec.train_kwargs)
            return spec.train_fn(**spec.train_kwargs)
    finally:
        _CURRENT = None


def run_task(spec: TaskSpec, _rows: Iterable[Any]) -> Iterator[bytes]:
    """Body of each barrier task: TF_CONFIG, strategy, train_fn, result."""
    from pyspark import BarrierTaskContext

    barrier_context = BarrierTaskContext.get()
    partition = barrier_context.partitionId()
    try:
        os.environ.update(spec.env)
        # Read by tfdist.training.fault_tolerance.preemption (its keys and status record).
        os.environ["TFDIST_LAUNCH_ATTEMPT"] = str(spec.attempt)
        host = spec.host or _executor_host(barrier_context, partition)
        from tfdist.engines.net import free_ports

        port = free_ports(1, host)[0]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        addresses = barrier_context.allGather(address)
        tf_config = {
            "cluster": {"worker": list(addresses)},
            "task": {"type": "worker", "index": partition},
        }
        os.environ["TF_CONFIG"] = json.dumps(tf_config)

        from tfdist.strategies import strategy_from_config

        strategy = strategy_from_config(
            tf_config,
            strategy="multi_worker_mirrored",
            compression=spec.compression,
            error_feedback=spec.error_feedback,
            **spec.options,
        )
        ctx = TrainContext(
            strategy=strategy,
            worker_index=partition,
            num_workers=spec.num_workers,
            is_chief=partition == 0,
            attempt=spec.attempt,
            backup_dir=spec.backup_dir,
            tf_config=tf_config,
            _barrier_context=barrier_context,
        )
        result = _call_train_fn(spec, ctx)
        payload = None
        if partition == 0:
            from pyspark import cloudpickle

            try:
                payload = cloudpickle.dumps(result)
            except Exception as error:
                raise TypeError(
                    "train_fn's return value on the chief must be picklable. "
                    f"Received: {type(result).__name__} ({error})"
                ) from error
        # Worker 0 leads TensorFlow's coordination service: no task leaves
        # (and its process exits) while another may still talk to it.
        barrier_context.barrier()
    except BaseException as error:  # noqa: BLE001 - every failure goes back
        if _preemption_record(error) is not None:
            # Every task agreed on this step and saved (the chief writes the
            # backup). The first task to fail makes Spark kill the others:
            # wait until all of them are done saving.
            barrier_context.barrier()
        raise RuntimeError(_encode_failure(spec, partition, error)) from None
    if payload is not None:
        yield payload
