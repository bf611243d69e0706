"""How fast supervision notices things: every deadline of an attempt, in seconds, from the controller's
arguments or environment; and where the state lives by default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Timings", "env_seconds", "default_state_dir"]


def default_state_dir() -> Path:
    """``$ORCH_STATE_DIR``, else ``~/.orch``."""
    return Path(os.environ.get("ORCH_STATE_DIR") or Path.home() / ".orch").expanduser()


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name``, else ``default``."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


@dataclass(frozen=True)
class Timings:
    """An attempt's deadlines (seconds).

    Attributes:
        heartbeat_s: how often agents send heartbeats and the controller pings them.
        node_timeout_s: an agent's silence after which its node counts as lost.
        agent_lease_s: the controller's silence after which an agent stops its ranks.
        provision_timeout_s: how long every agent has to start and say hello.
        preflight_timeout_s: how long the nodes' preflight checks may take.
        hang_floor_s: the shortest step watchdog timeout ``hang_timeout: auto`` gives.
        reattach_s: how long an agent whose link closed keeps its ranks running for a new controller to
            re-attach (``agents.attach``); 0: it stops them at once (a controller no successor can follow,
            such as ``orch run``'s, sends 0).
        keep_warm_s: how long the agents of a failed attempt's healthy nodes (and their fork-server templates)
            stay up for the restart of a job with a restart policy (``orchestrator.supervision.warm``); 0: they
            end with their attempt.
    """

    heartbeat_s: float = 0.5
    node_timeout_s: float = 3.0
    agent_lease_s: float = 15.0
    provision_timeout_s: float = 120.0
    preflight_timeout_s: float = 60.0
    hang_floor_s: float = 300.0
    reattach_s: float = 60.0
    keep_warm_s: float = 60.0

    @classmethod
    def from_env(cls, heartbeat_s: float | None = None, node_timeout_s: float | None = None,
                 agent_lease_s: float | None = None) -> "Timings":
        """The given values, else ``$ORCH_HEARTBEAT_S``, ``$ORCH_NODE_TIMEOUT_S``, ``$ORCH_AGENT_LEASE_S``,
        ``$ORCH_PROVISION_TIMEOUT_S``, ``$ORCH_PREFLIGHT_TIMEOUT_S``, ``$ORCH_HANG_FLOOR_S``,
        ``$ORCH_AGENT_REATTACH_S``, ``$ORCH_KEEP_WARM_S`` (``0`` turns warm agents off), else the defaults above."""
        return cls(heartbeat_s=heartbeat_s or env_seconds("ORCH_HEARTBEAT_S", cls.heartbeat_s),
                   node_timeout_s=node_timeout_s or env_seconds("ORCH_NODE_TIMEOUT_S", cls.node_timeout_s),
                   agent_lease_s=agent_lease_s or env_seconds("ORCH_AGENT_LEASE_S", cls.agent_lease_s),
                   provision_timeout_s=env_seconds("ORCH_PROVISION_TIMEOUT_S", cls.provision_timeout_s),
                   preflight_timeout_s=env_seconds("ORCH_PREFLIGHT_TIMEOUT_S", cls.preflight_timeout_s),
                   hang_floor_s=env_seconds("ORCH_HANG_FLOOR_S", cls.hang_floor_s),
                   reattach_s=env_seconds("ORCH_AGENT_REATTACH_S", cls.reattach_s),
                   keep_warm_s=0.0 if os.environ.get("ORCH_KEEP_WARM_S", "").strip() in ("0", "0.0")
                   else env_seconds("ORCH_KEEP_WARM_S", cls.keep_warm_s))
