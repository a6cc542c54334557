"""Every notebook in notebooks/ runs top to bottom."""

from __future__ import annotations

import pytest

from conftest import REPO, subprocess_env

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    import nbclient
    import nbformat
    for name, value in subprocess_env().items():
        monkeypatch.setenv(name, value)  # the kernel inherits it
    notebook = nbformat.read(path, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells
                   if cell.cell_type == "code"), "commit notebooks without outputs"
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()
    text = "".join(out.get("text", "") for cell in notebook.cells
                   if cell.cell_type == "code" for out in cell.outputs)
    assert "Traceback" not in text
    if path.name == "01_tour.ipynb":
        assert "parameter_server" in text and "ClusterSpecError on field 'task.index'" in text
        assert "largest relative gap" in text
