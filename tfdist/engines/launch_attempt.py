"""One attempt of ``tfdist launch``: start every task, watch them, forward a
preemption, and say how the attempt ended (and whether to restart). No TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from tfdist.engines import elastic as launch_elastic
from tfdist.engines.launch_results import (
    EVALUATOR_GRACE,
    PREEMPTED_EXIT_CODE,
    RESEND_SECONDS,
    SERVER_CODE,
    TaskExit,
)
from tfdist.engines.launch_tasks import (
    Output,
    Signals,
    Task,
    compact_json,
    position,
    stop_all,
    tasks_of,
)
from tfdist.errors import ConfigError


@dataclasses.dataclass
class Settings:
    """What every attempt of one launch shares."""

    evaluator: bool
    script_argv: list[str]
    args: list[str]
    parameter_server: bool
    show_all: bool
    env: dict
    python: str
    log_dir: Any
    stop_timeout: float
    out: Output
    verbose: bool
    grace: float
    preempt_signal: int
    stops: Signals
    status_dir: Path
    discovery: launch_elastic.Discovery | None
    discovery_interval: float
    min_workers: int
    max_workers: int


@dataclasses.dataclass
class AttemptEnd:
    """How one attempt ended.

    ``how``: "finished", "failed", "port" (a task could not bind its port),
    "preempted" (a training task exited with PREEMPTED_EXIT_CODE after
    writing its status record), "stopped" (the launcher got a stop signal)
    or "resize" (the discovery script asked for another size).
    """

    how: str
    failure: TaskExit | None = None
    records: dict[str, dict] = dataclasses.field(default_factory=dict)
    exits: list[TaskExit] = dataclasses.field(default_factory=list)
    killed: list[str] = dataclasses.field(default_factory=list)
    finished: bool = False
    drain_seconds: float | None = None
    grace: float = 0.0
    target: int | None = None
    lead: str = "worker:0"
    hurried: str | None = None  # Killed on this second signal, before the grace ended.

    @property
    def record(self) -> dict | None:
        """The lead task's status record (every task saves the same step)."""
        if not self.records:
            return None
        return self.records.get(self.lead) or self.records[sorted(self.records)[0]]


class Attempt:
    """Starts every task of one attempt, watches them, stops them all."""

    def __init__(self, settings: Settings, spec: dict, attempt: int, size: int) -> None:
        self.s = settings
        self.spec = spec
        self.attempt = attempt
        self.size = size
        self.tasks: list[Task] = []
        self.trainers: list[Task] = []  # Run the script and save.
        self.servers: list[Task] = []  # A parameter-server job's ps and workers.
        self.lead = "chief:0" if "chief" in spec["cluster"] else "worker:0"

    def run(self) -> AttemptEnd:
        s = self.s
        seen = s.stops.count
        try:
            self._start()
            next_check = time.monotonic() + s.discovery_interval
            evaluator_deadline = None
            while True:
                if s.stops.count > seen:
                    s.out.say(
                        f"{signal.Signals(s.stops.signum).name}: passing "
                        f"{signal.Signals(s.preempt_signal).name} on to the training "
                        f"tasks; they have {s.grace:g} s (--grace) to save and exit"
                    )
                    self._forward()
                    return self._drain("stopped", s.stops.time)
                now = time.monotonic()
                for task in self.tasks:
                    code = task.poll()
                    if code is not None and code != 0:
                        return self._exited(task, code, now)
                if all(t.poll() == 0 for t in self.trainers):
                    # Training is done; a side-car evaluator gets a grace period
                    # to evaluate the last checkpoint, then it is stopped.
                    evaluator_deadline = evaluator_deadline or time.monotonic() + EVALUATOR_GRACE
                    if (
                        all(
                            t.poll() is not None
                            for t in self.tasks
                            if t.task.startswith("evaluator")
                        )
                        or time.monotonic() > evaluator_deadline
                    ):
                        return AttemptEnd("finished", lead=self.lead)
                # After the exits: a lost worker is a failure, even if the
                # discovery script already reports its slot gone.
                if s.discovery is not None and now >= next_check:
                    end = self._resize_if_asked()
                    next_check = time.monotonic() + s.discovery_interval
                    if end is not None:
                        return end
                time.sleep(0.05)
        finally:
            stop_all(self.tasks, s.stop_timeout)

    def _exited(self, task: Task, code: int, now: float) -> AttemptEnd:
        """The end of the attempt once ``task`` exited with ``code`` (not 0):
        a preemption (it saved: the others get the grace period to save the
        same step) or a failure (every task is stopped)."""
        s = self.s
        task.finish(1.0)
        if task in self.trainers and code == PREEMPTED_EXIT_CODE and self._records().get(task.task):
            record = self._records()[task.task]
            s.out.say(
                f"{task.task} exited {code} after saving at "
                f"{position(record)} (preempted); waiting up to "
                f"{s.grace:g} s for the other tasks to save and exit"
            )
            # The grace period runs from the task's signal when a
            # record says when it came.
            times = [
                r["signal_time"]
                for r in self._records().values()
                if isinstance(r.get("signal_time"), (int, float))
            ]
            started = now - max(0.0, time.time() - min(times)) if times else now
            end = self._drain("preempted", started)
            # Named after the task that got the signal: the first
            # to exit may be another one.
            first = _first_signalled(end.records) or task.task
            end.failure = next((e for e in end.exits if e.task == first), task.exit())
            return end
        failure = task.exit()
        stop_all(self.tasks, s.stop_timeout)
        return AttemptEnd("port" if task.port_taken else "failed", failure, lead=self.lead)

    def _resize_if_asked(self) -> AttemptEnd | None:
        """When the discovery script reports another size and no task
        failed: the workers save (a preemption), then the attempt ends."""
        s = self.s
        target = self._target()
        if target is None or any(t.poll() not in (None, 0) for t in self.tasks):
            return None
        s.out.say(
            f"the discovery script reports room for {target} worker(s) "
            f"(now {self.size}): passing "
            f"{signal.Signals(s.preempt_signal).name} on so that the "
            "workers save, then relaunching"
        )
        self._forward()
        end = self._drain("resize", time.monotonic())
        end.target = target
        return end

    def _start(self) -> None:
        s = self.s
        base_env = dict(os.environ)
        base_env.update(s.env or {})
        base_env.update({"PYTHONUNBUFFERED": "1", "TFDIST_LAUNCH_ATTEMPT": str(self.attempt)})
        # Status records are per attempt: an old one must not pass for a new save.
        shutil.rmtree(s.status_dir, ignore_errors=True)
        logs = Path(s.log_dir) / f"attempt-{self.attempt}" if s.log_dir else None
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
        for task_type, index, config in tasks_of(self.spec, s.evaluator):
            name = f"{task_type}:{index}"
            task_env = dict(base_env, TF_CONFIG=compact_json(config))
            server = s.parameter_server and task_type in ("ps", "worker")
            argv = [s.python, "-c", SERVER_CODE] if server else [s.python, *s.script_argv, *s.args]
            task = Task(
                name,
                argv,
                task_env,
                s.out,
                s.show_all or name == self.lead,
                logs / f"{name.replace(':', '-')}.log" if logs else None,
                s.verbose,
            )
            self.tasks.append(task)
            if server:
                self.servers.append(task)
            elif task_type != "evaluator":
                self.trainers.append(task)

    def _records(self) -> dict[str, dict]:
        return read_status_records(self.s.status_dir)

    def _target(self) -> int | None:
        """The size the discovery script asks for, if not the current one."""
        s = self.s
        try:
            slots = s.discovery.slots()
        except ConfigError as error:
            # A failing script mid-job keeps the job as it is.
            s.out.say(f"warning: {error}; keeping {self.size} workers")
            return None
        target = min(s.max_workers, max(s.min_workers, slots))
        return target if target != self.size else None

    def _forward(self, again: bool = False) -> None:
        """Passes the preemption signal on to the tasks that run the script.

        A parameter-server job's servers keep running: the chief needs them
        to save, and they are stopped once it exited.

        Args:
            again: Only to the tasks without a status record yet. A task
                that is still starting may have lost the first signal
                (TensorFlow's coordination service records SIGTERM and
                nothing more until the script's watcher takes it over); one
                that saved is left to exit in peace.
        """
        saved = set(self._records()) if again else set()
        for task in self.tasks:
            if task not in self.servers and task.poll() is None and task.task not in saved:
                task.signal(self.s.preempt_signal)

    def _drain(self, how: str, started: float) -> AttemptEnd:
        """Waits up to the grace period (from ``started``) for the script's
        tasks to exit, SIGKILLs those still running, then stops the servers."""
        s = self.s
        seen = s.stops.count
        watched = [t for t in self.tasks if t not in self.servers]
        hurried = None
        deadline = started + s.grace
        resend = time.monotonic() + RESEND_SECONDS
        while any(t.poll() is None for t in watched) and time.monotonic() < deadline:
            if how != "preempted" and time.monotonic() >= resend:
                self._forward(again=True)
                resend = time.monotonic() + RESEND_SECONDS
            if s.stops.count > seen:
                if how != "stopped" and seen == 0:
                    # A first stop signal during a resize or a task's
                    # preemption: pass it on; the job ends after this save.
                    how, seen = "stopped", s.stops.count
                    self._forward()
                else:
                    hurried = signal.Signals(s.stops.last).name
                    s.out.say(f"{hurried} again: killing every task now")
                    break
            time.sleep(0.05)
        killed = [t.task for t in self.trainers if t.poll() is None]
        for t in watched:
            if t.poll() is None:
                t.signal(signal.SIGKILL)
                t.proc.wait()
        last_exit = time.monotonic()
        stop_all(self.servers, 1.0)
        for t in watched:
            t.finish(1.0)
        return AttemptEnd(
            how,
            records=self._records(),
            exits=[t.exit() for t in self.trainers],
            killed=killed,
            finished=all(t.proc.returncode == 0 for t in self.trainers),
            drain_seconds=last_exit - started,
            grace=s.grace,
            lead=self.lead,
            hurried=hurried,
        )


def _first_signalled(records: dict[str, dict]) -> str | None:
    """The task whose record has the earliest ``signal_time``."""
    timed = [
        (r["signal_time"], task)
        for task, r in records.items()
        if isinstance(r.get("signal_time"), (int, float))
    ]
    return min(timed)[1] if timed else None


def read_status_records(directory: str | os.PathLike) -> dict[str, dict]:
    """The preemption status records in ``directory``, by task (``"worker:0"``).

    A record that cannot be read (a partial write) is skipped: the workers
    write them atomically, so that is not a save.
    """
    records = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            task = record.get("task") or path.stem.replace("-", ":", 1)
            records[str(task)] = record
    return records
