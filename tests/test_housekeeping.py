"""Housekeeping (docs/housekeeping.md): what orch writes is removed or kept by one rule.

* The retention rule of ``checkpoints.keep_last``/``keep_every`` over checkpoints as found on disk (pure), and
  the spec's section.
* A real DeepSpeed job (tests/scripts/ds_tutorial_train.py: DeepSpeed tags, ``latest``) saving every 10 steps
  with ``keep_last: 2, keep_every: 50``: pruned while it runs, killed, resumed from its newest complete tag
  after the pruning, and left with exactly the newest 2 tags and the multiples of 50.
* ``orch gc`` leaves a RUNNING job's files alone; after its controller and agents were SIGKILLed (what no
  teardown removed: scratch, targets file, cgroups), ``--dry-run`` lists and removes nothing, ``orch gc``
  removes every leftover outside the job's records and records the job's end.
* ``orch gc --older-than`` on real DeepSpeed jobs (examples/train_gpt.py, checkpoints under the state dir):
  a finished job's run directories and checkpoints go, a FAILED job keeps the checkpoint its resume needs
  (until ``--drop-resume-checkpoints``).
"""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SCRIPTS, assert_no_leftovers, job_processes, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_resume
import helpers_train

from agents.attach import attach_path
from agents.cgroups import record_path
from orchestrator.checkpoints.retention import select
from orchestrator.checkpoints.tags import CheckpointInfo
from orchestrator.errors import SpecError
from orchestrator.spec import spec_from_dict

TWO_NODES = "node-0 slots=1\nnode-1 slots=1\n"


# --------------------------------------------------------------------------- the rule (pure)

def _infos(*tags: tuple[int, bool]) -> list[CheckpointInfo]:
    """Checkpoints ``global_step<N>`` newest first; ``(step, complete)``."""
    return [CheckpointInfo(f"global_step{s}", f"/ck/global_step{s}", s, problems=() if ok else ("missing x",),
                           format="deepspeed") for s, ok in sorted(tags, reverse=True)]


def _deleted(pruning) -> list[int]:
    return sorted(i.step for i in pruning.delete)


def test_keep_last_and_keep_every_over_complete_tags() -> None:
    found = _infos(*[(s, True) for s in range(10, 110, 10)])
    assert _deleted(select(found, 2)) == [10, 20, 30, 40, 50, 60, 70, 80]
    pruning = select(found, 2, keep_every=30)
    assert _deleted(pruning) == [10, 20, 40, 50, 70, 80]
    assert pruning.kept == {"global_step90": "one of the 2 newest complete", "global_step30": "its step is a "
                            "multiple of 30", "global_step60": "its step is a multiple of 30"}
    assert _deleted(select(found, 10)) == [] and _deleted(select(found, 50)) == []


def test_nothing_newer_than_the_newest_complete_tag_goes_and_older_incomplete_ones_do() -> None:
    found = _infos((10, True), (20, False), (30, True), (40, True), (50, False), (60, False))
    # 50 and 60: a save in progress, or one a resume skipped (to be saved again): newer than 40, kept
    assert _deleted(select(found, 1)) == [10, 20, 30]
    assert _deleted(select(found, 2)) == [10, 20]  # the cut-short save at 20 is older than the kept 30
    assert _deleted(select(_infos((10, False), (20, False)), 1)) == []  # nothing complete: nothing goes


def test_protected_tags_and_tags_of_unknown_step_stay(tmp_path) -> None:
    found = _infos((10, True), (20, True), (30, True))
    pruning = select(found, 1, protect={"global_step10": "DeepSpeed's latest names it"})
    assert _deleted(pruning) == [20] and pruning.kept["global_step10"] == "DeepSpeed's latest names it"
    odd = [CheckpointInfo("pretrained", "/ck/pretrained", -1, problems=("no marker",)), *found]
    assert "pretrained" not in [i.tag for i in select(odd, 1).delete]
    (tmp_path / "step_10").mkdir()
    (tmp_path / "step_10_universal").mkdir()  # orch's conversion of a tag goes with it
    tags = [CheckpointInfo(f"step_{s}", str(tmp_path / f"step_{s}"), s) for s in (30, 20, 10)]
    assert select(tags, 1).also == (str(tmp_path / "step_10_universal"),)
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        select(tags, 0)


def test_the_specs_checkpoints_section() -> None:
    base = {"name": "x", "entrypoint": "/bin/true", "no_python": True}
    spec = spec_from_dict({**base, "checkpoints": {"keep_last": 2, "keep_every": 100}})
    assert (spec.checkpoints.keep_last, spec.checkpoints.keep_every, spec.checkpoints.prunes) == (2, 100, True)
    assert not spec_from_dict(base).checkpoints.prunes  # default: every checkpoint is kept
    for bad, words in [({"keep_every": 3}, "checkpoints: keep_every only spares checkpoints keep_last would delete"),
                       ({"keep_last": 0}, "checkpoints.keep_last: Input should be greater than or equal to 1"),
                       ({"keep_last": True}, "checkpoints.keep_last: Input should be a valid integer"),
                       ({"keep_lst": 2}, "checkpoints.keep_lst: unknown field; did you mean keep_last?")]:
        with pytest.raises(SpecError) as err:
            spec_from_dict({**base, "checkpoints": bad})
        assert words in str(err.value) and "Traceback" not in str(err.value)


def test_gc_leaves_an_ended_job_whose_controller_still_owns_it(tmp_path) -> None:
    """A job reaches SUCCEEDED/CANCELLED/FAILED before its ranks are all gone (the grace period); its controller
    lets go of it (owner None) only then, or keeps it for a pending restart: until then nothing of it goes."""
    import socket

    import psutil
    from orchestrator.store import JobState, Store
    from orchestrator.supervision.housekeeping import collect
    run_dir = tmp_path / "jobs" / "j-abc123" / "attempt-1"
    (run_dir / "scratch" / "node-0").mkdir(parents=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "create_time": psutil.Process().create_time()}
    store = Store(tmp_path / "orch.db")
    store.create_job("j-abc123", "j", {})
    for number, end in enumerate((JobState.CANCELLED, JobState.FAILED), 1):
        store.set_owner("j-abc123", me)
        store.add_attempt("j-abc123", number, {"run_dir": str(run_dir), "nodes": []}, None)
        for state in (JobState.PROVISIONING, JobState.RUNNING, end):
            store.set_state("j-abc123", state)
        entries, kept = collect(store, tmp_path, older_than_s=0, dry_run=False)
        assert not [e for e in entries if e.job] and kept[0].job == "j-abc123", entries
        assert f"{end.value}, and its controller is still at it" in kept[0].why
        store.set_owner("j-abc123", None)
        entries, _ = collect(store, tmp_path, older_than_s=0, dry_run=False)
        assert [(e.what, e.path) for e in entries if e.job] == [("run_dir", str(run_dir))]
        if end == JobState.CANCELLED:
            store.set_state("j-abc123", JobState.PENDING)  # a resume: its next attempt
    store.close()


# --------------------------------------------------------------------------- retention in a real DeepSpeed job

def _complete_tags(ckpt: Path) -> set[int]:
    from orchestrator.checkpoints.formats import DeepSpeedFormat
    return {i.step for i in DeepSpeedFormat().scan(ckpt) if i.complete}


def _all_tags(ckpt: Path) -> set[int]:
    return {int(p.name.removeprefix("global_step")) for p in ckpt.glob("global_step*")}


@pytest.mark.integration
def test_keep_last_and_keep_every_prune_a_deepspeed_job_which_still_resumes(orch, write_spec, hostfile,
                                                                           tmp_path) -> None:
    helpers_train.prebuild_ops()
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "200", "--save_dir", str(ckpt), "--load_dir", str(ckpt), "--save_interval", "10"]
    spec = write_spec(name="keep", hostfile=str(hostfile(TWO_NODES)), launcher="pdsh", workdir=str(SCRIPTS),
                      entrypoint="ds_tutorial_train.py", args=args, deepspeed_args=True,
                      deepspeed_config=str(SCRIPTS / "ds_tutorial_zero2.json"), checkpoint_dir=str(ckpt),
                      stop_grace_seconds=5, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
                      checkpoints={"keep_last": 2, "keep_every": 50}, resume={"watch_seconds": 0.5})
    job = helpers_resume.run_and_kill(orch, spec, rank=1, at_step=120)
    newest = int(orch.json("status", job)["checkpoints"]["next_resume"].removeprefix("global_step"))
    assert newest >= 110
    assert _complete_tags(ckpt) == {newest - 10, newest, 50, 100}, sorted(_all_tags(ckpt))
    assert _all_tags(ckpt) - _complete_tags(ckpt) <= {newest + 10}  # at most the save cut short by the kill
    pruned = orch.events(job, "checkpoints_pruned")
    ended = orch.json("status", job)["attempts"][0]["ended_at"]
    assert any(e.at < ended for e in pruned), "nothing was pruned while the job ran"
    gone = {int(t.removeprefix("global_step")) for e in pruned for t in e.data["tags"]}
    assert gone == set(range(10, newest - 10, 10)) - {50, 100}
    assert all(e.data["bytes"] > 0 and e.data["failed"] == {} for e in pruned)
    print(f"\n[retention] attempt 1: {len(gone)} tags pruned, {sum(e.data['bytes'] for e in pruned)} bytes freed")

    r = orch("resume", job, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    later = {t for e in orch.events(job, "checkpoints_pruned") if e.attempt == 2 for t in e.data["tags"]}
    assert later == {f"global_step{s}" for s in range(newest - 10, 190, 10)} - {"global_step100", "global_step150"}
    detail = orch.json("status", job)
    assert detail["state"] == "SUCCEEDED" and detail["attempts"][1]["resume_tag"] == f"global_step{newest}"
    log = (Path(detail["run_dir"]) / "logs" / "rank-0.log").read_text()
    resumed = rf"^resumed rank=0 from={ckpt}/global_step{newest}\S* global_step={newest}$"
    assert re.search(resumed, log, re.MULTILINE), log[:2000]
    assert sorted(int(s) for s in re.findall(r"^step=(\d+) rank=0 ", log, re.MULTILINE)) == list(range(newest + 1, 201))
    assert _all_tags(ckpt) == _complete_tags(ckpt) == {50, 100, 150, 190, 200}
    assert (ckpt / "latest").read_text().strip() == "global_step200"
    recorded = orch.json("status", job)["checkpoints"]["checkpoints"]
    assert {c["tag"]: c["recorded_files"] for c in recorded} == {f"global_step{s}": 3 for s in (200, 190, 150, 100, 50)}
    freed = sum(e.data["bytes"] for e in orch.events(job, "checkpoints_pruned"))
    assert detail["checkpoints"]["pruned"] == {"tags": len(gone) + len(later), "keep_last": 2, "keep_every": 50,
                                               "bytes": freed}
    assert "older checkpoint(s) deleted by the spec's checkpoints policy (keep_last 2, keep_every 50)" in \
        orch("status", job).stdout
    assert_no_leftovers(job, timeout=5)
    # nothing of the finished job is left outside its records (the state dir) and its checkpoints
    for attempt in (1, 2):
        assert not (orch.state_dir / "jobs" / job / f"attempt-{attempt}" / "scratch").exists()
        assert not glob.glob(f"/tmp/orch-metrics/{job}.{attempt}*")
        assert not [p for n in (0, 1) for p in (attach_path(f"{job}.{attempt}", n), record_path(f"{job}.{attempt}", n))
                    if os.path.exists(p)]
    assert not list(ckpt.glob(".orch-preflight-*")) and not list((orch.state_dir / "prometheus").rglob(f"{job}.*"))
    assert _ours(orch.json("gc"), job) == []


# --------------------------------------------------------------------------- orch gc: leftovers of killed attempts

def _worker_spec(write_spec, hostfile) -> Path:
    return write_spec(name="gc", hostfile=str(hostfile(TWO_NODES)), entrypoint=str(SCRIPTS / "worker.py"),
                      stop_grace_seconds=2, env={"WORKER_STEPS": "100000", "WORKER_STEP_S": "0.05",
                                                 "WORKER_REPORT": "1"})


def _stored_state(orch, job: str) -> str:
    from orchestrator.store import Store
    store = Store(orch.state_dir / "orch.db")
    try:
        return store.get_job(job).state.value
    finally:
        store.close()


def _ours(result: dict, job: str) -> list[dict]:
    return [e for e in result["removed"] if e["job"] == job]


@pytest.mark.integration
def test_gc_leaves_a_running_job_alone_then_removes_what_its_killed_agents_left(orch, write_spec, hostfile) -> None:
    proc = orch.popen("run", str(_worker_spec(write_spec, hostfile)))
    try:
        job = helpers_resume.wait_listed(orch)
        attempt_id = f"{job}.1"
        detail = wait_for(lambda: (lambda d: d if d["state"] == "RUNNING" and all(
            (r["step"] or 0) >= 2 for r in d["ranks"]) else None)(orch.json("status", job)), 60, "both ranks stepping")
        run_dir = Path(detail["run_dir"])
        scratch = run_dir / "scratch"
        reports = [scratch / f"node-{n}" / "reports" / f"rank-{n}.jsonl" for n in (0, 1)]
        assert all(p.stat().st_size > 0 for p in reports) and list((scratch / "node-0" / "prom").glob("*.db"))
        targets = orch.state_dir / "prometheus" / "targets" / f"{attempt_id}.json"
        assert targets.exists()
        records = [Path(record_path(attempt_id, n)) for n in (0, 1) if os.path.exists(record_path(attempt_id, n))]
        cgroups = [Path(p.read_text().strip()) for p in records]
        before = sorted(str(p) for p in run_dir.rglob("*"))

        for args in (["gc"], ["gc", "--older-than", "0"]):  # a RUNNING job is not touched
            result = orch.json(*args)
            assert _ours(result, job) == [] and {"job": job, "why": "not over: RUNNING", "path": None} in result["kept"]
        assert orch.json("status", job)["state"] == "RUNNING" and targets.exists()
        assert set(before) <= {str(p) for p in run_dir.rglob("*")}  # everything still there (reports grew)
        step = max(r["step"] for r in orch.json("status", job)["ranks"])
        wait_for(lambda: min(r["step"] for r in orch.json("status", job)["ranks"]) > step, 30, "the ranks stepping on")

        # the controller frozen, its agents SIGKILLed, then the controller: no teardown, no sweep ran
        agents = [p for p in job_processes(job) if p.environ().get("ORCH_AGENT_ATTEMPT_ID")]
        assert len(agents) == 2
        os.kill(proc.pid, signal.SIGSTOP)
        for p in agents:
            p.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        helpers_resume.stop(proc)
    assert_no_leftovers(job, timeout=10)  # the ranks died with their agents (PR_SET_PDEATHSIG)
    left = [scratch, targets, *records]
    assert all(p.exists() for p in left), [str(p) for p in left if not p.exists()]

    dry = orch.json("gc", "--dry-run")
    listed = {(e["what"], e["path"]) for e in _ours(dry, job)}
    assert {("scratch", str(scratch)), ("targets", str(targets))} | {("cgroup", str(p)) for p in records} <= listed
    assert dry["dry_run"] and dry["bytes"] >= sum(p.stat().st_size for p in reports)
    assert all(p.exists() for p in left) and _stored_state(orch, job) == "RUNNING"  # nothing changed (orch status
    # would record the end itself, as every command reading the state dir does: recover_orphans)
    text = orch("gc", "--dry-run").stdout
    assert "would remove scratch" in text and str(scratch) in text and "nothing was removed (--dry-run)" in text

    result = orch.json("gc")
    assert not result["dry_run"] and result["recovered"] == [job] and result["failed"] == {}
    assert not any(p.exists() for p in [*left, *cgroups]), [str(p) for p in [*left, *cgroups] if p.exists()]
    assert not glob.glob(f"/tmp/orch-metrics/{job}.*") and not os.path.exists(attach_path(attempt_id, 0))
    detail = orch.json("status", job)
    assert detail["state"] == "FAILED" and detail["cause"]["kind"] == "controller_lost"
    assert (run_dir / "logs" / "rank-0.log").stat().st_size > 0 and (run_dir / "plan.json").exists()  # records stay
    assert [e.kind for e in orch.events(job, "gc")] == ["gc"]
    again = orch("gc")
    assert again.returncode == 0 and job not in again.stdout


# --------------------------------------------------------------------------- orch gc --older-than

def _gpt_spec(write_spec, hostfile, name: str, *extra: str) -> Path:
    return write_spec(name=name, hostfile=str(hostfile(TWO_NODES)), launcher="pdsh", workdir=str(ROOT / "examples"),
                      entrypoint="train_gpt.py", deepspeed_config=str(ROOT / "examples" / "ds_zero2.json"),
                      args=[*helpers_train.TINY_ARGS, "--checkpoint-interval", "5", *extra], stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


@pytest.mark.integration
def test_gc_older_than_removes_finished_jobs_files_but_not_what_a_resume_needs(orch, write_spec, hostfile) -> None:
    helpers_train.prebuild_ops()
    r = orch("run", str(_gpt_spec(write_spec, hostfile, "failing", "--steps", "20", "--fail-at-step", "13",
                                  "--fail-rank", "1")), timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    r = orch("run", str(_gpt_spec(write_spec, hostfile, "done", "--steps", "10")), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    jobs = {j["name"]: j["id"] for j in orch.json("list")}
    failed_dir, done_dir = (orch.state_dir / "jobs" / jobs[n] for n in ("failing", "done"))
    assert {p.name for p in (failed_dir / "checkpoints").iterdir()} >= {"step_5", "step_10", "latest"}
    assert not any(e["job"] in jobs.values() for e in orch.json("gc", "--older-than", "1d", "--dry-run")["removed"])

    dry = orch.json("gc", "--older-than", "0", "--dry-run")
    listed = {(e["what"], e["path"]) for e in dry["removed"] if e["job"] in jobs.values()}
    assert listed == {("run_dir", str(failed_dir / "attempt-1")), ("run_dir", str(done_dir / "attempt-1")),
                      ("checkpoint", str(failed_dir / "checkpoints" / "step_5")),
                      ("checkpoints", str(done_dir / "checkpoints"))}
    why = "checkpoint step_10: a resume would start from it (--drop-resume-checkpoints removes it)"
    assert {"job": jobs["failing"], "path": str(failed_dir / "checkpoints" / "step_10"), "why": why} in dry["kept"]
    assert (failed_dir / "attempt-1").is_dir() and (done_dir / "checkpoints" / "step_10").is_dir()  # dry: nothing gone

    result = orch.json("gc", "--older-than", "0")
    print(f"\n[gc] --older-than 0 freed {result['bytes']} bytes (dry run said {dry['bytes']})")
    assert result["bytes"] == dry["bytes"] > 1_000_000 and result["failed"] == {}
    assert not done_dir.exists()
    assert {p.name for p in failed_dir.iterdir()} == {"checkpoints"}
    assert {p.name for p in (failed_dir / "checkpoints").iterdir() if p.is_dir()} == {"step_10"}
    preview = orch.json("resume", jobs["failing"], "--dry-run")
    assert preview["resume_tag"] == "step_10", preview
    assert {j["id"] for j in orch.json("list")} == set(jobs.values())  # the jobs stay listed

    result = orch.json("gc", "--older-than", "0", "--drop-resume-checkpoints")
    assert [e["what"] for e in _ours(result, jobs["failing"])] == ["checkpoints"] and not failed_dir.exists()
    r = orch("gc", "--drop-resume-checkpoints")
    assert r.returncode == 2 and "--drop-resume-checkpoints applies to the jobs --older-than selects" in r.stderr
    r = orch("gc", "--older-than", "soon")
    assert r.returncode == 2 and "takes a number and a unit" in r.stderr
