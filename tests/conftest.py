"""Shared fixtures: logical CPUs, a clean environment, subprocess workers."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import cpu_time

# A deadline per test (tests/deadline.py): its hook, registered by this import.
# So are the check that a test left the process's collectives working
# (tests/collective_guard.py), and the own_process marker's (tests/own_process.py).
from collective_guard import pytest_runtest_teardown  # noqa: F401
from deadline import pytest_runtest_protocol  # noqa: F401
from own_process import in_child, pytest_pyfunc_call  # noqa: F401

REPO = Path(__file__).resolve().parent.parent

# The tests sit in one directory per part of tfdist (tests/spec, tests/training,
# ...). Some share helpers across parts (test_strategies.fit_losses, the
# slurm_engine and Spark fixtures): every part's directory is importable.
for _part in sorted(Path(__file__).resolve().parent.iterdir()):
    if _part.is_dir() and _part.name not in ("workers", "__pycache__"):
        if str(_part) not in sys.path:
            sys.path.append(str(_part))

#: Logical CPUs the test process splits its CPU into, once, before
#: TensorFlow starts: enough for every Mirrored test in this process.
LOGICAL_CPUS = 4

#: Variables that change strategy detection; tests start without them.
_DETECTION_VARS = (
    "TF_CONFIG",
    "TPU_NAME",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "TFDIST_CPU_REPLICAS",
    "TFDIST_REGISTER_TIMEOUT",
    "TFDIST_COLLECTIVE_TIMEOUT",
    "TFDIST_COMMUNICATION",
    "TFDIST_MODEL_PARALLEL",
    "TFDIST_TIMELINE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each test sees an environment without TF_CONFIG, Slurm or TPU hints."""
    for name in _DETECTION_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def tf_cpus():
    """Imports TensorFlow with the CPU split into LOGICAL_CPUS devices."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    if tf.config.get_logical_device_configuration(cpu) is None:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_CPUS
        )
    assert len(tf.config.list_logical_devices("CPU")) == LOGICAL_CPUS
    return tf


@pytest.fixture
def keras_mod(tf_cpus):
    """Keras on the logical CPUs, with ``keras.distribution`` reset after
    the test (tests/distribution's modules set one)."""
    import keras

    yield keras
    keras.distribution.set_distribution(None)


def subprocess_env(**extra: str) -> dict:
    """Environment for a TensorFlow subprocess: quiet, repo importable."""
    env = {k: v for k, v in os.environ.items() if k not in _DETECTION_VARS}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "strategies"), env.get("PYTHONPATH", "")]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


#: Set to 0 to start every TensorFlow subprocess fresh (coverage runs do:
#: a fork would share the pool server's coverage data file).
WARM_POOL_VAR = "TFDIST_TEST_WARM_POOL"


#: The session's warm pool while it runs, for the CPU each test costs (cpu_time).
_POOLS: list = []


def _pool_server() -> int | None:
    """The pid of the session's warm pool server, if one runs."""
    pool = _POOLS[0] if _POOLS else None
    return pool.proc.pid if pool is not None and pool.proc is not None else None


@pytest.fixture(scope="session", autouse=True)
def _warm_pool():
    """One warm pool per test process (tfdist.engines.warm): the TensorFlow
    processes that ``start``, ``tfdist launch`` and ``local_cluster`` start
    are forked from a server that imported TensorFlow and Keras once (most of
    the 3.7 s of CPU a process spends on imports). Each job is a fresh fork: no test
    sees another's TensorFlow state."""
    if (
        os.environ.get(WARM_POOL_VAR, "1") == "0"
        or "COVERAGE_PROCESS_START" in os.environ
        or in_child()  # One test in a process of its own (tests/own_process.py).
    ):
        yield None
        return
    from tfdist.engines import warm

    # The level subprocess_env gives, for the tasks that tests launch from
    # this process too (tfdist.launch, local_cluster): TensorFlow reads it at
    # import, so a job with another level cannot be forked from the pool.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    pool = warm.WarmPool(env=subprocess_env())
    os.environ.update(pool.env)
    _POOLS.append(pool)
    try:
        yield pool
    finally:
        _POOLS.remove(pool)
        os.environ.pop(warm.ENV, None)
        record = os.environ.get("TFDIST_WARM_POOL_RECORD")
        if record:  # For pytest_terminal_summary, in the controller.
            with open(record, "a", encoding="utf-8") as f:
                f.writelines(
                    line + "\n" for line in pool.log().splitlines() if "warm pool: " in line
                )
        pool.close()


@pytest.fixture(autouse=True)
def _warm_pool_alive(_warm_pool):
    """A pool whose server died (a crash, a test that killed it) is started
    again before the next test."""
    if _warm_pool is not None:
        _warm_pool.ensure()


def start(
    args, *, tf_config: dict | None = None, fresh: bool = False, **extra_env
) -> subprocess.Popen:
    """Starts ``python ARGS`` with its own TF_CONFIG; output is captured.

    ``fresh``: a new interpreter, not a fork of the warm pool (where
    TensorFlow and Keras are imported already): for what happens at import.
    """
    from tfdist.engines import warm

    env = subprocess_env(**extra_env)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return subprocess.Popen(
        [sys.executable if fresh else warm.interpreter(env), *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs, timeout: float) -> list[tuple[int, str, str]]:
    """Waits for every process; kills them all if one is still running."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def result_line(stdout: str) -> dict:
    """The JSON after 'tfdist result: ' in a script's output."""
    for line in stdout.splitlines():
        if line.startswith("tfdist result: "):
            return json.loads(line[len("tfdist result: ") :])
    raise AssertionError(f"no 'tfdist result:' line in output:\n{stdout[-3000:]}")


def results_by_task(stdout: str) -> dict[str, dict]:
    """The 'tfdist result:' line of each task in ``tfdist launch`` output."""
    found = {}
    for line in stdout.splitlines():
        match = re.match(r"\[(\w+:\d+)\] tfdist result: (.*)$", line)
        if match:
            found[match[1]] = json.loads(match[2])
    return found


def executed_notebooks(tmp_path_factory) -> Path:
    """Where tests/test_notebooks.py leaves the notebooks it ran
    (``DIR/notebooks/NAME.ipynb``), for tests/test_docs.py's site."""
    return tmp_path_factory.getbasetemp() / "executed"


#: The xdist group of every test that starts TensorFlow processes, and of the
#: tests that share a module-scoped fixture with one (a module's job, Slurm or
#: Spark cluster): one worker runs them one at a time, at normal priority, as
#: they ran before the suite ran in parallel. Their timeouts were set for a
#: machine they have to themselves.
PROCESS_GROUP = "processes"

#: The niceness of a test that runs in its worker's process only: it gets the
#: cycles the multi-process tests leave (they wait on sockets, joins and
#: their workers' imports), and does not slow them down.
IN_PROCESS_NICENESS = 10


#: The fast tier, ``python -m pytest -m fast``: every test of a module whose
#: tests took under FAST_MODULE_SECONDS, slow ones aside, in the run recorded
#: in DURATIONS (tests/suite_times.py writes it), of a module it has no record
#: of, and of each test package's quickest module where none is under it and
#: that one is under twice the limit; never a slow test. Whole modules, so
#: that a module's shared fixtures, paid by its first test, are counted. At
#: 12 s the tier took 175-230 s on an AVX2-only 2-vCPU machine; 9 s drops 6
#: modules' 61 recorded seconds.
FAST_MODULE_SECONDS = 9.0
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def fast_modules(recorded: dict[str, float]) -> dict[str, bool]:
    """Each recorded module's place in the fast tier (FAST_MODULE_SECONDS),
    with the quickest module of each test package that has none under it, if
    that one is under twice the limit (tests/models has none: its corpus
    takes minutes)."""
    fast = {path: seconds < FAST_MODULE_SECONDS for path, seconds in recorded.items()}
    packages: dict[str, list[str]] = {}
    for path in recorded:
        packages.setdefault(path.rsplit("/", 1)[0], []).append(path)
    for paths in packages.values():
        quickest = min(paths, key=recorded.__getitem__)
        if not any(fast[p] for p in paths) and recorded[quickest] < 2 * FAST_MODULE_SECONDS:
            fast[quickest] = True
    return fast


#: The tests the older TensorFlow/Keras pairs run besides the fast tier
#: (.ci/matrix): marked ``matrix``, so that one pytest run per pair takes them.
MATRIX_TESTS = REPO / ".ci" / "matrix-tests"


def matrix_tests() -> set[str]:
    """The module paths and node ids .ci/matrix-tests lists."""
    if not MATRIX_TESTS.exists():
        return set()
    lines = (line.strip() for line in MATRIX_TESTS.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def names(entry: str, nodeid: str) -> bool:
    """Whether a module path or node id (``entry``) names the test ``nodeid``;
    a node id without its ``[parameters]`` names every parameter. Under
    xdist's loadgroup, a collected test's node id ends with ``@GROUP``."""
    return nodeid == entry or nodeid.startswith((f"{entry}::", f"{entry}[", f"{entry}@"))


def _module_fixtures(item) -> set[str]:
    """The module- or class-scoped fixtures ``item`` uses (pytest keeps them
    in ``_fixtureinfo``; session-scoped ones are each worker's own)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {
        name
        for name, defs in info.name2fixturedefs.items()
        if defs and defs[-1].scope in ("module", "class", "package")
    }


def _groups(items) -> dict[str, str]:
    """Each test's xdist group: PROCESS_GROUP for the slow tests and those
    that share a module-scoped fixture with one; else its module's path (a
    module's tests share its module-scoped fixtures)."""
    shared: dict[str, set[str]] = {}
    for item in items:
        if item.get_closest_marker("slow"):
            shared.setdefault(item.nodeid.split("::")[0], set()).update(_module_fixtures(item))
    groups = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        together = (
            item.get_closest_marker("slow")
            or _module_fixtures(item) & shared.get(path, set())
            # tests/test_docs.py builds the site from the notebooks that
            # tests/test_notebooks.py executed in the same process's temp dir.
            or path.endswith(("tests/test_docs.py", "tests/test_notebooks.py"))
        )
        groups[item.nodeid] = PROCESS_GROUP if together else path
    return groups


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The documentation site's tests run last: the site shows the notebooks
    the session executed (tests/test_notebooks.py), with their outputs.

    Marks the fast tier (FAST_MODULE_SECONDS). Under pytest-xdist (``-n``),
    each test gets an ``xdist_group`` (_groups).
    ``tryfirst``: xdist reads the groups in its own hook, after this one.
    """
    items.sort(key=lambda item: item.nodeid.split("::")[0].endswith("tests/test_docs.py"))
    fast = fast_modules(json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {})
    listed = matrix_tests()
    for item in items:
        path = item.nodeid.split("::")[0]
        if any(names(entry, item.nodeid) for entry in listed):
            item.add_marker(pytest.mark.matrix)
        if item.get_closest_marker("slow"):
            item.user_properties.append(("slow", "1"))  # For tests/suite_times.py.
        elif fast.get(path, True):  # A module the record lacks is fast.
            item.add_marker(pytest.mark.fast)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    groups = _groups(items)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))


#: The niceness the run started with (.ci/run starts the version matrix's at
#: 19): a test is never given less.
_START_NICENESS = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def _renice(niceness: int) -> None:
    """Sets every thread of this process to ``niceness`` above the run's own
    (Linux's niceness is per thread; TensorFlow's pools keep the value they
    started with)."""
    niceness = min(19, _START_NICENESS + niceness)
    for task in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), niceness)
        except (PermissionError, ProcessLookupError):
            pass  # Raising it back needs root; a thread may have ended.


def pytest_runtest_setup(item):
    """Under xdist, an in-process test runs niced (IN_PROCESS_NICENESS).
    Notes the CPU spent before its setup (cpu_time)."""
    cpu_time.start(item, _pool_server())
    if os.environ.get("PYTEST_XDIST_WORKER") and hasattr(os, "setpriority"):
        marker = item.get_closest_marker("xdist_group")
        group = marker.args[0] if marker and marker.args else None
        _renice(0 if group == PROCESS_GROUP else IN_PROCESS_NICENESS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Records the test's CPU seconds, setup to teardown, as its ``cpu``
    property (in the report of its teardown, which the JUnit XML reads)."""
    if call.when == "teardown":
        item.user_properties.append(("cpu", f"{cpu_time.spent(item, _pool_server()):.2f}"))
    yield


def pytest_configure(config):
    """The controller names the files the model corpus's rows and the warm
    pools' records go to: under xdist they are written in the workers and
    printed by the controller."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        for variable, prefix in (
            ("TFDIST_CORPUS_ROWS", "tfdist-corpus-rows-"),
            ("TFDIST_WARM_POOL_RECORD", "tfdist-warm-record-"),
        ):
            fd, path = tempfile.mkstemp(prefix=prefix, suffix=".txt")
            os.close(fd)
            os.environ[variable] = path
            config.add_cleanup(lambda path=path: Path(path).unlink(missing_ok=True))


def pytest_terminal_summary(terminalreporter):
    """Prints the model corpus's losses (tests/models) when it trained any,
    and what the warm pools forked and declined (_warm_pool)."""
    import corpus_report

    table = corpus_report.table()
    if table is not None:
        terminalreporter.write_sep("=", "model corpus: first and last epoch's loss")
        terminalreporter.write_line(table)
    record = Path(os.environ.get("TFDIST_WARM_POOL_RECORD", "/nonexistent"))
    lines = record.read_text(encoding="utf-8").splitlines() if record.exists() else []
    if lines:
        forked = sum(" forked " in line for line in lines)
        declined = collections.Counter(
            line.split(": ", 2)[-1] for line in lines if " declined " in line
        )
        terminalreporter.write_line(
            f"warm pool: {forked} TensorFlow processes forked, {sum(declined.values())} "
            f"started fresh" + "".join(f"\n  {n} x {why}" for why, n in declined.most_common())
        )
