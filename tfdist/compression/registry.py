"""From a ``compression=`` setting to what compresses: a compressor, an
aggregator, or ``"auto"``'s chooser.

The fixed settings are built by :mod:`tfdist.compression.factory`; this
module adds ``"auto"`` (:mod:`tfdist.compression.auto`), which chooses
among them.
"""

from __future__ import annotations

from typing import Any

from tfdist.compression.aggregate import Aggregator
from tfdist.compression.auto import AutoCompression
from tfdist.compression.factory import fixed_aggregator, make_compressor
from tfdist.errors import ConfigError
from tfdist.spec.compression import default_error_feedback, parse_compression

__all__ = ["make_compressor", "make_aggregator", "default_error_feedback"]


def make_aggregator(setting: Any, error_feedback: bool | None = None) -> Aggregator:
    """Builds what the Keras hook reduces gradients with.

    Args:
        setting: Anything :func:`parse_compression` accepts, including a
            :class:`PowerSGD`, a compressor, or an :class:`ErrorFeedback`
            wrapping one.
        error_feedback: None for the compressor's default
            (:func:`default_error_feedback`), True or False to force it.

    Returns:
        A :class:`PowerSGD`, a :class:`CompressorAggregator`, or for
        ``"auto"`` an :class:`~tfdist.compression.auto.AutoCompression`.

    Raises:
        ConfigError: Bad setting, or error feedback forced on a lossless
            compressor or on one scaled to be unbiased (random-k's default),
            or contradicting the object given.
    """
    parsed = parse_compression(setting)
    if parsed.name == "auto":
        if error_feedback is not None:
            raise ConfigError(
                "error_feedback",
                error_feedback,
                "None with compression='auto'",
                hint="Each candidate 'auto' may choose keeps its own default.",
            )
        if parsed.compressor is not None:
            return parsed.compressor
        return AutoCompression()
    return fixed_aggregator(setting, error_feedback)
