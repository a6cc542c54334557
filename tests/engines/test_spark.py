"""tfdist.spark: argument checks (quick), and jobs on a real local Spark cluster.

The slow tests share one ``local-cluster[2,1,1024]`` session (a Spark master,
a worker and 2 executor JVMs of 1 core each, on 127.0.0.1): starting one
costs 10-20 s here, a barrier job of 2 TensorFlow tasks 10-25 s. The train
functions are in tests/workers/spark_train.py; the executors import it.

Without pyspark or Java the Spark tests are skipped, or fail when
TFDIST_REQUIRE_ENGINES=1 (CI).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import tfdist
from conftest import REPO, subprocess_env
from tfdist import spark as tfspark
from tfdist.engines import spark_session
from tfdist.errors import ConfigError

WORKERS = REPO / "tests" / "workers"
MASTER = "local-cluster[2,1,1024]"
#: Bound of each run() in these tests, in seconds.
JOB_TIMEOUT = 150.0
TASK_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
#: The scripts' model on fresh weights: cross-entropy of 3 classes, ~ln 3.
UNTRAINED_LOSS = math.log(3)


def _load_spark_train():
    """tests/workers/spark_train.py as module ``spark_train``: Spark pickles
    its functions by reference, and the executors import it by that name."""
    spec = importlib.util.spec_from_file_location("spark_train", WORKERS / "spark_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault("spark_train", module)
    return sys.modules["spark_train"]


spark_train = _load_spark_train()


# --------------------------------------------------------------------------
# Quick tests: no Spark started.


def test_missing_pyspark_error_names_the_extra(monkeypatch):
    # A None entry makes `import pyspark` raise ImportError, as when it is
    # not installed, even if another test imported it already.
    monkeypatch.setitem(sys.modules, "pyspark", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'tfdist[spark]'")):
        tfspark.run(lambda ctx: None, 2)
    with pytest.raises(ImportError, match=re.escape("pip install 'tfdist[spark]'")):
        tfspark.local_session(2)


def test_importing_tfdist_spark_loads_neither_pyspark_nor_tensorflow():
    code = (
        "import sys, tfdist, tfdist.spark; from tfdist import spark; "
        "print(sorted(m for m in ('pyspark', 'tensorflow', 'keras') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _noop(ctx):
    return None


def _need_pyspark() -> None:
    if importlib.util.find_spec("pyspark") is None:
        message = f"pyspark is not installed ({tfspark.INSTALL_HINT})"
        if os.environ.get("TFDIST_REQUIRE_ENGINES") == "1":
            pytest.fail(message + " (TFDIST_REQUIRE_ENGINES=1 requires it)", pytrace=False)
        pytest.skip(message)


@pytest.mark.parametrize(
    "kwargs, field, shown",
    [
        ({"train_fn": "train.py"}, "train_fn", "'train.py'"),
        ({"num_workers": 0}, "num_workers", "0"),
        ({"num_workers": True}, "num_workers", "True"),
        ({"num_workers": "2"}, "num_workers", "'2'"),
        ({"max_retries": -1}, "max_retries", "-1"),
        ({"timeout": 0}, "timeout", "0"),
        ({"wait_for_slots": -1}, "wait_for_slots", "-1"),
        ({"backup_dir": ""}, "backup_dir", "''"),
        ({"env": {"TF_CPP_MIN_LOG_LEVEL": 2}}, "env", "{'TF_CPP_MIN_LOG_LEVEL': 2}"),
        ({"host": ""}, "host", "''"),
        ({"compression": "zip"}, "compression", "'zip'"),
        ({"collective_timeout": -5}, "collective_timeout", "-5"),
        ({"no_such_option": 1}, "no_such_option", "1"),
        ({"strategy": "mirrored"}, "strategy", "'mirrored'"),
    ],
)
def test_run_checks_its_arguments_before_starting_anything(kwargs, field, shown):
    args = {"train_fn": _noop, "num_workers": 2, **kwargs}
    with pytest.raises(ConfigError) as caught:
        tfspark.run(args.pop("train_fn"), args.pop("num_workers"), **args)
    assert caught.value.field == field
    assert f"Received: {shown}" in str(caught.value)


@pytest.mark.parametrize("conf", [{"spark.python.worker.reuse": "true"}, {}])
def test_a_session_that_reuses_python_workers_is_refused(conf):
    # Spark's default is to reuse them. The setting cannot change on a
    # running session, and a second session would cost ~15 s: a stand-in
    # session shows how run() reads the user's settings.
    _need_pyspark()
    session = types.SimpleNamespace(sparkContext=types.SimpleNamespace(getConf=lambda: dict(conf)))
    with pytest.raises(ConfigError) as caught:
        tfspark.run(_noop, 2, spark=session)
    assert caught.value.field == "spark.python.worker.reuse"
    assert "expected 'false'. Received: 'true'" in str(caught.value)
    assert "local_session" in str(caught.value)


def _ctx_and_keywords(ctx, *, epochs=1, seed=0):
    return ctx, epochs, seed


def _keywords_only(epochs, learning_rate=0.01):
    return epochs, learning_rate


def _any_keywords(**kwargs):
    return kwargs


def _optional_first(ctx=None, epochs=1):
    return ctx, epochs


@pytest.mark.parametrize(
    "train_fn, kwargs, context, to_train_fn, to_strategy",
    [
        # The documented form: the context first, keywords after it.
        (
            _ctx_and_keywords,
            {"epochs": 3, "collective_timeout": 30},
            True,
            {"epochs": 3},
            {"collective_timeout": 30},
        ),
        (functools.partial(_ctx_and_keywords, seed=4), {}, True, {}, {}),
        (lambda ctx: ctx, {"communication": "RING"}, True, {}, {"communication": "RING"}),
        # spark-tensorflow-distributor's form: train_fn(**kwargs), no context.
        (lambda: 1, {}, False, {}, {}),
        (
            _keywords_only,
            {"epochs": 2, "register_timeout": 60},
            False,
            {"epochs": 2},
            {"register_timeout": 60},
        ),
        # A keyword naming the first parameter: it is not the context.
        (_ctx_and_keywords, {"ctx": "mine"}, False, {"ctx": "mine"}, {}),
        (_optional_first, {"epochs": 5}, False, {"epochs": 5}, {}),
        # **kwargs takes every name that is not a strategy option.
        (
            _any_keywords,
            {"batch": 8, "collective_timeout": 9},
            False,
            {"batch": 8},
            {"collective_timeout": 9},
        ),
    ],
)
def test_run_routes_its_keywords_to_train_fn_or_the_strategy(
    train_fn, kwargs, context, to_train_fn, to_strategy
):
    assert tfspark._plan_call(train_fn, kwargs) == (context, to_train_fn, to_strategy)


@pytest.mark.parametrize(
    "train_fn, kwargs, field, says",
    [
        # A keyword that neither takes.
        (
            _keywords_only,
            {"epochs": 1, "batch": 8},
            "batch",
            "expected a parameter of train_fn (epochs, learning_rate) or an option of "
            "tfdist.strategy_from_config (",
        ),
        # A train_fn parameter that is also a strategy option.
        (
            lambda ctx, communication="AUTO": None,
            {"communication": "RING"},
            "communication",
            "train_fn has a parameter 'communication'",
        ),
        # A required parameter that run() does not give.
        (
            lambda *, epochs: None,
            {},
            "train_fn",
            "expected a function the tasks can call as train_fn()",
        ),
        (lambda a, b: None, {}, "train_fn", "missing a required argument: 'b'"),
    ],
)
def test_run_refuses_keywords_train_fn_cannot_take(train_fn, kwargs, field, says):
    with pytest.raises(ConfigError) as caught:
        tfspark.run(train_fn, 2, **kwargs)
    assert caught.value.field == field
    assert says in str(caught.value)


def test_context_outside_a_task_says_where_it_works():
    with pytest.raises(
        tfdist.TfdistError,
        match=re.escape(
            "tfdist.spark.context() works only inside train_fn, on a Spark task "
            "started by tfdist.spark.run(train_fn, ...)"
        ),
    ):
        tfspark.context()


def test_strategy_from_config_in_a_task_returns_the_task_strategy(tf_cpus):
    # What run_task sets up around train_fn, with a local strategy standing
    # for the task's (a real MultiWorkerMirrored needs the Spark job below).
    from tfdist.strategies.provided import provide

    task_strategy = tfdist.strategy_from_config(
        strategy="mirrored", cpu_replicas=2, compression="fp16"
    )
    tf_config = {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 1},
    }
    with provide(
        task_strategy,
        tf_config=tf_config,
        compression="fp16",
        error_feedback=None,
        options={"cpu_replicas": 2},
        source="tfdist.spark.run",
    ):
        # Nothing asked, or the same settings: the task's strategy.
        assert tfdist.strategy_from_config() is task_strategy
        assert (
            tfdist.strategy_from_config(json.dumps(tf_config), compression="fp16", cpu_replicas=2)
            is task_strategy
        )
        # Another setting of the task's strategy: refused, naming run().
        with pytest.raises(ConfigError) as caught:
            tfdist.strategy_from_config(compression="bf16")
        assert caught.value.field == "compression"
        assert "expected None or the setting given to tfdist.spark.run (fp16)" in str(caught.value)
        assert "Received: 'bf16'" in str(caught.value)
        with pytest.raises(ConfigError) as caught:
            tfdist.strategy_from_config(cpu_replicas=3)
        assert caught.value.field == "cpu_replicas"
        # Another kind of strategy is built as asked.
        other = tfdist.strategy_from_config(strategy="one_device")
        assert other is not task_strategy and other.kind == "one_device"
    # Outside the task: a new strategy again.
    assert tfdist.strategy_from_config(strategy="mirrored", cpu_replicas=2) is not task_strategy


def test_a_spark_failure_outside_train_fn_names_the_partition():
    # What Spark says when an executor or Python worker dies: no task
    # traceback, so the partition comes from Spark's text, Java frames cut.
    text = (
        "org.apache.spark.SparkException: Job aborted due to stage failure: "
        "Stage failed because barrier task ResultTask(3, 1) finished "
        "unsuccessfully.\norg.apache.spark.SparkException: Python worker "
        "exited unexpectedly (crashed)\n\tat org.apache.spark.api.python."
        "BasePythonRunner.read(PythonRunner.scala:1)\n"
    )
    error = spark_session._job_error(RuntimeError(text), 0, 2, 2)
    assert error.partition == 1
    assert error.task_traceback is None
    assert "Python worker exited unexpectedly" in str(error)
    assert "attempt 1 of 2" in str(error)
    assert "PythonRunner.scala" not in str(error)


# --------------------------------------------------------------------------
# A real local Spark cluster.


class SparkCluster:
    """The module's Spark session and where its executors write their logs."""

    def __init__(self, session, start_seconds: float) -> None:
        self.session = session
        self.start_seconds = start_seconds
        sc = session.sparkContext
        # local-cluster's workers run in the driver's JVM and put the
        # executors' directories under $SPARK_HOME/work/<application id>.
        spark_home = sc._jvm.java.lang.System.getenv("SPARK_HOME") or "."
        self.app_dir = Path(spark_home, "work", sc.applicationId)

    def logs(self, tail: int = 6000) -> str:
        """The end of every executor's stdout and stderr, for failure messages."""
        return _logs(self.app_dir, tail)

    def wait_for_executors(self, seconds: float = 90) -> None:
        """Waits until both executors are up (Spark replaces a lost one)."""
        deadline = time.monotonic() + seconds
        while (spark_session._task_slots(self.session.sparkContext) or 0) < 2:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the Spark executors did not come back within {seconds:g} s\n{self.logs()}",
                    pytrace=False,
                )
            time.sleep(0.5)

    def run(self, train_fn, **kwargs):
        """tfspark.run on 2 workers, bounded; a job error shows the logs."""
        kwargs.setdefault("timeout", JOB_TIMEOUT)
        kwargs.setdefault("env", TASK_ENV)
        try:
            return tfspark.run(train_fn, 2, spark=self.session, **kwargs)
        except tfspark.SparkJobError as error:
            pytest.fail(f"{error}\n\n{self.logs()}", pytrace=False)


def _logs(app_dir: Path, tail: int = 6000) -> str:
    parts = []
    for path in sorted(app_dir.glob("*/std*")):
        text = path.read_text(errors="replace")
        parts.append(
            f"===== executor {path.parent.name} {path.name} (last "
            f"{tail} chars) =====\n{text[-tail:]}"
        )
    return "\n".join(parts) or f"(no executor logs in {app_dir})"


def _engines_missing() -> str | None:
    problems = []
    if importlib.util.find_spec("pyspark") is None:
        problems.append(f"pyspark is not installed ({tfspark.INSTALL_HINT})")
    java_home = os.environ.get("JAVA_HOME")
    if shutil.which("java") is None and not (
        java_home and os.path.exists(os.path.join(java_home, "bin", "java"))
    ):
        problems.append(
            "no Java runtime (Spark 4 needs Java 17 or 21, e.g. "
            "apt-get install openjdk-17-jre-headless)"
        )
    return "; ".join(problems) or None


@pytest.fixture(scope="module")
def spark_cluster():
    """One local-cluster Spark session for the module, stopped at the end."""
    missing = _engines_missing()
    if missing:
        message = f"the Spark tests need a real Spark: {missing}"
        if os.environ.get("TFDIST_REQUIRE_ENGINES") == "1":
            pytest.fail(message + " (TFDIST_REQUIRE_ENGINES=1 requires it)", pytrace=False)
        pytest.skip(message)
    saved = os.environ.get("SPARK_LOCAL_IP")
    start = time.monotonic()
    try:
        session = tfspark.local_session(
            2,
            master=MASTER,
            app_name="tfdist-tests",
            wait_for_slots=120,
            # The repo first: the executors import this checkout's tfdist,
            # not whatever copy is installed.
            conf={
                "spark.executorEnv.PYTHONPATH": os.pathsep.join(
                    [str(REPO), str(WORKERS), str(REPO / "strategies")]
                ),
                "spark.ui.showConsoleProgress": "false",
            },
        )
    except Exception as error:  # noqa: BLE001 - reported as the failure
        pytest.fail(f"the local Spark cluster did not start: {error}", pytrace=False)
    cluster = SparkCluster(session, time.monotonic() - start)
    try:
        yield cluster
    finally:
        session.stop()
        # The executors' logs, written inside the pyspark package; "work"
        # goes too if nothing else is in it.
        shutil.rmtree(cluster.app_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            cluster.app_dir.parent.rmdir()
        if saved is None:
            os.environ.pop("SPARK_LOCAL_IP", None)
        else:
            os.environ["SPARK_LOCAL_IP"] = saved


@pytest.fixture
def spark(spark_cluster):
    """The module's cluster, with both executors up."""
    spark_cluster.wait_for_executors()
    return spark_cluster


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Waits until none of ``pids`` runs; returns those still running."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _task_pids(pid_dir: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in sorted(pid_dir.glob("task-*.pid"))}


@pytest.mark.slow
def test_two_barrier_tasks_train_in_sync_with_the_compression_given(spark):
    # One job checks both (each costs 10-30 s here): the fit, and that
    # run()'s compression reaches every task's strategy.
    result = spark.run(functools.partial(spark_train.train, epochs=3), compression="fp16")
    context = f"\n{result}\n{spark.logs()}"
    chief, other = result["tasks"]
    # Worker index = partition id, worker 0 is the chief, on both sides.
    assert [chief["worker_index"], other["worker_index"]] == [0, 1], context
    assert [chief["task"], other["task"]] == ["worker:0", "worker:1"], context
    assert [chief["is_chief"], other["is_chief"]] == [True, False], context
    assert [chief["strategy_is_chief"], other["strategy_is_chief"]] == [True, False]
    assert chief["pid"] != other["pid"]
    # tfdist's MultiWorkerMirrored (with the Keras 3 fix), over both tasks.
    assert result["strategy"] == "tfdist.strategies.MultiWorkerMirroredStrategy"
    assert result["replicas"] == 2
    addresses = result["tf_config"]["cluster"]["worker"]
    assert len(set(addresses)) == 2
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    assert result["tf_config"]["task"] == {"type": "worker", "index": 0}
    assert result["env_TF_CONFIG"] == result["tf_config"]
    # Synchronous training: the same weights, bit for bit, and the loss falls.
    assert chief["weights_sha256"] == other["weights_sha256"], context
    assert chief["loss"] == other["loss"]
    assert len(chief["loss"]) == 3
    assert chief["loss"][-1] < 0.5 * chief["loss"][0], context
    # The compression setting, as each task's strategy reports it.
    assert result["compression"] == "fp16"
    assert chief["compression"] == other["compression"] == "fp16"
    assert "compression: fp16 (FP16Compressor" in result["description"], context


@pytest.mark.slow
def test_a_train_fn_without_arguments_that_makes_its_own_strategy(spark):
    # spark-tensorflow-distributor's convention: train_fn() calls
    # tfdist.strategy_from_config() and enters its scope, inside the scope
    # run() already entered. It gets the task's strategy (one per process:
    # TensorFlow's collectives are configured once), with run()'s compression.
    chief, other = spark.run(spark_train.train_own_strategy, compression="fp16")
    context = f"\n{chief}\n{other}\n{spark.logs()}"
    assert [chief["task"], other["task"]] == ["worker:0", "worker:1"], context
    assert chief["is_ctx_strategy"] and other["is_ctx_strategy"], context
    assert chief["compression"] == other["compression"] == "fp16"
    assert chief["variables_mirrored"] == "MirroredVariable"
    assert chief["weights_sha256"] == other["weights_sha256"], context
    assert chief["loss"] == other["loss"]
    assert chief["loss"][-1] < chief["loss"][0], context


@pytest.mark.slow
def test_a_failing_task_fails_the_stage_with_its_own_traceback(spark, tmp_path):
    train = functools.partial(
        spark_train.train, epochs=3, pid_dir=str(tmp_path), fail_task=1, fail_epoch=1
    )
    start = time.monotonic()
    with pytest.raises(tfspark.SparkJobError) as caught:
        tfspark.run(train, 2, spark=spark.session, timeout=JOB_TIMEOUT, env=TASK_ENV)
    elapsed = time.monotonic() - start
    error = caught.value
    context = f"\n{error}\n\n{spark.logs()}"
    assert not isinstance(error, tfspark.SparkTimeoutError), context
    assert error.partition == 1, context
    assert error.attempt == 0 and error.failures == ()
    # The task's own error and traceback, not only Spark's wrapper.
    assert "Spark task 1 (worker 1 of 2" in str(error), context
    assert "RuntimeError: task 1 fails on purpose at epoch 1" in str(error), context
    assert "spark_train.py" in error.task_traceback, context
    assert "in on_epoch_begin" in error.task_traceback, context
    assert "barrier" in error.spark_message, context
    # Worker 0 was in a collective, waiting for worker 1: Spark stopped it
    # (its collective timeout is 600 s; the job ended long before).
    assert elapsed < JOB_TIMEOUT / 2, f"took {elapsed:.0f} s{context}"
    pids = _task_pids(tmp_path)
    assert set(pids) == {"task-0.pid", "task-1.pid"}, context
    assert _wait_gone(list(pids.values()), 30) == [], f"tasks still run{context}"


@pytest.mark.slow
def test_a_retry_resumes_from_the_backup_directory(spark, tmp_path):
    marker = tmp_path / "failed-once"
    backup_dir = tmp_path / "backup"
    train = functools.partial(
        spark_train.train, epochs=3, fail_task=1, fail_epoch=1, fail_once_marker=str(marker)
    )
    result = spark.run(train, max_retries=1, backup_dir=backup_dir)
    context = f"\n{result}\n{spark.logs()}"
    chief, other = result["tasks"]
    # The first attempt failed at the start of epoch 1 (the marker says so);
    # the second one started at epoch 1 from the chief's backup, on both.
    assert marker.read_text() == "attempt 0"
    assert chief["attempt"] == other["attempt"] == 1, context
    assert chief["epochs_run"] == other["epochs_run"] == [1, 2], context
    assert chief["resumed_from"]["epoch"] == 1, context
    assert chief["resumed_from"]["writer"] == "worker:0"
    assert chief["weights_sha256"] == other["weights_sha256"], context
    # Resumed weights, not fresh ones: the loss starts far below ln(3).
    assert chief["loss"][0] < 0.5 * UNTRAINED_LOSS, context


@pytest.mark.slow
def test_more_workers_than_task_slots_is_refused(spark):
    # No spark=: run() takes the active session, the module's 2 slots.
    with pytest.raises(ConfigError) as caught:
        tfspark.run(_noop, 3, wait_for_slots=0)
    assert caught.value.field == "num_workers"
    assert "at most 2" in str(caught.value)
    assert "Received: 3" in str(caught.value)


@pytest.mark.slow
def test_a_hung_task_is_cancelled_at_the_timeout(spark, tmp_path):
    # Worker 1 sleeps, worker 0 waits for it in a Spark barrier. Killing a
    # task that waits in a barrier makes Spark 4.3's executor exit
    # (TaskKilledException in its barrier thread); Spark starts a new one in
    # a few seconds. Kept last, so that no other test waits for that.
    timeout = 30.0
    start = time.monotonic()
    with pytest.raises(tfspark.SparkTimeoutError) as caught:
        tfspark.run(
            functools.partial(spark_train.hang, pid_dir=str(tmp_path)),
            2,
            spark=spark.session,
            timeout=timeout,
            env=TASK_ENV,
        )
    elapsed = time.monotonic() - start
    context = f"\n{caught.value}\n\n{spark.logs()}"
    assert timeout <= elapsed < timeout + 60, f"took {elapsed:.0f} s{context}"
    assert "cancelled" in str(caught.value)
    pids = _task_pids(tmp_path)
    assert set(pids) == {"task-0.pid", "task-1.pid"}, context
    assert _wait_gone(list(pids.values()), 30) == [], f"tasks still run{context}"


@pytest.mark.slow
def test_without_a_session_run_gets_one_and_calls_train_fn_with_keywords(tmp_path):
    # As spark-tensorflow-distributor's runner: a fresh process with no
    # Spark session, and a train_fn(epochs, learning_rate) with no context.
    # A subprocess, since this one has the module's session (about 25 s).
    missing = _engines_missing()
    if missing:
        pytest.skip(f"needs a real Spark: {missing}")
    env = subprocess_env(TF_CPP_MIN_LOG_LEVEL="2")
    for name in (
        "SPARK_LOCAL_IP",
        "PYSPARK_PYTHON",
        "PYSPARK_SUBMIT_ARGS",
        "MASTER",
        "SPARK_REMOTE",
    ):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "spark_get_or_create.py"), "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    output = f"\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, output
    lines = [line for line in proc.stdout.splitlines() if line.startswith("result: ")]
    assert len(lines) == 1, output
    result = json.loads(lines[0][len("result: ") :])
    # SparkSession.builder.getOrCreate() gave plain python local[*], with the
    # settings run() needs and everything on loopback.
    assert result["session"] == {
        "active_before": False,
        "master": "local[*]",
        "spark.python.worker.reuse": "false",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.pyspark.python": sys.executable,
    }, output
    assert all(a.startswith("127.0.0.1:") for a in result["tf_config"]["cluster"]["worker"])
    # train_fn(**kwargs) ran in the strategy's scope on both tasks; its context
    # came from tfdist.spark.context().
    chief, other = result["tasks"]
    assert result["replicas"] == 2
    assert [chief["task"], other["task"]] == ["worker:0", "worker:1"]
    assert [chief["is_chief"], other["is_chief"]] == [True, False]
    assert chief["scope_is_ctx_strategy"] and other["scope_is_ctx_strategy"], output
    assert chief["variables_mirrored"] == "MirroredVariable"
    # epochs=3 reached train_fn; both workers trained in sync.
    assert len(chief["loss"]) == 3 and chief["loss"] == other["loss"], output
    assert chief["loss"][-1] < 0.5 * chief["loss"][0], output
    assert chief["weights_sha256"] == other["weights_sha256"]
