"""Deprecated: ``tfdist.slurm`` is now :mod:`tfdist.strategies.slurm` (works until the next release)."""

from tfdist._moved import moved

__getattr__, __dir__, __all__ = moved(__name__, [
    'tfdist.strategies.slurm',
])
