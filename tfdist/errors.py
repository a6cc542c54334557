"""Exceptions raised by tfdist.

Every error tfdist raises for a bad setting is a :class:`ConfigError` (also a
``ValueError``), whose message always has the same shape::

    <where>: field '<field>': expected <what was expected>. Received: <value>

so that a user can see at once which setting is wrong, what it should be, and
what was actually given. This module imports nothing heavy (no TensorFlow).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TfdistError", "ConfigError", "ClusterSpecError"]

#: Longest rendering of a received value kept in a message.
MAX_VALUE_CHARS = 200


def _shorten(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """Cuts ``text`` to at most ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


def _render(value: Any) -> str:
    """Shows a received value: ``repr`` so that ``'1'`` and ``1`` differ."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error.
        text = f"<{type(value).__name__} object>"
    return _shorten(text)


def _rebuild(cls: type, args: tuple, kwargs: dict) -> ConfigError:
    """Pickle helper: exceptions with keyword-only arguments need it."""
    return cls(*args, **kwargs)


class TfdistError(Exception):
    """Base class of all tfdist errors."""


class ConfigError(TfdistError, ValueError):
    """A bad setting.

    The message names the field, what was expected and what was received,
    e.g. ``"strategy_from_config: field 'strategy': expected one of ...
    Received: 'mirored'"``.

    Args:
        field: Name of the offending setting, e.g. ``'strategy'`` or a JSON
            path such as ``'task.index'``.
        value: The value received (kept as-is in :attr:`value`).
        expected: What was expected, phrased to follow "expected", e.g.
            ``"an integer in [0, 1]"``.
        source: Where the setting came from (a file, ``'TF_CONFIG'``, a
            function name...). Shown at the start of the message.
        line: 1-based line of the problem in ``source``, when known.
        column: 1-based column of the problem in ``source``, when known.
        hint: An extra sentence telling how to fix the problem.
        received: Text to show after "Received:" instead of ``repr(value)``
            (e.g. a JSON parser's message). Truncated like the value.

    Attributes:
        field, value, expected, source, line, column, hint: As given.
    """

    def __init__(
        self,
        field: str,
        value: Any,
        expected: str,
        *,
        source: str | None = None,
        line: int | None = None,
        column: int | None = None,
        hint: str | None = None,
        received: str | None = None,
    ) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        self.source = source
        self.line = line
        self.column = column
        self.hint = hint
        self._received = received
        super().__init__(self._format())

    def _where(self) -> str | None:
        """The message prefix telling where the setting came from."""
        return self.source

    def _format(self) -> str:
        shown = _shorten(self._received) if self._received is not None else _render(self.value)
        message = f"field '{self.field}': expected {self.expected}. Received: {shown}"
        where = self._where()
        if where:
            message = f"{where}: {message}"
        if self.hint:
            message = f"{message}. {_shorten(self.hint, 3 * MAX_VALUE_CHARS)}"
        return message

    def __reduce__(self):
        kwargs = {
            "source": self.source,
            "line": self.line,
            "column": self.column,
            "hint": self.hint,
            "received": self._received,
        }
        return (_rebuild, (type(self), (self.field, self.value, self.expected), kwargs))


class ClusterSpecError(ConfigError):
    """A problem in a TF_CONFIG or cluster spec (everything ``tfdist.spec`` raises).

    The message starts with ``TF_CONFIG`` and, in brackets, where it came from
    (a file path, ``<string>``, ``<dict>``), e.g.::

        TF_CONFIG (cluster_specs/bad.json): field 'task.index': expected an
        integer in [0, 1] (the 'worker' job has 2 tasks). Received: 5

    A ``source`` ending in ``()`` (a function name such as
    ``'spec_from_hosts()'``) is shown alone.
    """

    def _where(self) -> str | None:
        source = self.source
        if not source or source == "TF_CONFIG":
            return "TF_CONFIG"
        if source.endswith("()"):
            return source
        return f"TF_CONFIG ({source})"


def require_int(field: str, value: Any, minimum: int, source: str | None = None) -> int:
    """Returns ``value`` if it is an integer (not a bool) >= ``minimum``.

    Raises:
        ConfigError: Otherwise, naming ``field`` and the value received.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, value, f"an integer >= {minimum}", source=source)
    return value
