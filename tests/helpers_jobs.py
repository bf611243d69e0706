"""Watching a job from a test, whatever its provisioner: the store read in this process, steps from the ranks'
logs, the moment a state is reached, a process alive or gone.

Shared by tests/test_ssh.py, tests/test_ray.py and tests/test_provisioners.py (once copies in each).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

import helpers_train
from conftest import wait_for
from orchestrator.errors import NotFoundError
from orchestrator.store import Store

_STORES: dict[Path, Store] = {}


def store(orch: Any) -> Store:
    """The job store of the ``orch`` fixture, read from this process (one connection per file)."""
    path = orch.state_dir / "orch.db"
    if path not in _STORES:
        _STORES[path] = Store(path)
    return _STORES[path]


def job_id(orch: Any, timeout: float = 60) -> str:
    """The id of the newest job, as soon as it is in the store."""
    path = orch.state_dir / "orch.db"

    def find() -> str | None:
        if not path.exists():
            return None
        try:
            jobs = store(orch).list_jobs()
        except Exception:  # noqa: BLE001 - the file may be half-created
            return None
        return jobs[0].id if jobs else None
    return wait_for(find, timeout, "the job in the store", interval=0.05)


def attempt(st: Store, job: str, number: int) -> Any:
    """The attempt's record, or None while it is not stored yet (the job is stored first)."""
    try:
        return st.get_attempt(job, number)
    except NotFoundError:
        return None


def losses(run_dir: Path) -> dict[tuple[int, int], float]:
    """``{(rank, step): loss}`` from every rank's log of one attempt."""
    return helpers_train.attempt_losses(run_dir)


def last_steps(run_dir: Path, world: int) -> list[int]:
    """The last step each rank logged (0: none yet)."""
    seen = losses(run_dir)
    return [max((s for (r, s) in seen if r == rank), default=0) for rank in range(world)]


def started_pids(st: Store, job: str, number: int = 1) -> dict[int, int]:
    """``{global rank: pid}`` from the attempt's ``ranks_started`` events."""
    out = {}
    for ev in st.events(job):
        if ev.attempt == number and ev.kind == "ranks_started":
            out.update({r["global_rank"]: r["pid"] for r in ev.data["ranks"]})
    return out


def agent_pids(st: Store, job: str, number: int = 1) -> dict[int, int]:
    """``{node rank: agent pid}`` from the attempt's ``agent_up`` events."""
    return {e.data["node_rank"]: e.data["pid"] for e in st.events(job) if e.attempt == number and e.kind == "agent_up"}


def wait_training(orch: Any, job: str, world: int, past: int, timeout: float = 120, number: int = 1) -> Path:
    """Wait until the job is RUNNING and every rank logged a step beyond ``past``; the attempt's run dir."""
    st = store(orch)
    run_dir = Path(wait_for(lambda: attempt(st, job, number), 60, f"attempt {number}").plan["run_dir"])

    def ready() -> bool:
        rec = st.get_job(job)
        assert not rec.state.is_terminal(), f"the job ended early: {rec.state.value} {rec.cause}"
        return rec.state.value == "RUNNING" and min(last_steps(run_dir, world)) > past
    wait_for(ready, timeout, f"every rank past step {past}", interval=0.1)
    return run_dir


def time_to_state(orch: Any, job: str, state: str, fault_mono: float, timeout: float = 30) -> float:
    """Seconds from ``fault_mono`` (``time.monotonic()``) until the store says ``state`` (polled every 20 ms)."""
    st = store(orch)
    deadline = time.monotonic() + timeout
    while st.get_job(job).state.value != state:
        assert time.monotonic() < deadline, f"not {state} within {timeout} s: {st.get_job(job).state}"
        time.sleep(0.02)
    return time.monotonic() - fault_mono


def alive(pid: int) -> bool:
    """The process runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_netns(pid: int, ns: str) -> bool:
    """Process ``pid`` runs in the network namespace ``ns`` (a name under /run/netns)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{ns}").st_ino


def foreign_processes(net: Any, sids: Any = ()) -> list[str]:
    """Processes in the namespaces of ``net``'s hosts (tests/nethosts.py) other than sshd and those of the
    sessions ``sids`` (a Ray node's own all carry a session id of the cluster's ``ray start``s): agents, ranks,
    their children."""
    sids = set(sids)
    left = []
    for i in range(len(net.names)):
        for pid in net.pids(i):
            try:
                if sids and os.getsid(pid) in sids:
                    continue
                cmd = " ".join(psutil.Process(pid).cmdline())
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
            if "sshd" not in cmd:
                left.append(f"host {i}: {pid} {cmd[:120]}")
    return left


def assert_hosts_clean(net: Any, timeout: float = 10.0, sids: Any = ()) -> None:
    """No :func:`foreign_processes` on ``net``'s hosts (polled up to ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while foreign_processes(net, sids):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left on the hosts: {foreign_processes(net, sids)}")
        time.sleep(0.1)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (an ``orch.popen``) if it still runs, and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def out(r: subprocess.CompletedProcess) -> str:
    """A command's exit status and the tails of its output, for an assertion message."""
    return f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"


# --------------------------------------------------------------------------- what a Ray cluster holds of a job

# Read by a driver: the job's named actors (alive ones: Ray drops the name of a dead actor), its placement groups
# that are not removed, and the CPUs not available. Polls (every 0.2 s) until nothing of the job is there or
# TIMEOUT passes; prints one JSON line.
_CLUSTER_STATE = textwrap.dedent("""
    import json, sys, time
    import ray
    ray.init(logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + TIMEOUT
    while True:
        actors = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                        if a["name"].startswith(PREFIX))
        pgs = [p for p in ray.util.placement_group_table().values() if p.get("state") != "REMOVED"]
        total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
        state = {"actors": actors, "placement_groups": pgs, "cpus_in_use": total - free}
        if (not actors and not pgs and total == free) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(json.dumps(state))
""")


def ray_cluster_state(cluster: Any, job: str, timeout: float = 15.0) -> dict:
    """``{actors, placement_groups, cpus_in_use}`` of the job on a tests/raycluster.py cluster, once none is
    left or after ``timeout`` s."""
    code = f"PREFIX, TIMEOUT = {f'orch/{job}.'!r}, {float(timeout)!r}\n" + _CLUSTER_STATE
    r = cluster.run_python(code, timeout=timeout + 60)
    assert r.returncode == 0, f"driver failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_ray_cluster_clean(cluster: Any, job: str, timeout: float = 15.0) -> None:
    """No actor of the job is alive, no placement group is left, no CPU is reserved."""
    state = ray_cluster_state(cluster, job, timeout)
    assert state == {"actors": [], "placement_groups": [], "cpus_in_use": 0}, state


def ray_agent_workers(cluster: Any) -> list[str]:
    """Processes of the cluster that host an agent actor (``ray::OrchAgent...``)."""
    return [f"{pid} {cmd[:100]}" for pid, cmd in cluster.processes() if "OrchAgent" in cmd]
