"""The preemption signal in the servers of a parameter-server job.

A ps or worker task of a parameter-server job only serves the coordinator
(:func:`tfdist.strategies.serve`); TensorFlow's ``server.join()`` never
returns, and with Python's default action SIGTERM ends the task at once.
For a ps that loses the job's variables before anyone could save them: the
coordinator fails within a second (``ParameterServerError``), and a resume
goes back to the last backup. For the whole job preempted at once (SIGTERM to
every task, as ``tfdist launch`` and Slurm do) it also kills the workers that
the coordinator still waits on to finish the steps in flight.

So on the preemption signal (SIGTERM, or ``$TFDIST_PREEMPT_SIGNAL``) a server
keeps serving until the coordinator has saved, then exits with code 143:

* A **ps** first leaves a notice, ``$TFDIST_JOB_DIR/ps-notices/ps-N.json``.
  ``tfdist.fit`` on the coordinator looks for notices between steps and acts
  as if it had been signalled itself: the steps in flight finish, its
  ``BackupAndRestore`` saves (reading the variables from the ps, still
  there), and it exits with 143.
* A **worker** leaves no notice: the job can go on without it (the other
  workers run its steps).
* Either waits until the coordinator's status record
  (``$TFDIST_JOB_DIR/preempted/chief-0.json``) exists, the coordinator stops
  training, or the grace period ends (``$TFDIST_GRACE`` seconds, default 30,
  less a 2 s margin for the exit), whichever comes first, and then exits.

A server waits only while ``tfdist.fit`` trains with a backup callback (it
keeps a marker file in the notice directory meanwhile). Otherwise, or without
``$TFDIST_JOB_DIR``, the signal ends it at once, with code 143: the job is
being stopped (``local_cluster().stop()``, the launcher after the chief
finished), or nothing could save.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, NoReturn

from tfdist.training.fault_tolerance.preemption import (
    PREEMPTED_EXIT_CODE,
    preemption_signal,
    status_dir,
)

__all__ = ["serve_until_preempted", "NOTICE_DIR", "TRAINING_MARKER", "notice_dir", "grace_seconds"]

#: Where a ps leaves its notice, inside ``$TFDIST_JOB_DIR``.
NOTICE_DIR = "ps-notices"
#: Name prefix of the file ``tfdist.fit`` keeps in the notice directory while
#: it trains with a preemption watcher.
TRAINING_MARKER = "coordinator-training"
_DEFAULT_GRACE = 30.0
_MARGIN = 2.0


def notice_dir() -> str | None:
    """``$TFDIST_JOB_DIR/ps-notices``, or None without a job directory."""
    job = os.environ.get("TFDIST_JOB_DIR")
    return os.path.join(job, NOTICE_DIR) if job else None


def grace_seconds() -> float:
    """``$TFDIST_GRACE`` (seconds), or 30; an unreadable value counts as 30."""
    try:
        value = float(os.environ.get("TFDIST_GRACE") or _DEFAULT_GRACE)
    except ValueError:
        return _DEFAULT_GRACE
    return value if value > 0 else _DEFAULT_GRACE


def _write_json(directory: str, name: str, record: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)
    path = os.path.join(directory, name)
    os.replace(tmp, path)
    return path


def _coordinator_training() -> bool:
    directory = notice_dir()
    try:
        return directory is not None and any(
            name.startswith(TRAINING_MARKER) for name in os.listdir(directory)
        )
    except OSError:
        return False


def _coordinator_done() -> bool:
    directory = status_dir()
    if directory is None:
        return False
    try:
        return any(
            name.startswith("chief-") and name.endswith(".json") for name in os.listdir(directory)
        )
    except OSError:
        return False


def serve_until_preempted(task_type: str, task_index: int, server: Any = None) -> NoReturn:
    """Blocks this server's main thread until the preemption signal, then
    lets the coordinator save (see the module docstring) and exits with
    :data:`tfdist.training.fault_tolerance.preemption.PREEMPTED_EXIT_CODE`.

    Call it in the main thread after the ``tf.distribute.Server`` started,
    instead of ``server.join()`` (which never returns, so no Python signal
    handler could run).

    Args:
        task_type: ``"ps"`` or ``"worker"``.
        task_index: The task's index.
        server: The started ``tf.distribute.Server``, kept referenced here
            (its deletion would try to stop it).
    """
    task = f"{task_type}:{task_index}"
    signum = preemption_signal()
    received = threading.Event()
    signal_time: list[float] = []

    def on_signal(number: int, frame: object) -> None:
        if not signal_time:
            signal_time.append(time.time())
        received.set()

    signal.signal(signum, on_signal)
    while not received.wait(1.0):
        pass
    if not _coordinator_training():
        # Nothing to save for (no tfdist.fit with a backup running, or no
        # TFDIST_JOB_DIR): the job is being stopped, or cannot be helped.
        print(
            f"tfdist: {task} received {signum.name}: no training to save for; exiting "
            f"with code {PREEMPTED_EXIT_CODE}.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(PREEMPTED_EXIT_CODE)
    grace = grace_seconds()
    deadline = time.monotonic() + max(0.0, grace - _MARGIN)
    if task_type == "ps":
        _write_json(
            notice_dir(),
            f"ps-{task_index}.json",
            {"task": task, "signal_time": signal_time[0], "grace": grace},
        )
        what = "asked the coordinator to save; serving its variables until it has"
    else:
        what = "serving until the coordinator has saved (the job can go on without it)"
    print(
        f"tfdist: {task} received {signum.name}: {what}, at most {grace:g} s "
        f"(TFDIST_GRACE); then it exits with code {PREEMPTED_EXIT_CODE}.",
        file=sys.stderr,
        flush=True,
    )
    while time.monotonic() < deadline and not _coordinator_done() and _coordinator_training():
        time.sleep(0.1)
    if _coordinator_done():
        time.sleep(1.0)  # It detaches from the servers before it exits.
    reason = (
        "the coordinator saved"
        if _coordinator_done()
        else "the coordinator stopped training"
        if not _coordinator_training()
        else "the grace period ended"
    )
    print(
        f"tfdist: {task} exits ({reason}), {time.time() - signal_time[0]:.1f} s after the signal.",
        file=sys.stderr,
        flush=True,
    )
    sys.stderr.flush()
    # The server cannot be stopped; leave without TensorFlow's teardown.
    os._exit(PREEMPTED_EXIT_CODE)
