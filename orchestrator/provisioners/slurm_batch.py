"""From a login node: the Slurm allocation each attempt asks for (``sbatch``), waited for while Slurm queues it.

Outside an allocation (no ``SLURM_JOB_ID``) the slurm provisioner first asks Slurm for one::

    sbatch --parsable --job-name=orch-<job id>-<attempt> --nodes=<n> --ntasks-per-node=<slots>
           [--nodelist=<hostfile's hosts, filtered>] [--exclude=<lost nodes>] --chdir=/tmp
           --output=<run dir>/slurm-%j.out <slurm.sbatch_args>      (the script on stdin)

The script only holds the allocation: orch then starts every node's agent into it as a step from this
machine (``srun --jobid=<id> --overlap``, as inside an allocation), so the agents' link is srun's own.
The script ends by itself once no ``orch-agent-*`` step of its job has run for ``IDLE_S`` seconds
(``$ORCH_SLURM_IDLE_S``), so a controller that went away leaves no allocation behind; orch ``scancel``\\ s it when the attempt
ends, and when the job is cancelled while Slurm still queues it. While Slurm queues the request
``squeue`` says why (``Resources``, ``Priority``, ...): each new reason is an ``allocation`` event.
Each attempt gets its own allocation, so a restart after a node loss asks again, without the lost
node, and Slurm picks healthy ones.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Callable, Mapping, Sequence

from ..errors import ProvisionError
from ..launchers.slurm import compress_hostlist

__all__ = ["BatchAllocation", "batch_argv", "slurm_command", "hold_script", "IDLE_S", "sbatch_on_path"]

_TIMEOUT_S = 30.0
_POLL_S = 1.0
#: seconds without an agent step after which the batch script ends (``$ORCH_SLURM_IDLE_S`` overrides)
IDLE_S = 120

def hold_script(idle_s: int = IDLE_S) -> str:
    """The batch script: holds the allocation while any orch agent step of it runs (module docstring).
    It says what it sees in the job's output file (``slurm-<job>.out`` in the attempt's run directory):
    agent steps running, none (and when it ends), a squeue that failed and why."""
    return f"""#!/bin/sh
# orch: holds this allocation for the steps of its agents (srun --jobid=$SLURM_JOB_ID --overlap);
# it ends once squeue has shown none of them for {idle_s} s. A squeue that fails (slurmctld busy) is no
# evidence either way: only {10 * idle_s} s without an answer end it.
last=$(date +%s); seen=$last; said=""
while [ $((seen - last)) -lt {idle_s} ] && [ $(($(date +%s) - seen)) -lt {10 * idle_s} ]; do
  sleep 2
  if steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o %j 2>&1); then
    seen=$(date +%s)
    if printf '%s\n' "$steps" | grep -q '^orch-agent-'; then
      last=$seen; [ "$said" = run ] || echo "orch: $(date +%T) agent steps running"; said=run
    else
      [ "$said" = idle ] || echo "orch: $(date +%T) no agent step: the allocation ends in {idle_s} s unless one starts"
      said=idle
    fi
  else
    [ "$said" = blind ] || echo "orch: $(date +%T) squeue failed: $steps"; said=blind
  fi
done
echo "orch: $(date +%T) ending the allocation"
"""


#: squeue reasons that waiting alone may not cure (Slurm's "Job Reason Codes"), and what they mean
_STUCK = {
    "PartitionNodeLimit": "more nodes than the partition allows or has up",
    "PartitionTimeLimit": "a longer --time than the partition allows",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "BadConstraints": "the constraints (--constraint, --gpus-per-node, ...) cannot be met",
    "ReqNodeNotAvail": "a node the request needs is not available (down, drained or reserved)",
    "JobHeldUser": "the job is held (--hold): scontrol release <job> lets it run",
    "JobHeldAdmin": "an administrator holds the job",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
    "AssocMaxNodesPerJobLimit": "more nodes than the account may use per job",
    "QOSMaxNodePerJobLimit": "more nodes than the QOS allows per job",
}

#: squeue states in which the allocation is still coming (anything else but RUNNING: it ended).
_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED"}


def slurm_command(argv: list[str], env: Mapping[str, str], stdin: str | None = None,
                  timeout: float = _TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one of Slurm's client commands (``timeout`` seconds at most, ``_TIMEOUT_S`` by default); its result,
    whatever its exit status.

    Raises:
        ProvisionError: the command is not on PATH, or did not answer in time.
    """
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout, env=dict(env))
    except FileNotFoundError:
        raise ProvisionError(f"provisioner slurm: {argv[0]} is not on PATH (Slurm's client commands are needed "
                             "on the machine orch runs on)") from None
    except subprocess.TimeoutExpired:
        raise ProvisionError(f"provisioner slurm: {' '.join(argv)} did not answer within {timeout:g} s "
                             "(is slurmctld reachable?)") from None


def batch_argv(name: str, nodes: int, slots: int, output: str, hosts: Sequence[str] | None = None,
               exclude: Sequence[str] = (), sbatch_args: Sequence[str] = ()) -> list[str]:
    """The sbatch command line asking for one attempt's allocation (the module docstring's).

    Args:
        name: the Slurm job name (``orch-<job id>-<attempt>``).
        nodes: how many nodes (``--nodes``).
        slots: ranks per node (``--ntasks-per-node``).
        output: the batch script's output file (``%j``: the Slurm job id); the user's ``--output``
            in ``sbatch_args`` wins.
        hosts: exactly these nodes (``--nodelist``), from a hostfile; None: any Slurm picks.
        exclude: nodes not to use (``--exclude``): lost ones.
        sbatch_args: the spec's ``slurm.sbatch_args`` (partition, time, GPUs, account).
    """
    argv = ["sbatch", "--parsable", f"--job-name={name}", f"--nodes={nodes}", f"--ntasks-per-node={slots}"]
    if hosts:
        argv.append(f"--nodelist={compress_hostlist(list(hosts))}")
    if exclude:
        argv.append(f"--exclude={','.join(exclude)}")
    argv.append("--chdir=/tmp")  # the holder needs no directory; the controller's may not exist on the nodes
    if not any(a.split("=", 1)[0] in ("-o", "--output") or (a.startswith("-o") and len(a) > 2) for a in sbatch_args):
        argv.append(f"--output={output}")
    return argv + list(sbatch_args)


def _gpus_per_node(sbatch_args: Sequence[str]) -> int | None:
    """The GPUs per node ``--gpus-per-node=[type:]N`` (or ``--gres=gpu[:type]:N``) asks for, if any."""
    args = list(sbatch_args)
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag in ("--gpus-per-node", "--gres") and not value and i + 1 < len(args):
            value = args[i + 1]
        if flag == "--gpus-per-node":
            m = re.fullmatch(r"(?:[\w-]+:)?(\d+)", value)
        elif flag == "--gres":
            m = re.fullmatch(r"gpu(?::[\w-]+)?:(\d+)", value.split(",")[0])
        else:
            continue
        if m:
            return int(m.group(1))
    return None


class BatchAllocation:
    """One attempt's allocation, asked for with sbatch and waited for (the module docstring).

    Args:
        argv: the sbatch command (:func:`batch_argv`).
        env: the environment Slurm's commands run with (``SLURM_CONF``, ...).
        note: called with ``(kind, data)`` for each thing worth an event (``allocation``).
        gpus_per_node: what the request asks for (slots then count GPUs: ``SLURM_GPUS_PER_NODE``).
    """

    def __init__(self, argv: list[str], env: Mapping[str, str], note: Callable[[str, dict], None],
                 gpus_per_node: int | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.note = note
        self.gpus_per_node = gpus_per_node if gpus_per_node is not None else _gpus_per_node(argv)
        self.slots = int(next(a for a in argv if a.startswith("--ntasks-per-node=")).split("=", 1)[1])
        self.job_id: str | None = None

    def _run(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return slurm_command(argv, self.env, stdin)

    def submit(self) -> str:
        """Run sbatch; the Slurm job id.

        Raises:
            ProvisionError: sbatch refused the request (its own words: a bad partition, too many nodes).
        """
        idle = self.env.get("ORCH_SLURM_IDLE_S", "")
        r = self._run(self.argv, hold_script(int(idle) if idle.isdigit() and int(idle) > 0 else IDLE_S))
        job = r.stdout.strip().split(";")[0]
        if r.returncode != 0 or not job.isdigit():
            raise ProvisionError(f"provisioner slurm: sbatch refused the allocation: "
                                 f"{r.stderr.strip() or r.stdout.strip() or r.returncode} (command: {' '.join(self.argv)})")
        self.job_id = job
        shown = [a for a in self.argv[2:] if not a.startswith(("--chdir=", "--output="))]
        self.note("allocation", {"slurm_job": job, "state": "SUBMITTED", "command": self.argv,
                                 "message": f"asked Slurm for the allocation: job {job} (sbatch {' '.join(shown)})"})
        return job

    def wait_granted(self, timeout: float, cancelled: threading.Event) -> "collections.OrderedDict[str, int] | None":
        """Wait until Slurm runs the job; its environment as inside it (``SLURM_JOB_ID``,
        ``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``, ``SLURM_GPUS_PER_NODE``), or None once
        ``cancelled`` is set (the request is then cancelled).

        Raises:
            ProvisionError: the job ended without running (its output file names why), or it was
                still queued after ``timeout`` seconds (then it is cancelled).
        """
        assert self.job_id is not None, "submit() first"
        t0, last_reason, last_state = time.monotonic(), None, "PENDING"
        while True:
            if cancelled.wait(_POLL_S):
                self.cancel()
                return None
            r = self._run(["squeue", "-h", "-j", self.job_id, "-o", "%T|%r|%N"])
            if r.returncode != 0 and "invalid job id" not in r.stderr.lower():
                state, reason, nodelist = last_state, f"squeue failed: {r.stderr.strip()}", ""  # slurmctld busy: ask again
            else:
                first = (r.stdout.strip().splitlines() or [""])[0]  # one line: orch asks for no array
                state, reason, nodelist = (first.split("|") + ["", "", ""])[:3]
            last_state = state or last_state
            if state == "RUNNING" and nodelist:
                waited = time.monotonic() - t0
                self.note("allocation", {"slurm_job": self.job_id, "state": "RUNNING", "nodelist": nodelist,
                                         "waited_s": round(waited, 3),
                                         "message": f"Slurm job {self.job_id} granted {nodelist} after {waited:.1f} s"})
                return self._env(nodelist)
            if state not in _WAITING:
                self.cancel()
                raise ProvisionError(f"provisioner slurm: Slurm job {self.job_id} ended before its nodes were granted"
                                     f"{' (' + state + ')' if state else ''}; its output, if any, is in the file "
                                     "sbatch's --output names")
            if reason != last_reason:
                last_reason = reason
                said = f" ({reason})" if reason and reason != "None" else ""
                hint = _STUCK.get(reason)
                self.note("allocation", {"slurm_job": self.job_id, "state": state, "reason": reason,
                                         "message": f"Slurm job {self.job_id} {state}{said}"
                                                    + (f": {hint}; it may never start as asked (orch cancel, or it "
                                                       f"fails after slurm.queue_timeout)" if hint else "")})
            if time.monotonic() - t0 > timeout:
                self.cancel()
                hint = _STUCK.get(reason, "the cluster is busy, or the request is more than it can give")
                raise ProvisionError(f"provisioner slurm: Slurm job {self.job_id} was still {state} ({reason}: {hint}) "
                                     f"after slurm.queue_timeout = {timeout:.0f} s; it is cancelled. Change the "
                                     "request (num_nodes, num_gpus, slurm.sbatch_args) or raise slurm.queue_timeout.")

    def _env(self, nodelist: str) -> "collections.OrderedDict[str, str]":
        hosts = self._run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        env = collections.OrderedDict(SLURM_JOB_ID=self.job_id, SLURM_JOB_NODELIST=nodelist,
                                      SLURM_TASKS_PER_NODE=f"{self.slots}(x{max(len(hosts), 1)})")
        if self.gpus_per_node:
            env["SLURM_GPUS_PER_NODE"] = str(self.gpus_per_node)
        return env

    def cancel(self) -> None:
        """``scancel`` the job (queued or running); nothing if it was never submitted or already ended."""
        if self.job_id is None:
            return
        try:
            self._run(["scancel", self.job_id])
        except ProvisionError:
            return


def sbatch_on_path(env: Mapping[str, str]) -> None:
    """Raises ProvisionError when sbatch cannot be found (before anything is stored)."""
    if shutil.which("sbatch", path=env.get("PATH", os.defpath)) is None:
        raise ProvisionError("provisioner slurm: outside an allocation orch asks Slurm for one with sbatch, which is "
                             "not on PATH here; run orch on a login node with Slurm's client commands, or inside "
                             "salloc/sbatch.")
