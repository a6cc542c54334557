"""``tfdist launch`` and ``tfdist horovodrun``: their flags, and the launch they start."""

from __future__ import annotations

import argparse
import os
import sys

from tfdist import spec as spec_lib
from tfdist.engines import horovodrun
from tfdist.errors import ConfigError


def add_launch(sub) -> None:
    """Adds the ``launch`` subcommand to ``sub``."""
    launch = sub.add_parser(
        "launch",
        help="run a multi-worker job as local processes, with restarts",
        description="Runs SCRIPT as every task of a local cluster on 127.0.0.1 with its "
        "own TF_CONFIG. A failed task stops the job; it restarts up to --max-restarts "
        "times. SIGTERM or Ctrl-C is passed on to the tasks, which get --grace seconds to "
        "save and exit. Note: TensorFlow's servers listen on every interface; --netns keeps "
        "the job in a private network namespace.",
    )
    _add_shape_flags(launch)
    _add_restart_flags(launch)
    _add_output_flags(launch)
    _add_transport_flags(launch)
    _add_script_flags(launch)
    launch.set_defaults(func=_launch)


def _add_shape_flags(launch: argparse.ArgumentParser) -> None:
    """The job's shape: its tasks, or horovodrun's hosts."""
    launch.add_argument(
        "--workers",
        "-np",
        "--num-proc",
        dest="workers",
        default=None,
        metavar="N|MIN:MAX",
        help="worker tasks (default: 2, or every slot of -H/--hostfile); "
        "-np N as horovodrun spells it; MIN:MAX (torchrun's spelling) for "
        "an elastic job that shrinks down to MIN when a worker is lost and "
        "grows back up to MAX",
    )
    launch.add_argument(
        "-H",
        "--hosts",
        default=None,
        help="horovodrun's host1:slots,host2:slots; all on localhost/127.0.0.1: "
        "runs here, else prints each host's commands",
    )
    launch.add_argument(
        "--hostfile",
        "-hostfile",
        default=None,
        help="horovodrun's host file (lines 'host slots=N')",
    )
    launch.add_argument("--chief", action="store_true", help="add a chief task")
    launch.add_argument(
        "--ps",
        type=int,
        default=0,
        help="parameter-server tasks (ps and workers serve; the chief runs SCRIPT)",
    )
    launch.add_argument("--evaluator", action="store_true", help="add an evaluator task")


def _add_restart_flags(launch: argparse.ArgumentParser) -> None:
    """Restarts, preemption and elastic resizes."""
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job up to K times after a task fails or is preempted",
    )
    launch.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="after SIGTERM/SIGINT to the launcher (or a preempted task), "
        "seconds the tasks get to save and exit before SIGKILL (default 30)",
    )
    launch.add_argument(
        "--preempt-signal",
        default="SIGTERM",
        metavar="SIGNAL",
        help="the signal passed on to the tasks to make them save and exit "
        "(default SIGTERM; exported as TFDIST_PREEMPT_SIGNAL)",
    )
    launch.add_argument(
        "--worker-failed",
        default="restart",
        metavar="POLICY",
        help="elastic jobs: 'restart' (default) restarts a failed job at "
        "its size while --max-restarts allow, then shrinks it by one "
        "worker; 'shrink' shrinks it at once",
    )
    launch.add_argument(
        "--host-discovery-script",
        default=None,
        metavar="PATH",
        help="elastic jobs: an executable printing the worker slots "
        "available (one integer, or lines HOST:SLOTS); run every "
        "--discovery-interval seconds, the job is resized to match "
        "(within MIN:MAX)",
    )
    launch.add_argument(
        "--discovery-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between two runs of --host-discovery-script",
    )


def _add_output_flags(launch: argparse.ArgumentParser) -> None:
    """What is shown and logged, and a spec's ports."""
    launch.add_argument(
        "--show-all",
        action="store_true",
        help="show every task's output (default: the chief's, and "
        "warnings and errors of the others)",
    )
    launch.add_argument(
        "--spec", default=None, help="use this cluster spec's (local) ports for the first attempt"
    )
    launch.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also show TensorFlow's start-up messages of the tasks "
        "(CUDA, oneDNN, CPU instructions, cluster start-up); the "
        "--log-dir logs always have them",
    )
    launch.add_argument("--log-dir", default=None, help="keep each task's full log here")


def _add_transport_flags(launch: argparse.ArgumentParser) -> None:
    """The gradients' transport, the network namespace and the timeline."""
    launch.add_argument(
        "--transport",
        default="tf",
        choices=("tf", "mpi"),
        help="what carries the gradients: 'tf' (TensorFlow's collectives, default) or "
        "'mpi': the workers are MPI ranks that mpiexec starts, and the gradients' "
        "all-reduce goes through MPI (pip install 'tfdist[mpi]')",
    )
    launch.add_argument(
        "--netns",
        action="store_true",
        help="run the job in a private network namespace (unshare -n)",
    )
    launch.add_argument(
        "--timeline",
        default=None,
        metavar="PATH",
        help="profile every fit (tfdist.StepProfile): the chief writes a "
        "Chrome-trace timeline of every worker's steps to PATH, each "
        "worker its own beside it (exported as TFDIST_TIMELINE)",
    )


def _add_script_flags(launch: argparse.ArgumentParser) -> None:
    """The script, module or code, and its arguments."""
    # -m and -c as options: argparse refuses a positional that starts with '-'.
    launch.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        metavar="MODULE",
        help="run a module, as python -m MODULE [ARGS...]",
    )
    launch.add_argument(
        "-c",
        dest="code",
        nargs=argparse.REMAINDER,
        metavar="CODE",
        help="run code, as python -c CODE [ARGS...]",
    )
    launch.add_argument("script", nargs="?", help="the training script (or -m MODULE, -c CODE)")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def _launch(args: argparse.Namespace) -> int:
    from tfdist.engines import launch as launch_lib

    script, rest, python = _script_of(args)
    if args.netns and not os.environ.get("TFDIST_IN_NETNS"):
        given = list(sys.argv[2:] if args.argv is None else args.argv)
        given.remove("--netns")  # The first one: the launcher's, not the script's.
        inner = [sys.executable, "-m", "tfdist", "launch", *given]
        return launch_lib.run_in_netns(inner, grace=args.grace)
    workers = "2" if args.workers is None else args.workers
    if args.transport == "mpi":
        return _launch_mpi(args, workers, script, rest, python)
    if args.hosts is not None or args.hostfile is not None:
        workers, ranks = _horovod_hosts(args, workers)
        if not horovodrun.is_local(ranks):
            return _print_rank_commands(SOURCE, ranks, script, rest, python)
    if args.spec is not None and _print_spec_commands(args.spec, script, rest):
        return 2
    result = launch_lib.launch(
        script,
        rest,
        workers=workers,
        chief=args.chief,
        ps=args.ps,
        env=_timeline_env(args.timeline),
        evaluator=args.evaluator,
        max_restarts=args.max_restarts,
        show_all=args.show_all,
        spec=args.spec,
        log_dir=args.log_dir,
        verbose=args.verbose,
        python=python,
        grace=args.grace,
        preempt_signal=args.preempt_signal,
        worker_failed=args.worker_failed,
        host_discovery_script=args.host_discovery_script,
        discovery_interval=args.discovery_interval,
    )
    return result.exit_code


SOURCE = "tfdist launch"


def _script_of(args: argparse.Namespace) -> tuple[list, list, str | None]:
    """(script, its arguments, the interpreter named before it or None):
    ``SCRIPT``, ``-m MODULE``, ``-c CODE`` (also after ``--``), or
    horovodrun's ``python train.py``."""
    script, rest = [args.script], list(args.args)
    for flag, words in (("-m", args.module), ("-c", args.code)):
        if words is not None:
            if not words:
                what = "MODULE" if flag == "-m" else "CODE"
                raise ConfigError("script", flag, f"'{flag} {what}'", source=SOURCE)
            script, rest = [flag, words[0]], words[1:]
    if args.script in ("-m", "-c"):  # After '--'.
        if not rest:
            raise ConfigError(
                "script", args.script, f"'{args.script} MODULE_OR_CODE'", source=SOURCE
            )
        script, rest = [args.script, rest[0]], rest[1:]
    if script == [None]:
        raise ConfigError("script", None, "a script path, -m MODULE or -c CODE", source=SOURCE)
    python = None
    if len(script) == 1 and horovodrun.is_python_word(script[0]):
        # horovodrun's spelling: `python train.py`; tfdist adds the interpreter itself.
        python, script, rest = horovodrun.split_python([*script, *rest], source=SOURCE)
    return script, rest, python


def _horovod_hosts(args: argparse.Namespace, workers: str) -> tuple[int, list]:
    """-H/--hosts or --hostfile: (the worker count, each rank's host)."""
    from tfdist.engines import elastic as launch_elastic

    low, high = launch_elastic.parse_workers(workers)
    if low != high or args.host_discovery_script is not None:
        raise ConfigError(
            "workers",
            workers,
            "a fixed worker count with -H/--hosts or --hostfile",
            source=SOURCE,
            hint="An elastic job "
            "(MIN:MAX) runs every worker here; its size comes from "
            "--host-discovery-script.",
        )
    for field, value, given in (
        ("spec", args.spec, args.spec is not None),
        ("chief", args.chief, args.chief),
        ("ps", args.ps, args.ps),
    ):
        if given:
            raise ConfigError(
                field,
                value,
                "not set with -H/--hosts or --hostfile",
                source=SOURCE,
                hint="Horovod-style hosts give "
                "worker ranks only; use --spec for other cluster shapes.",
            )
    hosts = horovodrun.read_hosts(args.hosts, args.hostfile, source=SOURCE)
    count = sum(h.slots for h in hosts) if args.workers is None else high
    return count, horovodrun.rank_hosts(count, hosts, source=SOURCE)


def _print_spec_commands(given: str, script: list, rest: list) -> bool:
    """Whether the spec names other hosts; if so, prints each host's command
    (not ours to start)."""
    from tfdist.engines import launch as launch_lib
    from tfdist.engines.hosts import format_host_commands, host_commands

    spec = spec_lib.parse(given, require_task=False).to_dict()
    others = launch_lib.non_local_hosts(spec)
    if not others:
        return False
    print(
        f"tfdist launch: the spec names other hosts ({', '.join(others)}); tfdist launch "
        "starts processes on this machine only. Run on each host:",
        file=sys.stderr,
    )
    entry = script[-1] if len(script) == 1 else script[0]
    print(format_host_commands(host_commands(spec, entry, script[1:] + rest)))
    return True


def _timeline_env(timeline: str | None) -> dict | None:
    """--timeline FILE: the tasks' TFDIST_TIMELINE."""
    if timeline is None:
        return None
    if not timeline.strip() or os.path.isdir(timeline):
        raise ConfigError(
            "timeline",
            timeline,
            "a file path for the merged Chrome-trace JSON, e.g. trace.json",
            source=SOURCE,
        )
    return {"TFDIST_TIMELINE": os.path.abspath(timeline)}


def _launch_mpi(
    args: argparse.Namespace, workers: str, script: list, rest: list, python: str | None
) -> int:
    """``--transport mpi``: mpiexec starts the workers (tfdist.engines.mpi_launch)."""
    from tfdist.engines import mpi_launch

    for field, value, given in (
        ("chief", args.chief, args.chief),
        ("ps", args.ps, args.ps),
        ("evaluator", args.evaluator, args.evaluator),
        ("spec", args.spec, args.spec is not None),
        ("hosts", args.hosts, args.hosts is not None or args.hostfile is not None),
        ("host_discovery_script", args.host_discovery_script, args.host_discovery_script),
        ("timeline", args.timeline, args.timeline is not None),
        ("log_dir", args.log_dir, args.log_dir is not None),
    ):
        if given:
            raise ConfigError(
                field,
                value,
                "not set with --transport mpi",
                source="tfdist launch",
                hint="mpiexec starts N worker ranks on this machine; for other hosts give "
                "mpiexec its host file and run the script with TFDIST_TRANSPORT=mpi.",
            )
    if not workers.strip().isdigit() or int(workers) < 2:
        raise ConfigError(
            "workers",
            workers,
            "a fixed number of workers >= 2 with --transport mpi",
            source="tfdist launch",
            hint="MPI jobs are not elastic: MIN:MAX needs --transport tf.",
        )
    return mpi_launch.launch_mpi(
        script,
        rest,
        workers=int(workers),
        max_restarts=args.max_restarts,
        grace=args.grace,
        # Not the warm pool's: mpiexec's ranks must be its own children.
        python=python or sys.executable,
    )


def _print_rank_commands(
    what: str, ranks: list[str], script: list[str], rest: list[str], python: str | None
) -> int:
    """Prints each host's commands for ranks on other hosts; exit code 2 (nothing ran)."""
    print(horovodrun.multi_host_note(ranks, what), file=sys.stderr)
    print(horovodrun.format_commands(ranks, script, rest, python), end="")
    return 2


#: horovodrun options that tune Horovod's own runtime: accepted, with a note.
_HOROVOD_TUNING = (
    "--fusion-threshold-mb",
    "--cycle-time-ms",
    "--cache-capacity",
    "--timeline-filename",
    "--autotune-log-file",
    "--mpi-args",
    "--network-interface",
    "--config-file",
    "--log-level",
)
_HOROVOD_TUNING_FLAGS = (
    "--disable-cache",
    "--gloo",
    "--mpi",
    "--tcp",
    "--autotune",
    "--hierarchical-allreduce",
    "--hierarchical-allgather",
    "--no-stall-check",
    "--timeline-mark-cycles",
)
#: horovodrun options tfdist cannot honour: a clear error.
_HOROVOD_REJECTED = {
    "ssh_port": ("-p", "--ssh-port"),
    "ssh_identity_file": ("-i", "--ssh-identity-file"),
    "min_np": ("--min-np",),
    "max_np": ("--max-np",),
    "slots": ("--slots-per-host",),
    "host_discovery_script": ("--host-discovery-script",),
}


def add_horovodrun(sub) -> None:
    """Adds the ``horovodrun`` subcommand to ``sub``."""
    run = sub.add_parser(
        "horovodrun",
        help="horovodrun's options on tfdist launch",
        usage="tfdist horovodrun -np N [-H HOST:SLOTS,...|--hostfile FILE] [--max-restarts K] "
        "[--verbose] [--start-timeout S] [--output-filename DIR] COMMAND [ARGS...]",
        description="Takes horovodrun's command line. With every slot on localhost or "
        "127.0.0.1 it runs the job here as `tfdist launch --workers N` does (a TF_CONFIG per "
        "rank, restarts with --max-restarts, no orphan processes). With other hosts it starts "
        "nothing and prints each host's TF_CONFIG and command (exit code 2). A leading "
        "'python' word is dropped: tasks run with this interpreter.",
    )
    run.add_argument(
        "-np", "--num-proc", dest="np", type=int, required=True, help="number of processes (ranks)"
    )
    run.add_argument(
        "-H",
        "--hosts",
        default=None,
        help="host1:slots,host2:slots (default: localhost:NP); ranks fill the hosts in order",
    )
    run.add_argument("-hostfile", "--hostfile", default=None, help="file with lines 'host slots=N'")
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job up to K times after a failure (tfdist)",
    )
    run.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds for every rank to join (TFDIST_REGISTER_TIMEOUT)",
    )
    run.add_argument(
        "--verbose", action="store_true", help="also show TensorFlow's start-up messages"
    )
    run.add_argument(
        "--output-filename",
        default=None,
        help="keep each rank's full log under this directory (DIR/attempt-N/worker-RANK.log)",
    )
    run.add_argument("--log-dir", default=None, help="same as --output-filename")
    for names in _HOROVOD_REJECTED.values():
        run.add_argument(
            *names,
            dest=names[-1].lstrip("-").replace("-", "_"),
            default=None,
            help=argparse.SUPPRESS,
        )
    for name in _HOROVOD_TUNING:
        run.add_argument(name, default=None, help=argparse.SUPPRESS)
    for name in _HOROVOD_TUNING_FLAGS:
        run.add_argument(name, action="store_true", help=argparse.SUPPRESS)
    # Not dest="command": main() names the subcommand with args.command.
    run.add_argument(
        "words",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="python SCRIPT [ARGS...], SCRIPT [ARGS...] or python -m MODULE",
    )
    run.set_defaults(func=_horovodrun)


def _horovodrun(args: argparse.Namespace) -> int:
    from tfdist.engines import launch as launch_lib

    source = "tfdist horovodrun"
    for field, names in _HOROVOD_REJECTED.items():
        value = getattr(args, names[-1].lstrip("-").replace("-", "_"))
        if value is None:
            continue
        if field.startswith("ssh"):
            raise ConfigError(
                field,
                value,
                f"no {'/'.join(names)}: tfdist never uses SSH",
                source=source,
                hint="With other hosts tfdist horovodrun prints "
                "each host's command; start them with your own ssh or scheduler.",
            )
        raise ConfigError(
            field,
            value,
            f"no {'/'.join(names)}: tfdist horovodrun runs a fixed number of ranks",
            source=source,
            hint="Run a fixed -np N with "
            "--max-restarts K: a failed rank restarts the job, and "
            "tfdist.horovod.elastic resumes from the last commit. Elastic sizes "
            "are for tfdist strategy scripts: tfdist launch --workers MIN:MAX "
            "[--host-discovery-script PATH].",
        )
    ignored = [n for n in _HOROVOD_TUNING if getattr(args, n[2:].replace("-", "_")) is not None]
    ignored += [n for n in _HOROVOD_TUNING_FLAGS if getattr(args, n[2:].replace("-", "_"))]
    if ignored:
        print(
            f"{source}: note: ignored {', '.join(ignored)}: options that tune Horovod's own "
            "runtime have no effect here (TensorFlow's collectives carry the all-reduces)",
            file=sys.stderr,
        )
    if args.output_filename and args.log_dir and args.output_filename != args.log_dir:
        raise ConfigError(
            "output_filename",
            args.output_filename,
            f"the same directory as --log-dir ({args.log_dir!r}) or only one of them",
            source=source,
        )
    python, script, rest = horovodrun.split_python(args.words, source=source)
    hosts = horovodrun.read_hosts(args.hosts, args.hostfile, source=source)
    ranks = horovodrun.rank_hosts(args.np, hosts, source=source)
    if not horovodrun.is_local(ranks):
        return _print_rank_commands(source, ranks, script, rest, python)
    env = {}
    if args.start_timeout is not None:
        if not args.start_timeout > 0:
            raise ConfigError(
                "start_timeout", args.start_timeout, "a number of seconds > 0", source=source
            )
        env["TFDIST_REGISTER_TIMEOUT"] = str(args.start_timeout)
    result = launch_lib.launch(
        script,
        rest,
        workers=args.np,
        max_restarts=args.max_restarts,
        show_all=True,
        env=env,
        python=python,
        verbose=args.verbose,
        log_dir=args.output_filename or args.log_dir,
    )
    return result.exit_code
