"""Shared fixtures: logical CPUs, a clean environment, subprocess workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def start(args, *, tf_config: dict | None = None, **extra_env) -> subprocess.Popen:
    """Starts ``python ARGS`` with its own TF_CONFIG; output is captured."""
    env = subprocess_env(**extra_env)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return subprocess.Popen(
        [sys.executable, *map(str, args)],
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


def executed_notebooks(tmp_path_factory) -> Path:
    """Where tests/test_notebooks.py leaves the notebooks it ran
    (``DIR/notebooks/NAME.ipynb``), for tests/test_docs.py's site."""
    return tmp_path_factory.getbasetemp() / "executed"


def pytest_collection_modifyitems(items):
    """The documentation site's tests run last: the site shows the notebooks
    the session executed (tests/test_notebooks.py), with their outputs."""
    items.sort(key=lambda item: item.nodeid.split("::")[0].endswith("tests/test_docs.py"))


def pytest_terminal_summary(terminalreporter):
    """Prints the model corpus's losses (tests/models) when it trained any."""
    report = sys.modules.get("corpus_report")
    if report is not None and report.ROWS:
        terminalreporter.write_sep("=", "model corpus: first and last epoch's loss")
        terminalreporter.write_line(report.table())
