"""The slurm provisioner: inside a Slurm allocation, every node's agent is an ``srun`` step on it.

``orch run``/``orch server`` runs where ``salloc`` or an ``sbatch`` script put it (``SLURM_JOB_ID``
set). The pool, when the spec names no hostfile, is the allocation: ``SLURM_JOB_NODELIST``
expanded by ``scontrol show hostnames`` (the real tool), each node's slots its GPUs
(``SLURM_GPUS_PER_NODE``) or else its tasks (``SLURM_TASKS_PER_NODE``); a hostfile and the
include/exclude filters apply on top, and every host left must belong to the allocation.

Each node's agent is one step of that job::

    srun --jobid=<job> --nodes=1 --ntasks=1 --nodelist=<host> --overlap --export=ALL --unbuffered
         --job-name=orch-agent-<attempt>-<node rank> --chdir=<workdir> <slurm.srun_args>
         <python> -u -m agents.agent

whose stdin/stdout srun carries, so the controller talks to it as to a local agent (one step per
agent: srun gives each step one stdin). ``--overlap`` lets the ranks' own step (``launcher: slurm``
native) share the CPUs and GPUs the agents' steps hold. A node Slurm takes away (``scontrol update
state=DOWN``, a failed node) kills its agent's step: the link closes and the attempt fails with
``node_lost``, as with any provisioner. Preemption (``SIGTERM`` to the steps) makes every agent stop
its ranks and say Slurm took its node: a node loss too.

From a login node (no ``SLURM_JOB_ID``), each attempt first asks Slurm for its allocation
(:mod:`.slurm_batch`: ``sbatch``, PENDING while queued); the agents are then steps of that job,
started from here as above, and the allocation is cancelled when the attempt ends.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import collections
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping

from agents.ranks import kill_marked, user_umask_env

from ..errors import ProvisionError
from ..launchers.slurm import parse_tasks_per_node
from ..planning import JobPlan, NodePlan, ResourcePool
from .base import AgentHandle, Provisioner
from .local import LocalAgent
from .slurm_batch import BatchAllocation, batch_argv, sbatch_on_path, slurm_command

__all__ = ["SlurmProvisioner", "allocation_nodes"]


def _run(argv: list[str], env: Mapping[str, str]) -> str:
    r = slurm_command(argv, env)
    if r.returncode != 0:
        raise ProvisionError(f"provisioner slurm: {' '.join(argv)} failed: {r.stderr.strip() or r.returncode}")
    return r.stdout


def allocation_nodes(env: Mapping[str, str]) -> "collections.OrderedDict[str, int]":
    """The allocation's nodes and their slots, in Slurm's order.

    Slots: ``SLURM_GPUS_PER_NODE`` (``4`` or ``gpu:4``, every node) when the job asked for GPUs,
    else ``SLURM_TASKS_PER_NODE`` (``2(x3),1``), else 1 per node.

    Raises:
        ProvisionError: not inside an allocation, a node list scontrol cannot expand, or Slurm's variables do not
            fit each other.
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    missing = [name for name, value in (("SLURM_JOB_ID", env.get("SLURM_JOB_ID")), ("SLURM_JOB_NODELIST", nodelist))
               if not value]
    if missing:
        raise ProvisionError(f"provisioner slurm: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                             "not set here, so the nodes are known only once Slurm grants the allocation orch asks for "
                             "when the job is submitted (sbatch). To see the plan, run it inside one: "
                             "`salloc -N <nodes> orch plan job.yaml`, or give a hostfile.")
    expanded = slurm_command(["scontrol", "show", "hostnames", nodelist], env)
    hosts = expanded.stdout.split()
    if expanded.returncode != 0 or not hosts:  # (scontrol says "Invalid hostlist" on stderr and exits 0)
        said = "; ".join(line.strip() for line in expanded.stderr.splitlines() if line.strip())
        raise ProvisionError(f"provisioner slurm: SLURM_JOB_NODELIST {nodelist} names no host that `scontrol show "
                             f"hostnames` can expand: {said or f'exit {expanded.returncode}'}")
    gpus = env.get("SLURM_GPUS_PER_NODE", "").rsplit(":", 1)[-1]
    if gpus.isdigit() and int(gpus) > 0:
        counts = [int(gpus)] * len(hosts)
    elif env.get("SLURM_TASKS_PER_NODE"):
        try:
            counts = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        except ValueError as err:
            raise ProvisionError(f"provisioner slurm: SLURM_TASKS_PER_NODE: {err}") from None
    else:
        counts = [1] * len(hosts)
    if len(counts) != len(hosts):
        raise ProvisionError(f"provisioner slurm: SLURM_TASKS_PER_NODE gives {len(counts)} node(s) but "
                             f"SLURM_JOB_NODELIST {nodelist} has {len(hosts)}")
    return collections.OrderedDict(zip(hosts, counts))


class SlurmProvisioner(Provisioner):
    """Agents as ``srun`` steps of the allocation orch runs in (module docstring).

    Args:
        srun_args: the spec's ``slurm.srun_args``.
        python: the agents' interpreter (the spec's ``python``, else this one).
        env: the environment to read the allocation from and to run srun with (default: os.environ).
    """

    name = "slurm"
    max_parallel = 32

    def __init__(self, srun_args: tuple[str, ...] = (), python: str | None = None,
                 env: Mapping[str, str] | None = None, sbatch_args: tuple[str, ...] = (),
                 queue_timeout: float = 86400.0, allocation: BatchAllocation | None = None) -> None:
        self.srun_args = tuple(srun_args)
        self.python = python or sys.executable
        self.env = dict(os.environ if env is None else env)
        self.sbatch_args = tuple(sbatch_args)
        self.queue_timeout = queue_timeout
        self.allocation = allocation
        self.granted = allocation is not None
        self._nodes: collections.OrderedDict[str, int] | None = None

    def needs_allocation(self) -> bool:
        """Outside an allocation (no ``SLURM_JOB_ID``): each attempt asks for one first (:meth:`allocate`)."""
        return not self.env.get("SLURM_JOB_ID")

    def check_allocation_request(self) -> None:
        """Before a job is stored: sbatch must be here. Raises ProvisionError."""
        sbatch_on_path(self.env)

    def allocate(self, name: str, nodes: int, slots: int, output: str, hosts: list[str] | None,
                 exclude: list[str], note: Callable[[str, dict], None],
                 cancelled: threading.Event) -> SlurmProvisioner | None:
        """Ask Slurm for an allocation and wait for it (:class:`.slurm_batch.BatchAllocation`); a provisioner
        inside it, whose :meth:`close` cancels it, or None if ``cancelled`` was set meanwhile.

        Args:
            name: the Slurm job name; nodes, slots: ``--nodes``, ``--ntasks-per-node``; output: the batch
                output file; hosts: a hostfile's hosts (``--nodelist``) or None; exclude: lost nodes.
            note: ``(kind, data)`` for the job's events.

        Raises:
            ProvisionError: sbatch refused, the job ended unrun, or ``slurm.queue_timeout`` passed.
        """
        argv = batch_argv(name, nodes, slots, output, hosts, exclude, self.sbatch_args)
        alloc = BatchAllocation(argv, self.env, note)
        alloc.submit()
        granted = alloc.wait_granted(self.queue_timeout, cancelled)
        if granted is None:
            return None
        return SlurmProvisioner(self.srun_args, self.python, {**self.env, **granted}, allocation=alloc)

    def close(self) -> None:
        """Cancel the allocation orch asked for (from a login node); nothing inside the user's own."""
        if self.allocation is not None:
            self.allocation.cancel()

    def nodes(self) -> "collections.OrderedDict[str, int]":
        """The allocation's nodes (read once)."""
        if self._nodes is None:
            self._nodes = allocation_nodes(self.env)
        return self._nodes

    def discover(self) -> "collections.OrderedDict[str, int]":
        """The allocation, as the pool when the spec names no hostfile."""
        return collections.OrderedDict(self.nodes())

    def check(self, pool: ResourcePool) -> None:
        """Every host of the pool must belong to the allocation.

        Raises:
            ProvisionError: naming the hosts outside it.
        """
        if self.needs_allocation():
            return  # the hostfile is the request: sbatch --nodelist refuses a host Slurm does not have
        outside = [h for h in pool.hosts if h not in self.nodes()]
        if outside:
            raise ProvisionError(f"provisioner slurm: host(s) {', '.join(outside)} are not in allocation "
                                 f"{self.env.get('SLURM_JOB_ID')} (its nodes: {', '.join(self.nodes())})")

    def master_addr(self, host: str) -> str:
        """Node 0's address as this machine resolves it."""
        try:
            return socket.gethostbyname(host)
        except OSError:
            return host

    def start_agent(self, node: NodePlan, plan: JobPlan,
                    events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        """Start ``node``'s agent as a step on its host.

        Raises:
            ProvisionError: srun cannot be started.
        """
        log_dir = os.path.join(plan.run_dir, "agents")
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"node-{node.node_rank}.log")
        env = {k: v for k, v in self.env.items() if not k.startswith("ORCH_")}
        env["ORCH_AGENT_ATTEMPT_ID"] = plan.attempt_id
        env["ORCH_AGENT_NODE_RANK"] = str(node.node_rank)
        env.update(user_umask_env())  # ranks get the user's umask; the agent's own files stay private
        env["ORCH_AGENT_SLURM_STEP"] = "1"  # the agent drops its step's own SLURM_* for the ranks
        env["SLURM_OVERLAP"] = "1"  # srun's --overlap for every step started from the nodes (native srun)
        argv = ["srun", f"--jobid={self.env['SLURM_JOB_ID']}", "--nodes=1", "--ntasks=1", f"--nodelist={node.host}",
                "--overlap", "--export=ALL", "--unbuffered", f"--job-name={self.step_name(plan, node.node_rank)}",
                f"--chdir={node.workdir}", *self.srun_args, self.python, "-u", "-m", "agents.agent"]
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                        start_new_session=True)
        except OSError as err:
            raise ProvisionError(f"Cannot start the agent's srun step on {node.host} (node {node.node_rank}): "
                                 f"{err.strerror or err}.", reason=f"cannot run srun: {err.strerror or err}") from err
        return _StepAgent(node, proc, events, log_path)

    #: ``scontrol show node``'s state words of a node out of service (its base state, or one of its ``+`` flags).
    OUT_OF_SERVICE = frozenset({"DOWN", "DRAIN", "FAIL", "FUTURE"})
    #: Seconds :meth:`unavailable` waits for scontrol: it is asked from the attempt's message loop, which must
    #: not stall for slurm_command's usual 30 s when slurmctld is away (the reporting node is named then).
    UNAVAILABLE_TIMEOUT_S = 5.0

    def unavailable(self, hosts: Sequence[str]) -> list[str]:
        """Those of ``hosts`` that Slurm has down, drained, draining or failing, in the order given: when Slurm
        takes one node away it ends the whole allocation, so every agent's step gets SIGTERM, and this names the
        node that caused it; a host Slurm does not know is not named. [] when slurmctld does not answer within
        ``UNAVAILABLE_TIMEOUT_S`` (an error answer is asked again until then; the first step to report is then
        named).

        ``scontrol show node``, not ``sinfo``: sinfo's allocated-CPU view, asked while an allocation's steps
        end, was seen to stay "mixed" for minutes after the allocation was gone (Slurm 22.05)."""
        if not hosts:
            return []
        deadline = time.monotonic() + self.UNAVAILABLE_TIMEOUT_S
        while True:  # an answer that is an error (slurmctld busy ending the allocation's steps) is asked again
            try:
                r = slurm_command(["scontrol", "show", "node", "--oneliner", ",".join(hosts)], self.env,
                                  timeout=max(0.1, deadline - time.monotonic()))
            except ProvisionError:
                return []
            # "Node X not found" (exit 1, on stdout after the nodes it knows): an answer, asking again changes nothing
            if r.returncode == 0 or "not found" in r.stdout + r.stderr:
                break
            if time.monotonic() + 0.2 >= deadline:
                return []
            time.sleep(0.2)
        out = set()
        for line in r.stdout.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if self.OUT_OF_SERVICE & set(fields.get("State", "").split("+")):
                out.add(fields.get("NodeName"))
        return [h for h in hosts if h in out]

    @staticmethod
    def step_name(plan: JobPlan, node_rank: int) -> str:
        """The agent step's name (``squeue -s`` shows it)."""
        return f"orch-agent-{plan.attempt_id}-{node_rank}"

    def sweep(self, plan: JobPlan, spare: Collection[int] = ()) -> list[int]:
        """Cancel the attempt's agent steps still known to Slurm, and kill marked processes here."""
        try:
            out = _run(["squeue", "-h", "-s", "-j", self.env["SLURM_JOB_ID"], "-o", "%i %j"], self.env)
        except ProvisionError:
            out = ""
        rows = [line.split() for line in out.splitlines()]
        steps = [row[0] for row in rows if len(row) == 2 and row[1].startswith(f"orch-agent-{plan.attempt_id}-")]
        if steps:
            try:
                slurm_command(["scancel", *steps], self.env)
            except ProvisionError:  # slurmctld away: the steps end with their agents' links anyway
                pass
        return kill_marked(plan.attempt_id) + kill_marked(plan.attempt_id, key="ORCH_AGENT_ATTEMPT_ID")


class _StepAgent(LocalAgent):
    """An agent whose process here is its srun: SIGTERM first (srun forwards it and ends the step)."""

    def kill(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            if self.wait(3.0):
                return
