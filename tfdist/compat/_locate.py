"""The lookup behind :mod:`tfdist.compat.keras_src` and :mod:`tfdist.compat.tf_python`.

Each of those modules holds a table, tfdist name -> candidate locations, and
serves the names lazily through PEP 562 ``__getattr__``. This module holds
the shared machinery: parsing a location, trying candidates in order,
caching, and the error raised when no candidate exists.

Imports nothing heavy: a location's module is imported only when its name is
first looked up, so importing a table module never loads TensorFlow.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from tfdist.errors import TfdistError

__all__ = ["InternalNotFound", "Table", "installed_versions"]


class InternalNotFound(TfdistError, ImportError):
    """A Keras/TF internal tfdist needs exists at none of its known locations.

    An ``ImportError`` so that ``from tfdist.compat.keras_src import X``
    shows this message as is. It cannot also be an ``AttributeError``: CPython
    refuses a class with both bases (their instance layouts conflict). Where
    an ``AttributeError`` would have been caught (``hasattr``, ``getattr``
    with a default) it propagates instead: ask ``unresolved()`` first.

    Attributes:
        tfdist_name: The table's name, e.g. ``"KerasVariable"``.
        tried: Each candidate location with why it failed.
    """

    def __init__(self, message: str, *, tfdist_name: str = "", tried: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tfdist_name = tfdist_name
        self.tried = tried


def installed_versions() -> str:
    """``"Keras 3.15.1, TensorFlow 2.21.0"``, without importing either."""
    from tfdist.compat.versions import installed

    found = installed()
    return ", ".join(
        f"{label} {found[name] or 'not installed'}"
        for label, name in (("Keras", "keras"), ("TensorFlow", "tensorflow"))
    )


def load(location: str) -> Any:
    """The object at ``"module.path:attr"`` (``attr`` may be dotted) or the
    module ``"module.path"``.

    Raises:
        ImportError: The module does not exist or fails to import.
        AttributeError: The module has no such attribute.
    """
    module_name, _, attribute = location.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in attribute.split(".") if attribute else ():
        value = getattr(value, part)
    return value


class Table:
    """Serves one table's names: the body of a module's ``__getattr__``,
    ``__dir__`` and ``unresolved()``.

    Args:
        module: The serving module's ``__name__``, for messages.
        locations: tfdist name -> candidate locations, first match wins. Read
            at each lookup, so a test may patch entries in.
    """

    def __init__(self, module: str, locations: Mapping[str, tuple[str, ...]]) -> None:
        self.module = module
        self.locations = locations
        # name -> (candidates it was resolved from, value). Keyed with the
        # candidates too so that a patched entry is not served a stale value.
        self._cache: dict[str, tuple[tuple[str, ...], Any]] = {}

    def resolve(self, name: str) -> Any:
        """The object for table name ``name``.

        Raises:
            AttributeError: ``name`` is not in the table.
            InternalNotFound: No candidate location exists here.
        """
        candidates = self.locations.get(name)
        if candidates is None:
            raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
        candidates = tuple(candidates)
        cached = self._cache.get(name)
        if cached is not None and cached[0] == candidates:
            return cached[1]
        tried = []
        for location in candidates:
            try:
                value = load(location)
            except (ImportError, AttributeError) as error:
                # A module that exists but fails on an import of its own also
                # lands here; the reason is kept so the message tells them apart.
                tried.append(f"{location} ({type(error).__name__}: {error})")
                continue
            self._cache[name] = (candidates, value)
            return value
        raise InternalNotFound(
            f"tfdist needs {name!r} ({self.module}), found at none of its known "
            f"locations with {installed_versions()}. Tried: {'; '.join(tried)}. "
            f"tfdist does not support this version yet: add its location to "
            f"{self.module.replace('.', '/')}.py.",
            tfdist_name=name,
            tried=tuple(tried),
        )

    def dir(self, namespace: Iterable[str]) -> list[str]:
        """The module's own names plus every table name, for ``dir()``."""
        return sorted(set(namespace) | set(self.locations))

    def unresolved(self) -> dict[str, str]:
        """Table name -> why it resolves nowhere, for each such name.

        Resolves every entry, so it imports Keras and TensorFlow.
        """
        missing = {}
        for name in list(self.locations):
            try:
                self.resolve(name)
            except Exception as error:  # noqa: BLE001 - a report, not a failure.
                missing[name] = f"{type(error).__name__}: {error}"
        return missing
