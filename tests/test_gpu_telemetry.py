"""Per-rank GPU telemetry and ``gpu_fault`` (agents/gpu.py), through its one NVML seam: the fake NVML of
tests/fake_nvml.py (``ORCH_FAKE_NVML``), driven by a JSON state file a test changes while a job runs.

Unit tests: the rank -> GPU mapping (``CUDA_VISIBLE_DEVICES`` as indices, UUIDs, MIG UUIDs, empty; LOCAL_RANK;
``CUDA_DEVICE_ORDER``), NVML errors counted, reported once and retried (NVML initialised again after a few in a
row), Xid/ECC events. End to end (local agents, 3 hosts, 2 nodes): per-rank series on a node's /metrics, then an
Xid 79 on node 1's GPU fails the attempt with ``gpu_fault`` and the restart runs without node 1.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents import gpu
from agents.metrics import NodeCollector
from conftest import assert_no_leftovers, wait_for

FAKE = str(Path(__file__).resolve().parent / "fake_nvml.py")
BUSES = ["00000000:1A:00.0", "00000000:3B:00.0", "00000000:88:00.0", "00000000:B1:00.0"]


def _machine(path: Path, names: list[str] | None = None, **extra) -> Path:
    names = names or ["NVIDIA H100 80GB HBM3"] * 4
    gpus = [{"bus_id": bus.lower(), "uuid": f"GPU-{i}aaa{i}-0000-1111-2222-33334444555{i}", "name": names[i],
             "util": 10 * (i + 1), "mem_used": (i + 1) << 30, "mem_total": 80 << 30, "power_mw": 300_000 + i,
             "temp": 40 + i, "sm_clock": 1980, "mem_clock": 2619, "throttle": 0x4 | 0x40,
             "ecc": {"single": i, "double": 0}, "mig": [f"MIG-{i}bbb{i}-0000"]} for i, bus in enumerate(BUSES)]
    state = {"gpus": gpus, "events": [], "fail": {}, **extra}
    path.write_text(json.dumps(state))
    return path


def _edit(path: Path, change) -> None:
    state = json.loads(path.read_text())
    change(state)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)  # the fake reads it at every call: never a half-written file


def _env(state: Path, **env: str) -> dict[str, str]:
    return {"ORCH_FAKE_NVML": FAKE, "ORCH_FAKE_NVML_STATE": str(state), **env}


def _device(state: Path, **env: str) -> tuple[str, int, str | None] | None:
    mod = gpu.nvml(_env(state, **env))
    mod.nvmlInit()
    found = gpu.rank_device(mod, {k: v for k, v in env.items()})
    if found is None:
        return None
    handle, warning = found
    return gpu.bus_id(mod, handle), mod.nvmlDeviceGetIndex(handle), warning


def test_the_rank_gpu_follows_cuda_visible_devices_and_local_rank(tmp_path: Path) -> None:
    state = _machine(tmp_path / "m.json")
    assert _device(state, LOCAL_RANK="1")[:2] == (BUSES[1], 1)  # unset: every GPU, cuda:LOCAL_RANK
    assert _device(state, CUDA_VISIBLE_DEVICES="2", LOCAL_RANK="3")[:2] == (BUSES[2], 2)  # one device: that one
    assert _device(state, CUDA_VISIBLE_DEVICES="1,3", LOCAL_RANK="1")[:2] == (BUSES[3], 3)
    assert _device(state, CUDA_VISIBLE_DEVICES="GPU-2aaa2", LOCAL_RANK="0")[:2] == (BUSES[2], 2)  # a UUID prefix
    assert _device(state, CUDA_VISIBLE_DEVICES="MIG-3bbb3-0000")[:2] == (BUSES[3], 3)  # the MIG device's GPU
    assert _device(state, CUDA_VISIBLE_DEVICES="") is None  # every GPU hidden
    assert gpu.visible_entries({"CUDA_VISIBLE_DEVICES": "0, 2,bogus,3"}) == ["0", "2"]  # CUDA stops there
    with pytest.raises(LookupError, match="this node has 4 GPU"):
        _device(state, CUDA_VISIBLE_DEVICES="7")
    with pytest.raises(LookupError, match="LOCAL_RANK 2"):
        _device(state, CUDA_VISIBLE_DEVICES="0,1", LOCAL_RANK="2")
    with pytest.raises(LookupError, match="matches 4 GPUs"):
        _device(state, CUDA_VISIBLE_DEVICES="GPU-")


def test_fastest_first_order_is_named_only_where_the_models_differ(tmp_path: Path) -> None:
    same = _machine(tmp_path / "same.json")
    assert _device(same, CUDA_VISIBLE_DEVICES="1")[2] is None  # one model: FASTEST_FIRST is PCI order
    mixed = _machine(tmp_path / "mixed.json", names=["NVIDIA A100", "NVIDIA H100", "NVIDIA A100", "NVIDIA H100"])
    bus, index, warning = _device(mixed, CUDA_VISIBLE_DEVICES="1")
    assert (bus, index) == (BUSES[1], 1) and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in warning
    assert _device(mixed, CUDA_VISIBLE_DEVICES="1", CUDA_DEVICE_ORDER="PCI_BUS_ID")[2] is None
    assert _device(mixed, CUDA_VISIBLE_DEVICES="GPU-1aaa1")[2] is None  # a UUID is unambiguous


def _node(state: Path, ranks: dict[int, dict[str, str]], expect: bool = True):
    sent: list[dict] = []
    envs = {r: _env(state, **e) for r, e in ranks.items()}
    return gpu.NodeGpus(envs, "node-1", 1, sent.append, expect_gpus=expect), sent


def test_samples_of_the_ranks_gpus_and_unsupported_ecc_is_no_error(tmp_path: Path) -> None:
    state = _machine(tmp_path / "m.json")
    _edit(state, lambda s: s["gpus"][3].update(ecc=None))
    node, sent = _node(state, {4: {"CUDA_VISIBLE_DEVICES": "1,3", "LOCAL_RANK": "0"},
                               5: {"CUDA_VISIBLE_DEVICES": "1,3", "LOCAL_RANK": "1"}})
    rows = node.samples()
    assert [(r["gpu"], r["gpu_index"], r["ranks"]) for r in rows] == [(BUSES[1], 1, [4]), (BUSES[3], 3, [5])]
    assert rows[0]["utilization"] == 0.2 and rows[0]["memory_used"] == 2 << 30 and rows[0]["power_watts"] == 300.001
    assert rows[0]["temperature_c"] == 41 and rows[0]["sm_clock_mhz"] == 1980 and rows[0]["memory_clock_mhz"] == 2619
    assert rows[0]["throttle"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert (rows[0]["ecc_single"], rows[0]["ecc_double"]) == (1, 0)
    assert "ecc_single" not in rows[1] and node.errors == {} and sent == []


def test_nvml_errors_are_counted_reported_once_and_retried(tmp_path: Path) -> None:
    state = _machine(tmp_path / "m.json", fail={"nvmlDeviceGetPowerUsage": 2})
    node, sent = _node(state, {0: {"CUDA_VISIBLE_DEVICES": "0"}})
    first, second, third = node.samples(), node.samples(), node.samples()
    assert "power_watts" not in first[0] and "power_watts" not in second[0] and third[0]["power_watts"] == 300.0
    assert first[0]["utilization"] == 0.1  # the other values are still served
    assert node.errors == {("nvmlDeviceGetPowerUsage", "Unknown"): 2}
    assert len(sent) == 1 and sent[0]["type"] == "warning" and "nvmlDeviceGetPowerUsage failed" in sent[0]["message"]
    # failing all the time: NVML is shut down and initialised again, and never turned off
    _edit(state, lambda s: s.update(fail={"nvmlDeviceGetUtilizationRates": -1}))
    for _ in range(gpu.REINIT_AFTER):
        node.samples()
    assert node._mod is None  # starts afresh at the next call
    _edit(state, lambda s: s.update(fail={}))
    assert node.samples()[0]["utilization"] == 0.1
    assert node.errors[("nvmlDeviceGetUtilizationRates", "Unknown")] == gpu.REINIT_AFTER
    assert len(sent) == 2  # one warning per kind, not per scrape


def test_nvml_that_cannot_start_is_retried_where_gpus_are_expected(tmp_path: Path) -> None:
    state = _machine(tmp_path / "m.json", fail={"nvmlInit": 1})
    node, sent = _node(state, {0: {"CUDA_VISIBLE_DEVICES": "0"}})
    assert node.samples() == [] and node.errors == {("nvmlInit", "Unknown"): 1}
    assert "nvmlInit failed" in sent[0]["message"]
    assert node.samples()[0]["gpu"] == BUSES[0] and len(sent) == 1


def test_fault_xids_and_double_bit_ecc_become_gpu_faults_others_are_counted(tmp_path: Path) -> None:
    state = _machine(tmp_path / "m.json", events=[{"gpu": 1, "xid": 79}])  # before the event set: not seen
    node, sent = _node(state, {2: {"CUDA_VISIBLE_DEVICES": "1"}, 3: {"CUDA_VISIBLE_DEVICES": "2"}})
    assert node.poll() == []
    _edit(state, lambda s: s["events"].extend([{"gpu": 1, "xid": 13}, {"gpu": 1, "xid": 79}, {"gpu": 0, "xid": 79},
                                               {"gpu": 2, "dbe": True}]))
    faults = node.poll()  # GPU 0 is not this node's ranks': not registered
    assert [(f["gpu"], f["gpu_index"], f["xid"], f["ecc"], f["ranks"]) for f in faults] == [
        (BUSES[1], 1, 79, None, [2]), (BUSES[2], 2, None, "double_bit", [3])]
    assert "fallen off the bus" in faults[0]["what"] and sent == faults
    assert node.xids == {(BUSES[1], 13): 1, (BUSES[1], 79): 1}
    assert node.poll() == []  # each event once


def test_the_families_carry_rank_and_gpu_labels(tmp_path: Path) -> None:
    state = _machine(tmp_path / "m.json", fail={"nvmlDeviceGetTemperature": 1})
    node, _ = _node(state, {6: {"CUDA_VISIBLE_DEVICES": "2"}})
    collector = NodeCollector("j-1", 2, "node-1", lambda: {}, gpus=node)
    fams = {f.name: f for f in collector.collect()}
    (util,) = fams["orch_rank_gpu_utilization_ratio"].samples
    assert util.labels == {"job": "j-1", "attempt": "2", "node": "node-1", "rank": "6", "gpu": BUSES[2],
                           "gpu_index": "2"} and util.value == pytest.approx(0.3)
    assert fams["orch_rank_gpu_sm_clock_hertz"].samples[0].value == 1980e6
    assert {s.labels["reason"]: s.value for s in fams["orch_rank_gpu_clock_throttle"].samples}["sw_power_cap"] == 1
    assert fams["orch_gpu_nvml_errors"].samples[0].labels["call"] == "nvmlDeviceGetTemperature"
    assert len(fams["orch_node_gpu_utilization_ratio"].samples) == 4  # the node's series, through the same NVML


# A rank that prints what it sees and, on the first attempt, sleeps until stopped.
SCRIPT = textwrap.dedent("""
    import os, time
    n = int(os.environ["ORCH_RESTART_COUNT"])
    print(f"step=1 loss=1.0 restart={n} node={os.environ['ORCH_NODE']} "
          f"cvd={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    if n == 0:
        time.sleep(120)
""")


def _scrape(port: int) -> dict[str, list]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.mark.integration
def test_per_rank_series_then_an_xid_79_fails_the_attempt_and_leaves_the_node_out(
        orch, write_spec, hostfile, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SCRIPT)
    states = {n: _machine(tmp_path / f"node-{n}.json") for n in range(3)}  # each "node" its own machine
    spec = write_spec(name="gpus", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\nnode-2 slots=1\n")),
                      num_nodes=2, entrypoint=str(script),
                      stop_grace_seconds=2, env={"ORCH_FAKE_NVML": FAKE},
                      node_env={f"node-{n}": {"ORCH_FAKE_NVML_STATE": str(p)} for n, p in states.items()},
                      restart={"max_restarts": 1, "backoff_seconds": 0, "exclude_failed_nodes": True})
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 30, "the job")
        wait_for(lambda: orch.json("status", job_id)["state"] == "RUNNING", 60, "RUNNING")
        ports = {e.data["node_rank"]: e.data["metrics_port"] for e in orch.events(job_id, "ranks_started")}
        series = wait_for(lambda: (lambda f: f if "orch_rank_gpu_power_watts" in f else None)(_scrape(ports[1])),
                          30, "node 1's GPU series")
        (util,) = series["orch_rank_gpu_utilization_ratio"]
        assert {k: util.labels[k] for k in ("node", "rank", "gpu", "gpu_index")} == {
            "node": "node-1", "rank": "1", "gpu": BUSES[0], "gpu_index": "0"} and util.value == pytest.approx(0.1)
        assert series["orch_rank_gpu_memory_total_bytes"][0].value == 80 << 30
        assert series["orch_rank_gpu_temperature_celsius"][0].value == 40
        assert len(series["orch_node_gpu_utilization_ratio"]) == 4  # the node's series go on
        _edit(states[1], lambda s: s["events"].append({"gpu": 0, "xid": 79}))  # node 1's GPU falls off the bus
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == 0, out + err
    detail = orch.json("status", job_id)
    first, second = detail["attempts"]
    cause = first["cause"]
    assert cause["kind"] == "gpu_fault" and cause["node"] == "node-1" and cause["node_rank"] == 1, cause
    assert (cause["gpu"], cause["gpu_index"], cause["xid"], cause["ranks"]) == (BUSES[0], 0, 79, [1])
    assert "GPU fault on node-1 (node 1): GPU 0 (00000000:1A:00.0) reported Xid 79" in cause["message"]
    assert first["nodes"] == ["node-0", "node-1"] and second["nodes"] == ["node-0", "node-2"]
    assert detail["state"] == "SUCCEEDED" and detail["spec"]["exclude_hosts"] == ["node-1"]
    (ev,) = orch.events(job_id, "restart_scheduled")
    assert ev.data["exclude_hosts"] == ["node-1"] and ev.data["cause_kind"] == "gpu_fault"
    assert "cvd=0" in orch("logs", job_id, "--rank", "1").stdout  # its slot on node-2, in the restart
    assert_no_leftovers(job_id)
