"""Many fake agents in one process, speaking the agents' link protocol (``agents.link``), to drive a real
controller at scale (1,000 nodes) without 1,000 agent processes.

This is the one seam mocked: the provisioner (:class:`FakeProvisioner`, given to the controller as its
``provisioner_factory``) connects each node to this harness over a Unix socket instead of starting
``python -m agents.agent``. Everything on the controller's side (the link reader, the attempt's loop,
heartbeats and pings, the preflight round, teardown, the store) is the real code.

Each fake agent says ``hello``; answers the preflight's phases (every check passed, no shared-storage token);
answers ``start`` with ``started`` (its ranks, the harness's pid); then sends a ``heartbeat`` every
``heartbeat_s`` seconds (from its ``start`` or ``preflight`` message) and, if asked, a ``progress`` point per
rank; after ``run_s`` seconds of running (if given) every rank exits 0 and the agent says ``done``; ``stop``
is answered with ``stopped`` (every rank -15) and the link closed.

Run as a script (``python tests/fakeagents.py SOCKET``) it serves until killed, printing ``ready`` once it
listens; :func:`start_harness` does that in a subprocess and returns it with its socket.
"""

from __future__ import annotations

import heapq
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agents.link import MessageReader, MessageWriter, decode, encode  # noqa: E402
from agents.linkhub import shared_hub  # noqa: E402
from orchestrator.provisioners.base import AgentHandle, Provisioner  # noqa: E402


# --------------------------------------------------------------------------- the harness (its own process)

class _Fake:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.out = b""
        self.node: dict[str, Any] | None = None
        self.ranks: list[int] = []
        self.heartbeat_s = 0.5
        self.running_since: float | None = None
        self.scheduled = False  # its heartbeats have begun
        self.ended = False


class Harness:
    """The fake agents of every node that connects to ``path`` (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4096)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.timers: list[tuple[float, int, _Fake]] = []  # (when, seq, agent): its next heartbeat
        self.seq = 0

    def serve(self) -> None:
        while True:
            timeout = max(0.0, self.timers[0][0] - time.monotonic()) if self.timers else 1.0
            for key, mask in self.selector.select(timeout):
                if key.data is None:
                    self._accept()
                else:
                    self._io(key.data, mask)
            self._tick()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, _Fake(sock))

    def _io(self, fake: _Fake, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(fake)
        if not mask & selectors.EVENT_READ or fake.ended:
            return
        try:
            chunk = fake.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(fake)
            return
        *lines, fake.buffer = (fake.buffer + chunk).split(b"\n")
        for line in lines:
            if line.strip():
                self._handle(fake, decode(line))

    def _send(self, fake: _Fake, msg: dict[str, Any]) -> None:
        if fake.ended:
            return
        fake.out += encode(msg)
        self._flush(fake)

    def _flush(self, fake: _Fake) -> None:
        try:
            sent = fake.sock.send(fake.out) if fake.out else 0
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(fake)
            return
        fake.out = fake.out[sent:]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if fake.out else 0)
        self.selector.modify(fake.sock, events, fake)

    def _close(self, fake: _Fake) -> None:
        if fake.ended:
            return
        fake.ended = True
        try:
            self.selector.unregister(fake.sock)
        except (KeyError, ValueError):
            pass
        fake.sock.close()

    def _schedule(self, fake: _Fake) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (time.monotonic() + fake.heartbeat_s, self.seq, fake))

    def _handle(self, fake: _Fake, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "fake_node":
            fake.node = msg
            fake.ranks = list(msg.get("ranks") or [])
            self._send(fake, {"type": "hello", "host": msg.get("host"), "pid": os.getpid(), "python": sys.executable})
        elif kind == "preflight":
            fake.heartbeat_s = float(msg.get("heartbeat_s") or fake.heartbeat_s)
            if msg.get("phase") == "list":
                self._send(fake, {"type": "preflight_result", "phase": "list", "seen": msg.get("expect") or [],
                                  "problems": [], "seconds": 0.0})
            else:
                self._send(fake, {"type": "preflight_result", "phase": "check", "checks": [], "seconds": 0.0})
            if not fake.scheduled:
                fake.scheduled = True
                self._schedule(fake)
        elif kind == "start":
            fake.heartbeat_s = float(msg.get("heartbeat_s") or fake.heartbeat_s)
            fake.running_since = time.monotonic()
            self._send(fake, {"type": "started", "ranks": [{"global_rank": r, "pid": os.getpid()} for r in fake.ranks]})
        elif kind == "stop":
            self._send(fake, {"type": "stopped", "reason": msg.get("reason"), "exits": {str(r): -15 for r in fake.ranks}})
            self._close(fake)

    def _tick(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, fake = heapq.heappop(self.timers)
            if fake.ended:
                continue
            node = fake.node or {}
            run_s = node.get("run_s")
            if fake.running_since is not None and run_s is not None and now - fake.running_since >= float(run_s):
                for r in fake.ranks:
                    self._send(fake, {"type": "rank_exit", "global_rank": r, "returncode": 0, "how": "exit 0",
                                      "at": time.time()})
                self._send(fake, {"type": "done"})
                self._close(fake)
                continue
            self._send(fake, {"type": "heartbeat", "at": time.time()})
            if fake.running_since is not None and node.get("progress"):
                step = int((now - fake.running_since) / fake.heartbeat_s) + 1
                self._send(fake, {"type": "progress", "points": {str(r): [{"step": step, "loss": 1.0 / step}]
                                                                  for r in fake.ranks}})
            self._schedule(fake)


def start_harness(directory: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start the harness in a subprocess; returns ``(process, socket path)`` once it listens.

    Raises:
        RuntimeError: it did not say ``ready`` within 30 s.
    """
    path = os.path.join(directory or tempfile.mkdtemp(prefix="orch-fake-"), "agents.sock")
    proc = subprocess.Popen([sys.executable, __file__, path], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != b"ready":
        proc.kill()
        raise RuntimeError(f"the fake-agent harness did not start: {line!r}")
    return proc, path


# --------------------------------------------------------------------------- the controller's side

class FakeAgent(AgentHandle):
    """The controller's link to one fake agent: a Unix socket to the harness, read on the shared hub."""

    def __init__(self, node: Any, path: str, events: Any, run_s: float | None, progress: bool) -> None:
        self.node_rank, self.host = node.node_rank, node.host
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.sendall(encode({"type": "fake_node", "node_rank": node.node_rank, "host": node.host, "run_s": run_s,
                                  "progress": progress, "ranks": [r.global_rank for r in node.ranks]}))
        from agents.attach import socket_streams
        reader, writer = socket_streams(self.sock)
        self._writer = MessageWriter(writer)
        self._reader = MessageReader(reader, name=f"fake-{node.node_rank}", sink=events, tag=node.node_rank,
                                     hub=shared_hub())

    def send(self, msg: dict[str, Any]) -> bool:
        return self._writer.send(msg)

    def close(self) -> None:
        self._writer.close()

    def wait(self, timeout: float) -> bool:
        return True

    def kill(self) -> None:
        self._writer.close()


class FakeProvisioner(Provisioner):
    """Starts every node's agent in the harness listening at ``path``.

    Args:
        path: the harness's socket (:func:`start_harness`).
        run_s: seconds each node's ranks run before they exit 0 (None: until stopped).
        progress: each agent also reports a step per rank with every heartbeat.
    """

    name = "fake"
    max_parallel = 64

    def __init__(self, path: str, run_s: float | None = None, progress: bool = False) -> None:
        self.path, self.run_s, self.progress = path, run_s, progress

    def start_agent(self, node: Any, plan: Any, events: Any) -> AgentHandle:
        return FakeAgent(node, self.path, events, self.run_s, self.progress)


if __name__ == "__main__":
    harness = Harness(sys.argv[1])
    print("ready", flush=True)
    try:
        harness.serve()
    except KeyboardInterrupt:
        pass
