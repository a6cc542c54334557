"""Validation of a TF_CONFIG: every field checked up front, with a ClusterSpecError
that names the field, what was expected and what was received.

TensorFlow accepts many broken values silently, then hangs or fails much later (a
string ``"index": "1"``, a duplicated address, a parameter-server cluster without a
chief). :func:`validate` refuses them here. No TensorFlow.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, NoReturn

from tfdist.errors import ClusterSpecError
from tfdist.spec.address import BadAddress, split_address
from tfdist.spec.names import (
    CLUSTER_JOBS,
    IGNORED_TASK_KEYS,
    IGNORED_TOP_LEVEL_KEYS,
    RESOLVER_SOURCE,
    RPC_LAYERS,
    SINGLE_MACHINE_STRATEGIES,
    STRATEGIES,
    TASK_EXAMPLE,
    TASK_KEYS,
    TASK_TYPES,
    TOP_LEVEL_KEYS,
    did_you_mean,
    quoted,
    short,
)

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
        "strategy",
        strategy,
        f"None or one of {quoted(STRATEGIES)}",
        source=source,
        hint=did_you_mean(strategy, STRATEGIES),
    )


class Validator:
    """Checks raw TF_CONFIG data (parsed JSON); :mod:`tfdist.spec.tf_config`
    builds the TFConfig from what it returns."""

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

    def check(self, data: object, *, require_task: bool, strategy: object) -> dict[str, Any]:
        """The normalized fields of a :class:`~tfdist.spec.tf_config.TFConfig`
        (jobs ordered chief, worker, ps), once ``data`` keeps every rule."""
        strategy = _normalize_strategy(strategy, self.source)
        if not isinstance(data, Mapping):
            self.fail(
                "<root>",
                data,
                f'a JSON object like {{"cluster": {{...}}, "task": {TASK_EXAMPLE}}}',
                received="null" if data is None else None,
            )
        self._check_top_level_keys(data)
        cluster = self._check_cluster(data)
        self._check_strategy(data, cluster, strategy)
        task_type, task_index = self._check_task(data, cluster, require_task)
        rpc_layer, environment = self._check_extras(data)
        return {
            "cluster": cluster,
            "task_type": task_type,
            "task_index": task_index,
            "rpc_layer": rpc_layer,
            "environment": environment,
            "source": self.source,
        }

    def _check_top_level_keys(self, data: Mapping) -> None:
        for key in data:
            if key in TOP_LEVEL_KEYS or key in IGNORED_TOP_LEVEL_KEYS:
                continue
            self.fail(
                str(key),
                key,
                f"only the top-level keys {quoted(TOP_LEVEL_KEYS)}",
                hint=did_you_mean(key, TOP_LEVEL_KEYS),
            )

    def _check_cluster(self, data: Mapping) -> dict[str, tuple[str, ...]]:
        if "cluster" not in data:
            if "task" in data:
                self.fail(
                    "cluster",
                    None,
                    "a 'cluster' object because 'task' is set",
                    received="no 'cluster' key",
                    hint="Without a cluster TensorFlow silently ignores 'task' and trains "
                    "locally; add the cluster's jobs.",
                )
            return {}
        raw = data["cluster"]
        if not isinstance(raw, Mapping):
            self.fail(
                "cluster",
                raw,
                "a JSON object mapping job names ('chief', 'worker', 'ps') to lists of "
                "'host:port' addresses",
            )
        if not raw and "task" in data:
            self.fail(
                "cluster",
                raw,
                "a non-empty 'cluster' because 'task' is set",
                hint="With an empty cluster TensorFlow silently ignores 'task' and trains "
                "locally; add the cluster's jobs.",
            )
        self._check_job_names(raw)
        cluster = self._check_addresses(raw)
        self._check_chief_and_ps(cluster, raw)
        return cluster

    def _check_job_names(self, raw: Mapping) -> None:
        for name in raw:
            if name == "evaluator":
                self.fail(
                    "cluster.evaluator",
                    raw[name],
                    "no 'evaluator' job in 'cluster' (the evaluator runs outside the "
                    "training cluster)",
                    hint="Remove 'evaluator' from 'cluster' and give the evaluator process "
                    '"task": {"type": "evaluator", "index": 0}.',
                )
            if name not in CLUSTER_JOBS:
                self.fail(
                    f"cluster.{name}",
                    name,
                    f"a job name among {quoted(CLUSTER_JOBS)}",
                    hint=did_you_mean(name, CLUSTER_JOBS),
                )

    def _check_addresses(self, raw: Mapping) -> dict[str, tuple[str, ...]]:
        """Each job's addresses, in CLUSTER_JOBS order: lists of 'host:port',
        no address used twice."""
        cluster: dict[str, tuple[str, ...]] = {}
        seen: dict[tuple[str, int], str] = {}  # (host, port) -> field using it
        jobs_expected = "a non-empty list of 'host:port' addresses"
        for job, addresses in raw.items():
            field = f"cluster.{job}"
            if isinstance(addresses, Mapping):
                self.fail(
                    field,
                    addresses,
                    jobs_expected,
                    hint="Sparse jobs ({index: address}) are not supported; list every "
                    "task's address, in index order.",
                )
            if isinstance(addresses, str):
                self.fail(
                    field,
                    addresses,
                    jobs_expected,
                    hint='Put the address in a list, e.g. ["localhost:2222"].',
                )
            if not isinstance(addresses, (list, tuple)):
                self.fail(field, addresses, jobs_expected)
            if not addresses:
                self.fail(
                    field,
                    addresses,
                    jobs_expected,
                    hint=f"Remove the '{job}' job or give it at least one address.",
                )
            for index, address in enumerate(addresses):
                item = f"{field}[{index}]"
                try:
                    host, port = split_address(address)
                except BadAddress as bad:
                    self.fail(item, address, bad.expected, hint=bad.hint)
                key = (host.lower(), port)
                if key in seen:
                    self.fail(
                        item,
                        address,
                        f"an address used by a single task (it is also '{seen[key]}')",
                        hint="TensorFlow hangs when two tasks share a host:port; give each "
                        "task its own port.",
                    )
                seen[key] = item
            cluster[job] = tuple(addresses)
        return {job: cluster[job] for job in CLUSTER_JOBS if job in cluster}

    def _check_chief_and_ps(self, cluster: Mapping, raw: Mapping) -> None:
        if len(cluster.get("chief", ())) > 1:
            self.fail(
                "cluster.chief",
                list(cluster["chief"]),
                "exactly one 'chief' address",
                hint="Keep one chief and move the other addresses to the 'worker' job.",
            )
        if "ps" in cluster and "worker" not in cluster and "chief" not in cluster:
            self.fail(
                "cluster.ps",
                dict(raw),
                "a 'ps' job only together with 'chief' and 'worker' jobs",
                hint="Parameter servers only hold variables; add a 'chief' and at least "
                "one 'worker' to train.",
            )

    def _check_strategy(
        self, data: Mapping, cluster: dict[str, tuple[str, ...]], strategy: str | None
    ) -> None:
        jobs = f"jobs {list(cluster)}" if cluster else "no cluster"
        if strategy == "multi_worker_mirrored" and "ps" in cluster:
            self.fail(
                "cluster.ps",
                list(cluster["ps"]),
                "no 'ps' job: a multi_worker_mirrored cluster cannot have a 'ps' job",
                hint="TensorFlow would hang. Use strategy='parameter_server' to train "
                "with parameter servers, or remove the 'ps' job.",
            )
        if strategy == "parameter_server" or (strategy is None and "ps" in cluster):
            if not cluster:
                self.fail(
                    "cluster",
                    data.get("cluster"),
                    "a cluster with 'chief', 'worker' and 'ps' jobs for "
                    "strategy='parameter_server'",
                    received=jobs,
                    hint="Set TF_CONFIG (see `tfdist tf-config SPEC --task worker:0`), or "
                    "use strategy='mirrored' on one machine.",
                )
            if "ps" not in cluster:
                self.fail(
                    "cluster.ps",
                    None,
                    "a 'ps' job: strategy='parameter_server' needs at least one parameter server",
                    received=jobs,
                    hint="Add a 'ps' job, or use strategy='multi_worker_mirrored'.",
                )
            if "worker" not in cluster:
                self.fail(
                    "cluster.worker",
                    None,
                    "at least one 'worker' for parameter-server training",
                    received=jobs,
                )
            # The caller that hands TensorFlow's strategy a resolver is the
            # coordinator, as in TF's tutorial (a resolver of workers and ps,
            # no chief). From TF_CONFIG no process would be the coordinator.
            if "chief" not in cluster and self.source != RESOLVER_SOURCE:
                self.fail(
                    "cluster.chief",
                    None,
                    "exactly one 'chief' (the coordinator of parameter-server training)",
                    received=jobs,
                    hint="Without a chief the workers and ps wait forever; add "
                    '"chief": ["host:port"].',
                )
        num_tasks = sum(len(addresses) for addresses in cluster.values())
        if strategy in SINGLE_MACHINE_STRATEGIES and num_tasks > 1:
            self.fail(
                "cluster",
                data.get("cluster"),
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
                    "task",
                    None,
                    f"a 'task' saying which task this process is, e.g. {TASK_EXAMPLE}",
                    received="no 'task' key",
                    hint=f"A cluster of {num_tasks} tasks needs a 'task' in each process's "
                    "TF_CONFIG (TensorFlow fails with 'No such job in cluster: None'); "
                    "generate them with `tfdist tf-config SPEC --task worker:0`.",
                )
            return None, None

        task = data["task"]
        if not isinstance(task, Mapping):
            self.fail("task", task, f"a JSON object like {TASK_EXAMPLE}")
        for key in task:
            if key not in TASK_KEYS and key not in IGNORED_TASK_KEYS:
                self.fail(
                    f"task.{key}",
                    key,
                    "only the keys 'type' and 'index' in 'task'",
                    hint=did_you_mean(key, TASK_KEYS),
                )

        task_type = self._check_task_type(task, cluster)
        return task_type, self._check_task_index(task, task_type, cluster)

    def _check_task_type(self, task: Mapping, cluster: Mapping) -> str:
        if "type" not in task:
            self.fail(
                "task.type",
                dict(task),
                f"a 'type' in 'task', one of {quoted(TASK_TYPES)}",
            )
        task_type = task["type"]
        if not isinstance(task_type, str) or task_type not in TASK_TYPES:
            self.fail(
                "task.type",
                task_type,
                f"one of {quoted(TASK_TYPES)}",
                hint=did_you_mean(task_type, TASK_TYPES),
            )
        if task_type == "evaluator":
            if "chief" not in cluster and "worker" not in cluster:
                self.fail(
                    "task.type",
                    task_type,
                    "a task in the cluster; an 'evaluator' needs a cluster with a 'chief' "
                    "or 'worker' job to evaluate",
                )
        elif task_type not in cluster:
            jobs = quoted(cluster) if cluster else "none"
            self.fail(
                "task.type",
                task_type,
                f"a job of the cluster (jobs: {jobs}) or 'evaluator'",
                hint=f"Add a '{task_type}' job to 'cluster' or fix 'task.type'.",
            )

        return task_type

    def _check_task_index(self, task: Mapping, task_type: str, cluster: Mapping) -> int:
        if "index" not in task:
            self.fail("task.index", dict(task), "an 'index' in 'task' (an integer from 0)")
        index = task["index"]
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            hint = None
            if isinstance(index, str) and index.strip().lstrip("-").isdigit():
                hint = (
                    f'Write the index as a number: "index": {short(index.strip())}, '
                    f'not "{short(index)}".'
                )
            self.fail(
                "task.index",
                index,
                "an integer (the task's position in its job, from 0)",
                hint=hint,
            )
        index = int(index)
        if task_type == "evaluator":
            if index != 0:
                self.fail(
                    "task.index",
                    index,
                    "0 for the evaluator (there is only one)",
                )
        else:
            size = len(cluster[task_type])
            if not 0 <= index < size:
                plural = "task" if size == 1 else "tasks"
                self.fail(
                    "task.index",
                    index,
                    f"an integer in [0, {size - 1}] (the '{task_type}' job has {size} {plural})",
                    hint="Task indices start at 0." if index < 0 else None,
                )
        return index

    def _check_extras(self, data: Mapping) -> tuple[str | None, str | None]:
        rpc_layer = data.get("rpc_layer")
        if rpc_layer is not None and (
            not isinstance(rpc_layer, str) or rpc_layer not in RPC_LAYERS
        ):
            self.fail(
                "rpc_layer",
                rpc_layer,
                f"one of {quoted(RPC_LAYERS)} (or no 'rpc_layer')",
                hint="TensorFlow 2 only ships the 'grpc' RPC layer.",
            )
        environment = data.get("environment")
        if environment is not None and not isinstance(environment, str):
            self.fail("environment", environment, "a string, e.g. 'cloud'")
        return rpc_layer, environment


# --------------------------------------------------------------------------
