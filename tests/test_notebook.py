"""notebooks/analysis.ipynb runs top to bottom on a run dir and shows the report's table and figures."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from tests.conftest import ROOT
from tests.test_report import PLOTS, ROW, write_run


def test_analysis_notebook_runs_on_a_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BASTION_RUN_DIR", str(write_run(tmp_path / "run")))
    notebook = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells)  # stored without outputs
    here = {"metadata": {"path": str(ROOT / "notebooks")}}
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources=here).execute()
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(ROW in o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert sum("image/png" in o.get("data", {}) for o in outputs) == len(PLOTS)
