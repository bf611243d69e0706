"""What supervising many nodes costs the controller: its CPU with 100 and 1,000 agents.

A real controller (in this process) runs a job on N nodes whose agents are fakes that speak the link protocol
(tests/fakeagents.py, one process for all of them): each says hello, passes its preflight, starts its rank
and sends a heartbeat every 0.5 s (the default ``heartbeat_s``); with ``progress``, also a progress report
per heartbeat (twice what a real agent sends, about one a second). Once the job is RUNNING we wait 3 s,
then measure this process's CPU time (user + system, every thread: the link hub, the attempt's loop, the
store) over ``--window`` seconds, and the threads it holds; then cancel and time the teardown.

``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: one round with and one without
progress, of the smallest size only (100 agents, unless ``--nodes`` says otherwise), 0.5 s of waiting and a 1 s
window.

    python bench/controller_scale.py --rounds 3              # 100 and 1,000 agents, with and without progress
    python bench/controller_scale.py --quick                 # 100 agents, one round of each, a 1 s window

Target (issue 18): 1,000 agents at 2 heartbeats/s under 20% of one core.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fakeagents import FakeProvisioner, start_harness  # noqa: E402
from orchestrator.spec import spec_from_dict  # noqa: E402
from orchestrator.supervision import Controller  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_round(nodes: int, progress: bool, window: float, settle: float = 3.0) -> dict[str, float]:
    """One job on ``nodes`` fake agents, measured for ``window`` seconds from ``settle`` seconds after it is RUNNING:
    ``{"running_s", "cpu", "threads", "cancel_s"}`` (cpu: cores)."""
    with tempfile.TemporaryDirectory(prefix="orch-bench-scale-") as d:
        hostfile = Path(d) / "hosts"
        hostfile.write_text("".join(f"node-{i:04d} slots=1\n" for i in range(nodes)))
        harness, path = start_harness(d)
        controller = Controller(Path(d) / "state",
                                provisioner_factory=lambda name, spec: FakeProvisioner(path, progress=progress))
        try:
            t0 = time.perf_counter()
            job = controller.submit(spec_from_dict({"name": "scale", "hostfile": str(hostfile),
                                                    "entrypoint": "/bin/true", "stop_grace_seconds": 2},
                                                   check_files=False))
            while controller.get(job.id).state.value != "RUNNING":
                if controller.get(job.id).state.is_terminal() or time.perf_counter() - t0 > 300:
                    raise RuntimeError(f"the job did not run: {controller.get(job.id).cause}")
                time.sleep(0.05)
            running_s = time.perf_counter() - t0
            time.sleep(settle)
            c0, w0 = _cpu(), time.perf_counter()
            time.sleep(window)
            cpu = (_cpu() - c0) / (time.perf_counter() - w0)
            threads = threading.active_count()
            if controller.get(job.id).state.value != "RUNNING":
                raise RuntimeError(f"the job stopped while measured: {controller.get(job.id).cause}")
            t1 = time.perf_counter()
            controller.cancel(job.id)
            controller.wait(job.id, timeout=120)
            return {"running_s": running_s, "cpu": cpu, "threads": threads, "cancel_s": time.perf_counter() - t1}
        finally:
            controller.close()
            harness.kill()
            harness.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=10.0, help="seconds of CPU measured per round")
    ap.add_argument("--nodes", type=int, nargs="+", help="agents per job (default 100 1000; --quick: 100)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run, not a measurement: 100 agents, one round of each, a 1 s window")
    args = ap.parse_args(argv)
    settle = 3.0
    if args.quick:
        args.rounds, args.window, settle = 1, 1.0, 0.5
    if args.nodes is None:
        args.nodes = [100] if args.quick else [100, 1000]
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}\n")
    print("| agents | progress | CPU (% of a core), min / median / max | per agent | threads | to RUNNING | cancel |")
    print("|---|---|---|---|---|---|---|")
    for nodes in args.nodes:
        for progress in (False, True):
            rounds = [one_round(nodes, progress, args.window, settle) for _ in range(args.rounds)]
            cpu = sorted(r["cpu"] * 100 for r in rounds)
            med = statistics.median(cpu)
            print(f"| {nodes} | {'each heartbeat' if progress else 'none'} | {cpu[0]:.1f} / {med:.1f} / {cpu[-1]:.1f} "
                  f"| {med / nodes * 1000:.1f} m% | {max(r['threads'] for r in rounds)} "
                  f"| {statistics.median(r['running_s'] for r in rounds):.2f} s "
                  f"| {statistics.median(r['cancel_s'] for r in rounds):.2f} s |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
