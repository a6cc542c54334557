"""``tfdist launch``: run a multi-worker job as local processes, with restarts.

What torchrun is to PyTorch, for one machine: it picks free ports on
127.0.0.1, gives every task its TF_CONFIG, starts one process per task,
prefixes their output, and watches them. TensorFlow's start-up noise
(:mod:`tfdist.quiet`) is left out of what it shows, unless ``verbose``; the
per-task log files keep every line.

* A task that exits non-zero or is killed stops the whole job (the peers of a
  synchronous job would otherwise wait forever); the job then restarts, on
  new ports, up to ``max_restarts`` times. Training scripts resume with a
  backup callback (``tfdist.callbacks.BackupAndRestore``).
* A task that could not bind its port ("Could not start gRPC server": another
  process took it after it was picked) makes the launcher stop every task and
  relaunch on new ports, without counting a restart.
* Parameter-server jobs: ps and worker tasks run TensorFlow servers; the
  chief runs the script.
* Ctrl-C, SIGTERM or an error in the launcher stops every child (each runs in
  its own process group) before returning: no orphans.
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

from tfdist import cluster
from tfdist.errors import ConfigError, require_int
from tfdist.net import local_spec
from tfdist.quiet import NoiseFilter

__all__ = ["launch", "LaunchResult", "TaskExit", "SERVER_CODE"]

#: What ps and worker tasks of a parameter-server job run.
SERVER_CODE = ("import tfdist.strategies as s, tfdist.cluster as c; "
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
            signal N), 130 after Ctrl-C, 143 after SIGTERM.
        restarts: Restarts after failures (at most ``max_restarts``).
        port_relaunches: Relaunches because a port was taken (not restarts).
        failure: The task failure that ended the job, or None.
        attempts: Every failure seen, in order.
    """

    exit_code: int = 0
    restarts: int = 0
    port_relaunches: int = 0
    failure: TaskExit | None = None
    attempts: list[TaskExit] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class _Stop(Exception):
    """The launcher was asked to stop (signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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


def non_local_hosts(spec: dict) -> list[str]:
    """The hosts of a spec that are not this machine's loopback."""
    addresses = [a for job in spec["cluster"].values() for a in job]
    return sorted({cluster.parse_address(a)[0] for a in addresses} - _LOCAL_HOSTS)


def launch(
    script: str | Sequence[str],
    args: Sequence[str] = (),
    *,
    workers: int = 2,
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
) -> LaunchResult:
    """Runs ``python SCRIPT ARGS`` as every task of a local cluster.

    Args:
        script: A script path, or ``["-m", "pkg.module"]`` / ``["-c", code]``.
        args: The script's arguments.
        workers: Worker tasks.
        chief: Add a chief task (required with ``ps``).
        ps: Parameter-server tasks. With ps > 0, ps and worker tasks run
            TensorFlow servers and only the chief (and evaluator) run the
            script.
        evaluator: Add an evaluator task. It runs the script too; when the
            training tasks have finished it has EVALUATOR_GRACE seconds to
            finish before it is stopped.
        max_restarts: Restarts of the whole job after a task fails.
        show_all: Show every task's output. By default the chief's (or
            worker 0's) output is shown in full and the others' warnings,
            errors and tracebacks only.
        spec: A cluster spec (anything :func:`tfdist.cluster.parse` accepts)
            to use instead of picked ports; it must name only local hosts.
            It sets the job's shape (``workers``, ``chief`` and ``ps`` are
            ignored); its ports are used for the first attempt only.
        env: Extra environment variables for every task (a
            ``TFDIST_JOB_DIR`` here replaces the launch's own scratch
            directory, which is then not removed).
        python: The interpreter the tasks run.
        log_dir: If given, each task's full output goes to
            ``LOG_DIR/attempt-N/TASK.log``.
        stop_timeout: Seconds between SIGTERM and SIGKILL when stopping tasks.
        port_relaunches: How many relaunches on new ports to allow when a
            port was taken.
        output: Where prefixed lines go (default: sys.stdout).
        handle_signals: Turn SIGTERM/SIGINT into a clean stop of every task;
            default: when called from the main thread.
        verbose: Also show TensorFlow's start-up noise (the lines of
            :data:`tfdist.quiet.NOISE`); by default only the log files
            have it, and the tail of a failed task leaves it out.

    Returns:
        A :class:`LaunchResult`; the ``tfdist launch`` command exits with its
        ``exit_code``.

    Raises:
        ConfigError: Bad counts, or a spec naming other hosts (the message
            says to run ``tfdist hosts`` for the per-host commands).
    """
    if spec is not None:
        spec = cluster.parse(spec, require_task=False).to_dict()
        jobs = spec["cluster"]
        # Later attempts use new ports for a cluster of the same shape.
        workers, ps = len(jobs.get("worker", [])), len(jobs.get("ps", []))
        chief = "chief" in jobs
        others = non_local_hosts(spec)
        if others:
            raise ConfigError(
                "spec", others, "a spec with only local hosts (127.0.0.1, localhost)",
                source="tfdist launch", received=", ".join(others),
                hint="tfdist launch starts processes on this machine only; "
                "`tfdist hosts SPEC -- SCRIPT` prints each host's TF_CONFIG and command.")
    _check_counts(workers, ps, max_restarts)
    if ps and not chief:
        raise ConfigError("chief", chief, "True with ps > 0", source="tfdist launch",
                          hint="A parameter-server job needs a chief to run the training.")
    out = _Output(output or sys.stdout)
    script_argv = [script] if isinstance(script, str) else list(script)
    result = LaunchResult()
    if handle_signals is None:
        handle_signals = threading.current_thread() is threading.main_thread()
    previous = {}

    def on_signal(signum, frame):
        raise _Stop(signum)

    if handle_signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
    attempt = 0
    # One scratch directory for the whole launch, kept across restarts.
    job_dir = tempfile.mkdtemp(prefix="tfdist-job-")
    env = {"TFDIST_JOB_DIR": job_dir, **(env or {})}
    try:
        while True:
            job_spec = (spec if spec is not None and attempt == 0
                        else local_spec(workers, chief=chief, ps=ps))
            failure, port_taken = _run_once(
                job_spec, evaluator, script_argv, list(args), ps > 0,
                show_all, env, python, log_dir, attempt, stop_timeout, out, verbose)
            attempt += 1
            if failure is None:
                out.say("all tasks finished")
                return result
            result.attempts.append(failure)
            if port_taken and result.port_relaunches < port_relaunches:
                result.port_relaunches += 1
                out.say(f"{failure.task} could not bind its port (taken by another process); "
                        "relaunching every task on new ports (not counted as a restart)")
                continue
            if result.restarts < max_restarts:
                result.restarts += 1
                out.say(f"{failure.task} {failure.how}; restart {result.restarts} of "
                        f"{max_restarts} on new ports")
                continue
            result.failure = failure
            result.exit_code = failure.exit_code or 1
            tail = "\n".join(f"    {line}" for line in failure.tail[-15:])
            out.say(f"giving up: {failure.task} {failure.how}"
                    + (f" after {result.restarts} restart(s)" if max_restarts else "")
                    + (f". Its last lines:\n{tail}" if tail else ""))
            return result
    except (_Stop, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, _Stop) else signal.SIGINT
        out.say(f"{signal.Signals(signum).name}: every task was stopped")
        result.exit_code = 128 + signum
        return result
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(job_dir, ignore_errors=True)


def _run_once(spec, evaluator, script_argv, args, parameter_server, show_all, env, python, log_dir,
              attempt, stop_timeout, out, verbose=False) -> tuple[TaskExit | None, bool]:
    """Starts every task, waits, stops them all. Returns (failure, port_taken)."""
    tasks: list[_Task] = []
    trainers: list[_Task] = []
    lead = "chief:0" if "chief" in spec["cluster"] else "worker:0"
    base_env = dict(os.environ)
    base_env.update(env or {})
    base_env.update({"PYTHONUNBUFFERED": "1", "TFDIST_LAUNCH_ATTEMPT": str(attempt)})
    logs = Path(log_dir) / f"attempt-{attempt}" if log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    try:
        for task_type, index, config in _tasks_of(spec, evaluator):
            name = f"{task_type}:{index}"
            task_env = dict(base_env, TF_CONFIG=_json(config))
            server = parameter_server and task_type in ("ps", "worker")
            argv = [python, "-c", SERVER_CODE] if server else [python, *script_argv, *args]
            task = _Task(name, argv, task_env, out, show_all or name == lead,
                         logs / f"{name.replace(':', '-')}.log" if logs else None, verbose)
            tasks.append(task)
            if not server and task_type != "evaluator":
                trainers.append(task)
        evaluator_deadline = None
        while True:
            for task in tasks:
                code = task.poll()
                if code is not None and code != 0:
                    task.finish(1.0)
                    failure = TaskExit(task.task, code, tuple(task.tail))
                    port_taken = task.port_taken
                    _stop_all(tasks, stop_timeout)
                    return failure, port_taken
            if all(t.poll() == 0 for t in trainers):
                # Training is done; a side-car evaluator gets a grace period
                # to evaluate the last checkpoint, then it is stopped.
                evaluator_deadline = evaluator_deadline or time.monotonic() + EVALUATOR_GRACE
                if all(t.poll() is not None for t in tasks if t.task.startswith("evaluator")) \
                        or time.monotonic() > evaluator_deadline:
                    return None, False
            time.sleep(0.05)
    finally:
        _stop_all(tasks, stop_timeout)


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


def run_in_netns(argv: Sequence[str], output: IO[str] | None = None) -> int:
    """Runs ``argv`` in a private network namespace; returns its exit code.

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
    try:
        if output is not None:
            for line in proc.stdout:
                output.write(line)
        return proc.wait()
    finally:
        if proc.poll() is None:
            # The inner launcher stops its tasks on SIGTERM.
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
