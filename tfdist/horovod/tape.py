"""``hvd.DistributedGradientTape``: a finished ``tf.GradientTape`` whose
``gradient()`` returns gradients averaged over all ranks.

Horovod scripts wrap the tape after its ``with`` block, inside their
``tf.function`` step::

    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

The wrapper is an instance of the tape's own class (``isinstance`` holds)
sharing its recorded state. Compression state (error feedback, PowerSGD) is
created once per variable, outside the ``tf.function`` (``init_scope``), and
kept for the process: the wrapper itself is rebuilt at every trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.horovod import collectives
from tfdist.horovod.collectives import ReduceOp
from tfdist.horovod.optimizer import HorovodComm, check_reduction, reduce_gradients
from tfdist.record import Aggregator, attach, slot


@dataclasses.dataclass
class TapeSettings:
    """What ``DistributedGradientTape`` keeps on the tape (a :mod:`tfdist.record` slot).

    Attributes:
        aggregator: The compression's aggregator.
        op: The reduction.
        predivide: Horovod's ``gradient_predivide_factor``.
        sparse_as_dense: Send IndexedSlices as dense tensors.
        comm: What the last traced ``gradient`` sent through (tests, benchmarks).
    """

    aggregator: Aggregator
    op: ReduceOp
    predivide: float
    sparse_as_dense: bool
    comm: HorovodComm | None = None


def last_comm(tape: object) -> HorovodComm | None:
    """What the last traced ``gradient`` of a ``DistributedGradientTape`` sent
    through (None with one rank, or before its first call)."""
    settings = slot(tape, TapeSettings)
    return settings.comm if settings is not None else None


__all__ = ["DistributedGradientTape", "tape_state", "tape_traffic"]

#: aggregator -> {"step": Variable, "vars": {id(var): (var, {name: state})}}
_STATE: dict[int, dict] = {}
#: compression setting -> its aggregator, for the life of the process (the
#: wrapper is rebuilt at every trace; the state must not be).
_AGGREGATORS: dict = {}


def _key(compression: Any) -> Any:
    """The cache key of a compression setting: names by value, objects by identity."""
    return compression if isinstance(compression, (str, type(None))) else id(compression)


def tape_state(aggregator: Any) -> dict:
    """The tape's compression state for ``aggregator`` (tests, checkpoints)."""
    return _STATE.setdefault(id(aggregator), {"step": None, "vars": {}})


def _state_for(aggregator, sources: list) -> tuple[dict, tf.Variable]:
    import keras

    from tfdist.compat.keras_src import standardize_dtype
    from tfdist.horovod.auto import resolved

    store = tape_state(aggregator)
    store["aggregator"] = resolved(aggregator, sources)
    aggregator = store["aggregator"]
    with tf.init_scope(), collectives.runtime.created_eagerly():
        if store["step"] is None:
            store["step"] = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_tape_step")
        for var in sources:
            if id(var) in store["vars"]:
                continue
            specs = aggregator.state_specs(
                tuple(var.shape), standardize_dtype(var.dtype), len(store["vars"])
            )
            made = {
                s.name: keras.Variable(
                    initializer=s.initializer,
                    shape=s.shape,
                    dtype=s.dtype,
                    trainable=False,
                    name=f"hvd_tape_{s.name}",
                )
                for s in specs
            }
            store["vars"][id(var)] = (var, made, len(store["vars"]))
    return store, store["step"]


class _DistributedTape:
    """Methods put before the tape's class in a dynamic subclass."""

    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        settings = slot(self, TapeSettings)
        store, step = _state_for(settings.aggregator, flat_sources)
        keys = [store["vars"][id(v)][2] for v in flat_sources]
        state = {store["vars"][id(v)][2]: store["vars"][id(v)][1] for v in flat_sources}
        comm = HorovodComm() if collectives.runtime.size() > 1 else None
        reduced = reduce_gradients(
            flat,
            keys,
            aggregator=store["aggregator"],
            state=state,
            step=step,
            op=settings.op,
            predivide=settings.predivide,
            sparse_as_dense=settings.sparse_as_dense,
            comm=comm,
        )
        settings.comm = comm
        step.assign_add(1)
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    op: Any = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """A tape whose ``gradient()`` averages (or sums) over all ranks.

    Args:
        gradtape: The ``tf.GradientTape`` the step recorded with.
        device_dense: Accepted for Horovod scripts; no effect.
        device_sparse: Accepted for Horovod scripts; no effect.
        num_groups: Accepted for Horovod scripts; no effect.
        groups: Accepted for Horovod scripts; no effect.
        scale_local_gradients: Accepted for Horovod scripts; no effect.
        compression: ``hvd.Compression.none``/``fp16``, a Horovod-style
            compressor, or a tfdist setting/object (``"powersgd:4"``).
        sparse_as_dense: Send IndexedSlices as dense tensors.
        op: ``hvd.Average`` or ``hvd.Sum``; ``hvd.Adasum`` raises.
        gradient_predivide_factor: As in ``DistributedOptimizer``.
        process_set: Only None is supported.

    Raises:
        ConfigError: Bad argument, named with the value received.
    """
    from tfdist.horovod.compression import aggregator_for

    source = "hvd.DistributedGradientTape"
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigError(
            "gradtape",
            gradtape,
            "a tf.GradientTape",
            source=source,
            received=type(gradtape).__name__,
        )
    resolved = check_reduction(op, process_set, gradient_predivide_factor, source)
    aggregator = _AGGREGATORS.get(_key(compression))
    if aggregator is None:
        aggregator = aggregator_for(compression, source)
        _AGGREGATORS[_key(compression)] = aggregator
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedTape, base), {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    attach(
        tape,
        TapeSettings(aggregator, resolved, float(gradient_predivide_factor), bool(sparse_as_dense)),
    )
    return tape


def tape_traffic(variables: Any, compression: Any = None):
    """Bytes each rank sent for the last ``DistributedGradientTape.gradient``
    over ``variables`` with this ``compression`` (what
    :func:`tfdist.compression.step_traffic` gives for an optimizer).

    Args:
        variables: The variables the tape differentiated (``model.trainable_variables``).
        compression: The setting given to ``DistributedGradientTape``.

    Returns:
        A :class:`~tfdist.compression.Traffic`.

    Raises:
        ValueError: No tape with this compression has reduced gradients yet.
    """
    from tfdist.compat.keras_src import standardize_dtype

    aggregator = _AGGREGATORS.get(_key(compression))
    store = _STATE.get(id(aggregator)) if aggregator is not None else None
    if store is None or store["step"] is None or int(store["step"].numpy()) < 1:
        raise ValueError(
            "tape_traffic: expected a DistributedGradientTape with compression="
            f"{compression!r} to have reduced gradients. Received: none yet"
        )
    shapes = [
        (tuple(int(d) for d in v.shape), standardize_dtype(v.dtype))
        for v in tf.nest.flatten(variables)
    ]
    return store["aggregator"].traffic(
        shapes, collectives.runtime.size(), step=int(store["step"].numpy()) - 1
    )
