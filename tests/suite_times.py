"""Where the suite's time goes, from a run's JUnit XML report.

    python -m pytest --junitxml=/tmp/suite.xml
    python tests/suite_times.py /tmp/suite.xml [/tmp/earlier.xml ...]

writes two things:

- the table of docs/contributing.md (between its ``suite-times`` markers):
  the time by directory of tests/ and the 20 slowest tests, of the first
  report's run;
- tests/durations.json: each module's time without its slow tests, the
  least over the reports given, from which tests/conftest.py picks the fast
  tier (``-m fast``). A niced module's time swings with what ran beside it
  (test_parallel_options.py: 16.8 s in one full run, 19.5 s in the next,
  which left tests/parallel out of the fast tier); its least time over
  several runs is the steadier measure of what it costs.

A test's time is its setup, call and teardown (pytest's default for the
report), so the first test of a module carries the module's shared fixtures.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "contributing.md"
DURATIONS = REPO / "tests" / "durations.json"
BEGIN, END = "<!-- suite-times: begin -->", "<!-- suite-times: end -->"
SLOWEST = 20


def read_report(path: Path) -> list[dict]:
    """One record per test case: its id, module, time, outcome and whether
    it is marked slow (the ``slow`` property tests/conftest.py records)."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        # A class's tests: classname ends with the class, the file before it.
        parts = module.split("/")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        name = case.get("name", "")
        if "@" in name and name.rfind("@") > name.rfind("]"):
            name = name[: name.rfind("@")]  # pytest-xdist's group suffix.
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        cases.append(
            {
                "module": "/".join(parts) + ".py",
                "id": "/".join(parts) + ".py::" + name,
                "seconds": float(case.get("time") or 0.0),
                "slow": properties.get("slow") == "1",
                # CPU seconds, setup to teardown (tests/cpu_time.py); None
                # in a report from before it was recorded.
                "cpu": float(properties["cpu"]) if "cpu" in properties else None,
                "outcome": outcome,
            }
        )
    if not cases:
        raise SystemExit(f"{path}: no <testcase> in the report; expected pytest's --junitxml")
    return cases


def wall_seconds(path: Path) -> float:
    """The run's wall time, as pytest reported it."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return float(suite.get("time") or 0.0)


def directory(module: str) -> str:
    parts = module.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else module


def _cpu(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:,.0f}"


def markdown(cases: list[dict], wall: float) -> str:
    """The time by directory and the slowest tests, as Markdown."""
    by_dir: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0.0, 0, None])
    for case in cases:
        row = by_dir[directory(case["module"])]
        row[0] += case["seconds"]
        row[1] += 1
        if case["slow"]:
            row[2] += case["seconds"]
            row[3] += 1
        if case["cpu"] is not None:
            row[4] = (row[4] or 0.0) + case["cpu"]
    total = sum(c["seconds"] for c in cases)
    measured = [c["cpu"] for c in cases if c["cpu"] is not None]
    cpu = (
        f" CPU time adds up to {sum(measured):,.0f} s (tests/cpu_time.py: the test's "
        "processes, its children and the warm pool's jobs)."
        if measured
        else ""
    )
    lines = [
        f"{len(cases):,} tests; their times add up to {total:,.0f} s, and the run took "
        f"{wall:,.0f} s of wall time (its workers run tests side by side).{cpu}",
        "",
        "| directory | tests | seconds | CPU seconds | of which slow (tests, seconds) | share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = sorted(by_dir.items(), key=lambda kv: -kv[1][0])
    for name, (seconds, count, slow_s, slow_n, cpu_s) in rows:
        lines.append(
            f"| `{name}` | {count} | {seconds:,.0f} | {_cpu(cpu_s)} | {slow_n}, {slow_s:,.0f} | "
            f"{seconds / total:.0%} |"
        )
    lines += ["", f"The {SLOWEST} slowest tests:", ""]
    lines += ["| seconds | CPU seconds | slow | test |", "|---:|---:|---|---|"]
    for case in sorted(cases, key=lambda c: -c["seconds"])[:SLOWEST]:
        slow = "yes" if case["slow"] else ""
        lines.append(f"| {case['seconds']:,.1f} | {_cpu(case['cpu'])} | {slow} | `{case['id']}` |")
    return "\n".join(lines)


def module_seconds(cases: list[dict]) -> dict[str, float]:
    """Each module's time without its slow tests."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in cases:
        if not case["slow"]:
            seconds[case["module"]] += case["seconds"]
    return {m: round(s, 2) for m, s in sorted(seconds.items())}


def least(runs) -> dict[str, float]:
    """Each module's least time over ``runs`` (``module_seconds`` of each),
    among the runs that have it."""
    found: dict[str, float] = {}
    for seconds in runs:
        for module, value in seconds.items():
            found[module] = min(value, found.get(module, value))
    return dict(sorted(found.items()))


def write_doc(text: str, doc: Path = DOC) -> None:
    page = doc.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{doc}: expected the markers {BEGIN!r} and {END!r}")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="pytest's --junitxml file")
    parser.add_argument(
        "earlier",
        type=Path,
        nargs="*",
        help="other runs' reports: each module's time is its least over all",
    )
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--durations", type=Path, default=DURATIONS)
    args = parser.parse_args(argv)
    cases = read_report(args.report)
    write_doc(markdown(cases, wall_seconds(args.report)), args.doc)
    seconds = least(module_seconds(read_report(r)) for r in [args.report, *args.earlier])
    args.durations.write_text(json.dumps(seconds, indent=1) + "\n")
    print(
        f"{args.doc}: table of {len(cases)} tests; {args.durations}: {len(seconds)} modules, "
        f"each its least time over {1 + len(args.earlier)} report(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
