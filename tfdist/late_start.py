"""Deprecated: ``tfdist.late_start`` is now :mod:`tfdist.strategies.late_start` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.strategies.late_start',
])
