"""What tfdist keeps on a ``keras.distribution`` (a :mod:`tfdist.record` slot),
and which strategies it made for one.

tfdist's DataParallel and ModelParallel keep their ``compression`` and
``error_feedback``; any distribution keeps the strategy made for it once.
The strategies made for a distribution (by :func:`making`, then
:func:`mark`) are not the user's: the guard lets them be (:func:`is_mapped`).
The other modules of the package read these; this one imports none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from tfdist.record import attach, slot

#: Strategies made for a distribution: not the user's (the guard lets them be).
_mapped: weakref.WeakSet[Any] = weakref.WeakSet()
_local = threading.local()


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


def is_mapped(strategy: object) -> bool:
    """Whether ``strategy`` was made for a distribution, or one is being made
    now (then any ``strategy``, None too, is)."""
    return getattr(_local, "making", False) or strategy in _mapped


@contextlib.contextmanager
def making() -> Iterator[None]:
    """While a strategy for a distribution is made (the guard lets it be)."""
    _local.making = True
    try:
        yield
    finally:
        _local.making = False


def mark(strategy: object) -> None:
    """Records ``strategy`` as made for a distribution, not by the user."""
    _mapped.add(strategy)
