"""Rank crash to the next attempt's first step, on 2 local nodes, and where the time goes.

A 2-node x 1-slot ZeRO-2 job of examples/train_gpt.py (tiny model, a checkpoint every 10 steps)
under ``orch run`` with ``restart: {max_restarts: 1, backoff_seconds: 0}``; rank 1 raises after
step 25 on the first attempt (``--fail-at-step``). From the job's store, per round (seconds after
the failing rank's exit, as the controller recorded it):

* ``failed``: the job is FAILED;
* ``stopped``: attempt 1's teardown is over (every process gone; ``stopped_at``);
* ``attempt2``: attempt 2 is created (the restart's plan, a universal conversion if any);
* ``running``: every node of attempt 2 started its ranks;
* ``first step``: the first step any rank of attempt 2 reported.

Each round runs the job twice, interleaved: with warm agents (the default: attempt 1's agents and their
fork-server templates are kept for the restart, ``orchestrator.supervision.warm``) and cold
(``ORCH_KEEP_WARM_S=0``: the restart starts new agents, whose templates import torch and DeepSpeed again);
the table gives both and their ratio.

``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: one round of a shorter job
(:data:`QUICK_JOB`: 10 steps, a checkpoint every 4, rank 1 raises after step 6).

    python bench/recovery_timeline.py --rounds 3
    python bench/recovery_timeline.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
#: the job's steps, checkpoint interval and the step after which rank 1 raises: a full run's, and ``--quick``'s
JOB = {"steps": 40, "interval": 10, "fail_at": 25}
QUICK_JOB = {"steps": 10, "interval": 4, "fail_at": 6}


def _spec(work: Path, job: dict[str, int] = JOB) -> dict:
    hostfile = work / "hostfile"
    hostfile.write_text("node-0 slots=1\nnode-1 slots=1\n")
    return {"name": "crash", "hostfile": str(hostfile), "workdir": str(EXAMPLES), "entrypoint": "train_gpt.py",
            "args": ["--steps", str(job["steps"]), "--checkpoint-interval", str(job["interval"]),
                     "--fail-at-step", str(job["fail_at"]), "--fail-rank", "1", *TINY],
            "deepspeed_config": str(EXAMPLES / "ds_zero2.json"), "checkpoint_dir": str(work / "ckpt"),
            "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, "stop_grace_seconds": 5,
            "restart": {"max_restarts": 1, "backoff_seconds": 0}}


def one_round(work: Path, warm: bool = True, job: dict[str, int] = JOB) -> dict[str, float]:
    """Run the job once (``warm``: with warm agents, else ``ORCH_KEEP_WARM_S=0``; ``job``: :data:`JOB` or
    :data:`QUICK_JOB`); the milestones after the failing rank's exit (seconds)."""
    work.mkdir(parents=True)
    spec = work / "job.yaml"
    spec.write_text(yaml.safe_dump(_spec(work, job)))
    env = {**os.environ, "ORCH_STATE_DIR": str(work / "state"), "ORCH_KEEP_WARM_S": "60" if warm else "0"}
    r = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(spec)], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"orch run exited {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    db = sqlite3.connect(work / "state" / "orch.db")
    (job_id,) = db.execute("SELECT id FROM jobs").fetchone()
    crash = next(at for at, data in db.execute("SELECT at, data FROM events WHERE job_id=? AND attempt=1 AND "
                                               "kind='rank_exit' ORDER BY id", (job_id,))
                 if json.loads(data)["returncode"] != 0)
    failed = next(at for at, data in db.execute("SELECT at, data FROM events WHERE job_id=? AND attempt=1 AND "
                                                "kind='state' ORDER BY id", (job_id,))
                  if json.loads(data).get("to") == "FAILED")
    (stopped,) = db.execute("SELECT stopped_at FROM attempts WHERE job_id=? AND number=1", (job_id,)).fetchone()
    created, running = db.execute("SELECT created_at, running_at FROM attempts WHERE job_id=? AND number=2",
                                  (job_id,)).fetchone()
    (first,) = db.execute("SELECT MIN(at) FROM progress WHERE job_id=? AND attempt=2", (job_id,)).fetchone()
    kinds = [k for (k,) in db.execute("SELECT kind FROM events WHERE job_id=? AND attempt=2", (job_id,))]
    return {"failed": failed - crash, "stopped": stopped - crash, "attempt2": created - crash,
            "running": running - crash, "first step": first - crash,
            "converted": float("checkpoint_converted" in kinds)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run, not a measurement: one round of a 10-step job (see the module docstring)")
    args = ap.parse_args()
    job = QUICK_JOB if args.quick else JOB
    rows: dict[str, list[dict[str, float]]] = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="orch-recovery-") as tmp:
        for i in range(1 if args.quick else args.rounds):
            for kind in ("warm", "cold"):
                t = time.monotonic()
                rows[kind].append(one_round(Path(tmp) / f"r{i}-{kind}", warm=kind == "warm", job=job))
                print(f"round {i + 1} {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[kind][-1].items())
                      + f" ({time.monotonic() - t:.0f} s)", flush=True)
    print("| milestone (s after the crash) | warm agents: min / median / max | cold (ORCH_KEEP_WARM_S=0): "
          "min / median / max | warm / cold (medians) |\n|---|---|---|---|")
    for key in rows["warm"][0]:
        cells = []
        for kind in ("warm", "cold"):
            values = [r[key] for r in rows[kind]]
            cells.append(f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}")
        w, c = (statistics.median(r[key] for r in rows[k]) for k in ("warm", "cold"))
        print(f"| {key} | {cells[0]} | {cells[1]} | {w / c:.2f} |" if c >= 0.01 else f"| {key} | {cells[0]} | {cells[1]} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
