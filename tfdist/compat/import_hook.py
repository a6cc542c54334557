"""Runs a function when a module finishes importing, or at once if it has.

``import tfdist`` must not import Keras (the launcher and the spec commands
run without TensorFlow), yet Keras's ``set_distribution`` must be wrapped
before a user calls it, whichever of the two they import first
(:mod:`tfdist.distribution.guard`). A finder on ``sys.meta_path`` runs the
function right after the module's own code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

__all__ = ["after_import"]

_lock = threading.Lock()
#: Module name -> functions ("package.module:function") still to run.
_pending: dict[str, list[str]] = {}


def _run(target: str, module: ModuleType) -> None:
    path, _, name = target.partition(":")
    try:
        getattr(importlib.import_module(path), name)(module)
    except Exception as error:  # noqa: BLE001 - the user's import must go on
        warnings.warn(
            f"tfdist: {target} failed after {module.__name__} was imported, "
            f"so what it adds is off: {type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=2,
        )


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders return."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_run(module: ModuleType) -> None:
            exec_module(module)
            with _lock:
                targets = _pending.pop(fullname, [])
            for target_name in targets:
                _run(target_name, module)

        loader.exec_module = exec_then_run
        return spec


_finder = _Finder()


def after_import(module: str, target: str) -> None:
    """Calls ``target`` (``"package.module:function"``) with ``module`` once it
    is imported: now if it already is, else right after its import.

    A failure is a warning, never an error in the user's import.
    """
    loaded = sys.modules.get(module)
    if (
        loaded is not None
        and getattr(getattr(loaded, "__spec__", None), "_initializing", False) is False
    ):
        _run(target, loaded)
        return
    with _lock:
        _pending.setdefault(module, []).append(target)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
