"""The spec commands: ``info``, ``validate``, ``tf-config``, ``hosts`` and ``tfjob``.

All but ``info`` answer without importing TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from tfdist import spec as spec_lib
from tfdist.errors import TfdistError


def run_info(args: argparse.Namespace) -> int:
    """Runs ``tfdist info``: the strategy chosen here and why; returns the exit code."""
    from tfdist.spec.detect import choose
    from tfdist.spec.options import check_model_parallel, make_options

    options = {}
    if args.cpu_replicas is not None:
        options["cpu_replicas"] = args.cpu_replicas
    if args.model_parallel is not None:
        options["model_parallel"] = args.model_parallel
    if args.tpu is not None:
        options["tpu"] = args.tpu
    opts = make_options(**options)
    choice = choose(args.config, strategy=args.strategy, options=opts)
    model_parallel = check_model_parallel(choice.name, opts.model_parallel, role=choice.role)
    mesh = None
    if model_parallel > 1:
        # The replicas are known here only when the options list them.
        replicas = None
        if choice.name == "mirrored":
            replicas = len(opts.devices) if opts.devices else opts.cpu_replicas
        if replicas:
            from tfdist.parallel.mesh import Mesh

            mesh = Mesh(replicas, model_parallel).describe()
        else:
            mesh = (
                f"tensor groups of {model_parallel} replicas, innermost; "
                f"data-parallel size = replicas / {model_parallel}"
            )
    print(f"strategy: {choice.name}")
    print(f"why:      {choice.reason}")
    if mesh:
        print(f"mesh:     {mesh}")
    cfg = choice.tf_config
    if choice.slurm:
        from tfdist.strategies.slurm import SlurmClusterResolver

        resolver = SlurmClusterResolver(port_base=opts.slurm_port_base)
        spec = resolver.cluster_spec().as_dict()
        cfg = spec_lib.parse(
            {"cluster": spec, "task": {"type": resolver.task_type, "index": resolver.task_id}}
        )
        print(f"source:   Slurm job step (SLURM_PROCID={os.environ['SLURM_PROCID']})")
    elif cfg.cluster:
        print(f"source:   {cfg.source}")
    if cfg.cluster:
        for job, addresses in cfg.cluster.items():
            print(f"cluster:  {job}: {', '.join(addresses)}")
        chief = "chief" if cfg.is_chief else "not chief"
        print(f"task:     {cfg.task_id or 'none'} ({chief})")
    else:
        print("cluster:  none (this process only)")
    if choice.role != "trainer":
        print(f"role:     {choice.role}")
    if choice.name == "tpu":
        from tfdist.strategies import check_tpu

        try:
            check_tpu(choice.tpu)
            print(f"tpu:      {choice.tpu} (reachable)")
        except TfdistError as error:
            print(f"tpu:      {choice.tpu}: {error}")

    import tensorflow as tf  # Devices need TensorFlow; the rest did not.

    for kind in ("CPU", "GPU", "TPU"):
        found = tf.config.list_physical_devices(kind)
        names = ", ".join(d.name.replace("/physical_device:", "") for d in found)
        print(f"{kind.lower() + 's:':<10}{len(found)}" + (f" ({names})" if found else ""))
    from tfdist.compat import versions

    low = {package: f">={lo},<{hi}" for package, (lo, hi) in versions.SUPPORTED.items()}
    print(
        f"versions: tensorflow {tf.__version__}, keras "
        f"{__import__('keras').__version__} (supported: tensorflow {low['tensorflow']}, "
        f"keras {low['keras']})"
    )
    _print_patches(verbose=args.patches)
    return 0


def _print_patches(verbose: bool) -> None:
    """The registry's patches and how each fits the installed Keras/TF."""
    from tfdist import compat
    from tfdist.compat import registry

    report = compat.check()
    skipped = [n for n, problem in report.items() if problem == "not needed on this version"]
    broken = {n: problem for n, problem in report.items() if problem and n not in skipped}
    applies = len(report) - len(skipped)
    features = sorted({p.feature for p in registry.PATCHES if p.name not in skipped})
    print(
        f"patches:  {applies} apply on these versions ({len(skipped)} not needed), "
        f"{len(features)} features; {len(broken)} do not fit"
        + ("" if verbose else " (--patches lists them)")
    )
    for name, problem in broken.items():
        print(f"  ! {name}: {problem}")
    if verbose:
        for patch in registry.PATCHES:
            state = (
                "not needed"
                if patch.name in skipped
                else "MISMATCH"
                if patch.name in broken
                else "ok"
            )
            target = patch.target.replace("tfdist.compat.keras_src:", "keras:")
            print(f"  {state:<10} {patch.name:<40} {target}")
            print(f"             why: {patch.why}")


def _read_source(path: str) -> str | dict:
    """Reads ``-`` from stdin as JSON text; anything else goes to parse()."""
    if path == "-":
        text = sys.stdin.read()
        return text if text.strip() else "null"  # Empty stdin is an error.
    return path


def run_validate(args: argparse.Namespace) -> int:
    """Runs ``tfdist validate``: checks a TF_CONFIG or spec; returns the exit code."""
    source = _read_source(args.file)
    cfg = spec_lib.parse(source, require_task=args.require_task, strategy=args.strategy)
    jobs = ", ".join(f"{len(a)} {job}" for job, a in cfg.cluster.items())
    task = f", task {cfg.task_id}" if cfg.task_id else ""
    print(f"OK: {cfg.source}: {cfg.kind} ({jobs or 'no cluster'}){task}")
    return 0


def run_tf_config(args: argparse.Namespace) -> int:
    """Runs ``tfdist tf-config``: prints one task's TF_CONFIG; returns the exit code."""
    task_type, task_index = spec_lib.parse_task(args.task)
    config = spec_lib.tf_config_for_task(_read_source(args.spec), task_type, task_index)
    text = json.dumps(config, separators=(",", ":"))
    print(f"export TF_CONFIG={shlex.quote(text)}" if args.export else text)
    return 0


def _hosts_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--python",
        default="python",
        help="the interpreter command on each host (default: python), e.g. 'python3 -u'",
    )
    parser.add_argument(
        "--evaluator",
        action="store_true",
        default=None,
        help="also start an evaluator (default: when the spec's task is the evaluator)",
    )
    parser.add_argument(
        "--evaluator-host", default=None, help="host of the evaluator (default: the chief's)"
    )


_HOSTS_USAGE = "tfdist hosts SPEC [--python P] [--evaluator] -- SCRIPT [ARGS...]"
_HOSTS_DESCRIPTION = (
    "Prints, grouped by host, the shell line that starts each task of SPEC: "
    "TF_CONFIG='{...}' python SCRIPT ARGS. Run each line on its host (tasks "
    "on one host in separate shells). Does not import TensorFlow."
)


def _add_spec_command(
    sub,
    name: str,
    *,
    summary: str,
    usage: str,
    description: str,
    add_options,
    words: str,
    words_help: str,
    func,
) -> None:
    """Adds ``tfdist NAME SPEC [OPTIONS] -- WORDS...``.

    ``args.head()`` builds the parser of what comes before '--' (see
    :func:`_command_after_dashes`).
    """
    parser = sub.add_parser(name, help=summary, usage=usage, description=description)
    add_options(parser)
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, metavar=f"SPEC -- {words}", help=words_help
    )

    def head() -> argparse.ArgumentParser:
        head = argparse.ArgumentParser(prog=f"tfdist {name}", usage=usage, description=description)
        head.add_argument("spec", help="spec path or name in cluster_specs/, or '-' for stdin")
        add_options(head)
        return head

    parser.set_defaults(func=func, head=head)


def _command_after_dashes(
    args: argparse.Namespace, head: argparse.ArgumentParser, what: str
) -> list[str]:
    """Parses ``SPEC [OPTIONS] -- WORDS...``: options on either side of SPEC.

    The subcommand's positional is a REMAINDER (argparse would otherwise
    take options placed after SPEC, or after '--', as its own); ``head``
    parses what comes before the first '--' into ``args``, and the words
    after it are returned.
    """
    rest = list(args.rest)
    if "--" not in rest:
        if "-h" in rest or "--help" in rest:
            head.parse_args(["--help"])  # Prints the full help and exits.
        head.error(f"put {what} after '--' (see the usage above)")
    cut = rest.index("--")
    head.parse_args(rest[:cut], namespace=args)
    words = rest[cut + 1 :]
    if not words:
        head.error(f"{what} is missing after '--'")
    return words


def add_hosts(sub) -> None:
    """Adds the ``hosts`` subcommand to ``sub``."""
    _add_spec_command(
        sub,
        "hosts",
        summary="print the command that starts each task of a spec on its host",
        usage=_HOSTS_USAGE,
        description=_HOSTS_DESCRIPTION,
        add_options=_hosts_options,
        words="SCRIPT [ARGS...]",
        words_help="the spec, then '--', the script and its arguments",
        func=_hosts,
    )


def _hosts(args: argparse.Namespace) -> int:
    from tfdist.engines import hosts as hosts_lib

    words = _command_after_dashes(args, args.head(), "SCRIPT")
    commands = hosts_lib.host_commands(
        _read_source(args.spec),
        words[0],
        words[1:],
        python=args.python,
        evaluator=args.evaluator,
        evaluator_host=args.evaluator_host,
    )
    print(hosts_lib.format_host_commands(commands), end="")
    return 0


def _tfjob_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--name", default=None, help="metadata.name (required): lowercase letters, digits, '-'"
    )
    parser.add_argument("--image", default=None, help="container image (required)")
    parser.add_argument("--namespace", default=None, help="metadata.namespace")
    parser.add_argument(
        "--restart-policy",
        default="ExitCode",
        help="ExitCode (default: re-create a pod that exited with 128-255, "
        "e.g. 143 after saving on preemption; fail on 1-127), "
        "OnFailure, Never or Always",
    )
    parser.add_argument(
        "--grace",
        default="60",
        metavar="SECONDS",
        help="terminationGracePeriodSeconds of each pod: time from SIGTERM "
        "to SIGKILL to save a backup (default 60)",
    )
    parser.add_argument(
        "--backup-claim",
        default=None,
        metavar="PVC",
        help="PersistentVolumeClaim (ReadWriteMany) to mount in every pod for the backups",
    )
    parser.add_argument(
        "--backup-mount",
        default=None,
        metavar="PATH",
        help="where --backup-claim is mounted (default /backup)",
    )
    parser.add_argument("--cpu", default=None, help="CPU request and limit, e.g. 2 or 500m")
    parser.add_argument("--memory", default=None, help="memory request and limit, e.g. 4Gi")


_TFJOB_USAGE = (
    "tfdist tfjob SPEC --name N --image I [--namespace NS] "
    "[--restart-policy P] [--grace S] [--backup-claim PVC [--backup-mount PATH]] "
    "[--cpu C] [--memory M] -- COMMAND [ARGS...]"
)
_TFJOB_DESCRIPTION = (
    "Prints a Kubeflow TFJob (kubeflow.org/v1) YAML manifest with one replica "
    "spec per job of SPEC (Chief, Worker, PS, Evaluator), sized like SPEC. Host "
    "addresses are not used: the training operator sets TF_CONFIG in each pod. "
    "Preemption: on SIGTERM (an eviction, a drain) tfdist.BackupAndRestore saves "
    "within --grace seconds and exits 143, which the ExitCode policy restarts; keep "
    "the backups on a volume every pod mounts (--backup-claim). "
    "Apply it with: tfdist tfjob ... | kubectl apply -f -"
)


def add_tfjob(sub) -> None:
    """Adds the ``tfjob`` subcommand to ``sub``."""
    _add_spec_command(
        sub,
        "tfjob",
        summary="print a Kubeflow TFJob manifest for a spec",
        usage=_TFJOB_USAGE,
        description=_TFJOB_DESCRIPTION,
        add_options=_tfjob_options,
        words="COMMAND [ARGS...]",
        words_help="the spec, then '--' and the container's command",
        func=_tfjob,
    )


def _tfjob(args: argparse.Namespace) -> int:
    from tfdist.engines import hosts as hosts_lib

    head = args.head()
    command = _command_after_dashes(args, head, "COMMAND")
    missing = [
        flag for flag, value in (("--name", args.name), ("--image", args.image)) if value is None
    ]
    if missing:
        head.error(f"the following arguments are required: {', '.join(missing)}")
    counts = hosts_lib.replica_counts(_read_source(args.spec))
    manifest = hosts_lib.tfjob_manifest(
        counts,
        name=args.name,
        image=args.image,
        command=command,
        namespace=args.namespace,
        restart_policy=args.restart_policy,
        cpu=args.cpu,
        memory=args.memory,
        grace=args.grace,
        backup_claim=args.backup_claim,
        backup_mount=args.backup_mount,
    )
    shape = ", ".join(f"{count} {task_type}" for task_type, count in counts.items())
    print(
        f"# TFJob for {args.spec} ({shape}), written by tfdist.\n"
        "# The training operator sets TF_CONFIG in each pod; the spec's host "
        "addresses are not used.\n"
        "# On SIGTERM, tfdist.BackupAndRestore saves within the grace period and "
        "exits 143; keep its backup dir on a volume every pod mounts."
    )
    print(hosts_lib.to_yaml(manifest), end="")
    return 0
