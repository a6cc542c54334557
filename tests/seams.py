"""The figures of tfdist's seams (issue 40), read from the source.

    python tests/seams.py [--list]

prints, for tfdist/:

- the distinct ``_tfdist_*`` names (attributes tfdist sets on TensorFlow,
  Keras and its own objects to pass state between its parts);
- the ``Any`` annotations and the ``Protocol`` classes;
- the import circles, imports inside functions included (tests/test_layering.py
  refuses those at module level and those between packages);
- the functions over 80 lines, docstrings aside;
- the ``# noqa: SLF001`` (a reach into another object's private names) outside
  tfdist/compat;
- the pairs of repeated blocks of six lines or more in tfdist/, tests/ and
  benchmarks/ (the ``duplicates`` command, where it is installed).

``--list`` names each one. Before and after a change to the layout, the
figures say what moved.
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

import test_layering

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfdist"
LONG_FUNCTION = 80
TFDIST_NAME = re.compile(r"\b_tfdist_\w+")


def tfdist_names() -> dict[str, list[str]]:
    """Each ``_tfdist_*`` name -> the files it appears in."""
    found: dict[str, set[str]] = collections.defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        for name in TFDIST_NAME.findall(path.read_text()):
            found[name].add(str(path.relative_to(ROOT)))
    return {name: sorted(files) for name, files in sorted(found.items())}


def _annotations(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    yield arg.annotation
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def any_annotations() -> tuple[int, int]:
    """(``Any`` in annotations, ``Protocol`` classes) in tfdist."""
    anys = protocols = 0
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for annotation in _annotations(tree):
            for node in ast.walk(annotation):
                if (isinstance(node, ast.Name) and node.id == "Any") or (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and re.search(r"\bAny\b", node.value)
                ):
                    anys += 1
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                (isinstance(b, ast.Name) and b.id == "Protocol")
                or (isinstance(b, ast.Attribute) and b.attr == "Protocol")
                for b in node.bases
            ):
                protocols += 1
    return anys, protocols


def import_circles() -> list[list[str]]:
    """Groups of tfdist modules that import one another, in functions too."""
    return test_layering._cycles(test_layering._edges(module_level_only=False))


def long_functions(limit: int = LONG_FUNCTION) -> list[tuple[int, str]]:
    """(lines, ``file:line name``) of every function longer than ``limit``,
    its docstring aside (a function's arguments are documented at length)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                first = node.body[0]
                if (
                    isinstance(first, ast.Expr)
                    and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)
                ):
                    lines -= first.end_lineno - first.lineno + 1  # The docstring is not code.
                if lines > limit:
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                    found.append((lines, where))
    return sorted(found, reverse=True)


def private_reaches() -> dict[str, int]:
    """``# noqa: SLF001`` per file outside tfdist/compat."""
    counts = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "compat" in path.relative_to(PACKAGE).parts[:1]:
            continue
        n = path.read_text().count("noqa: SLF001")
        if n:
            counts[str(path.relative_to(ROOT))] = n
    return counts


def repeated_pairs(tree: str) -> int | None:
    """Pairs of repeated blocks in ``tree`` (the ``duplicates`` command), or
    None without it."""
    command = shutil.which("duplicates")
    if command is None:
        return None
    done = subprocess.run(
        [command, "--repo", str(ROOT / tree), "--most", "1", "--seconds", "120"],
        capture_output=True,
        text=True,
        check=False,
    )
    first = done.stdout.splitlines()[0] if done.stdout else ""
    if first.startswith("no duplicates"):
        return 0
    match = re.match(r"(\d+) pairs? of places", first)
    return int(match.group(1)) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name each one")
    args = parser.parse_args(argv)
    names = tfdist_names()
    anys, protocols = any_annotations()
    circles = import_circles()
    long = long_functions()
    reaches = private_reaches()
    print(f"_tfdist_ names: {len(names)}")
    if args.list:
        for name, files in names.items():
            print(f"  {name}: {', '.join(files)}")
    print(f"Any annotations: {anys}; Protocol classes: {protocols}")
    print(f"import circles (imports in functions included): {len(circles)}")
    if args.list:
        for circle in circles:
            print(f"  {' <-> '.join(circle)}")
    print(f"functions over {LONG_FUNCTION} lines: {len(long)}")
    if args.list:
        for lines, where in long:
            print(f"  {lines:4d} {where}")
    print(f"noqa: SLF001 outside tfdist/compat: {sum(reaches.values())} in {len(reaches)} files")
    if args.list:
        for path, n in sorted(reaches.items(), key=lambda kv: -kv[1]):
            print(f"  {n:3d} {path}")
    for tree in ("tfdist", "tests", "benchmarks"):
        pairs = repeated_pairs(tree)
        print(f"repeated-block pairs in {tree}/: {'?' if pairs is None else pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
