"""Hostfile hosts to Ray nodes (pure: node lists as ray.nodes() returns them)."""

from __future__ import annotations

from orchestrator.provisioners.ray import match_node


def _node(ip: str, name: str, cpus: int = 2, node_id: str | None = None) -> dict:
    return {"NodeID": node_id or f"id-{ip}", "NodeManagerAddress": ip, "NodeManagerHostname": name,
            "Alive": True, "Resources": {"CPU": cpus}}


NODES = [_node("10.0.0.11", "gpu-box.invalid"), _node("10.0.0.12", "gpu-box.invalid"), _node("127.0.0.1", "single-host")]


def test_by_address() -> None:
    assert match_node("10.0.0.12", NODES)["NodeID"] == "id-10.0.0.12"


def test_by_name_that_resolves_to_the_address() -> None:
    assert match_node("localhost", NODES)["NodeID"] == "id-127.0.0.1"


def test_by_unique_hostname_only() -> None:
    assert match_node("single-host", NODES)["NodeID"] == "id-127.0.0.1"
    assert match_node("gpu-box.invalid", NODES) is None  # two nodes share it: ambiguous, so no match


def test_no_node() -> None:
    assert match_node("10.9.9.9", NODES) is None
    assert match_node("no-such-host.invalid", NODES) is None
