"""The table an A/B of transfer.py runs ends with: one row per run tag and N
(random ids), from each run's transfer-TAG.json.

    python3 benchmarks/transfer_ab_summary.py RESULTS_DIR loop1 thread1 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("save_ratio", "load_ratio", "save_copy_GBps", "load_copy_GBps")
EXTRA = ("lat_load_p50_ms", "lat_save_event_p50_ms", "both_total_GBps")


def main(argv: list[str]) -> int:
    res, tags = Path(argv[0]), argv[1:]
    print(" | ".join(("run", "N", *COLUMNS, *EXTRA)))
    for tag in tags:
        path = res / f"transfer-{tag}.json"
        if not path.exists():
            print(f"{tag} | missing")
            continue
        doc = json.loads(path.read_text())
        extra = doc.get("extra", {})
        for row in doc.get("rows", []):
            if row.get("ids") == "random":
                cells = [row.get(c, "-") for c in COLUMNS]
                cells += [extra.get(c, "-") for c in EXTRA]
                print(" | ".join(map(str, (tag, row["N"], *cells))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
