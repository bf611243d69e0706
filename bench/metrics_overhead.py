"""What metrics cost: training throughput with metrics on vs off, and the time of one scrape.

The same 2-node x 1-slot ZeRO-2 job of examples/train_gpt.py under ``orch run``, two ways, in
alternating rounds (on, off, on, off, ...) so load drifts affect both alike:

* ``on``: ``metrics_port: auto`` (every agent serves /metrics) and the script reports every
  step with ``agents.report``; a scraper GETs every node's /metrics once a second, as a
  Prometheus with a 1 s scrape interval would (five times Prometheus' usual rate);
* ``off``: ``metrics_port: null`` and ``--no-report``: no exporter, no report;
* ``bare``: no orch at all: DeepSpeed's per-node launcher (``python -m deepspeed.launcher.launch``), one per
  "node" with the same world (2 nodes x 1 slot), the same script, arguments and config as ``off``; its
  ranks are exec'd, where orch's are forked from a template by default (``fast_start: auto``).

Throughput: the median over ranks of each rank's mean step time (the ``step_s`` of its
``[train]`` lines, first ``--warmup`` steps left out). Overhead = on / off - 1; against the bare launcher,
bare / on is orch's throughput with metrics on as a fraction of the bare launcher's (paired per round).

Scrape time: while an ``on`` job runs, ``--scrapes`` timed GETs of node 0's /metrics
(median and p90 in ms).

``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: one round of each system on one node
(:data:`QUICK`: 200 steps, the first 5 left out, enough for a scrape or two; 2,000 report calls), unless ``--steps``/``--warmup``/``--nodes`` say
otherwise.

    python bench/metrics_overhead.py --rounds 3 --steps 400
    python bench/metrics_overhead.py --rounds 3 --steps 150 --model small   # bigger steps
    python bench/metrics_overhead.py --quick
"""

from __future__ import annotations

import argparse
import math
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODELS = {
    "tiny": ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32"],
    "small": ["--n-layer", "2", "--d-model", "128", "--n-head", "4", "--seq-len", "128"],
}
STEP = re.compile(r"^\[train\] step=(\d+) rank=(\d+) .* step_s=([0-9.]+)", re.M)
#: a full run's options (where not given) and report calls, and ``--quick``'s
DEFAULTS = {"steps": 400, "warmup": 20, "nodes": 2, "report_calls": 20000}
QUICK = {"steps": 200, "warmup": 5, "nodes": 1, "report_calls": 2000}  # steps: ~1.3 s here, time to be scraped


def run(mode: str, work: Path, args: argparse.Namespace, scrapes: list[float]) -> list[float]:
    """One ``orch run``; returns each rank's mean step time (seconds) after the warm-up."""
    state = work / f"state-{mode}-{time.monotonic_ns()}"
    hostfile = work / "hostfile"
    hostfile.write_text("".join(f"node-{k} slots=1\n" for k in range(args.nodes)))
    train = ["--steps", str(args.steps), "--checkpoint-interval", "0", "--log-interval", "0",
             "--corpus-bytes", "200000", *MODELS[args.model]]
    if mode == "off":
        train.append("--no-report")
    spec = {"name": f"bench-{mode}", "hostfile": str(hostfile), "workdir": str(EXAMPLES),
            "entrypoint": "train_gpt.py", "args": train, "deepspeed_config": str(EXAMPLES / "ds_zero2.json"),
            "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
            "metrics_port": "auto" if mode == "on" else None}
    if mode == "off":
        spec["deepspeed_config"] = _without_monitor(work)
    path = work / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "ORCH_STATE_DIR": str(state), "ORCH_PROMETHEUS_TARGETS": str(state / "targets")}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(path)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape_loop, args=(state / "targets", stop, scrapes), daemon=True)
    if mode == "on":
        scraper.start()
    _, err = proc.communicate(timeout=1800)
    stop.set()
    if proc.returncode != 0:
        raise SystemExit(f"orch run ({mode}) failed:\n{err[-3000:]}")
    logs = next(state.glob("jobs/*/attempt-1/logs"))
    means = []
    for log in sorted(logs.glob("rank-*.log")):
        times = [float(m.group(3)) for m in STEP.finditer(log.read_text()) if int(m.group(1)) > args.warmup]
        means.append(statistics.fmean(times))
    return means


def run_bare(work: Path, args: argparse.Namespace) -> list[float]:
    """DeepSpeed's launcher without orch, ``args.nodes`` nodes x 1 slot on this machine; each rank's mean step
    time."""
    import base64
    import socket
    info = base64.urlsafe_b64encode(json.dumps({f"node-{k}": [0] for k in range(args.nodes)}).encode()).decode()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    train = ["--steps", str(args.steps), "--checkpoint-interval", "0", "--log-interval", "0",
             "--corpus-bytes", "200000", "--no-report", *MODELS[args.model]]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "ORCH_DEEPSPEED_CONFIG": _without_monitor(work), "PATH": _ranks_path()}
    logs = [work / f"bare-{time.monotonic_ns()}-node{k}.log" for k in range(args.nodes)]
    procs = []
    for k, log in enumerate(logs):
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(
                [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}", f"--node_rank={k}",
                 "--master_addr=127.0.0.1", f"--master_port={port}", str(EXAMPLES / "train_gpt.py"), *train],
                cwd=EXAMPLES, env=env, stdout=f, stderr=subprocess.STDOUT))
    for proc, log in zip(procs, logs):
        if proc.wait(1800) != 0:
            raise SystemExit(f"the bare launcher failed:\n{log.read_text()[-3000:]}")
    means = []
    for log in logs:
        times = [float(m.group(3)) for m in STEP.finditer(log.read_text()) if int(m.group(1)) > args.warmup]
        means.append(statistics.fmean(times))
    return means


def _ranks_path() -> str:
    """``PATH`` with this Python's directory first, as orch puts it for its ranks (``path_prepend``): the bare
    launcher's ranks then run the virtualenv's ``ninja`` when DeepSpeed loads its ops, as orch's do. With another
    ``ninja`` (Debian's, older) first, torch rebuilds an op that the other one built (their build logs differ),
    in the ``TORCH_EXTENSIONS_DIR`` both share, at every switch between the systems: about a minute each here."""
    here = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", os.defpath)
    return path if here in path.split(os.pathsep) else here + os.pathsep + path


def _without_monitor(work: Path) -> str:
    """The example config with DeepSpeed's CSV monitor explicitly off (orch turns it on otherwise)."""
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["csv_monitor"] = {"enabled": False}
    path = work / "ds_off.json"
    path.write_text(json.dumps(config))
    return str(path)


def _scrape_loop(targets: Path, stop: threading.Event, scrapes: list[float]) -> None:
    """GET every node's /metrics once a second; record the duration of each GET of node 0."""
    with httpx.Client(timeout=5, trust_env=False) as client:
        while not stop.wait(1.0):
            for f in targets.glob("bench-*.json"):
                try:
                    groups = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                for g in groups:
                    t0 = time.perf_counter()
                    try:
                        client.get(f"http://{g['targets'][0]}/metrics").raise_for_status()
                    except httpx.HTTPError:
                        continue
                    if g["labels"]["node"] == "node-0":
                        scrapes.append(time.perf_counter() - t0)


REPORT_COST = '''
import os, sys, tempfile, time
d = tempfile.mkdtemp()
os.environ.update(ORCH_JOB_ID="bench", ORCH_ATTEMPT="1", ORCH_NODE="n0", RANK="0",
                  PROMETHEUS_MULTIPROC_DIR=d, ORCH_REPORT_FILE=os.path.join(d, "r.jsonl"))
from agents import report
report.step(0, loss=1.0, samples=8, tokens=256, lr=1e-3)
n = int(sys.argv[1])
t0 = time.perf_counter()
for i in range(1, n + 1):
    report.step(i, loss=1.0 / i, samples=8, tokens=256, lr=1e-3)
print((time.perf_counter() - t0) / n)
'''


def report_cost(calls: int) -> float:
    """Seconds per ``agents.report.step`` call (multiprocess metrics and report file on), the mean of ``calls``."""
    out = subprocess.run([sys.executable, "-c", REPORT_COST, str(calls)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, help=f"default {DEFAULTS['steps']} (--quick: {QUICK['steps']})")
    p.add_argument("--warmup", type=int, help="steps left out of each rank's mean "
                                              f"(default {DEFAULTS['warmup']}; --quick: {QUICK['warmup']})")
    p.add_argument("--nodes", type=int,
                   help=f"nodes of 1 slot (default {DEFAULTS['nodes']}; --quick: {QUICK['nodes']})")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--quick", action="store_true", help="a smoke run, not a measurement: one round, one node, "
                                                        f"{QUICK['steps']} steps (see the module docstring)")
    args = p.parse_args()
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.quick:
        args.rounds = 1
    results: dict[str, list[float]] = {"on": [], "off": [], "bare": []}
    scrapes: list[float] = []
    with tempfile.TemporaryDirectory(prefix="orch-bench-metrics-") as tmp:
        for i in range(args.rounds):
            order = ("on", "off", "bare")
            for mode in order[i % 3:] + order[:i % 3]:
                means = run_bare(Path(tmp), args) if mode == "bare" else run(mode, Path(tmp), args, scrapes)
                results[mode].append(statistics.median(means))
                print(f"round {i + 1} {mode:>4}: step {statistics.median(means) * 1000:.2f} ms "
                      f"(ranks {', '.join(f'{m * 1000:.2f}' for m in means)})", flush=True)
    per_call = report_cost(args.report_calls)
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"\nmodel {args.model}, {args.nodes} x 1 ranks, {args.steps} steps, {args.rounds} rounds")
    print(f"median step time: on {on * 1000:.3f} ms, off {off * 1000:.3f} ms; on/off = {on / off:.4f} "
          f"(overhead {100 * (on / off - 1):+.2f} %)")
    bare = statistics.median(results["bare"])
    paired = [b / o for b, o in zip(results["bare"], results["on"])]
    print(f"bare launcher: median step time {bare * 1000:.3f} ms; orch with metrics on, throughput as a fraction of "
          f"the bare launcher's (bare / on step time, per round): {', '.join(f'{x:.4f}' for x in paired)}; "
          f"median {statistics.median(paired):.4f}")
    print(f"one agents.report.step call: {per_call * 1e6:.1f} us ({100 * per_call / off:.3f} % of a median "
          f"'off' step)")
    if scrapes:
        scrapes.sort()
        print(f"scrape of node 0's /metrics: median {statistics.median(scrapes) * 1000:.2f} ms, "
              f"p90 {scrapes[math.ceil(0.9 * len(scrapes)) - 1] * 1000:.2f} ms (nearest rank) over {len(scrapes)} scrapes")
    else:
        print("no scrape of node 0's /metrics: the 'on' runs ended before the scraper's first look (once a second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
