"""Deprecated: ``tfdist.keras_ps`` is now :mod:`tfdist.training.ps_patches` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.training.ps_patches',
])
