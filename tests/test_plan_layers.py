"""A rank's environment in the plan is the spec's ``env``, the launcher's variables, Accelerate's and orch's,
each laid over those before it, whichever way the planner builds it (once per node for pdsh and nossh:
``NodeRanks``), and planning leaves the garbage collector as it found it."""

from __future__ import annotations

import collections
import dataclasses
import gc

import pytest

from orchestrator.launchers import get_launcher
from orchestrator.planning import PlanInputs, make_plan, resolve_pool
from orchestrator.planning.plan import orch_env
from orchestrator.spec import spec_from_dict


def _setup(tmp_path, launcher: str, env: dict, counts=(3, 2, 3)):
    (tmp_path / "train.py").write_text("")
    spec = spec_from_dict({"name": "layers", "entrypoint": "train.py", "workdir": str(tmp_path), "launcher": launcher,
                           "provisioner": "ssh", "env": env}, tmp_path)
    inputs = PlanInputs(job_id="layers-1", master_port=29500, run_dir="/runs/layers/attempt-1", checkpoint_dir="/ck",
                        python="/usr/bin/python3", controller_env={"PYTHONPATH": "/p", "NCCL_X": "1"})
    pool = resolve_pool(collections.OrderedDict((f"h{i}", n) for i, n in enumerate(counts)))
    return spec, pool, inputs


def _merged(spec, inputs, plan, launcher_name: str) -> list[list[tuple[str, str]]]:
    """Every rank's environment as ``{**spec.env, **launcher env, **accelerate_env, **orch_env}``, merged here
    rank by rank from the launcher's own ``ranks`` (items, so key order counts)."""
    from orchestrator.launchers.base import LaunchContext
    launcher = get_launcher(launcher_name)
    ctx = LaunchContext(world=plan_world(plan), master_addr=plan.master_addr, master_port=plan.master_port,
                        python=inputs.python, entrypoint=spec.entrypoint, workdir=spec.workdir,
                        exports={k: v for k, v in plan.exports.items() if k not in spec.env}, run_id=inputs.job_id)
    out = []
    for node in plan.nodes:
        extra = orch_env(spec, inputs, node.node_rank, node.host)
        for r in launcher.ranks(ctx, node.node_rank):
            out.append(list({**spec.env, **r.env, **inputs.accelerate_env, **extra}.items()))
    return out


def plan_world(plan):
    return tuple((n.host, tuple(n.slots)) for n in plan.nodes)


@pytest.mark.parametrize("launcher", ["pdsh", "nossh", "openmpi", "standard"])
@pytest.mark.parametrize("env,accelerate", [
    ({"NCCL_DEBUG": "WARN"}, {}),
    ({"RANK": "99", "MASTER_PORT": "1"}, {}),  # the spec names launcher variables: its place, the launcher's value
    ({"A": "1"}, {"LOCAL_RANK": "7", "ACCELERATE_X": "y"}),  # a later layer sets a rank's own variable
])
def test_rank_env_is_the_layers_merged_in_order(tmp_path, launcher, env, accelerate) -> None:
    spec, pool, inputs = _setup(tmp_path, launcher, env)
    inputs = dataclasses.replace(inputs, accelerate_env=accelerate)
    plan = make_plan(spec, pool, inputs)
    got = [list(r.env.items()) for _, r in plan.ranks()]
    assert got == _merged(spec, inputs, plan, launcher)
    envs = [r.env for _, r in plan.ranks()]
    assert len({id(e) for e in envs}) == len(envs)  # each rank its own dict


def test_node_ranks_is_ranks_in_two_parts(tmp_path) -> None:
    spec, pool, inputs = _setup(tmp_path, "pdsh", {})
    plan = make_plan(spec, pool, inputs)
    from orchestrator.launchers.base import LaunchContext
    ctx = LaunchContext(world=plan_world(plan), master_addr="m", master_port=1, python="/usr/bin/python3",
                        entrypoint="train.py", exports={"X": "1"})
    for name in ("pdsh", "nossh"):
        launcher = get_launcher(name)
        for node_rank in range(len(plan.nodes)):
            laid = launcher.node_ranks(ctx, node_rank)
            assert all(tuple(own) == laid.names for *_, own in laid.ranks)
            assert laid.launches() == launcher.ranks(ctx, node_rank)


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_leaves_the_collector_as_it_was(tmp_path, enabled: bool) -> None:
    spec, pool, inputs = _setup(tmp_path, "pdsh", {})
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        make_plan(spec, pool, inputs)
        assert gc.isenabled() is enabled
        with pytest.raises(Exception):
            make_plan(spec, resolve_pool(collections.OrderedDict()), inputs)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_network_preview_of_other_hosts_names_the_jobs_interface_or_the_route(tmp_path) -> None:
    from orchestrator.supervision.prepare import network_preview
    spec, pool, inputs = _setup(tmp_path, "pdsh", {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": ""})
    plan = make_plan(spec, pool, dataclasses.replace(inputs, accelerate_env_defaults={"GLOO_SOCKET_IFNAME": "ib0"}))
    assert network_preview(plan) == {n: "NCCL_SOCKET_IFNAME=eth1 (the job's environment)" for n in range(3)}
    spec, pool, inputs = _setup(tmp_path, "pdsh", {"NCCL_DEBUG": "INFO"})
    plan = make_plan(spec, pool, dataclasses.replace(inputs, accelerate_env_defaults={"GLOO_SOCKET_IFNAME": "ib0"}))
    assert network_preview(plan) == {n: "GLOO_SOCKET_IFNAME=ib0 (the job's environment)" for n in range(3)}
    spec, pool, inputs = _setup(tmp_path, "pdsh", {})
    plan = make_plan(spec, pool, inputs)
    assert network_preview(plan) == {n: f"chosen on the node: the one that routes to {plan.master_addr}"
                                     for n in range(3)}
