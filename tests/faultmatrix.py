"""The fault matrix's engine: one 2-node ZeRO-2 job over SSH under a real ``orch server``, one fault
injected, the recovery measured (what each fault is and what is measured: bench/fault_matrix.py, which
prints the table; tests/test_fault_matrix.py asserts on it).
"""


from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import helpers_train  # noqa: E402
from conftest import job_processes, wait_for  # noqa: E402
from orchestrator.store import Store  # noqa: E402

EXAMPLES = ROOT / "examples"
FAULTS = ["rank_crash", "node_killed", "network_cut", "hang", "rank_stopped", "controller_killed",
          "controller_stopped", "agents_killed", "save_crash"]
#: the agents' lease (ORCH_AGENT_LEASE_S) the server is started with: orch's default, as bench/fault_matrix.py
#: measures it; tests/test_fault_matrix.py passes a shorter one (what it asserts is the same: the stall is seen)
LEASE_S = 15.0
#: seconds the controller_stopped fault keeps the server SIGSTOPped past the agents' lease (20 s for 15 s)
STALL_PAST_LEASE_S = 5
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
STEPS, INTERVAL, FAULT_STEP, SAVE_CRASH_STEP = 60, 10, 25, 30
VICTIM = 1  # host index and global rank (one slot per host)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``orch server`` for one state dir on a fixed port (so a restarted one is found at once), whose agents
    stop their ranks after ``lease_s`` seconds without a word from it."""

    def __init__(self, state_dir: Path, lease_s: float = LEASE_S) -> None:
        self.state_dir, self.port, self.lease_s = state_dir, _free_port(), lease_s
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "ORCH_STATE_DIR": str(self.state_dir), "ORCH_AGENT_LEASE_S": str(self.lease_s)}
        env.pop("ORCH_SERVER", None)
        with open(self.state_dir.parent / "server.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "server", "--port",
                                          str(self.port)], env=env, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_for(self._up, 120, "orch server")
        except AssertionError:
            raise AssertionError(f"orch server did not answer within 120 s: "
                               f"{(self.state_dir.parent / 'server.log').read_text()[-2000:]}") from None

    def headers(self) -> dict[str, str]:
        """The server's token (``<state dir>/server.token``, made at its first start)."""
        return {"Authorization": f"Bearer {(self.state_dir / 'server.token').read_text().strip()}"}

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/api/health", headers=self.headers(), timeout=1).status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def stall_steps(lease_s: float, pace_ms: float = 0.0) -> int:
    """The controller_stopped job's steps: training must still run when the agents' lease runs out. Unpaced:
    3,000 for the default 15 s lease (2 idle cores train ~155 steps/s: the lease ran out at step ~2,380), else
    300 per second of lease, rounded up to a checkpoint (1,500 for 5 s: twice what the lease lets 2 idle cores
    train). Paced (a step takes ``pace_ms`` ms at least): twice the steps the lease lets through at that pace,
    past the fault's step, rounded up to a checkpoint (550 for 5 s at 20 ms)."""
    if pace_ms > 0:
        return 50 * math.ceil((FAULT_STEP + 2 * lease_s * 1000.0 / pace_ms) / 50)
    return min(3000, 50 * math.ceil(300 * lease_s / 50))


def _spec(net, work: Path, fault: str, lease_s: float, pace_ms: float = 0.0) -> dict:
    p = net.client_params()
    # the stall must outlast the agents' lease while training still runs: a longer job for it
    steps, interval = (stall_steps(lease_s, pace_ms), 50) if fault == "controller_stopped" else (STEPS, INTERVAL)
    args = ["--steps", str(steps), "--checkpoint-interval", str(interval), *TINY]
    if fault == "controller_stopped" and pace_ms > 0:  # every rank sleeps before each step (no straggler)
        args += ["--pace-ms", f"{pace_ms:g}"]
    if fault == "hang":
        args += ["--hang-at-step", str(FAULT_STEP), "--hang-rank", str(VICTIM)]
    if fault == "save_crash":
        args += ["--crash-in-save-at-step", str(SAVE_CRASH_STEP), "--crash-rank", str(VICTIM)]
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    hostfile = work / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in net.names))
    return {
        "name": fault.replace("_", "-"), "hostfile": str(hostfile), "num_nodes": 2, "provisioner": "ssh",
        "workdir": str(EXAMPLES), "entrypoint": "train_gpt.py", "args": args, "deepspeed_config": config,
        "checkpoint_dir": str(work / "ckpt"), "hang_timeout": 5, "stop_grace_seconds": 5,
        "ssh": {"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]},
        "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
                "PATH": os.environ["PATH"],  # and the tests' own op cache (else each host's orch default)
                "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))},
        "restart": {"max_restarts": 1, "backoff_seconds": 0, "exclude_failed_nodes": True},
    }


def _rank_log(store: Store, job_id: str, attempt: int, rank: int) -> Path:
    return Path(store.get_attempt(job_id, attempt).plan["run_dir"]) / "logs" / f"rank-{rank}.log"


def _last_steps(store: Store, job_id: str, attempt: int) -> list[int]:
    run_dir = Path(store.get_attempt(job_id, attempt).plan["run_dir"])
    losses = helpers_train.attempt_losses(run_dir)
    return [max((s for (r, s) in losses if r == rank), default=0) for rank in (0, 1)]


def _rank_process(job_id: str, rank: int) -> psutil.Process:
    for p in job_processes(job_id):
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("RANK") == str(rank) and "train_gpt.py" in " ".join(p.cmdline()):
            return p
    raise LookupError(f"no process of rank {rank}")


def _env(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _log_has(path: Path, needle: str) -> bool:
    try:
        return needle in path.read_text()
    except OSError:
        return False


def run_fault(fault: str, net, work: Path, lease_s: float = LEASE_S, pace_ms: float = 0.0) -> dict:
    """Inject ``fault`` into a job under a server whose agents' lease is ``lease_s``; the measures. ``pace_ms``
    > 0 makes every step of the controller_stopped job last that long at least (:func:`stall_steps`): a
    shorter job, idle cores while the server is stopped."""
    state_dir = work / "state"
    server = Server(state_dir, lease_s)
    server.start()
    store: Store | None = None
    try:
        spec = _spec(net, work, fault, lease_s, pace_ms)
        r = httpx.post(f"{server.url}/api/jobs", json={"spec": spec, "source": "fault_matrix"}, timeout=60,
                       headers=server.headers())
        r.raise_for_status()
        job_id = r.json()["id"]
        store = Store(state_dir / "orch.db")

        def attempt1_at(step: int) -> bool:
            return min(_last_steps(store, job_id, 1)) >= step if store.get_job(job_id).attempt else False

        if fault == "hang":
            log = wait_for(lambda: store.get_job(job_id).attempt and _rank_log(store, job_id, 1, VICTIM), 60, "run dir")
            wait_for(lambda: _log_has(log, f"[hang] rank={VICTIM}"), 300, "rank 1 to hang", 0.005)
            t_fault = time.time()
        elif fault == "save_crash":
            log = wait_for(lambda: store.get_job(job_id).attempt and _rank_log(store, job_id, 1, VICTIM), 60, "run dir")
            wait_for(lambda: _log_has(log, "killing itself mid-save"), 300, "the crash in the save", 0.005)
            t_fault = time.time()
        else:
            wait_for(lambda: attempt1_at(FAULT_STEP), 300, f"every rank past step {FAULT_STEP}")
            if fault == "rank_crash":
                victim = _rank_process(job_id, VICTIM)
                t_fault = time.time()
                victim.send_signal(signal.SIGKILL)
            elif fault == "node_killed":
                t_fault = time.time()
                net.kill_host(VICTIM)
            elif fault == "network_cut":
                t_fault = time.time()
                net.cut_link(VICTIM)
            elif fault == "controller_killed":
                t_fault = time.time()
                server.kill()
                server.start()
            elif fault == "controller_stopped":
                t_fault = time.time()
                server.proc.send_signal(signal.SIGSTOP)
                time.sleep(lease_s + STALL_PAST_LEASE_S)
                server.proc.send_signal(signal.SIGCONT)
            elif fault == "rank_stopped":
                victim = _rank_process(job_id, VICTIM)
                t_fault = time.time()
                victim.send_signal(signal.SIGSTOP)
            elif fault == "agents_killed":
                agents = [p for p in job_processes(job_id) if _env(p).get("ORCH_AGENT_ATTEMPT_ID") == f"{job_id}.1"]
                t_fault = time.time()
                for agent in agents:
                    agent.send_signal(signal.SIGKILL)
            else:
                raise ValueError(fault)
        if fault == "controller_killed":
            return _reattached(store, job_id, t_fault)

        gone, gone_at = threading.Event(), []

        def watch_attempt1() -> None:
            attempt1 = f"{job_id}.1"
            while True:
                alive = 0
                for p in job_processes(job_id):
                    try:
                        env = p.environ()
                    except psutil.Error:
                        continue
                    alive += attempt1 in (env.get("ORCH_ATTEMPT_ID"), env.get("ORCH_AGENT_ATTEMPT_ID"))
                if not alive:
                    gone_at.append(time.time())
                    gone.set()
                    return
                time.sleep(0.05)
        threading.Thread(target=watch_attempt1, daemon=True).start()

        def failed_at() -> float | None:
            for e in store.events(job_id):
                if e.kind == "state" and e.attempt == 1 and e.data.get("to") == "FAILED":
                    return e.at
            return None
        detected = wait_for(failed_at, 120, "attempt 1 to fail") - t_fault
        first = wait_for(lambda: store.get_job(job_id).attempt >= 2 and store.progress(job_id, 2, limit=1), 300,
                      "attempt 2's first step")
        first_step_s = first[0]["at"] - t_fault
        job = wait_for(lambda: (j := store.get_job(job_id)).state.is_terminal() and not (
            j.state.value == "FAILED" and j.attempt < 2) and j, 600, "the job to end")
        # every process of attempt 1 (a cut host's agent stops its rank only once the controller's
        # lease, lease_s, ran out), then attempt 2's (stopped_at), then count
        gone.wait(60)
        attempt1_gone_s = (gone_at[0] if gone_at else time.time()) - t_fault
        wait_for(lambda: store.get_attempt(job_id, store.get_job(job_id).attempt).stopped_at, 60,
              "the last attempt's processes to end")
        if fault == "network_cut":
            net.restore_link(VICTIM)
        reached = max(_last_steps(store, job_id, 1))
        a2 = store.get_attempt(job_id, 2) if job.attempt >= 2 else None
        resumed = int(a2.resume_tag.removeprefix("step_")) if a2 and a2.resume_tag else 0
        leftovers = len(job_processes(job_id))
        a1 = store.get_attempt(job_id, 1)
        cause = a1.cause or {}
        a1d, a2d = a1.to_dict(), a2.to_dict() if a2 else {}
        return {"fault": fault, "detected_s": round(detected, 3), "first_step_s": round(first_step_s, 2),
                "reached_step": reached, "resumed_from": a2.resume_tag if a2 else None,
                "steps_lost": reached - resumed, "leftovers": leftovers, "attempt1_gone_s": round(attempt1_gone_s, 1), "final_state": job.state.value,
                "attempts": job.attempt, "cause": cause.get("kind"), "lost_node": cause.get("node"),
                "final_cause": (job.cause or {}).get("message") if job.state.value != "SUCCEEDED" else None,
                # where each attempt ran, its world size, and whether the resume needed a universal conversion
                "nodes": [a1d["nodes"], a2d.get("nodes")], "world_sizes": [a1d["world_size"], a2d.get("world_size")],
                "resume_universal_from": a2d.get("resume_universal_from"),
                "load_universal": ((a2.plan.get("deepspeed_config") or {}).get("checkpoint") or {}).get(
                    "load_universal") if a2 else None,
                "converted": any(e.kind == "checkpoint_converted" for e in store.events(job_id))}
    except AssertionError:  # say what the job went through, then fail the run
        if store is not None:
            for e in store.events(job_id):
                print(f"  event {e.attempt} {e.kind} {json.dumps(e.data)[:300]}", file=sys.stderr)
        print((work / "server.log").read_text()[-3000:], file=sys.stderr)
        for log in sorted(work.rglob("agents/node-*.log")):
            print(f"--- {log}:\n{log.read_text()[-2000:]}", file=sys.stderr)
        raise
    finally:
        if store is not None:
            store.close()
        server.stop()
        net.reset()


def _reattached(store: Store, job_id: str, t_fault: float) -> dict:
    """The next server re-attached to the running attempt: when training was recorded again, the steps
    logged twice or never by any rank, and what was left once the job ended."""
    at = wait_for(lambda: next((e.at for e in store.events(job_id) if e.kind == "reattached"), None), 120,
                  "the next server to re-attach")
    first = wait_for(lambda: [p for p in store.progress(job_id, 1, limit=100_000) if p["at"] > t_fault], 120,
                     "a step after the fault")  # (the ranks never stopped: a step normally comes before the re-attach)
    job = wait_for(lambda: (j := store.get_job(job_id)).state.is_terminal() and j, 600, "the job to end")
    wait_for(lambda: store.get_attempt(job_id, job.attempt).stopped_at, 60, "the attempt's processes to end")
    lost = 0
    for rank in (0, 1):
        steps = [int(m) for m in re.findall(r"\[train\] step=(\d+) ", _rank_log(store, job_id, 1, rank).read_text())]
        lost += (len(steps) - len(set(steps))) + (STEPS - len(set(steps)))
    return {"fault": "controller_killed", "detected_s": None, "first_step_s": round(min(p["at"] for p in first) - t_fault, 2),
            "reached_step": max(_last_steps(store, job_id, 1)), "resumed_from": "re-attached", "steps_lost": lost,
            "leftovers": len(job_processes(job_id)), "attempt1_gone_s": None, "final_state": job.state.value,
            "attempts": job.attempt, "cause": "-", "reattached_s": round(at - t_fault, 2)}
