"""tests/coverage_compare.py: the files whose coverage fell, from two coverage.py JSON reports."""

from __future__ import annotations

import json

import coverage_compare


def _report(lines: tuple[int, int], branches: tuple[int, int], missing: list[int], missing_branches: list) -> dict:
    summary = {"covered_lines": lines[0], "num_statements": lines[1], "covered_branches": branches[0],
               "num_branches": branches[1]}
    return {"files": {"a.py": {"summary": summary, "missing_lines": missing, "missing_branches": missing_branches},
                      "b.py": {"summary": dict(summary), "missing_lines": missing, "missing_branches": []}},
            "totals": dict(summary)}


def test_a_fall_past_the_points_is_named_with_the_newly_missed_lines(tmp_path, capsys) -> None:
    before = _report((90, 100), (9, 10), [5], [])
    after = _report((88, 100), (9, 10), [5, 7, 8], [[3, 4]])
    after["files"]["a.py"]["summary"]["covered_branches"] = 8  # a.py: -2 lines, -10 branches; b.py: -2 lines
    (tmp_path / "before.json").write_text(json.dumps(before))
    (tmp_path / "after.json").write_text(json.dumps(after))
    rows = coverage_compare.falls(before, after, 1.0)
    assert [(name, measure, round(fall, 1), new) for fall, name, measure, _, _, new in rows] == [
        ("a.py", "branches", 10.0, [[3, 4]]), ("a.py", "lines", 2.0, [7, 8]), ("b.py", "lines", 2.0, [7, 8])]
    assert coverage_compare.falls(before, after, 10.0) == []  # not more than 10 points
    assert coverage_compare.main([str(tmp_path / "before.json"), str(tmp_path / "after.json")]) == 1
    assert "a.py: branches 90.0% -> 80.0% (-10.0); newly missed: [[3, 4]]" in capsys.readouterr().out
    assert coverage_compare.main([str(tmp_path / "before.json"), str(tmp_path / "before.json")]) == 0


def test_nothing_to_cover_is_full_and_an_unreadable_report_is_said(tmp_path, capsys) -> None:
    empty = {"covered_branches": 0, "num_branches": 0}
    assert coverage_compare.percent(empty, "covered_branches", "num_branches") == 100
    assert coverage_compare.main([str(tmp_path / "none.json"), str(tmp_path / "none.json")]) == 2
    assert "cannot read a coverage JSON report" in capsys.readouterr().err
