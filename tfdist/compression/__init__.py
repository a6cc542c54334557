"""Gradient compression: the ``compression=`` setting and the compressors.

:func:`parse_compression` parses and validates the ``compression=`` setting
that :func:`tfdist.strategy_from_config` accepts. The compressors
(:func:`make_compressor`, :class:`TopKCompressor`, :class:`ErrorFeedback`...)
are stateless objects turning one gradient into a payload and back. Importing
this package does not import TensorFlow; the compressor names are loaded on
first access.
"""

import importlib
from typing import Any

from tfdist.compression.setting import (
    COMPRESSOR_NAMES,
    CompressionSetting,
    parse_compression,
)

# Public name -> module defining it; imported (with TensorFlow) on first use.
_LAZY = {
    "Compressor": "base",
    "Context": "base",
    "reduce_compressed": "base",
    "NoneCompressor": "identity",
    "FP16Compressor": "casting",
    "BF16Compressor": "casting",
    "TopKCompressor": "topk",
    "RandomKCompressor": "randomk",
    "SignCompressor": "sign",
    "QSGDCompressor": "qsgd",
    "ErrorFeedback": "memory",
    "make_compressor": "registry",
    "default_error_feedback": "registry",
}

__all__ = ["COMPRESSOR_NAMES", "CompressionSetting", "parse_compression", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # Cache: later lookups skip __getattr__.
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
