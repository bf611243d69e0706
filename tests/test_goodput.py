"""Goodput per job (orchestrator/observe/goodput.py, docs/goodput.md): unit tests on hand-built records, the
Prometheus series from a store, and one real job on local agents that fails once and is resumed by its restart
policy, checked through ``orch status --output json``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from conftest import ROOT
from orchestrator.observe.goodput import CATEGORIES, compute_goodput, tag_step, timeline
from orchestrator.observe.metrics import ControllerMetrics
from orchestrator.store import AttemptRecord, JobRecord, JobState, Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

T0 = 1_000_000.0


def _job(state: JobState, attempt: int, updated: float) -> JobRecord:
    return JobRecord("g-abc123", "g", state, {}, attempt, None, None, False, T0, updated)


def _attempt(number: int, state: JobState, created: float, ended: float | None, tag: str | None = None,
             plan: dict | None = None) -> AttemptRecord:
    return AttemptRecord("g-abc123", number, state, plan or {}, tag, None, created, created + 0.5, ended, ended)


def _steps(first: int, last: int, t_first: float, step_s: float, ranks: int = 2, pause: dict | None = None) -> list:
    """Points of steps first..last, ``step_s`` apart, every rank; ``pause``: ``{step: extra seconds before it}``."""
    out, t = [], t_first
    for s in range(first, last + 1):
        t += (pause or {}).get(s, 0.0) if s > first else 0.0
        out += [{"step": s, "at": t + 0.001 * r, "rank": r} for r in range(ranks)]
        t += step_s
    return out


def _sums_to_wall(g) -> None:
    assert set(g.seconds) == set(CATEGORIES)
    assert all(v >= 0 for v in g.seconds.values()), g.seconds
    assert math.isclose(sum(g.seconds.values()), g.wall_seconds, rel_tol=1e-9, abs_tol=1e-9)


def test_a_clean_run_is_startup_productive_checkpoint_and_wind_down() -> None:
    # created T0, attempt at +1, first step at +11, steps 1..100 every 0.1 s, a save of 2 s after step 50
    points = _steps(1, 100, T0 + 11, 0.1, pause={51: 2.0})
    last_at = max(p["at"] for p in points)
    job = _job(JobState.SUCCEEDED, 1, last_at + 3)
    a1 = _attempt(1, JobState.SUCCEEDED, T0 + 1, last_at + 3)
    save_at = T0 + 11 + 49 * 0.1 + 0.5  # a file written inside the gap after step 50
    g = compute_goodput(job, [a1], {1: points}, [save_at], now=last_at + 100)
    _sums_to_wall(g)
    assert g.wall_seconds == pytest.approx(last_at + 3 - T0)
    assert g.seconds["queued"] == pytest.approx(1.0)
    assert g.seconds["startup"] == pytest.approx(10.0)
    assert g.seconds["checkpoint"] == pytest.approx(2.0, abs=0.01)
    assert g.seconds["wind_down"] == pytest.approx(3.0, abs=0.01)
    assert g.seconds["productive"] == pytest.approx(99 * 0.1, abs=0.01)
    assert g.lost_steps == 0 and g.seconds["lost_work"] == 0 and g.checkpoint_saves == 1
    assert g.typical_step_seconds == pytest.approx(0.1)
    assert g.effective_ratio == pytest.approx(g.seconds["productive"] / g.wall_seconds)
    assert not g.running and g.to_dict()["percent"]["productive"] == pytest.approx(100 * g.effective_ratio)


def test_a_failed_and_resumed_run_loses_the_steps_after_the_resumed_tag() -> None:
    # attempt 1: steps 1..37 (a save after 20 and 30), fails; attempt 2 resumes from step_30, runs 31..60
    p1 = _steps(1, 37, T0 + 10, 0.5, pause={21: 1.0, 31: 1.0})
    end1 = max(p["at"] for p in p1) + 4.0  # failure detection: 4 s
    p2 = _steps(31, 60, end1 + 2.0 + 8.0, 0.5)  # restart gap 2 s, startup 8 s
    end2 = max(p["at"] for p in p2) + 1.0
    writes = [T0 + 10 + 19 * 0.5 + 0.3, T0 + 10 + 29 * 0.5 + 1.0 + 0.3]
    job = _job(JobState.SUCCEEDED, 2, end2)
    attempts = [_attempt(1, JobState.FAILED, T0, end1), _attempt(2, JobState.SUCCEEDED, end1 + 2.0, end2, "step_30")]
    g = compute_goodput(job, attempts, {1: p1, 2: p2}, writes, now=end2)
    _sums_to_wall(g)
    assert g.lost_steps == 37 - 30
    assert g.seconds["lost_work"] == pytest.approx(7 * 0.5, abs=0.01)  # steps 31..37 of attempt 1
    assert g.seconds["failure_detection"] == pytest.approx(4.0, abs=0.01)
    assert g.seconds["restart_gap"] == pytest.approx(2.0)
    assert g.seconds["startup"] == pytest.approx(10.0 + 8.0, abs=0.01)
    assert g.seconds["checkpoint"] == pytest.approx(2.0, abs=0.01)
    assert g.seconds["wind_down"] == pytest.approx(1.0, abs=0.01)
    # kept: attempt 1's steps 2..30 (the first step is start-up's), attempt 2's 32..60
    assert g.seconds["productive"] == pytest.approx((29 + 29) * 0.5, abs=0.02)
    assert [a["lost_steps"] for a in g.attempts] == [7, 0] and g.attempts[1]["resume_step"] == 30


def test_a_resume_from_an_older_tag_throws_away_the_later_attempts_steps_too() -> None:
    # attempt 1: 1..20 fails; attempt 2 from step_10: 11..25 fails; attempt 3 from a fresh start (step 0)
    p1, p2, p3 = _steps(1, 20, T0 + 5, 1.0), _steps(11, 25, T0 + 40, 1.0), _steps(1, 5, T0 + 70, 1.0)
    attempts = [_attempt(1, JobState.FAILED, T0, T0 + 30), _attempt(2, JobState.FAILED, T0 + 31, T0 + 60, "step_10"),
                _attempt(3, JobState.SUCCEEDED, T0 + 61, T0 + 80)]
    g = compute_goodput(_job(JobState.SUCCEEDED, 3, T0 + 80), attempts, {1: p1, 2: p2, 3: p3}, [], now=T0 + 80)
    _sums_to_wall(g)
    assert g.lost_steps == 20 + (25 - 10)
    assert [a["lost_steps"] for a in g.attempts] == [20, 15, 0]


def test_a_running_job_ends_now_and_counts_its_newest_step_onwards() -> None:
    points = _steps(1, 10, T0 + 5, 1.0)
    now = T0 + 20
    job = _job(JobState.RUNNING, 1, T0 + 2)
    g = compute_goodput(job, [_attempt(1, JobState.RUNNING, T0 + 1, None)], {1: points}, [], now=now)
    _sums_to_wall(g)
    assert g.running and g.end == now and g.wall_seconds == pytest.approx(20.0)
    assert g.seconds["startup"] == pytest.approx(4.0)
    assert g.seconds["productive"] == pytest.approx(9.0, abs=0.01)
    assert g.seconds["since_last_step"] == pytest.approx(now - (T0 + 5 + 9))  # the first rank's step 10 -> now


def test_a_job_without_a_step_is_all_startup_after_its_queue() -> None:
    job = _job(JobState.RUNNING, 1, T0 + 1)
    g = compute_goodput(job, [_attempt(1, JobState.RUNNING, T0 + 1, None)], {}, [], now=T0 + 31)
    _sums_to_wall(g)
    assert g.seconds["queued"] == pytest.approx(1.0) and g.seconds["startup"] == pytest.approx(30.0)
    assert g.effective_ratio == 0 and g.lost_steps == 0
    # one that failed before a step: start-up up to its end, nothing else
    failed = _job(JobState.FAILED, 1, T0 + 9)
    g = compute_goodput(failed, [_attempt(1, JobState.FAILED, T0, T0 + 9)], {}, [], now=T0 + 500)
    _sums_to_wall(g)
    assert g.wall_seconds == 9 and g.seconds["startup"] == 9
    # a job cancelled before it had an attempt: queued
    g = compute_goodput(_job(JobState.CANCELLED, 0, T0 + 4), [], {}, [], now=T0 + 500)
    assert g.seconds["queued"] == 4 and g.wall_seconds == 4


def test_clock_skew_never_makes_a_part_negative() -> None:
    points = _steps(1, 5, T0 - 50, 1.0)  # a node's clock far behind the controller's
    job = _job(JobState.SUCCEEDED, 1, T0 + 10)
    g = compute_goodput(job, [_attempt(1, JobState.SUCCEEDED, T0 + 1, T0 + 10)], {1: points}, [], now=T0 + 10)
    _sums_to_wall(g)


def test_tag_step_and_timeline() -> None:
    assert tag_step("step_40") == 40 and tag_step("global_step7") == 7 and tag_step("best") is None
    line = timeline([{"step": 2, "at": 5.0}, {"step": 1, "at": 6.0}, {"step": 2, "at": 4.0}, {"step": 3, "at": 4.5}])
    assert line == [(1, 6.0), (2, 6.0), (3, 6.0)]  # earliest per step, never earlier than the step before


def _finished_store(tmp_path) -> Store:
    """A store with one job, g-abc123: created at T0, running from T0 + 4 (steps 1-5 at T0 + 5 .. T0 + 9),
    SUCCEEDED at T0 + 12."""
    clock = [T0]
    store = Store(tmp_path / "orch.db", clock=lambda: clock[0])
    store.create_job("g-abc123", "g", {})
    store.set_state("g-abc123", JobState.PROVISIONING)
    store.add_attempt("g-abc123", 1, {"nodes": [], "world_size": 1}, None)
    clock[0] = T0 + 4
    store.set_state("g-abc123", JobState.RUNNING)
    store.add_progress("g-abc123", 1, [(0, {"step": s, "at": T0 + 4 + s}) for s in range(1, 6)])
    clock[0] = T0 + 12
    store.set_state("g-abc123", JobState.SUCCEEDED)
    return store


def test_prometheus_series_per_job_and_category(tmp_path) -> None:
    store = _finished_store(tmp_path)
    text = generate_latest(ControllerMetrics(store).registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "orch_job_seconds"]
    got = {s.labels["category"]: s.value for s in family.samples if s.labels["job"] == "g-abc123"}
    assert set(got) == set(CATEGORIES)
    assert got["startup"] == pytest.approx(5.0) and got["productive"] == pytest.approx(4.0)
    assert got["wind_down"] == pytest.approx(3.0) and sum(got.values()) == pytest.approx(12.0)


# -- a real job that fails once and is resumed ------------------------------------------------------------------

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
STEPS, INTERVAL, FAIL_AT = 40, 10, 25


@pytest.mark.integration
def test_a_job_that_fails_once_and_resumes_adds_up(orch, write_spec, hostfile, state_dir) -> None:
    helpers_train.prebuild_ops()
    config = json.loads((EXAMPLES / "ds_zero1.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    spec = write_spec(name="goodput", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")), launcher="pdsh",
                      workdir=str(EXAMPLES), entrypoint="train_gpt.py", deepspeed_config=config,
                      args=TINY + ["--steps", str(STEPS), "--checkpoint-interval", str(INTERVAL),
                                   "--fail-at-step", str(FAIL_AT), "--fail-rank", "1"],
                      restart={"max_restarts": 1, "backoff_seconds": 0}, stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    r = orch("run", str(spec), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert [a["state"] for a in detail["attempts"]] == ["FAILED", "SUCCEEDED"]
    g = detail["goodput"]

    # what the store recorded: attempt 1's last step before its failure, attempt 2's resume tag and its step
    store = Store(state_dir / "orch.db")
    last_before_failure = max(p["step"] for p in store.progress(job["id"], 1))
    tag = store.get_attempt(job["id"], 2).resume_tag
    resumed_step = int(tag.rsplit("_", 1)[1])
    assert resumed_step < last_before_failure
    assert g["lost_steps"] == last_before_failure - resumed_step

    wall = store.get_attempt(job["id"], 2).ended_at - store.get_job(job["id"]).created_at
    assert g["wall_seconds"] == pytest.approx(wall, rel=1e-9)
    assert abs(sum(g["seconds"].values()) - wall) <= 0.01 * wall
    for category in ("startup", "productive", "failure_detection", "lost_work"):
        assert g["seconds"][category] > 0, (category, g)
    assert g["checkpoint_saves"] >= 1 and 0 < g["effective_ratio"] < 1
    print("goodput:", json.dumps({k: round(v, 3) for k, v in g["seconds"].items()}), "wall", round(wall, 3),
          "ratio", round(g["effective_ratio"], 4), "lost_steps", g["lost_steps"], f"(from {tag}, failed after step "
          f"{last_before_failure})")

    text = orch("status", job["id"]).stdout
    assert "Goodput" in text and "lost_work" in text and "effective" in text


def test_the_api_shows_the_goodput_in_the_job_and_on_its_own_route(tmp_path) -> None:
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from orchestrator.face.api import create_app

    store = _finished_store(tmp_path)
    controller = SimpleNamespace(store=store, state_dir=tmp_path, metrics=ControllerMetrics(store),
                                 owner={"pid": 1}, unrecorded=lambda job_id: None)
    client = TestClient(create_app(controller, "tok", ["testserver"]), headers={"Authorization": "Bearer tok"})
    own = client.get("/api/jobs/g-abc123/goodput").json()
    assert own["job"] == "g-abc123" and own["wall_seconds"] == pytest.approx(12.0)
    assert own["seconds"]["productive"] == pytest.approx(4.0) and own["effective_ratio"] == pytest.approx(4 / 12)
    detail = client.get("/api/jobs/g-abc123").json()
    assert detail["goodput"]["seconds"] == own["seconds"]
    assert client.get("/api/jobs/nope/goodput").status_code == 404
