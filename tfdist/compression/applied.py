"""Whether an optimizer's last step applied its gradients, so that something was sent.

With Keras's ``gradient_accumulation_steps=k`` only every k-th step applies
(and all-reduces); the byte counts of compression and of the profiler count
those steps only.
"""

from __future__ import annotations

from typing import Any


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
