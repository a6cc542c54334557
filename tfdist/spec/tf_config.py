"""The validated TF_CONFIG: :class:`TFConfig`. No TensorFlow."""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from tfdist.errors import ClusterSpecError
from tfdist.spec.names import CLUSTER_JOBS
from tfdist.spec.validate import Validator

# --------------------------------------------------------------------------
# The parsed configuration.
# --------------------------------------------------------------------------


class ClusterSource(abc.ABC):
    """A running cluster that stands for its chief's TF_CONFIG, such as
    :class:`tfdist.engines.LocalCluster`: ``strategy_from_config(config=source)``
    reads :attr:`tf_config` from it. Defined here, below the strategies, so
    that they need not import the engines."""

    @property
    @abc.abstractmethod
    def tf_config(self) -> dict:
        """The chief's TF_CONFIG."""


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

    def with_task(self, task_type: str | None, task_index: int | None) -> TFConfig:
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


def from_data(
    data: object, source: str, *, require_task: bool, strategy: str | None = None
) -> TFConfig:
    """The TFConfig of raw TF_CONFIG data (parsed JSON), once it keeps every
    rule (:class:`~tfdist.spec.validate.Validator`).

    Raises:
        ClusterSpecError: The data breaks a rule; ``source`` says where it came from.
    """
    return TFConfig(**Validator(source).check(data, require_task=require_task, strategy=strategy))


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
            "<root>",
            config,
            "a TFConfig",
            source="validate()",
            hint="Use tfdist.spec.parse() for dicts, JSON strings and files.",
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
    return from_data(data, config.source, require_task=require_task, strategy=strategy)
