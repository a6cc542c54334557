"""Per-host launch commands and Kubeflow TFJob manifests. No TensorFlow.

Two ways to start every task of a cluster spec:

* :func:`host_commands` gives, for each task (chief, workers, ps, and an
  evaluator when asked for), the host it runs on, its ``TF_CONFIG`` and a
  shell command line to paste on that host::

      TF_CONFIG='{"cluster":...,"task":{"type":"worker","index":1}}' python train.py --epochs 3

* :func:`tfjob_manifest` gives a Kubeflow ``TFJob`` (``kubeflow.org/v1``)
  with one replica spec per job of the cluster; :func:`to_yaml` prints it as
  YAML for ``kubectl apply -f -`` without needing PyYAML.

Typical use::

    from tfdist.engines import hosts

    for cmd in hosts.host_commands("two_workers", "train.py", ["--epochs", "3"]):
        print(cmd.host, cmd.command)
    print(hosts.to_yaml(hosts.tfjob_manifest(
        "parameter_server", name="mnist", image="registry/img:1",
        command=["python", "train.py"])))

This module must stay importable without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from tfdist import spec as cluster
from tfdist.errors import ClusterSpecError, ConfigError

__all__ = [
    "HostCommand",
    "host_commands",
    "group_by_host",
    "format_host_commands",
    "REPLICA_TYPES",
    "RESTART_POLICIES",
    "DEFAULT_RESTART_POLICY",
    "DEFAULT_GRACE_SECONDS",
    "DEFAULT_BACKUP_MOUNT",
    "replica_counts",
    "tfjob_manifest",
    "to_yaml",
]

#: tfdist task type -> TFJob replica type (``spec.tfReplicaSpecs`` key).
REPLICA_TYPES = {"chief": "Chief", "worker": "Worker", "ps": "PS", "evaluator": "Evaluator"}
#: Values of a replica spec's ``restartPolicy`` accepted by the training operator.
RESTART_POLICIES = ("OnFailure", "Never", "Always", "ExitCode")
#: The restart policy :func:`tfjob_manifest` writes by default. With ``ExitCode`` the
#: training operator deletes and re-creates a pod whose container exited with a code
#: of 128 or more (retryable: 143 = preempted after saving, 137 = killed), and fails
#: the job on 1-127 (a bug would only fail again).
DEFAULT_RESTART_POLICY = "ExitCode"
#: Default ``terminationGracePeriodSeconds``: the time a pod has, from SIGTERM to
#: SIGKILL, to save a backup and exit (Kubernetes' own default is 30 s).
DEFAULT_GRACE_SECONDS = 60

_TFJOB_API_VERSION = "kubeflow.org/v1"
_TFJOB_CONTAINER = "tensorflow"  # The operator only sets TF_CONFIG in this container.
_MAX_NAME = 63  # Kubernetes label / Service name limit.
_MAX_INT64 = 2**63 - 1  # terminationGracePeriodSeconds is an int64.
_DNS1123_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
#: The volume :func:`tfjob_manifest` mounts for ``backup_claim``, and where by default.
_BACKUP_VOLUME = "tfdist-backup"
DEFAULT_BACKUP_MOUNT = "/backup"
_DNS1035_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# A Kubernetes resource quantity: "2", "0.5", "500m", "4Gi", "1e3".
_QUANTITY_RE = re.compile(r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?")


# --------------------------------------------------------------------------
# Per-host commands.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostCommand:
    """How to start one task of a cluster on its host.

    Attributes:
        host: The host the task runs on: the host part of its address (an
            IPv6 host without brackets), or the evaluator's host.
        task_type: ``"chief"``, ``"worker"``, ``"ps"`` or ``"evaluator"``.
        task_index: The task's index within its job.
        address: The task's ``host:port``; None for the evaluator, which is
            not part of the cluster.
        tf_config: The task's ``TF_CONFIG`` as a dict.
        argv: The program to run: the python command, the script and its
            arguments.
    """

    host: str
    task_type: str
    task_index: int
    address: str | None
    tf_config: dict[str, Any] = dataclasses.field(hash=False)
    argv: tuple[str, ...]

    @property
    def task_id(self) -> str:
        """The task as ``"type:index"``, e.g. ``"worker:1"``."""
        return f"{self.task_type}:{self.task_index}"

    @property
    def tf_config_json(self) -> str:
        """The ``TF_CONFIG`` value: compact JSON."""
        return json.dumps(self.tf_config, separators=(",", ":"))

    @property
    def env(self) -> dict[str, str]:
        """The environment variables to add: ``{"TF_CONFIG": ...}``."""
        return {"TF_CONFIG": self.tf_config_json}

    @property
    def command(self) -> str:
        """A POSIX shell line: ``TF_CONFIG='{...}' python script args...``.

        Every word is quoted with :func:`shlex.quote`, so ``shlex.split``
        gives back ``TF_CONFIG=<json>`` followed by :attr:`argv`.
        """
        return f"TF_CONFIG={shlex.quote(self.tf_config_json)} {shlex.join(self.argv)}"


def _fail(field: str, value: Any, expected: str, source: str, hint: str | None = None) -> NoReturn:
    raise ConfigError(field, value, expected, source=source, hint=hint)


def _word(value: Any, field: str, source: str) -> str:
    """A command-line word: a string, a path or a number (not a bool)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        _fail(field, value, "a string (or a path or number)", source)
    return value


def _python_argv(python: str | Sequence[str], source: str) -> tuple[str, ...]:
    """``"python3 -u"`` -> ``("python3", "-u")``; a sequence is kept as given."""
    expected = "a command such as 'python', '/usr/bin/python3 -u', or a list of words"
    if isinstance(python, (str, os.PathLike)):
        text = os.fspath(python)
        try:
            words = shlex.split(text)
        except ValueError as error:
            _fail("python", python, expected, source, hint=f"It does not split into words: {error}.")
    elif isinstance(python, Sequence) and not isinstance(python, bytes):
        words = [_word(word, f"python[{i}]", source) for i, word in enumerate(python)]
    else:
        _fail("python", python, expected, source)
    if not words or not words[0]:
        _fail("python", python, expected, source)
    return tuple(words)


def _script_args(args: Any, source: str) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        _fail("args", args, "a list of arguments", source,
              hint=f"Wrap a single argument in a list: [{os.fsdecode(os.fspath(args))!r}].")
    if isinstance(args, Mapping) or not isinstance(args, Iterable):
        _fail("args", args, "a list of arguments", source)
    return [_word(arg, f"args[{i}]", source) for i, arg in enumerate(args)]


def host_commands(
    spec: Any,
    script: str | os.PathLike,
    args: Sequence[Any] = (),
    python: str | Sequence[str] = "python",
    *,
    evaluator: bool | None = None,
    evaluator_host: str | None = None,
) -> list[HostCommand]:
    """Returns the command that starts each task of a cluster spec on its host.

    Each task gets its own ``TF_CONFIG`` (the spec's cluster plus its
    ``task``, and the spec's ``rpc_layer`` / ``environment`` if set), and
    runs ``python script args...``.

    Args:
        spec: Anything :func:`tfdist.spec.parse` accepts, read with
            ``require_task=False``: a spec name such as ``'two_workers'``, a
            path, a JSON string, a dict or a ``TFConfig``.
        script: The training script, e.g. ``'train.py'``. To run a module,
            pass ``'-m'`` and put the module first in ``args``.
        args: The script's arguments (strings; paths and numbers are
            converted with ``str``).
        python: The interpreter: a string split with :func:`shlex.split`
            (``'python3 -u'``, ``'uv run python'``) or a list of words. Every word
            is quoted in :attr:`HostCommand.command`, so the shell expands no
            ``~`` or ``$VAR`` in it: give absolute paths.
        evaluator: Also start a side-car evaluator (``evaluator:0``). None
            (the default) starts one when the spec's ``task`` is the
            evaluator, as in ``cluster_specs/parameter_server_evaluator.json``.
        evaluator_host: Where the evaluator runs; defaults to the host of the
            chief (or of worker 0 without a chief).

    Returns:
        One :class:`HostCommand` per task, in the order chief, workers, ps,
        evaluator.

    Raises:
        ClusterSpecError: The spec is invalid or has no cluster.
        ConfigError: A bad ``script``, ``args``, ``python`` or
            ``evaluator_host``; the message names the field.
    """
    source = "host_commands()"
    config = cluster.parse(spec, require_task=False)
    if not config.cluster:
        raise ClusterSpecError(
            "cluster", config.to_dict()["cluster"], "a cluster with at least one task",
            source=config.source,
            hint="Each task of the cluster needs an address; see cluster_specs/.",
        )
    script_word = _word(script, "script", source)
    if not script_word:
        _fail("script", script, "a non-empty script path", source)
    argv = (*_python_argv(python, source), script_word, *_script_args(args, source))

    if evaluator is None:
        evaluator = config.task_type == "evaluator"
    elif not isinstance(evaluator, bool):
        _fail("evaluator", evaluator, "True, False or None", source)

    commands = []
    for task_type, index, address in config.tasks():
        host, _ = cluster.parse_address(address)
        commands.append(HostCommand(
            host=host, task_type=task_type, task_index=index, address=address,
            tf_config=config.with_task(task_type, index).to_dict(), argv=argv,
        ))
    if evaluator:
        if evaluator_host is None:
            host = commands[0].host  # The chief, else worker 0 (tasks() order).
        elif isinstance(evaluator_host, str) and evaluator_host.strip() and not any(
                char.isspace() for char in evaluator_host):
            host = evaluator_host
        else:
            _fail("evaluator_host", evaluator_host, "a host name without spaces", source)
        commands.append(HostCommand(
            host=host, task_type="evaluator", task_index=0, address=None,
            tf_config=config.with_task("evaluator", 0).to_dict(), argv=argv,
        ))
    elif evaluator_host is not None:
        _fail("evaluator_host", evaluator_host, "None unless an evaluator is started", source,
              hint="Pass evaluator=True to start one.")
    return commands


def group_by_host(commands: Iterable[HostCommand]) -> dict[str, list[HostCommand]]:
    """Groups commands by host, hosts in order of first appearance.

    Host names are compared case-insensitively (DNS names are); the first
    spelling met is the key.
    """
    groups: dict[str, list[HostCommand]] = {}
    spelling: dict[str, str] = {}
    for command in commands:
        key = spelling.setdefault(command.host.lower(), command.host)
        groups.setdefault(key, []).append(command)
    return groups


def format_host_commands(commands: Iterable[HostCommand]) -> str:
    """Formats commands grouped by host, as ``tfdist hosts`` prints them.

    Each host gets a ``# host ...`` comment line, then for each of its tasks
    a ``# task ...`` comment and the command line. Several tasks on one host
    must run at the same time (one shell each, or end the lines with ``&``).
    """
    blocks = []
    for host, group in group_by_host(commands).items():
        plural = "task" if len(group) == 1 else "tasks, each in its own shell"
        lines = [f"# host {host}: {len(group)} {plural}"]
        for command in group:
            where = f" at {command.address}" if command.address else " (outside the cluster)"
            lines.append(f"# {command.task_id}{where}")
            lines.append(command.command)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""


# --------------------------------------------------------------------------
# Kubeflow TFJob.
# --------------------------------------------------------------------------


def _is_counts(value: Any) -> bool:
    """Whether ``value`` is a replica-count mapping such as ``{"worker": 2}``."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(key, str) and key in cluster.TASK_TYPES for key in value)
        and not any(isinstance(count, (list, tuple)) for count in value.values())
    )


def replica_counts(spec_or_counts: Any) -> dict[str, int]:
    """Returns the number of replicas of each task type.

    Args:
        spec_or_counts: A mapping of task type to count, e.g.
            ``{"chief": 1, "worker": 2, "ps": 1}``, or anything
            :func:`tfdist.spec.parse` accepts: its jobs' sizes are used
            (and one evaluator when the spec's ``task`` is the evaluator).

    Returns:
        Non-zero counts only, in the order chief, worker, ps, evaluator.

    Raises:
        ConfigError: A count is not a non-negative integer, or the counts
            break TensorFlow's rules (at most one chief and one evaluator;
            at least one chief or worker; ps only with a chief and workers).
        ClusterSpecError: The spec is invalid.
    """
    source = "tfjob_manifest()"
    if _is_counts(spec_or_counts):
        counts = {}
        for task_type, count in spec_or_counts.items():
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
                _fail(f"counts.{task_type}", count, "a non-negative integer", source)
            counts[task_type] = int(count)
    else:
        config = cluster.parse(spec_or_counts, require_task=False)
        if not config.cluster:
            raise ClusterSpecError("cluster", {}, "a cluster with at least one chief or worker",
                                   source=config.source)
        counts = {job: len(addresses) for job, addresses in config.cluster.items()}
        if config.task_type == "evaluator":
            counts["evaluator"] = 1
    counts = {t: counts[t] for t in cluster.TASK_TYPES if counts.get(t)}

    for task_type in ("chief", "evaluator"):
        if counts.get(task_type, 0) > 1:
            _fail(f"counts.{task_type}", counts[task_type],
                  f"at most one {task_type} (TensorFlow has a single {task_type})", source)
    if not counts.get("chief") and not counts.get("worker"):
        _fail("counts", dict(spec_or_counts) if isinstance(spec_or_counts, Mapping) else counts,
              "at least one chief or worker", source)
    if counts.get("ps"):
        if not counts.get("chief"):
            _fail("counts.chief", 0, "1 when there are parameter servers (the coordinator)",
                  source)
        if not counts.get("worker"):
            _fail("counts.worker", 0, "at least 1 when there are parameter servers", source)
    return counts


def _dns_hint(value: str, *, letter_first: bool) -> str | None:
    """Suggests a valid name: lowercase, other characters turned into '-'."""
    fixed = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")
    if letter_first:
        fixed = fixed.lstrip("0123456789-")
    fixed = fixed[:_MAX_NAME].rstrip("-")
    return f"Try {fixed!r}." if fixed and fixed != value else None


def _check_name(name: Any, counts: Mapping[str, int], source: str) -> str:
    expected = (
        "a DNS-1035 label (the training operator's rule for TFJob names): at most 63 "
        "lowercase letters, digits and '-', starting with a letter and ending with a "
        "letter or digit"
    )
    if not isinstance(name, str) or not name:
        _fail("name", name, expected, source)
    if len(name) > _MAX_NAME or not _DNS1035_RE.fullmatch(name):
        _fail("name", name, expected, source, hint=_dns_hint(name, letter_first=True))
    # The operator names each replica's pod and Service NAME-TYPE-INDEX.
    longest = max((f"{name}-{t}-{c - 1}" for t, c in counts.items()), key=len)
    if len(longest) > _MAX_NAME:
        _fail("name", name,
              f"a name short enough for the Service names the operator derives from it "
              f"(at most {_MAX_NAME} characters, e.g. {longest!r} has {len(longest)})",
              source, hint=f"Use at most {_MAX_NAME - (len(longest) - len(name))} characters.")
    return name


def _check_quantity(field: str, value: Any, source: str) -> str | None:
    if value is None:
        return None
    expected = "a positive Kubernetes quantity such as '2', '500m' (CPU) or '4Gi' (memory)"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            _fail(field, value, expected, source)
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        _fail(field, value, expected, source)
    match = _QUANTITY_RE.fullmatch(text)
    if match is None or float(match.group(1)) == 0:
        _fail(field, value, expected, source)
    return text


def _check_command(field: str, value: Any, source: str, *, allow_empty: bool) -> list[str]:
    expected = "a list of strings, e.g. ['python', 'train.py']"
    if isinstance(value, str):
        try:
            hint = f"Split it into words: {shlex.split(value)!r}."
        except ValueError:
            hint = None
        _fail(field, value, expected, source, hint=hint)
    if isinstance(value, bytes):
        _fail(field, value, expected, source)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        _fail(field, value, expected, source)
    words = [_word(word, f"{field}[{i}]", source) for i, word in enumerate(value)]
    if not words and not allow_empty:
        _fail(field, [], expected + " (not empty)", source)
    return words


def _check_grace(value: Any, source: str) -> int:
    """``terminationGracePeriodSeconds``: whole seconds, at least 1.

    Kubernetes takes an integer; 0 would mean SIGKILL at once, with no time
    to save a backup.
    """
    expected = ("whole seconds >= 1 from SIGTERM to SIGKILL "
                "(terminationGracePeriodSeconds), e.g. 60")
    received = value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())  # From the command line.
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not 1 <= value <= _MAX_INT64):
        value = received
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        hint = None
        if (isinstance(number, numbers.Real) and not isinstance(number, bool)
                and math.isfinite(number) and number >= 1):
            hint = f"Kubernetes takes whole seconds: use {math.ceil(number)}."
        _fail("grace", value, expected, source, hint=hint)
    return int(value)


def _check_backup_volume(claim: Any, mount: Any, source: str) -> str | None:
    """Checks the backup claim and mount path; returns the mount path."""
    if claim is None:
        if mount is not None:
            _fail("backup_mount", mount, "None when there is no backup_claim", source,
                  hint="Name the PersistentVolumeClaim to mount with backup_claim "
                       "(--backup-claim).")
        return None
    if (not isinstance(claim, str) or len(claim) > 253
            or not _DNS1123_SUBDOMAIN_RE.fullmatch(claim)):
        _fail("backup_claim", claim,
              "None or the name of a PersistentVolumeClaim: lowercase letters, digits, "
              "'-' and '.', starting and ending with a letter or digit", source,
              hint=_dns_hint(claim, letter_first=False) if isinstance(claim, str) else None)
    mount = DEFAULT_BACKUP_MOUNT if mount is None else mount
    if (not isinstance(mount, str) or not mount.startswith("/") or ":" in mount
            or any(c.isspace() for c in mount)):
        _fail("backup_mount", mount, "an absolute path in the container, without ':' or "
              "spaces, e.g. '/backup'", source)
    return mount


def tfjob_manifest(
    spec_or_counts: Any,
    *,
    name: str,
    image: str,
    command: Sequence[str],
    args: Sequence[str] = (),
    namespace: str | None = None,
    restart_policy: str = DEFAULT_RESTART_POLICY,
    cpu: str | float | None = None,
    memory: str | int | None = None,
    grace: int = DEFAULT_GRACE_SECONDS,
    backup_claim: str | None = None,
    backup_mount: str | None = None,
) -> dict[str, Any]:
    """Returns a Kubeflow ``TFJob`` (``kubeflow.org/v1``) running a cluster.

    Only the cluster's shape is used: one replica spec per job (``Chief``,
    ``Worker``, ``PS``, and ``Evaluator`` when the spec's task is the
    evaluator) with the job's number of tasks as ``replicas``. Host addresses
    are ignored: the training operator creates a pod and a Service per
    replica and sets each pod's ``TF_CONFIG`` itself, so the script should
    read it (``tfdist.strategy_from_config()`` does).

    Every replica spec runs the same container, named ``tensorflow`` (the
    operator only sets ``TF_CONFIG`` there). Print it with :func:`to_yaml`.

    Preemption: Kubernetes stops a pod (eviction, node drain, spot VM
    reclaimed) with SIGTERM, then SIGKILL after the pod's
    ``terminationGracePeriodSeconds`` (``grace``). tfdist's
    ``BackupAndRestore`` saves at an agreed step within that time and exits
    with 143; the default ``ExitCode`` policy makes the operator re-create
    the pod, and the new one resumes at that step. The backup directory
    must be on a volume every pod mounts (a ReadWriteMany claim or object
    storage): a restarted pod may land on another node. Each container also
    gets ``TFDIST_GRACE`` (the grace period), so that a save that takes
    longer is logged.

    Args:
        spec_or_counts: Anything :func:`tfdist.spec.parse` accepts, or
            replica counts such as ``{"chief": 1, "worker": 2, "ps": 1}``
            (see :func:`replica_counts`).
        name: ``metadata.name``: a DNS-1035 label, short enough that the
            names the operator derives (``NAME-worker-0``) stay within 63
            characters.
        image: The container image, e.g. ``'registry.example.com/train:1'``.
        command: The container's ``command``, e.g. ``['python', 'train.py']``.
        args: The container's ``args`` (left out when empty).
        namespace: ``metadata.namespace`` (a DNS-1123 label), or None for
            the one ``kubectl`` uses.
        restart_policy: ``restartPolicy`` of every replica spec: one of
            :data:`RESTART_POLICIES`. ``ExitCode`` (the default) re-creates
            a pod that exited with 128-255 (143: preempted and saved; 137:
            killed) and fails the job on 1-127; ``OnFailure`` and
            ``Always`` restart on any failure, bugs included. A restarted
            task resumes from its backup.
        cpu: CPU request and limit of each pod, e.g. ``'2'`` or ``'500m'``.
        memory: Memory request and limit of each pod, e.g. ``'4Gi'``.
        grace: ``terminationGracePeriodSeconds`` of every pod: whole
            seconds from SIGTERM to SIGKILL, at least 1. It must cover a
            step plus the save of a backup.
        backup_claim: A PersistentVolumeClaim (ReadWriteMany: every pod
            mounts it) to mount in every container for the backups, or
            None. Pass the mount path to the script, e.g.
            ``--backup_dir=/backup/run1``.
        backup_mount: Where ``backup_claim`` is mounted: an absolute path,
            default :data:`DEFAULT_BACKUP_MOUNT`.

    Returns:
        The manifest as a dict (keys in the conventional order).

    Raises:
        ConfigError: A bad argument; ``field`` names it (``'name'``,
            ``'image'``, ``'command'``, ``'namespace'``, ``'restart_policy'``,
            ``'cpu'``, ``'memory'``, ``'grace'``, ``'backup_claim'``,
            ``'backup_mount'``, ``'counts.<type>'``).
        ClusterSpecError: The spec is invalid.
    """
    source = "tfjob_manifest()"
    counts = replica_counts(spec_or_counts)
    name = _check_name(name, counts, source)
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        _fail("image", image, "a non-empty container image reference without spaces, "
              "e.g. 'registry.example.com/train:1'", source)
    command_words = _check_command("command", command, source, allow_empty=False)
    arg_words = _check_command("args", args, source, allow_empty=True)
    if namespace is not None and (
            not isinstance(namespace, str) or len(namespace) > _MAX_NAME
            or not _DNS1123_RE.fullmatch(namespace)):
        _fail("namespace", namespace,
              "None or a DNS-1123 label: at most 63 lowercase letters, digits and '-', "
              "starting and ending with a letter or digit", source,
              hint=_dns_hint(namespace, letter_first=False) if isinstance(namespace, str) else None)
    if restart_policy not in RESTART_POLICIES:
        hint = None
        if isinstance(restart_policy, str):
            lowered = {policy.lower(): policy for policy in RESTART_POLICIES}
            close = difflib.get_close_matches(restart_policy.lower(), list(lowered), n=1)
            hint = f"Did you mean {lowered[close[0]]!r}?" if close else None
        _fail("restart_policy", restart_policy,
              "one of " + ", ".join(repr(p) for p in RESTART_POLICIES), source, hint=hint)
    grace = _check_grace(grace, source)
    backup_mount = _check_backup_volume(backup_claim, backup_mount, source)
    resources: dict[str, str] = {}
    cpu_text = _check_quantity("cpu", cpu, source)
    memory_text = _check_quantity("memory", memory, source)
    if cpu_text is not None:
        resources["cpu"] = cpu_text
    if memory_text is not None:
        resources["memory"] = memory_text

    def replica_spec(count: int) -> dict[str, Any]:
        container: dict[str, Any] = {
            "name": _TFJOB_CONTAINER,
            "image": image,
            "command": list(command_words),
        }
        if arg_words:
            container["args"] = list(arg_words)
        # Read by tfdist's preemption handling: it logs a save that overran.
        container["env"] = [{"name": "TFDIST_GRACE", "value": str(grace)}]
        if resources:
            container["resources"] = {"requests": dict(resources), "limits": dict(resources)}
        pod: dict[str, Any] = {"terminationGracePeriodSeconds": grace}
        if backup_claim is not None:
            container["volumeMounts"] = [{"name": _BACKUP_VOLUME, "mountPath": backup_mount}]
            pod["volumes"] = [{"name": _BACKUP_VOLUME,
                               "persistentVolumeClaim": {"claimName": backup_claim}}]
        pod["containers"] = [container]
        return {
            "replicas": count,
            "restartPolicy": restart_policy,
            "template": {"spec": pod},
        }

    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": _TFJOB_API_VERSION,
        "kind": "TFJob",
        "metadata": metadata,
        "spec": {
            "tfReplicaSpecs": {
                REPLICA_TYPES[task_type]: replica_spec(count)
                for task_type, count in counts.items()
            },
        },
    }


# --------------------------------------------------------------------------
# A small YAML emitter.
# --------------------------------------------------------------------------

# Plain (unquoted) strings: start with a letter, '_' or '/', so that no YAML
# 1.1 or 1.2 resolver reads a number, date, null or special float; ':' only
# between word characters; no space, '#', ',', quote or bracket anywhere.
_PLAIN_RE = re.compile(r"[A-Za-z_/][A-Za-z0-9_./@+=-]*(:[A-Za-z0-9_./@+=-]+)*")
# Words that YAML 1.1 (PyYAML, go-yaml v2 under kubectl) reads as bool/null.
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\0": "\\0", "\a": "\\a", "\b": "\\b", "\t": "\\t",
            "\n": "\\n", "\v": "\\v", "\f": "\\f", "\r": "\\r", "\x1b": "\\e"}


def _printable(code: int) -> bool:
    """Characters YAML allows unescaped in a double-quoted scalar (no line breaks)."""
    return (
        0x20 <= code <= 0x7E
        or (0xA0 <= code <= 0xD7FF and code not in (0x2028, 0x2029))
        or (0xE000 <= code <= 0xFFFD and code != 0xFEFF)
        or 0x10000 <= code <= 0x10FFFF
    )


def _quote(text: str) -> str:
    """A double-quoted YAML scalar; anything unusual is escaped."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif _printable(code):
            out.append(char)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        if "e" in text and "." not in text:  # YAML 1.1 floats need a '.'.
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    if isinstance(value, str):
        if _PLAIN_RE.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return _quote(value)
    raise TypeError(f"to_yaml: cannot write a {type(value).__name__}: {value!r}")


def _lines(value: Any, indent: int) -> list[str]:
    """Block-style lines of a non-empty mapping or list at ``indent``."""
    pad = " " * indent
    lines = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"to_yaml: mapping keys must be strings, not {key!r}")
            head = f"{pad}{_scalar(key)}:"
            if _is_block(item):
                lines.append(head)
                lines.extend(_lines(item, indent + 2))
            else:
                lines.append(f"{head} {_inline(item)}")
    else:
        for item in value:
            if _is_block(item):
                nested = _lines(item, indent + 2)
                lines.append(f"{pad}- {nested[0][indent + 2:]}")
                lines.extend(nested[1:])
            else:
                lines.append(f"{pad}- {_inline(item)}")
    return lines


def _is_block(value: Any) -> bool:
    return isinstance(value, (Mapping, list, tuple)) and len(value) > 0


def _inline(value: Any) -> str:
    """A scalar, or ``{}`` / ``[]`` for an empty mapping or list."""
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _scalar(value)


def to_yaml(value: Any) -> str:
    """Writes dicts, lists and scalars as block-style YAML.

    Deterministic (mapping keys keep their order) and readable by any YAML
    1.1 or 1.2 parser (PyYAML, ``kubectl``): strings that a parser could
    read as something else (``yes``, ``on``, ``null``, ``2222``,
    ``1e3``, ``--flag``, strings with ``: `` or ``#``...) are double-quoted,
    with escapes for control and non-printable characters.

    Args:
        value: A dict (string keys), list, tuple, str, int, float, bool or
            None, nested freely.

    Returns:
        The YAML document, ending with a newline.

    Raises:
        TypeError: A value of another type, or a non-string key.
    """
    if _is_block(value):
        return "\n".join(_lines(value, 0)) + "\n"
    return _inline(value) + "\n"
