"""A fault in real training on 3 ssh hosts: how long until the run ends, and what it leaves behind:
orch vs DeepSpeed's runner + pdsh + ssh.

3 hosts (network namespaces with their own sshd, tests/nethosts.py), 1 slot each, the tiny ZeRO-2 job of
examples/train_gpt.py (gloo all-reduces every step; the example's collective timeout, ``--dist-timeout-s``,
is its default 600 s), started by

* ``orch``: ``orch run job.yaml``, ssh provisioner, pdsh launcher semantics, no restart, ``hang_timeout: 10``
  (a user's setting; the default ``auto`` waits at least 300 s), ``stop_grace_seconds: 5``;
* ``deepspeed``: ``deepspeed --hostfile H --launcher pdsh ...``, the real runner with Debian's pdsh over
  OpenSSH (bench/launch_ssh.py's set-up).

Once every rank logged step 3, one fault hits the last host, host 2 (global rank 2):

* ``kill_node``: every process of the host is SIGKILLed, its sshd included (a node that dies);
* ``cut_link``: the host's interface goes down (its packets are dropped: peers see silence, no reset);
* ``stop_rank``: the rank is SIGSTOPped (a process that stops running but holds its sockets open).

Measured: seconds from the fault until the command the user ran (``orch run``; the runner) exits, or
"not within L s" (``--limit``), when it is interrupted as a user would (Ctrl-C: SIGINT to its process group);
then how many processes of the run are still alive on each host 5 s later (the hosts' sshd excluded). Each
trial's network is reset after it (links up, everything killed).

``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: one round of ``kill_node`` (unless
``--faults`` says otherwise) with a 30 s limit (unless ``--limit`` does), on 2 hosts (bench/launch_ssh.py's
:data:`~bench.launch_ssh.QUICK_HOSTS`; the fault hits host 1), processes counted 1 s after the end
(:data:`QUICK_AFTER_S`), op caches copied from a warm one (:func:`bench.launch_ssh.copy_built_ops`) instead of the
warm-up runs, which it skips.

    sudo .venv/bin/python bench/failure_detection.py --rounds 3
    sudo .venv/bin/python bench/failure_detection.py --faults kill_node --rounds 1 --limit 30
    sudo .venv/bin/python bench/failure_detection.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.launch_latency import ARGS  # noqa: E402  (the same tiny model)
from bench.launch_ssh import EXAMPLES, HOSTS, QUICK_HOSTS, Systems, warm_ops_dir  # noqa: E402

FAULTS = ("kill_node", "cut_link", "stop_rank")
SYSTEMS = ("orch", "deepspeed")
STEP = re.compile(rb"\[train\] step=(\d+) rank=(\d+) ")  # (pdsh prefixes each line with its host)
TRAIN = [*ARGS[:ARGS.index("--steps")], "--steps", "100000", *ARGS[ARGS.index("--steps") + 2:]]
AFTER_S = 5.0  # processes are counted this long after the run ended
QUICK_AFTER_S = 1.0  # ... in a --quick run


def _steps(logs: list[Path]) -> dict[int, int]:
    """The newest step each rank logged in ``logs``."""
    out: dict[int, int] = {}
    for f in logs:
        try:
            text = f.read_bytes()
        except OSError:
            continue
        for m in STEP.finditer(text):
            out[int(m.group(2))] = max(out.get(int(m.group(2)), 0), int(m.group(1)))
    return out


def _left(net) -> dict[str, int]:
    """Processes alive on each host, its listening sshd excluded (zombies are not counted)."""
    out = {}
    for h in net.hosts:
        keep = {h.sshd.pid} if h.sshd is not None and h.sshd.poll() is None else set()
        pids = [p for p in net.pids(h.index) if p not in keep]
        out[h.name] = sum(1 for p in pids if _live(p))
    return out


def _live(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _victim_pid(net, victim: int) -> int:
    """The training process of global rank ``victim`` on host ``victim`` (not its launcher or agent)."""
    for pid in net.pids(victim):
        try:
            p = psutil.Process(pid)
            if p.environ().get("RANK") == str(victim) and "train_gpt.py" in " ".join(p.cmdline()) \
                    and "deepspeed.launcher.launch" not in " ".join(p.cmdline()):
                return pid
        except psutil.Error:
            continue
    raise LookupError(f"rank {victim}'s process on host {victim}")


class Trials(Systems):
    """Starts either system on the training job and applies a fault (see the module docstring)."""

    @property
    def victim(self) -> int:
        """The host index and global rank hit by the fault: the last host's (2 of :data:`HOSTS`)."""
        return self.hosts - 1

    def start(self, system: str) -> tuple[subprocess.Popen, callable]:
        """Start ``system``; returns its process and a function listing its rank logs."""
        d = self._dir(system)
        if system == "orch":
            spec = self._spec(d, TRAIN, name="fd", hang_timeout=10, stop_grace_seconds=5)
            env = {**os.environ, "ORCH_STATE_DIR": str(d / "state"), "PATH": self.path}
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(spec)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            return proc, lambda: list((d / "state").glob("jobs/*/attempt-1/logs/rank-*.log"))
        out = d / "runner.log"
        env = {**os.environ, "PATH": self.path, "DS_ENV_FILE": str(self.ds_env), **self._vars()}
        with open(out, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--hostfile",
                                     str(self.hostfile), "--launcher", "pdsh", "--master_addr", self.net.addresses[0],
                                     "--master_port", str(self._next_port()), "train_gpt.py", *TRAIN],
                                    cwd=EXAMPLES, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        return proc, lambda: [out]

    def fault(self, fault: str) -> None:
        """Apply ``fault`` to host :attr:`victim`."""
        if fault == "kill_node":
            self.net.kill_host(self.victim)
        elif fault == "cut_link":
            self.net.cut_link(self.victim)
        else:
            os.kill(_victim_pid(self.net, self.victim), signal.SIGSTOP)

    def trial(self, system: str, fault: str, limit: float, after_s: float = AFTER_S) -> dict:
        """One run of ``system`` with ``fault``: ``{"ended_s": seconds or None, "left": {host: processes}}``, the
        processes counted ``after_s`` seconds after the end."""
        proc, logs = self.start(system)
        try:
            deadline = time.monotonic() + 300
            while len([s for s in _steps(logs()).values() if s >= 3]) < self.hosts:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{system} did not reach step 3 on every rank (exit {proc.poll()}; "
                                       f"logs {[str(f) for f in logs()]})")
                time.sleep(0.05)
            t0 = time.monotonic()
            self.fault(fault)
            try:
                proc.wait(limit)
                ended = time.monotonic() - t0
            except subprocess.TimeoutExpired:  # what a user does then: Ctrl-C (SIGINT to the command's group)
                ended = None
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            time.sleep(after_s)
            return {"ended_s": ended, "left": _left(self.net), "interrupted": ended is None}
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
            self.net.reset()


def measure(rounds: int, faults: tuple[str, ...], limit: float, log=print,
            quick: bool = False) -> dict[str, dict[str, list[dict]]]:
    """``{fault: {system: [trial results]}}``, the systems alternating within each fault and round (``quick``:
    on :data:`~bench.launch_ssh.QUICK_HOSTS` hosts, processes counted :data:`QUICK_AFTER_S` after the end, op caches
    copied from a warm one, no warm-up runs)."""
    from nethosts import TestNetwork
    out: dict[str, dict[str, list[dict]]] = {f: {s: [] for s in SYSTEMS} for f in faults}
    with tempfile.TemporaryDirectory(prefix="orch-bench-fd-") as work, \
            TestNetwork(QUICK_HOSTS if quick else HOSTS) as net:
        runs = Trials(net, Path(work), ops_from=warm_ops_dir() if quick else None)
        if not quick:
            runs.bare()  # warm the page cache and the op caches (not counted)
            runs.orch()
        for i in range(rounds):
            for fault in faults:
                for system in SYSTEMS:
                    r = runs.trial(system, fault, limit, QUICK_AFTER_S if quick else AFTER_S)
                    out[fault][system].append(r)
                    log(f"round {i + 1} {fault} {system}: ended "
                        f"{'not within %g s' % limit if r['ended_s'] is None else '%.2f s' % r['ended_s']}, "
                        f"left {r['left']}", flush=True)
    return out


def table(results: dict[str, dict[str, list[dict]]], limit: float, after_s: float = AFTER_S) -> str:
    """A markdown table: per fault and system, the seconds to the end (median, min-max; how many ended within the
    limit) and the processes left on the faulty host (the last one) and on the others (max over the rounds)."""
    hosts = max((len(t["left"]) for by_system in results.values() for trials in by_system.values() for t in trials),
                default=HOSTS)
    victim = f"host {hosts - 1}"
    lines = ["| fault | system | run ended after (median; min-max) | ended within the limit | processes left "
             f"{after_s:g} s after it ended, or after Ctrl-C at the limit: {victim} / other hosts (max) |",
             "|---|---|---|---|---|"]
    for fault, by_system in results.items():
        for system, trials in by_system.items():
            done = [t["ended_s"] for t in trials if t["ended_s"] is not None]
            when = (f"{statistics.median(done):.2f} s; {min(done):.2f}-{max(done):.2f} s" if done
                    else f"not within {limit:g} s")
            names = list(trials[0]["left"]) if trials else []
            on_victim = max((t["left"][names[-1]] for t in trials), default=0)
            others = max((sum(v for k, v in t["left"].items() if k != names[-1]) for t in trials), default=0)
            label = "deepspeed --launcher pdsh" if system == "deepspeed" else system
            lines.append(f"| {fault} | {label} | {when} | {len(done)}/{len(trials)} | {on_victim} / {others} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--faults", help=f"comma-separated, of {', '.join(FAULTS)} (default: all; --quick: kill_node)")
    ap.add_argument("--limit", type=float,
                    help="seconds to wait for a run to end after the fault (default 60; --quick: 30)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke run, not a measurement: one round of kill_node, limit 30 s, {QUICK_HOSTS} hosts, "
                         f"processes counted {QUICK_AFTER_S:g} s after the end, op caches copied from "
                         "$TORCH_EXTENSIONS_DIR (else .torch_extensions), no warm-up runs")
    ap.add_argument("--json", action="store_true", help="print every trial as JSON")
    args = ap.parse_args(argv)
    if args.faults is None:
        args.faults = "kill_node" if args.quick else ",".join(FAULTS)
    if args.limit is None:
        args.limit = 30.0 if args.quick else 60.0
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {', '.join(unknown)}; expected some of {', '.join(FAULTS)}")
    results = measure(1 if args.quick else args.rounds, faults, args.limit, quick=args.quick)
    print(json.dumps(results) if args.json else table(results, args.limit, QUICK_AFTER_S if args.quick else AFTER_S))
    return 0


if __name__ == "__main__":
    sys.exit(main())
