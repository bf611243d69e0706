"""Time from a rank's death to the job being failed and every process stopped: orch vs. launch.py.

The same 2-node x 2-slot job of tests/scripts/worker.py (ranks that sleep in small
steps); once every rank runs, rank 3 (node 1) is killed with SIGKILL, and we measure

* ``orch``: seconds until the job is FAILED in orch's store, and until every process of
  the job (all 4 ranks on both nodes, both agents) is gone;
* ``deepspeed``: DeepSpeed's per-node launcher (``deepspeed.launcher.launch``, what pdsh
  runs on every node): seconds until node 1's launcher exits and its ranks are gone. Node
  0's launcher never learns of it (there is no link between nodes' launchers); its
  ranks run on until they end by themselves or block in a collective until the
  backend's timeout (30 min for gloo). That is reported as "not detected".

    python bench/failure_detection.py --rounds 5
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "worker.py"


def _env(ready: Path) -> dict[str, str]:
    e = dict(os.environ)
    e.update(WORKER_STEPS="100000", WORKER_STEP_S="0.05", WORKER_READY_DIR=str(ready))
    return e


def _wait(cond, timeout: float = 120.0, step: float = 0.002) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError
        time.sleep(step)
    return time.perf_counter()


def _rank_pid(rank: int) -> int:
    for p in psutil.process_iter(["pid", "environ", "cmdline"]):
        try:
            if str(WORKER) in " ".join(p.info["cmdline"] or []) and (p.info["environ"] or {}).get("RANK") == str(rank):
                return p.pid
        except (psutil.Error, TypeError):
            continue
    raise LookupError(rank)


def _alive(pids: list[int]) -> bool:
    return any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def run_orch(tmp: Path) -> tuple[float, float]:
    ready = tmp / "ready"
    (tmp / "hostfile").write_text("node-0 slots=2\nnode-1 slots=2\n")
    spec = tmp / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "fd", "hostfile": str(tmp / "hostfile"), "entrypoint": str(WORKER),
                                    "stop_grace_seconds": 2}))
    e = _env(ready)
    e["ORCH_STATE_DIR"] = str(tmp / "state")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(spec)], env=e,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(lambda: len(list(ready.glob("rank*.ready"))) == 4)
    pids = [_rank_pid(r) for r in range(4)]
    db = sqlite3.connect(tmp / "state" / "orch.db")
    t_kill = time.perf_counter()
    os.kill(pids[3], signal.SIGKILL)
    t_failed = _wait(lambda: db.execute("SELECT state FROM jobs").fetchone()[0] == "FAILED")
    t_gone = _wait(lambda: not _alive(pids))
    proc.wait(60)
    return t_failed - t_kill, t_gone - t_kill


def run_deepspeed(tmp: Path) -> tuple[float, float]:
    ready = tmp / "ready"
    info = base64.urlsafe_b64encode(json.dumps({"node-0": [0, 1], "node-1": [0, 1]}).encode()).decode()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launchers = [subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}",
                                   f"--node_rank={k}", "--master_addr=127.0.0.1", f"--master_port={port}",
                                   str(WORKER)], env=_env(ready), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True) for k in range(2)]
    _wait(lambda: len(list(ready.glob("rank*.ready"))) == 4)
    pids = [_rank_pid(r) for r in range(4)]
    t_kill = time.perf_counter()
    os.kill(pids[3], signal.SIGKILL)
    t_node1 = _wait(lambda: launchers[1].poll() is not None and not _alive(pids[2:]))
    time.sleep(5)
    node0_noticed = launchers[0].poll() is not None
    for p in launchers:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return t_node1 - t_kill, (0.0 if node0_noticed else float("inf"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    orch_failed, orch_gone, ds_node1, ds_node0 = [], [], [], []
    for i in range(args.rounds):
        f, g = run_orch(Path(tempfile.mkdtemp(prefix="fd-orch-")))
        n1, n0 = run_deepspeed(Path(tempfile.mkdtemp(prefix="fd-ds-")))
        orch_failed.append(f)
        orch_gone.append(g)
        ds_node1.append(n1)
        ds_node0.append(n0)
        print(f"round {i + 1}: orch FAILED after {f:.3f}s, all 4 ranks gone after {g:.3f}s | deepspeed: node 1 "
              f"launcher done after {n1:.3f}s, node 0 {'noticed' if n0 == 0 else 'never noticed (5 s watched)'}",
              flush=True)
    med = statistics.median
    print(f"median: orch failed {med(orch_failed):.3f}s, every rank gone {med(orch_gone):.3f}s; deepspeed node 1 "
          f"{med(ds_node1):.3f}s (ratio orch-failed/deepspeed-node1 {med(orch_failed) / med(ds_node1):.2f}); "
          f"deepspeed node 0 noticed in {sum(x == 0 for x in ds_node0)}/{len(ds_node0)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
