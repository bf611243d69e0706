"""Job states, the transition table, and the durable store."""

from __future__ import annotations

import itertools
import sqlite3

import pytest

from orchestrator.errors import NotFoundError, StateError
from orchestrator.store import TRANSITIONS, JobState, can_transition, check_transition
from orchestrator.store import Store

EXPECTED = {
    ("PENDING", "PROVISIONING"), ("PENDING", "FAILED"), ("PENDING", "CANCELLED"),
    ("PROVISIONING", "RUNNING"), ("PROVISIONING", "FAILED"), ("PROVISIONING", "CANCELLED"),
    ("RUNNING", "SUCCEEDED"), ("RUNNING", "FAILED"), ("RUNNING", "CANCELLED"),
    ("FAILED", "PENDING"), ("CANCELLED", "PENDING"),
}


@pytest.mark.parametrize("old,new", list(itertools.product(JobState, JobState)))
def test_every_pair_of_states(old: JobState, new: JobState) -> None:
    legal = (old.value, new.value) in EXPECTED
    assert can_transition(old, new) is legal
    if legal:
        check_transition("j", old, new)
    else:
        with pytest.raises(StateError) as err:
            check_transition("j", old, new)
        assert old.value in str(err.value) and new.value in str(err.value)


def test_terminal_and_resumable() -> None:
    assert {s for s in JobState if s.is_terminal()} == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    assert {s for s in JobState if s.is_resumable()} == {JobState.FAILED, JobState.CANCELLED}
    assert TRANSITIONS[JobState.SUCCEEDED] == frozenset()


def _store(tmp_path) -> Store:
    ticks = itertools.count(1000)
    return Store(tmp_path / "orch.db", clock=lambda: float(next(ticks)))


def test_store_walks_a_job_and_survives_reopen(tmp_path) -> None:
    s = _store(tmp_path)
    s.create_job("demo-abc123", "demo", {"name": "demo"})
    s.add_attempt("demo-abc123", 1, {"nodes": [{"host": "w0"}], "world_size": 2}, None)
    for st in (JobState.PROVISIONING, JobState.RUNNING):
        s.set_state("demo-abc123", st)
    cause = {"kind": "rank_exit", "message": "rank 1 exited with exit code 3"}
    s.set_state("demo-abc123", JobState.FAILED, cause=cause)
    s.mark_stopped("demo-abc123", 1)
    s.close()

    s2 = Store(tmp_path / "orch.db")
    job = s2.get_job("demo-abc123")
    assert job.state == JobState.FAILED and job.cause == cause and job.attempt == 1
    (a,) = s2.attempts(job.id)
    assert a.state == JobState.FAILED and a.cause == cause
    assert a.running_at and a.ended_at and a.stopped_at and a.created_at <= a.running_at <= a.ended_at
    kinds = [(e.kind, e.data.get("to")) for e in s2.events(job.id)]
    assert kinds == [("submitted", None), ("attempt", None), ("state", "PROVISIONING"), ("state", "RUNNING"),
                     ("state", "FAILED"), ("stopped", None)]
    assert s2._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_store_refuses_illegal_moves_and_keeps_state(tmp_path) -> None:
    s = _store(tmp_path)
    s.create_job("j-1", "j", {})
    with pytest.raises(StateError):
        s.set_state("j-1", JobState.SUCCEEDED)
    assert s.get_job("j-1").state == JobState.PENDING
    assert [e.kind for e in s.events("j-1")] == ["submitted"]


def test_resume_clears_cause_and_starts_a_new_attempt(tmp_path) -> None:
    s = _store(tmp_path)
    s.create_job("j-1", "j", {})
    s.add_attempt("j-1", 1, {"nodes": []}, None)
    s.set_state("j-1", JobState.PROVISIONING)
    s.set_state("j-1", JobState.CANCELLED, cause={"kind": "cancelled"})
    s.request_cancel("j-1")
    s.set_state("j-1", JobState.PENDING)
    s.add_attempt("j-1", 2, {"nodes": []}, "step_20")
    job = s.get_job("j-1")
    assert job.cause is None and job.attempt == 2 and not job.cancel_requested
    assert [a.state for a in s.attempts("j-1")] == [JobState.CANCELLED, JobState.PENDING]
    assert s.get_attempt("j-1", 2).resume_tag == "step_20"


def test_revise_cause_only_of_an_ended_attempt_and_only_the_current_job_cause(tmp_path) -> None:
    s = _store(tmp_path)
    s.create_job("j-1", "j", {})
    s.add_attempt("j-1", 1, {"nodes": []}, None)
    s.set_state("j-1", JobState.PROVISIONING)
    with pytest.raises(StateError, match="attempt 1 has not ended"):
        s.revise_cause("j-1", 1, {"kind": "node_lost"})
    first = {"kind": "rank_exit", "global_rank": 2}
    s.set_state("j-1", JobState.FAILED, cause=first)
    root = {"kind": "node_lost", "node": "b", "first_symptom": first}
    s.revise_cause("j-1", 1, root)
    assert s.get_job("j-1").cause == root and s.get_attempt("j-1", 1).cause == root
    (ev,) = [e for e in s.events("j-1") if e.kind == "cause_revised"]
    assert ev.attempt == 1 and ev.data == {"was": first, "cause": root}
    s.set_state("j-1", JobState.PENDING)
    s.add_attempt("j-1", 2, {"nodes": []}, None)
    s.revise_cause("j-1", 1, {"kind": "node_lost", "node": "c"})  # an older attempt: the job's cause stays
    assert s.get_job("j-1").cause is None and s.get_attempt("j-1", 1).cause["node"] == "c"


def test_progress_points_in_order_since_an_id_and_the_latest_per_rank(tmp_path) -> None:
    s = _store(tmp_path)
    s.create_job("j-1", "j", {})
    s.add_attempt("j-1", 1, {"nodes": []}, None)
    s.add_progress("j-1", 1, [(0, {"step": 1, "at": 10.0, "loss": 5.0}), (1, {"step": 1, "at": 10.1, "loss": 5.1}),
                              (0, {"step": 2, "at": 11.0, "loss": float("nan")})])
    points = s.progress("j-1", 1)
    assert [(p["rank"], p["step"]) for p in points] == [(0, 1), (1, 1), (0, 2)]
    assert points[2]["loss"] == "nan" and points[0]["at"] == 10.0  # JSON has no NaN: kept as a string
    assert [p["step"] for p in s.progress("j-1", 1, since_id=points[1]["id"])] == [2]
    assert s.progress("j-1", 2) == []
    latest = s.latest_progress("j-1", 1)
    assert {r: p["step"] for r, p in latest.items()} == {0: 2, 1: 1}


def test_get_job_by_prefix(tmp_path) -> None:
    s = _store(tmp_path)
    s.create_job("alpha-111111", "alpha", {})
    s.create_job("alpha-222222", "alpha", {})
    assert s.get_job("alpha-1").id == "alpha-111111"
    with pytest.raises(NotFoundError, match="ambiguous"):
        s.get_job("alpha-")
    with pytest.raises(NotFoundError, match="orch list"):
        s.get_job("beta")
    with pytest.raises(NotFoundError):
        s.get_job("%")  # LIKE wildcards are taken literally


def test_two_connections_see_each_others_writes(tmp_path) -> None:
    a, b = Store(tmp_path / "orch.db"), Store(tmp_path / "orch.db")
    a.create_job("j-1", "j", {})
    b.set_state("j-1", JobState.PROVISIONING)
    assert a.get_job("j-1").state == JobState.PROVISIONING
    assert isinstance(a._db, sqlite3.Connection)


def test_a_damaged_database_is_one_clear_error(tmp_path) -> None:
    db = tmp_path / "orch.db"
    db.write_text("garbage, not SQLite\n")
    with pytest.raises(StateError, match=r"Cannot use the state database .*orch.db: file is not a database.*move it away"):
        Store(db)
    assert db.read_text() == "garbage, not SQLite\n"  # nothing lost: the file is left as it was
