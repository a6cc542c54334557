"""Deprecated: ``tfdist.cluster`` is now :mod:`tfdist.spec` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.spec',
    'tfdist.spec.names',
    'tfdist.spec.tf_config',
    'tfdist.spec.address',
    'tfdist.spec.validate',
    'tfdist.spec.parse',
    'tfdist.spec.generate',
])
