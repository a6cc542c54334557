"""Input pipelines for distributed training: global batch and auto-sharding.

Under a multi-worker strategy, ``tf.data`` shards the dataset between the
workers according to ``options.experimental_distribute.auto_shard_policy``:

* ``FILE``: each worker reads its own subset of the input files. Cheapest,
  but it needs at least as many files as workers: a worker left without a
  file fails, and only when the data is first read, not when the policy is
  set.
* ``DATA``: every worker reads everything and keeps every n-th element.
  Always correct (given a deterministic order), at the cost of reading the
  whole input on every worker.
* ``AUTO`` (TensorFlow's default) tries FILE and falls back to DATA when it
  finds no file reader, e.g. for ``from_tensor_slices``, without any log.
  With a reader but too few files it still picks FILE, and fails at the first
  read.

:func:`choose_shard_policy` makes that choice up front and says why:
DATA for in-memory sources (``from_tensor_slices``, ``from_generator``,
``range``), FILE when the dataset reads files and there are at least as many
files as workers, and otherwise DATA with a :class:`ShardingWarning`.
:func:`distribute_dataset` applies it.

How files are found: the dataset's graph (``Dataset._as_serialized_graph``,
the GraphDef TensorFlow's own auto-shard rewrite works on) is searched for
the reader ops that rewrite knows (``TFRecordDataset``, ``TextLineDataset``,
``FixedLengthRecordDataset``...), also inside ``flat_map``/``interleave``
functions, and the file names are followed up to their source: a constant
list (``TFRecordDataset([...])``, ``from_tensor_slices([...])``) is counted;
a ``list_files`` pattern is globbed. Anything else (file names computed at
run time) cannot be counted: pass ``files=`` then. The graph is read with
private TensorFlow APIs; if that ever fails, the choice falls back to DATA
with a warning, which is always correct.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from absl import logging

from tfdist.compat import tf_private
from tfdist.compat.tf_python import graph_pb2
from tfdist.errors import ConfigError, require_int
from tfdist.training.callbacks import num_workers as _num_workers

__all__ = [
    "ShardingWarning",
    "ShardDecision",
    "global_batch_size",
    "choose_shard_policy",
    "distribute_dataset",
]

Policy = tf.data.experimental.AutoShardPolicy


class ShardingWarning(UserWarning):
    """The dataset is sharded by DATA although it reads files."""


@dataclasses.dataclass(frozen=True)
class ShardDecision:
    """The auto-shard policy chosen for a dataset, and why.

    Attributes:
        policy: The ``tf.data.experimental.AutoShardPolicy`` to apply.
        reason: One sentence saying why.
        num_workers: Workers the data is sharded between.
        reads_files: Whether the dataset reads files.
        num_files: Files counted (None if not counted).
    """

    policy: Policy
    reason: str
    num_workers: int
    reads_files: bool
    num_files: int | None


def global_batch_size(per_replica_batch: int, strategy: Any) -> int:
    """The batch ``fit`` and ``experimental_distribute_dataset`` expect.

    Returns:
        ``per_replica_batch * strategy.num_replicas_in_sync``.

    Raises:
        ConfigError: ``per_replica_batch`` is not an integer >= 1, or
            ``strategy`` has no ``num_replicas_in_sync``.
    """
    source = "global_batch_size"
    per_replica_batch = require_int("per_replica_batch", per_replica_batch, 1, source)
    replicas = getattr(strategy, "num_replicas_in_sync", None)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(
            "strategy",
            strategy,
            "a tf.distribute strategy (something with num_replicas_in_sync >= 1)",
            source=source,
        )
    return per_replica_batch * replicas


# --------------------------------------------------------------------------
# Reading the dataset graph.

# The reader ops of TensorFlow's auto-shard rewrite (grappler auto_shard.cc),
# which also accepts their versioned names (TFRecordDatasetV2...).
_READERS = (
    "ArrayRecordDataset",
    "FixedLengthRecordDataset",
    "RecordIODataset",
    "SSTableDataset",
    "TextLineDataset",
    "TFRecordDataset",
)
_READER_OP = re.compile(r"^(?:%s)(?:V\d+)?$" % "|".join(_READERS))
_SLICES = re.compile(r"^TensorSliceDataset(?:V\d+)?$")


def _graph(dataset: tf.data.Dataset) -> graph_pb2.GraphDef:
    serialized = tf_private.serialized_graph(
        dataset, external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE
    )
    return graph_pb2.GraphDef.FromString(serialized.numpy())


def _node_name(ref: str) -> str:
    return ref.lstrip("^").split(":")[0]


def _functions_called(node, functions: dict) -> list:
    called = []
    for attr in node.attr.values():
        names = [attr.func.name] if attr.HasField("func") else [f.name for f in attr.list.func]
        called.extend(functions[n] for n in names if n in functions)
    return called


def _reads_files_inside(node, functions: dict, seen: set) -> bool:
    """Whether a function of ``node`` (recursively) holds a reader op."""
    for function in _functions_called(node, functions):
        if function.signature.name in seen:
            continue
        seen.add(function.signature.name)
        for inner in function.node_def:
            if _READER_OP.match(inner.op) or _reads_files_inside(inner, functions, seen):
                return True
    return False


def _count_constant(node) -> int | None:
    if node.op != "Const":
        return None
    dims = node.attr["value"].tensor.tensor_shape.dim
    count = 1
    for dim in dims:
        count *= dim.size
    return count


def _count_files(ref: str, nodes: dict) -> int | None:
    """Counts the file names a dataset/tensor input ``ref`` yields, if constant."""
    node = nodes.get(_node_name(ref))
    for _ in range(100):  # Follow pass-through datasets (shuffle, repeat...).
        if node is None:
            return None
        if node.op == "Const":
            return _count_constant(node)
        if node.op == "MatchingFiles":
            pattern = nodes.get(_node_name(node.input[0]))
            if pattern is None or pattern.op != "Const":
                return None
            patterns = tf.make_ndarray(pattern.attr["value"].tensor).ravel()
            return len({name for p in patterns for name in tf.io.gfile.glob(p.decode())})
        if _SLICES.match(node.op) or node.op in ("Identity", "Reshape"):
            node = nodes.get(_node_name(node.input[0]))
            continue
        if node.op.startswith(
            (
                "ShuffleDataset",
                "PrefetchDataset",
                "CacheDataset",
                "OptionsDataset",
                "FinalizeDataset",
            )
        ):
            node = nodes.get(_node_name(node.input[0]))
            continue
        return None  # Computed at run time (map, repeat, zip...): not counted.
    return None


@dataclasses.dataclass
class _Inspection:
    reads_files: bool
    num_files: int | None
    detail: str


def _inspect(dataset: tf.data.Dataset) -> _Inspection:
    graph = _graph(dataset)
    nodes = {node.name: node for node in graph.node}
    functions = {f.signature.name: f for f in graph.library.function}
    counts: list[int | None] = []
    for node in graph.node:
        if _READER_OP.match(node.op):
            # A reader in the outer graph: its first input is the file names.
            counts.append(_count_files(node.input[0], nodes))
        elif _reads_files_inside(node, functions, set()):
            # flat_map/interleave over a dataset of file names.
            counts.append(_count_files(node.input[0], nodes) if node.input else None)
    if not counts:
        sources = sorted(
            {
                n.op
                for n in graph.node
                if n.op.endswith(("Dataset", "DatasetV2", "DatasetV3"))
                and not any(
                    _node_name(i) in nodes
                    and nodes[_node_name(i)].op.endswith(("Dataset", "DatasetV2", "DatasetV3"))
                    for i in n.input
                )
            }
        )
        return _Inspection(False, None, ", ".join(sources) or "no file reader")
    known = [c for c in counts if c is not None]
    if len(known) < len(counts):
        return _Inspection(True, None, "file names computed at run time")
    return _Inspection(True, min(known), f"{min(known)} file(s)")


# --------------------------------------------------------------------------
# Choosing and applying the policy.

_POLICIES = {
    "auto": None,
    "file": Policy.FILE,
    "data": Policy.DATA,
    "off": Policy.OFF,
    "hint": Policy.HINT,
}


def _parse_policy(policy: Any) -> Policy | None:
    """None means: tfdist chooses."""
    if isinstance(policy, Policy):
        return None if policy == Policy.AUTO else policy
    if isinstance(policy, str) and policy.strip().lower() in _POLICIES:
        return _POLICIES[policy.strip().lower()]
    raise ConfigError(
        "policy",
        policy,
        "one of 'auto', 'file', 'data', 'off', 'hint' or a tf.data.experimental.AutoShardPolicy",
        source="distribute_dataset",
    )


def _count_given_files(files: Any) -> int:
    if isinstance(files, str):
        return len(tf.io.gfile.glob(files))
    if isinstance(files, Sequence) and all(isinstance(f, str) for f in files):
        return len(files)
    raise ConfigError(
        "files", files, "a glob pattern or a list of file names", source="choose_shard_policy"
    )


def choose_shard_policy(
    dataset: tf.data.Dataset,
    strategy: Any = None,
    *,
    workers: int | None = None,
    files: str | Sequence[str] | None = None,
    warn: bool = True,
) -> ShardDecision:
    """Chooses the auto-shard policy for ``dataset``, and says why.

    * No file reader (``from_tensor_slices``, generators, ``range``): DATA.
      TensorFlow's AUTO also ends up there, silently.
    * Reads files, at least as many as workers: FILE.
    * Reads files, but fewer than workers, or a number that cannot be
      counted: DATA, with a :class:`ShardingWarning` saying why. FILE would
      leave a worker without files and fail at its first read.

    With one worker nothing is sharded; the decision is still reported but
    no warning is given.

    Args:
        dataset: The (unbatched or batched) dataset.
        strategy: The strategy; the number of workers comes from its cluster.
            Default: the one in scope.
        workers: Number of workers, instead of asking the strategy.
        files: The input files (a list, or a glob pattern) when the graph
            does not tell how many there are.
        warn: Issue the warning (it is also logged with absl).

    Returns:
        A :class:`ShardDecision`.
    """
    count = (
        require_int("workers", workers, 1, "choose_shard_policy")
        if workers is not None
        else _num_workers(strategy)
    )
    try:
        seen = _inspect(dataset)
    except Exception as error:  # noqa: BLE001 - private TF API; DATA is safe.
        seen = _Inspection(
            files is not None, None, f"the dataset graph could not be read ({error})"
        )
    num_files = _count_given_files(files) if files is not None else seen.num_files
    reads_files = seen.reads_files or files is not None

    def decide(policy: Policy, reason: str, warning: bool = False) -> ShardDecision:
        if warning and count > 1:
            if warn:
                warnings.warn(reason, ShardingWarning, stacklevel=3)
            logging.warning("tfdist: %s", reason)
        else:
            logging.info("tfdist: %s", reason)
        return ShardDecision(policy, reason, count, reads_files, num_files)

    if not reads_files:
        return decide(
            Policy.DATA,
            f"DATA: the dataset reads no files "
            f"({seen.detail}), so every worker produces all elements "
            f"and keeps 1 in {count}.",
        )
    if num_files is None:
        return decide(
            Policy.DATA,
            "DATA: the dataset reads files but their "
            f"number could not be counted ({seen.detail}); FILE "
            "sharding fails at the first read if a worker gets no "
            "file. Pass files= to count them.",
            warning=True,
        )
    if num_files < count:
        return decide(
            Policy.DATA,
            f"DATA: only {num_files} file(s) for {count} "
            "workers; FILE sharding would leave a worker without a "
            "file, which fails at its first read. Every worker reads "
            f"all files and keeps 1 element in {count}; split the "
            f"input into at least {count} files to shard by file.",
            warning=True,
        )
    return decide(
        Policy.FILE,
        f"FILE: {num_files} file(s) for {count} worker(s); each worker reads its own files.",
    )


def distribute_dataset(
    dataset: tf.data.Dataset,
    strategy: Any,
    per_replica_batch: int | None = None,
    *,
    policy: Any = "auto",
    files: str | Sequence[str] | None = None,
    drop_remainder: bool = True,
    distribute: bool = True,
):
    """Batches ``dataset`` to the global batch and sets its auto-shard policy.

    Args:
        dataset: An unbatched dataset when ``per_replica_batch`` is given
            (it is batched here), else one batched by the global batch.
        strategy: The strategy training runs under.
        per_replica_batch: Batch size of each replica; the dataset is batched
            by ``per_replica_batch * num_replicas_in_sync``.
        policy: ``"auto"``: :func:`choose_shard_policy` decides. ``"file"``,
            ``"data"``, ``"off"``, ``"hint"`` or an ``AutoShardPolicy``:
            that policy (``AutoShardPolicy.AUTO`` means ``"auto"``). An
            explicit ``"file"`` is checked now: a dataset that reads no files,
            or fewer files than workers, raises instead of failing at the
            first read.
        files: The input files, if the graph does not tell (see
            :func:`choose_shard_policy`).
        drop_remainder: Drop a last partial global batch (keeps every step's
            shape static, which multi-worker training wants).
        distribute: Return ``strategy.experimental_distribute_dataset(...)``;
            False returns the ``tf.data.Dataset`` with its options set
            (``model.fit`` accepts either).

    Returns:
        The distributed dataset, or the dataset (``distribute=False``).

    Raises:
        ConfigError: A bad batch size or policy, or ``"file"`` on a dataset
            that cannot be sharded by file.
    """
    chosen = _parse_policy(policy)
    if per_replica_batch is not None:
        dataset = dataset.batch(
            global_batch_size(per_replica_batch, strategy), drop_remainder=drop_remainder
        )
    if chosen is None or chosen == Policy.FILE:
        decision = choose_shard_policy(dataset, strategy, files=files, warn=chosen is None)
        if chosen == Policy.FILE and decision.policy != Policy.FILE:
            raise ConfigError(
                "policy",
                policy,
                "'file' only for a dataset that reads at least as many files as workers",
                source="distribute_dataset",
                hint=decision.reason.split(": ", 1)[1],
            )
        chosen = decision.policy
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = chosen
    dataset = dataset.with_options(options)
    if distribute:
        return strategy.experimental_distribute_dataset(dataset)
    return dataset
