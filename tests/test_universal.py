"""Resuming on another number of nodes: a checkpoint converted to DeepSpeed's universal format.

* Real DeepSpeed (``DS_ACCELERATOR=cpu``, gloo): examples/train_gpt.py on 3 local nodes x 1 slot at
  ZeRO-2 and ZeRO-3; one node's agent is killed with SIGKILL, the restart policy leaves the node
  out with no spare, and the job resumes by itself on 2 nodes from ``step_40_universal`` and
  succeeds. With a spare the world size stays and the resume loads the tag itself, no conversion: the
  fault matrix's node-loss faults assert that (tests/test_fault_matrix.py).
* ``convert_to_universal`` edge cases, with a stand-in for DeepSpeed's converter.
* The bad-input rule: ``orch resume`` of a job that had checkpoints but has no complete one is an
  error naming the directory and every skipped tag, unless ``--fresh``; an automatic restart
  starts from step 0 only when the job never finished a save.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, assert_no_leftovers, running_server, wait_for
from orchestrator.checkpoints import (MARKER, UNIVERSAL_MARKER, convert_to_universal, inspect_tag, latest_complete,
                                      needs_universal, scan)
from orchestrator.errors import CheckpointError
from orchestrator.planning import PlanInputs, make_plan, resolve_pool
from orchestrator.spec import spec_from_dict
from orchestrator.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
EVAL_RE = re.compile(r"^\[eval\] global_step=(\d+) rank=(\d+) eval_loss=(\S+)", re.MULTILINE)


def _attempt_plan(orch, job_id: str, number: int) -> dict:
    store = Store(orch.state_dir / "orch.db")
    try:
        return store.get_attempt(job_id, number).plan
    finally:
        store.close()


# --------------------------------------------------------------------------- real DeepSpeed, 3 -> 2 nodes


def _evals(run_dir: Path) -> dict[tuple[int, int], float]:
    """``{(rank, step): eval_loss}`` from every rank's log of one attempt."""
    out = {}
    for log in (run_dir / "logs").glob("rank-*.log"):
        for step, rank, value in EVAL_RE.findall(log.read_text(errors="replace")):
            out[(int(rank), int(step))] = float(value)
    return out


def _mean_loss(losses: dict[tuple[int, int], float], step: int, ranks: int) -> float:
    return sum(losses[(r, step)] for r in range(ranks)) / ranks


@pytest.mark.integration
@pytest.mark.parametrize("stage", [2, 3])
def test_a_lost_node_without_a_spare_resumes_on_fewer_nodes_from_a_universal_checkpoint(
        orch, write_spec, hostfile, stage) -> None:
    helpers_train.prebuild_ops()
    steps, interval, fail_after = 60, 20, 45
    config = json.loads((EXAMPLES / f"ds_zero{stage}.json").read_text())
    # rank 1 (node-1) stops after step 45 on attempt 1, so the others wait in the next all-reduce:
    # the test then takes node-1 away at a known step, after step_40 is complete
    args = TINY + ["--steps", str(steps), "--checkpoint-interval", str(interval), "--eval-interval", str(interval),
                   "--eval-batches", "4", "--eval-after-resume", "--hang-at-step", str(fail_after),
                   "--hang-rank", "1"]
    spec = write_spec(name=f"shrink{stage}", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\nnode-2 slots=1\n")),
                      launcher="pdsh", workdir=str(EXAMPLES), entrypoint="train_gpt.py", args=args,
                      deepspeed_config=config, stop_grace_seconds=5,
                      restart={"max_restarts": 1, "backoff_seconds": 0, "exclude_failed_nodes": True},
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    t0 = time.monotonic()
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        agents = wait_for(lambda: {e.data["node_rank"]: e.data["pid"] for e in orch.events(job_id, "agent_up")}
                          if len(orch.events(job_id, "agent_up")) == 3 else None, 120, "three agents")
        first_dir = Path(wait_for(lambda: orch.json("status", job_id).get("run_dir"), 60, "the run dir"))
        ckpt = Path(orch.json("status", job_id)["checkpoint_dir"])
        wait_for(lambda: "[hang] rank=1 " in (first_dir / "logs" / "rank-1.log").read_text(errors="replace")
                 if (first_dir / "logs" / "rank-1.log").exists() else False, 300, f"rank 1 to stop after step {fail_after}")
        assert inspect_tag(ckpt / "step_40").complete
        os.kill(agents[1], signal.SIGKILL)  # node-1's agent: its link closes, the node is lost
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    took = time.monotonic() - t0
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    text = " ".join(out.split())
    assert "restart 1 of 1 in 0 s without node-1 (restart policy)" in text
    assert "checkpoint step_40 (saved by 3 ranks) converted in" in text and "step_40_universal, for 2 ranks" in text

    detail = orch.json("status", job_id)
    first, second = detail["attempts"]
    assert first["cause"]["kind"] == "node_lost" and first["cause"]["node"] == "node-1"
    assert first["nodes"] == ["node-0", "node-1", "node-2"] and second["nodes"] == ["node-0", "node-2"]
    assert detail["state"] == "SUCCEEDED" and second["state"] == "SUCCEEDED" and second["world_size"] == 2
    assert (second["resume_tag"], second["resume_universal_from"]) == ("step_40_universal", "step_40")
    table = " ".join(orch("status", job_id).stdout.split())
    assert "step_40_universal (converted from step_40)" in table, table

    (conv,) = orch.events(job_id, "checkpoint_converted")
    assert conv.attempt == 2
    assert {k: conv.data[k] for k in ("from_tag", "tag", "step", "zero_stage", "from_world_size",
                                      "from_dp_world_size", "to_world_size", "reused")} == {
        "from_tag": "step_40", "tag": "step_40_universal", "step": 40, "zero_stage": stage, "from_world_size": 3,
        "from_dp_world_size": 3, "to_world_size": 2, "reused": False}
    assert 0 < conv.data["seconds"] < 120
    meta = json.loads((ckpt / "step_40_universal" / UNIVERSAL_MARKER).read_text())
    assert meta["source_tag"] == "step_40" and meta["source"]["world_size"] == 3
    assert not (ckpt / "step_40_universal" / ".source").exists()

    plans = [_attempt_plan(orch, job_id, n) for n in (1, 2)]
    assert plans[0]["deepspeed_config"]["checkpoint"]["load_universal"] is False
    assert plans[1]["deepspeed_config"]["checkpoint"]["load_universal"] is True
    envs = [r["env"] for node in plans[1]["nodes"] for r in node["ranks"]]
    assert all(e["ORCH_RESUME_TAG"] == "step_40_universal" and e["ORCH_RESUME_UNIVERSAL"] == "1" for e in envs)
    assert all("ORCH_RESUME_UNIVERSAL" not in r["env"] for node in plans[0]["nodes"] for r in node["ranks"])

    second_dir = Path(detail["run_dir"])
    before, after = helpers_train.attempt_losses(first_dir), helpers_train.attempt_losses(second_dir)
    assert max(s for (_, s) in before) == fail_after
    assert sorted(after) == [(r, s) for r in range(2) for s in range(41, steps + 1)]
    for rank in range(2):
        log = (second_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"[resume] rank={rank} tag=step_40_universal universal=1 from_tag=step_40 global_step=40 " \
               "from_world_size=3 from_dp=3 world_size=2 dp=2 " in log, log[-2000:]
    # the weights came back exactly: the same held-out windows give the same loss as at the save
    ev_before, ev_after = _evals(first_dir), _evals(second_dir)
    for rank in range(2):
        assert ev_after[(rank, 40)] == pytest.approx(ev_before[(0, 40)], rel=1e-6), (ev_after, ev_before)
    # training goes on from where it was: the mean loss of the first step after the resume is within
    # 0.5 of the mean loss of the last step before the failure. At steps 40-45 the 3-rank mean loss
    # moves by about +-0.15 from step to step (other batches, dropout); 0.5 is three times that and a
    # quarter of the ~2.0 that training had gained since step 1 (a restart from scratch is ~2 off).
    initial, last = _mean_loss(before, 1, 3), _mean_loss(before, fail_after, 3)
    resumed = _mean_loss(after, 41, 2)
    print(f"ZeRO-{stage}: loss step 1 {initial:.3f}; step {fail_after} (3 ranks, before the failure) {last:.3f}; "
          f"step 41 (2 ranks, after the universal resume) {resumed:.3f}; eval at step 40 {ev_before[(0, 40)]!r} "
          f"before, {ev_after[(0, 40)]!r} after; conversion {conv.data['seconds']:.2f} s; test {took:.0f} s")
    assert initial > 5.3 and last < initial - 1.5
    assert abs(resumed - last) < 0.5
    assert_no_leftovers(job_id)


# --------------------------------------------------------------------------- the converter's edge cases

FAKE_CONVERTER = textwrap.dedent("""\
    #!{python}
    # A stand-in for `python -m deepspeed.checkpoint.ds_to_universal --input_folder IN --output_folder OUT`.
    import json, os, shutil, subprocess, sys, time
    args = sys.argv[1:]
    assert args[:2] == ["-m", "deepspeed.checkpoint.ds_to_universal"], args
    src, out = args[args.index("--input_folder") + 1], args[args.index("--output_folder") + 1]
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps(sorted(os.listdir(src))) + "\\n")
    mode = os.environ.get("FAKE_MODE", "ok")
    os.makedirs(os.path.join(out, "zero", "w"), exist_ok=True)
    if mode == "fail":
        print("*** 1. Extracting ZeRO fragments", flush=True)
        print("AssertionError: Required universal_checkpoint_info state is missing", flush=True)
        sys.exit(1)
    if mode == "sleep":
        child = subprocess.Popen(["sleep", "60"])
        open(os.environ["FAKE_CHILD"], "w").write(str(child.pid))
        time.sleep(60)
    if mode == "ok":
        open(os.path.join(out, "zero", "w", "fp32.pt"), "wb").write(b"x")
        for name in os.listdir(src):
            if name.endswith("model_states.pt"):
                shutil.copy(os.path.join(src, name), out)
    print("*** Done!")
""")


@pytest.fixture()
def fake(tmp_path: Path):
    """(python, env, calls): a stand-in converter, its environment, and the input listing of each call."""
    path = tmp_path / "fake-python"
    path.write_text(FAKE_CONVERTER.format(python=sys.executable))
    path.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "FAKE_CALLS": str(calls), "FAKE_CHILD": str(tmp_path / "child.pid")}

    def listing() -> list[list[str]]:
        return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return str(path), env, listing


def _tag(root: Path, tag: str, step: int, *, world: int = 2, stage: int = 2, marker: bool = True,
         extra: tuple[str, ...] = ()) -> Path:
    d = root / tag
    d.mkdir(parents=True)
    files = [f"orch_rank_{r}.pt" for r in range(world)]
    files += ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage >= 3
              else ["mp_rank_00_model_states.pt"])
    if stage >= 1:
        files += [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    for f in files + list(extra):
        (d / f).write_bytes(b"x")
    if marker:
        (d / MARKER).write_text(json.dumps({"tag": tag, "step": step, "world_size": world, "zero_stage": stage,
                                            "dp_world_size": world, "time": 1.0,
                                            "rank_files": [f"orch_rank_{r}.pt" for r in range(world)]}))
    return d


@pytest.mark.integration
def test_conversion_writes_its_marker_last_and_a_finished_one_is_reused(tmp_path, fake) -> None:
    python, env, calls = fake
    d = _tag(tmp_path, "step_10", 10, world=3, stage=3)
    info = inspect_tag(d)
    assert needs_universal(info, 2) and not needs_universal(info, 3)
    u = convert_to_universal(info, python, env=env)
    assert (u.tag, u.path, u.reused, u.source) == ("step_10_universal", str(tmp_path / "step_10_universal"), False, info)
    meta = json.loads((tmp_path / "step_10_universal" / UNIVERSAL_MARKER).read_text())
    assert meta["source_tag"] == "step_10" and meta["step"] == 10 and meta["source"]["world_size"] == 3
    assert meta["seconds"] == pytest.approx(u.seconds, abs=1e-3)
    assert not (tmp_path / "step_10_universal" / ".source").exists()  # the links to the inputs are gone
    again = convert_to_universal(info, python, env=env)
    assert again.reused and again.tag == "step_10_universal" and again.seconds == meta["seconds"]
    assert len(calls()) == 1  # the converter ran once
    # the universal directory is no tag of its own, nor is a hidden one of orch's (preflight's tokens)
    (tmp_path / ".orch-preflight-x.1").mkdir()
    assert [i.tag for i in scan(tmp_path)] == ["step_10"] and latest_complete(tmp_path) == (info, [])


@pytest.mark.integration
def test_only_the_saving_worlds_files_are_converted(tmp_path, fake) -> None:
    python, env, calls = fake
    # a tag re-saved by 2 ranks where an earlier save by 3 left rank 2's optimizer partition behind
    d = _tag(tmp_path, "step_10", 10, world=2, stage=2, extra=("bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",))
    convert_to_universal(inspect_tag(d), python, env=env)
    assert calls() == [["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]]


@pytest.mark.integration
def test_a_conversion_cut_short_or_of_an_earlier_save_is_redone(tmp_path, fake) -> None:
    python, env, calls = fake
    d = _tag(tmp_path, "step_10", 10)
    half = tmp_path / "step_10_universal" / "zero" / "junk"
    half.mkdir(parents=True)  # a converter killed half-way: no marker
    assert latest_complete(tmp_path)[0].tag == "step_10"
    convert_to_universal(inspect_tag(d), python, env=env)
    assert not half.exists() and (tmp_path / "step_10_universal" / UNIVERSAL_MARKER).exists()
    # the tag is saved again (another save, another marker): its old conversion does not count
    marker = json.loads((d / MARKER).read_text())
    (d / MARKER).write_text(json.dumps({**marker, "time": 2.0}))
    u = convert_to_universal(inspect_tag(d), python, env=env)
    assert not u.reused and len(calls()) == 2
    assert json.loads((tmp_path / "step_10_universal" / UNIVERSAL_MARKER).read_text())["source"]["time"] == 2.0


@pytest.mark.integration
def test_a_failed_conversion_says_why_and_leaves_no_marker(tmp_path, fake) -> None:
    python, env, _ = fake
    info = inspect_tag(_tag(tmp_path, "step_10", 10))
    with pytest.raises(CheckpointError) as exc:
        convert_to_universal(info, python, env={**env, "FAKE_MODE": "fail"})
    msg = str(exc.value)
    log = tmp_path / "step_10_universal" / "orch_convert.log"
    assert "failed on" in msg and str(tmp_path / "step_10") in msg and "exit status 1" in msg
    assert "Required universal_checkpoint_info state is missing" in msg and str(log) in msg
    assert not (tmp_path / "step_10_universal" / UNIVERSAL_MARKER).exists()
    with pytest.raises(CheckpointError, match=r"exited 0 but left no .*zero/<parameter>/fp32.pt"):
        convert_to_universal(info, python, env={**env, "FAKE_MODE": "nothing"})
    assert not convert_to_universal(info, python, env=env).reused  # a good run afterwards succeeds
    with pytest.raises(CheckpointError, match="Cannot run DeepSpeed's checkpoint converter with /nonexistent/python"):
        convert_to_universal(inspect_tag(_tag(tmp_path, "step_20", 20)), "/nonexistent/python", env=env)


@pytest.mark.integration
def test_a_converter_past_its_time_is_killed_with_its_children(tmp_path, fake) -> None:
    python, env, _ = fake
    info = inspect_tag(_tag(tmp_path, "step_10", 10))
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="ran longer than 2 s and was stopped"):
        convert_to_universal(info, python, env={**env, "FAKE_MODE": "sleep"}, timeout=2)
    assert time.monotonic() - t0 < 15
    child = int((tmp_path / "child.pid").read_text())
    wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
             10, "the converter's child to be gone")


def test_stage_0_and_incomplete_checkpoints_are_not_converted(tmp_path, fake) -> None:
    python, env, calls = fake
    with pytest.raises(CheckpointError, match=r"ZeRO stage 0 by 2 rank\(s\).*ZeRO stage 1-3"):
        convert_to_universal(inspect_tag(_tag(tmp_path, "step_5", 5, stage=0)), python, env=env)
    with pytest.raises(CheckpointError, match=r"is incomplete \(no orch_checkpoint.json"):
        convert_to_universal(inspect_tag(_tag(tmp_path, "step_6", 6, marker=False)), python, env=env)
    assert calls() == []


def test_the_plan_of_a_universal_resume(tmp_path) -> None:
    (tmp_path / "train.py").write_text("")
    spec = spec_from_dict({"name": "p", "entrypoint": "train.py", "workdir": str(tmp_path)}, tmp_path)
    pool = resolve_pool({"n0": 1, "n1": 1})
    config = {"zero_optimization": {"stage": 2}, "checkpoint": {"tag_validation": "Fail", "load_universal": False}}

    def plan(**kw):
        return make_plan(spec, pool, PlanInputs(job_id="p-1", master_port=29555, run_dir="/r", checkpoint_dir="/ck",
                                                python="/py", deepspeed_config=config, **kw))
    universal = plan(resume_tag="step_40_universal", resume_universal_from="step_40")
    assert universal.deepspeed_config["checkpoint"] == {"tag_validation": "Fail", "load_universal": True}
    assert universal.to_dict()["resume_universal_from"] == "step_40"
    for _, r in universal.ranks():
        assert r.env["ORCH_RESUME_TAG"] == "step_40_universal" and r.env["ORCH_RESUME_UNIVERSAL"] == "1"
    plain = plan(resume_tag="step_40")
    assert plain.deepspeed_config["checkpoint"] == config["checkpoint"] and plain.resume_universal_from is None
    assert all("ORCH_RESUME_UNIVERSAL" not in r.env for _, r in plain.ranks())
    assert config["checkpoint"]["load_universal"] is False  # the job's own config is left alone


def test_exclude_failed_nodes_without_a_spare_is_accepted_unless_unsatisfiable(orch, write_spec, hostfile,
                                                                               tmp_path) -> None:
    (tmp_path / "t.py").write_text("")
    policy = {"max_restarts": 1, "exclude_failed_nodes": True}
    three = str(hostfile("node-0 slots=1\nnode-1 slots=1\nnode-2 slots=1\n"))
    r = orch("plan", str(write_spec(hostfile=three, entrypoint=str(tmp_path / "t.py"), restart=policy)))
    assert r.returncode == 0, r.stderr  # it restarts on the nodes left
    r = orch("plan", str(write_spec(hostfile=three, entrypoint=str(tmp_path / "t.py"), restart=policy,
                                    include="node-0@node-1")))
    assert r.returncode == 2 and "include 'node-0@node-1' names every host" in " ".join(r.stderr.split())
    one = tmp_path / "one"
    one.write_text("node-0 slots=2\n")
    r = orch("plan", str(write_spec(hostfile=str(one), entrypoint=str(tmp_path / "t.py"), restart=policy)))
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "runs on a single host" in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- no complete checkpoint

# One rank that, on its first attempt, leaves checkpoint tags (SAVE) and fails; later attempts succeed.
WORKER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    n = int(os.environ["ORCH_RESTART_COUNT"])
    ckpt = Path(os.environ["ORCH_CHECKPOINT_DIR"])
    print(f"step=1 loss=1.0 restart={n} resume_tag={os.environ.get('ORCH_RESUME_TAG')}", flush=True)
    if n == 0:
        save = os.environ.get("SAVE", "")
        if save != "none":
            ckpt.mkdir(parents=True, exist_ok=True)
        if save in ("incomplete", "damaged"):
            (ckpt / "step_10").mkdir()
            (ckpt / "step_10" / "mp_rank_00_model_states.pt").write_bytes(b"x")  # killed before the marker
        if save == "damaged":  # a save that finished once, then lost a file
            (ckpt / "step_20").mkdir()
            (ckpt / "step_20" / "orch_checkpoint.json").write_text(json.dumps(
                {"tag": "step_20", "step": 20, "world_size": 1, "zero_stage": 0, "rank_files": ["orch_rank_0.pt"]}))
        sys.exit(3)
""")


def _worker_spec(write_spec, hostfile, tmp_path, save: str, **fields) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return write_spec(name="ck", hostfile=str(hostfile("node-0 slots=1\n")), entrypoint=str(script),
                      stop_grace_seconds=2, env={"SAVE": save}, **fields)


@pytest.mark.integration
@pytest.mark.parametrize("save,configured,why", [
    ("damaged", False, ["every checkpoint tag in it is incomplete:",
                        "step_20: missing per-rank file orch_rank_0.pt; missing mp_rank_00_model_states.pt",
                        "step_10: no orch_checkpoint.json: the save did not finish"]),
    ("empty", True, ["it holds no checkpoint tag directory"]),
])
def test_resume_by_hand_without_a_complete_checkpoint_is_refused_unless_fresh(orch, write_spec, hostfile, tmp_path,
                                                                             save, configured, why) -> None:
    fields = {"checkpoint_dir": str(tmp_path / "ckpt")} if configured else {}
    assert orch("run", str(_worker_spec(write_spec, hostfile, tmp_path, save, **fields))).returncode == 1
    (job,) = orch.json("list")
    ckpt = orch.json("status", job["id"])["checkpoint_dir"]
    r = orch("resume", job["id"])
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
    err = " ".join(r.stderr.split())  # the terminal may wrap long lines
    assert f"Job {job['id']} has no complete checkpoint to resume from in {ckpt}:" in err, err
    for needle in why:
        assert needle in err, err
    assert f"To start it again from step 0: orch resume {job['id']} --fresh" in err, err
    assert orch.json("resume", job["id"])["kind"] == "CheckpointError"
    detail = orch.json("status", job["id"])
    assert detail["state"] == "FAILED" and len(detail["attempts"]) == 1  # a refused resume changes nothing

    r = orch("resume", job["id"], "--fresh")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Resuming job {job['id']}: attempt 2 from checkpoint (none: from step 0, as --fresh asks)" in r.stdout
    detail = orch.json("status", job["id"])
    assert detail["state"] == "SUCCEEDED" and detail["attempts"][1]["resume_tag"] is None
    assert "restart=1 resume_tag=None" in orch("logs", job["id"], "--rank", "0").stdout
    pending = [e for e in orch.events(job["id"], "state") if e.data["to"] == "PENDING" and e.attempt == 2]
    assert pending[0].data["fresh"] is True and pending[0].data["resume_tag"] is None
    assert_no_leftovers(job["id"])


@pytest.mark.integration
def test_the_server_refuses_the_same_way_and_takes_fresh(orch, write_spec, hostfile, tmp_path) -> None:
    assert orch("run", str(_worker_spec(write_spec, hostfile, tmp_path, "damaged"))).returncode == 1
    (job,) = orch.json("list")
    with running_server(orch):
        r = orch("resume", job["id"])  # through the HTTP API
        err = " ".join(r.stderr.split())
        assert r.returncode == 2 and "Traceback" not in err, err
        assert "has no complete checkpoint to resume from in" in err and "step_20: missing per-rank file" in err
        r = orch("resume", job["id"], "--fresh")
        assert r.returncode == 0 and "attempt 2 from checkpoint (none: from the start)" in r.stdout, r.stdout + r.stderr
        wait_for(lambda: orch.json("status", job["id"])["state"] == "SUCCEEDED", 60, "attempt 2 to succeed")
    assert orch.json("status", job["id"])["attempts"][1]["resume_tag"] is None
    assert_no_leftovers(job["id"])


@pytest.mark.integration
def test_resume_by_hand_of_a_job_that_never_checkpointed_starts_from_step_0(orch, write_spec, hostfile,
                                                                          tmp_path) -> None:
    assert orch("run", str(_worker_spec(write_spec, hostfile, tmp_path, "none"))).returncode == 1
    (job,) = orch.json("list")
    r = orch("resume", job["id"])  # no checkpoint_dir in the spec, nothing ever saved: nothing to lose
    assert r.returncode == 0, r.stdout + r.stderr
    assert "attempt 2 from checkpoint (none found: from the start)" in r.stdout
    assert [a["resume_tag"] for a in orch.json("status", job["id"])["attempts"]] == [None, None]


@pytest.mark.integration
@pytest.mark.parametrize("save,restarted", [("incomplete", True), ("damaged", False)])
def test_an_automatic_restart_starts_from_step_0_only_if_no_save_ever_finished(orch, write_spec, hostfile,
                                                                              tmp_path, save, restarted) -> None:
    spec = _worker_spec(write_spec, hostfile, tmp_path, save, restart={"max_restarts": 1, "backoff_seconds": 0})
    r = orch("run", str(spec))
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    if restarted:  # killed before its first save finished: a restart from step 0 is what was there
        assert r.returncode == 0, r.stdout + r.stderr
        assert [a["resume_tag"] for a in detail["attempts"]] == [None, None] and detail["state"] == "SUCCEEDED"
        assert orch.events(job["id"], "restart_failed") == []
    else:  # step_20 was complete once: starting over would silently throw its training away
        assert r.returncode == 1 and len(detail["attempts"]) == 1 and detail["state"] == "FAILED"
        (failed,) = orch.events(job["id"], "restart_failed")
        msg = failed.data["message"]
        assert f"no complete checkpoint to resume from in {detail['checkpoint_dir']}" in msg
        assert "The automatic restart is not done, since it would start from step 0." in msg
        assert f"orch resume {job['id']} --fresh" in msg
        assert "automatic restart failed: Job" in " ".join(r.stdout.split())
    assert_no_leftovers(job["id"])
