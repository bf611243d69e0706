"""The controller: submit, supervise, cancel and resume jobs; the only writer of job state.

One :class:`Controller` runs embedded in ``orch run`` or as the service behind ``orch
server``. Each attempt of a job is supervised by an :class:`AttemptRun` thread that

1. starts one agent per node through the spec's provisioner and sends it its plan;
2. turns the agents' messages into state changes, one small handler per message type
   (``started`` -> RUNNING once every node reported; a rank's non-zero exit, a spawn
   failure, an agent's link closing early or its heartbeats stopping -> FAILED with a
   cause; every rank exiting 0 -> SUCCEEDED);
3. tears the attempt down whatever happened: tells every agent to stop its ranks
   (SIGTERM, grace, SIGKILL), kills agents that do not go, sweeps any process still
   marked with the attempt's id, releases the master port and records ``stopped_at``.

Reaching FAILED does not wait for teardown, so the time to detect a failure is not
hidden behind the grace period; :meth:`Controller.wait` waits for both.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import secrets
import shutil
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import psutil

from ..checkpoints import (MARKER, CheckpointInfo, UniversalCheckpoint, convert_to_universal, latest_complete,
                           needs_universal)
from ..errors import CheckpointError, FilterError, HostfileError, OrchError, ProvisionError, SpecError, StateError
from ..launchers.deepspeed import ACCELERATOR_EXPORT_PREFIXES, deepspeed_env_files
from ..observe import ControllerMetrics, TargetsWriter, attempt_targets, default_targets_dir
from ..planning import JobPlan, PlanInputs, ResourcePool, load_hostfile, make_plan, resolve_pool
from ..provisioners import AgentHandle, Provisioner, get_provisioner
from ..spec import JobSpec, job_deepspeed, spec_from_dict
from ..store import JobRecord, JobState, Store
from .ports import PortLease, default_lock_dir, reserve_port
from .preflight import PreflightRound

__all__ = ["Controller", "AttemptRun", "prepare_plan", "recover_orphans", "default_state_dir", "new_job_id",
           "rank_log_tail"]


def default_state_dir() -> Path:
    """``$ORCH_STATE_DIR``, else ``~/.orch``."""
    return Path(os.environ.get("ORCH_STATE_DIR") or Path.home() / ".orch").expanduser()


def new_job_id(name: str) -> str:
    """``<name>-<6 hex digits>``."""
    return f"{name}-{secrets.token_hex(3)}"


def checkpoint_dir_of(spec: JobSpec, state_dir: str | Path, job_id: str) -> str:
    """The job's checkpoint directory: the spec's, else ``<state dir>/jobs/<job id>/checkpoints``."""
    return spec.checkpoint_dir or str((Path(state_dir) / "jobs" / job_id / "checkpoints").resolve())


def _deepspeed_env_lines(workdir: str) -> tuple[str, ...]:
    """Lines of the ``.deepspeed_env`` files DeepSpeed's runner would read (home, then workdir)."""
    lines: list[str] = []
    for path in deepspeed_env_files(os.environ, os.path.expanduser("~"), workdir):
        if os.path.isfile(path):
            with open(path) as f:
                lines += f.readlines()
    return tuple(lines)


def _accelerator_exports() -> tuple[str, ...]:
    """``get_accelerator().export_envs()`` without importing DeepSpeed: by ``DS_ACCELERATOR``,
    else CUDA when an NVIDIA device is present, else CPU."""
    name = os.environ.get("DS_ACCELERATOR") or ("cuda" if os.path.exists("/dev/nvidiactl") else "cpu")
    return tuple(ACCELERATOR_EXPORT_PREFIXES.get(name, ()))


def _python(spec: JobSpec) -> str:
    """The ranks' interpreter as an absolute path (the real launchers run their resolved one)."""
    if not spec.python:
        return sys.executable
    return shutil.which(spec.python) or spec.python


def prepare_plan(spec: JobSpec, state_dir: str | Path, job_id: str, *, attempt: int = 1,
                 resume_tag: str | None = None, hold_port: bool = True,
                 resume_universal_from: str | None = None) -> tuple[JobPlan, PortLease]:
    """Gather what the planner needs (the I/O part) and plan one attempt.

    Reads the hostfile, applies the filters, checks the nodes can be reached as the
    provisioner is configured (keys, names), reads the DeepSpeed (and Accelerate) config and
    resolves it for the pool's world size (``orchestrator.accelerate_config.job_deepspeed``),
    reserves the master port, then calls the pure :func:`orchestrator.plan.make_plan`.

    Args:
        spec: the validated spec.
        state_dir: orch's state directory (run directories).
        job_id: the job's id.
        attempt: 1-based attempt number.
        resume_tag: the checkpoint tag to resume from, or None.
        hold_port: keep the port reserved (False for ``orch plan``, which only looks).
        resume_universal_from: when ``resume_tag`` is a universal checkpoint, the tag it was
            converted from (see :class:`orchestrator.plan.PlanInputs`).

    Returns:
        ``(plan, lease)``; release the lease when the attempt is over.

    Raises:
        OrchError: HostfileError, FilterError, SpecError, PlanError, LaunchError, ProvisionError.
    """
    state_dir = Path(state_dir)
    provisioner = get_provisioner(spec.provisioner, spec)
    pool = _pool(spec, provisioner)
    provisioner.check(pool)
    if attempt == 1:  # a restart that has just used the spare must still run
        _check_restart_policy(spec, provisioner, pool)
    job_ds = job_deepspeed(spec, [len(slots) for _, slots in pool.nodes], os.environ)  # resolved for this world
    master_addr = spec.master_addr or provisioner.master_addr(pool.hosts[0])
    lease = reserve_port(default_lock_dir(), spec.master_port, master_addr,
                         check_bind=spec.provisioner == "local", hold=hold_port)
    try:
        job_dir = state_dir / "jobs" / job_id
        inputs = PlanInputs(
            job_id=job_id, attempt=attempt, master_port=lease.port,
            run_dir=str((job_dir / f"attempt-{attempt}").resolve()),
            checkpoint_dir=checkpoint_dir_of(spec, state_dir, job_id),
            python=_python(spec), default_master_addr=master_addr,
            resume_tag=resume_tag, resume_universal_from=resume_universal_from,
            controller_env=dict(os.environ), controller_cwd=spec.workdir,
            deepspeed_env_lines=_deepspeed_env_lines(spec.workdir),
            deepspeed_config=job_ds.config, accelerator_exports=_accelerator_exports(),
            accelerate_env_defaults=job_ds.env_defaults(), config_warnings=job_ds.warnings)
        inputs = dataclasses.replace(inputs, accelerate_env=job_ds.env(inputs.deepspeed_config_path))
        plan = make_plan(spec, pool, inputs)
        return plan, lease
    except BaseException:
        lease.release()
        raise


def _check_restart_policy(spec: JobSpec, provisioner: Provisioner, pool: ResourcePool) -> None:
    """A policy that restarts without a lost node needs somewhere to restart.

    A spare host takes the lost one's place; without one, a job that uses every host
    (``num_nodes`` and ``include`` not set) restarts on the nodes left, from its last checkpoint
    converted to DeepSpeed's universal format (:func:`orchestrator.checkpoints.convert_to_universal`).
    A fixed ``num_nodes`` or ``include`` with no host beyond them, or a single host, cannot be
    satisfied.

    Raises:
        SpecError: ``exclude_failed_nodes`` with no host to restart on.
    """
    policy = spec.restart
    if not (policy.exclude_failed_nodes and policy.max_restarts and "node_lost" in policy.retry_on):
        return
    every = _pool(spec.model_copy(update={"num_nodes": -1}), provisioner)
    if len(every.nodes) > len(pool.nodes):
        return
    if spec.num_nodes == -1 and not spec.include and len(pool.nodes) > 1:
        return  # the restart runs on fewer nodes
    if spec.num_nodes != -1:
        why = (f"num_nodes is {spec.num_nodes} and the hostfile (after the filters) has no host beyond them: "
               f"a restart without a lost node would have nowhere to go")
        fix = f"set num_nodes below its {len(every.nodes)} host(s), "
    elif spec.include:
        why = (f"include {spec.include!r} names every host the job uses: a restart without a lost node would "
               "have nowhere to go")
        fix = ""
    else:
        why = "the job runs on a single host: a restart without it would have no node to run on"
        fix = ""
    raise SpecError(f"restart.exclude_failed_nodes: {why}. Add a spare host to the hostfile, {fix}or turn "
                    "exclude_failed_nodes off.")


def _pool(spec: JobSpec, provisioner: Provisioner) -> ResourcePool:
    """The filtered resource pool of a spec, refusing pools a job cannot run on.

    The hosts are the hostfile's; without one, what the provisioner finds (a Ray
    cluster's nodes), else ``localhost`` with ``num_gpus`` (or 1) slots.

    Raises:
        HostfileError: the hostfile is bad, or a host left in the pool has ``slots=0``
            (named with its line).
        FilterError: the filters are bad, or leave no slot at all.
    """
    discovered = None if spec.hostfile else provisioner.discover()
    if spec.hostfile or discovered:
        hosts = load_hostfile(spec.hostfile) if spec.hostfile else discovered
        source = spec.hostfile or f"<the {provisioner.name} cluster's nodes>"
        # a host missing from a discovered pool is simply gone (a dead Ray node); from a hostfile, a typo
        unknown = [h for h in spec.exclude_hosts if h not in hosts] if spec.hostfile else []
        if unknown:
            raise FilterError(f"exclude_hosts names {', '.join(unknown)}, not in {source} (its hosts: "
                              f"{', '.join(hosts)}).")
        for host in spec.exclude_hosts:  # orch's own exclusion (lost nodes): before DeepSpeed's filters
            hosts.pop(host, None)
        if not hosts:
            raise FilterError(f"exclude_hosts leaves no host of {source}.")
    else:
        hosts = collections.OrderedDict(localhost=spec.num_gpus if spec.num_gpus > 0 else 1)
        source = "<no hostfile: localhost>"
    pool = resolve_pool(hosts, spec.include, spec.exclude, spec.num_nodes, spec.num_gpus, source=source)
    empty = [host for host, slots in pool.nodes if not slots]
    if empty:
        where = ", ".join(f"{h} (line {getattr(hosts, 'lines', {}).get(h, '?')})" for h in empty)
        raise HostfileError(f"Hostfile {source}: host(s) {where} have slots=0, so they would run no rank; "
                            "remove those lines or exclude the hosts.", path=source)
    if not pool.nodes:
        used = " and ".join(f"{name} {getattr(spec, name)!r}" for name in ("include", "exclude")
                            if getattr(spec, name))
        raise FilterError(f"No slot of hostfile {source} is left after {used or 'the filters'}; "
                          f"the hostfile has {', '.join(hosts)}.")
    return pool


def rank_log_tail(plan: dict, global_rank: int, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of a rank's log file (empty if it has none yet)."""
    path = Path(plan["nodes"][0]["log_dir"]) / f"rank-{global_rank}.log"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return [ln.decode("utf-8", "replace") for ln in data.splitlines()[-lines:]]


class AttemptRun:
    """Supervises one attempt of one job on its own thread (see the module docstring).

    Args:
        controller: the owning controller (its store, clock and settings).
        spec: the job's spec.
        plan: this attempt's plan.
        lease: the master port reservation, released at teardown.
        provisioner: starts the agents.
    """

    def __init__(self, controller: "Controller", spec: JobSpec, plan: JobPlan, lease: PortLease,
                 provisioner: Provisioner) -> None:
        self.c = controller
        self.spec = spec
        self.plan = plan
        self.lease = lease
        self.provisioner = provisioner
        self.job_id = plan.job_id
        self.events: "queue.Queue[tuple[int, dict]]" = queue.Queue()
        self.agents: dict[int, AgentHandle] = {}
        self.node_state: dict[int, str] = {n.node_rank: "starting" for n in plan.nodes}
        self.last_heard: dict[int, float] = {}
        self.exits: dict[int, int] = {}
        self.state = JobState.PENDING
        self.cancel_event = threading.Event()
        self.cancel_reason = "cancelled by the user"
        self.done = threading.Event()
        self._rank_node = {r.global_rank: n for n, r in plan.ranks()}
        self._last_ping = 0.0
        self._failed_at: float | None = None
        self._last_check = time.monotonic()
        self.metrics_ports: dict[int, int | None] = {}
        self._steps: dict[int, tuple[int | None, float]] = {}  # rank -> (last step, when it last moved)
        self._hang: dict[str, Any] | None = None  # a detected hang, waiting for the stack dumps
        self._targets_written = False
        self._preflight: PreflightRound | None = None  # between every hello and the start (see _provision)
        self._thread = threading.Thread(target=self._main, name=f"attempt-{plan.attempt_id}", daemon=True)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start supervising on a new thread."""
        self._thread.start()

    def _main(self) -> None:
        try:
            self._set(JobState.PROVISIONING)
            self._provision()
            while not self.state.is_terminal():
                self._turn()
        except Exception as err:  # an orch bug must still leave nothing running
            self._log(traceback.format_exc())
            self._fail({"kind": "internal_error", "message": f"orch internal error: {err!r} "
                        f"(details in {self.plan.run_dir}/controller.log)"})
        finally:
            self._teardown()

    def _provision(self) -> None:
        """Start every node's agent, wait until each said hello, run the preflight, then send
        each node its plan.

        No rank starts anywhere until every node's agent is up: a node that cannot be
        reached, refuses the key or lacks the spec's Python fails the attempt with
        ``provision_failed`` (every such node and its reason) before any rank runs. Then
        (unless the spec turns it off) every node runs its preflight checks
        (:mod:`orchestrator.preflight`); the main loop takes their answers
        (:meth:`_on_preflight_result`) and sends ``start`` only once every node passed.
        """
        failures = self._start_agents()
        if not failures and not self.cancel_event.is_set():
            failures = self._await_hellos()
        if self.cancel_event.is_set():
            return self._finish_cancelled()
        if failures:
            nodes = [{"node": self._host(n), "node_rank": n, "reason": why} for n, why in sorted(failures.items())]
            listing = "; ".join(f"{f['node']} (node {f['node_rank']}): {f['reason']}" for f in nodes)
            return self._fail({"kind": "provision_failed", "nodes": nodes, "node": nodes[0]["node"],
                               "node_rank": nodes[0]["node_rank"],
                               "message": f"could not start the agent on {len(nodes)} node(s): {listing}"})
        if self.spec.preflight.enabled:
            return self._begin_preflight()
        self._send_start()

    def _send_start(self) -> None:
        """Send every node its plan: the ranks start."""
        start_msg = {"type": "start", "attempt_id": self.plan.attempt_id, "grace": self.plan.grace,
                     "heartbeat_s": self.c.heartbeat_s, "lease_s": self.c.agent_lease_s}
        now = time.monotonic()
        for node in self.plan.nodes:
            self.last_heard[node.node_rank] = now
            self.agents[node.node_rank].send({**start_msg, "node": node.to_dict()})

    # -- preflight ----------------------------------------------------------------------------

    def _begin_preflight(self) -> None:
        """Ask every node to run its checks; heartbeats (and node-loss detection) start now."""
        self._preflight = PreflightRound(self.spec, self.plan, _python(self.spec),
                                         timeout_s=self.c.preflight_timeout_s, heartbeat_s=self.c.heartbeat_s,
                                         lease_s=self.c.agent_lease_s)
        now = time.monotonic()
        for node_rank, msg in self._preflight.requests().items():
            self.last_heard[node_rank] = now
            self.agents[node_rank].send(msg)

    def _on_preflight_result(self, node_rank: int, msg: dict) -> None:
        pf = self._preflight
        if pf is None or pf.phase == "done" or self.state.is_terminal():
            return
        pf.record(node_rank, msg)
        if not pf.phase_complete():
            return
        if pf.phase == "check":
            for n, request in pf.list_requests().items():
                self.agents[n].send(request)
            if pf.phase == "list":
                return
        self._finish_preflight()

    def _check_preflight(self) -> None:
        """Fail the attempt when nodes are still checking past the preflight timeout."""
        pf = self._preflight
        if pf is not None and pf.phase != "done" and not self.state.is_terminal() and pf.overdue():
            self._finish_preflight()

    def _finish_preflight(self) -> None:
        """Record every node's results (event ``preflight``); then fail or start the ranks."""
        assert self._preflight is not None
        event, cause = self._preflight.verdict()
        self._preflight.phase = "done"
        self.c.store.add_event(self.job_id, self.plan.attempt, "preflight", event)
        if cause is not None:
            return self._fail(cause)
        self._send_start()

    def _start_agents(self) -> dict[int, str]:
        """Start the agents in parallel (at most ``provisioner.max_parallel`` at once)."""
        failures: dict[int, str] = {}

        def start(node: Any) -> None:
            if self.cancel_event.is_set():
                return
            try:
                self.agents[node.node_rank] = self.provisioner.start_agent(node, self.plan, self.events)
            except ProvisionError as err:
                failures[node.node_rank] = str(err)

        workers = max(1, min(len(self.plan.nodes), getattr(self.provisioner, "max_parallel", 64)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="provision") as pool:
            list(pool.map(start, self.plan.nodes))
        return failures

    def _await_hellos(self) -> dict[int, str]:
        """Wait for every agent's hello; an agent that ends or stays silent is a failure."""
        waiting = set(self.agents)
        failures: dict[int, str] = {}
        deadline = time.monotonic() + self.c.provision_timeout_s
        while waiting and not self.cancel_event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                for n in waiting:
                    failures[n] = (f"its agent did not answer within {self.c.provision_timeout_s:.0f} s"
                                   f"{_detail(self.agents[n].diagnostics())}")
                break
            try:
                node_rank, msg = self.events.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            if msg.get("type") == "hello":
                waiting.discard(node_rank)
                self._on_hello(node_rank, msg)
            elif msg.get("type") == "eof" and node_rank in waiting:
                waiting.discard(node_rank)
                self.node_state[node_rank] = "gone"
                failures[node_rank] = f"its agent ended before it started{_detail(self.agents[node_rank].diagnostics())}"
        return failures

    def _turn(self) -> None:
        try:
            node_rank, msg = self.events.get(timeout=0.1)
        except queue.Empty:
            node_rank, msg = None, None
        if msg is not None:
            if msg.get("type") != "eof":  # a closed link is not a word from the agent
                self.last_heard[node_rank] = time.monotonic()
            handler = getattr(self, f"_on_{msg.get('type')}", self._on_unknown)
            handler(node_rank, msg)
        if self.cancel_event.is_set() and not self.state.is_terminal():
            self._finish_cancelled()
        self._check_heartbeats()
        self._check_progress()
        self._check_preflight()
        self._ping()

    def _ping(self) -> None:
        """Renew every agent's lease (agents stop their ranks when the controller falls silent)."""
        now = time.monotonic()
        if now - self._last_ping < self.c.heartbeat_s:
            return
        self._last_ping = now
        for node_rank, handle in self.agents.items():
            if self.node_state[node_rank] not in _ENDED:
                handle.send({"type": "ping"})

    # -- message handlers ---------------------------------------------------------------------

    def _on_hello(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "up"
        self.c.store.add_event(self.job_id, self.plan.attempt, "agent_up",
                               {"node_rank": node_rank, "host": self._host(node_rank), "pid": msg.get("pid")})

    def _on_started(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "running"
        self.metrics_ports[node_rank] = msg.get("metrics_port")
        self.c.store.add_event(self.job_id, self.plan.attempt, "ranks_started",
                               {"node_rank": node_rank, "host": self._host(node_rank), "ranks": msg.get("ranks", []),
                                "metrics_port": msg.get("metrics_port")})
        if self.state == JobState.PROVISIONING and all(
                s in ("running", "done") for s in self.node_state.values()):
            self._set(JobState.RUNNING)
            attempt = self.c.store.get_attempt(self.job_id, self.plan.attempt)
            self.c.metrics.running((attempt.running_at or 0) - attempt.created_at)
            self._write_targets()
            now = time.monotonic()
            self._steps = {r.global_rank: (None, now) for _, r in self.plan.ranks()}

    def _write_targets(self) -> None:
        """The attempt's Prometheus file_sd file: every node's exporter (see orchestrator.metrics)."""
        nodes = []
        for node in self.plan.nodes:
            port = self.metrics_ports.get(node.node_rank)
            if port:
                try:
                    addr = self.provisioner.master_addr(node.host)
                except OrchError:
                    addr = node.host
                nodes.append((node.host, addr, int(port)))
        if not nodes:
            return
        try:
            path = self.c.targets.write(self.plan.attempt_id, attempt_targets(self.job_id, self.plan.attempt, nodes))
            self._targets_written = True
            self.c.store.add_event(self.job_id, self.plan.attempt, "metrics_targets",
                                   {"path": str(path), "targets": [f"{a}:{p}" for _, a, p in nodes]})
        except OSError as err:
            self.c.store.add_event(self.job_id, self.plan.attempt, "warning",
                                   {"message": f"cannot write the Prometheus targets file in {self.c.targets.directory}: "
                                               f"{err.strerror or err}"})

    def _on_progress(self, node_rank: int, msg: dict) -> None:
        rows = [(int(rank), p) for rank, points in (msg.get("points") or {}).items() if isinstance(points, list)
                for p in points if isinstance(p, dict) and "step" in p]
        if rows:
            self.c.store.add_progress(self.job_id, self.plan.attempt, rows)
            now = time.monotonic()
            if self._steps and all(v[0] is None for v in self._steps.values()):
                # the first step of the attempt arms hang detection: start-up (imports, the
                # rendezvous, building ops) may take long, and counts against no rank
                self._steps = {r: (None, now) for r in self._steps}
            for rank, point in rows:
                old = self._steps.get(rank)
                if old is not None and (old[0] is None or int(point["step"]) > old[0]):
                    self._steps[rank] = (int(point["step"]), now)

    def _on_rank_exit(self, node_rank: int, msg: dict) -> None:
        rank, code = int(msg["global_rank"]), int(msg["returncode"])
        self.exits[rank] = code
        self.c.store.add_event(self.job_id, self.plan.attempt, "rank_exit",
                               {"global_rank": rank, "node_rank": node_rank, "host": self._host(node_rank),
                                "returncode": code, "how": msg.get("how"),
                                "during_teardown": self.state.is_terminal() and code != 0})
        if code != 0 and not self.state.is_terminal():
            node = self._rank_node[rank]
            local = next(r.local_rank for r in node.ranks if r.global_rank == rank)
            if isinstance(msg.get("at"), (int, float)):
                self.c.metrics.failure_detected("rank_exit", time.time() - msg["at"])
            self._fail({"kind": "rank_exit", "global_rank": rank, "local_rank": local, "node": node.host,
                        "node_rank": node.node_rank, "returncode": code,
                        "message": f"rank {rank} (local rank {local}) on {node.host} (node {node.node_rank}) "
                                   f"exited with {msg.get('how') or code}",
                        "log_tail": rank_log_tail(self.plan.to_dict(), rank)})

    def _on_done(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "done"
        every_rank_ok = len(self.exits) == self.plan.world_size and all(c == 0 for c in self.exits.values())
        if all(s == "done" for s in self.node_state.values()) and every_rank_ok and not self.state.is_terminal():
            self._set(JobState.SUCCEEDED)

    def _on_stopped(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "stopped"

    def _on_stopping(self, node_rank: int, msg: dict) -> None:
        self._fail({"kind": "agent_stopped", "node": self._host(node_rank), "node_rank": node_rank,
                    "message": f"the agent on {self._host(node_rank)} (node {node_rank}) stopped its ranks: "
                               f"{msg.get('reason')}"})

    def _on_spawn_failed(self, node_rank: int, msg: dict) -> None:
        self._fail({"kind": "spawn_failed", "node": self._host(node_rank), "node_rank": node_rank,
                    "global_rank": msg.get("global_rank"),
                    "message": f"rank {msg.get('global_rank')} on {self._host(node_rank)} (node {node_rank}) "
                               f"could not be started: {msg.get('error')}"})

    def _on_error(self, node_rank: int, msg: dict) -> None:
        self._fail({"kind": "agent_error", "node": self._host(node_rank), "node_rank": node_rank,
                    "message": f"the agent on {self._host(node_rank)} (node {node_rank}) failed: {msg.get('message')}"})

    def _on_eof(self, node_rank: int, msg: dict) -> None:
        if self.node_state.get(node_rank) not in ("done", "stopped", "lost"):
            self.node_state[node_rank] = "gone"
            if not self.state.is_terminal():
                self.c.metrics.failure_detected("node_lost", 0.0)  # the link closing is the news
            self._fail({"kind": "node_lost", "node": self._host(node_rank), "node_rank": node_rank,
                        "message": f"node lost: the agent on {self._host(node_rank)} (node {node_rank}) "
                                   "went away (its link closed)"})

    def _check_progress(self) -> None:
        """Hang detection (the spec's ``hang_timeout``): a running rank whose step has not moved
        for that long fails the attempt with ``no_progress``, once every node dumped its ranks'
        stacks (or 30 s passed)."""
        timeout = self.spec.hang_timeout
        if not timeout or self.state != JobState.RUNNING or not self._steps:
            return
        if all(v[0] is None for v in self._steps.values()):
            return  # armed by the first step of any rank
        now = time.monotonic()
        if self._hang is not None:
            if not self._hang["waiting"] or now > self._hang["deadline"]:
                cause, self._hang = self._hang["cause"], None
                self._fail(cause)
            return
        running = {r: v for r, v in self._steps.items() if r not in self.exits}
        stalled = {r: v for r, v in running.items() if now - v[1] > timeout}
        if not stalled:
            return
        steps = {r: v[0] for r, v in running.items()}
        known = [s for s in steps.values() if s is not None]
        low = min(known) if known else None
        behind = sorted(r for r in stalled if steps[r] is None) or sorted(r for r in stalled if steps[r] == low)
        if None in (steps[r] for r in behind):
            what = (f"rank(s) {', '.join(str(r) for r in behind if steps[r] is None)} reported no step "
                    f"{timeout:g} s after the others started stepping")
        elif max(known) > low:
            what = (f"rank(s) {', '.join(map(str, behind))} stuck at step {low} for {timeout:g} s while others "
                    f"reached step {max(known)}")
        else:
            what = f"no rank passed step {low} for {timeout:g} s (rank(s) {', '.join(map(str, behind))})"
        run_logs = os.path.join(self.plan.run_dir, "logs")
        cause = {"kind": "no_progress", "ranks": behind, "steps": {str(r): s for r, s in steps.items()},
                 "message": f"no progress: {what}; stacks of every rank in {run_logs}/rank-<rank>.stacks.txt",
                 "stacks": {}}
        waiting = {n for n, st in self.node_state.items() if st == "running"}
        for node_rank in waiting:
            self.agents[node_rank].send({"type": "dump"})
        self.c.store.add_event(self.job_id, self.plan.attempt, "hang_detected", {"ranks": behind, "steps": cause["steps"]})
        self._hang = {"cause": cause, "waiting": waiting, "deadline": now + 30.0}

    def _on_dumped(self, node_rank: int, msg: dict) -> None:
        if self._hang is not None:
            self._hang["waiting"].discard(node_rank)
            self._hang["cause"]["stacks"].update(msg.get("files") or {})
            if msg.get("errors"):
                self._hang["cause"].setdefault("stack_errors", {}).update(msg["errors"])

    def _on_heartbeat(self, node_rank: int, msg: dict) -> None:
        if self._preflight is not None and self._preflight.phase != "done":
            self._preflight.current[node_rank] = msg.get("preflight")  # named if the preflight times out

    def _on_warning(self, node_rank: int, msg: dict) -> None:
        self.c.store.add_event(self.job_id, self.plan.attempt, "warning",
                               {"node_rank": node_rank, "host": self._host(node_rank), "message": msg.get("message")})

    def _on_unknown(self, node_rank: int, msg: dict) -> None:
        self.c.store.add_event(self.job_id, self.plan.attempt, "agent_message",
                               {"node_rank": node_rank, "message": msg})

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        stalled, self._last_check = now - self._last_check > self.c.node_timeout_s / 2, now
        if stalled:  # this controller was frozen (suspended, swapped out): the silence was its own
            self.last_heard = {n: max(t, now) for n, t in self.last_heard.items()}
            return
        if self.state.is_terminal() or not self.events.empty():
            return  # messages still waiting to be read are no sign of silence
        for node_rank, heard in self.last_heard.items():
            if self.node_state[node_rank] in _ENDED:
                continue
            if now - heard > self.c.node_timeout_s:
                self.node_state[node_rank] = "lost"  # unreachable: teardown will not wait for it
                self.c.metrics.failure_detected("node_lost", now - heard)
                self._fail({"kind": "node_lost", "node": self._host(node_rank), "node_rank": node_rank,
                            "message": f"node lost: no heartbeat from the agent on {self._host(node_rank)} "
                                       f"(node {node_rank}) for {now - heard:.1f} s"})
                return

    # -- state --------------------------------------------------------------------------------

    def _host(self, node_rank: int) -> str:
        return self.plan.nodes[node_rank].host

    def _set(self, state: JobState, cause: dict | None = None) -> None:
        self.c.store.set_state(self.job_id, state, cause=cause)
        self.state = state

    def _fail(self, cause: dict) -> None:
        if self.state.is_terminal():
            self.c.store.add_event(self.job_id, self.plan.attempt, "later_failure", cause)
            return
        self._failed_at = time.monotonic()
        self._set(JobState.FAILED, cause)

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Ask the attempt to stop (from any thread); the attempt's own thread acts on it."""
        self.cancel_reason = reason
        self.cancel_event.set()

    def _finish_cancelled(self) -> None:
        if not self.state.is_terminal():
            self._set(JobState.CANCELLED, {"kind": "cancelled", "message": self.cancel_reason})

    def _log(self, text: str) -> None:
        os.makedirs(self.plan.run_dir, exist_ok=True)
        with open(os.path.join(self.plan.run_dir, "controller.log"), "a") as f:
            f.write(text + "\n")

    # -- teardown -----------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Stop every reachable agent's ranks, kill what does not stop, sweep, record the end.

        A lost node (its heartbeats stopped, or its link closed) is not waited for: its
        agent stops its own ranks when the controller's pings stop reaching it (its lease),
        and its connection is dropped here.
        """
        try:
            reason = (self.c.store.get_job(self.job_id).cause or {}).get("message", "attempt ended")
            lost = {n for n, state in self.node_state.items() if state in ("lost", "gone")}
            for node_rank in lost & set(self.agents):
                self.provisioner.forget(node_rank)
            live = {n: h for n, h in self.agents.items() if n not in lost}
            for node_rank, handle in live.items():
                if self.node_state[node_rank] not in _ENDED:
                    handle.send({"type": "stop", "reason": reason})
            deadline = time.monotonic() + self.plan.grace + 5.0
            for node_rank, handle in live.items():
                while not handle.wait(0.1) and time.monotonic() < deadline:
                    self._drain()
                    if node_rank in self._lost_while_stopping():
                        break
            self._drain()
            self._await_silent()
            newly_lost = self._lost_while_stopping()
            for node_rank in newly_lost:
                self.provisioner.forget(node_rank)
                live.pop(node_rank, None)
            self._revise_cause(lost | newly_lost)
            for handle in live.values():
                handle.close()
                if not handle.wait(0.5):
                    handle.kill()
            swept = self.provisioner.sweep(self.plan)
            if swept:
                self.c.store.add_event(self.job_id, self.plan.attempt, "swept", {"pids": swept})
            self.provisioner.close()
        except Exception:  # noqa: BLE001 - teardown must finish
            self._log(traceback.format_exc())
        finally:
            if self._targets_written:
                self.c.targets.remove(self.plan.attempt_id)
            if self._preflight is not None:  # tokens of agents that could not remove their own (where seen)
                shutil.rmtree(self._preflight.shared_dir, ignore_errors=True)
            self.lease.release()
            self.c.store.mark_stopped(self.job_id, self.plan.attempt)
            self.c.store.set_owner(self.job_id, None)
            try:
                self.c._attempt_ended(self)  # before done: whoever waits for the job sees a restart coming
            except Exception:  # noqa: BLE001 - the attempt must still end
                self._log(traceback.format_exc())
            self.done.set()

    def _lost_while_stopping(self) -> set[int]:
        """Nodes that went silent (no message for the node timeout) or whose link closed
        before they reported stopping: marks them ``lost`` and returns every lost node."""
        now = time.monotonic()
        for node_rank, heard in self.last_heard.items():
            if self.node_state[node_rank] not in _ENDED and now - heard > self.c.node_timeout_s:
                self.node_state[node_rank] = "lost"
        return {n for n, state in self.node_state.items() if state in ("lost", "gone")}

    def _await_silent(self) -> None:
        """After a failure, give each node not heard from since (one heartbeat after) the
        failure until the node timeout to speak; one that stays silent is lost. Costs nothing
        when every node answered; at most the node timeout otherwise."""
        if self._failed_at is None:
            return
        since = self._failed_at + self.c.heartbeat_s
        while True:
            self._drain()
            now = time.monotonic()
            silent = [n for n, state in self.node_state.items()
                      if state not in _ENDED and n in self.last_heard and self.last_heard[n] <= since
                      and now - self.last_heard[n] <= self.c.node_timeout_s]
            if not silent:
                return
            time.sleep(0.05)

    def _revise_cause(self, lost: set[int]) -> None:
        """Name a lost node as the root cause when a rank of *another* node failed first.

        A killed node takes its ranks' sockets with it: the surviving ranks' collectives
        fail with a connection error at once, often before the node's silence reaches the
        node timeout. The rank that exited first is then a symptom: the cause becomes
        ``node_lost`` (the first lost node, by node rank) and keeps the rank's failure under
        ``"first_symptom"``. A node counts only if it fell silent no later than one heartbeat
        after the failure (a node lost later did not cause it).
        """
        cause = (self.c.store.get_job(self.job_id).cause or {})
        if self.state != JobState.FAILED or cause.get("kind") != "rank_exit" or self._failed_at is None:
            return
        suspects = sorted(n for n in lost if n != cause.get("node_rank")
                          and self.last_heard.get(n, 0.0) <= self._failed_at + self.c.heartbeat_s)
        if not suspects:
            return
        node_rank = suspects[0]
        silent = self._failed_at - self.last_heard.get(node_rank, self._failed_at)
        revised = {"kind": "node_lost", "node": self._host(node_rank), "node_rank": node_rank,
                   "nodes": [self._host(n) for n in suspects],
                   "message": f"node lost: the agent on {self._host(node_rank)} (node {node_rank}) fell silent "
                              f"and never answered again; {max(silent, 0.0):.1f} s later {cause.get('message')} "
                              "(a consequence)",
                   "first_symptom": cause}
        self.c.store.revise_cause(self.job_id, self.plan.attempt, revised)

    def _drain(self) -> None:
        """Record what agents say while stopping (rank exits) without changing the state."""
        while True:
            try:
                node_rank, msg = self.events.get_nowait()
            except queue.Empty:
                return
            if msg.get("type") != "eof":  # a closed link is not a word from the agent
                self.last_heard[node_rank] = time.monotonic()
            if msg.get("type") == "rank_exit":
                self.exits[int(msg["global_rank"])] = int(msg["returncode"])
                self.c.store.add_event(self.job_id, self.plan.attempt, "rank_exit",
                                       {"global_rank": msg["global_rank"], "node_rank": node_rank,
                                        "host": self._host(node_rank), "returncode": msg["returncode"],
                                        "how": msg.get("how"), "during_teardown": True})
            elif msg.get("type") in ("stopped", "done"):
                self.node_state[node_rank] = msg["type"]
            elif msg.get("type") == "progress":
                self._on_progress(node_rank, msg)
            elif msg.get("type") == "eof" and self.node_state.get(node_rank) not in ("done", "stopped", "lost"):
                self.node_state[node_rank] = "gone"


class Controller:
    """Runs jobs: plans them, supervises their attempts, keeps their state in the store.

    Example::

        c = Controller("~/.orch")
        job = c.submit(load_spec("examples/quickstart.yaml"))
        job = c.wait(job.id)            # terminal, every process gone
        job.state                       # JobState.SUCCEEDED

    Args:
        state_dir: where the store, run directories and port locks live.
        clock: wall clock for the store (epoch seconds); injectable for tests.
        provisioner_factory: (name, spec) -> Provisioner (tests may replace it).
        heartbeat_s: how often agents send heartbeats and the controller pings them
            (default ``$ORCH_HEARTBEAT_S`` or 0.5 s).
        node_timeout_s: an agent's silence after which its node counts as lost
            (default ``$ORCH_NODE_TIMEOUT_S`` or 3 s).
        agent_lease_s: the controller's silence after which an agent stops its ranks
            (default ``$ORCH_AGENT_LEASE_S`` or 15 s). Agents also get
            ``$ORCH_PROVISION_TIMEOUT_S`` (default 120 s) to start and say hello, and
            ``$ORCH_PREFLIGHT_TIMEOUT_S`` (default 60 s) for their preflight checks.
        owner_url: the API URL of this controller, recorded as the owner of its jobs.
        recover_every_s: if > 0, look for orphaned jobs (see :func:`recover_orphans`) this often;
            ``orch server`` does, so a killed ``orch run`` is noticed.
        prometheus_targets: directory of the Prometheus file_sd files of running attempts
            (default ``$ORCH_PROMETHEUS_TARGETS`` or ``<state dir>/prometheus/targets``).
    """

    def __init__(self, state_dir: str | Path | None = None, *, clock: Callable[[], float] = time.time,
                 provisioner_factory: Callable[[str, JobSpec], Provisioner] = get_provisioner,
                 heartbeat_s: float | None = None, node_timeout_s: float | None = None,
                 agent_lease_s: float | None = None, owner_url: str | None = None,
                 recover_every_s: float = 0.0, prometheus_targets: str | Path | None = None) -> None:
        self.state_dir = Path(state_dir or default_state_dir()).expanduser().resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.state_dir / "orch.db", clock)
        self.provisioner_factory = provisioner_factory
        self.heartbeat_s = heartbeat_s or _env_seconds("ORCH_HEARTBEAT_S", 0.5)
        self.node_timeout_s = node_timeout_s or _env_seconds("ORCH_NODE_TIMEOUT_S", 3.0)
        self.agent_lease_s = agent_lease_s or _env_seconds("ORCH_AGENT_LEASE_S", 15.0)
        self.provision_timeout_s = _env_seconds("ORCH_PROVISION_TIMEOUT_S", 120.0)
        self.preflight_timeout_s = _env_seconds("ORCH_PREFLIGHT_TIMEOUT_S", 60.0)
        proc = psutil.Process()
        self.owner = {"pid": proc.pid, "host": socket.gethostname(), "create_time": proc.create_time(),
                      "url": owner_url}
        self.recover_every_s = recover_every_s
        self.metrics = ControllerMetrics(self.store)
        self.targets = TargetsWriter(Path(prometheus_targets).expanduser() if prometheus_targets
                                     else default_targets_dir(self.state_dir))
        self._runs: dict[str, AttemptRun] = {}
        self._restarts: dict[str, threading.Event] = {}  # job id -> set to call a pending restart off
        self._scanned_lost = False  # looked for FAILED jobs of a dead server (recover())
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch_requests, name="cancel-watcher", daemon=True)
        self._watcher.start()

    # -- queries ------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        """The job (``job_id`` may be a unique prefix). Raises NotFoundError."""
        return self.store.get_job(job_id)

    def active_run(self, job_id: str) -> AttemptRun | None:
        """The attempt this controller is supervising for the job, if any."""
        with self._lock:
            run = self._runs.get(job_id)
        return run if run is not None and not run.done.is_set() else None

    # -- commands -----------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> JobRecord:
        """Plan the job's first attempt and start it.

        Planning happens before anything is stored or started, so a bad hostfile,
        filter or port raises here and leaves no trace.

        Raises:
            OrchError: the job cannot be planned.
        """
        job_id = new_job_id(spec.name)
        plan, lease = prepare_plan(spec, self.state_dir, job_id)
        try:
            provisioner = self.provisioner_factory(spec.provisioner, spec)
            self.store.create_job(job_id, spec.name, spec.to_dict(), owner=self.owner)
        except BaseException:
            lease.release()
            raise
        self._start_attempt(spec, plan, lease, provisioner)
        return self.store.get_job(job_id)

    def resume(self, job_id: str, exclude_hosts: list[str] | None = None, automatic: bool = False,
               fresh: bool = False) -> JobRecord:
        """Start a new attempt of a FAILED or CANCELLED job from its last complete checkpoint.

        When the new attempt has another world size than the one that saved the checkpoint,
        the checkpoint is first converted to DeepSpeed's universal format here, on this
        controller's host (:func:`orchestrator.checkpoints.convert_to_universal`; event
        ``checkpoint_converted``), and the attempt starts from ``<tag>_universal`` with
        ``checkpoint.load_universal`` in its DeepSpeed config and ``ORCH_RESUME_UNIVERSAL=1``.
        Without a complete checkpoint the attempt starts from step 0 only where the job never
        checkpointed (see :meth:`_check_fresh_start`) or ``fresh`` asks for it.

        Args:
            job_id: the job (or a unique prefix of its id).
            exclude_hosts: hostfile hosts to leave out from now on (e.g. a lost node); they
                join the spec's ``exclude_hosts`` and are removed from the hostfile before its
                filters and ``num_nodes``/``num_gpus`` apply, so a spare host can take the
                lost one's place.
            automatic: a restart by the job's restart policy (not by hand).
            fresh: start from step 0 whatever checkpoints there are (``orch resume --fresh``).

        Raises:
            NotFoundError: no such job.
            StateError: the job is not FAILED or CANCELLED, or its last attempt is still stopping.
            CheckpointError: no complete checkpoint where the job had checkpoints, or the
                conversion to the universal format failed.
            OrchError: the new attempt cannot be planned (the job stays as it was).
        """
        self.recover()
        job = self.store.get_job(job_id)
        if not automatic:
            self._call_off_restart(job.id, "resumed by hand")
        if not job.state.is_resumable():
            hint = (f" Cancel it first (orch cancel {job.id}) to resume it from its last checkpoint."
                    if not job.state.is_terminal() else "")
            raise StateError(f"Job {job.id} is {job.state.value}; only FAILED or CANCELLED jobs can be "
                             f"resumed.{hint}")
        run = self._runs.get(job.id)
        if run is not None:
            run.done.wait()
        elif job.attempt and self.store.get_attempt(job.id, job.attempt).stopped_at is None \
                and _owner_alive(job.owner):
            raise StateError(f"Job {job.id}'s attempt {job.attempt} is still stopping; try again shortly.")
        spec = spec_from_dict(job.spec, source=f"job {job.id}")
        if exclude_hosts:
            merged = list(dict.fromkeys([*spec.exclude_hosts, *exclude_hosts]))
            spec = spec.model_copy(update={"exclude_hosts": merged})
        number = job.attempt + 1
        ckpt_dir = checkpoint_dir_of(spec, self.state_dir, job.id)
        info, skipped = (None, []) if fresh else latest_complete(ckpt_dir)
        if info is None and not fresh:
            self._check_fresh_start(job, spec, ckpt_dir, skipped, automatic)
        plan, lease = prepare_plan(spec, self.state_dir, job.id, attempt=number,
                                   resume_tag=info.tag if info else None)
        if info is not None and needs_universal(info, plan.world_size):
            lease.release()  # converting may take minutes; the port is reserved again below
            universal = self._convert(job.id, number, spec, info, plan.world_size)
            with self._lock:
                called_off = automatic and job.id not in self._restarts
            if called_off:  # cancelled (or resumed by hand) while converting: the restart is off
                return self.store.get_job(job.id)
            plan, lease = prepare_plan(spec, self.state_dir, job.id, attempt=number, resume_tag=universal.tag,
                                       resume_universal_from=info.tag)
        try:
            provisioner = self.provisioner_factory(spec.provisioner, spec)
            self.store.set_state(job.id, JobState.PENDING, data={
                "resume_tag": plan.resume_tag, "resume_universal_from": plan.resume_universal_from,
                "fresh": fresh, "exclude_hosts": spec.exclude_hosts, "automatic": automatic,
                "skipped_checkpoints": [{"tag": s.tag, "problems": list(s.problems)} for s in skipped]})
            if exclude_hosts:
                self.store.update_spec(job.id, spec.to_dict())
            self.store.set_owner(job.id, self.owner)
        except BaseException:
            lease.release()
            raise
        self._start_attempt(spec, plan, lease, provisioner)
        return self.store.get_job(job.id)

    def _check_fresh_start(self, job: JobRecord, spec: JobSpec, ckpt_dir: str, skipped: list[CheckpointInfo],
                           automatic: bool) -> None:
        """Allow a resume without a complete checkpoint to start from step 0, or refuse it.

        By hand (``orch resume`` without ``--fresh``) it is refused when the job had
        checkpointing: the spec names a ``checkpoint_dir`` (even an empty or missing one), or the
        checkpoint directory holds anything besides orch's own hidden entries (incomplete tags,
        DeepSpeed's ``latest``), or an earlier attempt started from a checkpoint (the directory
        merely existing says nothing: preflight creates it). An automatic restart starts from
        step 0 unless the job ever finished a save (a tag holds a completion marker, however
        damaged since) or an earlier attempt started from a checkpoint: restarting such a job
        from step 0 would silently throw its training away.

        Raises:
            CheckpointError: refused; names the directory and why each tag in it was skipped.
        """
        resumed = [a.resume_tag for a in self.store.attempts(job.id) if a.resume_tag]
        root = Path(ckpt_dir)
        if automatic:
            if not resumed and not any((Path(s.path) / MARKER).exists() for s in skipped):
                return
        elif not (spec.checkpoint_dir or resumed or skipped or _has_entries(root)):
            return
        if skipped:
            what = "every checkpoint tag in it is incomplete:\n" + "\n".join(
                f"  {s.tag}: {'; '.join(s.problems)}" for s in skipped)
        elif not root.exists():
            what = "the directory does not exist (no checkpoint was saved there)"
        else:
            what = "it holds no checkpoint tag directory"
        earlier = (f"\nEarlier attempts started from {', '.join(dict.fromkeys(resumed))}, which is gone or "
                   "damaged." if resumed else "")
        then = "The automatic restart is not done, since it would start from step 0. " if automatic else ""
        raise CheckpointError(f"Job {job.id} has no complete checkpoint to resume from in {ckpt_dir}: {what}"
                              f"{earlier}\n{then}To start it again from step 0: orch resume {job.id} --fresh")

    def _convert(self, job_id: str, number: int, spec: JobSpec, info: CheckpointInfo,
                 world_size: int) -> UniversalCheckpoint:
        """Convert ``info`` to DeepSpeed's universal format for attempt ``number`` (on this host, with
        the spec's Python and ``env``), and record it as a ``checkpoint_converted`` event.

        Raises:
            CheckpointError: see :func:`orchestrator.checkpoints.convert_to_universal`.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
        universal = convert_to_universal(info, _python(spec), env={**env, **spec.env},
                                         timeout=_env_seconds("ORCH_CONVERT_TIMEOUT_S", 3600.0))
        self.store.add_event(job_id, number, "checkpoint_converted", {
            "from_tag": info.tag, "tag": universal.tag, "step": info.step, "zero_stage": info.zero_stage,
            "from_world_size": info.world_size, "from_dp_world_size": info.dp_world_size,
            "to_world_size": world_size, "seconds": round(universal.seconds, 3), "reused": universal.reused,
            "path": universal.path})
        return universal

    def cancel(self, job_id: str, reason: str = "cancelled by the user") -> JobRecord:
        """Cancel a job: its ranks are stopped within the grace period.

        A job run by another controller is cancelled through the store (that controller
        polls for requests). A FAILED job waiting for an automatic restart keeps its state
        and is not restarted. Cancelling a job that already ended is otherwise a no-op.
        """
        job = self.store.get_job(job_id)
        if job.state.is_terminal():
            if not self._call_off_restart(job.id, reason) and _owner_alive(job.owner) \
                    and job.owner != self.owner:
                self.store.request_cancel(job.id)  # its controller may have a restart pending
            return self.store.get_job(job.id)
        run = self.active_run(job.id)
        if run is not None:
            run.cancel(reason)
        elif _owner_alive(job.owner):
            self.store.request_cancel(job.id)
        else:  # its controller is gone (and with it the agents): sweep, then record
            from agents.ranks import kill_marked
            if job.attempt:
                kill_marked(f"{job.id}.{job.attempt}")
            self.store.set_state(job.id, JobState.CANCELLED,
                                 cause={"kind": "cancelled", "message": "cancelled by the user"})
            if job.attempt:
                self.store.mark_stopped(job.id, job.attempt)
        return self.store.get_job(job.id)

    def wait(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """Wait until the job's current attempt ended, its processes are gone and no automatic
        restart is pending (a restart's attempt is waited for too)."""
        job = self.store.get_job(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy(job.id) and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.1)
        return self.store.get_job(job.id)

    def busy(self, job_id: str) -> bool:
        """Whether this controller runs an attempt of the job or will restart it."""
        with self._lock:
            return job_id in self._restarts or (job_id in self._runs and not self._runs[job_id].done.is_set())

    # -- automatic restarts (the spec's restart policy) ----------------------------------------

    def _attempt_ended(self, run: AttemptRun) -> None:
        """After an attempt stopped: restart the job later if its policy says so."""
        if self._closed.is_set():
            return
        self._apply_restart_policy(run.job_id, run.spec, run.plan.attempt)

    def _apply_restart_policy(self, job_id: str, spec: JobSpec, attempt: int) -> bool:
        """Schedule an automatic restart of a FAILED job whose last attempt is ``attempt``, if
        ``spec.restart`` retries its cause and restarts are left; returns whether it did.

        The decision is recorded as an event: ``restart_scheduled`` (restart number, wait,
        hosts left out), or a ``warning`` when ``max_restarts`` is used up.
        """
        try:
            job = self.store.get_job(job_id)
            policy = spec.restart
            if job.state != JobState.FAILED or policy.max_restarts == 0 or job.attempt != attempt:
                return False
            done = sum(1 for e in self.store.events(job.id) if e.kind == "restart_scheduled")
            cause = job.cause or {}
            if not policy.retries(cause):
                return False
            if done >= policy.max_restarts:
                self.store.add_event(job.id, job.attempt, "warning", {
                    "message": f"no automatic restart: the job was restarted {done} time(s), its max_restarts"})
                return False
            delay = policy.backoff(done)
            exclude = [cause["node"]] if policy.exclude_failed_nodes and cause.get("kind") == "node_lost" \
                and cause.get("node") else []
            self.store.add_event(job.id, job.attempt, "restart_scheduled", {
                "restart": done + 1, "max_restarts": policy.max_restarts, "in_seconds": delay,
                "exclude_hosts": exclude, "cause_kind": cause.get("kind")})
        except OrchError as err:
            self._log_restart_failure(job_id, f"cannot decide on a restart: {err}")
            return False
        called_off = threading.Event()
        with self._lock:
            self._restarts[job.id] = called_off
        self.store.set_owner(job.id, self.owner)  # so that `orch cancel` elsewhere reaches this controller
        threading.Thread(target=self._restart_later, args=(job.id, delay, exclude, called_off),
                         name=f"restart-{job.id}", daemon=True).start()
        return True

    def _restart_later(self, job_id: str, delay: float, exclude: list[str], called_off: threading.Event) -> None:
        try:
            if called_off.wait(delay) or self._closed.is_set():
                return
            try:
                self.resume(job_id, exclude_hosts=exclude, automatic=True)
            except OrchError as err:
                self._log_restart_failure(job_id, str(err))
            except Exception as err:  # noqa: BLE001 - an orch bug: say so, never die silently
                self._log_restart_failure(job_id, f"orch internal error: {err!r}")
        finally:
            with self._lock:
                if self._restarts.get(job_id) is called_off:
                    del self._restarts[job_id]
            try:
                job = self.store.get_job(job_id)
                if job.state.is_terminal() and job.owner == self.owner:
                    self.store.set_owner(job_id, None)  # no restart came of it
            except Exception:  # noqa: BLE001 - the store may be closing
                pass

    def _call_off_restart(self, job_id: str, reason: str) -> bool:
        with self._lock:
            called_off = self._restarts.pop(job_id, None)
        if called_off is None:
            return False
        called_off.set()
        self.store.add_event(job_id, None, "restart_called_off", {"reason": reason})
        return True

    def _log_restart_failure(self, job_id: str, message: str) -> None:
        try:
            self.store.add_event(job_id, None, "restart_failed", {"message": message})
            self.store.add_event(job_id, None, "warning", {"message": f"automatic restart failed: {message}"})
        except Exception:  # noqa: BLE001 - the store may be closing
            pass

    def recover(self) -> list[str]:
        """Fail the jobs whose controller died while they ran (see :func:`recover_orphans`).

        An ``orch server`` (a controller with an ``owner_url``) then applies each such job's
        restart policy, as for any failed attempt (cause ``controller_lost``), when an orch
        server was running it: so a killed server's jobs continue from their last complete
        checkpoint once a server runs again. A killed ``orch run``'s job stays FAILED for
        ``orch resume``: nobody watches it any more. Returns the ids failed now.
        """
        recovered = recover_orphans(self.store)
        if self.owner.get("url") and not self._closed.is_set():
            for job_id in self._controller_lost_jobs(recovered):
                try:
                    job = self.store.get_job(job_id)
                    self._apply_restart_policy(job.id, spec_from_dict(job.spec, source=f"job {job.id}"),
                                               job.attempt)
                except OrchError as err:
                    self._log_restart_failure(job_id, f"cannot decide on a restart: {err}")
        return recovered

    def _controller_lost_jobs(self, recovered: list[str]) -> list[str]:
        """Jobs whose restart policy this server is to apply: the ones just recovered, and (once,
        at the server's start) FAILED ones whose server died and whose restart nobody decided yet
        (another command may have noticed the death first)."""
        ids = list(recovered)
        if not self._scanned_lost:
            self._scanned_lost = True
            for job in self.store.list_jobs(limit=10_000):
                cause = job.cause or {}
                if job.state != JobState.FAILED or cause.get("kind") != "controller_lost" or job.id in ids \
                        or job.owner or job.id in self._restarts:
                    continue
                later = [e.kind for e in self.store.events(job.id) if e.attempt == job.attempt]
                if "restart_scheduled" not in later and "restart_failed" not in later:
                    ids.append(job.id)
        return [j for j in ids if (self.store.get_job(j).cause or {}).get("server")]

    def close(self, cancel: bool = True, timeout: float = 60.0,
              reason: str = "cancelled: the controller running it shut down") -> None:
        """Stop serving: cancel (or leave) every attempt this controller runs, wait for them."""
        self._closed.set()
        with self._lock:
            runs = list(self._runs.values())
            pending = list(self._restarts)
        for job_id in pending:
            self._call_off_restart(job_id, "the controller shut down")
        for run in runs:
            if cancel and not run.done.is_set():
                run.cancel(reason)
        for run in runs:
            run.done.wait(timeout)
        self.store.close()

    # -- internals ----------------------------------------------------------------------------

    def _start_attempt(self, spec: JobSpec, plan: JobPlan, lease: PortLease, provisioner: Provisioner) -> None:
        os.makedirs(os.path.join(plan.run_dir, "logs"), exist_ok=True)
        if spec.deepspeed_config is not None or plan.deepspeed_config:  # or built from an Accelerate config
            with open(plan.deepspeed_config_path, "w") as f:
                json.dump(plan.deepspeed_config, f, indent=2)
        with open(os.path.join(plan.run_dir, "plan.json"), "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
        self.store.add_attempt(plan.job_id, plan.attempt, plan.to_dict(), plan.resume_tag)
        self.metrics.attempt_started(plan.attempt)
        run = AttemptRun(self, spec, plan, lease, provisioner)
        with self._lock:
            self._runs[plan.job_id] = run
        run.start()

    def _watch_requests(self) -> None:
        last_recover = time.monotonic()
        while not self._closed.wait(0.25):
            if self.recover_every_s and time.monotonic() - last_recover > self.recover_every_s:
                last_recover = time.monotonic()
                try:
                    self.recover()
                except Exception:  # noqa: BLE001 - the store may be closing
                    pass
            with self._lock:
                runs = [r for r in self._runs.values() if not r.done.is_set()]
            for run in runs:
                try:
                    if self.store.get_job(run.job_id).cancel_requested:
                        run.cancel()
                except (OrchError, Exception):  # noqa: BLE001 - store closed at shutdown
                    continue
            with self._lock:
                pending = list(self._restarts)
            for job_id in pending:
                try:
                    if self.store.get_job(job_id).cancel_requested:
                        self._call_off_restart(job_id, "cancelled by the user")
                except (OrchError, Exception):  # noqa: BLE001 - store closed at shutdown
                    continue


def recover_orphans(store: Store) -> list[str]:
    """Fail every job whose controller died while it ran; return their ids.

    A job is orphaned when it is not terminal and the controller recorded as its owner is
    no longer running on this host. Its local agents stopped their ranks when their link
    to that controller closed (or when its lease ran out); any process still marked with
    the attempt's id is killed here. The job becomes FAILED with cause ``controller_lost``,
    so ``orch resume`` can continue it. Called by ``orch server`` at start and every few
    seconds, and by CLI commands that work on the state directory without a server.
    """
    from agents.ranks import kill_marked
    recovered = []
    for job in store.active_jobs():
        if _owner_alive(job.owner):
            continue
        if job.attempt:
            kill_marked(f"{job.id}.{job.attempt}")
        server = (job.owner or {}).get("url")
        cause = {"kind": "controller_lost", "server": server,
                 "message": f"the controller running this job ({'orch server at ' + server if server else 'orch run'}) "
                 "went away; its agents stopped the ranks. Continue from the last checkpoint with: "
                 f"orch resume {job.id}" + (" (an orch server restarts it if its restart policy says so)"
                                            if server else "")}
        try:
            store.set_state(job.id, JobState.FAILED, cause=cause)
        except StateError:  # someone else recorded an end meanwhile
            continue
        if job.attempt:
            store.mark_stopped(job.id, job.attempt)
        store.set_owner(job.id, None)
        recovered.append(job.id)
    return recovered


#: Node states after which an agent is no longer expected to say anything.
_ENDED = ("done", "stopped", "gone", "lost")


def _detail(text: str) -> str:
    """``": <text>"`` for a non-empty diagnostic, else ``""``."""
    text = " ".join(text.split())
    return f": {text[-500:]}" if text else ""


def _env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment, else ``default``."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def _has_entries(directory: Path) -> bool:
    """Whether a directory holds anything but hidden entries (orch's own, e.g. preflight's)."""
    try:
        return any(not e.name.startswith(".") for e in directory.iterdir())
    except OSError:
        return False


def _owner_alive(owner: dict[str, Any] | None) -> bool:
    """True if the controller recorded as ``owner`` still runs (or runs on another host, which
    cannot be checked from here)."""
    if not owner:
        return False
    if owner.get("host") != socket.gethostname():
        return True
    try:
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner.get("create_time", proc.create_time()))) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError):
        return False


