""":func:`tfjob_manifest`: a Kubeflow ``TFJob`` (``kubeflow.org/v1``) for a cluster spec,
with one replica spec per job; print it with :func:`~tfdist.engines.yaml_text.to_yaml`.

The restart policy, the grace period before SIGKILL (the tasks save on the
preemption signal in it) and a shared backup volume are set and checked here.
No TensorFlow.
"""

from __future__ import annotations

import copy
import difflib
import math
import numbers
import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from tfdist import spec as spec_lib
from tfdist.errors import ClusterSpecError, ConfigError

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
_DNS1123_SUBDOMAIN_RE = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
#: The volume :func:`tfjob_manifest` mounts for ``backup_claim``, and where by default.
_BACKUP_VOLUME = "tfdist-backup"
DEFAULT_BACKUP_MOUNT = "/backup"
_DNS1035_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# A Kubernetes resource quantity: "2", "0.5", "500m", "4Gi", "1e3".
_QUANTITY_RE = re.compile(
    r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?"
)


def fail(field: str, value: Any, expected: str, source: str, hint: str | None = None) -> NoReturn:
    """Raises the ConfigError of ``field``."""
    raise ConfigError(field, value, expected, source=source, hint=hint)


def command_word(value: Any, field: str, source: str) -> str:
    """A command-line word: a string, a path or a number (not a bool)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        fail(field, value, "a string (or a path or number)", source)
    return value


# --------------------------------------------------------------------------
# Kubeflow TFJob.
# --------------------------------------------------------------------------


def _is_counts(value: Any) -> bool:
    """Whether ``value`` is a replica-count mapping such as ``{"worker": 2}``."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(key, str) and key in spec_lib.TASK_TYPES for key in value)
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
                fail(f"counts.{task_type}", count, "a non-negative integer", source)
            counts[task_type] = int(count)
    else:
        config = spec_lib.parse(spec_or_counts, require_task=False)
        if not config.cluster:
            raise ClusterSpecError(
                "cluster", {}, "a cluster with at least one chief or worker", source=config.source
            )
        counts = {job: len(addresses) for job, addresses in config.cluster.items()}
        if config.task_type == "evaluator":
            counts["evaluator"] = 1
    counts = {t: counts[t] for t in spec_lib.TASK_TYPES if counts.get(t)}

    for task_type in ("chief", "evaluator"):
        if counts.get(task_type, 0) > 1:
            fail(
                f"counts.{task_type}",
                counts[task_type],
                f"at most one {task_type} (TensorFlow has a single {task_type})",
                source,
            )
    if not counts.get("chief") and not counts.get("worker"):
        fail(
            "counts",
            dict(spec_or_counts) if isinstance(spec_or_counts, Mapping) else counts,
            "at least one chief or worker",
            source,
        )
    if counts.get("ps"):
        if not counts.get("chief"):
            fail("counts.chief", 0, "1 when there are parameter servers (the coordinator)", source)
        if not counts.get("worker"):
            fail("counts.worker", 0, "at least 1 when there are parameter servers", source)
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
        fail("name", name, expected, source)
    if len(name) > _MAX_NAME or not _DNS1035_RE.fullmatch(name):
        fail("name", name, expected, source, hint=_dns_hint(name, letter_first=True))
    # The operator names each replica's pod and Service NAME-TYPE-INDEX.
    longest = max((f"{name}-{t}-{c - 1}" for t, c in counts.items()), key=len)
    if len(longest) > _MAX_NAME:
        fail(
            "name",
            name,
            f"a name short enough for the Service names the operator derives from it "
            f"(at most {_MAX_NAME} characters, e.g. {longest!r} has {len(longest)})",
            source,
            hint=f"Use at most {_MAX_NAME - (len(longest) - len(name))} characters.",
        )
    return name


def _check_quantity(field: str, value: Any, source: str) -> str | None:
    if value is None:
        return None
    expected = "a positive Kubernetes quantity such as '2', '500m' (CPU) or '4Gi' (memory)"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            fail(field, value, expected, source)
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        fail(field, value, expected, source)
    match = _QUANTITY_RE.fullmatch(text)
    if match is None or float(match.group(1)) == 0:
        fail(field, value, expected, source)
    return text


def _check_command(field: str, value: Any, source: str, *, allow_empty: bool) -> list[str]:
    expected = "a list of strings, e.g. ['python', 'train.py']"
    if isinstance(value, str):
        try:
            hint = f"Split it into words: {shlex.split(value)!r}."
        except ValueError:
            hint = None
        fail(field, value, expected, source, hint=hint)
    if isinstance(value, bytes):
        fail(field, value, expected, source)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        fail(field, value, expected, source)
    words = [command_word(word, f"{field}[{i}]", source) for i, word in enumerate(value)]
    if not words and not allow_empty:
        fail(field, [], expected + " (not empty)", source)
    return words


def _check_grace(value: Any, source: str) -> int:
    """``terminationGracePeriodSeconds``: whole seconds, at least 1.

    Kubernetes takes an integer; 0 would mean SIGKILL at once, with no time
    to save a backup.
    """
    expected = "whole seconds >= 1 from SIGTERM to SIGKILL (terminationGracePeriodSeconds), e.g. 60"
    received = value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())  # From the command line.
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not 1 <= value <= _MAX_INT64
    ):
        value = received
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        hint = None
        if (
            isinstance(number, numbers.Real)
            and not isinstance(number, bool)
            and math.isfinite(number)
            and number >= 1
        ):
            hint = f"Kubernetes takes whole seconds: use {math.ceil(number)}."
        fail("grace", value, expected, source, hint=hint)
    return int(value)


def _check_backup_volume(claim: Any, mount: Any, source: str) -> str | None:
    """Checks the backup claim and mount path; returns the mount path."""
    if claim is None:
        if mount is not None:
            fail(
                "backup_mount",
                mount,
                "None when there is no backup_claim",
                source,
                hint="Name the PersistentVolumeClaim to mount with backup_claim (--backup-claim).",
            )
        return None
    if not isinstance(claim, str) or len(claim) > 253 or not _DNS1123_SUBDOMAIN_RE.fullmatch(claim):
        fail(
            "backup_claim",
            claim,
            "None or the name of a PersistentVolumeClaim: lowercase letters, digits, "
            "'-' and '.', starting and ending with a letter or digit",
            source,
            hint=_dns_hint(claim, letter_first=False) if isinstance(claim, str) else None,
        )
    mount = DEFAULT_BACKUP_MOUNT if mount is None else mount
    if (
        not isinstance(mount, str)
        or not mount.startswith("/")
        or ":" in mount
        or any(c.isspace() for c in mount)
    ):
        fail(
            "backup_mount",
            mount,
            "an absolute path in the container, without ':' or spaces, e.g. '/backup'",
            source,
        )
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
    _check_image(image, source)
    container: dict[str, Any] = {
        "name": _TFJOB_CONTAINER,
        "image": image,
        "command": list(_check_command("command", command, source, allow_empty=False)),
    }
    arg_words = _check_command("args", args, source, allow_empty=True)
    if arg_words:
        container["args"] = list(arg_words)
    _check_namespace(namespace, source)
    _check_restart_policy(restart_policy, source)
    grace = _check_grace(grace, source)
    backup_mount = _check_backup_volume(backup_claim, backup_mount, source)
    # Read by tfdist's preemption handling: it logs a save that overran.
    container["env"] = [{"name": "TFDIST_GRACE", "value": str(grace)}]
    resources = _resources(cpu, memory, source)
    if resources:
        container["resources"] = {"requests": dict(resources), "limits": dict(resources)}
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": grace}
    if backup_claim is not None:
        container["volumeMounts"] = [{"name": _BACKUP_VOLUME, "mountPath": backup_mount}]
        pod["volumes"] = [
            {"name": _BACKUP_VOLUME, "persistentVolumeClaim": {"claimName": backup_claim}}
        ]
    pod["containers"] = [container]
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    replica_specs = {
        REPLICA_TYPES[task_type]: {
            "replicas": count,
            "restartPolicy": restart_policy,
            "template": {"spec": copy.deepcopy(pod)},
        }
        for task_type, count in counts.items()
    }
    return {
        "apiVersion": _TFJOB_API_VERSION,
        "kind": "TFJob",
        "metadata": metadata,
        "spec": {"tfReplicaSpecs": replica_specs},
    }


def _check_image(image: object, source: str) -> None:
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        fail(
            "image",
            image,
            "a non-empty container image reference without spaces, "
            "e.g. 'registry.example.com/train:1'",
            source,
        )


def _check_namespace(namespace: object, source: str) -> None:
    if namespace is not None and (
        not isinstance(namespace, str)
        or len(namespace) > _MAX_NAME
        or not _DNS1123_RE.fullmatch(namespace)
    ):
        fail(
            "namespace",
            namespace,
            "None or a DNS-1123 label: at most 63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit",
            source,
            hint=_dns_hint(namespace, letter_first=False) if isinstance(namespace, str) else None,
        )


def _check_restart_policy(restart_policy: object, source: str) -> None:
    if restart_policy not in RESTART_POLICIES:
        hint = None
        if isinstance(restart_policy, str):
            lowered = {policy.lower(): policy for policy in RESTART_POLICIES}
            close = difflib.get_close_matches(restart_policy.lower(), list(lowered), n=1)
            hint = f"Did you mean {lowered[close[0]]!r}?" if close else None
        fail(
            "restart_policy",
            restart_policy,
            "one of " + ", ".join(repr(p) for p in RESTART_POLICIES),
            source,
            hint=hint,
        )


def _resources(cpu: object, memory: object, source: str) -> dict[str, str]:
    """Each pod's requests (and limits): the CPU and memory given."""
    resources: dict[str, str] = {}
    cpu_text = _check_quantity("cpu", cpu, source)
    memory_text = _check_quantity("memory", memory, source)
    if cpu_text is not None:
        resources["cpu"] = cpu_text
    if memory_text is not None:
        resources["memory"] = memory_text
    return resources
