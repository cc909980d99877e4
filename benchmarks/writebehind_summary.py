"""The short table the write-behind device scripts print last, from
ssd_writebehind.py JSON files: save GB/s per round, its median and the
change against no tier, the SSD writes against dd and the drops.

    python benchmarks/writebehind_summary.py writebehind.json
    python benchmarks/writebehind_summary.py --cells RESULTS_DIR

With --paired, the files are `wb_<cell>_<round>.json` holding a `none` and
a `seal` row each (one round of both modes on one server pair, as the
twelfth session's scripts write them): a round's loss is its own seal row
against its own none row, and a cell's figure the median of its rounds.

With --cells, the files are `wb_<tree>_<mode>_<round>.json` (one round of
one mode on one tree each, as the variant scripts write them) and a cell is
(tree, mode); the baseline is `main_none`. Otherwise a cell is a mode of the
rows in the given files, the baseline `none`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _cells(paths: list[Path], by_file: bool) -> dict[str, list[dict]]:
    cells: dict[str, list[dict]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            name = path.stem[3:].rsplit("_", 1)[0] if by_file else row["mode"]
            cells.setdefault(name, []).append(row)
    return cells


def summary(cells: dict[str, list[dict]], baseline: str) -> str:
    def med(rows: list[dict], key: str) -> float:
        return statistics.median(float(r.get(key) or 0) for r in rows)

    base = med(cells[baseline], "save_GBps") if baseline in cells else float("nan")
    lines = [
        f"{'cell':14} | {'save GB/s (rounds)':30} | median | vs none | write/dd | drops"
    ]
    for name, rows in cells.items():
        save = med(rows, "save_GBps")
        each = " ".join(f"{r['save_GBps']:.2f}" for r in rows)
        lines.append(
            f"{name:14} | {each:30} | {save:6.3f} | {save / base - 1:+7.1%} | "
            f"{med(rows, 'write/dd'):8.2f} | {med(rows, 'dropped'):5.0f}"
        )
    return "\n".join(lines)


def paired(paths: list[Path]) -> str:
    """Per cell: each round's seal-against-none loss, their median, and the
    seal rows' SSD writes against dd."""
    cells: dict[str, list[tuple[float, float]]] = {}
    for path in paths:
        rows = {r["mode"]: r for r in json.loads(path.read_text())["rows"]}
        if not {"none", "seal"} <= rows.keys():
            continue
        loss = 1 - rows["seal"]["save_GBps"] / rows["none"]["save_GBps"]
        ratio = float(rows["seal"].get("write/dd") or "nan")
        cells.setdefault(path.stem[3:].rsplit("_", 1)[0], []).append((loss, ratio))
    lines = [f"{'cell':14} | median loss | {'rounds':44} | write/dd"]
    for name, got in sorted(cells.items()):
        losses = [x for x, _ in got]
        each = " ".join(f"{x:+.1%}" for x in losses)
        ratios = [r for _, r in got if r == r]  # no NaN: a tree that wrote nothing
        dd = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        lines.append(
            f"{name:14} | {statistics.median(losses):11.1%} | {each:44} | {dd}"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--cells", action="store_true", help="paths are result folders")
    p.add_argument(
        "--paired",
        action="store_true",
        help="paths are result folders of one-round files with none and seal rows",
    )
    args = p.parse_args()
    if args.cells or args.paired:
        paths = sorted(f for d in args.paths for f in d.glob("wb_*.json"))
    else:
        paths = [f for f in args.paths if f.exists()]
    if not paths:
        print(f"no write-behind JSON in {' '.join(map(str, args.paths))}")
        return 1
    if args.paired:
        print(paired(paths))
        return 0
    cells = _cells(paths, args.cells)
    print(summary(cells, "main_none" if args.cells else "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
