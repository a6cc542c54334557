"""Every notebook in notebooks/ runs top to bottom, and is committed clean.

Each notebook is executed by nbclient in a fresh kernel (the same Python),
with a time limit per cell; a cell that raises fails the test. The notebooks
check their own results with ``assert`` (so a wrong result fails too), and
the checks below look for what each notebook must show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, executed_notebooks, subprocess_env

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
#: Notebooks that start several TensorFlow processes (marked slow).
MULTI_PROCESS = {"03_multi_worker.ipynb", "06_profiling.ipynb"}
#: Notebooks that build a throttled link (root, unshare and tc).
NEEDS_NETNS = {"06_profiling.ipynb"}
#: Seconds one cell may run before the test fails.
CELL_TIMEOUT = 300
COMPRESSION_SETTINGS = ("none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd", "powersgd")


def _param(path: Path):
    marks = [pytest.mark.slow] if path.name in MULTI_PROCESS else []
    return pytest.param(path, marks=marks, id=path.name)


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs(path):
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    dirty = [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"commit notebooks without outputs; cells {dirty} have some"


def _require_netns() -> None:
    """Skips (or, in CI, fails) where a throttled link cannot be built."""
    import os
    import shutil
    import subprocess

    missing = [t for t in ("unshare", "ip", "tc") if shutil.which(t) is None]
    if not missing and os.geteuid() == 0:
        probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
        if probe.returncode == 0:
            return
    reason = f"needs root, unshare and tc (missing: {missing or 'root or namespaces'})"
    if os.environ.get("TFDIST_REQUIRE_ENGINES"):
        pytest.fail(reason)
    pytest.skip(reason)


def execute(path: Path, monkeypatch) -> tuple:
    """Runs the notebook in a fresh kernel; returns it and its outputs.

    Returns:
        The executed notebook, the text of its outputs (streams, plain text
        and Markdown) and the number of PNG images it displayed.
    """
    import nbclient
    import nbformat

    for name, value in subprocess_env().items():
        monkeypatch.setenv(name, value)  # the kernel inherits it
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO)}},
    )
    client.execute()  # Raises CellExecutionError when a cell fails.
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(
        out.get("text", "")
        + out.get("data", {}).get("text/plain", "")
        + out.get("data", {}).get("text/markdown", "")
        for out in outputs
    )
    images = sum("image/png" in out.get("data", {}) for out in outputs)
    return notebook, text, images


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch, tmp_path_factory):
    import nbformat

    if path.name in NEEDS_NETNS:
        _require_netns()
    notebook, text, images = execute(path, monkeypatch)
    assert "Traceback" not in text
    # The documentation site shows it with these outputs (tests/test_docs.py).
    executed = executed_notebooks(tmp_path_factory) / "notebooks"
    executed.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, executed / path.name)
    if path.name == "01_tour.ipynb":
        assert "parameter_server" in text and "ClusterSpecError on field 'task.index'" in text
        assert "largest relative gap" in text
    if path.name == "02_compression.ipynb":
        assert images >= 1, "no plot was displayed"
        assert "measured bytes per step == predict_traffic for every setting" in text
        table = [line for line in text.splitlines() if line.startswith("| `")]
        assert [line.split("`")[1] for line in table] == list(COMPRESSION_SETTINGS)
        assert "| `none` |" in text and "| 1.0x |" in table[0]
    if path.name == "03_multi_worker.ipynb":
        assert images >= 1, "no plot was displayed"
        assert "[worker:0]   this task: worker:0 (chief)" in text
        assert "[tfdist launch] all tasks finished" in text
        assert "identical final weights on both workers: True" in text
        assert "(matches the workers)" in text
    if path.name == "06_profiling.ipynb":
        assert images >= 2, "no plot was displayed"
        assert "fp32: communicate is the larger share" in text
        assert "powersgd: compute is the larger share" in text
        assert "step records of 2 workers" in text
    if path.name == "07_keras_distribution.ipynb":
        assert images >= 1, "no plot was displayed"
        assert "ModelParallel on a (2, 2) mesh: 4 replicas" in text
        assert "token_embedding/embeddings" in text
        assert "tensor-parallel (column)" in text and "tensor-parallel (row)" in text
        assert "tensor-parallel (vocabulary)" in text
        assert "largest loss difference" in text
    if path.name == "05_tensor_parallel.ipynb":
        assert images >= 1, "no plot was displayed"
        assert "mesh: data 2 x tensor 2; tensor groups [0, 1] [2, 3]" in text
        assert "largest loss difference" in text and "each replica holds" in text
        assert "block:" in text and "tensor-parallel" in text
