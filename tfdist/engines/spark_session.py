"""The driver side of :func:`tfdist.spark.run`: the Spark session, its task slots,
submitting one barrier job, and reading a failed job's error; the job errors
(:class:`SparkJobError`); :func:`local_session` for one machine. Imports
pyspark only when called, and never TensorFlow.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

from tfdist.compat import spark_private
from tfdist.engines.launch_results import PREEMPTED_EXIT_CODE
from tfdist.engines.worker.spark_task import MARK_RE, RESULT_TASK_RE, TB_RE, TaskSpec, run_task
from tfdist.errors import ConfigError, TfdistError, require_int

#: How to install what this module needs.
INSTALL_HINT = "pip install 'tfdist[spark]'"

SOURCE = "tfdist.spark.run"

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

    def __init__(
        self,
        message: str,
        *,
        partition: int | None = None,
        attempt: int = 0,
        task_traceback: str | None = None,
        spark_message: str | None = None,
        failures: tuple[SparkJobError, ...] = (),
        preempted: dict | None = None,
    ) -> None:
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
            "tfdist.spark needs pyspark (4.x), which is not installed "
            f"({error}). Install it with: {INSTALL_HINT}"
        ) from error
    return pyspark


# --------------------------------------------------------------------------
# The driver.


def _is_local_master(master: str | None) -> bool:
    """Whether a Spark master URL runs everything on this machine."""
    return bool(master) and (master == "local" or master.startswith(("local[", "local-cluster[")))


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
        conf = spark_private.launch_conf(pyspark)
        master = conf.get("spark.master", None)
    except Exception:  # noqa: BLE001 - a private API: then only the settings of any master.
        return settings, None
    if _is_local_master(master):
        settings.update(LOOPBACK_SETTINGS)
        if not (conf.contains("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")):
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

    logging.info(
        "tfdist.spark.run: no active Spark session; started one "
        "with SparkSession.builder.getOrCreate() (master %s) and %s",
        session.sparkContext.master,
        ", ".join(f"{k}={v}" for k, v in settings.items()),
    )
    return session, master


def context_of(spark: Any) -> tuple[Any, bool]:
    """The SparkContext to run on, and whether :func:`run` created it on a
    local master.

    ``spark`` is a SparkSession or SparkContext; None means the active
    session or context, else a new session from
    ``SparkSession.builder.getOrCreate()``.
    """
    pyspark = _pyspark()
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession() or spark_private.active_spark_context(pyspark)
        if spark is None:
            session, master = _get_or_create_session()
            return context_of(session)[0], _is_local_master(master)
    if isinstance(spark, pyspark.SparkContext):
        return spark, False
    if hasattr(spark, "sparkContext"):
        try:
            return spark.sparkContext, False
        except Exception as error:  # noqa: BLE001 - Spark Connect sessions have none.
            raise ConfigError(
                "spark",
                spark,
                "a classic SparkSession (with a SparkContext)",
                source=SOURCE,
                hint=f"Spark Connect sessions have no RDD barrier mode. Spark said: {error}",
            ) from None
    raise ConfigError("spark", spark, "a SparkSession, a SparkContext or None", source=SOURCE)


def check_worker_reuse(sc: Any) -> None:
    """Raises ConfigError unless the session has ``spark.python.worker.reuse=false``."""
    value = sc.getConf().get("spark.python.worker.reuse", "true")
    if str(value).strip().lower() != "false":
        raise ConfigError(
            "spark.python.worker.reuse",
            value,
            "'false'",
            source=SOURCE,
            hint="TensorFlow's collectives can be configured once per "
            "process: a reused Python worker fails the next job ('Collective "
            "ops are already configured') or hangs. Build the session with "
            ".config('spark.python.worker.reuse', 'false') (it cannot be "
            "changed on a running session), or use tfdist.spark.local_session()",
        )


def _task_slots(sc: Any) -> int | None:
    """Tasks Spark can run at once now, or None if it cannot be told."""
    try:
        jsc = spark_private.jvm_spark_context(sc)
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # noqa: BLE001 - a private API: leave the check to Spark.
        return None


def wait_for_task_slots(sc: Any, num_workers: int, seconds: float) -> int | None:
    """Waits until Spark has ``num_workers`` task slots; returns the slots."""
    deadline = time.monotonic() + seconds
    while True:
        slots = _task_slots(sc)
        if slots is None or slots >= num_workers or time.monotonic() >= deadline:
            return slots
        time.sleep(0.25)


def _without_java_frames(text: str, limit: int = 60) -> str:
    lines = [
        line
        for line in text.splitlines()
        if not line.lstrip().startswith("at ") and not line.lstrip().startswith("... ")
    ]
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more lines)"]
    return "\n".join(lines)


def _job_error(
    error: BaseException, attempt: int, attempts: int, num_workers: int
) -> SparkJobError:
    """Turns Spark's error into a SparkJobError with the task's traceback."""
    text = str(error)
    spark_message = _without_java_frames(text)
    where = f"attempt {attempt + 1} of {attempts}"
    match = MARK_RE.search(text)
    if match:
        info = json.loads(match.group(1))
        found = TB_RE.search(text, match.end())
        task_traceback = found.group(1) if found else "(not found in Spark's message)"
        partition = int(info["partition"])
        preempted = info.get("preempted")
        if preempted is not None:
            message = (
                f"{SOURCE}: the job was preempted on {where}: every task "
                f"stopped after step {preempted.get('step')} (epoch "
                f"{preempted.get('epoch')}, batch {preempted.get('batch')}), the "
                "chief saved a backup there, and the tasks exited with code "
                f"{PREEMPTED_EXIT_CODE}. A new attempt resumes at that step "
                "from backup_dir."
            )
        else:
            message = (
                f"{SOURCE}: Spark task {partition} (worker {partition} of "
                f"{num_workers}, on {info['host']}, pid {info['pid']}) failed on "
                f"{where}: {info['type']}: {info['message']}\n"
                "Spark aborted the barrier stage and stopped the other tasks.\n\n"
                f"Traceback of task {partition}:\n{task_traceback}"
            )
        return SparkJobError(
            message,
            partition=partition,
            attempt=attempt,
            task_traceback=task_traceback,
            spark_message=spark_message,
            preempted=preempted,
        )
    found = RESULT_TASK_RE.search(text)
    partition = int(found.group(1)) if found else None
    who = f"task {partition}" if partition is not None else "a task"
    message = (
        f"{SOURCE}: the Spark job failed on {where} ({who}; the "
        "failure came from outside train_fn, e.g. a lost executor or "
        f"a killed Python worker). Spark said:\n{spark_message}"
    )
    return SparkJobError(message, partition=partition, attempt=attempt, spark_message=spark_message)


def submit(
    sc: Any, spec: TaskSpec, seconds: float | None, attempts: int, timeout: float | None
) -> Any:
    """Runs one barrier job within ``seconds``; returns the chief's result."""
    pyspark = _pyspark()
    group = f"tfdist-{uuid.uuid4().hex[:12]}"
    box: dict[str, Any] = {}

    def job() -> None:
        sc.setJobGroup(
            group,
            f"tfdist.spark.run: {spec.num_workers} workers, attempt {spec.attempt + 1}",
            interruptOnCancel=True,
        )
        try:
            rdd = sc.parallelize(range(spec.num_workers), spec.num_workers)
            box["rows"] = rdd.barrier().mapPartitions(functools.partial(run_task, spec)).collect()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            box["error"] = error

    thread = pyspark.InheritableThread(target=job, daemon=True, name=f"{group}-collect")
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
            f"{SOURCE}: the job did not finish within timeout={timeout:g} s "
            f"(the whole run; this was attempt {spec.attempt + 1} of "
            f"{attempts}); its Spark job group {group!r} was cancelled, which "
            "kills its tasks. Raise timeout= if training needs longer. A hung "
            "peer is caught by collective_timeout= (default 600 s), a peer "
            "that never joins by register_timeout= (default 120 s).",
            attempt=spec.attempt,
        )
    if "error" in box:
        error = box["error"]
        if _is_spark_error(error):
            raise _job_error(error, spec.attempt, attempts, spec.num_workers) from error
        raise error
    rows = box["rows"]
    if len(rows) != 1:
        raise SparkJobError(
            f"{SOURCE}: expected one result, from the chief (task 0). Received: {len(rows)}",
            attempt=spec.attempt,
        )
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


# --------------------------------------------------------------------------
# A session for one machine.


def local_session(
    num_workers: int = 2,
    *,
    master: str | None = None,
    app_name: str = "tfdist",
    conf: Mapping[str, str] | None = None,
    wait_for_slots: float = 60.0,
):
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
    source = "tfdist.spark.local_session"
    require_int("num_workers", num_workers, 1, source=source)
    if master is not None and (not isinstance(master, str) or not master.strip()):
        raise ConfigError(
            "master",
            master,
            "None or a Spark master URL such as 'local[2]' or 'local-cluster[2,1,1024]'",
            source=source,
        )
    if conf is not None and not isinstance(conf, Mapping):
        raise ConfigError("conf", conf, "a mapping of Spark settings", source=source)
    pyspark = _pyspark()
    if spark_private.active_spark_context(pyspark) is not None:
        running = spark_private.active_spark_context(pyspark)
        raise ConfigError(
            "master",
            master,
            "no SparkContext running in this process",
            source=source,
            hint=f"One is running already ({running.master}); "
            "stop it first, or pass it to tfdist.spark.run(spark=...) if it "
            "has spark.python.worker.reuse=false.",
        )
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
    wait_for_task_slots(session.sparkContext, num_workers, wait_for_slots)
    return session
