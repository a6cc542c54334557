"""tests/seams.py counts what it says, on a package written here."""

from __future__ import annotations

import textwrap

import seams

SOURCE = textwrap.dedent(
    """
    from typing import Any, Protocol

    class Carrier(Protocol):
        aggregator: Any

    def short(x: Any, *rest: "Any") -> dict[str, Any]:
        x._tfdist_state = 1
        x._tfdist_state = getattr(x, "_tfdist_transport", None)
        return x._private  # noqa: SLF001 - a reach, counted

    def long():
        '''A docstring,

        not counted.
        '''
    {body}
    """
).format(body="\n".join(f"    a{i} = {i}" for i in range(seams.LONG_FUNCTION)))


def test_the_figures_of_a_package(tmp_path, monkeypatch):
    package = tmp_path / "tfdist"
    (package / "compat").mkdir(parents=True)
    (package / "mod.py").write_text(SOURCE)
    (package / "compat" / "patch.py").write_text("x._y  # noqa: SLF001 - compat may\n")
    monkeypatch.setattr(seams, "ROOT", tmp_path)
    monkeypatch.setattr(seams, "PACKAGE", package)
    assert seams.tfdist_names() == {
        "_tfdist_state": ["tfdist/mod.py"],
        "_tfdist_transport": ["tfdist/mod.py"],
    }
    # x, *rest (a string annotation), the return, and the Protocol's field.
    assert seams.any_annotations() == (4, 1)
    [(lines, where)] = seams.long_functions()
    assert lines == seams.LONG_FUNCTION + 1 and where == "tfdist/mod.py:12 long"
    assert seams.private_reaches() == {"tfdist/mod.py": 1}  # compat's does not count.


def test_the_report_of_tfdist_names_each_figure(capsys, monkeypatch):
    monkeypatch.setattr(seams, "repeated_pairs", lambda tree: None)
    assert seams.main([]) == 0
    out = capsys.readouterr().out
    for figure in (
        "_tfdist_ names: ",
        "Any annotations: ",
        "import circles (imports in functions included): ",
        f"functions over {seams.LONG_FUNCTION} lines: ",
        "noqa: SLF001 outside tfdist/compat: ",
        "repeated-block pairs in benchmarks/: ?",
    ):
        assert figure in out, out


def test_no_function_of_tfdist_is_over_the_limit():
    """Issue 40: a function over the limit does everything; split it (a literal
    table is data: put it in a constant)."""
    assert seams.long_functions() == []
