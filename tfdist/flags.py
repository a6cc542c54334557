"""Deprecated: ``tfdist.flags`` is now :mod:`tfdist.strategies.flags` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.strategies.flags',
])
