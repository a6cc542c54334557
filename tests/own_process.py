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

#: Set in the child, which runs the test itself (with no collective guard
#: after it and no warm pool of its own).
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


def plain_nodeid(item) -> str:
    """The item's node id as pytest takes it on its command line: under
    xdist's ``--dist loadgroup`` it ends in ``@<group>``."""
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return item.nodeid
    group = marker.args[0] if marker.args else marker.kwargs.get("name", "")
    if group and item.nodeid.endswith(f"@{group}"):
        return item.nodeid[: -len(group) - 1]
    return item.nodeid


def child_env() -> dict[str, str]:
    """This process's environment (the test's, with tests/conftest.py's
    changes) for the child, which is no xdist worker."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT"))
    }
    env[ENV] = "1"
    return env


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker(MARKER) is None or in_child():
        return None
    from tfdist.engines import warm

    env = child_env()
    try:
        done = subprocess.run(
            # The warm pool's interpreter when the session has one.
            child_command(plain_nodeid(pyfuncitem), warm.interpreter(env)),
            cwd=pyfuncitem.config.rootpath,  # Node ids are relative to it.
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as error:
        out = error.stdout or ""  # Bytes on some Pythons, despite text=True.
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        pytest.fail(
            f"{pyfuncitem.nodeid} did not end in its own process within {TIMEOUT} s:\n"
            f"{out[-3000:]}",
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
