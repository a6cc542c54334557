"""What tfdist keeps on objects it does not own: one typed record per strategy,
and one slot per kind of record on any other object.

A strategy carries a :class:`StrategyRecord`, reached through
:func:`record_of`. Each field says who writes it and who reads it:

- ``compression``: written by the strategy when built (parsed once, there);
  ``compression="auto"`` replaces it with its choice when the optimizer
  builds. Read by ``strategy.compression``, ``describe()`` and ``repr``.
- ``choice``: written by the strategy when :func:`tfdist.strategy_from_config`
  built it. Read by ``strategy.choice`` and ``describe()``.
- ``aggregator``: written by Mirrored and MultiWorkerMirrored when built, with
  compression or another transport. Read by the Keras hook in ``fit``
  (:mod:`tfdist.compression.keras_hook`), custom loops
  (:mod:`tfdist.training.loops`) and tensor parallelism's data-parallel
  reduction (:mod:`tfdist.parallel.grads`).
- ``transport``: written by MultiWorkerMirrored with ``transport="mpi"``.
  Read by the Keras hook, which takes the aggregator's collectives from it.
- ``observer``: written by :class:`tfdist.profiling.Profiler` while it records
  a ``fit``. Read by the Keras hook: told before and after the reduction, it
  makes the collectives.
- ``mesh``: written by :func:`tfdist.parallel.attach.attach`
  (``model_parallel=T``, or a ``keras.distribution`` layout). Read by
  :mod:`tfdist.parallel`, the traffic callback and :mod:`tfdist.distribution`.

The readers sit in several layers, most of them above this one; the record
names what it holds through the :class:`typing.Protocol` classes below, so this
module imports nothing above the spec layer (``tests/test_layering.py``).

Records of other objects (an optimizer's compression state, a model's
preemption state) are the layers' own dataclasses, kept with :func:`attach`
and found with :func:`slot`. Everything lives in one attribute,
:data:`ATTRIBUTE`, written to the object's ``__dict__`` so that Keras's
attribute tracking never sees it; the attribute name appears nowhere else
(``tests/test_record.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from tfdist.spec.compression import CompressionSetting
from tfdist.spec.detect import Choice

#: The one attribute tfdist sets on objects it does not own.
ATTRIBUTE = "_tfdist"

T = TypeVar("T")


@runtime_checkable
class Aggregator(Protocol):
    """Reduces one step's gradients across replicas
    (:class:`tfdist.compression.Aggregator`)."""

    def aggregate(self, items: list, step: object, comm: object) -> list:
        """The reduced gradients of ``items``, sent through ``comm``."""

    def describe(self) -> str:
        """One line for ``describe()``."""


@runtime_checkable
class Transport(Protocol):
    """Carries the aggregator's collectives between processes when TensorFlow's
    own do not (:class:`tfdist.transport.MpiTransport`)."""

    def make_comm(self) -> Any:
        """The collectives of one aggregation (a :class:`tfdist.compression.Comm`)."""

    def describe(self) -> str:
        """One line for ``describe()``."""


@runtime_checkable
class Observer(Protocol):
    """Watches the gradient reduction of ``fit``
    (:class:`tfdist.profiling.instrument.Profiler`)."""

    def before_reduce(self, pairs: list, step: object) -> list:
        """Told when the gradients are ready; returns the pairs to reduce."""

    def keras_reduce(self, pairs: list, run: Callable[[], list]) -> list:
        """Wraps Keras's own all-reduce (``run()``) when nothing compresses."""

    def after_reduce(self, grads: list) -> None:
        """Told when the reduced gradients are ready."""

    def make_comm(self) -> Any:
        """The aggregator's collectives, instrumented."""


@runtime_checkable
class MeshRuntime(Protocol):
    """A (data, tensor) mesh over a strategy's replicas and its collectives
    (:class:`tfdist.parallel.collectives.Runtime`)."""

    mesh: Any  # tfdist.parallel.mesh.Mesh: ``dp``, ``tp``, ``describe()``.


@dataclasses.dataclass
class StrategyRecord:
    """Everything tfdist attaches to a strategy; see the module's table."""

    compression: CompressionSetting = dataclasses.field(
        default_factory=lambda: CompressionSetting("none")
    )
    choice: Choice | None = None
    aggregator: Aggregator | None = None
    transport: Transport | None = None
    observer: Observer | None = None
    mesh: MeshRuntime | None = None

    @property
    def model_parallel(self) -> int:
        """The tensor-parallel group size T (1 without a mesh)."""
        return self.mesh.mesh.tp if self.mesh is not None else 1


def _slots(obj: object) -> dict[type, Any]:
    # None, or an object without a __dict__, has no records to read.
    return getattr(obj, "__dict__", {}).get(ATTRIBUTE) or {}


def slot(obj: object, kind: type[T]) -> T | None:
    """The record of type ``kind`` kept on ``obj``, or None."""
    return _slots(obj).get(kind)


def attach(obj: object, value: T, kind: type[T] | None = None) -> T:
    """Keeps ``value`` on ``obj`` as its record of ``kind`` (default: its type).

    The slots are copied, not changed in place: an object built from another's
    ``__dict__`` (tfdist.horovod's tapes) does not share later records with it.
    """
    slots = dict(_slots(obj))
    slots[kind or type(value)] = value
    vars(obj)[ATTRIBUTE] = slots
    return value


def detach(obj: object, kind: type) -> None:
    """Drops ``obj``'s record of ``kind``, if any."""
    slots = dict(_slots(obj))
    if slots.pop(kind, None) is not None:
        vars(obj)[ATTRIBUTE] = slots


def record_of(strategy: object) -> StrategyRecord:
    """The record of ``strategy``, created empty on first use.

    Any strategy has one, TensorFlow's own included: the profiler watches the
    default strategy's steps too.
    """
    record = slot(strategy, StrategyRecord)
    return record if record is not None else attach(strategy, StrategyRecord())
