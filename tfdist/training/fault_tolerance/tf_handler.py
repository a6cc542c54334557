"""TensorFlow's ``PreemptionCheckpointHandler`` under tfdist: the preempted exit.

``tf.distribute.experimental.PreemptionCheckpointHandler(cluster_resolver,
checkpoint_manager)`` works under tfdist's MultiWorkerMirrored as TensorFlow
documents it (agreement on a step over the coordination service, a save
there, an exit). But off Google Cloud its default ``exit_fn`` is Borg's,
``sys.exit(42)``: to ``tfdist launch``, Kubernetes' ``ExitCode`` restart
policy and Slurm that is an ordinary failure, and no status record says at
which step it saved. Measured under ``tfdist launch --max-restarts 1``: SIGTERM
to one worker, both exit 42, the launcher restarts the job as after a crash
(spending a restart) and it resumes at the saved step.

:func:`install` (called when a tfdist strategy is created) gives a handler
created without a ``termination_config`` tfdist's exit instead: the status
record ``$TFDIST_JOB_DIR/preempted/TASK.json`` (step = the handler's run
count at the save), then exit code 143, as :mod:`tfdist.training.fault_tolerance.preemption` does. A
handler given its own ``termination_config`` is left as it is.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

__all__ = ["install", "wrap_init"]


def _record(handler: Any) -> dict:
    resolver = getattr(handler, "_cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None) or "worker"
    task_id = getattr(resolver, "task_id", None) or 0
    manager = getattr(handler, "_write_checkpoint_manager", None)
    signalled = getattr(handler, "_received_own_sigterm_time", None)
    record = {
        "task": f"{task_type}:{task_id}",
        "attempt": int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", 0)),
        "step": int(getattr(handler, "_run_counter", 0)),
        "backup": getattr(manager, "latest_checkpoint", None),
        "signal_time": signalled,
        "source": "PreemptionCheckpointHandler",
    }
    return record


def _exit(handler: Any) -> None:
    from tfdist.training.fault_tolerance.preemption import PREEMPTED_EXIT_CODE, write_status

    record = _record(handler)
    record["exit_time"] = time.time()
    write_status(record)
    print(
        f"tfdist: preempted: {record['task']} saved at step {record['step']} "
        f"(PreemptionCheckpointHandler); exiting with code {PREEMPTED_EXIT_CODE}",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(PREEMPTED_EXIT_CODE)


def wrap_init(original):
    @functools.wraps(original)
    def __init__(
        self,
        cluster_resolver,
        checkpoint_or_checkpoint_manager,
        checkpoint_dir=None,
        termination_config=None,
    ):
        if termination_config is None:
            import tensorflow as tf

            termination_config = tf.distribute.experimental.TerminationConfig(
                exit_fn=lambda: _exit(self)
            )
        original(
            self,
            cluster_resolver,
            checkpoint_or_checkpoint_manager,
            checkpoint_dir,
            termination_config,
        )

    return __init__


def install() -> None:
    """Wraps ``PreemptionCheckpointHandler.__init__`` once (the registry's
    ``preemption_handler``); idempotent."""
    from tfdist import compat

    compat.install("preemption_handler")
