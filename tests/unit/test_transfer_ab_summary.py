"""benchmarks/transfer_ab_summary.py: the A/B table from transfer.py's JSON."""

from __future__ import annotations

import json

from benchmarks import transfer_ab_summary


def test_one_row_per_tag_and_random_size(tmp_path, capsys) -> None:
    doc = {
        "rows": [
            {"N": 64, "ids": "random", "save_ratio": 0.63, "load_ratio": 0.69,
             "save_copy_GBps": 45.3, "load_copy_GBps": 43.6},
            {"N": 64, "ids": "contig", "save_ratio": 0.1},
        ],
        "extra": {"lat_load_p50_ms": 0.61, "both_total_GBps": 63.8},
    }  # fmt: skip
    (tmp_path / "transfer-loop1.json").write_text(json.dumps(doc))
    assert transfer_ab_summary.main([str(tmp_path), "loop1", "thread1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "loop1 | 64 | 0.63 | 0.69 | 45.3 | 43.6 | 0.61 | - | 63.8"
    assert lines[2] == "thread1 | missing" and len(lines) == 3
