"""Deprecated: ``tfdist.ps_cluster`` is now :mod:`tfdist.engines.local_cluster` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.engines.local_cluster',
])
