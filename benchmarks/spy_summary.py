"""Summarise `py-spy record --format raw` output of a benchmark run: where the
pegaflow server process spends its samples (self and inclusive, by function),
so a profile of a device run comes back as a page of text, not 30 MB.

  python benchmarks/spy_summary.py transfer_spy.txt --match pegaflow.cli
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

RECORD = re.compile(r"(.*?) (\d+)\n", re.S)
LINE = re.compile(r" \(([^():]*?):\d+\)$")


def _frames(stack: str, match: str) -> list[str] | None:
    parts = stack.split(";")
    procs = [p for p in parts if p.startswith("process ")]
    if match and (not procs or match not in procs[-1]):
        return None  # --match "": every sample (a `py-spy record --pid` file)
    frames = [p for p in parts if not p.startswith("process ")]

    # "fn (path/to/file.py:123)" -> "fn (file.py)": lines split one function
    def shorten(m: re.Match) -> str:
        return f" ({m.group(1).rsplit('/', 1)[-1]})"

    short = [LINE.sub(shorten, f) for f in frames]
    return short


def summarise(text: str, match: str, top: int, within: str = "") -> str:
    own, incl, roots = Counter(), Counter(), Counter()
    total = 0
    for stack, count in RECORD.findall(text):
        frames = _frames(stack, match)
        if frames is None:
            continue
        if within and not any(within in f for f in frames):
            continue
        n = int(count)
        total += n
        if not frames:
            own["(no python frame)"] += n
            continue
        own[frames[-1]] += n
        roots[frames[0] if len(frames) < 3 else ";".join(frames[:3])] += n
        for f in set(frames):
            incl[f] += n
    out = [f"samples in processes matching {match!r}: {total}"]
    if within:
        out[0] += f" (stacks through {within!r} only)"
    for title, counter in (("self", own), ("inclusive", incl), ("roots", roots)):
        out.append(f"\n-- {title} (top {top}) --")
        for name, n in counter.most_common(top):
            out.append(f"{100 * n / max(total, 1):6.1f}%  {n:7d}  {name[:160]}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw")
    p.add_argument("--match", default="pegaflow.cli")
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--within", default="", help="only stacks through this frame")
    args = p.parse_args()
    with open(args.raw, errors="replace") as f:
        print(summarise(f.read(), args.match, args.top, args.within))


if __name__ == "__main__":
    main()
