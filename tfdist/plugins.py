"""Where the layers above the strategies plug into every strategy, so that the
strategies import none of them.

A strategy calls :func:`run` at fixed points of its life: ``"refuse"`` before
one is built (a Keras distribution already set), ``"install"`` while it is
built (the Keras fit fixes, the timeline), ``"created"`` once it is complete,
``"attach"`` for a tensor-parallel mesh, ``"multi_worker"`` and
``"parameter_server"`` for what only those strategies need, and ``"serve"`` on
a parameter server. ``"describe"`` collects extra lines for ``describe()``.

A plugin is a module that defines functions of those names. The facade,
``tfdist/__init__.py``, names the plugins (:data:`tfdist.PLUGINS`) with
:func:`use`; Python runs it before any ``tfdist.*`` module, so every strategy,
however it was imported, gets every plugin. Plugins are imported on the first
event, not before. This module sits in the base layer, beside
:mod:`tfdist.errors`: it imports nothing.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

EVENTS = (
    "refuse",
    "install",
    "created",
    "attach",
    "describe",
    "multi_worker",
    "parameter_server",
    "serve",
)

_names: list[str] = []
_modules: list[ModuleType] | None = None


def use(*modules: str) -> None:
    """Adds plugin modules (by name), run in the order given. Idempotent."""
    global _modules
    for name in modules:
        if name not in _names:
            _names.append(name)
            _modules = None  # Import the new one on the next event.


def plugins() -> list[ModuleType]:
    """The plugin modules, imported on first use."""
    global _modules
    if _modules is None:
        _modules = [importlib.import_module(name) for name in _names]
    return _modules


def run(event: str, *args: Any) -> list[Any]:
    """Calls ``event(*args)`` on every plugin that defines it.

    Returns:
        The results that are not None, in plugin order.
    """
    if event not in EVENTS:
        raise ValueError(f"event: expected one of {EVENTS}, got {event!r}")
    results = []
    for module in plugins():
        handler = getattr(module, event, None)
        if handler is not None:
            result = handler(*args)
            if result is not None:
                results.append(result)
    return results
