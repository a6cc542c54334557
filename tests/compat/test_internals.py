"""Every Keras/TF internal goes through tfdist.compat.keras_src and tf_python.

The scan reads tfdist's source (imports at any depth and
``importlib.import_module`` with a constant), so a private import fails here
even on a code path no other test runs. The tables are then checked against
the installed Keras and TensorFlow: every entry resolves, the first existing
candidate wins, and a name found nowhere fails with a message a user can act
on.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tfdist.compat import _locate, keras_src, tf_python
from tfdist.compat.keras_src import InternalNotFound
from tfdist.errors import TfdistError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tfdist"
PRIVATE = (
    "keras.src",
    "tensorflow.python",
    "tensorflow.core",
    "tensorflow.compiler",
    "tensorflow.tsl",
)
TABLES = (keras_src, tf_python)

#: (file, enclosing function, private module) of each private import still
#: allowed outside tfdist/compat: none. The test fails on any, and on an
#: entry here that no longer matches one.
ALLOWED: set[tuple[str, str, str]] = set()


def _is_private(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRIVATE)


def private_imports(source: str) -> list[tuple[int, str, str]]:
    """``(line, enclosing function or "<module>", module)`` per private import."""
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
            if isinstance(child, ast.Import):
                found.extend(
                    (child.lineno, scope, a.name) for a in child.names if _is_private(a.name)
                )
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                # ``from keras import src`` names the private module in the alias.
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    module = child.module if _is_private(child.module) else full
                    if _is_private(module):
                        found.append((child.lineno, scope, module))
                        break
            elif (
                isinstance(child, ast.Call)
                and child.args
                and isinstance(child.args[0], ast.Constant)
                and isinstance(child.args[0].value, str)
                and _is_private(child.args[0].value)
                and (
                    (isinstance(child.func, ast.Attribute) and child.func.attr == "import_module")
                    or (
                        isinstance(child.func, ast.Name)
                        and child.func.id in ("__import__", "import_module")
                    )
                )
            ):
                found.append((child.lineno, scope, child.args[0].value))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def test_the_scan_catches_every_spelling():
    source = "\n".join(
        [
            "import keras.src.backend",
            "from tensorflow.python.eager import context",
            "from keras import src",
            "from tensorflow import tsl as t",
            "import keras, tensorflow as tf",
            "from keras import ops",
            "from tfdist.compat.keras_src import TFOptimizer",
            "def f():",
            "    from tensorflow.core.framework import graph_pb2",
            "    importlib.import_module('tensorflow.compiler.xla')",
            "    importlib.import_module('keras.ops')",
            "class C:",
            "    def m(self):",
            "        __import__('keras.src.tree')",
        ]
    )
    assert private_imports(source) == [
        (1, "<module>", "keras.src.backend"),
        (2, "<module>", "tensorflow.python.eager"),
        (3, "<module>", "keras.src"),
        (4, "<module>", "tensorflow.tsl"),
        (9, "f", "tensorflow.core.framework"),
        (10, "f", "tensorflow.compiler.xla"),
        (14, "C.m", "keras.src.tree"),
    ]


def test_no_private_import_outside_compat():
    found: set[tuple[str, str, str]] = set()
    where: dict[tuple[str, str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("tfdist/compat/"):
            continue
        for line, scope, module in private_imports(path.read_text()):
            key = (relative, scope, module)
            found.add(key)
            where.setdefault(key, []).append(f"{relative}:{line} imports {module} (in {scope})")
    forbidden = [text for key in sorted(found - ALLOWED) for text in where[key]]
    assert forbidden == [], (
        "import these through tfdist.compat.keras_src / tfdist.compat.tf_python "
        "(add a table entry if needed):\n" + "\n".join(forbidden)
    )
    stale = sorted(ALLOWED - found)
    assert stale == [], f"ALLOWED entries that match no import any more; remove them: {stale}"


#: A private access marked with a noqa for SLF001 on its line (one rule or several).
MARKED = re.compile(r"#\s*noqa:[A-Z0-9, ]*\bSLF001\b")

#: (file, the code on the line) of each private access still marked outside
#: tfdist/compat, and why it cannot move there. The test fails on any other,
#: and on an entry here that no longer matches one.
ALLOWED_REACHES: set[tuple[str, str]] = {
    # CPython's exit steps, in the warm pool's fork server: run as a script,
    # it imports nothing of tfdist (``import tfdist`` installs the Keras
    # import hook), so it cannot import tfdist.compat.
    ("tfdist/engines/worker/warm_server.py", "threading._shutdown()"),
    ("tfdist/engines/worker/warm_server.py", "atexit._run_exitfuncs()"),
    # tfdist's own State's entry hook, not a Keras/TF/PySpark internal: kept
    # out of the public API, which is Horovod's.
    ("tfdist/horovod/elastic.py", "state._enter()"),
}


def marked_reaches(root: Path) -> dict[tuple[str, str], list[str]]:
    """``(file, code) -> ["file:line", ...]`` per line under ``root/tfdist``,
    outside tfdist/compat, that carries a ``# noqa: SLF001``."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted((root / "tfdist").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("tfdist/compat/"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = MARKED.search(line)
            if match:
                code = line[: match.start()].strip()
                found.setdefault((relative, code), []).append(f"{relative}:{number}")
    return found


def check_reaches(root: Path, allowed: set[tuple[str, str]]) -> None:
    """Fails on a marked private access under ``root/tfdist`` outside
    tfdist/compat that ``allowed`` does not name, and on a stale entry."""
    found = marked_reaches(root)
    forbidden = [where for key in sorted(set(found) - allowed) for where in found[key]]
    assert forbidden == [], (
        "reach Keras/TF/PySpark internals through an accessor in tfdist/compat "
        "(keras_private, tf_private, spark_private) or a public API, not a "
        "# noqa: SLF001:\n" + "\n".join(forbidden)
    )
    stale = sorted(allowed - set(found))
    assert stale == [], f"ALLOWED_REACHES entries that match no line any more; remove them: {stale}"


def test_no_private_access_is_marked_outside_compat():
    check_reaches(ROOT, ALLOWED_REACHES)


def test_a_marked_private_access_outside_compat_fails(tmp_path):
    (tmp_path / "tfdist" / "compat").mkdir(parents=True)
    (tmp_path / "tfdist" / "mod.py").write_text(
        "x = layer._kernel  # noqa: SLF001 - a reach\n"
        "y = layer._bias  # noqa: BLE001, SLF001 - another\n"
        "z = 1  # SLF001 in a comment, unmarked\n"
    )
    (tmp_path / "tfdist" / "compat" / "keras_private.py").write_text(
        "x = layer._kernel  # noqa: SLF001 - compat may\n"
    )
    assert sorted(marked_reaches(tmp_path)) == [
        ("tfdist/mod.py", "x = layer._kernel"),
        ("tfdist/mod.py", "y = layer._bias"),
    ]
    with pytest.raises(AssertionError, match=r"tfdist/mod\.py:1\n.*tfdist/mod\.py:2"):
        check_reaches(tmp_path, set())
    # Allowed, both pass; an allowed line that is gone is stale.
    check_reaches(
        tmp_path, {("tfdist/mod.py", "x = layer._kernel"), ("tfdist/mod.py", "y = layer._bias")}
    )
    with pytest.raises(AssertionError, match="match no line"):
        check_reaches(
            tmp_path,
            {
                ("tfdist/mod.py", "x = layer._kernel"),
                ("tfdist/mod.py", "y = layer._bias"),
                ("tfdist/gone.py", "w._v"),
            },
        )


def _libraries_loaded_by(modules: list[str], libraries: tuple[str, ...]) -> list[str]:
    """The modules of ``libraries`` a fresh interpreter holds after importing ``modules``."""
    code = (
        f"import sys, json, {', '.join(modules)}\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        f"if m.split('.')[0] in {libraries!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_accessor_modules_loads_no_library():
    accessors = [f"tfdist.compat.{m}" for m in ("keras_private", "tf_private", "spark_private")]
    assert _libraries_loaded_by(accessors, ("tensorflow", "keras", "pyspark")) == []


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.__name__.rsplit(".", 1)[-1])
def test_importing_a_table_loads_no_tensorflow(table):
    assert _libraries_loaded_by([table.__name__], ("tensorflow", "keras")) == []


@pytest.mark.parametrize(
    "table, name",
    [(t, n) for t in TABLES for n in t.LOCATIONS],
    ids=lambda x: x if isinstance(x, str) else x.__name__.rsplit(".", 1)[-1],
)
def test_every_entry_resolves_here(table, name):
    value = getattr(table, name)
    wants_module = all(":" not in location for location in table.LOCATIONS[name])
    assert isinstance(value, types.ModuleType) == wants_module, (name, value)
    # It is the object at one of its candidates (the first that exists).
    first = None
    for location in table.LOCATIONS[name]:
        try:
            first = _locate.load(location)
            break
        except (ImportError, AttributeError):
            continue
    assert value is first


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.__name__.rsplit(".", 1)[-1])
def test_unresolved_is_empty_here(table):
    assert table.unresolved() == {}


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.__name__.rsplit(".", 1)[-1])
def test_a_name_found_nowhere_names_the_locations_and_versions(table, monkeypatch):
    import keras
    import tensorflow as tf

    missing = (
        "tfdist_no_such_package.sub:Thing",
        "keras:no_such_attribute_xyz",
        "tensorflow.python.no_such_module",
    )
    monkeypatch.setitem(table.LOCATIONS, "FakeMissing", missing)
    with pytest.raises(InternalNotFound) as info:
        table.FakeMissing  # noqa: B018 - the lookup itself must raise
    message = str(info.value)
    assert "'FakeMissing'" in message
    for location in missing:
        assert location in message
    assert f"Keras {keras.__version__}" in message
    assert f"TensorFlow {tf.__version__}" in message
    assert info.value.tfdist_name == "FakeMissing"
    assert len(info.value.tried) == len(missing)
    assert isinstance(info.value, ImportError) and isinstance(info.value, TfdistError)
    # An import statement shows the same message (not "cannot import name").
    namespace: dict = {}
    with pytest.raises(InternalNotFound, match="FakeMissing.*no_such_attribute_xyz"):
        exec(f"from {table.__name__} import FakeMissing", namespace)  # noqa: S102 - an import statement against the test's own table
    assert "FakeMissing" in table.unresolved()
    # A name outside the table is a plain AttributeError (hasattr works).
    assert not hasattr(table, "NotInTheTable")


def test_internal_not_found_is_shared():
    assert keras_src.InternalNotFound is tf_python.InternalNotFound is _locate.InternalNotFound


@pytest.mark.parametrize(
    "table, candidates, expected, other",
    [
        (
            keras_src,
            (
                "keras.src.no_such_module:BaseOptimizer",
                "keras:NoSuchAttribute",
                "keras.src.optimizers.base_optimizer:BaseOptimizer",
                "keras:optimizers.Optimizer",
            ),
            ("keras.src.optimizers.base_optimizer", "BaseOptimizer"),
            ("keras.optimizers", "Optimizer"),
        ),
        (
            tf_python,
            (
                "tensorflow.python.no_such_module",
                "tensorflow.python.eager.context",
                "tensorflow.python.eager.backprop",
            ),
            ("tensorflow.python.eager.context", None),
            ("tensorflow.python.eager.backprop", None),
        ),
    ],
    ids=["keras_src", "tf_python"],
)
def test_the_first_existing_candidate_wins(table, candidates, expected, other, monkeypatch):
    def at(module: str, attribute: str | None):
        value = importlib.import_module(module)
        return value if attribute is None else getattr(value, attribute)

    monkeypatch.setitem(table.LOCATIONS, "FakeMoved", candidates)
    value = table.FakeMoved
    assert value is at(*expected)
    assert value is not at(*other)
    assert "FakeMoved" in dir(table)


def test_a_resolved_name_is_cached_and_a_patched_entry_is_not_stale(monkeypatch):
    monkeypatch.setitem(keras_src.LOCATIONS, "FakeCached", ("keras.src.tree",))
    first = keras_src.FakeCached

    def fail(location):
        raise AssertionError(f"looked up {location} again")

    with monkeypatch.context() as patched:
        patched.setattr(_locate, "load", fail)
        assert keras_src.FakeCached is first
    monkeypatch.setitem(keras_src.LOCATIONS, "FakeCached", ("keras.src.backend",))
    assert keras_src.FakeCached is importlib.import_module("keras.src.backend")


def test_dir_lists_the_table():
    for table in TABLES:
        names = dir(table)
        assert set(table.LOCATIONS) <= set(names)
        assert {"InternalNotFound", "LOCATIONS", "unresolved"} <= set(names)
