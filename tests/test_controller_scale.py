"""The controller at scale: one thread reads every agent's link (agents.linkhub), and a real controller
supervises 1,000 fake agents (tests/fakeagents.py, the provisioner the one seam replaced) without a thread
each. How much CPU that costs is bench/controller_scale.py's, not a test's."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pytest

from agents.linkhub import MAX_LINE, LinkHub
from fakeagents import FakeProvisioner, start_harness
from orchestrator.spec import spec_from_dict
from orchestrator.store import Store
from orchestrator.supervision import Controller

pytestmark = pytest.mark.timeout(300)


def _drain(sink: "queue.Queue", count: int, timeout: float = 20.0) -> list:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        try:
            out.append(sink.get(timeout=0.1))
        except queue.Empty:
            pass
    return out


def test_one_hub_reads_many_pipes_in_order_with_one_eof_each() -> None:
    hub, sink = LinkHub(name="test-hub"), queue.Queue()
    writers = {}
    for tag in range(200):
        r, w = os.pipe()
        hub.add(r, lambda n, fd=r: os.read(fd, n), sink, tag)
        os.set_blocking(r, False)
        writers[tag] = w
    before = threading.active_count()
    for i in range(5):
        for tag, w in writers.items():
            # a message split across writes, and two in one write
            os.write(w, b'{"type": "m", "i": %d, "tag"' % (2 * i))
            os.write(w, b': %d}\n{"type": "m", "i": %d, "tag": %d}\n' % (tag, 2 * i + 1, tag))
    os.write(writers[0], b"not json\n" + b"x" * (MAX_LINE + 10))
    for w in writers.values():
        os.close(w)
    got = _drain(sink, 200 * 11 + 2)
    assert threading.active_count() == before  # no thread per stream
    by_tag: dict[int, list[dict]] = {}
    for tag, msg in got:
        by_tag.setdefault(tag, []).append(msg)
    for tag, msgs in by_tag.items():
        extra = msgs[10:-1]
        assert [m["i"] for m in msgs[:10]] == list(range(10)) and all(m["tag"] == tag for m in msgs[:10])
        assert msgs[-1] == {"type": "eof"} and sum(m["type"] == "eof" for m in msgs) == 1
        if tag == 0:  # garbage is said to be garbage; an endless line is cut at MAX_LINE, not buffered forever
            assert [m["type"] for m in extra] == ["garbage", "garbage"], [str(m)[:80] for m in extra]
        else:
            assert extra == []
    assert len(by_tag) == 200 and hub.links == 0


@pytest.mark.integration
def test_a_controller_supervises_a_thousand_agents_without_a_thread_each(tmp_path: Path) -> None:
    nodes = 1000
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"node-{i:04d} slots=1\n" for i in range(nodes)))
    harness, path = start_harness(str(tmp_path))
    controller = Controller(tmp_path / "state", provisioner_factory=lambda name, spec: FakeProvisioner(path, progress=True))
    try:
        spec = spec_from_dict({"name": "thousand", "hostfile": str(hostfile), "entrypoint": "/bin/true",
                               "stop_grace_seconds": 2}, check_files=False)
        job = controller.submit(spec)
        deadline = time.monotonic() + 120
        while controller.get(job.id).state.value != "RUNNING":
            assert time.monotonic() < deadline and not controller.get(job.id).state.is_terminal(), \
                controller.get(job.id).cause
            time.sleep(0.1)
        time.sleep(4.0)  # more than the node timeout (3 s): heartbeats from all 1,000 keep every node alive
        assert controller.get(job.id).state.value == "RUNNING", controller.get(job.id).cause
        assert threading.active_count() < 12, [t.name for t in threading.enumerate()]
        store = Store(tmp_path / "state" / "orch.db")
        started = [e.data for e in store.events(job.id, limit=100_000) if e.kind == "ranks_started"]
        assert sorted(r["global_rank"] for e in started for r in e["ranks"]) == list(range(nodes))
        summary = store.progress_summaries([(job.id, 1)])[(job.id, 1)]
        assert len(summary["ranks"]) == nodes and summary["step"] >= 2  # every rank's points were stored
        controller.cancel(job.id)
        ended = controller.wait(job.id, timeout=60)
        assert ended.state.value == "CANCELLED" and not controller.busy(job.id)
        assert len([e for e in store.events(job.id, limit=100_000) if e.kind == "node_lost"]) == 0
        store.close()
    finally:
        controller.close()
        harness.kill()
        harness.wait()
