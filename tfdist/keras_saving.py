"""Deprecated: ``tfdist.keras_saving`` is now :mod:`tfdist.training.saving` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.training.saving',
    'tfdist.training.chief_save',
])
