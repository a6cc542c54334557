"""The ``compression=`` setting: a name, a short string form, or an object.

It is part of what the user asks for, like the other options, so it is read
here, below the layers that act on it (the strategies, the compressors)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.errors import ConfigError

#: Names accepted by ``compression=``, with the meaning of the optional
#: parameter in the short form ``"name:param"``.
COMPRESSOR_NAMES: dict[str, str | None] = {
    "none": None,
    "fp16": None,
    "bf16": None,
    "topk": "ratio",  # fraction of entries kept, in (0, 1]
    "randomk": "ratio",
    "powersgd": "rank",  # a positive integer
    "sign": None,
    "qsgd": "levels",  # a positive integer
    "auto": None,  # chosen from the measured link when the optimizer builds
}


@dataclasses.dataclass(frozen=True)
class CompressionSetting:
    """A parsed compression setting.

    Attributes:
        name: One of :data:`COMPRESSOR_NAMES`.
        param: The short-form parameter (``0.01`` in ``"topk:0.01"``), or None
            for the compressor's default.
        compressor: The compressor object when one was given instead of a
            name; None otherwise.
        error_feedback: None for the compressor's default, or True/False.
        resolved: For ``"auto"``, the setting it chose once the optimizer
            built (shown as ``auto -> powersgd:4``); None before.
    """

    name: str
    param: float | int | None = None
    compressor: Any = None
    error_feedback: bool | None = None
    resolved: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether gradients go through tfdist's aggregation at all.

        A compressor object counts even when it is the identity
        (``NoneCompressor()``): that sends gradients through the same path
        uncompressed, the reference the benchmarks compare with.
        """
        return self.name != "none" or self.compressor is not None

    def __str__(self) -> str:
        if self.compressor is not None:
            text = repr(self.compressor)
        else:
            text = self.name if self.param is None else f"{self.name}:{self.param}"
        if self.error_feedback is not None:
            text += f" (error_feedback={self.error_feedback})"
        if self.resolved is not None:
            text += f" -> {self.resolved}"
        return text


def _bad(value: Any, expected: str) -> ConfigError:
    return ConfigError(
        "compression",
        value,
        expected,
        source="strategy_from_config",
        hint="Use one of: "
        + ", ".join(COMPRESSOR_NAMES)
        + ", optionally with a parameter, e.g. 'topk:0.01' or 'powersgd:4'.",
    )


def parse_compression(setting: Any) -> CompressionSetting:
    """Parses a ``compression=`` setting.

    Args:
        setting: None or ``"none"`` (no compression); a name from
            :data:`COMPRESSOR_NAMES`; a short form ``"topk:0.01"``,
            ``"randomk:0.05"``, ``"powersgd:4"`` or ``"qsgd:16"``; a
            :class:`CompressionSetting`; ``"auto"`` (chosen from the measured
            link, see :mod:`tfdist.compression.auto`); or a compressor object (anything
            with a ``name`` attribute naming its kind).

    Returns:
        The parsed setting.

    Raises:
        ConfigError: The setting is not one of the above, or its parameter is
            out of range. The message names the value received.
    """
    if setting is None:
        return CompressionSetting("none")
    if isinstance(setting, CompressionSetting):
        return setting
    if not isinstance(setting, str):
        name = getattr(setting, "name", None)
        if isinstance(name, str) and name in COMPRESSOR_NAMES:
            return CompressionSetting(name, compressor=setting)
        raise _bad(setting, "a compressor name or a compressor object")
    text = setting.strip().lower()
    name, sep, raw = text.partition(":")
    if name not in COMPRESSOR_NAMES:
        raise _bad(setting, "one of " + ", ".join(map(repr, COMPRESSOR_NAMES)))
    kind = COMPRESSOR_NAMES[name]
    if not sep:
        return CompressionSetting(name)
    if kind is None:
        raise _bad(setting, f"no parameter for {name!r}")
    if kind == "ratio":
        try:
            ratio = float(raw)
        except ValueError:
            raise _bad(setting, f"'{name}:RATIO' with RATIO a number in (0, 1]") from None
        if not 0.0 < ratio <= 1.0:
            raise _bad(setting, f"'{name}:RATIO' with RATIO in (0, 1]")
        return CompressionSetting(name, ratio)
    try:
        number = int(raw)
    except ValueError:
        raise _bad(setting, f"'{name}:N' with N a positive integer ({kind})") from None
    if number < 1:
        raise _bad(setting, f"'{name}:N' with N a positive integer ({kind})")
    return CompressionSetting(name, number)


def with_error_feedback(
    setting: CompressionSetting, error_feedback: bool | None
) -> CompressionSetting:
    """``setting`` with ``error_feedback`` (``strategy_from_config``'s
    ``error_feedback=``; None: the compressor's default)."""
    return dataclasses.replace(setting, error_feedback=error_feedback)


#: Whether error feedback is on by default: the biased compressors need it
#: to converge; the unbiased or near-lossless ones do not. Random-k is
#: unbiased (scaled) by default; ``RandomKCompressor(unbiased=False)`` gets
#: error feedback (see :func:`default_error_feedback`).
_DEFAULT_EF = {
    "none": False,
    "fp16": False,
    "bf16": False,
    "qsgd": False,
    "randomk": False,
    "topk": True,
    "sign": True,
    "powersgd": True,
    "auto": False,  # Each candidate keeps its own default.
}


def default_error_feedback(name: Any) -> bool:
    """Whether error feedback should be on by default for a compressor.

    True for top-k and sign (biased: the literature needs error feedback
    for convergence); False for none, fp16, bf16, QSGD and random-k
    (lossless, nearly so, or unbiased; random-k's default scaling does not
    admit error feedback). A ``RandomKCompressor(unbiased=False)`` object
    gets True.

    Args:
        name: A name from :data:`COMPRESSOR_NAMES`, or a compressor.
    """
    if not isinstance(name, str):
        if getattr(name, "name", None) == "randomk":
            return bool(getattr(name, "contractive", False))
        name = getattr(name, "name", name)
    if name not in COMPRESSOR_NAMES:
        raise ConfigError("name", name, "one of " + ", ".join(map(repr, COMPRESSOR_NAMES)))
    return _DEFAULT_EF[name]
