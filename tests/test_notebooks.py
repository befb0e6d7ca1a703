"""The notebooks run: each is executed top to bottom with nbclient (a real Jupyter kernel), so a
change that breaks one fails here instead of in a user's hands."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _outputs(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


def _execute(tmp_path, env: dict[str, str] | None = None) -> str:
    import os

    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})   # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return _outputs(nb)


def test_quickstart_notebook_runs_end_to_end(tmp_path):
    # 6 problems, not the notebook's 16: more than its 4 in flight, so run_continuously still refills
    # as problems finish; every cell runs as a user's would
    text = _execute(tmp_path, {"TTS_PROBLEMS": "6"})
    assert "generator: CPU backend | PRM: CPU backend" in text
    assert "PRM read as: step_tag (Qwen2ForCausalLM)" in text   # the shipped PRM's architecture says how
    assert "scripted check passed: ['step 1', 'step 1', 'The answer is \\\\boxed{1}']" in text
    for k in (1, 2, 4, 8):
        assert f"N={k}: PRM-greedy " in text
    assert (tmp_path / "quickstart-accuracy.png").stat().st_size > 10_000
    assert "MCTS: answer " in text and "; exit: " in text
    assert (tmp_path / "quickstart-mcts-tree.png").stat().st_size > 10_000


@pytest.mark.server
def test_quickstart_notebook_runs_on_live_servers(tmp_path, live):
    gen, prm = live.url("generator"), live.url("prm")
    # 4 problems, not 16: this checks the server path; the accuracies are the CPU run's to show
    text = _execute(tmp_path, {"TTS_GENERATOR_URL": gen, "TTS_PRM_URL": prm, "TTS_PROBLEMS": "4"})
    assert f"generator: {gen} | PRM: {prm}" in text
    assert "PRM read as: step_tag (Qwen2ForCausalLM)" in text   # told by the server's /model_info
    assert "MCTS: answer " in text
    for k in (1, 2, 4, 8):
        line = next(x for x in text.splitlines() if x.startswith(f"N={k}: PRM-greedy "))
        # accuracies over 4 problems: multiples of 25%
        assert all(int(pct) % 25 == 0 for pct in re.findall(r"(\d+)%", line)), line
