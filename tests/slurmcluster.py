"""A real Slurm cluster on one machine, over the namespace test hosts of tests/nethosts.py.

    with SlurmCluster(net) as cluster:          # net: a started TestNetwork
        cluster.env                              # SLURM_CONF=... for sinfo/srun/sbatch/scancel
        cluster.run(["srun", "-N", "3", "hostname"])
        cluster.node_state("worker-1")           # 'idle', 'allocated', 'down', ...

Layout: ``munged`` (its own key and socket) and ``slurmctld`` in the root namespace, listening on
the bridge address under the machine's hostname (``SlurmctldHost=<hostname>(<bridge address>)``);
one ``slurmd -N <host name>`` per namespace host, started with ``nsenter --net`` (``ip netns
exec`` remounts /sys, and slurmd then cannot find its cgroups), plus ``--uts`` of the host's sshd
when the network has ``own_hostnames``. ``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``, ``ReturnToService=2``, ``SelectType=select/cons_tres`` with CPUs as the
consumable, every host in one default partition ``test``. Everything lives in a temp directory;
:meth:`SlurmCluster.close` kills the daemons and removes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["SlurmCluster", "SlurmError", "check_prerequisites"]

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "sinfo")


class SlurmError(RuntimeError):
    """The test cluster could not be started, or a command failed."""


def check_prerequisites() -> None:
    """Raise SlurmError naming what is missing (Debian: slurm-wlm, munge)."""
    missing = [b for b in BINARIES if not shutil.which(b) and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        raise SlurmError(f"missing {', '.join(missing)} (Debian packages slurm-wlm and munge)")


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class SlurmCluster:
    """slurmctld on the bridge, one slurmd per host of ``net``; a context manager.

    Args:
        net: a started ``nethosts.TestNetwork``.
        cpus: CPUs each node declares (Slurm's slots for ``-n``).
        hosts: indices of the hosts that get a slurmd (default: all).
    """

    __test__ = False

    def __init__(self, net: Any, cpus: int = 2, hosts: Sequence[int] | None = None) -> None:
        self.net = net
        self.cpus = cpus
        self.indices = list(range(len(net.names))) if hosts is None else list(hosts)
        self.dir = Path(tempfile.mkdtemp(prefix="orch-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def names(self) -> list[str]:
        return [self.net.names[i] for i in self.indices]

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        check_prerequisites()
        try:
            self._munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            for i in self.indices:
                self.start_slurmd(i)
            self.wait_idle(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.dir / "munge").mkdir()
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.socket}", f"--key-file={key}",
                               f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'munged.log'}",
                               f"--seed-file={self.dir / 'munge' / 'seed'}"])
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if time.monotonic() > deadline or self.procs["munged"].poll() is not None:
                raise SlurmError(f"munged did not start: {self._log('munged.log')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        ctl = self.net.controller_addr
        lines = [
            "ClusterName=orchtest",
            f"SlurmctldHost={socket.gethostname()}({ctl})",
            f"SlurmctldPort={_free_port(ctl)}",
            f"SlurmdPort={_free_port(ctl)}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.dir / 'state'}", f"SlurmdSpoolDir={self.dir / 'spool-%n'}",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}", f"SlurmdPidFile={self.dir / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.dir / 'slurmctld.log'}", f"SlurmdLogFile={self.dir / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "ReturnToService=2",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5", "MinJobAge=30",
            "SlurmctldDebug=info", "SlurmdDebug=info",
        ]
        for i in self.indices:
            h = self.net.host(i)
            lines.append(f"NodeName={h.name} NodeAddr={h.addr} CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.dir / "state").mkdir()
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")

    def _spawn(self, key: str, argv: list[str]) -> None:
        log = open(self.dir / f"{key}.out", "ab")
        self.procs[key] = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    def start_slurmd(self, i: int) -> None:
        """(Re)start host i's slurmd."""
        h = self.net.host(i)
        old = self.procs.get(f"slurmd-{h.name}")
        if old is not None and old.poll() is None:
            return
        (self.dir / f"spool-{h.name}").mkdir(exist_ok=True)
        self._spawn(f"slurmd-{h.name}", [*self.net.enter_argv(i), "slurmd", "-D", "-N", h.name, "-f", str(self.conf)])

    def restart_dead(self, timeout: float = 60.0) -> None:
        """Start every slurmd that is not running (after ``net.reset()``, which kills them and the
        steps on them), cancel every job left, and wait until every node is idle again."""
        for i in self.indices:
            self.start_slurmd(i)
        self.run(["scancel", "--user", "root"], check=False)
        self.wait_idle(timeout)

    def stop_slurmd(self, i: int) -> None:
        """SIGKILL host i's slurmd (its jobs' steps keep running, as on a node whose daemon died)."""
        p = self.procs.get(f"slurmd-{self.net.names[i]}")
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def controller_states(self) -> dict[str, str]:
        """Each node's ``State=`` as ``scontrol show node`` gives it (``IDLE``, ``MIXED+DRAIN``, ...).

        wait_idle asks this, not sinfo: sinfo's allocated-CPU view, once a node-info request came in while an
        allocation's steps were ending, was seen to say "mixed" for minutes after scontrol showed the nodes idle
        with no CPU allocated and no job left (Slurm 22.05)."""
        r = self.run(["scontrol", "show", "node", "--oneliner"], check=False, timeout=15)
        states = {}
        for line in r.stdout.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            states[fields.get("NodeName", "?")] = fields.get("State", "UNKNOWN")
        return states

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until every node is idle, with no job on it and not drained or down (``NOT_RESPONDING`` is let be: a
        node just resumed shows it until its slurmd registers again)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.controller_states()
            if all((states.get(n) or "").split("+")[0] == "IDLE" and
                   not {"DRAIN", "COMPLETING", "FAIL"} & set(states[n].split("+")[1:]) for n in self.names):
                return
            for key, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{key} exited {p.returncode}: {self._log(key + '.out')}")
            if time.monotonic() > deadline:
                raise SlurmError(f"nodes not idle within {timeout} s: {states}; slurmctld: "
                                 f"{self._log('slurmctld.log')}")
            time.sleep(0.2)

    # ------------------------------------------------------------------ use
    def run(self, argv: Sequence[str], timeout: float = 60, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
        r = subprocess.run(list(argv), env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                           timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr[-2000:]}")
        return r

    def node_state(self, name: str) -> str:
        r = self.run(["sinfo", "-h", "-N", "-n", name, "-o", "%T"], check=False, timeout=15)
        return r.stdout.strip().lower() or "unknown"

    def set_state(self, name: str, state: str, reason: str = "test") -> None:
        """``scontrol update nodename=<name> state=<state>`` (DOWN, RESUME, DRAIN)."""
        self.run(["scontrol", "update", f"nodename={name}", f"state={state}", f"reason={reason}"])

    def _log(self, name: str) -> str:
        try:
            return (self.dir / name).read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------ stop
    def close(self) -> None:
        for key in sorted(self.procs, key=lambda k: k == "munged"):  # munged last
            p = self.procs[key]
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
