"""Submit to the first training step on every rank: ``fast_start: on`` (ranks forked from a template that
imported torch and DeepSpeed) vs ``off`` (each rank exec'd), side by side.

The same 2-node x 1-slot (``--slots 2``: 2 x 2) ZeRO-2 job of examples/train_gpt.py (tiny model, 2 steps; what
launch_latency.py runs) under ``orch run`` on this machine, in alternating rounds (off, on, off, on, ...)
so load drifts affect both alike. For each run, the seconds from starting ``orch run`` until the last
rank has logged ``[train] step=1``. Prints each round, the medians and the ratio on / off (median,
and per round). One run before the rounds (not counted) warms the page cache and DeepSpeed's op cache.

``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: one round (off, on) and no warm-up
run.

    python bench/fast_start.py --rounds 3 [--slots 2]
    python bench/fast_start.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLES = ROOT / "examples"

from bench.launch_latency import ARGS, wait_step1  # noqa: E402  (the same job, the same step-1 poll)


def run(tmp: Path, mode: str, slots: int = 1) -> float:
    """One ``orch run`` with ``fast_start: mode`` on 2 nodes of ``slots`` slots; seconds until every rank
    logged step 1."""
    state = tmp / "state"
    (tmp / "hostfile").write_text(f"node-0 slots={slots}\nnode-1 slots={slots}\n")
    spec = tmp / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": f"bench-{mode}", "hostfile": str(tmp / "hostfile"),
                                    "workdir": str(EXAMPLES), "entrypoint": "train_gpt.py", "args": ARGS,
                                    "deepspeed_config": str(EXAMPLES / "ds_zero2.json"), "fast_start": mode,
                                    "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}}))
    env = {**os.environ, "ORCH_STATE_DIR": str(state), "DS_ACCELERATOR": "cpu"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(spec)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        dt = wait_step1(lambda: list(state.glob("jobs/*/attempt-1/logs/rank-*.log")), 2 * slots, t0, [proc], 300)
    except RuntimeError:
        raise RuntimeError(f"orch run ({mode}) ended before step 1 on every rank; state in {state}") from None
    except TimeoutError:
        proc.kill()
        raise TimeoutError(f"no step 1 on every rank within 300 s ({mode})") from None
    if proc.wait(300) != 0:
        raise RuntimeError(f"orch run ({mode}) failed; state in {state}")
    return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slots", type=int, default=1, help="ranks per node (2 nodes)")
    p.add_argument("--quick", action="store_true", help="a smoke run, not a measurement: one round, no warm-up run")
    args = p.parse_args()
    times: dict[str, list[float]] = {"off": [], "on": []}
    if not args.quick:
        run(Path(tempfile.mkdtemp(prefix="bench-fs-warm-")), "off", args.slots)  # page cache, DeepSpeed's op cache
    for i in range(1 if args.quick else args.rounds):
        for mode in times:
            times[mode].append(run(Path(tempfile.mkdtemp(prefix=f"bench-fs-{mode}-")), mode, args.slots))
        print(f"round {i + 1}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    print("median seconds from orch run to step 1 on every rank: "
          + "  ".join(f"{k} {v:.2f} (min {min(times[k]):.2f}, max {max(times[k]):.2f})" for k, v in med.items()))
    print(f"on / off: median {med['on'] / med['off']:.2f}; per round {', '.join(f'{r:.2f}' for r in ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
