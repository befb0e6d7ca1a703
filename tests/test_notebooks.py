"""The notebooks run: each is executed top to bottom with nbclient (a real Jupyter kernel), so a
change that breaks one fails here instead of in a user's hands."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _outputs(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


def test_quickstart_notebook_runs_end_to_end(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _outputs(nb)
    assert "scripted check passed: ['step 1', 'step 1', 'The answer is \\\\boxed{1}']" in text
    for k in (1, 2, 4, 8):
        assert f"N={k}: PRM-greedy " in text
    assert (tmp_path / "quickstart-accuracy.png").stat().st_size > 10_000
