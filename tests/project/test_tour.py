"""examples/tour.ipynb, run top to bottom by a real Jupyter kernel (nbclient), offline on SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest

TOUR = Path(__file__).resolve().parents[2] / "examples" / "tour.ipynb"
pytestmark = pytest.mark.slow  # loads SmolLM2 in the kernel and runs every step (a few minutes on two cores)


def test_the_tour_runs_top_to_bottom_and_shows_its_results(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(TOUR, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")  # stripped in git
    client = NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    shown = {}
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output.output_type != "error", output
            for kind in output.get("data", {}):
                shown.setdefault(kind, []).append(cell.source.splitlines()[-1])
    html = shown.get("text/html", [])
    for result in ("report", "inspection", "ablation", "pruning"):  # each result renders itself, not its repr
        assert result in html, (result, html)
    # progress: one display per long call, updated in place (not a line per update, not nothing)
    for cell in notebook.cells:
        if cell.cell_type == "code" and "headscope.analyze(" in cell.source:
            progress = [o for o in cell.outputs if "headscope-progress" in o.get("data", {}).get("text/html", "")]
            assert len(progress) == 1, [o.get("output_type") for o in cell.outputs]
            # its last state says the run ended (it stayed on "writing tables"), and no bar of transformers' own
            assert "<b>done" in progress[0]["data"]["text/html"]
            assert not any("Converting" in o.get("text", "") or "TqdmWarning" in o.get("text", "")
                           for o in cell.outputs)  # fmt: skip
    nbformat.write(notebook, tmp_path / "tour.ipynb")
