"""The environment that reaches the ranks is decided per node (issue 19, item 1).

DeepSpeed's runner exports the variables of its accelerator's prefixes (``NCCL`` for CUDA) from the
head node's environment, so on a CPU-only login node it exports none. orch's plan carries the
controller's variables per accelerator (``orchestrator.planning.node_layers``), and each node's agent
lays the layer of its own accelerator (reported in its hello) under the node's environment. Also the
spec's ``node_env`` (variables by host pattern).

The end-to-end test runs a controller with no accelerator (``DS_ACCELERATOR=cpu``, as conftest sets it,
no /dev/nvidiactl) against three ssh hosts (tests/nethosts.py): two whose login environment says
``DS_ACCELERATOR=cuda`` (what an agent on a GPU node reports; the probe rank imports neither torch nor
DeepSpeed, so no GPU is needed), one of them with its own ``NCCL_IB_HCA``; and one CPU host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agents.nodeenv import node_accelerator, rank_env
from orchestrator.errors import PlanError
from orchestrator.planning import make_plan
from orchestrator.planning.node_layers import accelerator_layers, node_env_layer, unmatched_patterns
from orchestrator.planning.plan import PlanInputs
from orchestrator.planning.pool import resolve_pool
from orchestrator.spec import spec_from_dict
from orchestrator.store import Store

from conftest import ROOT

PROBE = ROOT / "tests" / "probe.py"
CONTROLLER_NCCL = {"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5_0"}


# --------------------------------------------------------------------------- the plan (pure)

def _plan(tmp_path: Path, launcher: str = "pdsh", env: dict | None = None, controller: dict | None = None,
          hosts: tuple[str, ...] = ("gpu-a-0", "gpu-a-1", "cpu-0"), **fields):
    (tmp_path / "t.py").write_text("")
    spec = spec_from_dict({"name": "n", "entrypoint": "t.py", "launcher": launcher, "env": env or {}, **fields},
                          base_dir=tmp_path)
    pool = resolve_pool({h: 1 for h in hosts})
    inputs = PlanInputs(job_id="j", master_port=29500, run_dir=str(tmp_path / "run"),
                        checkpoint_dir=str(tmp_path / "ck"), python="/usr/bin/python3", accelerator="cpu",
                        controller_env={"PATH": "/usr/bin", "PYTHONHASHSEED": "0", **(controller or CONTROLLER_NCCL)},
                        controller_cwd=str(tmp_path))
    return make_plan(spec, pool, inputs)


def test_the_accelerators_exports_travel_beside_the_ranks_env_not_in_it(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    for node in plan.nodes:
        assert node.accelerator_env["cuda"] == CONTROLLER_NCCL
        assert not any(k.startswith("NCCL_") for r in node.ranks for k in r.env)
        assert node.ranks[0].env["PYTHONHASHSEED"] == "0"  # the runner's own prefixes are still exported
    assert "NCCL_DEBUG" not in plan.exports
    # the spec's env and .deepspeed_env win wherever they name the variable
    plan = _plan(tmp_path, env={"NCCL_DEBUG": "WARN"})
    assert plan.nodes[0].accelerator_env["cuda"] == {"NCCL_IB_HCA": "mlx5_0"}
    assert plan.nodes[0].ranks[0].env["NCCL_DEBUG"] == "WARN"
    # one node, or a launcher that exports nothing (nossh, standard): no layer, as DeepSpeed's runner
    assert _plan(tmp_path, hosts=("gpu-a-0",)).nodes[0].accelerator_env == {}
    assert _plan(tmp_path, launcher="nossh").nodes[0].accelerator_env == {}
    # DeepSpeed's EXCLUDE_ENVS still apply; what is exported anyway is not repeated in a layer
    layers = accelerator_layers({"NCCL_DEBUG": "INFO", "AISC_JOB_NAME": "x", "NCCL_IB_HCA": "m"}, "/w",
                                {"PYTHONPATH": "/w"}, {})
    assert layers["cuda"] == {"NCCL_DEBUG": "INFO"}  # runner.py EXCLUDE_ENVS under AISC


def test_the_agent_lays_its_accelerators_layer_under_the_nodes_own_environment() -> None:
    node = {"accelerator_env": {"cuda": dict(CONTROLLER_NCCL)}, "env_defaults": {}}
    rank = {"env": {"RANK": "0"}}
    gpu_node = {"DS_ACCELERATOR": "cuda", "NCCL_IB_HCA": "mlx5_3"}
    env = rank_env(gpu_node, node, rank)
    assert env["NCCL_IB_HCA"] == "mlx5_3" and env["NCCL_DEBUG"] == "INFO"  # the node's own wins
    cpu = rank_env({"DS_ACCELERATOR": "cpu"}, node, rank)
    assert "NCCL_DEBUG" not in cpu and "NCCL_IB_HCA" not in cpu
    # a rank's own DS_ACCELERATOR (the spec's env) decides, as it decides DeepSpeed's accelerator in the rank
    assert rank_env({"DS_ACCELERATOR": "cuda"}, node, {"env": {"DS_ACCELERATOR": "cpu"}}).get("NCCL_DEBUG") is None
    assert node_accelerator({"DS_ACCELERATOR": "xpu"}) == "xpu"
    assert node_accelerator({}) == ("cuda" if os.path.exists("/dev/nvidiactl") else "cpu")


def test_node_env_applies_by_host_pattern_over_env_and_exports(tmp_path: Path) -> None:
    plan = _plan(tmp_path, env={"A": "all", "B": "all"},
                 node_env={"gpu-a-*": {"A": "gpu", "PYTHONHASHSEED": "7"}, "gpu-a-1": {"A": "one"},
                           "nowhere-*": {"C": "x"}})
    envs = [n.ranks[0].env for n in plan.nodes]
    assert [e["A"] for e in envs] == ["gpu", "one", "all"]      # in the order written, a later entry wins
    assert [e["B"] for e in envs] == ["all"] * 3
    assert [e["PYTHONHASHSEED"] for e in envs] == ["7", "7", "0"]  # over the runner's export
    assert any("node_env: pattern 'nowhere-*' matches no node" in w for w in plan.warnings)
    assert node_env_layer({"gpu-?-0": {"X": "1"}}, "gpu-a-0") == {"X": "1"}
    assert node_env_layer({"GPU-*": {"X": "1"}}, "gpu-a-0") == {}  # case-sensitive, as host names in a hostfile
    assert unmatched_patterns({"gpu-*": {}}, ["gpu-1"]) == []
    with pytest.raises(PlanError, match=r"node_env for gpu-a-0: MASTER_PORT, RANK set by the pdsh launcher"):
        _plan(tmp_path, node_env={"gpu-a-0": {"RANK": "3", "MASTER_PORT": "1"}})


# --------------------------------------------------------------------------- real ssh hosts

def test_cuda_nodes_get_the_controllers_nccl_variables_under_their_own(orch, write_spec, hostfile, net3,
                                                                          tmp_path: Path) -> None:
    assert os.environ.get("DS_ACCELERATOR") == "cpu" and not any(k.startswith("NCCL_") for k in os.environ)
    names = net3.names
    net3.set_session_env(0, {"DS_ACCELERATOR": "cuda", "NCCL_IB_HCA": "mlx5_3"})
    net3.set_session_env(1, {"DS_ACCELERATOR": "cuda"})
    try:
        p = net3.client_params()
        out_dir = tmp_path / "out"
        spec = write_spec(
            name="accel", hostfile=str(hostfile("".join(f"{n} slots=1\n" for n in names))), provisioner="ssh",
            launcher="pdsh", entrypoint=str(PROBE), stop_grace_seconds=5,
            ssh={"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"]},
            env={"OMP_NUM_THREADS": "1", "PROBE_OUT_DIR": str(out_dir)},
            node_env={names[2]: {"ORCH_TEST_HOST_CLASS": "cpu"}, f"{names[0][:-1]}[01]": {"NCCL_IB_TIMEOUT": "22"}})
        r = orch("run", str(spec), timeout=180, env=CONTROLLER_NCCL)
        assert r.returncode == 0, r.stdout + r.stderr
        envs = {int(f.stem[4:]): json.loads(f.read_text())["env"] for f in out_dir.glob("rank*.json")}
        assert sorted(envs) == [0, 1, 2]
        # node 0 sets its own NCCL_IB_HCA: the controller's is not leaked over it; NCCL_DEBUG it lacks
        assert (envs[0]["NCCL_IB_HCA"], envs[0]["NCCL_DEBUG"]) == ("mlx5_3", "INFO")
        # node 1 sets none: it gets the controller's, as DeepSpeed's runner on a GPU head node exports them
        assert (envs[1]["NCCL_IB_HCA"], envs[1]["NCCL_DEBUG"]) == ("mlx5_0", "INFO")
        # node 2 is a CPU node: DeepSpeed's CPU accelerator exports no NCCL_*
        assert "NCCL_IB_HCA" not in envs[2] and "NCCL_DEBUG" not in envs[2]
        assert [envs[i].get("NCCL_IB_TIMEOUT") for i in range(3)] == ["22", "22", None]
        assert [envs[i].get("ORCH_TEST_HOST_CLASS") for i in range(3)] == [None, None, "cpu"]
        (job,) = orch.json("list")
        store = Store(orch.state_dir / "orch.db")
        try:
            up = {e.data["node_rank"]: e.data["accelerator"] for e in store.events(job["id"]) if e.kind == "agent_up"}
        finally:
            store.close()
        assert up == {0: "cuda", 1: "cuda", 2: "cpu"}
    finally:
        for i in (0, 1):
            net3.set_session_env(i, {})
