"""Gradient compression: the ``compression=`` setting and the compressors.

:func:`parse_compression` parses and validates the ``compression=`` setting
that :func:`tfdist.strategy_from_config` accepts (it lives in the spec layer,
:mod:`tfdist.spec.compression`, with the other options). The compressors
(:func:`make_compressor`, :class:`TopKCompressor`, :class:`ErrorFeedback`...)
are stateless objects turning one gradient into a payload and back. Importing
this package does not import TensorFlow; the compressor names are loaded on
first access.

It sits below the strategies: it imports the spec layer and :mod:`tfdist.errors`
only, never the strategies, parallel, the Keras integration, profiling, horovod,
the engines or the CLI. What it needs of a strategy (its aggregator, a
tensor-parallel mesh) it reads from attributes the strategy carries.
"""

from tfdist._lazy import lazy_attributes
from tfdist.spec.compression import (
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
    "make_aggregator": "registry",
    "Aggregator": "aggregate",
    "CompressorAggregator": "aggregate",
    "PowerSGD": "powersgd",
    "Traffic": "traffic",
    "predict_traffic": "predict",
    "SparseGradient": "sparse",
    "CommunicationStats": "callback",
    "step_traffic": "loop_traffic",
    "CompressedCrossDeviceOps": "cross_device_ops",
    "default_error_feedback": "registry",
    "AutoCompression": "auto",
    "LinkEstimate": "auto",
}

__all__ = ["COMPRESSOR_NAMES", "CompressionSetting", "parse_compression", *_LAZY]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
