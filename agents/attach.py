"""Re-attach: a new controller takes over a node's running agent, whose ranks never stopped.

A controller that is an ``orch server`` starts its agents with ``reattach_s > 0``. Such an agent,
once its ranks run, listens on a Unix socket of its own on the node (:func:`attach_path`: in a
directory only its user may enter, so only that user's processes can connect). When its link to
the controller closes (the controller was killed, or restarted), the agent does not stop its ranks:
it keeps them running for ``reattach_s`` seconds, keeps what it would have said (:class:`RelinkWriter`),
and waits for a new link on that socket. A new controller connects (the local provisioner directly;
the ssh provisioner runs ``python -m agents.attach ATTEMPT_ID NODE_RANK`` over SSH, which pipes the
SSH channel to the socket: :func:`main`), sends::

    {"type": "attach", "attempt_id": ..., "node_rank": ...}

and gets ``attached`` {host, pid, ranks: [{global_rank, pid}], exits: {rank: returncode},
metrics_port, detached_s} followed by every message kept while no controller listened. Nobody
attaching within ``reattach_s`` has the agent stop its ranks as before. A link that falls silent
(no end of stream) is still the lease's: a node cut off from its controller stops its ranks.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
import stat
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from .link import MessageReader, MessageWriter

__all__ = ["attach_dir", "attach_path", "node_key", "private_dir", "AttachPoint", "RelinkWriter", "attach_request", "main",
           "write_outcome", "read_outcomes", "remove_points"]

#: Message types a detached agent does not keep (each is superseded by the next, or means nothing later).
NOT_KEPT = frozenset({"heartbeat"})


def attach_dir() -> str:
    """The directory of this user's agents' sockets: ``<tmp>/orch-agents-<uid>``, mode 0700."""
    return os.path.join(tempfile.gettempdir(), f"orch-agents-{os.getuid()}")


def node_key(attempt_id: str, node_rank: int) -> str:
    """24 hex digits naming one node of one attempt: the agent's socket and its cgroup's record are called by it
    (a hash keeps a socket's path within the 107 bytes a Unix socket address may have)."""
    return hashlib.sha256(f"{attempt_id}\0{node_rank}".encode()).hexdigest()[:24]


def attach_path(attempt_id: str, node_rank: int) -> str:
    """Where the agent of ``node_rank`` in attempt ``attempt_id`` listens on its node."""
    return os.path.join(attach_dir(), f"{node_key(attempt_id, node_rank)}.sock")


def private_dir(path: str) -> None:
    """Create ``path`` 0700, or check that an existing one is ours and closed to others.

    Raises:
        OSError: it is someone else's, or others may enter it.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a directory private to this user")


def attach_request(attempt_id: str, node_rank: int) -> dict[str, Any]:
    """The first message a new controller sends a running agent."""
    return {"type": "attach", "attempt_id": attempt_id, "node_rank": int(node_rank)}


class RelinkWriter:
    """The agent's writer to whichever controller is linked now (:class:`agents.link.MessageWriter` API).

    While no controller is linked (:meth:`detach`), messages are kept (at most ``keep``; heartbeats
    are not), to be sent to the next one first (:meth:`relink`). ``send`` returns True then: the
    agent's threads go on as if the link were up.
    """

    def __init__(self, writer: MessageWriter, keep: int = 10_000) -> None:
        self._writer: MessageWriter | None = writer
        self._kept: collections.deque[dict] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> bool:
        """Send to the linked controller, or keep for the next one."""
        with self._lock:
            if self._writer is None:
                if msg.get("type") not in NOT_KEPT:
                    self._kept.append(msg)
                return True
            return self._writer.send(msg)

    def detach(self) -> None:
        """The link closed: keep messages from now on (the old writer is closed, in the background)."""
        with self._lock:
            old, self._writer = self._writer, None
        if old is not None:
            threading.Thread(target=old.close, args=(1.0,), daemon=True).start()

    def relink(self, writer: MessageWriter, first: dict[str, Any]) -> None:
        """Link ``writer``: send ``first``, then every kept message, then go on sending there."""
        with self._lock:
            old, self._writer = self._writer, writer
            writer.send(first)
            while self._kept:
                writer.send(self._kept.popleft())
        if old is not None:
            threading.Thread(target=old.close, args=(1.0,), daemon=True).start()

    def close(self, close_timeout: float = 10.0) -> None:
        """Close the current link (what waits is sent first)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close(close_timeout)


class _SocketStream:
    """One direction of a connected socket as the binary stream :mod:`agents.link` reads or writes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._file = sock.makefile("rb")

    def readline(self) -> bytes:
        return self._file.readline()

    def hub_source(self) -> tuple[int, Any]:
        """For :class:`agents.linkhub.LinkHub`: the socket's descriptor, read without blocking (the socket
        itself stays blocking for the writer's ``sendall``)."""
        return self.sock.fileno(), lambda n: self.sock.recv(n, socket.MSG_DONTWAIT)

    def write(self, data: bytes) -> int:
        self.sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class AttachPoint:
    """The agent's listening socket (see the module docstring).

    Args:
        attempt_id, node_rank: whom it answers for (an ``attach`` naming anything else is refused).
        inbox: the agent's message queue; an accepted link arrives there as
            ``("attach", {"type": "relink", "reader_tag": tag, "writer": MessageWriter})``, and that
            link's messages follow with ``tag``.

    Raises:
        OSError: the socket cannot be created (the agent then runs without re-attach, and says so).
    """

    def __init__(self, attempt_id: str, node_rank: int, inbox: "Any") -> None:
        self.attempt_id = attempt_id
        self.node_rank = int(node_rank)
        self.inbox = inbox
        self.path = attach_path(attempt_id, node_rank)
        private_dir(os.path.dirname(self.path))
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self._sock.listen(4)
        self._links = 0
        self._closed = False
        threading.Thread(target=self._accept, name="attach-point", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), name="attach-greet", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        """Read the ``attach`` request (5 s at most); hand a good one to the agent, refuse others."""
        conn.settimeout(5.0)
        stream = _SocketStream(conn)
        try:
            line = stream.readline()
            msg = json.loads(line) if line.strip() else {}
        except (OSError, ValueError):
            msg = {}
        if not isinstance(msg, dict) or msg.get("type") != "attach" or msg.get("attempt_id") != self.attempt_id \
                or msg.get("node_rank") != self.node_rank:
            try:
                stream.write(json.dumps({"type": "error", "message": f"this agent serves node {self.node_rank} of "
                                         f"{self.attempt_id}; got {str(msg)[:200]}"}).encode() + b"\n")
            except OSError:
                pass
            stream.close()
            return
        conn.settimeout(None)
        self._links += 1
        tag = ("controller", self._links)
        MessageReader(stream, name=f"controller-link-{self._links}", sink=self.inbox, tag=tag)
        self.inbox.put(("attach", {"type": "relink", "reader_tag": tag,
                                   "writer": MessageWriter(stream, background=True)}))

    def close(self) -> None:
        """Stop listening and remove the socket."""
        self._closed = True
        try:
            self._sock.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def outcome_path(log_dir: str, node_rank: int) -> str:
    """Where a detached agent whose ranks all ended records their exits (in the node's log directory)."""
    return os.path.join(log_dir, f".node-{node_rank}.outcome.json")


def write_outcome(log_dir: str, node_rank: int, exits: dict[int, int]) -> None:
    """Record the node's rank exits for whoever finds the attempt's controller gone (``supervision.orphans``):
    an attempt whose ranks all ended while no controller listened is recorded by them, not as lost."""
    try:
        with open(outcome_path(log_dir, node_rank), "w") as f:
            json.dump({"exits": {str(k): v for k, v in exits.items()}, "at": time.time()}, f)
    except OSError:
        pass


def read_outcomes(plan: dict) -> dict[int, int] | None:
    """Every rank's exit code from the outcome files of all the plan's nodes, or None unless every node
    left one (readable here: local nodes, or a log directory on shared storage)."""
    exits: dict[int, int] = {}
    for node in plan.get("nodes") or ():
        try:
            with open(outcome_path(node["log_dir"], node["node_rank"])) as f:
                exits.update({int(k): int(v) for k, v in json.load(f)["exits"].items()})
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return exits if len(exits) == sum(len(n.get("ranks") or ()) for n in plan.get("nodes") or ()) else None


def remove_points(attempt_id: str, node_ranks: "Any") -> None:
    """Remove the sockets of these nodes' agents on this machine (agents killed before they could)."""
    for node_rank in node_ranks:
        try:
            os.unlink(attach_path(attempt_id, node_rank))
        except OSError:
            pass


def open_link(attempt_id: str, node_rank: int, timeout: float = 5.0) -> socket.socket:
    """Connect to a running agent's socket on this machine and send the ``attach`` request.

    Raises:
        OSError: no agent of that attempt and node listens here (it ended, or its window passed).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(attach_path(attempt_id, node_rank))
        sock.sendall(json.dumps(attach_request(attempt_id, node_rank)).encode() + b"\n")
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def socket_streams(sock: socket.socket) -> tuple[Any, Any]:
    """(reader stream, writer stream) over one connected socket, for :mod:`agents.link`."""
    stream = _SocketStream(sock)
    return stream, stream


def _pump(read: Callable[[int], bytes], write: Callable[[bytes], Any], done: threading.Event) -> None:
    try:
        while True:
            data = read(65536)
            if not data:
                break
            write(data)
    except OSError:
        pass
    done.set()


def main(argv: list[str] | None = None) -> int:
    """``python -m agents.attach ATTEMPT_ID NODE_RANK``: pipe stdin/stdout to that agent's socket (what the
    ssh provisioner runs to re-attach). Exits 3, saying why on stderr, when no such agent listens."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m agents.attach ATTEMPT_ID NODE_RANK", file=sys.stderr)
        return 2
    try:
        sock = open_link(args[0], int(args[1]))
    except OSError as err:
        print(f"no agent of {args[0]} node {args[1]} listens at {attach_path(args[0], int(args[1]))} "
              f"({err.strerror or err}): it ended, or nobody re-attached within its window", file=sys.stderr)
        return 3
    done = threading.Event()
    out = sys.stdout.buffer

    def to_stdout(data: bytes) -> None:
        out.write(data)
        out.flush()
    threading.Thread(target=_pump, args=(sys.stdin.buffer.raw.read, sock.sendall, done), daemon=True).start()
    threading.Thread(target=_pump, args=(sock.recv, to_stdout, done), daemon=True).start()
    done.wait()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
