"""Where DeepSpeed's universal-checkpoint conversion (``ds_to_universal``) is cheapest: a fresh Python on the
controller's host (what orch does now: ``orchestrator.checkpoints.convert_to_universal``) or a node agent
that has torch and DeepSpeed imported already (a warm fork-server template forks a child that runs the
converter's ``__main__`` with the same arguments).

A 3-node x 1-slot ZeRO-2 run of examples/train_gpt.py (tiny model) saves ``step_20``; each round converts it
both ways, alternating (ABAB), into fresh output directories, and reports seconds of each (min/median/max)
and their ratio. The conversion's own work is the same in both; what differs is the interpreter start and
the imports of torch and DeepSpeed.

``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: one round, converting a 2-node run's
``step_2`` (:data:`QUICK_RUN`).

    python bench/universal_where.py --rounds 5
    python bench/universal_where.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import helpers_train  # noqa: E402

CONVERTER = "deepspeed.checkpoint.ds_to_universal"
#: the run whose last step's checkpoint is converted: a full run's, and ``--quick``'s
RUN = {"nodes": 3, "steps": 20}
QUICK_RUN = {"nodes": 2, "steps": 2}

# A warm process: imports what a rank imports (torch, deepspeed) and the converter's module, then for each line
# of JSON argv on stdin forks a child that runs the converter as __main__ and prints the child's seconds.
_WARM = r"""
import json, os, runpy, sys, time
import torch, deepspeed, deepspeed.checkpoint.ds_to_universal
print("ready", flush=True)
for line in sys.stdin:
    argv = json.loads(line)
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # the converter's output: not into this process's answers
        sys.argv = [argv[0]] + argv[1:]
        try:
            runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"seconds": time.perf_counter() - t, "status": status}), flush=True)
"""


def make_checkpoint(work: Path, run: dict[str, int] = RUN) -> Path:
    """Train ``run["steps"]`` steps on ``run["nodes"]`` local nodes of 1 slot (:data:`RUN`: 20 on 3), saving the
    last step's tag (``step_20``); returns the tag's directory."""
    ckpt = work / "ckpt"
    steps = str(run["steps"])
    job = helpers_train.start(ROOT / "examples" / "ds_zero2.json",
                              helpers_train.TINY_ARGS + ["--steps", steps, "--checkpoint-interval", steps],
                              ckpt_dir=ckpt, nodes=run["nodes"], slots=1, log_dir=work / "logs")
    codes = job.wait(600)
    if any(codes):
        raise RuntimeError(f"training failed {codes}: {job.output()[-3000:]}")
    return ckpt / f"step_{steps}"


def cold(tag: Path, out: Path, env: dict) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", CONVERTER, "--input_folder", str(tag), "--output_folder", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return time.perf_counter() - t


def warm(proc: subprocess.Popen, tag: Path, out: Path) -> float:
    proc.stdin.write(json.dumps([CONVERTER, "--input_folder", str(tag), "--output_folder", str(out)]) + "\n")
    proc.stdin.flush()
    answer = json.loads(proc.stdout.readline())
    if answer["status"] != 0:
        raise RuntimeError(f"warm conversion failed: status {answer['status']}")
    return answer["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run, not a measurement: one round, a 2-node run's step_2 (see the module docstring)")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {"controller (fresh python)": [], "agent (warm, forked)": []}
    with tempfile.TemporaryDirectory(prefix="orch-universal-") as tmp:
        work = Path(tmp)
        tag = make_checkpoint(work, QUICK_RUN if args.quick else RUN)
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", _WARM], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().strip() == "ready"
        print(f"warm process ready in {time.perf_counter() - t:.2f} s (paid once per node, before any failure)")
        try:
            for i in range(args.rounds):
                for kind in (list(times) if i % 2 == 0 else list(reversed(times))):
                    out = work / f"out-{i}-{len(times[kind])}-{kind[:5]}"
                    seconds = cold(tag, out, env) if kind.startswith("controller") else warm(proc, tag, out)
                    times[kind].append(seconds)
                    shutil.rmtree(out)
                print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
        finally:
            proc.stdin.close()
            proc.wait(30)
    load = os.getloadavg()[0]
    print("\n| where | min | median | max |\n|---|---|---|---|")
    for kind, values in times.items():
        print(f"| {kind} | {min(values):.2f} s | {statistics.median(values):.2f} s | {max(values):.2f} s |")
    a, b = (statistics.median(v) for v in times.values())
    print(f"\nagent / controller (medians): {b / a:.2f}; load average (1 min) at the end: {load:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
