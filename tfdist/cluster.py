"""Parse, validate and generate ``TF_CONFIG`` without TensorFlow.

TensorFlow reads the ``TF_CONFIG`` environment variable to learn the cluster
(job name -> list of ``host:port`` addresses) and which task the current
process is. It accepts many broken values silently, then hangs or fails with
a cryptic message much later (a string ``"index": "1"`` is accepted, a
duplicated address hangs, a parameter-server cluster without a chief waits
forever...). This module checks a ``TF_CONFIG`` up front and raises a
:class:`~tfdist.errors.ClusterSpecError` naming the offending field, what was
expected and what was received.

Typical use::

    from tfdist import cluster

    config = cluster.parse()                       # reads $TF_CONFIG
    config = cluster.parse("two_workers", require_task=False)   # a spec file
    env = {"TF_CONFIG": json.dumps(cluster.tf_config_for_task(
        "two_workers", "worker", 1))}

This module must stay importable without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import numbers
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from tfdist.errors import ClusterSpecError

__all__ = [
    "TASK_TYPES",
    "CLUSTER_JOBS",
    "KINDS",
    "STRATEGIES",
    "SPEC_DIR_ENV",
    "DEFAULT_SPEC_DIR",
    "TFConfig",
    "parse",
    "validate",
    "tf_config_for_task",
    "all_task_configs",
    "spec_from_hosts",
    "parse_task",
    "parse_address",
    "is_cluster_resolver",
    "RESOLVER_SOURCE",
]

#: Task types TensorFlow knows, in the order tasks are listed.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
#: Jobs allowed inside ``cluster`` (the evaluator runs outside the cluster).
CLUSTER_JOBS = ("chief", "worker", "ps")
#: Values of :attr:`TFConfig.kind`.
KINDS = ("local", "multi_worker", "parameter_server")
#: Strategy names accepted by ``strategy=`` (see :func:`validate`).
STRATEGIES = (
    "multi_worker_mirrored",
    "parameter_server",
    "mirrored",
    "one_device",
    "default",
    "tpu",
)
_SINGLE_MACHINE_STRATEGIES = ("mirrored", "one_device", "default", "tpu")

_TOP_LEVEL_KEYS = ("cluster", "task", "rpc_layer", "environment")
# Set by Google Cloud AI Platform / Vertex AI next to the TensorFlow keys;
# accepted and ignored so that a TF_CONFIG written by the platform parses.
_IGNORED_TOP_LEVEL_KEYS = ("job",)
_TASK_KEYS = ("type", "index")
_IGNORED_TASK_KEYS = ("trial", "cloud")
_RPC_LAYERS = ("grpc",)
#: ``TFConfig.source`` of a config read from a ``ClusterResolver``.
RESOLVER_SOURCE = "<ClusterResolver>"

#: Environment variable overriding the directory of named cluster specs.
SPEC_DIR_ENV = "TFDIST_SPEC_DIR"
#: The repository's ``cluster_specs/`` directory (next to the package).
DEFAULT_SPEC_DIR = Path(__file__).resolve().parent.parent / "cluster_specs"

_ADDRESS_EXPECTED = "a 'host:port' address with a non-empty host and an integer port in 1..65535"
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_TASK_RE = re.compile(r"\s*([A-Za-z_]+)\s*:\s*(-?[0-9]+)\s*")
_TASK_EXAMPLE = '{"type": "worker", "index": 0}'


def _short(text: Any, limit: int = 60) -> str:
    """Shortens a value embedded in a hint."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quoted(names: Iterable[str]) -> str:
    """``('a', 'b')`` -> ``"'a', 'b'"``."""
    return ", ".join(f"'{name}'" for name in names)


def _did_you_mean(word: Any, choices: Sequence[str]) -> str | None:
    """A "Did you mean ...?" hint for a likely typo, or None."""
    if not isinstance(word, str):
        return None
    if word.lower() == "master":  # TF1 / AI Platform name of the chief.
        return "'master' is the TF1 name of the chief; use 'chief'."
    lowered = {choice.lower(): choice for choice in choices}
    matches = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f"Did you mean '{lowered[matches[0]]}'?" if matches else None


# --------------------------------------------------------------------------
# The parsed configuration.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """A validated ``TF_CONFIG``.

    Build one with :func:`parse`; a hand-built instance is not checked until
    it goes through :func:`validate`.

    Attributes:
        cluster: Job name -> task addresses (``"host:port"``), jobs in the
            order chief, worker, ps. ``{}`` when there is no cluster.
        task_type: This process's task type, or None when not set.
        task_index: This process's index within its job, or None.
        rpc_layer: ``"grpc"`` or None.
        environment: The ``environment`` field (e.g. ``"cloud"``) or None.
        source: Where the config came from, used in error messages:
            ``"TF_CONFIG"``, a file path, ``"<string>"`` or ``"<dict>"``.
    """

    cluster: dict[str, tuple[str, ...]] = dataclasses.field(hash=False)
    task_type: str | None
    task_index: int | None
    rpc_layer: str | None = None
    environment: str | None = None
    source: str = "<dict>"

    def __post_init__(self) -> None:
        # Store address lists as tuples so that a hand-built config compares
        # equal to the parsed one; anything odd is left for validate().
        if isinstance(self.cluster, Mapping):
            cluster = {
                job: tuple(addresses) if isinstance(addresses, (list, tuple)) else addresses
                for job, addresses in self.cluster.items()
            }
            object.__setattr__(self, "cluster", cluster)

    @property
    def num_workers(self) -> int:
        """Number of training workers: the chief plus the workers."""
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def num_tasks(self) -> int:
        """Number of tasks in the cluster (an evaluator is not in it)."""
        return sum(len(addresses) for addresses in self.cluster.values())

    @property
    def kind(self) -> str:
        """``"local"``, ``"multi_worker"`` or ``"parameter_server"``.

        ``"local"`` when there is no cluster or it holds a single task (and
        no ps); ``"parameter_server"`` when there is a ``ps`` job; else
        ``"multi_worker"``.
        """
        if not self.cluster:
            return "local"
        if "ps" in self.cluster:
            return "parameter_server"
        if self.num_tasks == 1:
            return "local"
        return "multi_worker"

    @property
    def task_id(self) -> str | None:
        """The task as ``"type:index"`` (e.g. ``"worker:1"``), or None."""
        if self.task_type is None or self.task_index is None:
            return None
        return f"{self.task_type}:{self.task_index}"

    @property
    def task_address(self) -> str | None:
        """This task's ``host:port``; None without a task or for the evaluator."""
        if self.task_type is None or self.task_index is None:
            return None
        addresses = self.cluster.get(self.task_type, ())
        if 0 <= self.task_index < len(addresses):
            return addresses[self.task_index]
        return None

    @property
    def is_chief(self) -> bool:
        """Whether this task does the chief's work (saving, logging).

        True for the chief, for worker 0 when there is no chief job, and for
        a local config without a task.
        """
        if self.task_type is None:
            return self.kind == "local"
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and "chief" not in self.cluster

    def tasks(self) -> list[tuple[str, int, str]]:
        """Lists the cluster's tasks as ``(type, index, address)``.

        Returns:
            One tuple per task, in the order chief, worker, ps.
        """
        return [
            (job, index, address)
            for job in CLUSTER_JOBS
            for index, address in enumerate(self.cluster.get(job, ()))
        ]

    def to_dict(self) -> dict[str, Any]:
        """Returns the ``TF_CONFIG`` as a JSON-ready dict.

        ``task`` is left out when :attr:`task_type` is None, ``rpc_layer``
        and ``environment`` when unset.
        """
        data: dict[str, Any] = {
            "cluster": {job: list(addresses) for job, addresses in self.cluster.items()}
        }
        if self.task_type is not None:
            data["task"] = {"type": self.task_type, "index": self.task_index}
        if self.rpc_layer is not None:
            data["rpc_layer"] = self.rpc_layer
        if self.environment is not None:
            data["environment"] = self.environment
        return data

    def to_json(self, indent: int | None = None) -> str:
        """Returns the ``TF_CONFIG`` JSON string (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent)

    def with_task(self, task_type: str | None, task_index: int | None) -> "TFConfig":
        """Returns a validated copy for another task of the same cluster.

        Args:
            task_type: ``"chief"``, ``"worker"``, ``"ps"`` or ``"evaluator"``
                (None removes the task).
            task_index: Index of the task within its job.

        Raises:
            ClusterSpecError: The task is not in the cluster.
        """
        config = dataclasses.replace(self, task_type=task_type, task_index=task_index)
        return validate(config, require_task=task_type is not None)


# --------------------------------------------------------------------------
# Addresses.
# --------------------------------------------------------------------------


class _BadAddress(Exception):
    """Internal: why an address is wrong (turned into a ClusterSpecError)."""

    def __init__(self, hint: str | None = None, expected: str = _ADDRESS_EXPECTED) -> None:
        super().__init__(hint)
        self.hint = hint
        self.expected = expected


def _check_host(host: str) -> None:
    """Raises _BadAddress unless ``host`` is a plausible host name or IPv4."""
    if not host:
        raise _BadAddress("Add the host before the port, e.g. 'localhost:2222'.")
    if "://" in host:
        raise _BadAddress(
            "Remove the scheme (e.g. 'grpc://'): cluster addresses are plain host:port; "
            "set \"rpc_layer\": \"grpc\" instead."
        )
    if not _HOST_RE.fullmatch(host):
        raise _BadAddress(
            f"The host {_short(repr(host))} is not a valid name or IP address "
            "(letters, digits, '.', '-' and '_' only)."
        )


def _check_ipv6(host: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise _BadAddress(f"{_short(repr(host))} in brackets is not an IPv6 address.") from None


def _split_address(addr: Any) -> tuple[str, int]:
    """Splits ``"host:port"`` / ``"[v6]:port"`` or raises _BadAddress."""
    if not isinstance(addr, str):
        raise _BadAddress(
            'Write the address as a quoted string with a host, e.g. "localhost:2222".',
            expected=_ADDRESS_EXPECTED + " as a string",
        )
    if addr != addr.strip() or any(char.isspace() for char in addr):
        raise _BadAddress("Remove the spaces.")
    if "://" in addr:
        _check_host(addr)  # Raises the scheme hint.
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0:
            raise _BadAddress("Close the bracket of the IPv6 address, e.g. '[::1]:2222'.")
        host, rest = addr[1:end], addr[end + 1 :]
        _check_ipv6(host)
        if not rest.startswith(":"):
            raise _BadAddress(f"Add a port after the bracket, e.g. '[{_short(host)}]:2222'.")
        port_text = rest[1:]
    else:
        host, sep, port_text = addr.rpartition(":")
        if not sep:
            raise _BadAddress(f"Add a port, e.g. '{_short(addr)}:2222'.")
        if ":" in host:
            raise _BadAddress("Write IPv6 addresses in brackets, e.g. '[::1]:2222'.")
        _check_host(host)
    if not port_text:
        raise _BadAddress("Add the port after the colon, e.g. 'localhost:2222'.")
    if not (port_text.isascii() and port_text.isdigit()):
        raise _BadAddress(f"The port {_short(repr(port_text))} is not a number.")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _BadAddress(f"Port {port} is out of range; use one in 1..65535 (e.g. 2222).")
    return host, port


def _format_address(host: str, port: int) -> str:
    """Joins host and port, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(addr: str) -> tuple[str, int]:
    """Splits a ``"host:port"`` address.

    Args:
        addr: ``"host:port"``; IPv6 hosts go in brackets (``"[::1]:2222"``).

    Returns:
        ``(host, port)``; an IPv6 host is returned without brackets.

    Raises:
        ClusterSpecError: ``field='address'`` for a malformed address.
    """
    try:
        return _split_address(addr)
    except _BadAddress as bad:
        raise ClusterSpecError(
            "address", addr, bad.expected, source="parse_address()", hint=bad.hint
        ) from None


def parse_task(text: str) -> tuple[str, int]:
    """Parses a task written ``"type:index"``.

    Args:
        text: E.g. ``"worker:1"`` or ``"chief:0"``.

    Returns:
        ``(task_type, task_index)``, e.g. ``("worker", 1)``.

    Raises:
        ClusterSpecError: ``field='task'`` for malformed text or an unknown
            type.
    """
    expected = (
        f"'TYPE:INDEX' with TYPE one of {_quoted(TASK_TYPES)} and INDEX a "
        "non-negative integer, e.g. 'worker:1'"
    )
    match = _TASK_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ClusterSpecError("task", text, expected, source="parse_task()")
    task_type, index = match.group(1), int(match.group(2))
    if task_type not in TASK_TYPES:
        raise ClusterSpecError(
            "task", text, expected, source="parse_task()",
            hint=_did_you_mean(task_type, TASK_TYPES),
        )
    if index < 0:
        raise ClusterSpecError(
            "task", text, expected, source="parse_task()", hint="Task indices start at 0."
        )
    return task_type, index


# --------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------


def _normalize_strategy(strategy: Any, source: str) -> str | None:
    """Maps ``strategy`` to a name in STRATEGIES, or None for None / ``'auto'``.

    Also accepts TF class names such as ``'MultiWorkerMirroredStrategy'``.
    """
    if strategy is None:
        return None
    if isinstance(strategy, str):
        key = strategy.strip().lower().replace("-", "").replace("_", "")
        key = key.removesuffix("strategy")
        if key == "auto":  # Same as None: infer from the cluster.
            return None
        for name in STRATEGIES:
            if name.replace("_", "") == key:
                return name
    raise ClusterSpecError(
        "strategy", strategy, f"None or one of {_quoted(STRATEGIES)}", source=source,
        hint=_did_you_mean(strategy, STRATEGIES),
    )


class _Validator:
    """Checks raw TF_CONFIG data (parsed JSON) and builds a TFConfig."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(
        self,
        field: str,
        value: Any,
        expected: str,
        *,
        hint: str | None = None,
        received: str | None = None,
    ) -> NoReturn:
        raise ClusterSpecError(
            field, value, expected, source=self.source, hint=hint, received=received
        )

    def run(self, data: Any, *, require_task: bool, strategy: Any) -> TFConfig:
        strategy = _normalize_strategy(strategy, self.source)
        if not isinstance(data, Mapping):
            self.fail(
                "<root>", data, f'a JSON object like {{"cluster": {{...}}, "task": {_TASK_EXAMPLE}}}',
                received="null" if data is None else None,
            )
        self._check_top_level_keys(data)
        cluster = self._check_cluster(data)
        self._check_strategy(data, cluster, strategy)
        task_type, task_index = self._check_task(data, cluster, require_task)
        rpc_layer, environment = self._check_extras(data)
        return TFConfig(
            cluster=cluster,
            task_type=task_type,
            task_index=task_index,
            rpc_layer=rpc_layer,
            environment=environment,
            source=self.source,
        )

    def _check_top_level_keys(self, data: Mapping) -> None:
        for key in data:
            if key in _TOP_LEVEL_KEYS or key in _IGNORED_TOP_LEVEL_KEYS:
                continue
            self.fail(
                str(key), key, f"only the top-level keys {_quoted(_TOP_LEVEL_KEYS)}",
                hint=_did_you_mean(key, _TOP_LEVEL_KEYS),
            )

    def _check_cluster(self, data: Mapping) -> dict[str, tuple[str, ...]]:
        if "cluster" not in data:
            if "task" in data:
                self.fail(
                    "cluster", None, "a 'cluster' object because 'task' is set",
                    received="no 'cluster' key",
                    hint="Without a cluster TensorFlow silently ignores 'task' and trains "
                    "locally; add the cluster's jobs.",
                )
            return {}
        raw = data["cluster"]
        if not isinstance(raw, Mapping):
            self.fail(
                "cluster", raw,
                "a JSON object mapping job names ('chief', 'worker', 'ps') to lists of "
                "'host:port' addresses",
            )
        if not raw and "task" in data:
            self.fail(
                "cluster", raw, "a non-empty 'cluster' because 'task' is set",
                hint="With an empty cluster TensorFlow silently ignores 'task' and trains "
                "locally; add the cluster's jobs.",
            )
        for name in raw:
            if name == "evaluator":
                self.fail(
                    "cluster.evaluator", raw[name],
                    "no 'evaluator' job in 'cluster' (the evaluator runs outside the "
                    "training cluster)",
                    hint="Remove 'evaluator' from 'cluster' and give the evaluator process "
                    '"task": {"type": "evaluator", "index": 0}.',
                )
            if name not in CLUSTER_JOBS:
                self.fail(
                    f"cluster.{name}", name, f"a job name among {_quoted(CLUSTER_JOBS)}",
                    hint=_did_you_mean(name, CLUSTER_JOBS),
                )

        cluster: dict[str, tuple[str, ...]] = {}
        seen: dict[tuple[str, int], str] = {}  # (host, port) -> field using it
        jobs_expected = "a non-empty list of 'host:port' addresses"
        for job, addresses in raw.items():
            field = f"cluster.{job}"
            if isinstance(addresses, Mapping):
                self.fail(
                    field, addresses, jobs_expected,
                    hint="Sparse jobs ({index: address}) are not supported; list every "
                    "task's address, in index order.",
                )
            if isinstance(addresses, str):
                self.fail(
                    field, addresses, jobs_expected,
                    hint='Put the address in a list, e.g. ["localhost:2222"].',
                )
            if not isinstance(addresses, (list, tuple)):
                self.fail(field, addresses, jobs_expected)
            if not addresses:
                self.fail(
                    field, addresses, jobs_expected,
                    hint=f"Remove the '{job}' job or give it at least one address.",
                )
            for index, address in enumerate(addresses):
                item = f"{field}[{index}]"
                try:
                    host, port = _split_address(address)
                except _BadAddress as bad:
                    self.fail(item, address, bad.expected, hint=bad.hint)
                key = (host.lower(), port)
                if key in seen:
                    self.fail(
                        item, address,
                        f"an address used by a single task (it is also '{seen[key]}')",
                        hint="TensorFlow hangs when two tasks share a host:port; give each "
                        "task its own port.",
                    )
                seen[key] = item
            cluster[job] = tuple(addresses)
        cluster = {job: cluster[job] for job in CLUSTER_JOBS if job in cluster}

        if len(cluster.get("chief", ())) > 1:
            self.fail(
                "cluster.chief", list(cluster["chief"]), "exactly one 'chief' address",
                hint="Keep one chief and move the other addresses to the 'worker' job.",
            )
        if "ps" in cluster and "worker" not in cluster and "chief" not in cluster:
            self.fail(
                "cluster.ps", dict(raw),
                "a 'ps' job only together with 'chief' and 'worker' jobs",
                hint="Parameter servers only hold variables; add a 'chief' and at least "
                "one 'worker' to train.",
            )
        return cluster

    def _check_strategy(
        self, data: Mapping, cluster: dict[str, tuple[str, ...]], strategy: str | None
    ) -> None:
        jobs = f"jobs {list(cluster)}" if cluster else "no cluster"
        if strategy == "multi_worker_mirrored" and "ps" in cluster:
            self.fail(
                "cluster.ps", list(cluster["ps"]),
                "no 'ps' job: a multi_worker_mirrored cluster cannot have a 'ps' job",
                hint="TensorFlow would hang. Use strategy='parameter_server' to train "
                "with parameter servers, or remove the 'ps' job.",
            )
        if strategy == "parameter_server" or (strategy is None and "ps" in cluster):
            if not cluster:
                self.fail(
                    "cluster", data.get("cluster"),
                    "a cluster with 'chief', 'worker' and 'ps' jobs for "
                    "strategy='parameter_server'",
                    received=jobs,
                    hint="Set TF_CONFIG (see `tfdist tf-config SPEC --task worker:0`), or "
                    "use strategy='mirrored' on one machine.",
                )
            if "ps" not in cluster:
                self.fail(
                    "cluster.ps", None,
                    "a 'ps' job: strategy='parameter_server' needs at least one "
                    "parameter server",
                    received=jobs,
                    hint="Add a 'ps' job, or use strategy='multi_worker_mirrored'.",
                )
            if "worker" not in cluster:
                self.fail(
                    "cluster.worker", None,
                    "at least one 'worker' for parameter-server training", received=jobs,
                )
            # The caller that hands TensorFlow's strategy a resolver is the
            # coordinator, as in TF's tutorial (a resolver of workers and ps,
            # no chief). From TF_CONFIG no process would be the coordinator.
            if "chief" not in cluster and self.source != RESOLVER_SOURCE:
                self.fail(
                    "cluster.chief", None,
                    "exactly one 'chief' (the coordinator of parameter-server training)",
                    received=jobs,
                    hint="Without a chief the workers and ps wait forever; add "
                    '"chief": ["host:port"].',
                )
        num_tasks = sum(len(addresses) for addresses in cluster.values())
        if strategy in _SINGLE_MACHINE_STRATEGIES and num_tasks > 1:
            self.fail(
                "cluster", data.get("cluster"),
                f"at most one task for strategy='{strategy}', which runs on one machine",
                hint="Use strategy='multi_worker_mirrored' for a multi-worker cluster "
                "(or 'parameter_server' with a 'ps' job), or unset TF_CONFIG.",
            )

    def _check_task(
        self, data: Mapping, cluster: dict[str, tuple[str, ...]], require_task: bool
    ) -> tuple[str | None, int | None]:
        num_tasks = sum(len(addresses) for addresses in cluster.values())
        if "task" not in data:
            if require_task and num_tasks > 1:
                self.fail(
                    "task", None,
                    f"a 'task' saying which task this process is, e.g. {_TASK_EXAMPLE}",
                    received="no 'task' key",
                    hint=f"A cluster of {num_tasks} tasks needs a 'task' in each process's "
                    "TF_CONFIG (TensorFlow fails with 'No such job in cluster: None'); "
                    "generate them with `tfdist tf-config SPEC --task worker:0`.",
                )
            return None, None

        task = data["task"]
        if not isinstance(task, Mapping):
            self.fail("task", task, f"a JSON object like {_TASK_EXAMPLE}")
        for key in task:
            if key not in _TASK_KEYS and key not in _IGNORED_TASK_KEYS:
                self.fail(
                    f"task.{key}", key, "only the keys 'type' and 'index' in 'task'",
                    hint=_did_you_mean(key, _TASK_KEYS),
                )

        if "type" not in task:
            self.fail(
                "task.type", dict(task),
                f"a 'type' in 'task', one of {_quoted(TASK_TYPES)}",
            )
        task_type = task["type"]
        if not isinstance(task_type, str) or task_type not in TASK_TYPES:
            self.fail(
                "task.type", task_type, f"one of {_quoted(TASK_TYPES)}",
                hint=_did_you_mean(task_type, TASK_TYPES),
            )
        if task_type == "evaluator":
            if "chief" not in cluster and "worker" not in cluster:
                self.fail(
                    "task.type", task_type,
                    "a task in the cluster; an 'evaluator' needs a cluster with a 'chief' "
                    "or 'worker' job to evaluate",
                )
        elif task_type not in cluster:
            jobs = _quoted(cluster) if cluster else "none"
            self.fail(
                "task.type", task_type,
                f"a job of the cluster (jobs: {jobs}) or 'evaluator'",
                hint=f"Add a '{task_type}' job to 'cluster' or fix 'task.type'.",
            )

        if "index" not in task:
            self.fail("task.index", dict(task), "an 'index' in 'task' (an integer from 0)")
        index = task["index"]
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            hint = None
            if isinstance(index, str) and index.strip().lstrip("-").isdigit():
                hint = f'Write the index as a number: "index": {_short(index.strip())}, not "{_short(index)}".'
            self.fail(
                "task.index", index, "an integer (the task's position in its job, from 0)",
                hint=hint,
            )
        index = int(index)
        if task_type == "evaluator":
            if index != 0:
                self.fail(
                    "task.index", index, "0 for the evaluator (there is only one)",
                )
        else:
            size = len(cluster[task_type])
            if not 0 <= index < size:
                plural = "task" if size == 1 else "tasks"
                self.fail(
                    "task.index", index,
                    f"an integer in [0, {size - 1}] (the '{task_type}' job has "
                    f"{size} {plural})",
                    hint="Task indices start at 0." if index < 0 else None,
                )
        return task_type, index

    def _check_extras(self, data: Mapping) -> tuple[str | None, str | None]:
        rpc_layer = data.get("rpc_layer")
        if rpc_layer is not None and (not isinstance(rpc_layer, str) or rpc_layer not in _RPC_LAYERS):
            self.fail(
                "rpc_layer", rpc_layer, f"one of {_quoted(_RPC_LAYERS)} (or no 'rpc_layer')",
                hint="TensorFlow 2 only ships the 'grpc' RPC layer.",
            )
        environment = data.get("environment")
        if environment is not None and not isinstance(environment, str):
            self.fail("environment", environment, "a string, e.g. 'cloud'")
        return rpc_layer, environment


def validate(
    config: TFConfig, *, require_task: bool = True, strategy: str | None = None
) -> TFConfig:
    """Checks a :class:`TFConfig` (e.g. one built by hand).

    Args:
        config: The config to check.
        require_task: Whether a cluster of more than one task needs a task
            (True for a process's TF_CONFIG, False for a spec file).
        strategy: None (or ``'auto'``) to infer from the cluster, or one of
            :data:`STRATEGIES` to add that strategy's rules.

    Returns:
        A normalized copy (jobs ordered chief, worker, ps; tuples).

    Raises:
        ClusterSpecError: The config breaks a rule (see :func:`parse`).
    """
    if not isinstance(config, TFConfig):
        raise ClusterSpecError(
            "<root>", config, "a TFConfig", source="validate()",
            hint="Use tfdist.cluster.parse() for dicts, JSON strings and files.",
        )
    data: dict[str, Any] = {}
    cluster = config.cluster
    if isinstance(cluster, Mapping):
        cluster = {
            job: list(addresses) if isinstance(addresses, (list, tuple)) else addresses
            for job, addresses in cluster.items()
        }
    data["cluster"] = cluster
    if config.task_type is not None or config.task_index is not None:
        task: dict[str, Any] = {}
        if config.task_type is not None:
            task["type"] = config.task_type
        if config.task_index is not None:
            task["index"] = config.task_index
        data["task"] = task
    if config.rpc_layer is not None:
        data["rpc_layer"] = config.rpc_layer
    if config.environment is not None:
        data["environment"] = config.environment
    return _Validator(config.source).run(data, require_task=require_task, strategy=strategy)


# --------------------------------------------------------------------------
# Reading sources.
# --------------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook refusing duplicated keys (JSON keeps the last)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _json_hint(text: str, error: json.JSONDecodeError) -> str:
    """A hint for a JSON syntax error: likely cause and the offending line."""
    hints = []
    if "double quotes" in error.msg and "'" in text:
        hints.append(
            "JSON needs double quotes, not single quotes (is this a Python dict? "
            "use json.dumps())."
        )
    elif re.search(r",\s*[}\]]", text):
        hints.append("JSON does not allow a trailing comma before '}' or ']'.")
    lines = text.splitlines()
    if 0 < error.lineno <= len(lines):
        line = lines[error.lineno - 1].strip()
        if len(line) > 120:
            line = line[:117] + "..."
        hints.append(f"Line {error.lineno}: {line}")
    return " ".join(hints)


def _loads(text: str, source: str) -> Any:
    """json.loads that raises ClusterSpecError (field '<json>')."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ClusterSpecError(
            "<json>", text, "valid JSON", source=source,
            line=error.lineno, column=error.colno,
            received=f"{error.msg} at line {error.lineno}, column {error.colno}",
            hint=_json_hint(text, error),
        ) from None
    except _DuplicateKey as duplicate:
        raise ClusterSpecError(
            "<json>", duplicate.key, "unique keys in each JSON object", source=source,
            received=f"the key {duplicate.key!r} twice",
            hint="JSON silently keeps only the last one; merge them.",
        ) from None
    except RecursionError:
        raise ClusterSpecError(
            "<json>", None, "valid JSON", source=source, received="JSON nested too deeply"
        ) from None


def _spec_dir(environ: Mapping[str, str]) -> Path:
    override = environ.get(SPEC_DIR_ENV)
    return Path(override).expanduser() if override else DEFAULT_SPEC_DIR


def _display_path(path: Path) -> str:
    """The path relative to the current directory when below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _find_spec(source: str | os.PathLike, environ: Mapping[str, str]) -> Path:
    """Finds a spec file: the path as given, then in the spec directory."""
    given = Path(os.fsdecode(os.fspath(source))).expanduser()
    candidates = [given]
    if given.name and given.suffix != ".json":
        candidates.append(given.with_name(given.name + ".json"))
    spec_dir = _spec_dir(environ)
    if given.name and len(given.parts) == 1:  # A bare name such as 'two_workers'.
        candidates.append(spec_dir / given.name)
        if given.suffix != ".json":
            candidates.append(spec_dir / (given.name + ".json"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    try:
        available = sorted(p.stem for p in spec_dir.glob("*.json"))
    except OSError:
        available = []
    listing = ", ".join(available) if available else "none"
    raise ClusterSpecError(
        "path", os.fsdecode(os.fspath(source)),
        f"a JSON string, a JSON file, or the name of a spec in {spec_dir}",
        source=_display_path(given),
        hint=f"Searched: {', '.join(str(c) for c in candidates)}. Specs in {spec_dir} "
        f"(override with ${SPEC_DIR_ENV}): {listing}.",
    )


def _read_spec(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ClusterSpecError(
            "path", str(path), "a readable UTF-8 JSON file", source=_display_path(path),
            received=f"{str(path)!r} ({error})",
        ) from None


def parse(
    source: Any = None,
    *,
    env: Mapping[str, str] | None = None,
    require_task: bool = True,
    strategy: str | None = None,
) -> TFConfig:
    """Reads and validates a ``TF_CONFIG`` or cluster spec.

    Args:
        source: Where to read it from:

            * None: the ``TF_CONFIG`` environment variable (of ``env``);
              unset or blank means local training.
            * a dict (TF_CONFIG shape) or a :class:`TFConfig` (re-validated);
            * a JSON string (starting with ``{`` or ``[``, or ``null``); a
              blank string means local training;
            * a ``tf.distribute.cluster_resolver.ClusterResolver``, as
              TensorFlow's strategies take one. A parameter-server cluster
              from a resolver needs no chief and no task: the caller is the
              coordinator, as in TensorFlow's tutorial;
            * a path (``str`` or ``os.PathLike``) to a JSON file, or a bare
              name such as ``'two_workers'`` / ``'two_workers.json'`` looked
              up in the spec directory: ``$TFDIST_SPEC_DIR`` if set, else the
              repository's ``cluster_specs/``.
        env: Environment to read ``TF_CONFIG`` and ``TFDIST_SPEC_DIR`` from;
            defaults to ``os.environ``.
        require_task: True for a process's TF_CONFIG (a cluster of more than
            one task needs a ``task``); False for spec files, whose ``task``
            is optional (but checked when present).
        strategy: None (or ``'auto'``) to infer the rules from the cluster, or one of
            :data:`STRATEGIES` to add that strategy's rules: no ``ps`` job for
            ``'multi_worker_mirrored'``; a chief, workers and ps for
            ``'parameter_server'`` (also applied when a ``ps`` job is
            present); at most one task for ``'mirrored'``, ``'one_device'``,
            ``'default'`` and ``'tpu'``.

    Returns:
        The validated :class:`TFConfig`.

    Raises:
        ClusterSpecError: Any problem (bad JSON, missing file, a rule broken);
            its ``field`` names the offending field, e.g. ``'task.index'``.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if is_cluster_resolver(source):
        data = _resolver_data(source)
        # A parameter-server resolver is read by the coordinator, which need
        # not be one of the cluster's tasks.
        ps_job = "ps" in data.get("cluster", {})
        return _Validator(RESOLVER_SOURCE).run(
            data, require_task=require_task and not ps_job, strategy=strategy)
    if source is None:
        text = environ.get("TF_CONFIG")
        data = {} if text is None or not str(text).strip() else _loads(str(text), "TF_CONFIG")
        return _Validator("TF_CONFIG").run(data, require_task=require_task, strategy=strategy)
    if isinstance(source, TFConfig):
        return validate(source, require_task=require_task, strategy=strategy)
    if isinstance(source, Mapping):
        return _Validator("<dict>").run(source, require_task=require_task, strategy=strategy)
    if isinstance(source, str):
        stripped = source.strip()
        if not stripped or stripped[0] in "{[" or stripped == "null":
            data = _loads(source, "<string>") if stripped else {}
            return _Validator("<string>").run(data, require_task=require_task, strategy=strategy)
    if isinstance(source, (str, os.PathLike)):
        path = _find_spec(source, environ)
        data = _loads(_read_spec(path), _display_path(path))
        return _Validator(_display_path(path)).run(
            data, require_task=require_task, strategy=strategy
        )
    raise ClusterSpecError(
        "<root>", source,
        "a TF_CONFIG dict, a JSON string, a TFConfig, or the path of a JSON file",
        source="parse()",
    )


def is_cluster_resolver(obj: Any) -> bool:
    """Whether ``obj`` is a ``tf.distribute.cluster_resolver.ClusterResolver``.

    Read from the class names, so that TensorFlow need not be imported.
    """
    return any(cls.__name__ == "ClusterResolver" for cls in type(obj).__mro__)


def _resolver_data(resolver: Any) -> dict[str, Any]:
    """The TF_CONFIG-shaped data of a ClusterResolver."""
    data: dict[str, Any] = {"cluster": dict(resolver.cluster_spec().as_dict())}
    if resolver.task_type is not None:
        data["task"] = {"type": resolver.task_type, "index": resolver.task_id}
    rpc_layer = getattr(resolver, "rpc_layer", None)
    if rpc_layer:
        data["rpc_layer"] = rpc_layer
    return data


# --------------------------------------------------------------------------
# Generation.
# --------------------------------------------------------------------------


def tf_config_for_task(spec: Any, task_type: str, task_index: int) -> dict[str, Any]:
    """Returns the ``TF_CONFIG`` dict of one task of a cluster spec.

    Args:
        spec: Anything :func:`parse` accepts (read with ``require_task=False``),
            e.g. ``'two_workers'``.
        task_type: ``'chief'``, ``'worker'``, ``'ps'`` or ``'evaluator'``.
        task_index: Index of the task within its job.

    Returns:
        ``{"cluster": {...}, "task": {"type": ..., "index": ...}}`` (plus
        ``rpc_layer`` / ``environment`` when the spec sets them).

    Raises:
        ClusterSpecError: The spec is invalid or has no such task.
    """
    return parse(spec, require_task=False).with_task(task_type, task_index).to_dict()


def all_task_configs(spec: Any) -> list[tuple[str, int, dict[str, Any]]]:
    """Returns the ``TF_CONFIG`` of every task in a cluster spec.

    An evaluator is not in the cluster, so none is generated for it (use
    ``tf_config_for_task(spec, 'evaluator', 0)``).

    Args:
        spec: Anything :func:`parse` accepts (read with ``require_task=False``).

    Returns:
        ``(task_type, task_index, tf_config_dict)`` per task, in the order
        chief, worker, ps.
    """
    config = parse(spec, require_task=False)
    return [
        (task_type, index, config.with_task(task_type, index).to_dict())
        for task_type, index, _ in config.tasks()
    ]


def _split_host(entry: str) -> tuple[str, int | None]:
    """``"name"`` -> (name, None); ``"name:port"`` / ``"[v6]:port"`` -> (host, port)."""
    text = entry.strip()
    if text.startswith("[") and text.endswith("]"):
        host = text[1:-1]
        _check_ipv6(host)
        return host, None
    if ":" in text or text.startswith("["):
        return _split_address(text)
    _check_host(text)
    return text, None


def spec_from_hosts(
    hosts: Sequence[str], *, chief: bool = False, num_ps: int = 0, port: int = 2222
) -> dict[str, Any]:
    """Builds a cluster spec from a list of hosts.

    Roles are given in order: the first host is the chief if ``chief``, the
    next ``num_ps`` hosts are parameter servers, the rest are workers.

    Args:
        hosts: ``"name"`` or ``"name:port"`` entries (``"[::1]:2222"`` for
            IPv6). A host without a port gets ``port``; a name repeated
            without ports gets successive ports (``port``, ``port + 1``, ...)
            so ``['localhost'] * 4`` gives four local tasks.
        chief: Make the first host the chief.
        num_ps: Number of parameter servers (needs ``chief=True`` and at
            least one worker).
        port: Port for hosts given without one.

    Returns:
        ``{"cluster": {...}}`` with jobs in the order chief, worker, ps.

    Raises:
        ClusterSpecError: Bad hosts or arguments (fields ``'hosts'``,
            ``'hosts[i]'``, ``'chief'``, ``'num_ps'``, ``'port'``).
    """
    source = "spec_from_hosts()"

    def fail(field: str, value: Any, expected: str, hint: str | None = None) -> NoReturn:
        raise ClusterSpecError(field, value, expected, source=source, hint=hint)

    hosts_expected = "a list of 'host' or 'host:port' strings"
    if isinstance(hosts, (str, bytes, Mapping)):
        fail("hosts", hosts, hosts_expected, hint='Wrap a single host in a list: ["host"].')
    try:
        entries = list(hosts)
    except TypeError:
        fail("hosts", hosts, hosts_expected)
    if not isinstance(chief, bool):
        fail("chief", chief, "True or False")
    if isinstance(num_ps, bool) or not isinstance(num_ps, numbers.Integral) or num_ps < 0:
        fail("num_ps", num_ps, "a non-negative integer")
    if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 1 <= port <= 65535:
        fail("port", port, "an integer port in 1..65535")
    num_ps, port = int(num_ps), int(port)
    if num_ps > 0 and not chief:
        fail(
            "chief", chief, "True when num_ps > 0 (parameter-server training needs a chief)",
            hint="Pass chief=True; the first host becomes the chief.",
        )
    num_workers = len(entries) - int(chief) - num_ps
    if num_ps > 0 and num_workers < 1:
        fail(
            "hosts", entries,
            f"at least {num_ps + 2} hosts (1 chief, {num_ps} ps and at least 1 worker)",
        )
    if not entries:
        fail("hosts", entries, "at least one host")

    parsed: list[tuple[str, int | None]] = []
    explicit: dict[tuple[str, int], int] = {}  # (host, port) -> position in hosts
    for position, entry in enumerate(entries):
        field = f"hosts[{position}]"
        if not isinstance(entry, str):
            fail(field, entry, "a 'host' or 'host:port' string")
        try:
            host, host_port = _split_host(entry)
        except _BadAddress as bad:
            fail(field, entry, "a 'host' or 'host:port' string with a valid host and port", bad.hint)
        if host_port is not None:
            key = (host.lower(), host_port)
            if key in explicit:
                fail(
                    field, entry,
                    f"an address used once (it is also hosts[{explicit[key]}])",
                    hint="Each task needs its own host:port.",
                )
            explicit[key] = position
        parsed.append((host, host_port))

    # Hosts without a port: successive free ports per host name.
    next_port: dict[str, int] = {}
    addresses = []
    for position, (host, host_port) in enumerate(parsed):
        if host_port is None:
            candidate = next_port.get(host.lower(), port)
            while (host.lower(), candidate) in explicit:
                candidate += 1
            if candidate > 65535:
                fail(f"hosts[{position}]", entries[position], "a free port <= 65535",
                     hint="Pass a lower port= or give the ports explicitly.")
            next_port[host.lower()] = candidate + 1
            host_port = candidate
        addresses.append(_format_address(host, host_port))

    cluster: dict[str, list[str]] = {}
    start = 0
    if chief:
        cluster["chief"] = addresses[:1]
        start = 1
    ps = addresses[start : start + num_ps]
    workers = addresses[start + num_ps :]
    if workers:
        cluster["worker"] = workers
    if ps:
        cluster["ps"] = ps
    spec = {"cluster": cluster}
    parse(spec, require_task=False)  # Double-check with the full rules.
    return spec
