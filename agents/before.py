"""The agent between its ``hello`` and the ``start`` message: the preflight requests, with heartbeats.

Run by :func:`agents.agent.main` before the node's plan arrives (:class:`BeforeStart`).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from .link import MessageWriter
from .nodeenv import rank_env

__all__ = ["BeforeStart", "stay_warm"]


class BeforeStart:
    """The agent between ``hello`` and ``start``: it answers the controller's ``preflight``
    requests (:mod:`agents.preflight`, on a thread, so a ``stop`` is obeyed at once) and ``orch doctor``'s
    ``doctor`` requests (:mod:`agents.doctor`), sends
    heartbeats from the first request on, and gives up when the controller falls silent for
    the lease the request named (before any request: after ``timeout`` seconds).

    Args:
        writer: where messages to the controller go.
        inbox: messages from the controller.
        base_env: the node's environment (ranks' environments are laid over it).
        warm: between two attempts (:func:`stay_warm`): a ``stop`` (one that crossed the agent's ``idle``, or a
            cancel before the next start) is answered ``stopped`` (nothing runs), other messages of the ended
            attempt (a ``dump``) are ignored; only end of stream releases the agent.
    """

    def __init__(self, writer: MessageWriter, inbox: "queue.Queue[tuple[Any, dict]]",
                 base_env: dict[str, str], warm: bool = False) -> None:
        self.warm = warm
        self.writer = writer
        self.inbox = inbox
        self.base_env = base_env
        self.preflight: Any = None
        self.doctor: Any = None  # agents.doctor.NodeDoctor, once orch doctor asked
        self._thread: threading.Thread | None = None
        self._beating = threading.Event()
        self._done = threading.Event()
        self._heartbeat_s = 1.0
        self._lease_s: float | None = None

    def wait(self, timeout: float = 600.0) -> dict | None:
        """The ``start`` message, or None when the controller gave up on the attempt (``stop``,
        end of stream), fell silent for its lease, or sent nothing usable."""
        deadline = time.monotonic() + timeout
        last_heard = time.monotonic()
        while time.monotonic() < deadline:
            if self._lease_s is not None and time.monotonic() - last_heard > self._lease_s:
                print(f"agent: no word from the controller for {self._lease_s:.0f} s before the start; exiting",
                      file=sys.stderr)
                return None
            try:
                _tag, msg = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            last_heard = time.monotonic()
            kind = msg.get("type")
            if kind == "start":
                return msg
            if kind == "eof" or (kind == "stop" and not self.warm):
                return None  # the controller gave up on this attempt before it started
            if kind == "stop":  # warm: nothing runs here; whoever asks is told so (the link's end releases us)
                self.writer.send({"type": "stopped", "reason": msg.get("reason", "stop requested"), "exits": {}})
                continue
            if kind == "preflight":
                self._preflight(msg)
            elif kind == "doctor":
                self._doctor(msg)
            elif kind != "ping" and not self.warm:
                print(f"agent: expected a start message, got {kind!r}; exiting", file=sys.stderr)
                return None
        print(f"agent: no start message within {timeout:.0f} s; exiting", file=sys.stderr)
        return None

    def _begin_heartbeats(self, msg: dict) -> None:
        """Heartbeats from the first request on; the controller's silence past ``lease_s`` ends the wait."""
        self._heartbeat_s = float(msg.get("heartbeat_s") or self._heartbeat_s)
        self._lease_s = float(msg["lease_s"]) if msg.get("lease_s") else self._lease_s
        if not self._beating.is_set():
            self._beating.set()
            threading.Thread(target=self._heartbeats, name="preflight-heartbeats", daemon=True).start()

    def _doctor(self, msg: dict) -> None:
        """``orch doctor``'s requests (:mod:`agents.doctor`): ``clock`` and ``listen`` answered at once, the
        others on a thread each (the agent never starts ranks for it: the controller ends the link)."""
        from .doctor import NodeDoctor, run_in_thread
        self._begin_heartbeats(msg)
        if self.doctor is None:
            node = msg.get("node") or {}
            ranks = node.get("ranks") or [{}]
            self.doctor = NodeDoctor(rank_env(self.base_env, node, ranks[0]) if node else self.base_env)
        if msg.get("phase") in ("clock", "listen", "unlisten"):
            self.writer.send(self.doctor.run(msg))
        else:
            run_in_thread(self.doctor, msg, self.writer.send)

    def _preflight(self, msg: dict) -> None:
        from .preflight import NodePreflight, run_in_thread
        self._begin_heartbeats(msg)
        if self.preflight is None:
            node = msg.get("node") or {}
            ranks = node.get("ranks") or [{}]
            self.preflight = NodePreflight(int(node.get("node_rank", 0)), rank_env(self.base_env, node, ranks[0]),
                                           host=str(node.get("host", "")))
        if self._thread is not None:
            self._thread.join()  # phases run one at a time (the controller waits for each anyway)
        self._thread = run_in_thread(self.preflight, msg, self.writer.send)

    def _heartbeats(self) -> None:
        while not self._done.wait(self._heartbeat_s):
            check = self.preflight.current if self.preflight is not None else None
            if not self.writer.send({"type": "heartbeat", "at": time.time(), "preflight": check}):
                return

    def close(self) -> None:
        """Stop the heartbeats, call off a running check, remove this node's preflight token, close the
        doctor's listener."""
        self._done.set()
        if self.doctor is not None:
            self.doctor.close()
        if self.preflight is not None:
            self.preflight.abort()
            if self._thread is not None:
                self._thread.join(5.0)
            self.preflight.cleanup()


def stay_warm(keep_s: float, writer: MessageWriter, inbox: "queue.Queue[tuple[Any, dict]]",
              base_env: dict[str, str], about: dict[str, Any]) -> dict | None:
    """The agent between two attempts (the controller's ``keep_warm_s``): say ``idle`` (``about``: the attempt
    that ended, the warm template's pid; the attempt's processes are gone, the agent and its template are up)
    and wait up to ``keep_s`` seconds for the next attempt's ``preflight`` requests and ``start``, as after
    ``hello``.

    Returns:
        The next ``start`` message; None when the controller released the node (end of stream), fell silent
        (past the lease of a preflight request), or ``keep_s`` passed. A signal now ends the agent at once
        (its template dies with it: ``PR_SET_PDEATHSIG``).
    """
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    writer.send({"type": "idle", "pid": os.getpid(), **about})
    before = BeforeStart(writer, inbox, base_env, warm=True)
    try:
        return before.wait(timeout=keep_s)
    finally:
        before.close()
