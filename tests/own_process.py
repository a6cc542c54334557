"""Tests marked ``own_process`` run in a pytest process of their own.

Such a test makes a step fail on purpose while collectives run (an id
outside a split vocabulary, a stock strategy's known failure). TensorFlow
may then abort every collective of the process: a collective that starts
while the failed step is being cancelled fails before the step counts as
cancelled, and ``BaseCollectiveExecutor`` takes that for a collective error
("Collective ops is aborted by: CompleteGroup is cancelled before it
starts"). Every later collective of that process fails, in whatever test
runs there next. So the test runs in a child pytest (a fork of the warm
pool when the session has one), which only it can spoil; the parent reports
the child's result as the test's. Its fixtures are still set up in the parent
too (cheap ones: ``tf_cpus``, ``keras_mod``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: Set in the child: run the test here, and check no collectives after it.
ENV = "TFDIST_TEST_OWN_PROCESS"
MARKER = "own_process"
#: Seconds the child may take (tests/deadline.py still ends a hung parent).
TIMEOUT = 600


def in_child() -> bool:
    return os.environ.get(ENV) == "1"


def child_command(nodeid: str, python: str) -> list[str]:
    """The child's pytest: this one test, without xdist (and without a warm
    pool of its own: tests/conftest.py starts none in a child)."""
    return [python, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", nodeid]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker(MARKER) is None or in_child():
        return None
    from tfdist.engines import warm

    # This process's environment (the test's, with tests/conftest.py's
    # changes), and the warm pool's interpreter when the session has one.
    env = {**os.environ, ENV: "1"}
    try:
        done = subprocess.run(
            child_command(pyfuncitem.nodeid, warm.interpreter(env)),
            cwd=pyfuncitem.config.rootpath,  # Node ids are relative to it.
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(
            f"{pyfuncitem.nodeid} did not end in its own process within {TIMEOUT} s:\n"
            f"{(error.stdout or '')[-3000:]}",
            pytrace=False,
        )
    summary = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    if done.returncode != 0 or " passed" not in summary[0]:
        sys.stdout.write(done.stdout[-6000:])
        sys.stderr.write(done.stderr[-3000:])
        pytest.fail(
            f"{pyfuncitem.nodeid} failed in its own process (exit code {done.returncode}): "
            f"{summary[0]}",
            pytrace=False,
        )
    return True
