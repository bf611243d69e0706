"""A job's progress in the job list (``orch list``, ``GET /api/jobs``, the dashboard's list): the step (the
slowest rank's), the loss (rank 0's), steps/s over the recent window and the ETA, from the attempt's progress
row the store keeps as steps are recorded; the list's columns fit the terminal.

Store-level and pure tests with an injected clock; the same fields under a real server are in
tests/test_server.py, in a real browser in tests/test_web_dashboard.py.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from conftest import ROOT

from orchestrator.face.cli.render import fmt_eta, fmt_rate, jobs_table
from orchestrator.observe import job_detail, job_list
from orchestrator.observe.progress import STALE_S, progress_fields, steps_per_second
from orchestrator.store import JobState, Store
from orchestrator.store.progress import WINDOW_S, fold

ARTIFACTS = Path(os.environ.get("ORCH_TEST_ARTIFACTS") or ROOT / "test-artifacts")
PLAN = {"world_size": 2, "nodes": [{"host": "a", "node_rank": 0, "log_dir": "/nonexistent", "ranks": []}]}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path):
    clock = Clock()
    s = Store(tmp_path / "orch.db", clock=clock)
    s.test_clock = clock
    yield s
    s.close()


def _running(store: Store, job_id: str) -> None:
    store.create_job(job_id, "t", {"name": "t"})
    store.add_attempt(job_id, 1, PLAN, None)
    store.set_state(job_id, JobState.PROVISIONING)
    store.set_state(job_id, JobState.RUNNING)


def _train(store: Store, job_id: str, seconds: int, rate: float, start: int = 0, lag: int = 0,
           total: int | None = None) -> int:
    """Report a step of ranks 0 and 1 once a second (rank 1 ``lag`` steps behind); returns the last step."""
    step = start
    for _ in range(seconds):
        store.test_clock.now += 1.0
        step += rate
        points = [(0, {"step": int(step), "at": store.test_clock.now, "loss": 10.0 / (1 + step), "total_steps": total}),
                  (1, {"step": int(step) - lag, "at": store.test_clock.now, "loss": 99.0})]
        store.add_progress(job_id, 1, [(r, {k: v for k, v in p.items() if v is not None}) for r, p in points])
    return int(step)


def test_the_list_shows_the_slowest_ranks_step_rank_0s_loss_the_recent_rate_and_the_eta(store) -> None:
    _running(store, "j-1")
    _train(store, "j-1", 40, 2.0)  # 2 steps/s for 40 s, then 10 steps/s: the rate is the recent one
    last = _train(store, "j-1", 40, 10.0, start=80, lag=3, total=1000)
    (j,) = job_list(store, 10)
    assert j["step"] == last - 3 and j["total_steps"] == 1000  # the straggler's step
    assert j["loss"] == pytest.approx(10.0 / (1 + last)) and j["loss_step"] == last  # rank 0's, not rank 1's 99
    assert j["steps_per_second"] == pytest.approx(10.0)
    assert j["eta_seconds"] == pytest.approx((1000 - (last - 3)) / 10.0)
    assert j["progress_at"] == store.test_clock.now
    # the job's detail (orch status, GET /api/jobs/{id}) carries the same line
    detail = job_detail(store, "j-1")
    assert {k: detail[k] for k in ("step", "loss", "steps_per_second", "eta_seconds")} == \
        {k: j[k] for k in ("step", "loss", "steps_per_second", "eta_seconds")}


def test_a_stalled_job_s_rate_falls_and_its_eta_grows(store) -> None:
    _running(store, "j-1")
    _train(store, "j-1", 40, 5.0, total=10_000)
    before = job_list(store, 1)[0]
    assert before["steps_per_second"] == pytest.approx(5.0)
    store.test_clock.now += STALE_S  # reports a few seconds late: still the same rate
    assert job_list(store, 1)[0]["steps_per_second"] == pytest.approx(5.0)
    store.test_clock.now += WINDOW_S  # nothing for half a minute more: the window's steps over a longer time
    stalled = job_list(store, 1)[0]
    assert 0 < stalled["steps_per_second"] < 5.0 / 1.9
    assert stalled["eta_seconds"] > 1.9 * before["eta_seconds"] - 60


def test_a_finished_job_keeps_its_last_step_and_loss_without_a_rate_or_eta(store) -> None:
    _running(store, "j-1")
    last = _train(store, "j-1", 10, 3.0, total=30)
    store.set_state("j-1", JobState.SUCCEEDED)
    (j,) = job_list(store, 10)
    assert (j["step"], j["loss"], j["total_steps"]) == (last, pytest.approx(10.0 / (1 + last)), 30)
    assert j["steps_per_second"] is None and j["eta_seconds"] is None


def test_a_job_without_steps_or_total_has_none_and_a_new_attempt_starts_over(store) -> None:
    store.create_job("j-0", "t", {"name": "t"})  # never started
    _running(store, "j-1")
    _train(store, "j-1", 5, 1.0)  # no total reported: no ETA
    jobs = {j["id"]: j for j in job_list(store, 10)}
    assert all(jobs["j-0"][k] is None for k in ("step", "loss", "steps_per_second", "eta_seconds", "total_steps"))
    assert jobs["j-1"]["step"] == 5 and jobs["j-1"]["steps_per_second"] == pytest.approx(1.0)
    assert jobs["j-1"]["eta_seconds"] is None
    store.set_state("j-1", JobState.FAILED, cause={"kind": "rank_exit", "message": "x"})
    store.set_state("j-1", JobState.PENDING)
    store.add_attempt("j-1", 2, PLAN, "step_3")
    assert job_list(store, 10)[0]["step"] is None  # attempt 2 has reported nothing yet


def test_fold_keeps_a_bounded_window_and_a_diverged_loss() -> None:
    s = None
    for i in range(300):  # 300 s, a batch every half second from two nodes
        s = fold(s, [(i % 2, {"step": i, "loss": "nan" if i == 298 else 1.0})], 1000.0 + i / 2)
    assert s["step"] == 298 and s["loss"] == "nan" and s["loss_rank"] == 0
    assert len(s["samples"]) <= WINDOW_S + 3  # about one a second
    assert s["samples"][0][0] <= s["at"] - WINDOW_S < s["samples"][1][0]
    assert progress_fields(s, True, s["at"])["loss"] == "nan"
    # a step counter that went back (a restarted count) measures anew instead of a negative rate
    s = fold(s, [(0, {"step": 5}), (1, {"step": 5})], s["at"] + 1)
    assert s["samples"] == [[s["at"], 5]] and steps_per_second(s["samples"], s["at"], True) is None


def test_the_page_s_progress_is_one_indexed_query(store) -> None:
    plan = store._db.execute("EXPLAIN QUERY PLAN SELECT * FROM progress_summary WHERE (job_id = ? AND attempt = ?) "
                             "OR (job_id = ? AND attempt = ?)", ("a", 1, "b", 1)).fetchall()
    assert plan and all("USING INDEX" in r["detail"] or "PRIMARY KEY" in r["detail"] for r in plan
                        if "SCAN" in r["detail"] or "SEARCH" in r["detail"]), [r["detail"] for r in plan]
    assert not any(r["detail"].startswith("SCAN progress_summary") for r in plan)
    for i in range(450):  # more than one chunk of the query
        store.create_job(f"j-{i:03d}", "t", {"name": "t"})
        store.add_attempt(f"j-{i:03d}", 1, PLAN, None)
        store.add_progress(f"j-{i:03d}", 1, [(0, {"step": i, "at": 1.0})])
    got = store.progress_summaries([(f"j-{i:03d}", 1) for i in range(450)] + [("nope", 1)])
    assert len(got) == 450 and got[("j-449", 1)]["step"] == 449


def _render(jobs: list[dict], width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(jobs_table(jobs, width))
    return out.getvalue().splitlines()


def test_orch_list_s_table_fits_the_terminal(store) -> None:
    _running(store, "quickstart-fail-a1b2c3")
    _train(store, "quickstart-fail-a1b2c3", 40, 12.5, total=3000)
    store.create_job("other-job-d4e5f6", "t", {"name": "t"})
    store.set_state("other-job-d4e5f6", JobState.FAILED,
                    cause={"kind": "rank_exit", "message": "rank 3 (local rank 1) on node-1 exited with exit code 1"})
    jobs = job_list(store, 10)
    for width in (80, 120, 200):
        lines = _render(jobs, width)
        assert all(len(line.rstrip()) <= width for line in lines), (width, lines)
        header = lines[0].split()
        assert header[:2] == ["job", "state"] and {"step", "loss", "steps/s", "eta", "cause"} <= set(header), lines
        running = next(line for line in lines if line.startswith("quickstart-fail-a1b2c3"))
        assert "500/3000" in running and " 12.5 " in running and " 3m20s" in running
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / f"orch-list-{width}-columns.txt").write_text("\n".join(lines) + "\n")
    assert {"attempt", "restarts", "world", "updated"} <= set(_render(jobs, 200)[0].split())
    # no job with a step, or none with a cause: no empty columns
    by_id = {j["id"]: j for j in jobs}
    assert "cause" not in _render([by_id["quickstart-fail-a1b2c3"]], 80)[0].split()
    assert not {"step", "loss", "steps/s", "eta"} & set(_render([by_id["other-job-d4e5f6"]], 80)[0].split())


def test_formats() -> None:
    assert [fmt_rate(v) for v in (None, 0.0, 0.0512, 12.34, 1234.5)] == ["-", "0.00", "0.05", "12.3", "1234"]
    assert [fmt_eta(v) for v in (None, 0, 59.6, 245, 7980, 3 * 86400 + 4 * 3600)] == \
        ["-", "0s", "1m00s", "4m05s", "2h13m", "3d04h"]
