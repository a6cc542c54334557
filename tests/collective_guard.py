"""A test that leaves TensorFlow's collectives aborted is named.

Once TensorFlow aborts a process's collective executor, every later
collective of that process fails ("Collective ops is aborted by: ... Restart
your program to reset"), in whichever tests run there next: the failures
then name innocent tests. After each test that used the logical CPUs
(``tf_cpus``), this runs an all-reduce over two of them. If it fails, the
test that left the collectives aborted fails at its teardown, saying so and
with TensorFlow's first error; the tests after it in that process may fail
too, and the report names the cause first. (It does not end the process, as
tests/deadline.py does: pytest-xdist 3.8.0 under ``--dist loadgroup`` hangs
when it replaces a crashed worker, pytest-xdist#1323 and #1327.)

Tests that abort collectives on purpose (a step that fails while others'
collectives run) run in a process of their own: tests/own_process.py.
"""

from __future__ import annotations

import sys
import threading

import pytest

from own_process import in_child

#: The probe's group key: far above the ones TensorFlow's strategies (1, 2,
#: ...) and tfdist.parallel's runtimes (50,000 + ...) take, so that it never
#: shares a group or instance with a test's collectives.
GROUP_KEY_START = 9_000_000

_probe: dict = {}
#: Set once a test left the collectives failing: nothing to probe after it.
_spoiled: list[str] = []


def _all_reduce(tf):
    """An all-reduce of 1.0 over two logical CPUs: 2.0 while the process's
    collectives work."""
    if "run" not in _probe:
        from tensorflow.python.distribute import cross_device_ops, cross_device_utils

        devices = ["/cpu:0", "/cpu:1"]
        strategy = tf.distribute.MirroredStrategy(
            devices,
            cross_device_ops=cross_device_ops.CollectiveAllReduce(
                devices=devices,
                group_size=2,
                options=tf.distribute.experimental.CommunicationOptions(),
                collective_keys=cross_device_utils.CollectiveKeys(GROUP_KEY_START),
            ),
        )

        @tf.function(autograph=False)
        def step():
            return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))

        _probe["run"] = lambda: strategy.experimental_local_results(strategy.run(step))
    return [float(v) for v in _probe["run"]()]


def collectives_error() -> str | None:
    """Why this process's collectives fail, or None when they work (or
    TensorFlow's logical CPUs were never set up here)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or len(tf.config.list_logical_devices("CPU")) < 2:
        return None
    found: list = []

    def probe():  # In a thread of its own: no test's strategy scope applies.
        try:
            found.append(_all_reduce(tf))
        except Exception as error:  # noqa: BLE001 (the error is the finding)
            found.append(error)

    thread = threading.Thread(target=probe, name="collective-guard", daemon=True)
    thread.start()
    thread.join(120)
    if not found:
        return "a two-device all-reduce did not end within 120 s"
    if isinstance(found[0], Exception):
        lines = [line.strip() for line in str(found[0]).splitlines() if line.strip()]
        # TensorFlow's first error, which every later collective repeats.
        said = next((line for line in lines if "aborted by" in line), lines[0] if lines else "")
        return f"{type(found[0]).__name__}: {said}"
    if found[0] != [2.0, 2.0]:
        return f"a two-device all-reduce of 1.0 gave {found[0]}"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if _spoiled or in_child() or "tf_cpus" not in getattr(item, "fixturenames", ()):
        return result
    why = collectives_error()
    if why is not None:
        _spoiled.append(item.nodeid)
        pytest.fail(
            f"{item.nodeid} left this process's TensorFlow collectives failing ({why}); "
            "a test that makes a step fail while collectives run needs "
            "@pytest.mark.own_process (tests/own_process.py)",
            pytrace=False,
        )
    return result
