"""Deprecated: ``tfdist._hvd_worker`` is now :mod:`tfdist.engines.hvd_worker` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.engines.hvd_worker',
])
