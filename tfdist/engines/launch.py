"""``tfdist launch``: run a multi-worker job as local processes, with restarts.

What torchrun is to PyTorch, for one machine: it picks free ports on
127.0.0.1, gives every task its TF_CONFIG, starts one process per task,
prefixes their output, and watches them. TensorFlow's start-up noise
(:mod:`tfdist.engines.quiet`) is left out of what it shows, unless ``verbose``; the
per-task log files keep every line.

* A task that exits non-zero or is killed stops the whole job (the peers of a
  synchronous job would otherwise wait forever); the job then restarts, on
  new ports, up to ``max_restarts`` times. Training scripts resume with a
  backup callback (``tfdist.training.callbacks.BackupAndRestore``).
* A task that could not bind its port ("Could not start gRPC server": another
  process took it after it was picked) makes the launcher stop every task and
  relaunch on new ports, without counting a restart.
* Parameter-server jobs: ps and worker tasks run TensorFlow servers; the
  chief runs the script.
* Preemption: SIGTERM or Ctrl-C to the launcher is passed on (as
  ``preempt_signal``) to the tasks that run the script; they get ``grace``
  seconds to save and exit, then are SIGKILLed (a parameter-server job's
  servers only after the chief exited: it saves through them). The launcher
  reports what happened from the status records the tasks write
  (``$TFDIST_JOB_DIR/preempted/TASK.json``, :mod:`tfdist.training.preemption`):
  saved at step N, finished, or killed. A task that exits with
  PREEMPTED_EXIT_CODE after writing its record was preempted by itself: the
  others get the grace period to finish the same save, then the job restarts
  (one of ``max_restarts``) and resumes at that step.
* Elastic jobs (``workers="MIN:MAX"``): a lost worker, once restarts are
  spent (or at once with ``worker_failed="shrink"``), restarts the job one
  worker smaller, down to MIN; a host-discovery script that reports room
  resizes it (a preemption save, then a relaunch). :mod:`tfdist.engines.elastic`.
* An error in the launcher stops every child (each runs in its own process
  group) before returning: no orphans.
* Every task gets ``TFDIST_LAUNCH_ATTEMPT`` (0, then 1, 2... after restarts)
  and ``TFDIST_JOB_DIR``: a scratch directory of this launch, the same across
  restarts and removed when the launch returns. ``tfdist.horovod.elastic``
  keeps its commits there, so a restarted job resumes from them while a new
  launch starts afresh.

This module does not import TensorFlow; the children do.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Sequence

from tfdist import spec as cluster
from tfdist.engines import elastic as launch_elastic
from tfdist.errors import ConfigError, require_int
from tfdist.engines.net import local_spec
from tfdist.engines.quiet import NoiseFilter

__all__ = ["launch", "LaunchResult", "TaskExit", "SERVER_CODE", "PREEMPTED_EXIT_CODE",
           "DEFAULT_GRACE", "read_status_records"]

#: What ps and worker tasks of a parameter-server job run.
SERVER_CODE = ("import tfdist.strategies as s, tfdist.spec as c; "
               "s.serve(c.parse())")

_PORT_TAKEN = re.compile(r"Could not start gRPC server|Address already in use|"
                         r"Failed to add port to server")
#: Lines of a non-chief task shown by default: warnings, errors, tracebacks.
_IMPORTANT = re.compile(r"\bwarn|error|exception|traceback|^[EFW]\d{4}", re.IGNORECASE)
#: TensorFlow's INFO lines: not shown for a non-chief task, even with "error"
#: in their text ("Ignoring error status when releasing ...").
_TF_INFO = re.compile(r"I\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w.]+:\d+\] ")
_TAIL = 30
#: Seconds an evaluator may run on after the training tasks finished.
EVALUATOR_GRACE = 60.0
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
#: A task's exit code after it saved on preemption (128 + SIGTERM), as in
#: tfdist.training.preemption, which imports TensorFlow; the launcher does not.
PREEMPTED_EXIT_CODE = 143
#: Seconds the tasks get to save after a preemption signal (Slurm's
#: KillWait, a spot VM's notice: about 30 s).
DEFAULT_GRACE = 30.0
#: Seconds between two sends of the preemption signal to a task that has
#: not saved yet (see _Attempt._forward).
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


class _Signals:
    """The stop signals the launcher received (set by its signal handler).

    The handler only records the signal: the attempt's watch loop passes it
    on and runs the grace period, so a signal never cuts a stop short.
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # The first one.
        self.last: int | None = None
        self.time = 0.0
        self.count = 0

    def __call__(self, signum: int, frame: Any = None) -> None:
        if self.count == 0:
            self.signum, self.time = signum, time.monotonic()
        self.last = signum
        self.count += 1


class _Task:
    """One child process and the thread that copies its output."""

    def __init__(self, task: str, argv: list[str], env: dict, out: "_Output",
                 shown: bool, log_path: Path | None, verbose: bool = False) -> None:
        self.task = task
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
        self.port_taken = False
        self._log = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115
        # Own session: the launcher signals the whole group, grandchildren too.
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True,
            encoding="utf-8", errors="replace", bufsize=1)
        self._thread = threading.Thread(target=self._pump, args=(out, shown, verbose),
                                        daemon=True)
        self._thread.start()

    def _pump(self, out: "_Output", shown: bool, verbose: bool) -> None:
        in_traceback = False
        noise = None if verbose else NoiseFilter()
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if self._log:
                self._log.write(line + "\n")
            if _PORT_TAKEN.search(line):
                self.port_taken = True
            if noise is not None and noise.is_noise(line):
                continue  # In the log file only.
            self.tail.append(line)
            in_traceback = in_traceback or line.startswith("Traceback")
            if shown or in_traceback or (_IMPORTANT.search(line)
                                         and not _TF_INFO.match(line)):
                out.line(f"[{self.task}] {line}")
        if self._log:
            self._log.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self, timeout: float = 5.0) -> None:
        """Waits for the output to drain after the process ended."""
        self._thread.join(timeout)

    def exit(self) -> TaskExit:
        return TaskExit(self.task, self.proc.returncode, tuple(self.tail))


class _Output:
    """Serializes lines from several threads onto one stream."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            self._stream.write(text + "\n")
            self._stream.flush()

    def say(self, text: str) -> None:
        self.line(f"[tfdist launch] {text}")


def _tasks_of(spec: dict, evaluator: bool) -> list[tuple[str, int, dict]]:
    tasks = [(t, i, cfg) for t, i, cfg in cluster.all_task_configs(spec)]
    if evaluator:
        # The evaluator stays outside `cluster`, as TensorFlow expects.
        tasks.append(("evaluator", 0, {"cluster": spec["cluster"],
                                       "task": {"type": "evaluator", "index": 0}}))
    return tasks


def _check_counts(workers: Any, ps: Any, max_restarts: Any) -> None:
    require_int("workers", workers, 1, "tfdist launch")
    require_int("ps", ps, 0, "tfdist launch")
    require_int("max_restarts", max_restarts, 0, "tfdist launch")


def _signal_number(value: Any) -> int:
    """``"SIGUSR1"``, ``"USR1"``, ``10`` or a ``signal.Signals`` -> its number."""
    expected = ("a signal name or number that a process can catch (SIGTERM, SIGUSR1, "
                "SIGINT...)")
    try:
        if isinstance(value, str):
            name = value.strip().upper()
            number = int(name) if name.isdigit() else signal.Signals[
                name if name.startswith("SIG") else "SIG" + name]
        elif isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            raise KeyError(value)
        number = signal.Signals(number)
    except (KeyError, ValueError):
        raise ConfigError("preempt_signal", value, expected, source="tfdist launch") from None
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError("preempt_signal", value, expected, source="tfdist launch",
                          hint=f"{number.name} cannot be caught, so nothing could be saved.")
    return int(number)


def non_local_hosts(spec: dict) -> list[str]:
    """The hosts of a spec that are not this machine's loopback."""
    addresses = [a for job in spec["cluster"].values() for a in job]
    return sorted({cluster.parse_address(a)[0] for a in addresses} - _LOCAL_HOSTS)


def _position(record: dict) -> str:
    """``"step 37 (epoch 1, batch 12)"`` from a status record."""
    text = f"step {record.get('step')}"
    if record.get("epoch") is not None:
        text += f" (epoch {record['epoch']}, batch {record.get('batch')})"
    return text


def launch(
    script: str | Sequence[str],
    args: Sequence[str] = (),
    *,
    workers: int | str | tuple[int, int] = 2,
    chief: bool = False,
    ps: int = 0,
    evaluator: bool = False,
    max_restarts: int = 0,
    show_all: bool = False,
    spec: Any = None,
    env: dict | None = None,
    python: str = sys.executable,
    log_dir: str | os.PathLike | None = None,
    stop_timeout: float = 10.0,
    port_relaunches: int = 5,
    output: IO[str] | None = None,
    handle_signals: bool | None = None,
    verbose: bool = False,
    grace: float = DEFAULT_GRACE,
    preempt_signal: str | int = "SIGTERM",
    worker_failed: str = "restart",
    host_discovery_script: str | os.PathLike | None = None,
    discovery_interval: float = 5.0,
) -> LaunchResult:
    """Runs ``python SCRIPT ARGS`` as every task of a local cluster.

    Args:
        script: A script path, or ``["-m", "pkg.module"]`` / ``["-c", code]``.
        args: The script's arguments.
        workers: Worker tasks: a count, or an elastic range ``"MIN:MAX"`` /
            ``(MIN, MAX)``. An elastic job starts MAX workers (or what the
            discovery script reports), shrinks by one down to MIN when a
            worker fails and cannot be restarted (see ``worker_failed``), and
            grows back when the discovery script reports free slots.
        chief: Add a chief task (required with ``ps``).
        ps: Parameter-server tasks. With ps > 0, ps and worker tasks run
            TensorFlow servers and only the chief (and evaluator) run the
            script.
        evaluator: Add an evaluator task. It runs the script too; when the
            training tasks have finished it has EVALUATOR_GRACE seconds to
            finish before it is stopped.
        max_restarts: Restarts of the whole job after a task fails or is
            preempted.
        show_all: Show every task's output. By default the chief's (or
            worker 0's) output is shown in full and the others' warnings,
            errors and tracebacks only.
        spec: A cluster spec (anything :func:`tfdist.spec.parse` accepts)
            to use instead of picked ports; it must name only local hosts.
            It sets the job's shape (``workers``, ``chief`` and ``ps`` are
            ignored); its ports are used for the first attempt only.
        env: Extra environment variables for every task (a
            ``TFDIST_JOB_DIR`` here replaces the launch's own scratch
            directory, which is then not removed).
        python: The interpreter the tasks run.
        log_dir: If given, each task's full output goes to
            ``LOG_DIR/attempt-N/TASK.log``.
        stop_timeout: Seconds between SIGTERM and SIGKILL when stopping the
            other tasks after a failure.
        port_relaunches: How many relaunches on new ports to allow when a
            port was taken.
        output: Where prefixed lines go (default: sys.stdout).
        handle_signals: Turn SIGTERM/SIGINT (and ``preempt_signal``) into a
            preemption of the job: the signal is passed on and the tasks get
            ``grace`` seconds to save; default: when called from the main
            thread.
        verbose: Also show TensorFlow's start-up noise (the lines of
            :data:`tfdist.engines.quiet.NOISE`); by default only the log files
            have it, and the tail of a failed task leaves it out.
        grace: Seconds the training tasks get, after a preemption signal,
            to save and exit before they are killed (exported as
            ``TFDIST_GRACE``).
        preempt_signal: The signal passed on to the training tasks when the
            launcher is stopped or resizes the job (exported as
            ``TFDIST_PREEMPT_SIGNAL``).
        worker_failed: Elastic jobs: ``"restart"`` restarts the job at its
            size while restarts remain, then shrinks it; ``"shrink"``
            shrinks it at once.
        host_discovery_script: Elastic jobs: an executable printing the
            worker slots available (see :mod:`tfdist.engines.elastic`), run
            every ``discovery_interval`` seconds.
        discovery_interval: Seconds between two runs of the discovery
            script.

    Returns:
        A :class:`LaunchResult`; the ``tfdist launch`` command exits with its
        ``exit_code``.

    Raises:
        ConfigError: Bad counts, grace, signal, elastic range or discovery
            script, or a spec naming other hosts (the message says to run
            ``tfdist hosts`` for the per-host commands).
    """
    source = "tfdist launch"
    min_workers, max_workers = launch_elastic.parse_workers(workers)
    elastic = min_workers != max_workers or host_discovery_script is not None
    if spec is not None:
        if elastic:
            raise ConfigError("spec", spec, "no spec with an elastic --workers MIN:MAX",
                              source=source, hint="An elastic job picks its own ports.")
        spec = cluster.parse(spec, require_task=False).to_dict()
        jobs = spec["cluster"]
        # Later attempts use new ports for a cluster of the same shape.
        min_workers = max_workers = len(jobs.get("worker", []))
        ps = len(jobs.get("ps", []))
        chief = "chief" in jobs
        others = non_local_hosts(spec)
        if others:
            raise ConfigError(
                "spec", others, "a spec with only local hosts (127.0.0.1, localhost)",
                source=source, received=", ".join(others),
                hint="tfdist launch starts processes on this machine only; "
                "`tfdist hosts SPEC -- SCRIPT` prints each host's TF_CONFIG and command.")
    _check_counts(max_workers, ps, max_restarts)
    if ps and not chief:
        raise ConfigError("chief", chief, "True with ps > 0", source=source,
                          hint="A parameter-server job needs a chief to run the training.")
    if elastic and (ps or chief):
        field, value = ("ps", ps) if ps else ("chief", chief)
        raise ConfigError(field, value, "no chief or ps in an elastic (MIN:MAX) job",
                          source=source, hint="Elastic jobs are MultiWorkerMirrored workers "
                          "only (worker 0 is the chief); a parameter-server job already "
                          "carries on without a lost worker.")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
        raise ConfigError("grace", grace, "a number of seconds > 0", source=source)
    preempt_signum = _signal_number(preempt_signal)
    if worker_failed not in launch_elastic.WORKER_FAILED:
        raise ConfigError("worker_failed", worker_failed,
                          f"one of {', '.join(launch_elastic.WORKER_FAILED)}", source=source)
    if isinstance(discovery_interval, bool) or not isinstance(
            discovery_interval, (int, float)) or not discovery_interval > 0:
        raise ConfigError("discovery_interval", discovery_interval, "a number of seconds > 0",
                          source=source)
    discovery = None
    size = max_workers
    out = _Output(output or sys.stdout)
    if host_discovery_script is not None:
        discovery = launch_elastic.Discovery(host_discovery_script, source=source)
        slots = discovery.slots()  # Bad output: a ConfigError before anything starts.
        size = min(max_workers, max(min_workers, slots))
        out.say(f"elastic job: {min_workers} to {max_workers} workers; the discovery script "
                f"reports {slots} slot(s): starting {size} worker(s)")
    script_argv = [script] if isinstance(script, str) else list(script)
    result = LaunchResult()
    if handle_signals is None:
        handle_signals = threading.current_thread() is threading.main_thread()
    stops = _Signals()
    previous = {}
    if handle_signals:
        for signum in {signal.SIGTERM, signal.SIGINT, preempt_signum}:
            previous[signum] = signal.signal(signum, stops)
    attempt = 0
    # One scratch directory for the whole launch, kept across restarts.
    job_dir = tempfile.mkdtemp(prefix="tfdist-job-")
    env = {"TFDIST_JOB_DIR": job_dir, **(env or {}),
           "TFDIST_PREEMPT_SIGNAL": signal.Signals(preempt_signum).name,
           "TFDIST_GRACE": f"{grace:g}"}
    if elastic:
        env.update(TFDIST_MIN_WORKERS=str(min_workers), TFDIST_MAX_WORKERS=str(max_workers))
    settings = _Settings(
        evaluator=evaluator, script_argv=script_argv, args=list(args),
        parameter_server=ps > 0, show_all=show_all, env=env, python=python,
        log_dir=log_dir, stop_timeout=stop_timeout, out=out, verbose=verbose,
        grace=float(grace), preempt_signal=preempt_signum, stops=stops,
        status_dir=Path(env["TFDIST_JOB_DIR"]) / STATUS_DIR,
        discovery=discovery, discovery_interval=float(discovery_interval),
        min_workers=min_workers, max_workers=max_workers)

    try:
        while True:
            if stops.count:  # A signal between two attempts: nothing runs.
                result.outcome = "stopped"
                result.exit_code = 128 + stops.signum
                out.say(f"{signal.Signals(stops.signum).name}: stopped between two attempts")
                return result
            job_spec = (spec if spec is not None and attempt == 0
                        else local_spec(size, chief=chief, ps=ps))
            result.workers = size
            end = _Attempt(settings, job_spec, attempt, size).run()
            attempt += 1
            if end.how == "finished":
                result.outcome = "finished"
                out.say("all tasks finished")
                return result
            if end.how in ("stopped", "resize") or end.records:
                result.stop_seconds = end.drain_seconds
            if end.how == "stopped":
                return _report_stop(end, stops.signum, result, out)
            if end.how == "resize" and end.finished:
                # The tasks were ending anyway: training is complete (and the
                # backup deleted); a relaunch would start it over.
                result.outcome = "finished"
                out.say("all tasks finished (the resize came as training ended)")
                return result
            if end.how == "resize":
                old, size = size, end.target
                result.resizes.append((old, size, "discovery"))
                verb = "grew" if size > old else "shrank"
                how = (f"the workers saved at {_position(end.record)}" if end.record
                       else "nothing was saved; the job resumes from its last backup")
                out.say(f"{verb} {old} -> {size} workers (MIN {min_workers}, MAX "
                        f"{max_workers}): {how}; relaunching at the new size "
                        "(not counted as a restart)")
                continue
            failure = end.failure
            result.attempts.append(failure)
            if end.how == "port" and result.port_relaunches < port_relaunches:
                result.port_relaunches += 1
                out.say(f"{failure.task} could not bind its port (taken by another process); "
                        "relaunching every task on new ports (not counted as a restart)")
                continue
            if end.how == "preempted":
                what = (f"{failure.task} was preempted and the job saved at "
                        f"{_position(end.record)}")
            else:
                what = f"{failure.task} {failure.how}"
            can_shrink = elastic and size > min_workers
            if result.restarts < max_restarts and not (can_shrink and worker_failed == "shrink"):
                result.restarts += 1
                resume = (f", resuming at {_position(end.record)}" if end.how == "preempted"
                          else "")
                out.say(f"{what}; restart {result.restarts} of {max_restarts} on new "
                        f"ports{resume}")
                continue
            if can_shrink:
                old, size = size, size - 1
                result.resizes.append((old, size, f"{failure.task} {failure.how}"))
                why = ("--worker-failed shrink" if worker_failed == "shrink"
                       else "restarts spent")
                origin = (f"at {_position(end.record)}" if end.how == "preempted"
                          else "from its last backup")
                out.say(f"{what}; {why}: shrinking {old} -> {size} workers (MIN "
                        f"{min_workers}); the job resumes {origin}; global batch kept "
                        "by the script, see README 'Elastic jobs'")
                continue
            result.failure = failure
            if end.how == "preempted":
                result.outcome = "preempted"
                result.saved = end.record
                result.exit_code = PREEMPTED_EXIT_CODE
                out.say(f"giving up: {what}"
                        + (f" after {result.restarts} restart(s)" if max_restarts else "")
                        + "; run the same command to resume")
                return result
            result.outcome = "failed"
            result.exit_code = failure.exit_code or 1
            tail = "\n".join(f"    {line}" for line in failure.tail[-15:])
            out.say(f"giving up: {failure.task} {failure.how}"
                    + (f" after {result.restarts} restart(s)" if max_restarts else "")
                    + (f". Its last lines:\n{tail}" if tail else ""))
            return result
    except KeyboardInterrupt:  # Without our handlers (handle_signals=False).
        out.say("SIGINT: every task was stopped")
        result.outcome = "stopped"
        result.exit_code = 128 + signal.SIGINT
        return result
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(job_dir, ignore_errors=True)


def _report_stop(end: "_AttemptEnd", signum: int, result: LaunchResult,
                 out: _Output) -> LaunchResult:
    """The one line saying what a stop signal to the launcher led to."""
    name = signal.Signals(signum).name
    took = f"{end.drain_seconds:.1f} s after {name}"
    if end.finished:
        result.outcome, result.exit_code = "finished", 0
        out.say(f"finished: every training task completed ({took})")
    elif end.record is not None:
        result.outcome, result.saved = "preempted", end.record
        result.exit_code = 128 + signum
        out.say(f"preempted: saved at {_position(end.record)}; run the same command to "
                f"resume ({took})")
    elif end.killed:
        result.outcome, result.exit_code = "killed", 128 + signum
        if end.hurried:
            out.say(f"killed on a second signal ({end.hurried}), nothing saved "
                    f"({', '.join(end.killed)} still running {took})")
        else:
            out.say(f"killed after the grace period, nothing saved ({', '.join(end.killed)} "
                    f"still running {end.grace:g} s after {name})")
    else:
        result.outcome, result.exit_code = "stopped", 128 + signum
        how = "; ".join(f"{e.task} {e.how}" for e in end.exits if e.returncode != 0)
        out.say(f"{name}: every task was stopped, nothing saved ({how or 'no status record'})")
    return result


@dataclasses.dataclass
class _Settings:
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
    out: _Output
    verbose: bool
    grace: float
    preempt_signal: int
    stops: _Signals
    status_dir: Path
    discovery: launch_elastic.Discovery | None
    discovery_interval: float
    min_workers: int
    max_workers: int


@dataclasses.dataclass
class _AttemptEnd:
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


class _Attempt:
    """Starts every task of one attempt, watches them, stops them all."""

    def __init__(self, settings: _Settings, spec: dict, attempt: int, size: int) -> None:
        self.s = settings
        self.spec = spec
        self.attempt = attempt
        self.size = size
        self.tasks: list[_Task] = []
        self.trainers: list[_Task] = []   # Run the script and save.
        self.servers: list[_Task] = []    # A parameter-server job's ps and workers.
        self.lead = "chief:0" if "chief" in spec["cluster"] else "worker:0"

    def run(self) -> _AttemptEnd:
        s = self.s
        seen = s.stops.count
        try:
            self._start()
            next_check = time.monotonic() + s.discovery_interval
            evaluator_deadline = None
            while True:
                if s.stops.count > seen:
                    s.out.say(f"{signal.Signals(s.stops.signum).name}: passing "
                              f"{signal.Signals(s.preempt_signal).name} on to the training "
                              f"tasks; they have {s.grace:g} s (--grace) to save and exit")
                    self._forward()
                    return self._drain("stopped", s.stops.time)
                now = time.monotonic()
                for task in self.tasks:
                    code = task.poll()
                    if code is None or code == 0:
                        continue
                    task.finish(1.0)
                    if (task in self.trainers and code == PREEMPTED_EXIT_CODE
                            and self._records().get(task.task)):
                        record = self._records()[task.task]
                        s.out.say(f"{task.task} exited {code} after saving at "
                                  f"{_position(record)} (preempted); waiting up to "
                                  f"{s.grace:g} s for the other tasks to save and exit")
                        # The grace period runs from the task's signal when a
                        # record says when it came.
                        times = [r["signal_time"] for r in self._records().values()
                                 if isinstance(r.get("signal_time"), (int, float))]
                        started = now - max(0.0, time.time() - min(times)) if times else now
                        end = self._drain("preempted", started)
                        # Named after the task that got the signal: the first
                        # to exit may be another one.
                        first = _first_signalled(end.records) or task.task
                        end.failure = next((e for e in end.exits if e.task == first),
                                           task.exit())
                        return end
                    failure = task.exit()
                    _stop_all(self.tasks, s.stop_timeout)
                    return _AttemptEnd("port" if task.port_taken else "failed", failure,
                                       lead=self.lead)
                if all(t.poll() == 0 for t in self.trainers):
                    # Training is done; a side-car evaluator gets a grace period
                    # to evaluate the last checkpoint, then it is stopped.
                    evaluator_deadline = evaluator_deadline or time.monotonic() + EVALUATOR_GRACE
                    if all(t.poll() is not None for t in self.tasks
                           if t.task.startswith("evaluator")) \
                            or time.monotonic() > evaluator_deadline:
                        return _AttemptEnd("finished", lead=self.lead)
                # After the exits: a lost worker is a failure, even if the
                # discovery script already reports its slot gone.
                if s.discovery is not None and now >= next_check:
                    target = self._target()
                    next_check = time.monotonic() + s.discovery_interval
                    if target is not None and not any(
                            t.poll() not in (None, 0) for t in self.tasks):
                        s.out.say(f"the discovery script reports room for {target} worker(s) "
                                  f"(now {self.size}): passing "
                                  f"{signal.Signals(s.preempt_signal).name} on so that the "
                                  "workers save, then relaunching")
                        self._forward()
                        end = self._drain("resize", time.monotonic())
                        end.target = target
                        return end
                time.sleep(0.05)
        finally:
            _stop_all(self.tasks, s.stop_timeout)

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
        for task_type, index, config in _tasks_of(self.spec, s.evaluator):
            name = f"{task_type}:{index}"
            task_env = dict(base_env, TF_CONFIG=_json(config))
            server = s.parameter_server and task_type in ("ps", "worker")
            argv = ([s.python, "-c", SERVER_CODE] if server
                    else [s.python, *s.script_argv, *s.args])
            task = _Task(name, argv, task_env, s.out, s.show_all or name == self.lead,
                         logs / f"{name.replace(':', '-')}.log" if logs else None, s.verbose)
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

    def _drain(self, how: str, started: float) -> _AttemptEnd:
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
        _stop_all(self.servers, 1.0)
        for t in watched:
            t.finish(1.0)
        return _AttemptEnd(
            how, records=self._records(), exits=[t.exit() for t in self.trainers],
            killed=killed, finished=all(t.proc.returncode == 0 for t in self.trainers),
            drain_seconds=last_exit - started, grace=s.grace, lead=self.lead,
            hurried=hurried)


def _first_signalled(records: dict[str, dict]) -> str | None:
    """The task whose record has the earliest ``signal_time``."""
    timed = [(r["signal_time"], task) for task, r in records.items()
             if isinstance(r.get("signal_time"), (int, float))]
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


def _stop_all(tasks: list[_Task], timeout: float) -> None:
    """SIGTERM every running task's process group, then SIGKILL what is left.

    Each task leads its own process group, so this also reaches processes
    the task started (data loaders, shells) even after the task itself
    exited: the group keeps its id while any member lives.
    """
    running = [t for t in tasks if t.poll() is None]
    for t in running:
        t.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for t in running:
        try:
            t.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for t in tasks:
        t.signal(signal.SIGKILL)
        if t.poll() is None:
            t.proc.wait()
        t.finish(1.0)


def _json(config: dict) -> str:
    return json.dumps(config, separators=(",", ":"))


def netns_command(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped to run in a new private network namespace.

    Inside, only a loopback interface exists (brought up first), so the
    TensorFlow servers of a local job cannot be reached from the network.
    Root can create one with ``unshare -n``; other users need user
    namespaces (``unshare -rn``).
    """
    mode = "-n" if os.geteuid() == 0 else "-rn"
    return ["unshare", mode, "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
            *argv]


def run_in_netns(argv: Sequence[str], output: IO[str] | None = None,
                 grace: float = DEFAULT_GRACE) -> int:
    """Runs ``argv`` in a private network namespace; returns its exit code.

    SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 to this process are passed on to
    the inner launcher (``argv``), which runs the grace period itself.

    Raises:
        ConfigError: A namespace cannot be created here (field ``'netns'``),
            with the system's reason.
    """
    command = netns_command(argv)
    probe = subprocess.run(netns_command(["true"]), capture_output=True, text=True)
    if probe.returncode != 0:
        raise ConfigError("netns", True, "a machine where this user may create a network "
                          "namespace (root, or unprivileged user namespaces)",
                          source="tfdist launch", received=probe.stderr.strip() or "failed",
                          hint="Run without --netns.")
    env = dict(os.environ, TFDIST_IN_NETNS="1")
    proc = subprocess.Popen(command, env=env, start_new_session=True,
                            stdout=None if output is None else subprocess.PIPE,
                            stderr=subprocess.STDOUT if output is not None else None, text=True)

    def forward(signum, frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            previous[signum] = signal.signal(signum, forward)
    try:
        if output is not None:
            for line in proc.stdout:
                output.write(line)
        return proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if proc.poll() is None:
            # The inner launcher stops its tasks on SIGTERM, within its grace.
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace + 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
