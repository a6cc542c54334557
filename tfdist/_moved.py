"""Old import paths that keep working for one release, with a DeprecationWarning.

tfdist's modules moved into packages by layer (issue 20). Each old module is a
stub that calls :func:`moved`: importing it warns once, naming the new path,
and every attribute, private ones included, is looked up in the new modules.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, Sequence


def moved(old: str, new: Sequence[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """Warns that ``old`` moved to ``new[0]`` and returns its forwarding hooks.

    Args:
        old: The old module's name (its ``__name__``).
        new: The new modules, searched in order for each attribute.

    Returns:
        ``(__getattr__, __dir__, __all__)`` for the old module.
    """
    # stacklevel 3: the old module's body is level 2; the import machinery's
    # frames are skipped, so level 3 is the user's import statement.
    warnings.warn(f"{old} is now {new[0]}; the old path works until the next "
                  "release", DeprecationWarning, stacklevel=3)
    public: list[str] = []
    for name in new:
        public += [n for n in getattr(importlib.import_module(name), "__all__", ())
                   if n not in public]

    def __getattr__(attribute: str) -> Any:
        for name in new:
            module = importlib.import_module(name)
            if hasattr(module, attribute):
                return getattr(module, attribute)
        raise AttributeError(f"module {old!r} (now {new[0]}) has no attribute {attribute!r}")

    def __dir__() -> list[str]:
        return sorted(public)

    return __getattr__, __dir__, public
