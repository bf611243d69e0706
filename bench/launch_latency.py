"""Time from launch to the first training step on every rank: orch vs. DeepSpeed's launcher.

Three ways to start the same 2-node x 2-slot ZeRO-2 job of examples/train_gpt.py (tiny
model, 2 steps) on this machine, run side by side in rounds (A, B, C, A, B, C, ...) so
load drifts affect all alike:

* ``deepspeed``: what DeepSpeed's pdsh runner runs on every node, started at once:
  ``python -u -m deepspeed.launcher.launch --world_info=... --node_rank=<n> ...``
  (no pdsh/ssh here, so this is DeepSpeed's per-node floor, *without* its ssh cost);
* ``orch``: ``orch run`` of the same job (controller, agents, ranks);
* ``floor``: one rank alone (world size 1): Python start-up, torch and DeepSpeed
  imports, a gloo group of one, one step.

For each start, the seconds from starting the command until the *last* rank has logged
``[train] step=1``. Prints medians and the ratio orch/deepspeed and orch/floor.

    python bench/launch_latency.py --rounds 5
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ARGS = ["--steps", "2", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
        "--corpus-bytes", "200000", "--log-interval", "0"]
STEP1 = re.compile(rb"^\[train\] step=1 rank=(\d+) ", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return e


def wait_step1(files: "list[Path] | Callable[[], list[Path]]", ranks: int, t0: float, procs: list[subprocess.Popen],
               timeout: float, pattern: "re.Pattern[bytes]" = STEP1) -> float:
    """Seconds from ``t0`` until ``ranks`` distinct ranks logged step 1 (``pattern``'s group 1) in ``files`` (a
    list, or a function giving the list each time: logs that appear later), polled every 10 ms.

    Raises:
        RuntimeError: every process of ``procs`` ended first.
        TimeoutError: not within ``timeout`` seconds.
    """
    while time.perf_counter() - t0 < timeout:
        seen = set()
        for f in (files() if callable(files) else files):
            try:
                seen |= {int(m) for m in pattern.findall(f.read_bytes())}
            except OSError:
                pass
        if len(seen) >= ranks:
            return time.perf_counter() - t0
        if procs and all(p.poll() is not None for p in procs):
            raise RuntimeError(f"ended before step 1 on every rank: {files() if callable(files) else files}")
        time.sleep(0.01)
    raise TimeoutError("no step 1 in time")


def run_deepspeed(tmp: Path) -> float:
    world = {"node-0": [0, 1], "node-1": [0, 1]}
    info = base64.urlsafe_b64encode(json.dumps(world).encode()).decode()
    port = free_port()
    logs = [tmp / f"ds-node{k}.log" for k in range(2)]
    e = env()
    e["ORCH_DEEPSPEED_CONFIG"] = str(EXAMPLES / "ds_zero2.json")
    t0 = time.perf_counter()
    procs = []
    for k in range(2):
        with open(logs[k], "wb") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}", f"--node_rank={k}",
                 "--master_addr=127.0.0.1", f"--master_port={port}", str(EXAMPLES / "train_gpt.py"), *ARGS],
                cwd=EXAMPLES, env=e, stdout=f, stderr=subprocess.STDOUT))
    dt = wait_step1(logs, 4, t0, procs, 300)
    for p in procs:
        p.wait(300)
    return dt


def run_orch(tmp: Path) -> float:
    import yaml
    state = tmp / "state"
    hostfile = tmp / "hostfile"
    hostfile.write_text("node-0 slots=2\nnode-1 slots=2\n")
    spec = tmp / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "bench", "hostfile": str(hostfile), "workdir": str(EXAMPLES),
                                    "entrypoint": "train_gpt.py", "args": ARGS,
                                    "deepspeed_config": str(EXAMPLES / "ds_zero2.json"),
                                    "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}}))
    e = env()
    e["ORCH_STATE_DIR"] = str(state)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(spec)], env=e,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not list(state.glob("jobs/*/attempt-1/logs")):
        time.sleep(0.01)
    log_dir = next(state.glob("jobs/*/attempt-1/logs"))
    dt = wait_step1([log_dir / f"rank-{r}.log" for r in range(4)], 4, t0, [proc], 300)
    if proc.wait(300) != 0:
        raise RuntimeError("orch run failed")
    return dt


def run_floor(tmp: Path) -> float:
    e = env()
    e.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
             ORCH_DEEPSPEED_CONFIG=str(EXAMPLES / "ds_zero2.json"))
    log = tmp / "floor.log"
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-u", str(EXAMPLES / "train_gpt.py"), *ARGS], cwd=EXAMPLES, env=e,
                                stdout=f, stderr=subprocess.STDOUT)
    dt = wait_step1([log], 1, t0, [proc], 300)
    proc.wait(300)
    return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    runs = {"deepspeed": run_deepspeed, "orch": run_orch, "floor": run_floor}
    times: dict[str, list[float]] = {k: [] for k in runs}
    run_floor(Path(tempfile.mkdtemp()))  # warm the page cache and DeepSpeed's op cache
    for i in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(fn(Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))))
        print(f"round {i + 1}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("median seconds to step 1 on every rank: " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print(f"orch / deepspeed launcher = {med['orch'] / med['deepspeed']:.2f}   "
          f"orch / floor = {med['orch'] / med['floor']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
