"""What tfdist keeps on a ``keras.distribution`` (a :mod:`tfdist.record` slot).

tfdist's DataParallel and ModelParallel keep their ``compression`` and
``error_feedback``; any distribution keeps the strategy made for it once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.record import attach, slot


@dataclasses.dataclass
class DistributionRecord:
    """Attributes:
    options: ``compression`` and ``error_feedback``, as tfdist's
        DataParallel and ModelParallel were given them ({} for Keras's own).
    strategy: The strategy made for the distribution, once made.
    """

    options: dict = dataclasses.field(default_factory=dict)
    strategy: Any = None


def kept(distribution: object) -> DistributionRecord:
    """``distribution``'s record (empty on first use)."""
    found = slot(distribution, DistributionRecord)
    return found if found is not None else attach(distribution, DistributionRecord())


def keep_options(distribution: object, compression: object, error_feedback: bool | None) -> None:
    """Keeps the options of tfdist's DataParallel or ModelParallel."""
    kept(distribution).options = {"compression": compression, "error_feedback": error_feedback}


def options_of(distribution: object) -> dict:
    """The options ``distribution`` was given (a copy; {} for Keras's own)."""
    return dict(kept(distribution).options)


def strategy_of(distribution: object) -> Any:
    """The strategy made for ``distribution``, or None."""
    return kept(distribution).strategy
