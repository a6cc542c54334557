"""Lazy module attributes, so that importing a package skips TensorFlow."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    package: str, table: Mapping[str, str], names: list[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Returns ``(__getattr__, __dir__)`` for a package.

    Args:
        package: The package's ``__name__``.
        table: Public name -> module defining it (absolute, or relative to
            ``package`` when it has no dot).
        names: Every public name of the package, for ``dir()``.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if "." not in module:
            module = f"{package}.{module}"
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # Cache: later lookups skip __getattr__.
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
