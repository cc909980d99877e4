"""Every notebook runs top to bottom with small parameters (nbclient), so none
rots. The cell tagged `parameters` holds each notebook's defaults; the test
adds a cell after it with its own."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
SMALL = {
    # a 150-request trace, one cache size, no 10M-hash error runs: ~10 s
    "sharing": "REQUESTS = 150\nFRACTIONS = (0.1,)\nSCAN_FRACTIONS = (0.1,)\n"
    "ERROR_RUNS = 0",
    "transfer": "",
    "ssd": "",
}


def test_every_notebook_is_covered() -> None:
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(SMALL)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The inline backend renders PNGs without a display; a headless CI that set
    # MPLBACKEND=Agg would silently skip every figure.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    (at,) = [
        i
        for i, c in enumerate(nb.cells)
        if "parameters" in c.get("metadata", {}).get("tags", [])
    ]
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(SMALL[name]))
    client = nbclient.NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    errors = [
        out
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    figures = sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells
        for out in cell.get("outputs", [])
    )
    assert figures >= 2
