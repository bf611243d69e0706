"""The agent's message stream to and from its controller: JSON objects, one per line.

The same framing runs over any byte stream: a local agent's stdin/stdout pipes, an SSH
channel's stdin/stdout, or a socket. Every message is a JSON object with a ``type``.

Controller -> agent:
    ``preflight`` {phase: "check", node, python, entrypoint, mode, workdir, checkpoint_dir,
        deepspeed, skip, master_port, shared, timeout_s, heartbeat_s, lease_s}: run this node's
        checks before any rank starts (``agents.preflight``); heartbeats begin, and the
        agent exits if the controller is silent for ``lease_s``.
    ``preflight`` {phase: "list", shared: {dir, nonce}, expect: [node ranks]}: say which
        nodes' shared-storage tokens this node sees.
    ``doctor`` {phase: "report" | "listen" | "connect" | "clock", node, python, workdir, checkpoint_dir,
        addr, port, timeout_s, heartbeat_s, lease_s}: ``orch doctor``'s questions (``agents.doctor``); no
        ``start`` follows, the controller ends the link.
    ``start`` {node, attempt_id, grace, heartbeat_s, lease_s, reattach_s}: the node's plan; start the
        ranks (sent once every node passed its preflight); ``reattach_s`` > 0: when the link closes, keep
        the ranks running that long for a new controller (``agents.attach``).
    ``stop`` {reason}: stop every rank (SIGTERM, grace, SIGKILL), report, exit.
    ``ping`` {}: keeps the agent's lease alive.
    ``attach`` {attempt_id, node_rank}: a new controller's first message on the agent's socket
        (``agents.attach``), once the one that started it died.

Agent -> controller:
    ``hello`` {host, pid, python, version, accelerator}: the agent is up; ``accelerator`` is the node's DeepSpeed
        accelerator (``agents.nodeenv.node_accelerator``), which decides the variables exported to its ranks.
    ``preflight_result`` {phase: "check", checks: [{name, status, detail, seconds}], token, seconds}
        or {phase: "list", seen: [node ranks], problems, seconds}: a preflight phase's answer.
    ``doctor_result`` {phase, report | status, detail | at, seconds}: the answer to a ``doctor`` request.
    ``started`` {ranks: [{global_rank, pid}]}: every rank of the node was started.
    ``attached`` {host, pid, ranks, exits: {rank: returncode}, metrics_port, detached_s}: the answer to
        ``attach``; what the agent kept while no controller was linked follows.
    ``spawn_failed`` {global_rank, error}: a rank could not be started.
    ``rank_exit`` {global_rank, returncode, how, at}: a rank ended.
    ``heartbeat`` {at, preflight?}: the agent is alive (every ``heartbeat_s`` seconds); during
        the preflight, ``preflight`` names the check running (or null).
    ``stopping`` {reason}: the agent stops its ranks on its own (a signal, its lease ran out).
    ``stopped`` {reason, exits: {rank: returncode}}: ranks stopped; the agent exits.
    ``done`` {}: every rank of the node ended by itself; the agent exits.
    ``error`` {message}: the agent cannot go on; it stops its ranks and exits.
    ``warning`` {message}: something the user should know; the agent goes on.

A reader that reaches end-of-stream yields ``{"type": "eof"}`` once.
"""

from __future__ import annotations

import json
import queue
import threading
from typing import IO, Any

__all__ = ["MessageWriter", "MessageReader", "encode", "decode"]


def encode(msg: dict[str, Any]) -> bytes:
    """One message as a line of UTF-8 JSON (no embedded newlines: JSON escapes them)."""
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode("utf-8")


def decode(line: bytes) -> dict[str, Any]:
    """Parse one line; a line that is not a JSON object becomes ``{"type": "garbage", "line": ...}``."""
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return {"type": "garbage", "line": line.decode("utf-8", "replace")[:500]}
    return msg if isinstance(msg, dict) and "type" in msg else {"type": "garbage", "line": str(msg)[:500]}


class MessageWriter:
    """Thread-safe writer of messages to a binary stream; errors after close are ignored.

    Args:
        stream: where the lines go.
        background: write on a thread of its own, so ``send`` never blocks on a peer that does not read
            (a controller stalled or suspended: the pipe, the SSH channel and the socket fill, and a
            writer blocked in them could not keep its own deadlines, such as an agent's lease). At most
            :data:`QUEUED` messages wait; past that, progress and heartbeats are dropped first (newer ones
            follow), then any. :meth:`close` sends what is waiting, for ``close_timeout`` seconds at most.
    """

    #: Messages a background writer keeps waiting for a peer that does not read.
    QUEUED = 10_000
    #: Message types a full background queue drops first (each is superseded by the next).
    SUPERSEDED = frozenset({"progress", "heartbeat"})

    def __init__(self, stream: IO[bytes], background: bool = False) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.closed = False
        self.dropped = 0
        self._queue: "queue.Queue[bytes | None] | None" = None
        if background:
            self._queue = queue.Queue(self.QUEUED)
            self._thread = threading.Thread(target=self._drain, name="link-writer", daemon=True)
            self._thread.start()

    def send(self, msg: dict[str, Any]) -> bool:
        """Write ``msg`` and flush (background: queue it). Returns False if the stream is gone."""
        data = encode(msg)
        if self._queue is not None:
            if self.closed:
                return False
            try:
                self._queue.put_nowait(data)
            except queue.Full:
                self.dropped += 1  # the peer has not read for QUEUED messages: this one is lost
                if msg.get("type") not in self.SUPERSEDED:
                    try:
                        self._queue.put(data, timeout=1.0)
                        self.dropped -= 1
                    except queue.Full:
                        pass
            return True
        return self._write(data)

    def _write(self, data: bytes) -> bool:
        with self._lock:
            if self.closed:
                return False
            try:
                self._stream.write(data)
                self._stream.flush()
                return True
            except (OSError, ValueError):
                self.closed = True
                return False

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            data = self._queue.get()
            if data is None or not self._write(data):
                return

    def close(self, close_timeout: float = 10.0) -> None:
        """Close the stream (the peer sees end-of-stream); a background writer first sends what waits."""
        if self._queue is not None and not self.closed:
            try:
                self._queue.put(None, timeout=close_timeout)
                self._thread.join(close_timeout)
            except queue.Full:
                pass
        with self._lock:
            self.closed = True
            try:
                self._stream.close()
            except OSError:
                pass


class MessageReader:
    """Reads messages from a binary stream on a daemon thread into a queue.

    Example::

        reader = MessageReader(proc.stdout, name="agent-0")
        msg = reader.get(timeout=0.1)     # None on timeout; {"type": "eof"} at the end

    Args:
        stream: the binary stream to read lines from.
        name: thread name, for debugging.
        sink: optional ``queue.Queue`` to put ``(tag, msg)`` pairs into instead of the
            reader's own queue (so one consumer can wait on many agents).
        tag: the first element of those pairs.
        hub: with a sink, an :class:`agents.linkhub.LinkHub` to read the stream on instead of a thread of
            its own, where the stream can be multiplexed (:meth:`agents.linkhub.LinkHub.watch`); the controller
            reads all its agents this way. The messages and their order are the same.
    """

    def __init__(self, stream: IO[bytes], name: str = "link-reader",
                 sink: "queue.Queue[tuple[Any, dict]] | None" = None, tag: Any = None, hub: Any = None) -> None:
        self._stream = stream
        self._queue: "queue.Queue[dict]" = queue.Queue()
        self._sink = sink
        self._tag = tag
        self._thread: threading.Thread | None = None
        if hub is not None and sink is not None and hub.watch(stream, sink, tag):
            return
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, msg: dict) -> None:
        if self._sink is not None:
            self._sink.put((self._tag, msg))
        else:
            self._queue.put(msg)

    def _run(self) -> None:
        try:
            for line in iter(self._stream.readline, b""):
                if line.strip():
                    self._put(decode(line))
        except (OSError, ValueError):
            pass
        self._put({"type": "eof"})

    def get(self, timeout: float | None = None) -> dict | None:
        """Next message, or None after ``timeout`` seconds (only without a sink)."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
