"""tests/collective_guard.py and tests/own_process.py, in a pytest run of their own.

A test that aborts its process's collectives fails at its teardown, named.
Marked ``own_process``, the same test runs in a child process, and the tests
after it keep their collectives.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # Three TensorFlow processes (pytest, its worker, a child).

TESTS = textwrap.dedent(
    """
    import pytest

    from collective_guard import collectives_error


    @pytest.fixture(scope="session")
    def tf_cpus():
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        two = [tf.config.LogicalDeviceConfiguration()] * 2
        tf.config.set_logical_device_configuration(cpu, two)
        return tf


    def abort():
        # What TensorFlow does itself when a collective starts while its
        # failed step is being cancelled; here at once, on purpose.
        from tensorflow.python.eager import context
        from tensorflow.python.framework import errors

        context.context().abort_collective_ops(errors.UNAVAILABLE, "aborted on purpose")


    @pytest.mark.own_process
    @pytest.mark.xdist_group("aborting")  # Its node id ends in "@aborting".
    def test_aborts_in_its_own_process(tf_cpus):
        assert collectives_error() is None
        abort()
        assert "aborted on purpose" in collectives_error()


    def test_after_the_child(tf_cpus):
        assert collectives_error() is None


    def test_aborts_here(tf_cpus):
        abort()
    """
)


def test_an_aborting_test_is_named_and_one_in_its_own_process_spoils_nothing(tmp_path):
    (tmp_path / "test_aborting.py").write_text(TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "collective_guard", "-p", "own_process"]
        + [
            "-p",
            "no:cacheprovider",
            "-n",
            "1",
            "--dist",
            "loadgroup",
            "-q",
            "-rA",
            "test_aborting.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests"), "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    # The own_process test aborted its child's collectives, not the worker's:
    # the test after it passes there.
    for name in ("test_aborts_in_its_own_process", "test_after_the_child", "test_aborts_here"):
        assert f"PASSED test_aborting.py::{name}" in out, out
    # The test that aborted them in the worker fails at its teardown, named.
    assert "ERROR test_aborting.py::test_aborts_here" in out, out
    assert (
        "test_aborting.py::test_aborts_here left this process's TensorFlow collectives "
        "failing (UnavailableError: Collective ops is aborted by: aborted on purpose)" in out
    ), out
    assert "@pytest.mark.own_process" in out, out
    assert re.search(r"\b3 passed(, \d+ warnings?)?, 1 error in\b", done.stdout), out
