"""Run a Keras training function on Spark, one TensorFlow worker per barrier task.

:func:`run` starts ``num_workers`` Spark tasks together (barrier execution
mode: all of them or none). Each task picks a free port on its executor's
host, the tasks exchange their addresses with
``BarrierTaskContext.allGather``, and every task gets its own ``TF_CONFIG``
(``worker`` job, index = Spark partition id; worker 0 is the chief) and a
tfdist :class:`~tfdist.strategies.MultiWorkerMirroredStrategy`, which includes
the Keras 3 ``fit`` fix. Then it calls ``train_fn(ctx)`` with a
:class:`TrainContext`, inside the strategy's scope::

    from tfdist.engines import spark as tfspark

    def train(ctx):
        with ctx.strategy.scope():
            model = build_and_compile()
        model.fit(data, epochs=5,
                  callbacks=[tfdist.BackupAndRestore(ctx.backup_dir)])
        return model.get_weights()          # only the chief's is returned

    session = tfspark.local_session(2)      # or your own SparkSession
    weights = tfspark.run(train, num_workers=2, backup_dir="/shared/backup")

As spark-tensorflow-distributor's ``MirroredStrategyRunner.run(train_fn,
**kwargs)``: ``run(train_fn, num_workers=2, epochs=3)`` calls
``train_fn(epochs=3)`` when its first parameter is not a required
positional one (the context is then :func:`context`), and with no active
session gets one from ``SparkSession.builder.getOrCreate()`` with the
settings below (the loopback ones for a local master only).

Failures: when one task fails, Spark aborts the barrier stage as a whole and
kills the other tasks; :func:`run` raises :class:`SparkJobError` with the
failing task's partition and Python traceback. Spark does not retry a failed
barrier result stage, so :func:`run` does: ``max_retries=N`` submits the job
again (new processes, new ports), and ``train_fn`` resumes from
``backup_dir`` through :class:`tfdist.training.callbacks.BackupAndRestore`.
A preempted attempt (SIGTERM to a task: every task stops after the same
step, the chief backs up there, and the tasks wait for each other before
they fail the stage, so that Spark cannot kill the chief mid-save) is
reported as :attr:`SparkJobError.preempted`, and the next attempt resumes
at that step. ``timeout`` bounds the whole run: its Spark job group is
cancelled when it runs out. (Spark 4.3 quirk: a task killed while it waits in ``allGather`` or
``barrier`` makes its executor exit with code 50; Spark starts a new one.)

pyspark is optional (``pip install 'tfdist[spark]'``); importing this module
does not import pyspark, nor TensorFlow on the driver.

Spark settings this needs (:func:`local_session` sets them, and so does
:func:`run` on the session it creates):

* ``spark.python.worker.reuse=false``. TensorFlow's collectives can be set up
  once per process; a reused Python worker fails the next job with
  "Collective ops are already configured", or hangs, and keeps TensorFlow's
  server and memory alive between jobs. :func:`run` refuses a session
  without it.
* ``spark.scheduler.barrier.maxConcurrentTasksCheck.interval`` low (e.g.
  ``1s``): otherwise a job sent before the executors registered waits 15 s
  per check. :func:`run` also waits for enough task slots first.
* For jobs on one machine, everything on loopback: ``SPARK_LOCAL_IP``,
  ``spark.driver.host`` and ``spark.driver.bindAddress`` = ``127.0.0.1``.

Note that TensorFlow's gRPC server listens on every interface (``*:PORT``),
whatever host the cluster spec names, without authentication.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import pickle
import re
import socket
import sys
import time
import traceback
import uuid
from typing import Any, Callable, Iterable, Iterator, Mapping

from tfdist.errors import ConfigError, TfdistError, require_int

__all__ = [
    "INSTALL_HINT",
    "SparkJobError",
    "SparkTimeoutError",
    "TrainContext",
    "context",
    "local_session",
    "run",
]

#: How to install what this module needs.
INSTALL_HINT = "pip install 'tfdist[spark]'"

_SOURCE = "tfdist.engines.spark.run"

#: Settings :func:`run` needs on any master; it gives them to the session it
#: creates when none is active.
SESSION_SETTINGS: dict[str, str] = {
    "spark.python.worker.reuse": "false",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
}
#: Added for a local master (``local``, ``local[N]``, ``local-cluster[...]``):
#: the driver and the tasks stay on loopback.
LOOPBACK_SETTINGS: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}
#: Settings :func:`local_session` applies (before the caller's ``conf``).
LOCAL_SETTINGS: dict[str, str] = {
    **SESSION_SETTINGS,
    **LOOPBACK_SETTINGS,
    "spark.ui.enabled": "false",
}

# A failing task puts its partition and traceback in its exception message
# (see _encode_failure); the driver finds them in Spark's error text.
_MARK = "tfdist-task-error"
_MARK_RE = re.compile(_MARK + r" (\{.*\})")
_TB_START = "--- traceback of the failed task ---"
_TB_END = "--- end of the traceback ---"
_TB_RE = re.compile(re.escape(_TB_START) + r"\n(.*?)\n" + re.escape(_TB_END), re.S)
_RESULT_TASK_RE = re.compile(r"ResultTask\(\d+, (\d+)\)")
#: Longest task traceback carried back to the driver, in characters.
_MAX_TRACEBACK = 20_000


class SparkJobError(TfdistError, RuntimeError):
    """The Spark job of :func:`run` failed.

    Attributes:
        partition: The Spark partition (= worker index) of the task that
            failed first, or None when Spark did not say (an executor lost).
        attempt: The submission that failed, 0-based (see ``max_retries``).
        task_traceback: The failing task's Python traceback, or None.
        spark_message: Spark's own error text, without Java stack frames.
        failures: The errors of the earlier submissions, oldest first.
        preempted: When the attempt ended on a preemption (a task got
            SIGTERM, or ``$TFDIST_PREEMPT_SIGNAL``, and every task saved at
            one step): that task's status record (``step``, ``epoch``,
            ``batch``, ``signal_time``, ``saved_time``...); else None.
    """

    def __init__(self, message: str, *, partition: int | None = None,
                 attempt: int = 0, task_traceback: str | None = None,
                 spark_message: str | None = None,
                 failures: tuple["SparkJobError", ...] = (),
                 preempted: dict | None = None) -> None:
        super().__init__(message)
        self.partition = partition
        self.attempt = attempt
        self.task_traceback = task_traceback
        self.spark_message = spark_message
        self.failures = tuple(failures)
        self.preempted = preempted


class SparkTimeoutError(SparkJobError, TimeoutError):
    """:func:`run` did not finish within its ``timeout``; the job was cancelled."""


def _pyspark():
    """Imports pyspark, or says how to install it."""
    try:
        import pyspark
    except ImportError as error:
        raise ImportError(
            "tfdist.engines.spark needs pyspark (4.x), which is not installed "
            f"({error}). Install it with: {INSTALL_HINT}") from error
    return pyspark


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
            model and optimizer inside ``strategy.scope()``.
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
            raise ConfigError("message", message, "a string",
                              source="TrainContext.all_gather")
        return list(self._barrier_context.allGather(message))

    def barrier(self) -> None:
        """Waits until every task reached this call (same rule as all_gather)."""
        self._barrier_context.barrier()


# --------------------------------------------------------------------------
# The Spark task.


@dataclasses.dataclass(frozen=True)
class _TaskSpec:
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
    (tfdist.training.preemption.Preempted, a SystemExit), else None."""
    from tfdist.training.preemption import Preempted  # No TensorFlow.
    return dict(error.record) if isinstance(error, Preempted) else None


def _encode_failure(spec: _TaskSpec, partition: int, error: BaseException) -> str:
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
        info["message"] = (f"saved at step {record.get('step')} and exited with "
                           f"code {error.code}")
        what = f"was preempted: {info['message']}"
    return (f"tfdist.engines.spark: task {partition} (worker {partition} of "
            f"{spec.num_workers}) {what}\n"
            f"{_MARK} {json.dumps(info)}\n{_TB_START}\n{text.rstrip()}\n{_TB_END}")


_CURRENT: TrainContext | None = None


def context() -> TrainContext:
    """The :class:`TrainContext` of the Spark task that runs this code.

    For a ``train_fn`` that takes no context argument (as
    spark-tensorflow-distributor's ``train_fn(**kwargs)``): call it inside
    ``train_fn``, e.g. ``tfdist.engines.spark.context().is_chief``.

    Raises:
        TfdistError: Called outside a ``train_fn`` that :func:`run` started.
    """
    if _CURRENT is None:
        raise TfdistError(
            "tfdist.engines.spark.context() works only inside train_fn, on a Spark "
            "task started by tfdist.engines.spark.run(train_fn, ...). Received: a "
            f"call in process {os.getpid()}, outside such a task.")
    return _CURRENT


def _call_train_fn(spec: _TaskSpec, ctx: TrainContext) -> Any:
    """Calls train_fn in ``ctx.strategy.scope()``, as the anchor's runner does,
    with ``tfdist.engines.spark.context()`` answering ``ctx`` meanwhile."""
    global _CURRENT
    _CURRENT = ctx
    try:
        with ctx.strategy.scope():
            if spec.pass_context:
                return spec.train_fn(ctx, **spec.train_kwargs)
            return spec.train_fn(**spec.train_kwargs)
    finally:
        _CURRENT = None


def _run_task(spec: _TaskSpec, _rows: Iterable[Any]) -> Iterator[bytes]:
    """Body of each barrier task: TF_CONFIG, strategy, train_fn, result."""
    from pyspark import BarrierTaskContext

    barrier_context = BarrierTaskContext.get()
    partition = barrier_context.partitionId()
    try:
        os.environ.update(spec.env)
        # Read by tfdist.training.preemption (its keys and status record).
        os.environ["TFDIST_LAUNCH_ATTEMPT"] = str(spec.attempt)
        host = spec.host or _executor_host(barrier_context, partition)
        from tfdist.engines.net import free_ports
        port = free_ports(1, host)[0]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        addresses = barrier_context.allGather(address)
        tf_config = {"cluster": {"worker": list(addresses)},
                     "task": {"type": "worker", "index": partition}}
        os.environ["TF_CONFIG"] = json.dumps(tf_config)

        from tfdist.strategies import strategy_from_config
        strategy = strategy_from_config(
            tf_config, strategy="multi_worker_mirrored",
            compression=spec.compression, error_feedback=spec.error_feedback,
            **spec.options)
        ctx = TrainContext(
            strategy=strategy, worker_index=partition,
            num_workers=spec.num_workers, is_chief=partition == 0,
            attempt=spec.attempt, backup_dir=spec.backup_dir,
            tf_config=tf_config, _barrier_context=barrier_context)
        result = _call_train_fn(spec, ctx)
        payload = None
        if partition == 0:
            from pyspark import cloudpickle
            try:
                payload = cloudpickle.dumps(result)
            except Exception as error:
                raise TypeError(
                    "train_fn's return value on the chief must be picklable. "
                    f"Received: {type(result).__name__} ({error})") from error
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


# --------------------------------------------------------------------------
# The driver.


def _is_local_master(master: str | None) -> bool:
    """Whether a Spark master URL runs everything on this machine."""
    return bool(master) and (master == "local" or master.startswith(
        ("local[", "local-cluster[")))


def _new_session_settings() -> tuple[dict[str, str], str | None]:
    """The settings for the session :func:`run` creates, and its master.

    Starts (or joins, under spark-submit) Spark's JVM first, without a
    SparkContext, to read the master it was given: spark-submit's
    ``--master``, ``spark-defaults.conf``, or ``local[*]`` for plain
    ``python``. Only a local master gets the loopback settings.
    """
    pyspark = _pyspark()
    settings = dict(SESSION_SETTINGS)
    try:
        pyspark.SparkContext._ensure_initialized()
        conf = pyspark.SparkConf(_jvm=pyspark.SparkContext._jvm)
        master = conf.get("spark.master", None)
    except Exception:  # A private API: then only the settings of any master.
        return settings, None
    if _is_local_master(master):
        settings.update(LOOPBACK_SETTINGS)
        if not (conf.contains("spark.pyspark.python")
                or os.environ.get("PYSPARK_PYTHON")):
            # The executors' Python is this one, which has tfdist.
            settings["spark.pyspark.python"] = sys.executable
    return settings, master


def _get_or_create_session():
    """``SparkSession.builder.getOrCreate()`` with what :func:`run` needs."""
    from pyspark.sql import SparkSession
    settings, master = _new_session_settings()
    builder = SparkSession.builder
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    from absl import logging
    logging.info("tfdist.engines.spark.run: no active Spark session; started one "
                 "with SparkSession.builder.getOrCreate() (master %s) and %s",
                 session.sparkContext.master,
                 ", ".join(f"{k}={v}" for k, v in settings.items()))
    return session, master


def _context_of(spark: Any) -> tuple[Any, bool]:
    """The SparkContext to run on, and whether :func:`run` created it on a
    local master.

    ``spark`` is a SparkSession or SparkContext; None means the active
    session or context, else a new session from
    ``SparkSession.builder.getOrCreate()``.
    """
    pyspark = _pyspark()
    if spark is None:
        from pyspark.sql import SparkSession
        spark = (SparkSession.getActiveSession()
                 or pyspark.SparkContext._active_spark_context)
        if spark is None:
            session, master = _get_or_create_session()
            return _context_of(session)[0], _is_local_master(master)
    if isinstance(spark, pyspark.SparkContext):
        return spark, False
    if hasattr(spark, "sparkContext"):
        try:
            return spark.sparkContext, False
        except Exception as error:  # Spark Connect sessions have none.
            raise ConfigError(
                "spark", spark, "a classic SparkSession (with a SparkContext)",
                source=_SOURCE, hint="Spark Connect sessions have no RDD "
                f"barrier mode. Spark said: {error}") from None
    raise ConfigError("spark", spark, "a SparkSession, a SparkContext or None",
                      source=_SOURCE)


def _check_worker_reuse(sc: Any) -> None:
    value = sc.getConf().get("spark.python.worker.reuse", "true")
    if str(value).strip().lower() != "false":
        raise ConfigError(
            "spark.python.worker.reuse", value, "'false'", source=_SOURCE,
            hint="TensorFlow's collectives can be configured once per "
            "process: a reused Python worker fails the next job ('Collective "
            "ops are already configured') or hangs. Build the session with "
            ".config('spark.python.worker.reuse', 'false') (it cannot be "
            "changed on a running session), or use tfdist.engines.spark.local_session()")


def _task_slots(sc: Any) -> int | None:
    """Tasks Spark can run at once now, or None if it cannot be told."""
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # A private API: leave the check to Spark.
        return None


def _wait_for_slots(sc: Any, num_workers: int, seconds: float) -> int | None:
    """Waits until Spark has ``num_workers`` task slots; returns the slots."""
    deadline = time.monotonic() + seconds
    while True:
        slots = _task_slots(sc)
        if slots is None or slots >= num_workers or time.monotonic() >= deadline:
            return slots
        time.sleep(0.25)


def _without_java_frames(text: str, limit: int = 60) -> str:
    lines = [line for line in text.splitlines()
             if not line.lstrip().startswith("at ")
             and not line.lstrip().startswith("... ")]
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more lines)"]
    return "\n".join(lines)


def _job_error(error: BaseException, attempt: int, attempts: int,
               num_workers: int) -> SparkJobError:
    """Turns Spark's error into a SparkJobError with the task's traceback."""
    text = str(error)
    spark_message = _without_java_frames(text)
    where = f"attempt {attempt + 1} of {attempts}"
    match = _MARK_RE.search(text)
    if match:
        info = json.loads(match.group(1))
        found = _TB_RE.search(text, match.end())
        task_traceback = found.group(1) if found else "(not found in Spark's message)"
        partition = int(info["partition"])
        preempted = info.get("preempted")
        if preempted is not None:
            message = (
                f"{_SOURCE}: the job was preempted on {where}: every task "
                f"stopped after step {preempted.get('step')} (epoch "
                f"{preempted.get('epoch')}, batch {preempted.get('batch')}), the "
                "chief saved a backup there, and the tasks exited with code "
                f"{_preempted_exit_code()}. A new attempt resumes at that step "
                "from backup_dir.")
        else:
            message = (
                f"{_SOURCE}: Spark task {partition} (worker {partition} of "
                f"{num_workers}, on {info['host']}, pid {info['pid']}) failed on "
                f"{where}: {info['type']}: {info['message']}\n"
                "Spark aborted the barrier stage and stopped the other tasks.\n\n"
                f"Traceback of task {partition}:\n{task_traceback}")
        return SparkJobError(message, partition=partition, attempt=attempt,
                             task_traceback=task_traceback,
                             spark_message=spark_message, preempted=preempted)
    found = _RESULT_TASK_RE.search(text)
    partition = int(found.group(1)) if found else None
    who = f"task {partition}" if partition is not None else "a task"
    message = (f"{_SOURCE}: the Spark job failed on {where} ({who}; the "
               "failure came from outside train_fn, e.g. a lost executor or "
               f"a killed Python worker). Spark said:\n{spark_message}")
    return SparkJobError(message, partition=partition, attempt=attempt,
                         spark_message=spark_message)


def _preempted_exit_code() -> int:
    from tfdist.training.preemption import PREEMPTED_EXIT_CODE  # No TensorFlow.
    return PREEMPTED_EXIT_CODE


def _submit(sc: Any, spec: _TaskSpec, seconds: float | None,
            attempts: int, timeout: float | None) -> Any:
    """Runs one barrier job within ``seconds``; returns the chief's result."""
    pyspark = _pyspark()
    group = f"tfdist-{uuid.uuid4().hex[:12]}"
    box: dict[str, Any] = {}

    def job() -> None:
        sc.setJobGroup(group, f"tfdist.engines.spark.run: {spec.num_workers} workers, "
                       f"attempt {spec.attempt + 1}", interruptOnCancel=True)
        try:
            rdd = sc.parallelize(range(spec.num_workers), spec.num_workers)
            box["rows"] = (rdd.barrier()
                           .mapPartitions(functools.partial(_run_task, spec))
                           .collect())
        except BaseException as error:  # noqa: BLE001 - re-raised below
            box["error"] = error

    thread = pyspark.InheritableThread(target=job, daemon=True,
                                       name=f"{group}-collect")
    thread.start()
    try:
        thread.join(seconds)
    except BaseException:  # KeyboardInterrupt in a notebook: stop the tasks.
        sc.cancelJobGroup(group)
        raise
    if thread.is_alive():
        sc.cancelJobGroup(group)
        thread.join(60)
        raise SparkTimeoutError(
            f"{_SOURCE}: the job did not finish within timeout={timeout:g} s "
            f"(the whole run; this was attempt {spec.attempt + 1} of "
            f"{attempts}); its Spark job group {group!r} was cancelled, which "
            "kills its tasks. Raise timeout= if training needs longer. A hung "
            "peer is caught by collective_timeout= (default 600 s), a peer "
            "that never joins by register_timeout= (default 120 s).",
            attempt=spec.attempt)
    if "error" in box:
        error = box["error"]
        if _is_spark_error(error):
            raise _job_error(error, spec.attempt, attempts,
                             spec.num_workers) from error
        raise error
    rows = box["rows"]
    if len(rows) != 1:
        raise SparkJobError(
            f"{_SOURCE}: expected one result, from the chief (task 0). "
            f"Received: {len(rows)}", attempt=spec.attempt)
    return pickle.loads(rows[0])


def _is_spark_error(error: BaseException) -> bool:
    """Whether ``error`` is Spark's report of a failed job."""
    try:
        from py4j.protocol import Py4JJavaError
    except ImportError:  # pragma: no cover - py4j comes with pyspark
        return False
    if isinstance(error, Py4JJavaError):
        return True
    try:
        from pyspark.errors import PySparkException
    except ImportError:  # pragma: no cover - pyspark < 3.4
        return False
    return isinstance(error, PySparkException)


def _check_env(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(
            isinstance(k, str) and k and "=" not in k and isinstance(v, str)
            for k, v in env.items()):
        raise ConfigError("env", env, "a mapping of variable names to string "
                          "values, e.g. {'TF_CPP_MIN_LOG_LEVEL': '2'}",
                          source=_SOURCE)
    return dict(env)


def _check_seconds(field: str, value: Any, *, allow_none: bool,
                   allow_zero: bool = False) -> float | None:
    if allow_none and (value is None or value == math.inf):
        return None
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and not math.isnan(value) and (value >= 0 if allow_zero else value > 0))
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(field, value, f"a number of seconds {bound}"
                          + (" or None" if allow_none else ""), source=_SOURCE)
    return float(value)


def _check_backup_dir(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("backup_dir", value, "None or a directory path "
                          "that every executor sees", source=_SOURCE)
    return value


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY,
               inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD,
               inspect.Parameter.KEYWORD_ONLY)


def _plan_call(train_fn: Callable[..., Any],
               kwargs: Mapping[str, Any]) -> tuple[bool, dict, dict]:
    """How each task calls ``train_fn``: (pass the context?, its keyword
    arguments, the strategy options), from ``run``'s extra keywords.

    ``train_fn`` gets the :class:`TrainContext` first when its first
    parameter is positional, required, and named by no keyword; otherwise it
    is called as ``train_fn(**kwargs)``, as spark-tensorflow-distributor
    calls it. A keyword goes to ``train_fn`` when it names one of its
    parameters (or it takes ``**kwargs``), else to the strategy when it is
    one of :func:`tfdist.strategy_from_config`'s options.
    """
    from tfdist.spec.options import StrategyOptions
    option_names = {f.name for f in dataclasses.fields(StrategyOptions)}
    try:
        signature = inspect.signature(train_fn)
    except (TypeError, ValueError):  # Some builtins and C callables.
        signature = None
    params = list(signature.parameters.values()) if signature else []
    first = params[0] if params else None
    pass_context = signature is None or (
        first is not None and first.kind in _POSITIONAL
        and first.default is inspect.Parameter.empty and first.name not in kwargs)
    named = {p.name for p in params[1 if pass_context else 0:]
             if p.kind in _BY_KEYWORD}
    any_keyword = signature is None or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    train_kwargs: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in named and name in option_names:
            raise ConfigError(
                name, value, "a keyword that names either a parameter of "
                "train_fn or a strategy option, not both", source=_SOURCE,
                hint=f"train_fn has a parameter {name!r}, which is also an "
                "option of tfdist.strategy_from_config: rename the parameter")
        if name in named:
            train_kwargs[name] = value
        elif name in option_names:
            options[name] = value
        elif any_keyword and signature is not None:
            train_kwargs[name] = value
        elif name in ("strategy", "config"):
            raise ConfigError(name, value, "no such option (tfdist.engines.spark "
                              "builds each task's TF_CONFIG and always uses "
                              "the multi_worker_mirrored strategy)",
                              source=_SOURCE)
        else:
            raise ConfigError(
                name, value, "a parameter of train_fn ("
                + (", ".join(sorted(named)) or "it has none") + ") or an "
                "option of tfdist.strategy_from_config ("
                + ", ".join(sorted(option_names)) + ")", source=_SOURCE)
    if signature is not None:
        try:
            signature.bind(*([None] if pass_context else []), **train_kwargs)
        except TypeError as error:
            shown = ", ".join(["ctx"] * pass_context
                              + [f"{k}=..." for k in train_kwargs])
            raise ConfigError(
                "train_fn", train_fn, f"a function the tasks can call as "
                f"train_fn({shown})", source=_SOURCE,
                hint=f"Python says: {error}. A required first positional "
                "parameter gets the TrainContext; pass the others as keywords "
                "of run()") from None
    return pass_context, train_kwargs, options


def run(train_fn: Callable[..., Any], num_workers: int, *,
        spark: Any = None, compression: Any = None,
        error_feedback: bool | None = None, backup_dir: str | os.PathLike | None = None,
        max_retries: int = 0, timeout: float | None = 24 * 3600.0,
        env: Mapping[str, str] | None = None, host: str | None = None,
        wait_for_slots: float = 60.0, **kwargs: Any) -> Any:
    """Runs ``train_fn`` on ``num_workers`` Spark barrier tasks.

    Each task builds its ``TF_CONFIG`` (job ``worker``, index = its Spark
    partition id, worker 0 = chief), then tfdist's MultiWorkerMirrored
    strategy through :func:`tfdist.strategy_from_config`, and calls
    ``train_fn`` inside that strategy's scope, as spark-tensorflow-
    distributor's ``MirroredStrategyRunner`` does: either
    ``train_fn(ctx, **kwargs)`` with a :class:`TrainContext` (``ctx.strategy``,
    ``ctx.worker_index``, ``ctx.is_chief``, ``ctx.attempt``,
    ``ctx.backup_dir``...), or ``train_fn(**kwargs)`` (then
    :func:`context` returns it). Every task must train under that strategy:
    the tasks meet in every all-reduce.

    Args:
        train_fn: ``train_fn(ctx, **kwargs)`` or ``train_fn(**kwargs)``;
            it gets the context when its first parameter is positional,
            without default, and named by no keyword. Pickled to the
            executors with cloudpickle, so it may be defined in a notebook;
            whatever it imports must be installed there (tfdist included).
        num_workers: Number of workers (Spark tasks); at most the task
            slots of the cluster, since barrier tasks all run at once.
        spark: A SparkSession or SparkContext. Default: the active session
            or context; with none, ``SparkSession.builder.getOrCreate()``
            with ``spark.python.worker.reuse=false`` and a 1 s barrier slot
            check, and, for a local master (plain ``python`` gets
            ``local[*]``), the driver on 127.0.0.1, the tasks' servers on
            127.0.0.1 and this Python for the executors. A given or active
            session is used as it is, and must have
            ``spark.python.worker.reuse=false``.
        compression: Gradient compression, as for
            :func:`tfdist.strategy_from_config` (e.g. ``"fp16"``,
            ``"powersgd:4"``); the strategy reports it as
            ``ctx.strategy.compression``.
        error_feedback: As for :func:`tfdist.strategy_from_config`.
        backup_dir: A directory every executor sees (a shared filesystem),
            handed to ``train_fn`` as ``ctx.backup_dir`` for
            :class:`tfdist.training.callbacks.BackupAndRestore`.
        max_retries: Submissions of the job after a failed one. Spark does
            not retry a failed barrier result stage itself; each retry
            starts every task again in new processes on new ports, and
            ``train_fn`` resumes from ``backup_dir``. A preempted attempt
            (see :class:`SparkJobError`) counts as a failed one; its retry
            resumes at the step where every task saved.
        timeout: Seconds for the whole run, retries included; then the
            Spark job group is cancelled (its tasks are killed) and
            :class:`SparkTimeoutError` is raised. None: no limit.
        env: Environment variables set in each task before TensorFlow
            starts, e.g. ``{"TF_CPP_MIN_LOG_LEVEL": "2"}``.
        host: Address every task gives the others, e.g. ``"127.0.0.1"``:
            the same for all tasks, so only for executors on one machine.
            Default: each executor's host, as Spark knows it.
        wait_for_slots: Seconds to wait for executors to offer
            ``num_workers`` task slots before failing.
        **kwargs: Keyword arguments of ``train_fn`` (those that name its
            parameters, or all when it takes ``**kwargs``), and options of
            :func:`tfdist.strategy_from_config`, e.g.
            ``collective_timeout=300``, ``register_timeout=60``,
            ``communication="RING"``. A name that is both is refused.

    Returns:
        What ``train_fn`` returned on the chief (worker 0); the other
        tasks' return values are dropped (use ``ctx.all_gather`` to collect
        something from every task).

    Raises:
        ConfigError: A bad argument or option, a keyword neither
            ``train_fn`` nor the strategy takes, a ``train_fn`` that cannot
            be called with them, a session with Python worker reuse, or more
            workers than task slots. The message names the field and the
            value received.
        SparkJobError: A task failed on the last allowed attempt: the message
            has the failing partition and that task's traceback; the
            earlier attempts' errors are in ``failures``.
        SparkTimeoutError: ``timeout`` ran out.
        ImportError: pyspark is not installed.
    """
    if not callable(train_fn):
        raise ConfigError("train_fn", train_fn, "a callable: train_fn(ctx, "
                          "**kwargs) or train_fn(**kwargs)", source=_SOURCE)
    require_int("num_workers", num_workers, 1, source=_SOURCE)
    require_int("max_retries", max_retries, 0, source=_SOURCE)
    timeout = _check_seconds("timeout", timeout, allow_none=True)
    wait_for_slots = _check_seconds("wait_for_slots", wait_for_slots,
                                    allow_none=False, allow_zero=True)
    backup_dir = _check_backup_dir(backup_dir)
    env = _check_env(env)
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise ConfigError("host", host, "None or a host name or IP address",
                          source=_SOURCE)
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ConfigError("error_feedback", error_feedback, "None, True or False",
                          source=_SOURCE)
    pass_context, train_kwargs, options = _plan_call(train_fn, kwargs)
    # Fail here, not in every task: the options and compression, checked
    # without TensorFlow (the tasks read their own environment).
    from tfdist.compression import parse_compression
    from tfdist.spec.options import make_options
    parse_compression(compression)
    make_options(env={}, **options)

    sc, created_local = _context_of(spark)
    if created_local and host is None:
        host = "127.0.0.1"  # Every task runs on this machine.
    _check_worker_reuse(sc)
    slots = _wait_for_slots(sc, num_workers, wait_for_slots)
    if slots is not None and slots < num_workers:
        raise ConfigError(
            "num_workers", num_workers,
            f"at most {slots}, the task slots this Spark cluster has",
            source=_SOURCE, hint="Barrier tasks run all at once, one slot "
            "each: add executors or cores, or lower num_workers.")
    if max_retries and backup_dir is None:
        from absl import logging
        logging.warning("tfdist.engines.spark.run: max_retries=%d without backup_dir: "
                        "a retry trains from the start.", max_retries)

    deadline = None if timeout is None else time.monotonic() + timeout
    attempts = max_retries + 1
    failures: list[SparkJobError] = []
    for attempt in range(attempts):
        spec = _TaskSpec(train_fn=train_fn, pass_context=pass_context,
                         train_kwargs=dict(train_kwargs), num_workers=num_workers,
                         attempt=attempt, compression=compression,
                         error_feedback=error_feedback, options=dict(options),
                         env=env, host=host, backup_dir=backup_dir)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return _submit(sc, spec, left, attempts, timeout)
        except SparkTimeoutError as error:
            error.failures = tuple(failures)
            raise
        except SparkJobError as error:
            error.failures = tuple(failures)
            failures.append(error)
            if attempt + 1 == attempts:
                raise
            from absl import logging
            if error.preempted is not None:
                logging.warning(
                    "tfdist.engines.spark.run: attempt %d of %d was preempted and saved at "
                    "step %s; submitting the job again (it resumes at that step "
                    "from backup_dir).", attempt + 1, attempts,
                    error.preempted.get("step"))
                continue
            logging.warning("tfdist.engines.spark.run: attempt %d of %d failed; "
                            "submitting the job again%s.\n%s", attempt + 1,
                            attempts, " (train_fn resumes from backup_dir)"
                            if backup_dir else "", error)
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------
# A session for one machine.


def local_session(num_workers: int = 2, *, master: str | None = None,
                  app_name: str = "tfdist",
                  conf: Mapping[str, str] | None = None,
                  wait_for_slots: float = 60.0):
    """Starts a SparkSession on this machine, set up for :func:`run`.

    Everything stays on 127.0.0.1 (``SPARK_LOCAL_IP``, the driver's host
    and bind address), Python workers are not reused, the barrier slot
    check runs every second, and the web UI is off. Then it waits until
    the executors offer ``num_workers`` task slots.

    Args:
        num_workers: Task slots needed; the default master is
            ``local[num_workers]``.
        master: E.g. ``"local-cluster[2,1,1024]"`` (2 executor processes of 1
            core and 1024 MB, like a small real cluster).
        app_name: The Spark application name.
        conf: More Spark settings; they override the ones above.
        wait_for_slots: Seconds to wait for the executors.

    With ``local-cluster``, the executors (and the tasks' Python output)
    log to ``$SPARK_HOME/work/<application id>/<executor id>/stderr``;
    ``SPARK_HOME`` is the pyspark package's directory for a pip install.

    Returns:
        The SparkSession. Stop it with ``session.stop()``.

    Raises:
        ConfigError: Bad arguments, or a SparkContext already running in
            this process (its settings cannot be changed).
        ImportError: pyspark is not installed.
    """
    source = "tfdist.engines.spark.local_session"
    require_int("num_workers", num_workers, 1, source=source)
    if master is not None and (not isinstance(master, str) or not master.strip()):
        raise ConfigError("master", master, "None or a Spark master URL such as "
                          "'local[2]' or 'local-cluster[2,1,1024]'", source=source)
    if conf is not None and not isinstance(conf, Mapping):
        raise ConfigError("conf", conf, "a mapping of Spark settings",
                          source=source)
    pyspark = _pyspark()
    if pyspark.SparkContext._active_spark_context is not None:
        running = pyspark.SparkContext._active_spark_context
        raise ConfigError(
            "master", master, "no SparkContext running in this process",
            source=source, hint=f"One is running already ({running.master}); "
            "stop it first, or pass it to tfdist.engines.spark.run(spark=...) if it "
            "has spark.python.worker.reuse=false.")
    master = master or f"local[{num_workers}]"
    # Read by the JVM when it starts (and by local-cluster's executors).
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession
    settings = dict(LOCAL_SETTINGS)
    settings["spark.pyspark.python"] = sys.executable
    settings["spark.pyspark.driver.python"] = sys.executable
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    _wait_for_slots(session.sparkContext, num_workers, wait_for_slots)
    return session
