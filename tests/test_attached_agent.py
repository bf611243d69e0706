"""A new server's handle on a local agent another server started (``AttachedLocalAgent``,
``agents.attach.open_link``), in this process: a listening Unix socket stands in for the agent. The real agents
and a killed server are tests/test_reattach.py's."""

from __future__ import annotations

import json
import os
import queue
import socket
import uuid
from types import SimpleNamespace

import pytest

from agents.attach import attach_dir, attach_path, private_dir
from orchestrator.errors import ProvisionError
from orchestrator.provisioners.local import AttachedLocalAgent


@pytest.fixture
def agent_socket():
    """(attempt id, the listening socket at node 0's attach path) of an attempt no real agent has."""
    attempt_id = f"attached-{uuid.uuid4().hex[:8]}.1"
    private_dir(attach_dir())
    path = attach_path(attempt_id, 0)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        yield attempt_id, listener
    finally:
        listener.close()
        os.unlink(path)


def test_an_agent_not_yet_known_by_its_pid_is_gone_once_its_link_is_closed(agent_socket) -> None:
    """Before the agent said ``attached`` (its pid), waiting for it is waiting for the link: not gone while the
    link is open (the handle sent the attach request, and sends more), gone once the handle closed it, and the
    agent's end sees end-of-stream."""
    attempt_id, listener = agent_socket
    handle = AttachedLocalAgent(SimpleNamespace(node_rank=0, host="localhost"), attempt_id, queue.Queue())
    peer, _ = listener.accept()
    peer.settimeout(5)
    with peer, peer.makefile("rb") as agent_end:
        assert json.loads(agent_end.readline()) == {"type": "attach", "attempt_id": attempt_id, "node_rank": 0}
        assert handle.pid is None
        assert handle.wait(0.1) is False
        assert handle.send({"type": "ping"})
        assert json.loads(agent_end.readline()) == {"type": "ping"}
        handle.close()
        assert handle.wait(0.1) is True
        assert agent_end.readline() == b""


def test_no_agent_listening_is_a_provision_error_naming_the_node(agent_socket) -> None:
    """An attempt whose agent ended (no socket) cannot be re-attached: a ProvisionError naming the node."""
    attempt_id, _listener = agent_socket
    with pytest.raises(ProvisionError, match=r"cannot re-attach to the agent of node 1 \(node-b\)"):
        AttachedLocalAgent(SimpleNamespace(node_rank=1, host="node-b"), attempt_id, queue.Queue())
