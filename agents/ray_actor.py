"""The agent as a Ray actor: a thin relay around the same ``python -m agents.agent`` process.

The ``ray`` provisioner places one :class:`AgentActor` on each node of the plan (node
affinity, no soft fallback). The actor starts the node agent as a child process, exactly
as the local and ssh provisioners start it, and relays the agent's message stream over
Ray calls: ``send`` writes a line to the agent's stdin, ``recv`` returns the lines it
wrote to stdout (a long poll). So the supervision logic exists once, in ``agents.agent``.

If the actor dies (its node is lost, or the job is cancelled and the actor killed), the
agent's stdin closes and the agent stops its ranks; if the controller stops calling, the
agent's lease runs out and it does the same.
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Any

__all__ = ["AgentActor", "make_actor_class", "EOF_LINE"]

#: What ``send`` is given to close the agent's stdin (its link reads end-of-stream).
EOF_LINE = b""


class AgentActor:
    """Runs one node's agent and relays its JSON-lines stream (see the module docstring).

    Args:
        python: the interpreter for the agent (the spec's ``python``, else this worker's).
        workdir: the agent's working directory (``/`` where it does not exist: the preflight
            then reports it).
        env: extra environment for the agent (its attempt markers).
        log_path: where the agent's stderr goes on this node, or None to keep only a tail.
    """

    def __init__(self, python: str | None, workdir: str, env: dict[str, str], log_path: str | None) -> None:
        agent_env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
        agent_env.update(env)
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._out: "queue.Queue[bytes]" = queue.Queue()
        self._log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - lives as long as the actor
        self.proc = subprocess.Popen([python or sys.executable, "-u", "-m", "agents.agent"],
                                     cwd=workdir if os.path.isdir(workdir) else "/",
                                     env=agent_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            self._out.put(line)
        self._out.put(EOF_LINE)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in iter(self.proc.stderr.readline, b""):
            self._tail.append(line.decode("utf-8", "replace").rstrip())
            if self._log is not None:
                self._log.write(line)
                self._log.flush()

    def send(self, line: bytes) -> bool:
        """Write one message line to the agent; ``EOF_LINE`` closes its stdin."""
        assert self.proc.stdin is not None
        try:
            if line == EOF_LINE:
                self.proc.stdin.close()
            else:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def recv(self, timeout: float) -> list[bytes]:
        """The agent's next lines: waits up to ``timeout`` s for one, then takes what is there.
        An empty ``bytes`` in the list means the agent closed its stdout (it ended)."""
        try:
            lines = [self._out.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                lines.append(self._out.get_nowait())
            except queue.Empty:
                return lines

    def status(self) -> dict[str, Any]:
        """``{"pid", "returncode", "stderr"}`` of the agent process."""
        return {"pid": self.proc.pid, "returncode": self.proc.poll(), "stderr": "\n".join(self._tail)}

    def kill(self) -> None:
        """SIGKILL the agent's process group (its ranks have their own, and die with it:
        they carry PR_SET_PDEATHSIG)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def make_actor_class(ray: Any) -> Any:
    """The Ray actor class for :class:`AgentActor`: three concurrency groups, so a long
    ``recv`` never delays a ``send`` and messages to the agent keep their order."""
    groups = {"send": 1, "recv": 1, "ctl": 1}

    class _Actor(AgentActor):
        @ray.method(concurrency_group="send")
        def send(self, line: bytes) -> bool:
            return super().send(line)

        @ray.method(concurrency_group="recv")
        def recv(self, timeout: float) -> list[bytes]:
            return super().recv(timeout)

        @ray.method(concurrency_group="ctl")
        def status(self) -> dict[str, Any]:
            return super().status()

        @ray.method(concurrency_group="ctl")
        def kill(self) -> None:
            return super().kill()

    _Actor.__name__ = _Actor.__qualname__ = "OrchAgent"
    return ray.remote(concurrency_groups=groups, max_restarts=0, max_task_retries=0)(_Actor)
