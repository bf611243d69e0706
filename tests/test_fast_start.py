"""``fast_start``: ranks forked from a node's template (agents/forkserver.py) are what exec'd ranks are to
their script, draw fresh random numbers, die of their signals as exec'd ranks do, train ZeRO-2 to the end;
``auto`` falls back to exec saying why, ``on`` refuses where ``auto`` would fall back.

The probe (tests/scripts/forkprobe.py) writes what a script can see of how it was started; the same job
runs once forked (``on``) and once exec'd (``off``) on the local provisioner, and the reports are compared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SCRIPTS, assert_no_leftovers, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

PROBE = str(SCRIPTS / "forkprobe.py")
EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
#: what two runs of one job differ in whatever starts the ranks (the job id is replaced by JOB in values)
PER_RUN = {"MASTER_PORT", "FORKPROBE_OUT"}


def _probe_run(orch, write_spec, hostfile, out: Path, mode: str, module: bool = False,
               **env: str) -> tuple[dict[int, dict], str]:
    """Run the probe on 2 nodes (2 ranks on the first: two forks from one template), as a script or with
    ``python -m``; its reports by rank."""
    spec = write_spec(name="probe", hostfile=str(hostfile("node-0 slots=2\nnode-1 slots=1\n")),
                      workdir=str(ROOT), module=module,
                      entrypoint="tests.scripts.forkprobe" if module else "tests/scripts/forkprobe.py", args=["--flag", "a b"], fast_start=mode, stop_grace_seconds=2,
                      env={"FORKPROBE_OUT": str(out), "DS_ACCELERATOR": "cpu", **env})
    r = orch("run", str(spec), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    job_id = orch.json("list")[0]["id"]
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(reports) == [0, 1, 2]
    return reports, job_id


def _diff(a: object, b: object) -> object:
    """The entries of two dicts that differ (``(a's, b's)``), or the two values themselves."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    return a, b


def _fallbacks(orch, job_id: str) -> list[str]:
    """Why each node's ranks were exec'd, not forked (the ranks_started events' fast_start), node by node; a
    fast_start warning would be a defect (auto's choice is no fault of the job's) and is returned too."""
    started = sorted(orch.events(job_id, "ranks_started"), key=lambda e: e.data["node_rank"])
    warned = [e.data["message"] for e in orch.events(job_id, "warning") if "fast_start" in e.data.get("message", "")]
    return [(e.data.get("fast_start") or {}).get("why") for e in started
            if (e.data.get("fast_start") or {}).get("why")] + warned


def _seen(report: dict, job_id: str) -> dict:
    """What must be equal between a forked and an exec'd rank: everything but the draws and whether torch
    was imported before the script ran (the job id and per-run variables made neutral)."""
    env = {k: v.replace(job_id, "JOB") for k, v in report["env"].items() if k not in PER_RUN}
    proc_env = dict(w.split("=", 1) for w in report["proc_environ"])
    proc_env = {k: v.replace(job_id, "JOB") for k, v in proc_env.items() if k not in PER_RUN}
    keep = {k: v for k, v in report.items() if k not in ("draws", "preloaded", "env", "proc_environ", "fds")}
    return {**keep, "env": env, "proc_environ": proc_env}


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_a_forked_rank_sees_what_an_exec_d_rank_sees(orch, write_spec, hostfile, tmp_path, module) -> None:
    forked, fork_job = _probe_run(orch, write_spec, hostfile, tmp_path / "on", "on", module)
    execd, exec_job = _probe_run(orch, write_spec, hostfile, tmp_path / "off", "off", module)
    assert all(r["preloaded"] for r in forked.values()) and not any(r["preloaded"] for r in execd.values())
    for rank in range(3):
        f, e = _seen(forked[rank], fork_job), _seen(execd[rank], exec_job)
        assert set(f) == set(e)
        for key in sorted(f):
            assert f[key] == e[key], f"rank {rank}: {key}: forked != exec'd: {_diff(f[key], e[key])}"
        # spot checks of what the comparison covers, so that an empty report cannot pass
        assert f["argv"] == [PROBE, f"--local_rank={forked[rank]['env']['LOCAL_RANK']}",
                             "--flag", "a b"]
        assert f["main"]["name"] == "__main__" and f["main"]["file"] == PROBE
        assert f["main"]["spec"] == (["tests.scripts.forkprobe", PROBE, "SourceFileLoader", "tests.scripts"]
                                     if module else None)
        assert f["threads"] == [1, 1] and f["cwd"] == str(ROOT) and f["path"][0] == str(ROOT if module else SCRIPTS)
        assert f["proc_cmdline"] == forked[rank]["orig_argv"] and f["proc_environ"] == f["env"]
        assert f["signals"][str(int(signal.SIGTERM))] == 0 and f["signals"][str(int(signal.SIGINT))] == \
            "default_int_handler"
        assert forked[rank]["fds"] == execd[rank]["fds"]
    assert _fallbacks(orch, fork_job) == []  # forked: no fallback line
    logs = Path(orch.json("status", fork_job)["run_dir"]) / "logs"
    assert sorted(p.name for p in logs.glob("forkserver-*.log")) == ["forkserver-node0.log", "forkserver-node1.log"]
    assert_no_leftovers(fork_job, timeout=5)


def test_forked_ranks_draw_different_numbers_unless_the_script_seeds(orch, write_spec, hostfile, tmp_path) -> None:
    fresh, _ = _probe_run(orch, write_spec, hostfile, tmp_path / "fresh", "on")
    for kind in ("python", "numpy", "torch"):
        draws = [tuple(fresh[r]["draws"][kind]) for r in range(3)]
        assert len(set(draws)) == 3, (kind, draws)  # two ranks of one template differ too
    seeded, _ = _probe_run(orch, write_spec, hostfile, tmp_path / "seeded", "on", FORKPROBE_SEED="7")
    assert all(r["preloaded"] for r in seeded.values())
    for kind in ("python", "numpy", "torch"):
        draws = [tuple(seeded[r]["draws"][kind]) for r in range(3)]
        assert len(set(draws)) == 1, (kind, draws)


KILLABLE = '''import os, time
import torch

print(f"rank {os.environ['RANK']} up torch={torch.__version__}", flush=True)
time.sleep(600)
'''


def test_a_forked_rank_killed_by_sigkill_reads_as_killed_by_signal_9(orch, write_spec, hostfile, tmp_path) -> None:
    (tmp_path / "sleeper.py").write_text(KILLABLE)
    spec = write_spec(name="kill", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")), workdir=str(tmp_path),
                      entrypoint="sleeper.py", fast_start="on", stop_grace_seconds=2)
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")
        up = wait_for(lambda: (lambda d: d if d["state"] == "RUNNING" and all(
            "up" in (r.get("last_line") or "") for r in d["ranks"]) else None)(orch.json("status", job_id)),
            180, "both ranks up")
        victim = next(r for r in up["ranks"] if r["global_rank"] == 1)
        with open(f"/proc/{victim['pid']}/cmdline", "rb") as f:
            assert b"sleeper.py" in f.read()  # the rank's own process, as ps shows it
        os.kill(victim["pid"], signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    detail = orch.json("status", job_id)
    rank1 = next(r for r in detail["ranks"] if r["global_rank"] == 1)
    assert (rank1["returncode"], rank1["how"]) == (-9, "signal SIGKILL"), rank1
    assert detail["state"] == "FAILED" and detail["cause"]["kind"] == "rank_exit", detail["cause"]
    assert detail["cause"]["returncode"] == -9
    assert _fallbacks(orch, job_id) == []
    assert_no_leftovers(job_id, timeout=10)


def test_zero2_trains_to_the_end_with_fast_start_on(orch, write_spec, hostfile) -> None:
    helpers_train.prebuild_ops()
    steps = 20
    spec = write_spec(name="zero2", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")), launcher="pdsh",
                      workdir=str(EXAMPLES), entrypoint="train_gpt.py", args=[*TINY, "--steps", str(steps)],
                      deepspeed_config=str(EXAMPLES / "ds_zero2.json"), fast_start="on", stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    r = orch("run", str(spec), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert [x["step"] for x in detail["ranks"]] == [steps, steps]
    losses = helpers_train.attempt_losses(detail["run_dir"])
    assert sorted(losses) == [(rank, s) for rank in range(2) for s in range(1, steps + 1)]
    logs = Path(detail["run_dir"]) / "logs"
    assert (logs / "forkserver-node0.log").is_file() and _fallbacks(orch, job["id"]) == []
    assert_no_leftovers(job["id"], timeout=10)


def test_auto_falls_back_to_exec_for_a_non_python_entrypoint_and_says_why(orch, write_spec, hostfile,
                                                                          tmp_path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho \"rank $RANK step=1 loss=1.0\"\n")
    script.chmod(0o755)
    spec = write_spec(name="sh", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")), workdir=str(tmp_path),
                      entrypoint=str(script), no_python=True, no_local_rank=True, stop_grace_seconds=2)
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    reasons = _fallbacks(orch, job["id"])
    assert len(reasons) == 2 and reasons[0] == reasons[1], reasons  # each node's ranks_started says why; no warning
    assert reasons[0].startswith("the ranks' program") and "is not Python (no_python)" in reasons[0], reasons
    started = [e.data["fast_start"] for e in orch.events(job["id"], "ranks_started")]
    assert all(s["mode"] == "auto" and s["forked"] is False and s["job_wide"] for s in started), started


def test_on_refuses_where_auto_would_fall_back(orch, write_spec, hostfile, tmp_path) -> None:
    spec = write_spec(name="refuse", hostfile=str(hostfile("node-0 slots=1\n")), workdir=str(ROOT),
                      entrypoint=str(SCRIPTS / "worker.py"), fast_start="on", stop_grace_seconds=2)
    r = orch("run", str(spec), timeout=120)
    assert r.returncode != 0
    (job,) = orch.json("list")
    cause = orch.json("status", job["id"])["cause"]
    assert cause["kind"] == "spawn_failed", cause
    assert "fast_start on: the ranks cannot be forked on node-0" in cause["message"], cause
    assert "imports neither torch nor DeepSpeed" in cause["message"], cause


def test_the_template_plan_says_why_a_node_s_ranks_cannot_be_forked(tmp_path) -> None:
    """agents.forkserver.plan_template, without processes: each reason auto logs and on fails with, and what
    the template gets (the variables every rank shares; each rank's entrypoint)."""
    from agents.forkserver import NodeReason, plan_template
    py = sys.executable
    (tmp_path / "train.py").write_text("import os, torch\n")
    (tmp_path / "plain.py").write_text("import os\n")
    argv = [[py, "-u", "train.py", f"--local_rank={i}"] for i in range(2)]
    envs = [{"RANK": str(i), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0,1"} for i in range(2)]
    plan = plan_template(argv, envs, str(tmp_path))
    assert plan.options == ("-u",) and dict(plan.env) == {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert [m["args"] for m in plan.mains] == [["--local_rank=0"], ["--local_rank=1"]]
    assert plan.mains[0]["target"] == str(tmp_path / "train.py") and plan.mains[0]["argv0"] == "train.py"
    module = plan_template([[py, "-u", "-m", "pkg.main", "x"]], [{}], str(tmp_path))  # not a file here: assumed
    assert module.mains[0] == {"kind": "module", "target": "pkg.main", "args": ["x"]}
    cases = [
        (argv, [{**e, "CUDA_VISIBLE_DEVICES": e["RANK"]} for e in envs], None,
         "CUDA_VISIBLE_DEVICES differs between the node's ranks", True),
        (argv, [{**e, "PYTHONHASHSEED": e["RANK"]} for e in envs], None, "PYTHONHASHSEED differs", True),
        ([[py, "-u", "missing.py"]], [{}], None, "'missing.py' is not a file in", True),
        ([["/bin/sh", "run.sh"]], [{}], None, "is not Python (no_python)", False),
        ([[py, "-c", "print(1)"]], [{}], None, "interpreter option '-c'", False),
        ([[py, "-u", "plain.py"]], [{}], None, "imports neither torch nor DeepSpeed", False),
        ([argv[0], [py, "-B", "train.py"]], envs, None, "different interpreters or interpreter options", False),
        (argv, envs, "openmpi", "the openmpi launcher's ranks are started by its own tool", False),
    ]
    for argvs, env, launcher, words, node_only in cases:
        with pytest.raises(ValueError, match=re.escape(words)) as err:
            plan_template(argvs, env, str(tmp_path), launcher)
        assert isinstance(err.value, NodeReason) == node_only, words


def test_auto_starts_a_node_s_only_rank_as_a_new_process_unless_its_template_is_kept(tmp_path, monkeypatch) -> None:
    """agents.forkserver.open_server: with one rank on the node and nothing to keep the template for, auto execs
    it and says why (a template imports more than the rank would), starting nothing; two ranks, or a template kept
    (``kept``), go on to start the template (its start is stubbed here)."""
    from agents import forkserver
    monkeypatch.setattr(forkserver, "_is_subreaper", lambda: True)  # (as an agent is; this test process is not)
    py = sys.executable
    (tmp_path / "train.py").write_text("import os, torch\n")
    one = [[py, "-u", "train.py", "--local_rank=0"]]
    server, why, job_wide = forkserver.open_server("auto", one, [{}], str(tmp_path), str(tmp_path / "t.log"))
    assert server is None and why == forkserver.ONE_RANK and not job_wide
    assert "one rank on this node" in why and "no restart policy, no --keep-warm" in why
    assert not (tmp_path / "t.log").exists()
    # what auto would fork from instead: the same plan, which two ranks (or a kept template) are started with
    two = [*one, [py, "-u", "train.py", "--local_rank=1"]]
    assert len(forkserver.plan_template(two, [{}, {}], str(tmp_path)).mains) == 2
    started = []
    monkeypatch.setattr(forkserver.ForkServer, "start", lambda self: started.append(len(self.plan.mains)) or "not here")
    for argvs, kept in ((two, False), (one, True)):
        assert forkserver.open_server("auto", argvs, [{}] * len(argvs), str(tmp_path), str(tmp_path / "t.log"),
                                      kept=kept) == (None, "not here", False)
    assert started == [2, 1]


#: an agent's part in forking one rank with no cgroup (run as its own process: the agent is a child subreaper,
#: which the rank's fork from the template needs, and a pytest worker must not become one)
FORK_WITHOUT_CGROUP = """
import json, os, sys
from agents.forkserver import ForkServer, plan_template
from agents.ranks import become_subreaper
assert become_subreaper()
argv = [sys.executable, "-u", "where.py", "--local_rank=0"]
env = dict(os.environ)
server = ForkServer(plan_template([argv], [env], os.getcwd()), "template.log")
why = server.start()
assert why is None, why
try:
    read, write = os.pipe()
    pid = server.fork(0, argv, env, server.plan.mains[0], write)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as out:
        said = out.read()
finally:
    server.close()
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "said": said.strip(),
                  "agent": open("/proc/self/cgroup").read().strip()}))
"""


def test_a_rank_forked_without_a_cgroup_stays_in_the_template_s_and_runs(tmp_path) -> None:
    """ForkServer.fork with no cgroup (a node without cgroup v2, or one whose cgroup could not be made: the agent's
    ``no_cgroup``): the rank runs its script in the cgroup it was forked in, the agent's, joins no other, and
    exits with its own code."""
    import subprocess
    (tmp_path / "where.py").write_text("import sys, torch\nprint(open('/proc/self/cgroup').read().strip(), "
                                       "sys.argv[1:], flush=True)\nraise SystemExit(3)\n")
    r = subprocess.run([sys.executable, "-c", FORK_WITHOUT_CGROUP], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["code"] == 3 and got["said"] == f"{got['agent']} ['--local_rank=0']", got
