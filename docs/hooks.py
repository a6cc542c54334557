"""MkDocs hooks of tfdist's documentation site (``hooks:`` in ``mkdocs.yml``).

* The notebooks (``notebooks/*.ipynb``) and the benchmark results
  (``benchmarks/results/**``) live outside ``docs/``: they are added to the
  build at the same paths as in the repository (``notebooks/01_tour.ipynb``,
  ``benchmarks/results/xla.md``), so mkdocs-jupyter renders the notebooks and
  the result tables are pages that links can point at. Nothing is copied into
  the repository.
* The repository's notebooks are committed without outputs. With
  ``TFDIST_DOCS_NOTEBOOKS=DIR`` the site shows the executed copies in
  ``DIR/notebooks/`` instead (``tests/test_notebooks.py`` writes them there
  when it runs them; ``tests/test_docs.py`` builds the site from them), and
  each notebook without an executed copy as committed.
* ``<!-- tfdist:patches -->``, ``<!-- tfdist:supported -->`` and
  ``<!-- tfdist:minimums -->`` in a page are replaced by tables read from
  ``tfdist/compat/registry.py`` and ``tfdist/compat/versions.py``, so the
  list of patches cannot drift from the code. tfdist is never imported: the
  registry is read with ``ast`` (its one import, ``Patch``, is replaced by a
  stand-in record) and the versions with ``ast.literal_eval``.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.tfdist")

#: Files outside docs/ that the site shows: (folder under the repository,
#: file patterns). Each appears at the same path in the site as in the
#: repository (notebooks/01_tour.ipynb, benchmarks/results/xla.md).
EXTERNAL = (
    ("notebooks", ("*.ipynb",)),
    ("benchmarks/results", ("*.md", "*.json", "*.png")),
)


def _repo(config) -> Path:
    return Path(config.config_file_path).resolve().parent


# --------------------------------------------------------------- external files


@event_priority(100)  # Before mkdocs-jupyter's on_files, which wraps the notebooks.
def on_files(files: Files, config) -> Files:
    repo = _repo(config)
    for folder, patterns in EXTERNAL:
        root = repo / folder
        for pattern in patterns:
            for path in sorted(root.rglob(pattern)):
                if any(part.startswith(".") for part in path.relative_to(root).parts):
                    continue  # .ipynb_checkpoints and the like
                uri = path.relative_to(repo).as_posix()
                if files.get_file_from_path(uri) is not None:
                    log.warning("%s is both in docs/ and in %s/", uri, folder)
                    continue
                # An ordinary File whose source folder is the repository (the
                # site path equals the path in the repository), not a generated
                # one: mkdocs-jupyter's NotebookFile reads abs_src_path from
                # src_dir, which a generated File lacks.
                files.append(
                    File(
                        uri,
                        src_dir=str(_source_dir(repo, uri)),
                        dest_dir=config.site_dir,
                        use_directory_urls=config.use_directory_urls,
                        inclusion=InclusionLevel.INCLUDED,
                    )
                )
    return files


def _source_dir(repo: Path, uri: str) -> Path:
    """Where ``uri`` is read from: an executed notebook's folder when
    ``TFDIST_DOCS_NOTEBOOKS`` holds a copy of it, else the repository."""
    executed = os.environ.get("TFDIST_DOCS_NOTEBOOKS")
    if executed and uri.endswith(".ipynb") and (Path(executed) / uri).is_file():
        return Path(executed)
    return repo


def on_serve(server, config, builder):
    repo = _repo(config)
    for folder, _ in EXTERNAL:
        server.watch(str(repo / folder))
    server.watch(str(repo / "tfdist" / "compat"))
    return server


# ------------------------------------------------------------ generated tables


@dataclasses.dataclass
class _Patch:
    """Stand-in for ``tfdist.compat.patching.Patch``, with the same fields."""

    name: str
    target: str
    wrapper: str
    feature: str
    why: str
    needed: str = ""
    params: tuple | None = None
    kind: str = "function"
    dynamic: bool = False
    canary: str = ""


def _registry(repo: Path) -> tuple[tuple[_Patch, ...], dict]:
    path = repo / "tfdist" / "compat" / "registry.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    tree.body = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))]
    namespace: dict = {"Patch": _Patch, "__name__": "tfdist_docs_registry"}
    exec(compile(tree, str(path), "exec"), namespace)  # noqa: S102 - the project's own table
    return namespace["PATCHES"], namespace["FEATURES"]


def _literal(repo: Path, relative: str, name: str):
    path = repo / relative
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name) and target.id == name:
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not found in {relative}")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _target(target: str) -> str:
    keras, tf = "tfdist.compat.keras_src:", "tensorflow:"
    if target.startswith(keras):
        return f"Keras `{target[len(keras) :]}`"
    if target.startswith(tf):
        return f"TensorFlow `tf.{target[len(tf) :]}`"
    return _cell(target)


def _canary(canary: str) -> str:
    if canary.startswith("tests/") and " " not in canary:
        return f"`{canary}`"
    return _cell(canary) or "-"


def patches_table(repo: Path) -> str:
    patches, features = _registry(repo)
    lines = [
        f"{len(patches)} patches in {len(features)} features. `#` is the position in "
        "the registry: patches of one target compose in that order, the lowest "
        "closest to Keras's original.",
        "",
    ]
    for feature, info in features.items():
        mine = [p for p in patches if p.feature == feature]
        if not mine:
            continue
        kind = (
            "required: if a target changed, creating a strategy fails with `PatchError`"
            if info.get("required", True)
            else "optional: if a target changed, the feature is switched off with a "
            "`FeatureDisabledWarning`, and using it raises `ConfigError`"
        )
        lines += [
            f"### `{feature}`: {info['description']}",
            "",
            f"*{kind[0].upper()}{kind[1:]}.*",
            "",
            "| # | patch | target | versions | why | test showing stock Keras/TF needs it |",
            "|--:|---|---|---|---|---|",
        ]
        previous = None
        for patch in mine:
            why = "the same" if patch.why == previous else _cell(patch.why)
            previous = patch.why
            where = _target(patch.target) + (" (per owner, at run time)" if patch.dynamic else "")
            needed = f"`{patch.needed}`" if patch.needed else "all supported"
            lines.append(
                f"| {patches.index(patch) + 1} | `{patch.name}` | {where} | {needed} | {why} | "
                f"{_canary(patch.canary)} |"
            )
        lines.append("")
    return "\n".join(lines)


def supported_table(repo: Path) -> str:
    supported = _literal(repo, "tfdist/compat/versions.py", "SUPPORTED")
    pairs = _literal(repo, "tfdist/compat/versions.py", "TESTED_PAIRS")
    lines = ["| package | supported (`SUPPORTED`) |", "|---|---|"]
    lines += [f"| {package} | `>={low},<{high}` |" for package, (low, high) in supported.items()]
    lines += [
        "",
        "Tested pairs (`TESTED_PAIRS`, oldest first):",
        "",
        "| TensorFlow | Keras |",
        "|---|---|",
    ]
    lines += [f"| {tf} | {keras} |" for tf, keras in pairs]
    return "\n".join(lines)


def minimums_text(repo: Path) -> str:
    minimums = _literal(repo, "tfdist/compat/versions.py", "FEATURE_MINIMUMS")
    if not minimums:
        return "`FEATURE_MINIMUMS` is empty: on every supported pair every feature works."
    rows = ["| feature | needs |", "|---|---|"]
    rows += [
        f"| `{feature}` | " + ", ".join(f"{p}>={v}" for p, v in needs.items()) + " |"
        for feature, needs in minimums.items()
    ]
    return "\n".join(rows)


_GENERATED = {
    "<!-- tfdist:patches -->": patches_table,
    "<!-- tfdist:supported -->": supported_table,
    "<!-- tfdist:minimums -->": minimums_text,
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, make in _GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make(_repo(config)))
    return markdown
