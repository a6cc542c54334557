"""Deprecated: ``tfdist.hosts`` is now :mod:`tfdist.engines.hosts` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.engines.hosts',
    'tfdist.engines.tfjob',
    'tfdist.engines.yaml_text',
])
