"""Deprecated: ``tfdist.launch`` is now :mod:`tfdist.engines.launch` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.engines.launch',
    'tfdist.engines.launch_results',
    'tfdist.engines.launch_tasks',
    'tfdist.engines.launch_attempt',
    'tfdist.engines.netns',
])
