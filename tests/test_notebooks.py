"""Every notebook under notebooks/ runs top to bottom without an error.

The kernel is the interpreter running the tests: a kernelspec pointing at ``sys.executable`` is
written to a temporary directory put first on ``JUPYTER_PATH``, so this works on a fresh machine
where only ``pip install -e .[dev]`` ran, whatever kernelspecs are (or are not) installed.
"""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
KERNEL = "autopar-test-python"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "autopar tests", "language": "python"}))
    return root


def test_notebooks_found():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


def test_notebooks_committed_without_outputs():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, kernel_dir, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_dir))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") == "error"]
    assert not errors
