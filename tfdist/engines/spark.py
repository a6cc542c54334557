"""Run a Keras training function on Spark, one TensorFlow worker per barrier task.

:func:`run` starts ``num_workers`` Spark tasks together (barrier execution
mode: all of them or none). Each task picks a free port on its executor's
host, the tasks exchange their addresses with
``BarrierTaskContext.allGather``, and every task gets its own ``TF_CONFIG``
(``worker`` job, index = Spark partition id; worker 0 is the chief) and a
tfdist :class:`~tfdist.strategies.MultiWorkerMirroredStrategy`, which includes
the Keras 3 ``fit`` fix. Then it calls ``train_fn(ctx)`` with a
:class:`TrainContext`, inside the strategy's scope::

    from tfdist import spark as tfspark

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
settings below (the loopback ones for a local master only). A ``train_fn``
that calls ``tfdist.strategy_from_config()`` itself gets the task's strategy.

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
import inspect
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

# The settings are public here too, as before the split.
from tfdist.engines.spark_session import (  # noqa: F401
    INSTALL_HINT,
    LOCAL_SETTINGS,
    LOOPBACK_SETTINGS,
    SESSION_SETTINGS,
    SOURCE,
    SparkJobError,
    SparkTimeoutError,
    check_worker_reuse,
    context_of,
    local_session,
    submit,
    wait_for_task_slots,
)
from tfdist.engines.worker.spark_task import TaskSpec, TrainContext, context
from tfdist.errors import ConfigError, require_int

__all__ = [
    "INSTALL_HINT",
    "SparkJobError",
    "SparkTimeoutError",
    "TrainContext",
    "context",
    "local_session",
    "run",
]


def _check_env(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in env.items()
    ):
        raise ConfigError(
            "env",
            env,
            "a mapping of variable names to string values, e.g. {'TF_CPP_MIN_LOG_LEVEL': '2'}",
            source=SOURCE,
        )
    return dict(env)


def _check_seconds(
    field: str, value: Any, *, allow_none: bool, allow_zero: bool = False
) -> float | None:
    if allow_none and (value is None or value == math.inf):
        return None
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and not math.isnan(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(
            field,
            value,
            f"a number of seconds {bound}" + (" or None" if allow_none else ""),
            source=SOURCE,
        )
    return float(value)


def _check_backup_dir(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            "backup_dir", value, "None or a directory path that every executor sees", source=SOURCE
        )
    return value


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _plan_call(train_fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> tuple[bool, dict, dict]:
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
        first is not None
        and first.kind in _POSITIONAL
        and first.default is inspect.Parameter.empty
        and first.name not in kwargs
    )
    named = {p.name for p in params[1 if pass_context else 0 :] if p.kind in _BY_KEYWORD}
    any_keyword = signature is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    train_kwargs: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in named and name in option_names:
            raise ConfigError(
                name,
                value,
                "a keyword that names either a parameter of "
                "train_fn or a strategy option, not both",
                source=SOURCE,
                hint=f"train_fn has a parameter {name!r}, which is also an "
                "option of tfdist.strategy_from_config: rename the parameter",
            )
        if name in named:
            train_kwargs[name] = value
        elif name in option_names:
            options[name] = value
        elif any_keyword and signature is not None:
            train_kwargs[name] = value
        elif name in ("strategy", "config"):
            raise ConfigError(
                name,
                value,
                "no such option (tfdist.spark "
                "builds each task's TF_CONFIG and always uses "
                "the multi_worker_mirrored strategy)",
                source=SOURCE,
            )
        else:
            raise ConfigError(
                name,
                value,
                "a parameter of train_fn ("
                + (", ".join(sorted(named)) or "it has none")
                + ") or an "
                "option of tfdist.strategy_from_config (" + ", ".join(sorted(option_names)) + ")",
                source=SOURCE,
            )
    if signature is not None:
        try:
            signature.bind(*([None] if pass_context else []), **train_kwargs)
        except TypeError as error:
            shown = ", ".join(["ctx"] * pass_context + [f"{k}=..." for k in train_kwargs])
            raise ConfigError(
                "train_fn",
                train_fn,
                f"a function the tasks can call as train_fn({shown})",
                source=SOURCE,
                hint=f"Python says: {error}. A required first positional "
                "parameter gets the TrainContext; pass the others as keywords "
                "of run()",
            ) from None
    return pass_context, train_kwargs, options


def run(
    train_fn: Callable[..., Any],
    num_workers: int,
    *,
    spark: Any = None,
    compression: Any = None,
    error_feedback: bool | None = None,
    backup_dir: str | os.PathLike | None = None,
    max_retries: int = 0,
    timeout: float | None = 24 * 3600.0,
    env: Mapping[str, str] | None = None,
    host: str | None = None,
    wait_for_slots: float = 60.0,
    **kwargs: Any,
) -> Any:
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
        raise ConfigError(
            "train_fn",
            train_fn,
            "a callable: train_fn(ctx, **kwargs) or train_fn(**kwargs)",
            source=SOURCE,
        )
    require_int("num_workers", num_workers, 1, source=SOURCE)
    require_int("max_retries", max_retries, 0, source=SOURCE)
    timeout = _check_seconds("timeout", timeout, allow_none=True)
    wait_for_slots = _check_seconds(
        "wait_for_slots", wait_for_slots, allow_none=False, allow_zero=True
    )
    backup_dir = _check_backup_dir(backup_dir)
    env = _check_env(env)
    pass_context, train_kwargs, options = _check_call(
        train_fn, host, compression, error_feedback, kwargs
    )
    sc, host = _cluster(spark, host, num_workers, wait_for_slots)
    if max_retries and backup_dir is None:
        from absl import logging

        logging.warning(
            "tfdist.spark.run: max_retries=%d without backup_dir: a retry trains from the start.",
            max_retries,
        )

    deadline = None if timeout is None else time.monotonic() + timeout
    attempts = max_retries + 1
    failures: list[SparkJobError] = []
    for attempt in range(attempts):
        spec = TaskSpec(
            train_fn=train_fn,
            pass_context=pass_context,
            train_kwargs=dict(train_kwargs),
            num_workers=num_workers,
            attempt=attempt,
            compression=compression,
            error_feedback=error_feedback,
            options=dict(options),
            env=env,
            host=host,
            backup_dir=backup_dir,
        )
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return submit(sc, spec, left, attempts, timeout)
        except SparkTimeoutError as error:
            error.failures = tuple(failures)
            raise
        except SparkJobError as error:
            error.failures = tuple(failures)
            failures.append(error)
            if attempt + 1 == attempts:
                raise
            _log_retry(error, attempt, attempts, backup_dir)
    raise AssertionError("unreachable")  # pragma: no cover


def _check_call(
    train_fn: object,
    host: object,
    compression: object,
    error_feedback: object,
    kwargs: dict,
) -> tuple[bool, dict, dict]:
    """Checks ``run``'s arguments here, not in every task (the options and the
    compression without TensorFlow: the tasks read their own environment).

    Returns:
        Whether ``train_fn`` takes the context, its keyword arguments, and the
        options of ``strategy_from_config`` among ``kwargs``.
    """
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise ConfigError("host", host, "None or a host name or IP address", source=SOURCE)
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ConfigError("error_feedback", error_feedback, "None, True or False", source=SOURCE)
    pass_context, train_kwargs, options = _plan_call(train_fn, kwargs)
    from tfdist.spec.compression import parse_compression
    from tfdist.spec.options import make_options

    parse_compression(compression)
    make_options(env={}, **options)
    return pass_context, train_kwargs, options


def _cluster(spark: Any, host: str | None, num_workers: int, wait_for_slots: float):
    """The SparkContext, and the host the tasks advertise, once the cluster
    has a task slot for every worker."""
    sc, created_local = context_of(spark)
    if created_local and host is None:
        host = "127.0.0.1"  # Every task runs on this machine.
    check_worker_reuse(sc)
    slots = wait_for_task_slots(sc, num_workers, wait_for_slots)
    if slots is not None and slots < num_workers:
        raise ConfigError(
            "num_workers",
            num_workers,
            f"at most {slots}, the task slots this Spark cluster has",
            source=SOURCE,
            hint="Barrier tasks run all at once, one slot "
            "each: add executors or cores, or lower num_workers.",
        )
    return sc, host


def _log_retry(error: Any, attempt: int, attempts: int, backup_dir: Any) -> None:
    from absl import logging

    if error.preempted is not None:
        logging.warning(
            "tfdist.spark.run: attempt %d of %d was preempted and saved at "
            "step %s; submitting the job again (it resumes at that step "
            "from backup_dir).",
            attempt + 1,
            attempts,
            error.preempted.get("step"),
        )
        return
    logging.warning(
        "tfdist.spark.run: attempt %d of %d failed; submitting the job again%s.\n%s",
        attempt + 1,
        attempts,
        " (train_fn resumes from backup_dir)" if backup_dir else "",
        error,
    )
