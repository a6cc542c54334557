"""tfdist's layers import in one direction, without cycles, and the lowest
import no TensorFlow.

The layers, lowest first (docs/reference/layout.md); a module may import its own layer
and the ones below, at module level or inside a function:

    base (errors, plugins, compat, ...) < spec < record < transport < compression
    < strategies < parallel < distribution < pipeline < training < profiling
    < engines < horovod < cli

The facade (``tfdist/__init__.py``, which names the plugins) sits above
every layer. The import graph is read
from the source (``import``, ``from ... import``, ``importlib.import_module``
with a constant, and the values of lazy-name tables), so a forbidden import
fails here even on a code path no other test runs. Two fresh interpreters check
what actually loads.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfdist"

LAYERS = (
    ("base", ("tfdist.errors", "tfdist._lazy", "tfdist.plugins", "tfdist.compat")),
    ("spec", ("tfdist.spec",)),
    ("record", ("tfdist.record",)),
    ("transport", ("tfdist.transport",)),
    ("compression", ("tfdist.compression",)),
    ("strategies", ("tfdist.strategies",)),
    ("parallel", ("tfdist.parallel",)),
    ("distribution", ("tfdist.distribution",)),
    ("pipeline", ("tfdist.pipeline",)),
    ("training", ("tfdist.training",)),
    ("profiling", ("tfdist.profiling",)),
    ("engines", ("tfdist.engines",)),
    ("horovod", ("tfdist.horovod",)),
    ("cli", ("tfdist.cli",)),
)
#: Above every layer: the facade, ``python -m tfdist`` and ``tfdist.spark``
#: (users' spelling of tfdist.engines.spark).
FACADE = ("tfdist", "tfdist.__main__", "tfdist.spark")
#: Loaded by the facade once Keras is imported (its import hook wraps Keras's
#: set_distribution, tfdist.distribution.guard), whichever layer imported Keras.
FACADE_HOOKS = ("tfdist.distribution", "tfdist.distribution.guard")
#: What the launcher-side processes may never load.
NO_TENSORFLOW = ("tensorflow", "keras", "jax", "torch")


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names[name] = path
    return names


MODULES = _module_names()


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported tfdist module, line, at module level)`` for every import."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, bool]] = []

    def add(name: str, line: int, top: bool) -> None:
        if name == "tfdist" or name.startswith("tfdist."):
            # ``from pkg import sub`` names the submodule when there is one.
            found.append((name, line, top))

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno, inner)
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, child, path.name == "__init__.py")
                for alias in child.names:
                    full = f"{target}.{alias.name}"
                    add(full if full in MODULES else target, child.lineno, inner)
            elif (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr == "import_module"
                and child.args
                and isinstance(child.args[0], ast.Constant)
                and isinstance(child.args[0].value, str)
            ):
                add(child.args[0].value, child.lineno, False)
            elif (
                isinstance(child, ast.Assign)
                and isinstance(child.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in child.targets)
            ):
                # A lazy-name table: its values are modules, absolute or relative.
                for value in child.value.values:
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        name = value.value if "." in value.value else f"{module}.{value.value}"
                        add(name, child.lineno, False)
            visit(child, inner)

    visit(tree, True)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def test_every_module_belongs_to_a_layer():
    loose = [
        name for name, path in MODULES.items() if name not in FACADE and layer_of(name) is None
    ]
    assert loose == [], f"modules in no layer of tests/test_layering.py: {loose}"


def test_no_module_imports_a_higher_layer():
    upward = []
    for name, imports in GRAPH.items():
        mine = layer_of(name)
        if mine is None:
            continue
        for target, line, top in imports:
            theirs = layer_of(target)
            if theirs is None or theirs > mine:
                where = "module level" if top else "inside a function"
                upward.append(
                    f"{name}:{line} imports {target} ({where}); "
                    f"{LAYERS[mine][0]} is below "
                    f"{LAYERS[theirs][0] if theirs is not None else 'the facade'}"
                )
    assert upward == [], "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def _edges(module_level_only: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, imports in GRAPH.items():
        if name in FACADE:
            continue
        for target, _, top in imports:
            # ``from tfdist.pkg import x`` runs pkg/__init__ as well.
            if target in MODULES and target != name and (top or not module_level_only):
                edges.setdefault(name, set()).add(target)
    return edges


def test_no_import_cycle_between_modules():
    """Imports inside functions included: a function that imports a module
    importing its own hides a circle the module-level graph does not show."""
    assert _cycles(_edges(module_level_only=False)) == []


def test_no_import_cycle_between_packages():

    def package(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else name

    edges: dict[str, set[str]] = {}
    for name, targets in _edges(module_level_only=False).items():
        for target in targets:
            if package(target) != package(name):
                edges.setdefault(package(name), set()).add(package(target))
    assert _cycles(edges) == []


def test_the_checks_catch_a_forbidden_import(tmp_path):
    """The graph reader sees imports inside functions and lazy tables."""
    source = tmp_path / "probe.py"
    source.write_text(
        "_LAZY = {'x': 'tfdist.engines.launch'}\n"
        "def f():\n    from tfdist.training import steps\n"
        "import tfdist.cli\n"
    )
    found = {(target, top) for target, _, top in imports_of("tfdist.spec.probe", source)}
    assert found == {
        ("tfdist.engines.launch", False),
        ("tfdist.training.steps", False),
        ("tfdist.cli", True),
    }
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _loaded_after(code: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


#: The layers that need TensorFlow (or define what runs with it).
TENSORFLOW_LAYERS = (
    "tfdist.record",
    "tfdist.transport",
    "tfdist.compression",
    "tfdist.strategies",
    "tfdist.parallel",
    "tfdist.distribution",
    "tfdist.training",
    "tfdist.profiling",
    "tfdist.horovod",
)


def launcher_side() -> list[str]:
    """Every module of the launcher side: the spec layer, the CLI and the
    engines but their worker side (tfdist.engines.worker), and the plugin list."""
    return [
        name
        for name in MODULES
        if name.startswith(("tfdist.spec", "tfdist.cli", "tfdist.engines"))
        and not (name == "tfdist.engines.worker" or name.startswith("tfdist.engines.worker."))
    ] + ["tfdist.plugins"]


def test_the_launchers_engines_import_no_layer_that_needs_tensorflow():
    """Read from the source, inside functions too: the launcher hands work to
    processes that import TensorFlow; it imports none of it itself. (The CLI's
    info and profile commands do, inside the command, for this process.)"""
    found = [
        f"{name}:{line} imports {target}"
        for name in launcher_side()
        if name.startswith(("tfdist.engines", "tfdist.spec"))
        for target, line, _ in GRAPH[name]
        if target.startswith(TENSORFLOW_LAYERS)
    ]
    assert found == []


def test_the_spec_layer_and_the_launcher_load_no_tensorflow():
    launcher = launcher_side()
    loaded = _loaded_after("\n".join(f"import {name}" for name in sorted(launcher)))
    assert set(launcher) <= set(loaded)
    heavy = sorted(m for m in loaded if m.split(".")[0] in NO_TENSORFLOW)
    assert heavy == []
    # The spec layer alone loads nothing of the layers above it.
    loaded = _loaded_after("import tfdist.spec, tfdist.spec.detect, tfdist.spec.options")
    above = [m for m in loaded if m.startswith("tfdist.") and (layer_of(m) or 0) > 1]
    assert above == []


def test_importing_each_layer_loads_nothing_above_it():
    """In one fresh interpreter, the layers are imported lowest first; after
    each, no module of a higher layer may be loaded."""
    order = [
        [
            name
            for name in sorted(MODULES)
            if layer_of(name) == index and name not in ("tfdist.engines.spark",)
        ]  # Needs pyspark.
        for index in range(len(LAYERS))
    ]
    code = "\n".join(
        [
            "import importlib, json, sys",
            f"order = {order!r}",
            f"layers = {[p for _, p in LAYERS]!r}",
            "def layer(m):",
            "    for i, ps in enumerate(layers):",
            "        if any(m == p or m.startswith(p + '.') for p in ps): return i",
            "report = []",
            "for i, names in enumerate(order):",
            "    for n in names: importlib.import_module(n)",
            "    above = sorted(m for m in sys.modules if m.startswith('tfdist.')",
            "                   and (layer(m) or 0) > i)",
            "    report.append([i, above])",
            "print(json.dumps(report))",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == len(LAYERS)
    leaks = {LAYERS[i][0]: [m for m in above if m not in FACADE_HOOKS] for i, above in report}
    assert {layer: above for layer, above in leaks.items() if above} == {}
