"""``hvd.DistributedOptimizer`` for Keras 3, and the gradient reduction it shares
with ``hvd.DistributedGradientTape``.

Horovod's own DistributedOptimizer hooks Keras 2 internals that Keras 3 no
longer has. This one subclasses the optimizer's own class (``isinstance``
still holds, and ``model.save`` stores the plain optimizer) and reduces in
``apply``, which both ``model.fit`` and ``optimizer.apply_gradients`` in a
custom loop go through, before clipping and the update, as Horovod did.

The reduction runs through a tfdist aggregator (:mod:`tfdist.compression`)
over TensorFlow's collectives between the processes, so every tfdist
compression setting works, with error feedback and PowerSGD state kept in
optimizer variables, and :func:`tfdist.compression.step_traffic` counts
the bytes.

Two Keras 3 traps are handled when the shim is initialized:

* Under mixed precision ``compile`` wraps the optimizer in a
  ``LossScaleOptimizer``, which applies the inner optimizer (and so
  all-reduces) only when *this* rank's gradients are finite. Ranks that
  disagree would deadlock; the finiteness check is made global (one scalar
  all-reduce) so that every rank takes the same branch.
* ``compile(jit_compile="auto")`` turns XLA on where there is a GPU, and
  XLA cannot compile TensorFlow's multi-process collectives; it is turned
  off, with a log line, for models whose optimizer all-reduces.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import keras
import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.compat.keras_src import backend, standardize_dtype
from tfdist.compression.aggregate import Item, scale_gradient
from tfdist.compression.applied import OwnReduction, own_reduction
from tfdist.compression.keras_hook import create_state, state_by_key
from tfdist.errors import ConfigError
from tfdist.horovod import collectives, runtime
from tfdist.horovod.collectives import ReduceOp
from tfdist.record import attach
from tfdist.transport.comm import ReplicaComm

__all__ = [
    "DistributedOptimizer",
    "HorovodComm",
    "reduce_gradients",
    "check_reduction",
    "install",
    "load_model",
    "is_distributed",
]

log = logging.getLogger("tfdist.horovod")


class HorovodComm(ReplicaComm):
    """tfdist's aggregator collectives over the Horovod ranks (no strategy)."""

    def __init__(self) -> None:
        super().__init__(runtime.size())  # No replica context here.

    def reduce_sum(self, tensors):
        dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
        out = list(tensors)
        for i, r in zip(dense, collectives.sum_dense([tensors[i] for i in dense])):
            out[i] = r
        for i, t in enumerate(tensors):
            if isinstance(t, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(
                    collectives.gather_varying(t.values),
                    collectives.gather_varying(t.indices),
                    t.dense_shape,
                )
        return out

    def gather_rows(self, rows):
        return collectives.gather_rows(rows)

    def cond(self, pred, true_fn, false_fn, args):
        return tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))


def reduce_gradients(
    grads: list,
    keys: list | None = None,
    *,
    aggregator,
    state: dict,
    step,
    op: ReduceOp,
    predivide: float = 1.0,
    sparse_as_dense: bool = False,
    comm: HorovodComm | None = None,
) -> list:
    """Averages (or sums) each rank's gradients through ``aggregator``.

    Args:
        grads: One per variable; None stays None.
        keys: A stable integer per gradient (the optimizer's variable
            index): the key of its ``state`` and random streams. Default:
            the positions.
        aggregator: A tfdist aggregator (SUM semantics).
        state: Variable index -> the aggregator's state variables.
        step: The step (PowerSGD's warm-up, random-k's seed).
        op: Average or Sum.
        predivide: Horovod's ``gradient_predivide_factor``: divide by it before
            the sum and by ``size / predivide`` after.
        sparse_as_dense: Send IndexedSlices as dense tensors.
        comm: Records what was sent; a new one when None.

    Returns:
        The reduced gradients.
    """
    n = runtime.size()
    if n == 1:
        return list(grads)
    comm = comm or HorovodComm()
    keys = list(range(len(grads))) if keys is None else list(keys)
    items, at = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) and sparse_as_dense:
            g = tf.convert_to_tensor(g)
        if op == ReduceOp.Average and predivide != 1.0:
            g = scale_gradient(g, 1.0 / predivide)
        items.append(Item(g, keys[i], state.get(keys[i], {})))
        at.append(i)
    reduced = aggregator.aggregate(items, tf.convert_to_tensor(step), comm)
    post = predivide / n if op == ReduceOp.Average else 1.0
    out = list(grads)
    for i, r in zip(at, reduced):
        out[i] = scale_gradient(r, post) if post != 1.0 else r
    return out


def is_distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the one a LossScaleOptimizer wraps) is a
    ``hvd.DistributedOptimizer``."""
    return own_reduction(optimizer) is not None


def last_comm(optimizer: object) -> HorovodComm | None:
    """What the last traced step of a ``hvd.DistributedOptimizer`` sent through
    (None with one rank, or before its first step)."""
    settings = own_reduction(optimizer)
    return getattr(settings, "comm", None)


def _settings(optimizer: object) -> _Settings:
    return own_reduction(optimizer)  # Attached by DistributedOptimizer.


class _Settings:
    """What ``DistributedOptimizer`` keeps on the optimizer (an
    :class:`~tfdist.compression.applied.OwnReduction`, so that the traffic
    counts of tfdist.compression find it)."""

    def __init__(
        self,
        aggregator,
        op,
        predivide,
        sparse_as_dense,
        backward_passes_per_step,
        average_aggregated_gradients,
    ):
        self.aggregator = aggregator
        self.op = op
        self.predivide = predivide
        self.sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        # What the last traced step sent, as the tape keeps it (tests, benchmarks).
        self.comm: HorovodComm | None = None
        # backward_passes_per_step > 1: the gradients summed so far, by
        # variable index (optimizer variables; Keras saves them).
        self.accumulators: list = []

    # Read by tfdist.compression (step_traffic, CommunicationStats) through
    # the OwnReduction protocol.
    @property
    def num_replicas(self) -> int:
        """The ranks a step's gradients are reduced over."""
        return runtime.size()

    def sent_last_step(self, optimizer) -> bool:
        """Whether the optimizer's last step sent (not only accumulated)."""
        count = getattr(optimizer, "_tfdist_hvd_count", None)
        return count is None or int(count.numpy()) == 0


class _DistributedMixin:
    """Placed before the optimizer's own class in a dynamic subclass."""

    def build(self, variables):
        super().build(variables)
        settings = _settings(self)
        from tfdist.horovod.auto import resolved

        settings.aggregator = resolved(settings.aggregator, list(variables))
        if any(
            settings.aggregator.state_specs(tuple(v.shape), standardize_dtype(v.dtype), i)
            for i, v in enumerate(variables)
        ):
            create_state(self, settings.aggregator, tf.distribute.get_strategy(), list(variables))
        if settings.backward_passes_per_step > 1:
            with backend.name_scope(self.name, caller=self):
                settings.accumulators = [
                    self.add_variable_from_reference(v, name="hvd_accumulated") for v in variables
                ]
                self._tfdist_hvd_count = self.add_variable(
                    (), dtype="int64", initializer="zeros", name="hvd_passes"
                )

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with backend.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads = list(grads)
        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else list(self._trainable_variables)
        )
        settings = _settings(self)
        if settings.backward_passes_per_step > 1:
            return self._hvd_accumulate(grads, variables, trainable_variables)
        reduced = self._hvd_reduce(grads, variables)
        return super().apply(reduced, trainable_variables)

    def _hvd_reduce(self, grads, variables):
        settings = _settings(self)
        keys = [self._get_variable_index(v) for v in variables]
        # The step the update is about to apply (PowerSGD's warm-up counts it).
        step = tf.convert_to_tensor(getattr(self.iterations, "value", self.iterations))
        comm = HorovodComm() if runtime.size() > 1 else None
        settings.comm = comm
        return reduce_gradients(
            grads,
            keys,
            aggregator=settings.aggregator,
            state=state_by_key(self),
            step=step,
            op=settings.op,
            predivide=settings.predivide,
            sparse_as_dense=settings.sparse_as_dense,
            comm=comm,
        )

    def _hvd_accumulate(self, grads, variables, trainable_variables):
        settings = _settings(self)
        passes = settings.backward_passes_per_step
        accumulators = [settings.accumulators[self._get_variable_index(v)] for v in variables]
        for acc, g in zip(accumulators, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        self._tfdist_hvd_count.assign_add(1)
        scale = 1.0 / passes if settings.average_aggregated_gradients else 1.0
        base = super()

        def send():
            local = [
                None if g is None else acc.value * tf.cast(scale, acc.dtype)
                for acc, g in zip(accumulators, grads)
            ]
            reduced = self._hvd_reduce(local, variables)
            base.apply(reduced, trainable_variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))
            self._tfdist_hvd_count.assign(0)

        def wait():
            # As Horovod: every backward pass counts as an iteration.
            self._iterations.assign_add(1)

        due = self._tfdist_hvd_count >= passes
        if tf.executing_eagerly():
            send() if bool(due) else wait()
        else:
            tf.cond(
                due, lambda: (send(), tf.constant(True))[1], lambda: (wait(), tf.constant(False))[1]
            )


def check_reduction(
    op: Any, process_set: Any, gradient_predivide_factor: Any, source: str
) -> ReduceOp:
    """Checks what DistributedOptimizer and DistributedGradientTape share.

    Returns:
        The resolved op (Average or Sum).

    Raises:
        ConfigError: Adasum or another op, a process set, or a bad
            ``gradient_predivide_factor``.
    """
    resolved = collectives.resolve_op(op, None, source, allowed=(ReduceOp.Average, ReduceOp.Sum))
    if process_set is not None:
        raise ConfigError("process_set", process_set, "None (every rank)", source=source)
    if (
        isinstance(gradient_predivide_factor, bool)
        or not isinstance(gradient_predivide_factor, (int, float))
        or not gradient_predivide_factor > 0
    ):
        raise ConfigError(
            "gradient_predivide_factor", gradient_predivide_factor, "a number > 0", source=source
        )
    if gradient_predivide_factor != 1.0 and resolved != ReduceOp.Average:
        raise ConfigError(
            "gradient_predivide_factor",
            gradient_predivide_factor,
            "1.0 unless op=hvd.Average",
            source=source,
        )
    return resolved


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            "optimizer",
            optimizer,
            "a Keras 3 optimizer (keras.optimizers.*)",
            source="hvd.DistributedOptimizer",
            received=type(optimizer).__name__,
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ConfigError(
            "optimizer",
            type(optimizer).__name__,
            "the inner optimizer",
            source="hvd.DistributedOptimizer",
            hint="Wrap the inner optimizer; compile() adds the loss scaling under mixed precision.",
        )


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
):
    """Wraps a Keras 3 optimizer so that it averages gradients over all ranks.

    Args:
        optimizer: A Keras 3 optimizer. A new optimizer of the same class and
            config is returned (its variables, if any, are not carried over).
        name: A name for the new optimizer; default: the old one's.
        use_locking: Accepted for Horovod scripts; no effect.
        device_dense: Accepted; TensorFlow places the collectives itself.
        device_sparse: Accepted; TensorFlow places the collectives itself.
        num_groups: Accepted; TensorFlow packs the collectives itself (one
            per dtype per step).
        groups: Accepted, as ``num_groups``.
        compression: ``hvd.Compression.none`` (default) or ``.fp16``, a
            Horovod-style compressor, or any tfdist compression setting or
            object (``"powersgd:4"``, ``"topk:0.01"``...).
        sparse_as_dense: Send Embedding gradients (IndexedSlices) as dense.
        backward_passes_per_step: Accumulate this many steps' gradients
            locally and send once.
        op: ``hvd.Average`` or ``hvd.Sum``; ``hvd.Adasum`` raises.
        gradient_predivide_factor: Divide gradients by it before the sum and
            by ``size() / factor`` after (Average only).
        average_aggregated_gradients: With ``backward_passes_per_step > 1``,
            average the accumulated gradients instead of summing them.
        process_set: Only None is supported.
        scale_local_gradients: Accepted; no local-only variables here.

    Returns:
        An optimizer of the same class (``isinstance`` holds).

    Raises:
        ConfigError: Bad argument (named), Adasum, or not a Keras 3 optimizer.
    """
    from tfdist.horovod.compression import aggregator_for

    install()  # The fixes a DistributedOptimizer needs, before any is used.
    _check_optimizer(optimizer)
    source = "hvd.DistributedOptimizer"
    resolved = check_reduction(op, process_set, gradient_predivide_factor, source)
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step < 1
    ):
        raise ConfigError(
            "backward_passes_per_step", backward_passes_per_step, "an integer >= 1", source=source
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ConfigError(
            "gradient_accumulation_steps",
            optimizer.gradient_accumulation_steps,
            "None: use backward_passes_per_step, which sends once per accumulation",
            source=source,
        )
    settings = _Settings(
        aggregator_for(compression, source),
        resolved,
        float(gradient_predivide_factor),
        bool(sparse_as_dense),
        backward_passes_per_step,
        bool(average_aggregated_gradients),
    )
    base = type(optimizer)
    cls = type(
        base.__name__,
        (_DistributedMixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__},
    )
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    new = cls.from_config(config)
    attach(new, settings, kind=OwnReduction)
    return new


def load_model(
    filepath: str,
    custom_optimizers: list | None = None,
    custom_objects: dict | None = None,
    compression: Any = None,
):
    """``keras.models.load_model`` whose optimizer comes back distributed
    (``hvd.load_model``): its state is restored, then it all-reduces."""
    install()
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is None or is_distributed(opt):
        return model
    inner = getattr(opt, "inner_optimizer", opt)
    dist = DistributedOptimizer(inner, compression=compression)
    if inner.built:
        dist.build(keras_private.optimizer_trainable_variables(inner))
        for mine, theirs in zip(dist.variables, inner.variables):
            mine.assign(theirs)
    if inner is opt:
        model.optimizer = dist
    else:
        opt.inner_optimizer = dist
    return model


# --- Keras 3 patches, installed by hvd.init() -------------------------------


def wrap_check_finite(original):
    @functools.wraps(original)
    def check_finite(self, grads):
        finite = original(self, grads)
        if not is_distributed(self) or runtime.size() < 2:
            return finite
        # Every rank must take the same branch of the loss-scale cond: the
        # finite branch all-reduces. Count the ranks whose gradients are not.
        bad = collectives.sum_dense([tf.cast(tf.logical_not(finite), tf.int32)])[0]
        return tf.equal(bad, 0)

    return check_finite


def wrap_compile(original):
    @functools.wraps(original)
    def compile(self, *args, **kwargs):  # noqa: A001 - Keras's name.
        original(self, *args, **kwargs)
        if (
            getattr(self, "_jit_compile", False)
            and runtime.is_initialized()
            and runtime.size() > 1
            and is_distributed(getattr(self, "optimizer", None))
        ):
            log.warning(
                "tfdist.horovod: jit_compile turned off for %s: XLA cannot compile "
                "TensorFlow's multi-process all-reduce that "
                "hvd.DistributedOptimizer runs in each step",
                self.name,
            )
            self._jit_compile = False

    return compile


def install() -> None:
    """Installs the LossScaleOptimizer and jit_compile fixes (the registry's
    ``horovod``); idempotent.

    Raises:
        tfdist.ConfigError: A target changed in this Keras and the fixes
            were switched off (with a warning).
    """
    from tfdist import compat
    from tfdist.compression.keras_hook import install as install_hook

    install_hook()
    compat.install("horovod")
    compat.require("horovod", "tfdist.horovod")
