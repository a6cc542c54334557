"""tfdist.distribution's part in a strategy's life (see :mod:`tfdist.plugins`).

A Keras distribution set beside a tfdist strategy would train unsharded on
TensorFlow, silently: :mod:`~tfdist.distribution.guard` refuses it in either
order.
"""

from __future__ import annotations

from typing import Any

from tfdist.distribution import guard


def refuse(kind: str) -> None:
    guard.check_no_distribution(kind)


def install(strategy: Any) -> None:
    guard.install()
    guard.check_no_distribution(strategy.kind)


def created(strategy: Any) -> None:
    guard.register_strategy(strategy)
