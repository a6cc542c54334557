"""Whether an optimizer's last step applied its gradients, so that something was sent.

With Keras's ``gradient_accumulation_steps=k`` only every k-th step applies
(and all-reduces); the byte counts of compression and of the profiler count
those steps only.
"""

from __future__ import annotations

from typing import Any, Protocol

from tfdist.record import slot


class OwnReduction(Protocol):
    """An optimizer that reduces its gradients itself, outside the strategy
    (``tfdist.horovod.DistributedOptimizer``, a layer above, keeps its
    settings on the optimizer under this kind with :func:`tfdist.record.attach`).
    The traffic counts read it through this protocol."""

    @property
    def num_replicas(self) -> int:
        """The ranks a step's gradients are reduced over."""

    def sent_last_step(self, optimizer: object) -> bool:
        """Whether the optimizer's last step sent (not only accumulated)."""


def own_reduction(optimizer: object) -> OwnReduction | None:
    """The reduction ``optimizer`` (or the one a LossScaleOptimizer wraps)
    does itself; None for one the strategy reduces for."""
    return slot(getattr(optimizer, "inner_optimizer", optimizer), OwnReduction)


def applies_this_step(optimizer: Any) -> bool:
    """Whether ``optimizer``'s last step applied its gradients (eagerly).

    Always True without gradient accumulation; with ``k`` steps, True after
    every k-th step.
    """
    k = getattr(optimizer, "gradient_accumulation_steps", None)
    if not k:
        return True
    raw = getattr(optimizer, "_iterations", None)
    if raw is None:
        return True
    return int(raw.numpy()) % k == 0
