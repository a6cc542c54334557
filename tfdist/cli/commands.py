"""The ``tfdist`` command.

    tfdist info [--config SPEC] [--strategy NAME] [--cpu-replicas N] [--model-parallel T]
                [--tpu T] [--verbose]
    tfdist validate FILE|- [--strategy NAME] [--require-task]
    tfdist tf-config SPEC --task TYPE:INDEX [--export]
    tfdist launch [--workers N|MIN:MAX|-np N] [-H HOST:SLOTS,...|--hostfile F] [--chief]
                  [--ps M] [--evaluator] [--max-restarts K] [--grace S] [--preempt-signal SIG]
                  [--worker-failed restart|shrink] [--host-discovery-script PATH]
                  [--discovery-interval S] [--show-all] [--verbose] [--spec SPEC]
                  [--log-dir D] [--netns] [--timeline PATH]
                  SCRIPT|-m MODULE|-c CODE [ARGS...]
    tfdist profile LOGDIR [--output PNG]
    tfdist horovodrun -np N [-H HOST:SLOTS,...|--hostfile F] [--max-restarts K]
                      [--verbose] [--start-timeout S] [--output-filename D] COMMAND...
    tfdist hosts SPEC [--python P] [--evaluator] -- SCRIPT [ARGS...]
    tfdist tfjob SPEC --name N --image I [--namespace NS] -- COMMAND [ARGS...]

``validate``, ``tf-config``, ``hosts``, ``tfjob``, ``horovodrun`` and ``profile`` never import
TensorFlow, so
they answer at once. ``info`` and ``launch`` leave TensorFlow's start-up
noise out of the terminal (see :mod:`tfdist.engines.quiet`); ``--verbose`` shows it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tfdist.cli.launch_commands import add_horovodrun, add_launch
from tfdist.cli.spec_commands import add_hosts, add_tfjob, run_info, run_tf_config, run_validate
from tfdist.engines.quiet import filtered_stderr
from tfdist.errors import TfdistError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfdist", description="Distributed training for TensorFlow and Keras 3."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info", help="which strategy would be chosen here, and why; devices, cluster and this task"
    )
    info.add_argument(
        "--config", default=None, help="TF_CONFIG JSON or spec path (default: $TF_CONFIG)"
    )
    info.add_argument("--strategy", default="auto")
    info.add_argument("--cpu-replicas", type=int, default=None)
    info.add_argument(
        "--model-parallel",
        type=int,
        default=None,
        help="tensor-parallel group size T (tfdist.parallel)",
    )
    info.add_argument("--tpu", default=None)
    info.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also show TensorFlow's start-up messages (CUDA, "
        "oneDNN, CPU instructions), hidden by default",
    )
    # TensorFlow writes its start-up noise to fd 2 itself: main() filters it.
    info.add_argument(
        "--patches",
        action="store_true",
        help="list every change tfdist makes to Keras/TF (tfdist/compat/"
        "registry.py), with why and whether it fits the installed versions",
    )
    info.set_defaults(func=run_info, filter_stderr=True)

    validate = sub.add_parser("validate", help="check a TF_CONFIG or spec file ('-' reads stdin)")
    validate.add_argument("file")
    validate.add_argument("--strategy", default=None, help="also check the rules of this strategy")
    validate.add_argument(
        "--require-task",
        action="store_true",
        help="the file is one process's TF_CONFIG and must name its task",
    )
    validate.set_defaults(func=run_validate)

    tf_config = sub.add_parser("tf-config", help="print the TF_CONFIG of one task of a spec")
    tf_config.add_argument("spec", help="spec path or name in cluster_specs/, or '-' for stdin")
    tf_config.add_argument("--task", required=True, help="TYPE:INDEX, e.g. worker:1")
    tf_config.add_argument(
        "--export", action="store_true", help="print a shell 'export TF_CONFIG=...' line"
    )
    tf_config.set_defaults(func=run_tf_config)
    add_launch(sub)
    add_horovodrun(sub)
    add_hosts(sub)
    add_tfjob(sub)
    profile = sub.add_parser(
        "profile",
        help="plot where each worker's step time went",
        description="Reads LOGDIR/steps.jsonl, written by "
        "tfdist.StepProfile(log_dir=LOGDIR), prints the mean "
        "milliseconds per step of each phase for every worker and "
        "draws them to a PNG (needs matplotlib).",
    )
    profile.add_argument("logdir", help="the StepProfile log_dir")
    profile.add_argument(
        "--output", default=None, help="the PNG to write (default: LOGDIR/profile.png)"
    )
    profile.set_defaults(func=_profile)
    return parser


def _profile(args: argparse.Namespace) -> int:
    from tfdist.profiling import plot as plot_lib

    figures = plot_lib.plot(args.logdir, args.output)
    print(plot_lib.table(figures["workers"]))
    print(f"{figures['steps']} step records; plot: {figures['output']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``tfdist`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)[1:]  # After the subcommand.
    quiet = getattr(args, "filter_stderr", False) and not args.verbose
    try:
        with filtered_stderr(quiet):
            return args.func(args)
    except TfdistError as error:
        print(f"tfdist {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
