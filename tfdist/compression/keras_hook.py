"""Compressed gradient aggregation inside Keras 3 ``fit``.

Keras 3 aggregates gradients in exactly one place:
``TFOptimizer._all_reduce_sum_gradients``, which all-reduces (SUM) in replica
context; the loss is already scaled by 1/num_replicas. :func:`install` wraps
that method once. The wrapper looks at the current strategy: when it carries
an aggregator (``strategy_from_config(compression=...)`` with two or more
replicas) the aggregator reduces the gradients through
``ReplicaContext.all_reduce`` / ``all_gather``; otherwise Keras's own method
runs unchanged. Using only the replica context keeps the same code working
under Mirrored and multi-worker MultiWorkerMirrored.

State (error-feedback residuals, PowerSGD's Q) lives in per-replica
variables (``synchronization="on_read"``) that the optimizer owns:

* they are created when the optimizer builds, by a wrapper of
  ``BaseOptimizer.build``, for optimizers created in the strategy's scope;
* ``model.save`` stores them after the optimizer's own variables, under keys
  ``tfdist_0``, ``tfdist_1``...; ``keras.models.load_model`` restores them
  when the loading strategy has the same compression, and otherwise loads the
  optimizer's own variables and ignores them (with a warning). Residuals are
  saved as their mean over replicas, which keeps their sum (the gradient
  still owed) when the mean is restored to every replica.

``compression="auto"`` (:mod:`tfdist.compression.auto`) makes its choice in
the build wrapper, before the state is created: it measures the link with
a few all-reduces (every worker builds at the same point of ``fit``) and
then behaves as the aggregator it chose, or as Keras's own all-reduce.

The wrapped methods are declared in :mod:`tfdist.compat.registry` and
checked when installing, so an incompatible Keras fails loudly here rather
than training uncompressed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any

import tensorflow as tf

from tfdist import compat
from tfdist.compat import tf_private
from tfdist.compat.keras_src import backend, standardize_dtype
from tfdist.compression.aggregate import Aggregator, Item
from tfdist.compression.sparse import TracedSlices, record_traced, traced_slices
from tfdist.record import attach, record_of, slot
from tfdist.transport.comm import ReplicaComm

_PREFIX = "tfdist_"
log = logging.getLogger("tfdist.compression")


def strategy_aggregator(strategy: Any) -> Aggregator | None:
    """The aggregator of a tfdist strategy with compression on, else None.

    tfdist's Mirrored and MultiWorkerMirrored strategies build it when the
    setting is enabled; one replica has nothing to send.
    """
    aggregator = record_of(strategy).aggregator
    if aggregator is None or strategy.num_replicas_in_sync < 2:
        return None
    if getattr(aggregator, "passthrough", False):  # "auto" chose none.
        return None
    return aggregator


def _resolve_auto(strategy: Any, variables: list) -> None:
    """Lets ``compression="auto"`` choose (once per strategy) and shows the choice
    as ``strategy.compression`` (``auto -> powersgd:4``)."""
    record = record_of(strategy)
    aggregator = record.aggregator
    if aggregator is None or not hasattr(aggregator, "resolve") or aggregator.resolved:
        return
    decision = aggregator.resolve(strategy, variables)
    record.compression = dataclasses.replace(record.compression, resolved=decision.choice)


@dataclasses.dataclass
class OptimizerState:
    """The compression state an optimizer owns (kept with :func:`tfdist.record.attach`).

    Attributes:
        aggregator: The aggregator the state was made for.
        variables: Every state variable, in the order ``model.save`` stores them.
        by_key: Per gradient (Keras's variable index): the state's variables by name.
    """

    aggregator: Aggregator
    variables: list
    by_key: dict[int, dict[str, Any]]


class _Logged:
    """Marks an optimizer whose compression traffic was logged once."""


def optimizer_state(optimizer: object) -> OptimizerState | None:
    """The compression state ``optimizer`` owns; None before it built under
    a strategy that compresses."""
    return slot(optimizer, OptimizerState)


def state_by_key(optimizer: object) -> dict[int, dict[str, Any]]:
    """The optimizer's state variables by gradient index; {} without state."""
    state = optimizer_state(optimizer)
    return state.by_key if state is not None else {}


def state_variables(optimizer: Any) -> list:
    """The compression state variables an optimizer owns (may be empty)."""
    state = optimizer_state(optimizer)
    return list(state.variables) if state is not None else []


def create_state(optimizer, aggregator: Aggregator, strategy, variables) -> None:
    """Creates the aggregator's per-replica state for each trainable variable."""
    state: dict[int, dict[str, Any]] = {}
    flat = []
    with strategy.scope(), backend.name_scope(optimizer.name, caller=optimizer):
        for index, var in enumerate(variables):
            specs = aggregator.state_specs(tuple(var.shape), standardize_dtype(var.dtype), index)
            colocate = var.value if isinstance(var, backend.Variable) else var
            for spec in specs:
                with strategy.extended.colocate_vars_with(colocate):
                    v = backend.Variable(
                        initializer=spec.initializer,
                        shape=spec.shape,
                        dtype=spec.dtype,
                        trainable=False,
                        aggregation=spec.aggregation,
                        synchronization="on_read",
                        name=f"{_PREFIX}{spec.name}_{var.name}",
                    )
                state.setdefault(index, {})[spec.name] = v
                flat.append(v)
    # Kept out of Keras's own variable list (plain __dict__ entries bypass its
    # tracker), so that a model saved with compression still loads without
    # it; model.save stores them through the save/load wrappers below, and
    # tf.train.Checkpoint through named dependencies.
    for i, v in enumerate(flat):
        tf_private.track_trackable(optimizer, v, name=f"{_PREFIX}{i}", overwrite=True)
    attach(optimizer, OptimizerState(aggregator, flat, state))


def wrap_build(original):
    @functools.wraps(original)
    def build(self, variables):
        original(self, variables)
        # A LossScaleOptimizer's inner optimizer does the aggregation and
        # gets its own state when it builds.
        if hasattr(self, "inner_optimizer") or optimizer_state(self) is not None:
            return
        strategy = getattr(self, "_distribution_strategy", None) or tf.distribute.get_strategy()
        _resolve_auto(strategy, list(variables))
        aggregator = strategy_aggregator(strategy)
        if aggregator is not None:
            create_state(self, aggregator, strategy, list(variables))

    return build


def ids_per_example(indices: Any) -> int | None:
    """Ids each example looked up, for the indices of a gather's gradient.

    TensorFlow's gradient of ``tf.gather`` flattens the ids with a Reshape
    (gradients of several calls are concatenated), so the indices' own shape
    is ``(None,)`` when the batch is unknown, but the ids' static shape (say
    ``(None, 16)``) still says how many each example looked up. None where
    the trace does not know it (eager, or another producer).
    """
    op = getattr(indices, "op", None) if not tf.executing_eagerly() else None
    if op is None:
        return None
    if op.type in ("Identity", "Cast"):
        return ids_per_example(op.inputs[0])
    if op.type == "ConcatV2":  # One table looked up by several calls.
        parts = [ids_per_example(t) for t in op.inputs[:-1]]
        return None if None in parts else sum(parts)
    if op.type == "Reshape":
        shape = op.inputs[0].shape
        return None if shape.rank is None or shape.rank < 1 else shape[1:].num_elements()
    return None


def _traced(grad: tf.IndexedSlices) -> TracedSlices:
    return TracedSlices(
        tuple(grad.values.shape[1:]), grad.indices.dtype.name, ids_per_example(grad.indices)
    )


def with_variable_shape(grad: Any, variable: Any) -> Any:
    """A dense gradient with its variable's static shape.

    Traced gradients may lose it (a Dense kernel's, from a 3-D input such as
    a transformer's hidden states: ``(None, 64)``); the aggregator would then
    send them uncompressed, unlike what its byte count says.
    """
    if isinstance(grad, tf.Tensor) and not grad.shape.is_fully_defined():
        shape = tf.TensorShape(variable.shape)
        if shape.is_fully_defined():
            grad.set_shape(shape)
    return grad


def wrap_reduce(original):
    @functools.wraps(original)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        pairs = list(grads_and_vars)
        # Which gradients are IndexedSlices, compressed or not: step_traffic
        # refuses to count them without the model that says how many rows.
        # Their ids per example too: a model may leave an Embedding's input
        # length open (BERT's token ids), the traced batches do not.
        record_traced(self, [_traced(g) for g, _ in pairs if isinstance(g, tf.IndexedSlices)])
        strategy = tf.distribute.get_strategy()
        record = record_of(strategy)
        observer = record.observer
        if observer is not None and tf.distribute.get_replica_context():
            pairs = observer.before_reduce(pairs, self.iterations)
        aggregator = strategy_aggregator(strategy)
        if aggregator is None or not tf.distribute.get_replica_context():
            if observer is None or not tf.distribute.get_replica_context():
                return original(self, pairs)
            out = observer.keras_reduce(pairs, lambda: original(self, pairs))
            observer.after_reduce([g for g, _ in out])
            return out
        own = optimizer_state(self)
        state = own.by_key if own is not None else None
        if own is None or own.aggregator is not aggregator:
            needs = any(
                aggregator.state_specs(tuple(v.shape), v.dtype.name, i)
                for i, (_, v) in enumerate(pairs)
            )
            if needs:
                raise RuntimeError(
                    f"tfdist: compression {aggregator.describe()} keeps per-replica state, "
                    "but this optimizer was built outside the strategy that compresses. "
                    "Expected: create the model and call compile() inside strategy.scope(). "
                    "Received: an optimizer built under "
                    f"{type(self._distribution_strategy).__name__}"
                )
            state = {}
        keys = [self._get_variable_index(v) for _, v in pairs]
        items = [
            Item(with_variable_shape(g, v), key, state.get(key, {}))
            for (g, v), key in zip(pairs, keys)
        ]
        step = tf.convert_to_tensor(getattr(self.iterations, "value", self.iterations))
        if record.transport is not None:
            comm = record.transport.make_comm()
        elif observer is not None:
            comm = observer.make_comm()
        else:
            comm = ReplicaComm()
        reduced = aggregator.aggregate(items, step, comm)
        if observer is not None:
            observer.after_reduce(reduced)
        # The gradients sent as IndexedSlices, for CommunicationStats to check.
        aggregator.traced_slices = traced_slices(self)
        if slot(self, _Logged) is None:
            attach(self, _Logged())
            # Sparse gradients' rows follow the batch: CommunicationStats counts them.
            shapes = [
                (tuple(v.shape), v.dtype.name)
                for g, v in pairs
                if g is not None and not isinstance(g, tf.IndexedSlices)
            ]
            log.info(
                "tfdist compression %s: %s%s",
                aggregator.describe(),
                aggregator.traffic(shapes, comm.num_replicas),
                f" and {len(aggregator.traced_slices)} sparse gradient(s)"
                if aggregator.traced_slices
                else "",
            )
        return [(g, v) for g, (_, v) in zip(reduced, pairs)]

    return _all_reduce_sum_gradients


class _OwnKeys:
    """A read-only view of a weights store without tfdist's keys."""

    def __init__(self, store, exclude):
        self._store, self._exclude = store, set(exclude)

    def keys(self):
        return [k for k in self._store.keys() if k not in self._exclude]  # noqa: SIM118 - a Keras weights store: iterating it indexes it

    def __getitem__(self, key):
        return self._store[key]

    def __len__(self):
        return len(self.keys())


def _ordered_keys(store) -> list[str]:
    """tfdist's aggregated keys (``tfdist_3``), in variable order."""
    keys = [
        k
        for k in store.keys()  # noqa: SIM118 - a Keras weights store: iterating it indexes it
        if str(k).startswith(_PREFIX) and str(k)[len(_PREFIX) :].isdigit()
    ]
    return sorted(keys, key=lambda k: int(str(k)[len(_PREFIX) :]))


def _replica_copies(optimizer, variable) -> tuple:
    """The per-replica components of a state variable when this process holds
    every replica (Mirrored on one host); () otherwise."""
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if strategy is None:
        return ()
    local = strategy.experimental_local_results(variable.value)
    return local if len(local) == strategy.num_replicas_in_sync > 1 else ()


def wrap_save(original):
    @functools.wraps(original)
    def save_own_variables(self, store):
        original(self, store)
        for i, v in enumerate(state_variables(self)):
            # Reading in cross-replica context applies the aggregation (the
            # mean of residuals: it keeps their sum when restored to all).
            store[f"{_PREFIX}{i}"] = v.numpy()
            # One host holding every replica also keeps each copy, so that a
            # resume with the same replicas is exact.
            for r, copy in enumerate(_replica_copies(self, v)):
                store[f"{_PREFIX}{i}_r{r}"] = copy.numpy()

    return save_own_variables


def wrap_load(original):
    @functools.wraps(original)
    def load_own_variables(self, store):
        saved = _ordered_keys(store)
        tfdist_keys = [k for k in store.keys() if str(k).startswith(_PREFIX)]  # noqa: SIM118 - a Keras weights store: iterating it indexes it
        original(self, _OwnKeys(store, tfdist_keys) if tfdist_keys else store)
        mine = state_variables(self)
        # Shapes differ when the state was saved for another model_parallel
        # layout (a shard's residual); it then starts from zeros.
        if (
            saved
            and len(saved) == len(mine)
            and all(tuple(store[k].shape) == tuple(v.shape) for k, v in zip(saved, mine))
        ):
            for key, v in zip(saved, mine):
                copies = _replica_copies(self, v)
                names = [f"{key}_r{r}" for r in range(len(copies))]
                if (
                    copies
                    and all(n in tfdist_keys for n in names)
                    and f"{key}_r{len(copies)}" not in tfdist_keys
                ):
                    for copy, name in zip(copies, names):
                        copy.assign(store[name])
                else:
                    v.assign(store[key])
        elif saved or mine:
            warnings.warn(
                f"tfdist: the saved optimizer has {len(saved)} compression state variables "
                f"and this one has {len(mine)} (or their shapes differ: another "
                "model_parallel layout); the compression state starts from zeros. "
                "Load the model inside a strategy with the same compression setting to "
                "resume it.",
                stacklevel=2,
            )

    return load_own_variables


def install() -> None:
    """Wraps Keras's gradient aggregation, build, save and load once; idempotent.

    The patches are declared in :mod:`tfdist.compat.registry` (feature
    ``"compression"``).

    Raises:
        tfdist.compat.PatchError: This Keras lacks a method tfdist wraps, or
            its signature changed.
    """
    compat.install("compression")
