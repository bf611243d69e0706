"""Which files lost coverage between two ``coverage json`` reports (issue 35: no file may lose more than a point).

    python tests/coverage_compare.py BEFORE.json AFTER.json [--points 1.0]

Prints, for every file of both reports whose line or branch coverage fell by more than ``--points``
percentage points, the fall, the two percentages and the lines (and branches) missed after but not before;
then both reports' totals. Exit status 1 when a file fell by more than that, else 0. docs/testing.md has
the commands that make the two reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable

#: (name, covered key, total key) of coverage.py's JSON ``summary``
MEASURES = (("lines", "covered_lines", "num_statements"), ("branches", "covered_branches", "num_branches"))


def percent(summary: dict, covered: str, total: str) -> float:
    """``summary[covered]`` of ``summary[total]`` in percent; 100 where there is nothing to cover."""
    return 100.0 * summary[covered] / summary[total] if summary.get(total) else 100.0


def falls(before: dict, after: dict, points: float) -> list[tuple[float, str, str, float, float, list]]:
    """``(fall, file, measure, before %, after %, newly missed)`` for each file of both reports (``files``
    of ``coverage json``) whose measure fell by more than ``points``, biggest fall first."""
    out = []
    for name in sorted(set(before["files"]) & set(after["files"])):
        a, b = before["files"][name], after["files"][name]
        for measure, covered, total in MEASURES:
            x, y = percent(a["summary"], covered, total), percent(b["summary"], covered, total)
            if x - y > points:
                key = "missing_lines" if measure == "lines" else "missing_branches"
                old = {tuple(m) if isinstance(m, list) else m for m in a.get(key, [])}
                new = [m for m in b.get(key, []) if (tuple(m) if isinstance(m, list) else m) not in old]
                out.append((x - y, name, measure, x, y, new))
    return sorted(out, key=lambda row: -row[0])


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--points", type=float, default=1.0, help="the fall allowed, in percentage points")
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    except (OSError, ValueError) as err:
        print(f"cannot read a coverage JSON report: {err}", file=sys.stderr)
        return 2
    rows = falls(before, after, args.points)
    for fall, name, measure, x, y, new in rows:
        print(f"{name}: {measure} {x:.1f}% -> {y:.1f}% (-{fall:.1f}); newly missed: {new}")
    for label, report in (("before", before), ("after", after)):
        t = report["totals"]
        print(f"{label}: lines {percent(t, 'covered_lines', 'num_statements'):.2f}%, "
              f"branches {percent(t, 'covered_branches', 'num_branches'):.2f}%")
    print(f"{len(rows)} file measure(s) fell by more than {args.points:g} point(s)")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
