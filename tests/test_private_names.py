"""No tfdist module reaches into another's private names.

A name with a leading underscore belongs to its module. What another module
of tfdist needs is public within the package (no underscore), or lives in the
module that uses it. Read from the source, so a lazy import inside a function
counts too:

* ``from tfdist.x import _name`` (also relative: ``from .x import _name``);
* ``x._name`` where ``x`` is bound to another tfdist module (``import
  tfdist.x as x``, ``from tfdist import x``, ``import tfdist.x`` then
  ``tfdist.x._name``), and ``getattr(x, "_name")`` and its siblings.

Dunder names (``__version__``, ``__all__``) are allowed.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfdist"
#: Calls whose second argument names an attribute of their first.
ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def module_names() -> dict[str, Path]:
    """Every tfdist module's dotted name -> its file."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _in_tfdist(module: str) -> bool:
    return module == "tfdist" or module.startswith("tfdist.")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.expr) -> list[str] | None:
    """``["a", "b", "c"]`` for ``a.b.c``; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(
    path: Path, module: str, modules: Collection[str], is_package: bool = False
) -> list[str]:
    """``"file:line: ..."`` for every private name of another tfdist module
    that the file of ``module`` (at ``path``) imports or reads.

    ``modules``: the dotted names of tfdist's modules, to tell a module from
    a class or function.
    """
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # Local name -> the tfdist module it is.

    def report(node: ast.AST, what: str) -> None:
        found.append((node.lineno, f"{path}:{node.lineno}: {what}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _in_tfdist(alias.name):
                    continue
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound["tfdist"] = "tfdist"
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            if not _in_tfdist(source):
                continue
            for alias in node.names:
                if _private(alias.name) and source != module:
                    report(node, f"from {source} import {alias.name}")
                if f"{source}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"

    def module_of(node: ast.expr) -> str | None:
        """The tfdist module ``node`` (a name or dotted name) is, if any."""
        parts = _dotted(node)
        if parts is None or parts[0] not in bound:
            return None
        name = ".".join([bound[parts[0]], *parts[1:]])
        return name if name in modules or name == "tfdist" else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = module_of(node.value)
            if owner is not None and owner != module:
                report(node, f"{owner}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_CALLS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            owner = module_of(node.args[0])
            if owner is not None and owner != module:
                report(node, f"{node.func.id}({owner}, {node.args[1].value!r})")
    return [text for _, text in sorted(found)]


def test_no_tfdist_module_uses_another_ones_private_names():
    modules = module_names()
    found = []
    for name, path in sorted(modules.items()):
        found += private_uses(path, name, modules, is_package=path.name == "__init__.py")
    assert not found, (
        "private names used across tfdist's modules; make them public (no "
        "underscore) in the defining module, or move them to their one user:\n" + "\n".join(found)
    )


def test_the_scan_finds_what_it_must(tmp_path):
    modules = set(module_names())
    source = tmp_path / "injected.py"
    source.write_text(
        "from __future__ import annotations\n"  # 1
        "import tfdist.spec.names as names\n"  # 2
        "import tfdist.spec.address\n"  # 3
        "from tfdist import __version__, errors\n"  # 4
        "from tfdist.spec.names import _short, did_you_mean\n"  # 5
        "from .names import _quoted\n"  # 6
        "from os import _exit\n"  # 7
        "from tfdist.spec.names import short as _local\n"  # 8
        "\n"  # 9
        "def f(x):\n"  # 10
        "    from tfdist.training.ps.data import _lazy\n"  # 11
        "    names._hidden(x)\n"  # 12
        "    tfdist.spec.address._split(x)\n"  # 13
        "    getattr(errors, '_secret')\n"  # 14
        "    x._own, errors.__doc__, errors.TfdistError._x\n"  # 15
        "    getattr(errors, 'public'), _local(x), _exit\n"  # 16
        "    return names.short(x)\n"
    )  # 17
    found = private_uses(source, "tfdist.spec.injected", modules)
    assert found == [
        f"{source}:5: from tfdist.spec.names import _short",
        f"{source}:6: from tfdist.spec.names import _quoted",
        f"{source}:11: from tfdist.training.ps.data import _lazy",
        f"{source}:12: tfdist.spec.names._hidden",
        f"{source}:13: tfdist.spec.address._split",
        f"{source}:14: getattr(tfdist.errors, '_secret')",
    ]
    # A module's own private names are its own.
    assert private_uses(source, "tfdist.spec.names", modules) == [
        f"{source}:11: from tfdist.training.ps.data import _lazy",
        f"{source}:13: tfdist.spec.address._split",
        f"{source}:14: getattr(tfdist.errors, '_secret')",
    ]
