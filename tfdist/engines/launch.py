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
  (``$TFDIST_JOB_DIR/preempted/TASK.json``, :mod:`tfdist.training.fault_tolerance.preemption`):
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

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from tfdist import spec as spec_lib
from tfdist.engines import elastic as launch_elastic, warm
from tfdist.engines.launch_attempt import Attempt, AttemptEnd, Settings, read_status_records
from tfdist.engines.launch_results import (
    DEFAULT_GRACE,
    LOCAL_HOSTS,
    PREEMPTED_EXIT_CODE,
    SERVER_CODE,
    STATUS_DIR,
    LaunchResult,
    TaskExit,
)
from tfdist.engines.launch_tasks import Output, Signals, position
from tfdist.engines.net import local_spec
from tfdist.engines.netns import netns_command, run_in_netns
from tfdist.errors import ConfigError, require_int

__all__ = [
    "launch",
    "LaunchResult",
    "TaskExit",
    "SERVER_CODE",
    "PREEMPTED_EXIT_CODE",
    "DEFAULT_GRACE",
    "read_status_records",
    "netns_command",
    "run_in_netns",
]


SOURCE = "tfdist launch"


def _check_counts(workers: Any, ps: Any, max_restarts: Any) -> None:
    require_int("workers", workers, 1, SOURCE)
    require_int("ps", ps, 0, SOURCE)
    require_int("max_restarts", max_restarts, 0, SOURCE)


def _signal_number(value: Any) -> int:
    """``"SIGUSR1"``, ``"USR1"``, ``10`` or a ``signal.Signals`` -> its number."""
    expected = "a signal name or number that a process can catch (SIGTERM, SIGUSR1, SIGINT...)"
    try:
        if isinstance(value, str):
            name = value.strip().upper()
            number = (
                int(name)
                if name.isdigit()
                else signal.Signals[name if name.startswith("SIG") else "SIG" + name]
            )
        elif isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            raise KeyError(value)
        number = signal.Signals(number)
    except (KeyError, ValueError):
        raise ConfigError("preempt_signal", value, expected, source=SOURCE) from None
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(
            "preempt_signal",
            value,
            expected,
            source=SOURCE,
            hint=f"{number.name} cannot be caught, so nothing could be saved.",
        )
    return int(number)


def non_local_hosts(spec: dict) -> list[str]:
    """The hosts of a spec that are not this machine's loopback."""
    addresses = [a for job in spec["cluster"].values() for a in job]
    return sorted({spec_lib.parse_address(a)[0] for a in addresses} - LOCAL_HOSTS)


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
    python: str | None = None,
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
        python: The interpreter the tasks run (default: this one, or the warm
            pool's that ``TFDIST_WARM_POOL`` names: :mod:`tfdist.engines.warm`).
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
    plan = _plan(
        workers=workers,
        chief=chief,
        ps=ps,
        max_restarts=max_restarts,
        spec=spec,
        grace=grace,
        preempt_signal=preempt_signal,
        worker_failed=worker_failed,
        host_discovery_script=host_discovery_script,
        discovery_interval=discovery_interval,
    )
    out = Output(output or sys.stdout)
    discovery, size = _discover(plan, host_discovery_script, out)
    if handle_signals is None:
        handle_signals = threading.current_thread() is threading.main_thread()
    stops = Signals()
    previous = {}
    if handle_signals:
        for signum in {signal.SIGTERM, signal.SIGINT, plan.preempt_signal}:
            previous[signum] = signal.signal(signum, stops)
    result = LaunchResult()
    # One scratch directory for the whole launch, kept across restarts.
    job_dir = tempfile.mkdtemp(prefix="tfdist-job-")
    try:
        settings = _settings(
            plan,
            job_dir=job_dir,
            env=env,
            python=python,
            script_argv=[script] if isinstance(script, str) else list(script),
            args=list(args),
            evaluator=evaluator,
            show_all=show_all,
            log_dir=log_dir,
            stop_timeout=stop_timeout,
            out=out,
            verbose=verbose,
            stops=stops,
            discovery=discovery,
        )
        return _attempts(plan, settings, size, port_relaunches, result)
    except KeyboardInterrupt:  # Without our handlers (handle_signals=False).
        out.say("SIGINT: every task was stopped")
        result.outcome = "stopped"
        result.exit_code = 128 + signal.SIGINT
        return result
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(job_dir, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """:func:`launch`'s arguments that shape the job and its policies, checked."""

    spec: dict | None  # Given: the first attempt's cluster.
    min_workers: int
    max_workers: int
    chief: bool
    ps: int
    elastic: bool
    max_restarts: int
    grace: float
    preempt_signal: int
    worker_failed: str
    discovery_interval: float


def _plan(
    *,
    workers: object,
    chief: object,
    ps: object,
    max_restarts: object,
    spec: object,
    grace: object,
    preempt_signal: object,
    worker_failed: object,
    host_discovery_script: object,
    discovery_interval: object,
) -> _Plan:
    """Every check of :func:`launch`'s arguments, before anything starts.

    Raises:
        ConfigError: Naming the argument and the value received.
    """
    min_workers, max_workers = launch_elastic.parse_workers(workers)
    elastic = min_workers != max_workers or host_discovery_script is not None
    if spec is not None:
        spec = _local_spec(spec, elastic)
        jobs = spec["cluster"]
        # Later attempts use new ports for a cluster of the same shape.
        min_workers = max_workers = len(jobs.get("worker", []))
        ps, chief = len(jobs.get("ps", [])), "chief" in jobs
    _check_counts(max_workers, ps, max_restarts)
    if ps and not chief:
        raise ConfigError(
            "chief",
            chief,
            "True with ps > 0",
            source=SOURCE,
            hint="A parameter-server job needs a chief to run the training.",
        )
    if elastic and (ps or chief):
        field, value = ("ps", ps) if ps else ("chief", chief)
        raise ConfigError(
            field,
            value,
            "no chief or ps in an elastic (MIN:MAX) job",
            source=SOURCE,
            hint="Elastic jobs are MultiWorkerMirrored workers "
            "only (worker 0 is the chief); a parameter-server job already "
            "carries on without a lost worker.",
        )
    grace = _seconds("grace", grace)
    preempt_signum = _signal_number(preempt_signal)
    if worker_failed not in launch_elastic.WORKER_FAILED:
        raise ConfigError(
            "worker_failed",
            worker_failed,
            f"one of {', '.join(launch_elastic.WORKER_FAILED)}",
            source=SOURCE,
        )
    return _Plan(
        spec=spec,
        min_workers=min_workers,
        max_workers=max_workers,
        chief=bool(chief),
        ps=ps,
        elastic=elastic,
        max_restarts=max_restarts,
        grace=grace,
        preempt_signal=preempt_signum,
        worker_failed=worker_failed,
        discovery_interval=_seconds("discovery_interval", discovery_interval),
    )


def _local_spec(spec: object, elastic: bool) -> dict:
    """The parsed ``spec``: only local hosts, and no elastic range beside it."""
    if elastic:
        raise ConfigError(
            "spec",
            spec,
            "no spec with an elastic --workers MIN:MAX",
            source=SOURCE,
            hint="An elastic job picks its own ports.",
        )
    spec = spec_lib.parse(spec, require_task=False).to_dict()
    others = non_local_hosts(spec)
    if others:
        raise ConfigError(
            "spec",
            others,
            "a spec with only local hosts (127.0.0.1, localhost)",
            source=SOURCE,
            received=", ".join(others),
            hint="tfdist launch starts processes on this machine only; "
            "`tfdist hosts SPEC -- SCRIPT` prints each host's TF_CONFIG and command.",
        )
    return spec


def _seconds(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(field, value, "a number of seconds > 0", source=SOURCE)
    return float(value)


def _discover(
    plan: _Plan, script: str | os.PathLike | None, out: Output
) -> tuple[launch_elastic.Discovery | None, int]:
    """The discovery script, if any, and the size to start at."""
    if script is None:
        return None, plan.max_workers
    discovery = launch_elastic.Discovery(script, source=SOURCE)
    slots = discovery.slots()  # Bad output: a ConfigError before anything starts.
    size = min(plan.max_workers, max(plan.min_workers, slots))
    out.say(
        f"elastic job: {plan.min_workers} to {plan.max_workers} workers; the discovery "
        f"script reports {slots} slot(s): starting {size} worker(s)"
    )
    return discovery, size


def _settings(
    plan: _Plan, *, job_dir: str, env: dict | None, python: str | None, **rest
) -> Settings:
    """The attempts' settings: the tasks' environment (the job directory,
    the grace and signal they are told, an elastic job's range) and the
    interpreter, with :func:`launch`'s other arguments as given (``rest``)."""
    env = {
        "TFDIST_JOB_DIR": job_dir,
        **(env or {}),
        "TFDIST_PREEMPT_SIGNAL": signal.Signals(plan.preempt_signal).name,
        "TFDIST_GRACE": f"{plan.grace:g}",
    }
    if plan.elastic:
        env.update(
            TFDIST_MIN_WORKERS=str(plan.min_workers), TFDIST_MAX_WORKERS=str(plan.max_workers)
        )
    return Settings(
        parameter_server=plan.ps > 0,
        env=env,
        python=python or warm.interpreter({**os.environ, **env}),
        grace=plan.grace,
        preempt_signal=plan.preempt_signal,
        status_dir=Path(env["TFDIST_JOB_DIR"]) / STATUS_DIR,
        discovery_interval=plan.discovery_interval,
        min_workers=plan.min_workers,
        max_workers=plan.max_workers,
        **rest,
    )


def _attempts(
    plan: _Plan, settings: Settings, size: int, port_relaunches: int, result: LaunchResult
) -> LaunchResult:
    """Runs attempts until one ends the launch: finished, stopped, or failed
    with no restart, relaunch or shrink left."""
    out, stops = settings.out, settings.stops
    attempt = 0
    while True:
        if stops.count:  # A signal between two attempts: nothing runs.
            result.outcome = "stopped"
            result.exit_code = 128 + stops.signum
            out.say(f"{signal.Signals(stops.signum).name}: stopped between two attempts")
            return result
        given = plan.spec is not None and attempt == 0
        job_spec = plan.spec if given else local_spec(size, chief=plan.chief, ps=plan.ps)
        result.workers = size
        end = Attempt(settings, job_spec, attempt, size).run()
        attempt += 1
        if end.how == "finished":
            result.outcome = "finished"
            out.say("all tasks finished")
            return result
        if end.how in ("stopped", "resize") or end.records:
            result.stop_seconds = end.drain_seconds
        if end.how == "stopped":
            return _report_stop(end, stops.signum, result, out)
        if end.how == "resize":
            if end.finished:
                # The tasks were ending anyway: training is complete (and the
                # backup deleted); a relaunch would start it over.
                result.outcome = "finished"
                out.say("all tasks finished (the resize came as training ended)")
                return result
            size = _resize(plan, end, size, result, out)
            continue
        result.attempts.append(end.failure)
        if end.how == "port" and result.port_relaunches < port_relaunches:
            result.port_relaunches += 1
            out.say(
                f"{end.failure.task} could not bind its port (taken by another process); "
                "relaunching every task on new ports (not counted as a restart)"
            )
            continue
        after = _after_failure(plan, end, size, result, out)
        if after is None:
            return result
        size = after


def _resize(plan: _Plan, end: AttemptEnd, size: int, result: LaunchResult, out: Output) -> int:
    """The size the discovery script asked for, said; the new size."""
    old, size = size, end.target
    result.resizes.append((old, size, "discovery"))
    verb = "grew" if size > old else "shrank"
    how = (
        f"the workers saved at {position(end.record)}"
        if end.record
        else "nothing was saved; the job resumes from its last backup"
    )
    out.say(
        f"{verb} {old} -> {size} workers (MIN {plan.min_workers}, MAX "
        f"{plan.max_workers}): {how}; relaunching at the new size "
        "(not counted as a restart)"
    )
    return size


def _after_failure(
    plan: _Plan, end: AttemptEnd, size: int, result: LaunchResult, out: Output
) -> int | None:
    """After a failed or preempted attempt: the size to restart at (a
    restart, or an elastic job one worker smaller), or None when the launch
    gives up (``result`` then says why)."""
    failure = end.failure
    if end.how == "preempted":
        what = f"{failure.task} was preempted and the job saved at {position(end.record)}"
    else:
        what = f"{failure.task} {failure.how}"
    can_shrink = plan.elastic and size > plan.min_workers
    shrink_first = can_shrink and plan.worker_failed == "shrink"
    if result.restarts < plan.max_restarts and not shrink_first:
        result.restarts += 1
        resume = f", resuming at {position(end.record)}" if end.how == "preempted" else ""
        out.say(f"{what}; restart {result.restarts} of {plan.max_restarts} on new ports{resume}")
        return size
    if can_shrink:
        old, size = size, size - 1
        result.resizes.append((old, size, f"{failure.task} {failure.how}"))
        why = "--worker-failed shrink" if plan.worker_failed == "shrink" else "restarts spent"
        origin = f"at {position(end.record)}" if end.how == "preempted" else "from its last backup"
        out.say(
            f"{what}; {why}: shrinking {old} -> {size} workers (MIN "
            f"{plan.min_workers}); the job resumes {origin}; global batch kept "
            "by the script, see docs/guide/preemption.md, 'Elastic jobs'"
        )
        return size
    result.failure = failure
    after = f" after {result.restarts} restart(s)" if plan.max_restarts else ""
    if end.how == "preempted":
        result.outcome = "preempted"
        result.saved = end.record
        result.exit_code = PREEMPTED_EXIT_CODE
        out.say(f"giving up: {what}{after}; run the same command to resume")
        return None
    result.outcome = "failed"
    result.exit_code = failure.exit_code or 1
    tail = "\n".join(f"    {line}" for line in failure.tail[-15:])
    out.say(
        f"giving up: {failure.task} {failure.how}{after}"
        + (f". Its last lines:\n{tail}" if tail else "")
    )
    return None


def _report_stop(end: AttemptEnd, signum: int, result: LaunchResult, out: Output) -> LaunchResult:
    """The one line saying what a stop signal to the launcher led to."""
    name = signal.Signals(signum).name
    took = f"{end.drain_seconds:.1f} s after {name}"
    if end.finished:
        result.outcome, result.exit_code = "finished", 0
        out.say(f"finished: every training task completed ({took})")
    elif end.record is not None:
        result.outcome, result.saved = "preempted", end.record
        result.exit_code = 128 + signum
        out.say(
            f"preempted: saved at {position(end.record)}; run the same command to resume ({took})"
        )
    elif end.killed:
        result.outcome, result.exit_code = "killed", 128 + signum
        if end.hurried:
            out.say(
                f"killed on a second signal ({end.hurried}), nothing saved "
                f"({', '.join(end.killed)} still running {took})"
            )
        else:
            out.say(
                f"killed after the grace period, nothing saved ({', '.join(end.killed)} "
                f"still running {end.grace:g} s after {name})"
            )
    else:
        result.outcome, result.exit_code = "stopped", 128 + signum
        how = "; ".join(f"{e.task} {e.how}" for e in end.exits if e.returncode != 0)
        out.say(f"{name}: every task was stopped, nothing saved ({how or 'no status record'})")
    return result
