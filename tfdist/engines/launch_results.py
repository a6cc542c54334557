"""What ``tfdist launch`` returns (:class:`LaunchResult`, one :class:`TaskExit` per task)
and the constants its tasks and the CLI share: exit codes, grace periods, what a
parameter-server task runs. No TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re
import signal

#: What ps and worker tasks of a parameter-server job run.
SERVER_CODE = "import tfdist.strategies as s, tfdist.spec as c; s.serve(c.parse())"

PORT_TAKEN = re.compile(
    r"Could not start gRPC server|Address already in use|"
    r"Failed to add port to server"
)
#: Lines of a non-chief task shown by default: warnings, errors, tracebacks.
IMPORTANT = re.compile(r"\bwarn|error|exception|traceback|^[EFW]\d{4}", re.IGNORECASE)
#: TensorFlow's INFO lines: not shown for a non-chief task, even with "error"
#: in their text ("Ignoring error status when releasing ...").
TF_INFO = re.compile(r"I\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w.]+:\d+\] ")
TAIL = 30
#: Seconds an evaluator may run on after the training tasks finished.
EVALUATOR_GRACE = 60.0
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
#: A task's exit code after it saved on preemption (128 + SIGTERM), as in
#: tfdist.training.fault_tolerance.preemption, which imports TensorFlow; the launcher does not.
PREEMPTED_EXIT_CODE = 143
#: Seconds the tasks get to save after a preemption signal (Slurm's
#: KillWait, a spot VM's notice: about 30 s).
DEFAULT_GRACE = 30.0
#: Seconds between two sends of the preemption signal to a task that has
#: not saved yet (see Attempt._forward).
RESEND_SECONDS = 2.0
#: Where, under TFDIST_JOB_DIR, the tasks write their preemption records.
STATUS_DIR = "preempted"


@dataclasses.dataclass(frozen=True)
class TaskExit:
    """How one task ended.

    Attributes:
        task: ``"worker:1"``.
        returncode: The process's return code (negative: killed by a signal).
        tail: Its last lines of output.
    """

    task: str
    returncode: int
    tail: tuple[str, ...] = ()

    @property
    def how(self) -> str:
        """``"exited with code 3"`` or ``"was killed by SIGKILL"``."""
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"was killed by {name}"
        return f"exited with code {self.returncode}"

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + N for a signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode


@dataclasses.dataclass
class LaunchResult:
    """What :func:`launch` did.

    Attributes:
        exit_code: 0 on success, else the failing task's code (128 + N for a
            signal N), 130 after Ctrl-C, 143 after SIGTERM (0 if the tasks
            finished within the grace period anyway), 143 when a preempted
            job has no restarts left.
        restarts: Restarts after failures or preemptions (at most
            ``max_restarts``).
        port_relaunches: Relaunches because a port was taken (not restarts).
        failure: The task failure that ended the job, or None.
        attempts: Every failure or preemption seen, in order.
        outcome: How the launch ended: ``"finished"``, ``"failed"``,
            ``"preempted"`` (stopped, with a backup saved), ``"killed"``
            (stopped after the grace period, nothing saved) or
            ``"stopped"`` (the tasks exited on the signal without saving).
        saved: The status record of the last preemption save
            (``{"step": ..., "epoch": ..., "batch": ..., "backup": ...}``),
            or None.
        stop_seconds: Seconds from the last preemption signal (to the
            launcher, or a task's own) to the exit of the last training task.
        workers: The number of workers of the last attempt.
        resizes: Elastic size changes, in order: ``(old, new, why)``.
    """

    exit_code: int = 0
    restarts: int = 0
    port_relaunches: int = 0
    failure: TaskExit | None = None
    attempts: list[TaskExit] = dataclasses.field(default_factory=list)
    outcome: str = ""
    saved: dict | None = None
    stop_seconds: float | None = None
    workers: int = 0
    resizes: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0
