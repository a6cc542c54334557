"""Deprecated: ``tfdist.tf_handler`` is now :mod:`tfdist.training.tf_handler` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.training.tf_handler',
])
