"""From a fixed ``compression=`` setting (anything but ``"auto"``) to a
compressor or an aggregator.

:mod:`tfdist.compression.registry` adds ``"auto"``, which chooses among fixed
settings built here; keeping them apart lets :mod:`tfdist.compression.auto`
build its candidates without importing the registry that imports it.
"""

from __future__ import annotations

from typing import Any

from tfdist.compression.aggregate import Aggregator, CompressorAggregator, check_error_feedback
from tfdist.compression.base import Compressor
from tfdist.compression.casting import BF16Compressor, FP16Compressor
from tfdist.compression.identity import NoneCompressor
from tfdist.compression.memory import ErrorFeedback
from tfdist.compression.powersgd import PowerSGD
from tfdist.compression.qsgd import QSGDCompressor
from tfdist.compression.randomk import RandomKCompressor
from tfdist.compression.sign import SignCompressor
from tfdist.compression.topk import TopKCompressor
from tfdist.errors import ConfigError
from tfdist.spec.compression import parse_compression

__all__ = ["make_compressor", "fixed_aggregator"]


def make_compressor(setting: Any) -> Compressor:
    """Builds the compressor a setting names.

    Args:
        setting: Anything :func:`parse_compression` accepts: None, ``"fp16"``,
            ``"topk:0.01"``, a :class:`CompressionSetting`, or a compressor
            object (returned as is). Defaults: top-k keeps 1% (tensors under
            1024 entries whole, as sign does), random-k 25% (scaled to be
            unbiased), QSGD uses 16 levels.

    Returns:
        The compressor.

    Raises:
        ConfigError: The setting is invalid, or names PowerSGD, which is not
            available in this build (field ``'compression'``).
    """
    parsed = parse_compression(setting)
    if parsed.compressor is not None:
        return parsed.compressor
    name, param = parsed.name, parsed.param
    if name == "none":
        return NoneCompressor()
    if name == "fp16":
        return FP16Compressor()
    if name == "bf16":
        return BF16Compressor()
    if name == "topk":
        return TopKCompressor() if param is None else TopKCompressor(param)
    if name == "randomk":
        return RandomKCompressor() if param is None else RandomKCompressor(param)
    if name == "sign":
        return SignCompressor()
    if name == "qsgd":
        return QSGDCompressor(16 if param is None else param)
    # PowerSGD keeps factor matrices across steps and does not fit
    # compress/decompress: it is an aggregator; so is "auto".
    if name == "auto":
        raise ConfigError(
            "compression",
            setting if isinstance(setting, str) else name,
            "a stateless compressor",
            hint="'auto' chooses an aggregator when the optimizer builds: use "
            "strategy_from_config(compression='auto') or make_aggregator('auto')",
        )
    raise ConfigError(
        "compression",
        setting if isinstance(setting, str) else name,
        "a stateless compressor",
        hint="PowerSGD is an aggregator with per-step state: use make_aggregator(), "
        "or strategy_from_config(compression='powersgd')",
    )


def fixed_aggregator(setting: Any, error_feedback: bool | None = None) -> Aggregator:
    """Builds the aggregator of a fixed setting (see
    :func:`tfdist.compression.registry.make_aggregator`).

    Raises:
        ConfigError: As ``make_aggregator``, and for ``"auto"``.
    """
    parsed = parse_compression(setting)
    obj = parsed.compressor
    if parsed.name == "auto":
        raise ConfigError(
            "compression",
            setting if isinstance(setting, str) else parsed.name,
            "a fixed setting (a compressor or an aggregator), not 'auto'",
            hint="'auto' chooses among fixed settings; it cannot be one of its own candidates.",
        )
    if isinstance(obj, Aggregator):
        if error_feedback is not None and error_feedback != getattr(
            obj, "error_feedback", error_feedback
        ):
            raise ConfigError(
                "error_feedback",
                error_feedback,
                f"None or {obj.error_feedback} (the value {obj!r} was built with)",
            )
        return obj
    if isinstance(obj, ErrorFeedback):
        if error_feedback is False:
            raise ConfigError(
                "error_feedback", error_feedback, "None or True with an ErrorFeedback object"
            )
        return CompressorAggregator(obj.compressor, error_feedback=True)
    if parsed.name == "powersgd":
        ef = True if error_feedback is None else error_feedback
        if not isinstance(ef, bool):
            raise ConfigError("error_feedback", error_feedback, "True, False or None")
        return PowerSGD(4 if parsed.param is None else parsed.param, error_feedback=ef)
    compressor = make_compressor(parsed)
    if error_feedback is True and not getattr(compressor, "contractive", True):
        raise ConfigError(
            "error_feedback",
            error_feedback,
            "False or None with a compressor that scales what it keeps to be unbiased",
            received=f"error_feedback=True with {compressor!r}",
            hint="Its error-feedback residual would grow every step; for random-k with error "
            "feedback use compression=RandomKCompressor(ratio, unbiased=False).",
        )
    return CompressorAggregator(compressor, check_error_feedback(compressor, error_feedback))
