"""Submit to the first training step on every rank, on 3 ssh hosts: orch vs DeepSpeed's pdsh runner vs
torchrun on each node vs one bare process.

3 hosts (network namespaces with their own sshd, tests/nethosts.py), 1 slot each, the same tiny ZeRO-2 job
of examples/train_gpt.py (2 steps). The systems, run in alternating rounds (A B C D A B C D ...):

* ``orch``: ``orch run job.yaml`` with the ssh provisioner (paramiko) and the pdsh launcher's semantics
  (``fast_start`` as the spec's default), in the foreground: a new controller, new agents, every time;
* ``orch_warm``: ``orch submit job.yaml`` (the same job) to an ``orch server --keep-warm 600`` that runs through
  all the rounds (a user's long-lived server): each job takes the agents and fork-server templates the job
  before it left on the hosts (no SSH session, no agent start, no import of torch and DeepSpeed);
* ``deepspeed-pdsh``: ``deepspeed --hostfile H --launcher pdsh --master_addr A train_gpt.py ...``, the real
  runner with Debian's pdsh over OpenSSH (an ``ssh`` on PATH that adds ``-F <the hosts' ssh config>``, as a
  user's ~/.ssh/config would; the runner's own ssh check included) and a ``.deepspeed_env`` for the ranks'
  variables;
* ``torchrun``: ``ssh host torchrun --nnodes 3 --node_rank i ...`` to every host at once;
* ``bare``: one local process, world size 1 (Python, the imports, a gloo group of one, one step).

Before the rounds, a bare run, an orch run and an orch_warm run (not counted; the last starts the server and
leaves it warm agents) warm the page cache and DeepSpeed's op caches (one
for the ranks started over ssh, one for the local bare process: :data:`EXT_DIRS`). Seconds from starting the
command to the moment the *last* rank has logged ``[train] step=1``; min, median
and max over the rounds, and each system's median over orch's. Needs root (namespaces).

``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: one round on :data:`QUICK_HOSTS`
hosts, every system once; of the warm-up runs only orch_warm's (so that its counted job takes kept agents);
the op caches start as copies of a warm one (:func:`copy_built_ops`) instead of being built by the warm-up runs.

    sudo .venv/bin/python bench/launch_ssh.py --rounds 5
    sudo .venv/bin/python bench/launch_ssh.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.launch_latency import ARGS, wait_step1  # noqa: E402  (the same job; the step-1 poll of every launch benchmark)
EXAMPLES = ROOT / "examples"
STEP1 = re.compile(rb"\[train\] step=1 rank=(\d+) ")
HOSTS = 3
#: ``--quick``'s hosts: the fewest with which DeepSpeed's runner still goes through pdsh (with one host it runs
#: launch.py locally) and torchrun still has a rendezvous of several nodes
QUICK_HOSTS = 2


#: DeepSpeed's JIT op cache of the ranks started over ssh (orch, pdsh, torchrun) and of the local bare process:
#: two, because a build made in one environment did not match the other (torch rebuilt it: 40-60 s each time
#: seen here when all four shared one; the bare process then found Debian's older ninja first on its PATH, and each
#: ninja rebuilds what the other built, not taking its build log: now every system's PATH has this Python's
#: directory first). Each is warmed by a round that is not counted (``--quick``: copied, :func:`copy_built_ops`).
EXT_DIRS = {"ssh": "ext-ssh", "local": "ext-local"}


def warm_ops_dir() -> Path:
    """Where ``--quick`` finds ops built already: ``$TORCH_EXTENSIONS_DIR``, else the tests' cache
    (``.torch_extensions`` in the checkout, tests/conftest.py's default)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or ROOT / ".torch_extensions")


def copy_built_ops(src: Path, dest: Path) -> list[str]:
    """Copy every op that is built in ``src`` (``<op>/<op>.so`` there and no build holding ``<op>/lock``) into
    ``dest`` (file times kept, so torch's ninja finds the copy up to date), and return their names.

    The copy is what the warm-up runs would have built: the same sources and flags, the same virtualenv's ninja
    (the ranks' ``PATH`` has it first). An op built differently is rebuilt by the first rank that loads it, as
    without the copy. The copy, not ``src`` itself, so that no rank of the benchmark writes into a cache others
    use (a rank killed in a build would leave its lock there).
    """
    done = []
    for lib in sorted(src.glob("*/*.so")):
        op = lib.parent
        if lib.stem == op.name and not (op / "lock").exists():
            shutil.copytree(op, dest / op.name, ignore=shutil.ignore_patterns("lock"))
            done.append(op.name)
    return done


def _env_vars(ext: str) -> dict[str, str]:
    """What every system's ranks get: the CPU accelerator, one thread, gloo on the namespace's interface, a
    private op cache (``ext``: a directory of :data:`EXT_DIRS`, warmed before the rounds)."""
    return {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_EXTENSIONS_DIR": ext,
            "ORCH_DEEPSPEED_CONFIG": str(EXAMPLES / "ds_zero2.json")}


class Systems:
    """The four ways to start the job on one :class:`nethosts.TestNetwork` (see the module docstring)."""

    def __init__(self, net, work: Path, ops_from: Path | None = None) -> None:
        """``ops_from``: a warm op cache whose built ops both of :data:`EXT_DIRS` start with
        (:func:`copy_built_ops`); without it they start empty and the first run on each side builds them."""
        self.net, self.work = net, work
        self.hosts = len(net.names)
        self.server: subprocess.Popen | None = None  # orch_warm's server, started by its first run
        self.port = 29600
        bin_dir = work / "bin"
        bin_dir.mkdir()
        ssh = bin_dir / "ssh"
        ssh.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {net.ssh_config} \"$@\"\n")
        ssh.chmod(0o755)
        self.path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        self.hostfile = work / "hostfile"
        self.hostfile.write_text("".join(f"{n} slots=1\n" for n in net.names))
        self.ext = {k: str(work / d) for k, d in EXT_DIRS.items()}
        if ops_from is not None:
            copied = [copy_built_ops(ops_from, Path(d)) for d in self.ext.values()]
            print(f"op caches start with {', '.join(copied[0]) or 'nothing'} built (copied from {ops_from})",
                  file=sys.stderr, flush=True)
        self.ds_env = work / "ds_env"
        self.ds_env.write_text("".join(f"{k}={v}\n" for k, v in {**self._vars(), "PATH": self.path}.items()))

    def _vars(self, where: str = "ssh") -> dict[str, str]:
        return _env_vars(self.ext[where])

    def _next_port(self) -> int:
        self.port += 1
        return self.port

    def _dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.work))

    def orch(self) -> float:
        d = self._dir("orch")
        spec = self._spec(d)
        env = {**os.environ, "ORCH_STATE_DIR": str(d / "state"), "PATH": self.path}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(spec)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        logs = lambda: list((d / "state").glob("jobs/*/attempt-1/logs/rank-*.log"))  # noqa: E731
        dt = wait_step1(logs, self.hosts, t0, [proc], 300, STEP1)
        if proc.wait(300) != 0:
            raise RuntimeError(f"orch run failed (state in {d})")
        return dt

    def _spec(self, d: Path, args: list[str] = ARGS, **fields) -> Path:
        """``d/job.yaml``: the job on the hosts (ssh provisioner, pdsh semantics) with ``args`` for the script and
        ``fields`` laid over the spec."""
        p = self.net.client_params()
        spec = d / "job.yaml"
        spec.write_text(yaml.safe_dump({
            "name": "bench", "hostfile": str(self.hostfile), "provisioner": "ssh", "launcher": "pdsh",
            "workdir": str(EXAMPLES), "entrypoint": "train_gpt.py", "args": args,
            "deepspeed_config": str(EXAMPLES / "ds_zero2.json"), "master_port": self._next_port(),
            "ssh": {"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]},
            "env": {**self._vars(), "PATH": self.path}, **fields}))
        return spec

    def orch_warm(self) -> float:
        state = self.work / "warm-state"
        env = {**os.environ, "ORCH_STATE_DIR": str(state), "PATH": self.path}
        if self.server is None:
            port = self._next_port()
            self.server = subprocess.Popen([sys.executable, "-m", "orchestrator", "server", "--port", str(port),
                                            "--keep-warm", "600"], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while not _listening(port):
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"orch server did not start (state in {state})")
                time.sleep(0.1)
        spec = self._spec(self._dir("warm"))
        before = set((state / "jobs").glob("*")) if (state / "jobs").exists() else set()
        t0 = time.perf_counter()
        submit = subprocess.run([sys.executable, "-m", "orchestrator", "--output", "json", "submit", str(spec)],
                                env=env, capture_output=True, text=True, timeout=120)
        if submit.returncode != 0:
            raise RuntimeError(f"orch submit failed: {submit.stderr[-2000:]}")
        job_id = json.loads(submit.stdout)["id"]
        logs = lambda: [f for j in set((state / "jobs").glob("*")) - before  # noqa: E731
                        for f in j.glob("attempt-1/logs/rank-*.log")]
        dt = wait_step1(logs, self.hosts, t0, [], 300, STEP1)
        deadline = time.monotonic() + 300
        while (end := _state(state, job_id)) not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not end (state in {state})")
            time.sleep(0.2)
        if end != "SUCCEEDED":
            raise RuntimeError(f"job {job_id} {end} (state in {state})")
        return dt

    def close(self) -> None:
        """Stop the server of ``orch_warm`` (its kept agents end with it)."""
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(60)
            except subprocess.TimeoutExpired:
                self.server.kill()

    def deepspeed_pdsh(self) -> float:
        d = self._dir("ds")
        out = d / "runner.log"
        env = {**os.environ, "PATH": self.path, "DS_ENV_FILE": str(self.ds_env), **self._vars()}
        t0 = time.perf_counter()
        with open(out, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--hostfile",
                                     str(self.hostfile), "--launcher", "pdsh", "--master_addr", self.net.addresses[0],
                                     "--master_port", str(self._next_port()), "train_gpt.py", *ARGS],
                                    cwd=EXAMPLES, env=env, stdout=f, stderr=subprocess.STDOUT)
        dt = wait_step1([out], self.hosts, t0, [proc], 300, STEP1)
        if proc.wait(300) != 0:
            raise RuntimeError(f"deepspeed's runner failed: {out}")
        return dt

    def torchrun(self) -> float:
        d = self._dir("torchrun")
        port = self._next_port()
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**self._vars(), "PATH": self.path}.items())
        t0 = time.perf_counter()
        procs, logs = [], []
        for i, host in enumerate(self.net.names):
            cmd = (f"cd {shlex.quote(str(EXAMPLES))} && env {exports} {shlex.quote(sys.executable)} -m "
                   f"torch.distributed.run --nnodes {self.hosts} --nproc_per_node 1 --node_rank {i} "
                   f"--master_addr {self.net.addresses[0]} --master_port {port} train_gpt.py "
                   + " ".join(shlex.quote(a) for a in ARGS))
            logs.append(d / f"node-{i}.log")
            with open(logs[-1], "wb") as f:
                procs.append(subprocess.Popen(["/usr/bin/ssh", "-F", str(self.net.ssh_config), host, cmd],
                                              stdout=f, stderr=subprocess.STDOUT))
        dt = wait_step1(logs, self.hosts, t0, procs, 300, STEP1)
        for p in procs:
            if p.wait(300) != 0:
                raise RuntimeError(f"torchrun failed: {logs}")
        return dt

    def bare(self) -> float:
        d = self._dir("bare")
        log = d / "bare.log"
        env = {**os.environ, **self._vars("local"), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self._next_port()),
               "PATH": self.path}  # the other systems' ranks' PATH: this Python's directory (its ninja) first
        env.pop("GLOO_SOCKET_IFNAME")  # this machine's namespace has no eth0 of the hosts'
        t0 = time.perf_counter()
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-u", "train_gpt.py", *ARGS], cwd=EXAMPLES, env=env,
                                    stdout=f, stderr=subprocess.STDOUT)
        dt = wait_step1([log], 1, t0, [proc], 300, STEP1)
        proc.wait(300)
        return dt


def _state(state_dir: Path, job_id: str) -> str:
    """The job's state in the server's store."""
    from orchestrator.store import Store
    store = Store(state_dir / "orch.db")
    try:
        return store.get_job(job_id).state.value
    finally:
        store.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def measure(rounds: int, systems: tuple[str, ...] = ("orch", "orch_warm", "deepspeed_pdsh", "torchrun", "bare"),
            log: Callable[[str], None] = print, quick: bool = False) -> dict[str, list[float]]:
    """``{system: [seconds per round]}``, the systems interleaved round by round on one 3-host network
    (``quick``: :data:`QUICK_HOSTS` hosts, op caches copied from :func:`warm_ops_dir`, no bare and orch warm-up)."""
    from nethosts import TestNetwork
    times: dict[str, list[float]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="orch-bench-ssh-") as work, \
            TestNetwork(QUICK_HOSTS if quick else HOSTS) as net:
        runs = Systems(net, Path(work), ops_from=warm_ops_dir() if quick else None)
        try:
            if not quick:
                runs.bare()  # warm the page cache and both op caches (a round not counted)
                runs.orch()
            if "orch_warm" in systems:
                runs.orch_warm()  # starts the server; its agents stay warm for the first counted round
            for i in range(rounds):
                for s in systems:
                    times[s].append(getattr(runs, s)())
                log(f"round {i + 1}: " + "  ".join(f"{s} {v[-1]:.2f}s" for s, v in times.items()))
        finally:
            runs.close()
    return times


def table(times: dict[str, list[float]]) -> str:
    """A markdown table: min / median / max per system, and orch's and orch_warm's medians over its."""
    orchs = [o for o in ("orch", "orch_warm") if times.get(o)]
    lines = ["| system | min | median | max | " + " | ".join(f"{o} / system" for o in orchs) + " |",
             "|---|---|---|---|" + "---|" * len(orchs)]
    for s, v in times.items():
        med = statistics.median(v)
        ratios = " | ".join(f"{statistics.median(times[o]) / med:.2f}" for o in orchs)
        lines.append(f"| {s.replace('_', ' --launcher ') if s == 'deepspeed_pdsh' else s} | {min(v):.2f} s | "
                     f"{med:.2f} s | {max(v):.2f} s | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke run, not a measurement: one round on {QUICK_HOSTS} hosts, op caches copied from "
                         "$TORCH_EXTENSIONS_DIR (else .torch_extensions), only orch_warm's warm-up run")
    ap.add_argument("--json", action="store_true", help="print the seconds per round as JSON")
    args = ap.parse_args(argv)
    times = measure(1 if args.quick else args.rounds, quick=args.quick)
    print(json.dumps(times) if args.json else table(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
