""":func:`to_yaml`: the YAML of a manifest for ``kubectl apply -f -``, without PyYAML.

Plain scalars only where YAML reads them back as the same string; everything
else is double-quoted with escapes.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

# --------------------------------------------------------------------------
# A small YAML emitter.
# --------------------------------------------------------------------------

# Plain (unquoted) strings: start with a letter, '_' or '/', so that no YAML
# 1.1 or 1.2 resolver reads a number, date, null or special float; ':' only
# between word characters; no space, '#', ',', quote or bracket anywhere.
_PLAIN_RE = re.compile(r"[A-Za-z_/][A-Za-z0-9_./@+=-]*(:[A-Za-z0-9_./@+=-]+)*")
# Words that YAML 1.1 (PyYAML, go-yaml v2 under kubectl) reads as bool/null.
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}
_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "\0": "\\0",
    "\a": "\\a",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\v": "\\v",
    "\f": "\\f",
    "\r": "\\r",
    "\x1b": "\\e",
}


def _printable(code: int) -> bool:
    """Characters YAML allows unescaped in a double-quoted scalar (no line breaks)."""
    return (
        0x20 <= code <= 0x7E
        or (0xA0 <= code <= 0xD7FF and code not in (0x2028, 0x2029))
        or (0xE000 <= code <= 0xFFFD and code != 0xFEFF)
        or 0x10000 <= code <= 0x10FFFF
    )


def _quote(text: str) -> str:
    """A double-quoted YAML scalar; anything unusual is escaped."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif _printable(code):
            out.append(char)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        if "e" in text and "." not in text:  # YAML 1.1 floats need a '.'.
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    if isinstance(value, str):
        if _PLAIN_RE.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return _quote(value)
    raise TypeError(f"to_yaml: cannot write a {type(value).__name__}: {value!r}")


def _lines(value: Any, indent: int) -> list[str]:
    """Block-style lines of a non-empty mapping or list at ``indent``."""
    pad = " " * indent
    lines = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"to_yaml: mapping keys must be strings, not {key!r}")
            head = f"{pad}{_scalar(key)}:"
            if _is_block(item):
                lines.append(head)
                lines.extend(_lines(item, indent + 2))
            else:
                lines.append(f"{head} {_inline(item)}")
    else:
        for item in value:
            if _is_block(item):
                nested = _lines(item, indent + 2)
                lines.append(f"{pad}- {nested[0][indent + 2 :]}")
                lines.extend(nested[1:])
            else:
                lines.append(f"{pad}- {_inline(item)}")
    return lines


def _is_block(value: Any) -> bool:
    return isinstance(value, (Mapping, list, tuple)) and len(value) > 0


def _inline(value: Any) -> str:
    """A scalar, or ``{}`` / ``[]`` for an empty mapping or list."""
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _scalar(value)


def to_yaml(value: Any) -> str:
    """Writes dicts, lists and scalars as block-style YAML.

    Deterministic (mapping keys keep their order) and readable by any YAML
    1.1 or 1.2 parser (PyYAML, ``kubectl``): strings that a parser could
    read as something else (``yes``, ``on``, ``null``, ``2222``,
    ``1e3``, ``--flag``, strings with ``: `` or ``#``...) are double-quoted,
    with escapes for control and non-printable characters.

    Args:
        value: A dict (string keys), list, tuple, str, int, float, bool or
            None, nested freely.

    Returns:
        The YAML document, ending with a newline.

    Raises:
        TypeError: A value of another type, or a non-string key.
    """
    if _is_block(value):
        return "\n".join(_lines(value, 0)) + "\n"
    return _inline(value) + "\n"
