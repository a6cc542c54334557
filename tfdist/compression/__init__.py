"""Gradient compression settings.

This package will hold the compressors themselves. For now it parses and
validates the ``compression=`` setting that :func:`tfdist.strategy_from_config`
accepts and keeps on the strategy, so that scripts can already pass it and a
typo fails early. Importing it does not import TensorFlow.
"""

from tfdist.compression.setting import (
    COMPRESSOR_NAMES,
    CompressionSetting,
    parse_compression,
)

__all__ = ["COMPRESSOR_NAMES", "CompressionSetting", "parse_compression"]
