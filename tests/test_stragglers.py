"""Straggler detection (issue 20 item 2): the detector on synthetic series (orchestrator/supervision/stragglers.py),
the flag as the API, the metric and a restart read it, and real 2-node jobs of examples/train_gpt.py: one with
rank 1 slowed on purpose (``--slow-rank 1 --slow-ms 200``) is named within the window; even jobs never are."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from conftest import ROOT
from orchestrator.observe.metrics import ControllerMetrics
from orchestrator.observe.stragglers import flagged_ranks
from orchestrator.spec.straggler import StragglerOptions
from orchestrator.store import JobState, Store
from orchestrator.supervision.restarts import straggler_hosts
from orchestrator.supervision.stragglers import StragglerWatch, signal_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
HOSTS = {r: (f"node-{r // 2}", r // 2) for r in range(8)}  # 8 ranks, 2 a node


def _run(watch: StragglerWatch, steps: int, base: float, slow: dict[int, float], jitter: float,
         seed: int = 0, key: str = "compute_seconds") -> list[tuple[str, dict]]:
    """Feed ``steps`` steps of every rank (``base`` seconds each, ``slow[rank]`` more, +-``jitter`` relative
    noise), one report of all ranks per step; the events, in order."""
    rng = random.Random(seed)
    out = []
    for step in range(1, steps + 1):
        rows = [(r, {"step": step, key: (base + slow.get(r, 0.0)) * (1 + rng.uniform(-jitter, jitter))})
                for r in range(len(watch.hosts))]
        out += watch.record(rows)
    return out



def test_the_others_median_is_each_other_ranks_median_and_many_ranks_reuse_it_for_a_while() -> None:
    import statistics
    watch = StragglerWatch(StragglerOptions(window_steps=5), HOSTS)
    rng = random.Random(3)
    for step in range(1, 40):
        for r in range(8):
            watch.record([(r, {"step": step, "compute_seconds": rng.uniform(0.01, 0.03)})])
            others = [statistics.median(s.recent) for q, s in watch.ranks.items() if q != r and s.recent]
            assert watch._others_median(r) == (statistics.median(others) if others else None)
    # above SMALL ranks the sorted medians are rebuilt at most every REBUILD_EVERY_S (one sort, not R per step)
    now = [0.0]
    many = StragglerWatch(StragglerOptions(window_steps=5), {r: ("n", 0) for r in range(100)}, clock=lambda: now[0])
    many.record([(r, {"step": 1, "compute_seconds": 0.01}) for r in range(100)])
    before = many._others_median(0)
    many.record([(r, {"step": 2, "compute_seconds": 1.0}) for r in range(1, 100)])
    assert many._others_median(0) == before  # within the half second: the list built at step 1
    now[0] += StragglerWatch.REBUILD_EVERY_S
    assert many._others_median(0) > before  # rebuilt: every other rank's median moved up

def test_a_slow_rank_is_flagged_after_the_window_and_named() -> None:
    watch = StragglerWatch(StragglerOptions(), HOSTS)  # defaults: 20% over the median, 20 steps
    events = _run(watch, 60, 0.1, {5: 0.05}, 0.05)
    assert [k for k, _ in events] == ["straggler"]
    data = events[0][1]
    assert (data["global_rank"], data["node"], data["node_rank"]) == (5, "node-2", 2)
    assert data["step"] == 20  # over from step 1: flagged at the window's end, not before
    assert 1.3 < data["ratio"] < 1.7 and data["signal"] == "compute_seconds"
    assert "rank 5 on node-2" in data["message"]
    assert list(watch.flagged()) == [5]


def test_the_flag_is_lifted_after_a_window_within_and_a_second_episode_is_a_second_event() -> None:
    watch = StragglerWatch(StragglerOptions(window_steps=10), HOSTS)
    events = _run(watch, 15, 0.1, {2: 0.1}, 0.0)
    events += [e for step in range(16, 40) for e in watch.record([(r, {"step": step, "compute_seconds": 0.1})
                                                                 for r in range(8)])]
    assert [(k, d["global_rank"], d["step"]) for k, d in events] == [("straggler", 2, 10), ("straggler_cleared", 2, 25)]
    assert watch.flagged() == {}
    more = [e for step in range(40, 60) for e in watch.record([(r, {"step": step, "compute_seconds": 0.3 if r == 2
                                                                    else 0.1}) for r in range(8)])]
    assert [(k, d["global_rank"]) for k, d in more] == [("straggler", 2)]


def test_an_even_series_with_jitter_is_never_flagged() -> None:
    for seed in range(20):
        watch = StragglerWatch(StragglerOptions(), HOSTS)
        assert _run(watch, 300, 0.1, {}, 0.15, seed=seed) == [], seed


def test_a_run_of_over_steps_shorter_than_the_window_is_no_straggler() -> None:
    watch = StragglerWatch(StragglerOptions(window_steps=10), HOSTS)
    events = _run(watch, 9, 0.1, {3: 0.1}, 0.0) + _run(watch, 0, 0.1, {}, 0.0)
    events += [e for step in range(10, 30) for e in watch.record([(r, {"step": step, "compute_seconds": 0.1})
                                                                 for r in range(8)])]
    assert events == []


def test_millisecond_jitter_under_the_least_excess_is_no_straggler() -> None:
    watch = StragglerWatch(StragglerOptions(), HOSTS)  # min_excess_seconds 0.01
    assert _run(watch, 100, 0.002, {1: 0.002}, 0.0) == []  # twice as slow, but by 2 ms


def test_step_seconds_is_the_signal_without_compute_seconds_and_disabled_flags_nothing() -> None:
    assert signal_of({"step": 1, "compute_seconds": 0.2, "step_seconds": 1.0}) == ("compute_seconds", 0.2)
    assert signal_of({"step": 1, "step_seconds": 1.0}) == ("step_seconds", 1.0)
    assert signal_of({"step": 1, "step_seconds": "nan"}) is None and signal_of({"step": 1}) is None
    watch = StragglerWatch(StragglerOptions(window_steps=5), HOSTS)
    events = _run(watch, 10, 0.5, {7: 0.5}, 0.0, key="step_seconds")
    assert [(k, d["global_rank"], d["signal"]) for k, d in events] == [("straggler", 7, "step_seconds")]
    off = StragglerWatch(StragglerOptions(enabled=False), HOSTS)
    assert _run(off, 50, 0.1, {7: 0.5}, 0.0) == []


def test_thinned_points_count_in_steps_and_repeated_points_are_ignored() -> None:
    watch = StragglerWatch(StragglerOptions(window_steps=10), HOSTS)
    events = []
    for step in range(1, 30, 3):  # the agent sent every third step only
        rows = [(r, {"step": step, "compute_seconds": 0.3 if r == 0 else 0.1}) for r in reversed(range(8))]
        events += watch.record(rows + rows)  # and each twice (rank 0 last: the others' median is there at step 1)
    assert [(k, d["global_rank"], d["step"]) for k, d in events] == [("straggler", 0, 10)]


def _store_with_flag(tmp_path: Path) -> Store:
    """A RUNNING job "s-1" on node-0 and node-1 whose rank 1 was flagged (events from a real watch)."""
    store = Store(tmp_path / "orch.db")
    plan = {"nodes": [{"node_rank": n, "host": f"node-{n}", "log_dir": str(tmp_path),
                       "ranks": [{"global_rank": n, "local_rank": 0, "slot": 0}]} for n in range(2)],
            "world_size": 2, "run_dir": str(tmp_path)}
    store.create_job("s-1", "s", {})
    store.set_state("s-1", JobState.PROVISIONING)
    store.add_attempt("s-1", 1, plan, None)
    store.set_state("s-1", JobState.RUNNING)
    watch = StragglerWatch(StragglerOptions(window_steps=3), {0: ("node-0", 0), 1: ("node-1", 1)})
    for step in range(1, 6):
        for kind, data in watch.record([(0, {"step": step, "compute_seconds": 0.1}),
                                        (1, {"step": step, "compute_seconds": 0.4})]):
            store.add_event("s-1", 1, kind, data)
    return store


def test_the_flag_reaches_the_metric_the_api_and_an_exclude_on_restart(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from orchestrator.face.api import create_app

    store = _store_with_flag(tmp_path)
    assert list(flagged_ranks(store.events("s-1"), 1)) == [1]
    text = generate_latest(ControllerMetrics(store).registry).decode()
    assert 'orch_straggler{job="s-1",node="node-1",rank="1"} 1.0' in text
    assert 'rank="0"' not in [ln for ln in text.splitlines() if ln.startswith("orch_straggler{")][0]

    controller = SimpleNamespace(store=store, state_dir=tmp_path, metrics=ControllerMetrics(store),
                                 owner={"pid": 1}, unrecorded=lambda job_id: None)
    client = TestClient(create_app(controller, "tok", ["testserver"]), headers={"Authorization": "Bearer tok"})
    ranks = {r["global_rank"]: r for r in client.get("/api/jobs/s-1").json()["ranks"]}
    assert ranks[0]["straggler"] is None and ranks[1]["straggler"]["node"] == "node-1"

    warn = SimpleNamespace(straggler=StragglerOptions())
    exclude = SimpleNamespace(straggler=StragglerOptions(on_straggler="exclude_on_restart"))
    assert straggler_hosts(store, "s-1", 1, warn, []) == []
    assert straggler_hosts(store, "s-1", 1, exclude, []) == ["node-1"]
    assert straggler_hosts(store, "s-1", 1, exclude, ["node-1"]) == []  # (already left out as a lost node)
    store.add_event("s-1", 1, "straggler_cleared", {"global_rank": 1})
    assert straggler_hosts(store, "s-1", 1, exclude, []) == []
    text = generate_latest(ControllerMetrics(store).registry).decode()
    assert "orch_straggler{" not in text


# -- real 2-node jobs of examples/train_gpt.py ---------------------------------------------------------------------

def _spec(write_spec, hostfile, name: str, steps: int, extra: list[str], straggler: dict | None = None,
          hosts: str = "node-0 slots=1\nnode-1 slots=1\n", **more) -> Path:
    config = json.loads((EXAMPLES / "ds_zero1.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    return write_spec(name=name, hostfile=str(hostfile(hosts)), launcher="pdsh",
                      workdir=str(EXAMPLES), entrypoint="train_gpt.py", deepspeed_config=config,
                      args=TINY + ["--steps", str(steps)] + extra, stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                      **({"straggler": straggler} if straggler else {}), **more)


@pytest.mark.integration
@pytest.mark.deepspeed
@pytest.mark.timing
def test_a_rank_slowed_on_purpose_is_named_within_the_window(orch, write_spec, hostfile, state_dir) -> None:
    helpers_train.prebuild_ops()
    window = 10
    spec = _spec(write_spec, hostfile, "slow", 25, ["--slow-rank", "1", "--slow-ms", "200"],
                 {"window_steps": window})
    r = orch("run", str(spec), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    events = orch.events(job["id"], "straggler")
    assert [(e.data["global_rank"], e.data["node"], e.data["node_rank"]) for e in events] == [(1, "node-1", 1)]
    data = events[0].data
    first = min(p["step"] for p in Store(state_dir / "orch.db").progress(job["id"], 1) if p["rank"] == 1)
    # never before a full window of its steps was over; at the window's end on a quiet machine, later
    # when the other rank's first steps (warm-up, a loaded machine) were slow enough to keep rank 1 under
    # the threshold for a step or two (its run of over steps then starts again): within a second window
    # (a fresh-clone run on a loaded machine flagged it at step 13 with first step 1)
    assert first + window - 1 <= data["step"] <= first + 2 * window - 1, (first, data)
    assert data["signal"] == "compute_seconds" and data["seconds"] - data["median_seconds"] > 0.15, data
    print("straggler event:", json.dumps(data))


@pytest.mark.integration
@pytest.mark.deepspeed
@pytest.mark.timing
def test_even_jobs_raise_no_straggler(orch, write_spec, hostfile) -> None:
    helpers_train.prebuild_ops()
    # 3 jobs x 160 steps: 453 windows of 10 steps per rank in which an even rank could be flagged (6 jobs x 80
    # steps gave 426, 20 x 25 gave 320, each spending most of its time starting)
    runs, events = 3, []
    for i in range(runs):
        spec = _spec(write_spec, hostfile, f"even{i}", 160, [], {"window_steps": 10}, fast_start="on")
        r = orch("run", str(spec), timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = orch.json("list")
    assert len(jobs) == runs and all(j["state"] == "SUCCEEDED" for j in jobs)
    for job in jobs:
        events += [(job["id"], e.data) for e in orch.events(job["id"], "straggler")]
    assert events == [], events


STRAGGLER_ROWS_JS = """return [...document.querySelectorAll('#ranks-table tr.rank-row')].map(tr => ({
  rank: +tr.dataset.rank, straggler: tr.classList.contains('straggler'), title: tr.getAttribute('title'),
  badge: (tr.querySelector('.straggler-badge') || {}).textContent || null,
  background: getComputedStyle(tr.querySelector('td')).backgroundColor}));"""


@pytest.mark.integration
@pytest.mark.deepspeed
@pytest.mark.timing
def test_the_dashboard_highlights_the_straggler_row(browser, write_spec, hostfile, tmp_path) -> None:
    from conftest import Orch, running_server, wait_for

    helpers_train.prebuild_ops()
    (tmp_path / "state").mkdir()
    orch = Orch(tmp_path / "state")
    spec = _spec(write_spec, hostfile, "web-slow", 30, ["--slow-rank", "1", "--slow-ms", "200"], {"window_steps": 10})
    with running_server(orch) as (proc, url):
        browser.get(proc.login_url)
        job_id = orch.json("submit", str(spec), check=True)["id"]
        browser.get(f"{url}/#/jobs/{job_id}")
        rows = wait_for(lambda: (v := browser.execute_script(STRAGGLER_ROWS_JS)) and any(r["straggler"] for r in v)
                        and v, 300, "a rank row marked straggler", interval=0.5)
        by_rank = {r["rank"]: r for r in rows}
        assert [r for r, row in by_rank.items() if row["straggler"]] == [1], rows
        assert by_rank[1]["badge"].startswith(" straggler ×") and "rank 1 on node-1" in by_rank[1]["title"], rows
        assert by_rank[1]["background"] != by_rank[0]["background"], rows  # the row is highlighted
        assert by_rank[0]["badge"] is None and by_rank[0]["title"] is None
        wait_for(lambda: orch.json("status", job_id)["state"] == "SUCCEEDED", 300, "the job to succeed")


@pytest.mark.integration
@pytest.mark.deepspeed
@pytest.mark.timing
def test_exclude_on_restart_leaves_the_stragglers_node_out_of_the_restart(orch, write_spec, hostfile) -> None:
    helpers_train.prebuild_ops()
    spec = _spec(write_spec, hostfile, "slow-restart", 30, ["--slow-rank", "1", "--slow-ms", "200",
                                                            "--fail-at-step", "20", "--fail-rank", "0"],
                 {"window_steps": 10, "on_straggler": "exclude_on_restart"},
                 hosts="node-0 slots=1\nnode-1 slots=1\nnode-2 slots=1\n",  # node-2: a spare for the restart
                 restart={"max_restarts": 1, "backoff_seconds": 0}, num_nodes=2)
    r = orch("run", str(spec), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    first, second = detail["attempts"]
    assert first["cause"]["kind"] == "rank_exit" and first["nodes"] == ["node-0", "node-1"], first
    (scheduled,) = orch.events(job["id"], "restart_scheduled")
    assert scheduled.data["exclude_hosts"] == ["node-1"], scheduled.data
    assert second["nodes"] == ["node-0", "node-2"] and detail["state"] == "SUCCEEDED", second
