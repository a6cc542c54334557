"""Every notebook and example script that imports more than the base install
names the extra that brings it, and that extra does (issue 38, part 5).

A user who ran ``pip install -e .`` and opened notebook 07 met
``ModuleNotFoundError: No module named 'keras_hub'``. Here each notebook's
and each script's imports are read (the code, not a list kept by hand); a
module outside the standard library and the base dependencies must be in
the requirements of an extra that the notebook's first cell or the
script's docstring names as ``pip install -e '.[EXTRA]'``.
"""

from __future__ import annotations

import ast
import json
import re
import sys

import pytest

from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+.
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: The distribution that provides each importable module the notebooks and
#: scripts use beyond the base install. A module missing here fails the test
#: until it is named, so a new import cannot slip past.
PROVIDERS = {"keras_hub": "keras-hub", "matplotlib": "matplotlib", "IPython": "ipykernel"}
#: Importable without any extra: the base dependencies, tfdist, the scripts' helpers.
BASE = {"tensorflow", "keras", "numpy", "absl", "tfdist", "_common"}


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def extra_packages(extra: str) -> set[str]:
    """The distributions an extra installs, through ``tfdist[...]`` too."""
    found: set[str] = set()
    for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
        nested = re.fullmatch(r"tfdist\[([\w,-]+)\]", requirement.strip())
        if nested:
            for name in nested.group(1).split(","):
                found |= extra_packages(name)
        else:
            found.add(_requirement_name(requirement))
    return found


def base_packages() -> set[str]:
    return {_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}


def imported_modules(source: str) -> set[str]:
    """Top-level modules imported anywhere in ``source`` (functions included)."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


def named_extras(text: str) -> set[str]:
    return {
        name
        for group in re.findall(r"pip install -e '\.\[([\w,-]+)\]'", text)
        for name in group.split(",")
    }


def _notebook(path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join(
        "".join(line for line in c["source"] if not line.lstrip().startswith(("%", "!")))
        for c in cells
        if c["cell_type"] == "code"
    )
    return code, "".join(cells[0]["source"])


def _script(path):
    source = path.read_text()
    return source, ast.get_docstring(ast.parse(source)) or ""


CASES = [(p, _notebook) for p in sorted((REPO / "notebooks").glob("*.ipynb"))] + [
    (p, _script) for p in sorted((REPO / "strategies").glob("*.py"))
]


@pytest.mark.parametrize("path, read", CASES, ids=[p.name for p, _ in CASES])
def test_what_it_imports_beyond_the_base_install_is_named(path, read):
    code, where_told = read(path)
    extra = imported_modules(code) - BASE - set(sys.stdlib_module_names)
    unknown = extra - set(PROVIDERS)
    assert not unknown, f"{path.name} imports {sorted(unknown)}: add its distribution to PROVIDERS"
    needed = {PROVIDERS[m] for m in extra}
    assert needed.isdisjoint(base_packages())  # Else PROVIDERS is wrong.
    if not needed:
        return
    offered = set().union(*(extra_packages(e) for e in named_extras(where_told)))
    missing = needed - offered
    assert not missing, (
        f"{path.name} needs {sorted(needed)}; "
        f"{'its first cell' if path.suffix == '.ipynb' else 'its docstring'} names "
        f"extras {sorted(named_extras(where_told))}, which lack {sorted(missing)}"
    )


def test_the_checks_read_what_they_claim():
    # The readers find a nested extra and an import inside a function.
    assert {"keras-hub", "matplotlib", "ipykernel"} <= extra_packages("notebooks")
    assert "keras_hub" in imported_modules("def main():\n    import keras_hub.models\n")
    assert named_extras("pip install -e '.[keras-hub,bench]'") == {"keras-hub", "bench"}
    code, told = _notebook(REPO / "notebooks" / "07_keras_distribution.ipynb")
    assert "keras_hub" in imported_modules(code) and "notebooks" in named_extras(told)
