"""The progress table is thinned as points are added (orchestrator/store/thinning.py, issue 18): recent points
at full resolution, older ones one per bucket growing with age, and never the newest or first point of a rank
or a point whose loss was not finite."""

from __future__ import annotations

import math

from orchestrator.store import Store
from orchestrator.store.thinning import BUCKETS_PER_LEVEL, RECENT_STEPS, kept_ids, rank_bound

RANKS, STEPS = 4, 25_000  # 100,000 points


def _fill(store: Store, job: str = "j-1", bad_steps: frozenset[int] = frozenset()) -> None:
    store.create_job(job, "t", {})
    for first in range(0, STEPS, 500):  # as an attempt adds them: a batch of every rank's points at a time
        batch = []
        for step in range(first, first + 500):
            for rank in range(RANKS):
                loss = math.nan if (step in bad_steps and rank == 1) else 1.0 / (step + 1)
                batch.append((rank, {"step": step, "at": 1000.0 + step, "loss": loss}))
        store.add_progress(job, 1, batch)


def test_100k_points_keep_a_bounded_set_with_recent_first_newest_and_non_finite(tmp_path) -> None:
    store = Store(tmp_path / "orch.db")
    bad = frozenset({3, 7_777, 20_001})
    _fill(store, bad_steps=bad)
    store.thin_progress("j-1", 1)
    points = store.progress("j-1", 1)
    assert len(points) <= RANKS * rank_bound(STEPS) + len(bad)
    assert len(points) < 100_000 // 10  # a month-long job stays small: here 1/10 of what was reported
    by_rank: dict[int, list[int]] = {}
    for p in points:
        by_rank.setdefault(p["rank"], []).append(p["step"])
    assert sorted(by_rank) == list(range(RANKS))
    for rank, steps in by_rank.items():
        assert steps == sorted(steps)  # still in the order they were added
        assert steps[0] == 0 and steps[-1] == STEPS - 1  # the first and the newest point
        recent = [s for s in steps if s > STEPS - 1 - RECENT_STEPS]
        assert recent == list(range(STEPS - RECENT_STEPS, STEPS))  # every recent point
        old = [s for s in steps if s <= STEPS - 1 - RECENT_STEPS]
        assert len(old) <= (BUCKETS_PER_LEVEL + 2) * 6 + 2 + (len(bad) if rank == 1 else 0)
        # the oldest points (16,000 steps or more behind) are one per 160-step bucket
        gaps = [b - a for a, b in zip(old, old[1:]) if b < STEPS - 16 * RECENT_STEPS]
        assert gaps and max(gaps) <= 2 * 16 * RECENT_STEPS // BUCKETS_PER_LEVEL + 1
    nan_steps = {p["step"] for p in points if p["rank"] == 1 and p["loss"] == "nan"}
    assert nan_steps == set(bad)  # every non-finite loss is kept
    latest = store.latest_progress("j-1", 1)
    assert {r: p["step"] for r, p in latest.items()} == {r: STEPS - 1 for r in range(RANKS)}
    assert store.progress("j-1", 1, since_id=points[-5]["id"]) == points[-4:]


def test_thinning_runs_while_points_are_added(tmp_path) -> None:
    """No explicit pass: add_progress thins the attempt now and then, so the table never grows unbounded."""
    store = Store(tmp_path / "orch.db")
    _fill(store)
    rows = store.progress("j-1", 1)
    # a pass runs once as many new points arrived as the last one kept: at most twice the bound, never 100k
    assert len(rows) <= 2 * RANKS * rank_bound(STEPS) + 2000
    assert {r: p["step"] for r, p in store.latest_progress("j-1", 1).items()} == {r: STEPS - 1 for r in range(RANKS)}
    summary = store.progress_summaries([("j-1", 1)])[("j-1", 1)]
    assert summary["step"] == STEPS - 1 and summary["ranks"] == {str(r): STEPS - 1 for r in range(RANKS)}


def test_an_attempt_keeping_many_rows_is_thinned_a_part_of_its_ranks_at_a_time(tmp_path, monkeypatch) -> None:
    from orchestrator.store import thinning
    monkeypatch.setattr(thinning, "PASS_ROWS", 1500)  # 4 ranks keep ~6,000 rows: passes over 1 or 2 ranks each
    seen: list[int] = []
    real = thinning.ProgressThinning._thin

    def spy(self, db, job_id, attempt, parts=1, part=0):
        seen.append(parts)
        return real(self, db, job_id, attempt, parts, part)
    monkeypatch.setattr(thinning.ProgressThinning, "_thin", spy)
    store = Store(tmp_path / "orch.db")
    _fill(store)
    assert max(seen) >= 2  # some passes covered a part of the ranks only
    rows = store.progress("j-1", 1)
    per_rank = {r: sum(1 for p in rows if p["rank"] == r) for r in range(RANKS)}
    # every rank was thinned in turn: at most what it keeps, and two turns' worth of new points
    assert all(n <= 3 * rank_bound(STEPS) + 2000 for n in per_rank.values()), per_rank
    assert len(rows) <= 2 * RANKS * rank_bound(STEPS) + 2000
    assert {r: p["step"] for r, p in store.latest_progress("j-1", 1).items()} == {r: STEPS - 1 for r in range(RANKS)}


def test_a_short_job_loses_nothing(tmp_path) -> None:
    store = Store(tmp_path / "orch.db")
    store.create_job("j-2", "t", {})
    store.add_progress("j-2", 1, [(r, {"step": s, "at": float(s)}) for s in range(RECENT_STEPS) for r in range(2)])
    assert store.thin_progress("j-2", 1) == 0 and len(store.progress("j-2", 1)) == 2 * RECENT_STEPS


def test_a_second_pass_over_what_a_pass_kept_removes_nothing() -> None:
    rows = [(i, 0, i, i % 997 == 0) for i in range(20_000)]
    kept = kept_ids(rows)
    assert len(kept) < len(rows) // 5 and {r[0] for r in rows if r[3]} <= kept
    assert kept_ids([r for r in rows if r[0] in kept]) == kept
