"""Deprecated: ``tfdist.horovodrun`` is now :mod:`tfdist.engines.horovodrun` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.engines.horovodrun',
])
