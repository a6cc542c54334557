"""Multi-worker tasks leave TensorFlow's coordination service together.

A Python process that ends does not disconnect from the coordination
service (TensorFlow 2.21 never shuts its agent down at interpreter exit): it
just stops sending heartbeats. When a peer is still alive 10 s later (the
default heartbeat timeout), the leader declares the task crashed and every
surviving task logs, at ERROR level::

    BaseCollectiveExecutor::StartAbort UNAVAILABLE: ... The following tasks
    are unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:1
    The tasks have crashed. ...

or, when the leader left first, "Failed to send RPC to coordination
service". Measured: a clean 2-worker fit with one worker leaving 15 s after
the other logged it every time; a job whose workers finish their last
collective together but take different times to exit (saving, evaluating,
interpreter teardown under load) logs it now and then.

:func:`leave_together` registers an ``atexit`` handler that waits at a
coordination-service barrier until every training task reached its own
exit, so they all leave within a moment of each other. The wait is bounded:

* a process ending on an uncaught exception, or whose collectives
  tfdist's watchdog aborted, does not wait (its peers must learn of the
  failure as soon as possible);
* a dead peer fails the barrier once the service declares it unhealthy
  (about 10 s);
* otherwise the wait ends after ``TFDIST_EXIT_TIMEOUT`` seconds (default
  :data:`DEFAULT_EXIT_TIMEOUT`; 0 turns the barrier off). A script that
  calls ``sys.exit(1)`` while its peers still train waits that long, since
  an ``atexit`` handler cannot see the exit code.

``os._exit`` and fatal signals skip the handler, as do tfdist's preemption
exits (their own handler, registered later, runs first).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable

from absl import logging

from tfdist.errors import ConfigError

__all__ = ["DEFAULT_EXIT_TIMEOUT", "BARRIER_ID", "exit_timeout", "leave_together"]

#: Seconds a task waits at exit for the others, unless ``TFDIST_EXIT_TIMEOUT``.
DEFAULT_EXIT_TIMEOUT = 30.0
#: The coordination-service barrier every training task passes at exit.
BARRIER_ID = "tfdist/exit"

_registered = False
_failed_checks: list[Callable[[], bool]] = []


def exit_timeout() -> float:
    """Seconds to wait at exit (``TFDIST_EXIT_TIMEOUT``); 0 means no barrier."""
    text = os.environ.get("TFDIST_EXIT_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_EXIT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(
            "TFDIST_EXIT_TIMEOUT", text, "a number of seconds >= 0 (0: off)", source="environment"
        )
    return value


def leave_together(failed: Callable[[], bool] = lambda: False) -> None:
    """Makes this process wait at exit until every training task exits.

    Call it once the coordination service is up (after the strategy joined
    the cluster); later calls only add their ``failed`` check.

    Args:
        failed: Returns True when this process should not wait (its
            collectives were aborted, so the job failed).
    """
    global _registered
    _failed_checks.append(failed)
    if _registered:
        return
    timeout = exit_timeout()  # A bad value fails here, not at exit.
    if timeout > 0:
        atexit.register(_wait_for_peers)
        _registered = True


def _wait_for_peers() -> None:
    if getattr(sys, "last_value", None) is not None:
        return  # Uncaught exception: a crash; the peers must hear of it now.
    if any(check() for check in _failed_checks):
        return
    timeout = exit_timeout()
    from tfdist.compat.tf_python import eager_context as context

    started = time.monotonic()
    try:
        context.context().wait_at_barrier(BARRIER_ID, int(timeout * 1000))
    except Exception as error:  # noqa: BLE001 - exiting either way
        text = (str(error).strip().splitlines() or [""])[0][:300]
        logging.warning(
            "tfdist: left without waiting for every peer after %.1f s "
            "(TFDIST_EXIT_TIMEOUT=%g): %s: %s",
            time.monotonic() - started,
            timeout,
            type(error).__name__,
            text,
        )
