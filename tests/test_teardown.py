"""Teardown after a failure (orchestrator.supervision.teardown), with fake agents and a fake clock: no wait for
silent nodes when every rank's exit is already known, the node timeout for a node whose ranks' fate is
unknown, and an agent that said ``stopped`` is not waited for further."""

from __future__ import annotations

from typing import Any

from orchestrator.supervision.teardown import Teardown
from orchestrator.supervision.watches import HeartbeatWatch


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeHandle:
    """An agent whose process does not end (``wait`` False, costing its timeout of the clock), or has ended."""

    def __init__(self, clock: FakeClock, ended: bool = False) -> None:
        self.clock = clock
        self.ended = ended
        self.sent: list[dict[str, Any]] = []
        self.waits = 0

    def send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        if self.ended:
            return True
        self.clock.now += timeout
        return False


class FakeProvisioner:
    def __init__(self) -> None:
        self.forgotten: list[int] = []

    def forget(self, node_rank: int) -> None:
        self.forgotten.append(node_rank)


def _teardown(states: dict[int, str], exits_known: bool, clock: FakeClock) -> tuple[Teardown, dict, HeartbeatWatch]:
    hb = HeartbeatWatch(node_timeout_s=3.0, heartbeat_s=0.5, clock=clock)
    hb.expect(states)  # every node last heard now, at the failure
    # node 0 says "stopped" once told to stop; node 1's agent process is gone, and it says nothing more
    handles = {0: FakeHandle(clock), 1: FakeHandle(clock, ended=True)}

    def drain() -> None:
        if handles[0].sent:
            states[0] = "stopped"
        clock.now += 0.05
    return Teardown(handles, states, hb, FakeProvisioner(), drain, clock=clock,
                    exits_known=lambda: exits_known), handles, hb


def test_no_silence_wait_when_every_exit_is_known() -> None:
    clock = FakeClock()
    states = {0: "running", 1: "running"}  # every rank's exit was reported (rank 1's, the failure, and rank 0's)
    teardown, handles, _ = _teardown(states, exits_known=True, clock=clock)
    failed_at = clock.now
    lost = teardown.stop("rank 1 exited with 1", grace_s=5.0, failed_at=failed_at)
    assert lost == set() and teardown.silence_wait is None
    assert handles[0].sent == [{"type": "stop", "reason": "rank 1 exited with 1"}]
    assert handles[0].waits == 1  # its "stopped" ends the wait for that agent: its exit is not awaited
    assert clock.now - failed_at < 0.5


def test_a_node_whose_ranks_fate_is_unknown_gets_the_node_timeout() -> None:
    clock = FakeClock()
    states = {0: "running", 1: "running"}  # node 1 went silent at the failure: its ranks' fate is unknown
    teardown, _, _ = _teardown(states, exits_known=False, clock=clock)
    failed_at = clock.now
    lost = teardown.stop("rank 0 exited with 1", grace_s=5.0, failed_at=failed_at)
    assert lost == {1} and states[1] == "lost"
    assert teardown.silence_wait is not None and teardown.silence_wait["nodes"] == [1]
    assert clock.now - failed_at >= 3.0  # the node timeout, counted from the node's last word
