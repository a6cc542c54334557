"""tests/suite_times.py's table and durations, and the fast tier they choose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import conftest
import suite_times

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4" time="30.5">
<testcase classname="tests.spec.test_cluster" name="test_a[x@y]" time="1.5">
 <properties><property name="cpu" value="1.25"/></properties></testcase>
<testcase classname="tests.spec.test_cluster" name="test_b@tests/spec/test_cluster.py" time="2.0">
 <skipped message="no"/></testcase>
<testcase classname="tests.training.test_fit.TestFit" name="test_c@processes" time="20.0">
 <properties><property name="slow" value="1"/><property name="cpu" value="31.5"/></properties>
</testcase>
<testcase classname="tests.test_lint" name="test_d" time="7.0"><failure message="x"/></testcase>
</testsuite></testsuites>
"""


def test_the_report_gives_the_table_and_each_modules_time_without_slow_tests(tmp_path):
    report = tmp_path / "suite.xml"
    report.write_text(REPORT)
    doc = tmp_path / "contributing.md"
    doc.write_text(f"intro\n{suite_times.BEGIN}\nold\n{suite_times.END}\noutro\n")
    durations = tmp_path / "durations.json"
    assert suite_times.main([str(report), f"--doc={doc}", f"--durations={durations}"]) == 0
    cases = suite_times.read_report(report)
    # xdist's group suffix goes, a parameter's "@" stays; a class's module is its file.
    assert [c["id"] for c in cases] == [
        "tests/spec/test_cluster.py::test_a[x@y]",
        "tests/spec/test_cluster.py::test_b",
        "tests/training/test_fit.py::test_c",
        "tests/test_lint.py::test_d",
    ]
    assert [c["outcome"] for c in cases] == ["passed", "skipped", "passed", "failure"]
    assert json.loads(durations.read_text()) == {
        "tests/spec/test_cluster.py": 3.5,
        "tests/test_lint.py": 7.0,
    }
    page = doc.read_text()
    assert page.startswith("intro\n") and page.endswith("\noutro\n") and "old" not in page
    assert "4 tests; their times add up to 30 s, and the run took 30 s" in page
    assert "CPU time adds up to 33 s" in page  # 1.25 + 31.5: two tests record it.
    assert [c["cpu"] for c in cases] == [1.25, None, 31.5, None]
    assert "| `tests/training/` | 1 | 20 | 32 | 1, 20 | 66% |" in page
    assert "| `tests/test_lint.py` | 1 | 7 | – | 0, 0 | 23% |" in page
    rows = [line for line in page.splitlines() if line.startswith("| ") and "::" in line]
    assert rows[0] == "| 20.0 | 32 | yes | `tests/training/test_fit.py::test_c` |"
    assert len(rows) == 4


def test_each_modules_time_is_its_least_over_the_reports_given(tmp_path):
    report = tmp_path / "suite.xml"
    report.write_text(REPORT)
    earlier = tmp_path / "earlier.xml"
    earlier.write_text(
        REPORT.replace('name="test_a[x@y]" time="1.5"', 'name="test_a[x@y]" time="0.5"')
        .replace('time="7.0"', 'time="9.0"')
        .replace("tests.test_lint", "tests.test_other")
    )
    doc = tmp_path / "contributing.md"
    doc.write_text(f"{suite_times.BEGIN}\n{suite_times.END}\n")
    durations = tmp_path / "durations.json"
    argv = [str(report), str(earlier), f"--doc={doc}", f"--durations={durations}"]
    assert suite_times.main(argv) == 0
    assert json.loads(durations.read_text()) == {
        "tests/spec/test_cluster.py": 2.5,  # 0.5 + 2.0 in the earlier run, 3.5 in this one.
        "tests/test_lint.py": 7.0,  # This run only.
        "tests/test_other.py": 9.0,  # The earlier run only.
    }
    # The table is the first report's run.
    assert "| 1.5 | 1 |  | `tests/spec/test_cluster.py::test_a[x@y]` |" in doc.read_text()


def test_a_report_without_tests_or_a_page_without_markers_is_refused(tmp_path):
    empty = tmp_path / "empty.xml"
    empty.write_text('<testsuites><testsuite name="pytest" time="1"/></testsuites>')
    with pytest.raises(SystemExit, match="no <testcase>"):
        suite_times.read_report(empty)
    page = tmp_path / "page.md"
    page.write_text("no markers")
    with pytest.raises(SystemExit, match="suite-times: begin"):
        suite_times.write_doc("table", page)


def whole_suite(request) -> Path:
    """tests/, or a skip when the run did not collect every test module."""
    tests = Path(conftest.__file__).parent
    on_disk = {p.relative_to(tests.parent).as_posix() for p in tests.rglob("test_*.py")}
    collected = {item.nodeid.split("::")[0] for item in request.session.items}
    if not on_disk <= collected:
        pytest.skip("needs the whole suite collected (python -m pytest)")
    return tests


def test_the_fast_tier_touches_every_package(request):
    tests = whole_suite(request)
    fast = {
        item.nodeid.split("::")[0].split("/")[1]
        for item in request.session.items
        if item.get_closest_marker("fast")
    }
    packages = {p.name for p in (tests.parent / "tfdist").iterdir() if (p / "__init__.py").exists()}
    assert packages and packages <= fast, sorted(packages - fast)
    # The slow tests never are.
    assert not any(
        item.get_closest_marker("fast") and item.get_closest_marker("slow")
        for item in request.session.items
    )


def test_a_package_with_no_quick_module_lends_its_quickest_unless_it_is_slow():
    limit = conftest.FAST_MODULE_SECONDS
    fast = conftest.fast_modules(
        {
            "tests/a/test_quick.py": limit / 2,
            "tests/a/test_long.py": limit * 5,
            "tests/b/test_long.py": limit * 5,
            "tests/b/test_longer.py": limit * 1.5,
            "tests/c/test_corpus.py": limit * 50,
        }
    )
    assert fast == {
        "tests/a/test_quick.py": True,
        "tests/a/test_long.py": False,
        "tests/b/test_long.py": False,
        "tests/b/test_longer.py": True,
        "tests/c/test_corpus.py": False,
    }


def test_every_line_of_the_matrix_list_marks_a_test(request):
    # .ci/matrix runs -m "fast or matrix": a line that names no test (a test
    # renamed, a parameter changed) would drop its fit path from the older
    # pairs in silence.
    whole_suite(request)
    listed = conftest.matrix_tests()
    marked = [item.nodeid for item in request.session.items if item.get_closest_marker("matrix")]
    assert len(listed) >= 10
    for entry in listed:
        took = [n for n in marked if conftest.names(entry, n)]
        assert took, f".ci/matrix-tests: {entry!r} names no collected test"
