"""Every notebook runs top to bottom (nbclient), so none rots: with its
defaults, which plot the JSON in benchmarks/results, and where it can replay a
benchmark, with small parameters. The cell tagged `parameters` holds each
notebook's defaults; the test adds a cell after it with its own."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# Each notebook's runs: the cell added after its parameters. The defaults plot
# the JSON in benchmarks/results as it is; sharing also replays a trace.
SMALL = {
    "sharing": {
        "json": "",
        # a 150-request trace, one cache size, no 10M-hash error runs: ~10 s
        "run": 'SOURCE = "run"\nREQUESTS = 150\nFRACTIONS = (0.1,)\n'
        "SCAN_FRACTIONS = (0.1,)\nERROR_RUNS = 0",
    },
    "transfer": {"json": ""},
    "ssd": {"json": ""},
}


def test_every_notebook_is_covered() -> None:
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == set(SMALL)


@pytest.mark.parametrize(
    ("name", "run"), sorted((name, run) for name, runs in SMALL.items() for run in runs)
)
def test_notebook_runs(name: str, run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The inline backend renders PNGs without a display; a headless CI that set
    # MPLBACKEND=Agg would silently skip every figure.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    (at,) = [
        i
        for i, c in enumerate(nb.cells)
        if "parameters" in c.get("metadata", {}).get("tags", [])
    ]
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(SMALL[name][run]))
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
