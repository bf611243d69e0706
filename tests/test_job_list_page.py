"""A page of the job list (``orch list``, ``GET /api/jobs``: ``observe.job_list``) reads its own rows only:
the jobs by the list's index, and of each attempt only its world size and hosts (issue 18; timing:
bench/plan_scale.py)."""

from __future__ import annotations

import collections

from orchestrator.observe import job_list
from orchestrator.observe.views import job_summary
from orchestrator.planning import PlanInputs, make_plan, resolve_pool
from orchestrator.spec import spec_from_dict
from orchestrator.store import Store


def _plan(tmp_path, nodes: int, job_id: str) -> dict:
    (tmp_path / "train.py").write_text("")
    spec = spec_from_dict({"name": "p", "entrypoint": "train.py", "workdir": str(tmp_path), "provisioner": "ssh"},
                          tmp_path)
    inputs = PlanInputs(job_id=job_id, master_port=29500, run_dir="/r", checkpoint_dir="/ck", python="/usr/bin/python3")
    hosts = collections.OrderedDict((f"h{(i * 7) % nodes}-{i}", 2) for i in range(nodes))  # not in sorted order
    return make_plan(spec, resolve_pool(hosts), inputs).to_dict()


def test_a_page_shows_what_the_whole_attempts_would_and_uses_the_index(tmp_path) -> None:
    clock = iter(range(1000, 2000))
    store = Store(tmp_path / "orch.db", clock=lambda: float(next(clock)))
    for i in range(30):
        store.create_job(f"j-{i:02d}", "p", {})
        if i % 3:  # a third never got an attempt
            store.add_attempt(f"j-{i:02d}", 1, _plan(tmp_path, 1 + i, f"j-{i:02d}"), None)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    page = job_list(store, 10)
    store._db.set_trace_callback(None)
    assert [d["id"] for d in page] == [f"j-{i:02d}" for i in range(29, 19, -1)]  # newest first
    for d in page:
        job = store.get_job(d["id"])
        assert d == job_summary(job, store.get_attempt(job.id, job.attempt) if job.attempt else None, None)
        if job.attempt:
            assert d["world_size"] == 2 * len(d["nodes"]) and d["nodes"][1].startswith("h7-")
        else:
            assert "world_size" not in d and "nodes" not in d
    (jobs_query,) = [q for q in statements if "FROM jobs" in q]
    plan = [tuple(r)[-1] for r in store._db.execute(f"EXPLAIN QUERY PLAN {jobs_query}").fetchall()]
    assert plan == ["SCAN jobs USING INDEX jobs_newest"]  # a page by the list's index, not a sort of every job
    assert not [q for q in statements if "SELECT *" in q and "attempts" in q]  # no attempt's whole plan


def test_attempts_of_an_older_store_are_read_from_their_plans(tmp_path) -> None:
    store = Store(tmp_path / "orch.db")
    for i in range(3):
        store.create_job(f"j-{i}", "p", {})
        store.add_attempt(f"j-{i}", 1, _plan(tmp_path, 3 + i, f"j-{i}"), None)
    new = job_list(store, 3)
    store._db.execute("DELETE FROM attempt_worlds WHERE job_id != 'j-1'")  # as a store from before the table
    assert job_list(store, 3) == new and [len(d["nodes"]) for d in new] == [5, 4, 3]
