"""Devices the scheduler assigned (CUDA_VISIBLE_DEVICES set before orch starts): slots index into them.

Pure tests of agents/devices.py, and ``orch run`` of the probe (tests/probe.py) on two local "nodes"
with ``CUDA_VISIBLE_DEVICES=4,5`` in the environment orch starts with (local agents' node environment
is the controller's): every rank's CUDA_VISIBLE_DEVICES names devices 4 and 5, never 0 and 1, for
launch.py's semantics (pdsh) and for an MPI launcher (whose ranks inherit the list and index it by
LOCAL_RANK); ``orch plan`` shows each slot's device; a slot past the list is a clear error before
anything starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.devices import describe, mapped

PROBE = Path(__file__).with_name("probe.py")


def test_mapped_devices():
    node = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert mapped({"CUDA_VISIBLE_DEVICES": "0,1"}, node, "n0") == "4,5"
    assert mapped({"CUDA_VISIBLE_DEVICES": "1"}, node, "n0") == "5"
    assert mapped({"RANK": "0"}, node, "n0") is None  # inherited: nothing to map
    assert mapped({"CUDA_VISIBLE_DEVICES": "0,1"}, {}, "n0") is None
    assert mapped({"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, "n0") == "GPU-bb"
    with pytest.raises(ValueError, match=r"n0: the job uses slot\(s\) 0,1,2 .*CUDA_VISIBLE_DEVICES=4,5 .* 2 device"):
        mapped({"CUDA_VISIBLE_DEVICES": "0,1,2"}, node, "n0")
    assert describe(node, [0, 1, 2]) == ["4", "5", "?"] and describe({}, [0]) is None
    assert mapped({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": ""}, "n0") is None  # "no GPU": nothing to map
    with pytest.raises(ValueError, match="names device 4 twice"):
        mapped({"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "4,4"}, "n0")


def _run(orch, write_spec, hostfile, tmp_path, slots=2, **fields):
    out = tmp_path / "out"
    hosts = hostfile(f"node-0 slots={slots}\nnode-1 slots={slots}\n")
    spec = write_spec(name="dev", hostfile=str(hosts), entrypoint=str(PROBE),
                      env={"PROBE_OUT_DIR": str(out)}, stop_grace_seconds=5, **fields)
    r = orch("run", str(spec), "--output", "json", env={"CUDA_VISIBLE_DEVICES": "4,5"}, timeout=120)
    return r, out


@pytest.mark.integration
@pytest.mark.parametrize("launcher,include,expected", [
    ("pdsh", "", {0: "4,5", 1: "4,5", 2: "4,5", 3: "4,5"}),
    ("pdsh", "node-0:1@node-1", {0: "5", 1: "4,5", 2: "4,5"}),
    ("openmpi", "", {0: "4,5", 1: "4,5", 2: "4,5", 3: "4,5"}),
])
def test_ranks_get_the_assigned_devices(orch, write_spec, hostfile, tmp_path, launcher, include, expected):
    r, out = _run(orch, write_spec, hostfile, tmp_path, launcher=launcher, include=include)
    detail = json.loads(r.stdout)
    assert r.returncode == 0 and detail["state"] == "SUCCEEDED", (detail.get("cause"), r.stderr[-2000:])
    import probe
    reports = probe.load_probe_outputs(str(out))
    assert {rank: rep["env"]["CUDA_VISIBLE_DEVICES"] for rank, rep in reports.items()} == expected
    plan = orch("plan", str(write_spec(name="dev2", hostfile=str(tmp_path / "hostfile"), entrypoint=str(PROBE),
                                       launcher=launcher, include=include)), env={"CUDA_VISIBLE_DEVICES": "4,5"})
    text = " ".join(plan.stdout.split())
    assert "0 (device 4)" in text and "CUDA_VISIBLE_DEVICES=4,5 on this machine" in text, plan.stdout[-3000:]


@pytest.mark.integration
def test_a_slot_past_the_assigned_devices_is_refused_before_anything_starts(orch, write_spec, hostfile, tmp_path):
    r, out = _run(orch, write_spec, hostfile, tmp_path, slots=4, num_gpus=3)  # the hostfile has them, the machine not
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "node-0 uses slot(s) 0,1,2, but CUDA_VISIBLE_DEVICES=4,5" in err and "2 device(s)" in err, err
    assert not out.exists()
