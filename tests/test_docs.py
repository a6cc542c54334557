"""The documentation site (mkdocs.yml, docs/): built strict, and checked.

One build of the site (about 6 s, no TensorFlow: mkdocstrings reads the
source) is shared by the tests. They check what the build alone would not
show: every public name of tfdist and of its public subpackages has an entry
in the API reference with its docstring, every notebook and benchmark table
is a page (the notebooks with the outputs of this session's run of them:
these tests run last), and a broken link fails the build rather than being
published.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import executed_notebooks

REPO = Path(__file__).resolve().parent.parent
#: The packages whose ``__all__`` is the public API the reference must cover.
#: tfdist.engines has no ``__all__`` of its own: tfdist.spark (the same module
#: as tfdist.engines.spark) and the names tfdist re-exports are its public part.
PACKAGES = (
    "tfdist",
    "tfdist.strategies",
    "tfdist.training",
    "tfdist.compression",
    "tfdist.transport",
    "tfdist.parallel",
    "tfdist.pipeline",
    "tfdist.distribution",
    "tfdist.horovod",
    "tfdist.profiling",
    "tfdist.spec",
    "tfdist.spark",
    "tfdist.compat",
    "tfdist.cli",
)


def _mkdocs_missing() -> bool:
    return importlib.util.find_spec("mkdocs") is None


pytestmark = pytest.mark.skipif(
    _mkdocs_missing() and not os.environ.get("TFDIST_REQUIRE_TOOLS"),
    reason="mkdocs is not installed (pip install -e '.[test]'); CI requires it",
)


def build(
    config_dir: Path, site: Path, notebooks: Path | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", NO_MKDOCS_2_WARNING="1")
    if notebooks is not None:
        env["TFDIST_DOCS_NOTEBOOKS"] = str(notebooks)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            # Not -q: quiet mode drops the warnings that --strict counts.
            "--strict",
            "-f",
            str(config_dir / "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=config_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # The notebooks this session executed (these tests run after them,
    # tests/conftest.py), shown with their outputs.
    done = build(REPO, out, notebooks=executed_notebooks(tmp_path_factory))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


class _Ids(HTMLParser):
    """The ``id`` attributes of the pages fed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key == "id" and value:
                self.ids.add(value)


def _reference_ids(site: Path) -> set[str]:
    parser = _Ids()
    for page in (site / "reference").rglob("*.html"):
        parser.feed(page.read_text(encoding="utf-8"))
    return parser.ids


def _public_names() -> list[tuple[str, str, object]]:
    """(package, name, object) for every name in each package's ``__all__``."""
    out = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            out.append((package, name, getattr(module, name)))
    return out


def _entries(package: str, name: str, obj: object) -> set[str]:
    """The reference ids that could document ``package.name``: the public
    path, where the object is defined, and every tfdist module that binds it
    under that name (a constant is documented where it is assigned)."""
    found = {f"{package}.{name}"}
    if inspect.ismodule(obj):
        found.add(obj.__name__)
    elif isinstance(obj, enum.Enum):
        found.add(f"{type(obj).__module__}.{type(obj).__qualname__}.{obj.name}")
    elif getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
        found.add(f"{obj.__module__}.{obj.__qualname__}")
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("tfdist.") and getattr(module, name, None) is obj:
            found.add(f"{module_name}.{name}")
    return found


def test_every_public_name_has_a_reference_entry(site):
    ids = _reference_ids(site)
    names = _public_names()
    assert len(names) > 150  # Every package's __all__ was read.
    missing = [
        f"{package}.{name}"
        for package, name, obj in names
        if not _entries(package, name, obj) & ids
    ]
    assert not missing, f"no entry in docs/reference for: {missing}"


def test_every_public_function_and_class_has_a_docstring():
    # Its own docstring: not one inherited from a base class.
    undocumented = [
        f"{package}.{name}"
        for package, name, obj in _public_names()
        if (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj))
        and not (obj.__doc__ or "").strip()
    ]
    assert not undocumented, undocumented


def test_notebooks_and_benchmark_tables_are_pages(site):
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        page = site / "notebooks" / notebook.stem / "index.html"
        assert page.is_file(), page
        # mkdocs-jupyter renders the cells (the committed notebooks have no
        # outputs: the site shows the code and the text).
        text = page.read_text(encoding="utf-8")
        assert "jp-Cell" in text or "jupyter-wrapper" in text, page
    for table in sorted((REPO / "benchmarks" / "results").glob("*.md")):
        assert (site / "benchmarks" / "results" / table.stem / "index.html").is_file(), table


def test_the_notebooks_this_session_ran_show_their_outputs(site, tmp_path_factory):
    import nbformat

    executed = sorted((executed_notebooks(tmp_path_factory) / "notebooks").glob("*.ipynb"))
    if not executed:
        pytest.skip("no notebook ran in this session (tests/test_notebooks.py runs them)")
    for path in executed:
        page = (site / "notebooks" / path.stem / "index.html").read_text(encoding="utf-8")
        # A line the notebook printed is on its page (the committed copy
        # has no outputs).
        printed = [
            line.strip()
            for cell in nbformat.read(path, as_version=4).cells
            if cell.cell_type == "code"
            for out in cell.outputs
            if out.output_type == "stream"
            for line in out.text.splitlines()
            if len(line.strip()) > 20 and not set(line.strip()) & set("<>&\"'")
        ]
        assert printed and printed[0] in page, (path.name, printed[:1])
    clean = (REPO / "notebooks" / "01_tour.ipynb").read_text(encoding="utf-8")
    assert '"outputs": []' in clean  # What is committed stays without outputs.


def test_the_patch_table_is_read_from_the_registry(site):
    from tfdist.compat import registry

    text = (site / "versions" / "index.html").read_text(encoding="utf-8")
    assert len(registry.PATCHES) > 10
    assert f"{len(registry.PATCHES)} patches in" in text
    for patch in registry.PATCHES:
        assert f"<code>{patch.name}</code>" in text, patch.name


def test_getting_started_gives_the_readmes_two_commands(site):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(.+?)\n```", readme)[:2]
    assert len(commands) == 2
    text = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    for command in commands:
        assert command in text, command


def test_a_broken_link_fails_the_build(tmp_path):
    """Under the site's own settings (``strict``, ``validation``: inherited
    from mkdocs.yml), on two pages without the plugins: a copy of the whole
    site took 21 s of the run's critical path, in the search index and the
    API reference, which no link check needs."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](guide.md).\n", encoding="utf-8")
    (docs / "guide.md").write_text(
        "# Guide\n\nSee [the missing page](no-such-page.md).\n", encoding="utf-8"
    )
    (tmp_path / "mkdocs.yml").write_text(
        f"INHERIT: {REPO / 'mkdocs.yml'}\n"
        "docs_dir: docs\n"
        "hooks: []\n"
        "plugins: []\n"
        "nav:\n  - index.md\n  - guide.md\n",
        encoding="utf-8",
    )
    done = build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def test_the_changelog_names_the_packages_version():
    import tfdist

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+.

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert tfdist.__version__ == version
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M)
