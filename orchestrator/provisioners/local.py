"""The local provisioner: every node's agent is a subprocess on this machine.

This is the embedded default, and how the tests run multinode jobs on one machine: each
"node" of the hostfile gets its own agent process (its own session), which starts that
node's ranks. The link is the agent's stdin/stdout pipes; the agent's stderr goes to
``<run_dir>/agents/node-<node rank>.log``. The agent's environment is the controller's,
which is the node environment every rank's env is laid over. A new controller takes over a
running agent through its socket (:class:`AttachedLocalAgent`, ``agents.attach``).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
from collections.abc import Collection
from typing import Any

import psutil

from agents.attach import open_link, socket_streams
from agents.link import MessageReader, MessageWriter
from agents.linkhub import shared_hub
from agents.ranks import user_umask_env
from agents.sweep import sweep_attempt

from ..errors import ProvisionError
from ..planning import JobPlan, NodePlan
from .base import AgentHandle, Provisioner

__all__ = ["LocalProvisioner", "LocalAgent"]


class LocalAgent(AgentHandle):
    """A local agent subprocess and its pipes."""

    def __init__(self, node: NodePlan, proc: subprocess.Popen[bytes],
                 events: "queue.Queue[tuple[int, dict]]", log_path: str) -> None:
        self.log_path = log_path
        self.node_rank = node.node_rank
        self.host = node.host
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._writer = MessageWriter(proc.stdin)
        self._reader = MessageReader(proc.stdout, name=f"agent-{node.node_rank}", sink=events,
                                     tag=node.node_rank, hub=shared_hub())

    def send(self, msg: dict[str, Any]) -> bool:
        return self._writer.send(msg)

    def close(self) -> None:
        self._writer.close()

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def diagnostics(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 2000))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.wait(5.0)


class AttachedLocalAgent(AgentHandle):
    """A local agent another controller started, linked through its socket (``agents.attach``)."""

    def __init__(self, node: NodePlan, attempt_id: str, events: "queue.Queue[tuple[int, dict]]") -> None:
        self.node_rank = node.node_rank
        self.host = node.host
        self.attempt_id = attempt_id
        try:
            self._sock = open_link(attempt_id, node.node_rank)
        except OSError as err:
            raise ProvisionError(f"cannot re-attach to the agent of node {node.node_rank} ({node.host}): "
                                 f"{err.strerror or err} (it ended, or its window passed)",
                                 reason=f"cannot re-attach: {err.strerror or err}") from err
        reader, writer = socket_streams(self._sock)
        self._writer = MessageWriter(writer)
        self._reader = MessageReader(reader, name=f"agent-{node.node_rank}", sink=events, tag=node.node_rank,
                                     hub=shared_hub())
        self.pid: int | None = None  # the agent's, once it said ``attached``

    def send(self, msg: dict[str, Any]) -> bool:
        return self._writer.send(msg)

    def close(self) -> None:
        self._writer.close()

    def wait(self, timeout: float) -> bool:
        if self.pid is None:
            return self._writer.closed
        try:
            psutil.Process(self.pid).wait(timeout)
            return True
        except psutil.NoSuchProcess:
            return True
        except psutil.TimeoutExpired:
            return False

    def kill(self) -> None:
        sweep_attempt(self.attempt_id, [self.node_rank], node_rank=self.node_rank)


class LocalProvisioner(Provisioner):
    """Starts ``python -m agents.agent`` per node, in its own session, with the controller's env."""

    name = "local"
    reattaches = True
    warm_capable = True  # its agents' handles hold their own pipes: any instance can supervise them

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable

    def start_agent(self, node: NodePlan, plan: JobPlan,
                    events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        log_dir = os.path.join(plan.run_dir, "agents")
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, f"node-{node.node_rank}.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
        env["ORCH_AGENT_ATTEMPT_ID"] = plan.attempt_id  # marks the agent; not passed to ranks
        env["ORCH_AGENT_NODE_RANK"] = str(node.node_rank)
        env.update(user_umask_env())  # ranks get the user's umask; the agent's own files stay private
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen([self.python, "-u", "-m", "agents.agent"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log, env=env,
                                        cwd=node.workdir if os.path.isdir(node.workdir) else "/",  # preflight names it
                                        start_new_session=True)
        except OSError as err:
            raise ProvisionError(f"Cannot start the agent for node {node.node_rank} ({node.host}): "
                                 f"{err.strerror or err}.", reason=f"cannot start the agent: {err.strerror or err}") \
                from err
        return LocalAgent(node, proc, events, log_path)

    def warm_key(self, host: str) -> tuple | None:
        """The interpreter (every local agent has the controller's environment)."""
        return ("local", self.python)

    def attach_agent(self, node: NodePlan, plan: JobPlan,
                     events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        """Connect to the node's agent socket on this machine (:class:`AttachedLocalAgent`)."""
        return AttachedLocalAgent(node, plan.attempt_id, events)

    def sweep(self, plan: JobPlan, spare: Collection[int] = ()) -> list[int]:
        """Kill every rank and agent of the attempt still on this machine (but the pids in ``spare``: agents kept
        warm): its nodes' cgroups (``agents.cgroups``), then what carries its markers; then remove the scratch
        killed agents left."""
        monitor = next((n.deepspeed_monitor_dir for n in plan.nodes if n.deepspeed_monitor_dir), None)
        return sweep_attempt(plan.attempt_id, [n.node_rank for n in plan.nodes],
                             scratch=plan.nodes[0].metrics_dir if plan.nodes else None, monitor=monitor, spare=spare)
