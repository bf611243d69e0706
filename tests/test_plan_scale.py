"""Large plans (issue 18: the planner is linear in nodes): the plan of thousands of nodes is checked against
an expectation computed here independently, node by node, from the pool alone (no timing: bench/plan_scale.py).
"""

from __future__ import annotations

import collections

import pytest

from orchestrator.errors import LaunchError
from orchestrator.launchers import get_launcher
from orchestrator.launchers.base import LaunchContext
from orchestrator.planning import PlanInputs, make_plan, resolve_pool
from orchestrator.spec import spec_from_dict


def _spec(tmp_path, **fields):
    (tmp_path / "train.py").write_text("")
    base = {"name": "big", "entrypoint": "train.py", "workdir": str(tmp_path), "provisioner": "ssh",
            "metrics_port": 9100}
    base.update(fields)
    return spec_from_dict(base, tmp_path)


def _inputs() -> PlanInputs:
    return PlanInputs(job_id="big-1", master_port=29500, run_dir="/runs/big/attempt-1", checkpoint_dir="/ck",
                      python="/usr/bin/python3")


def _expected(counts: list[int]) -> list[tuple[int, int, int, int]]:
    """``(node, global rank, LOCAL_RANK as launch.py gives it, slot)`` of every rank, counted one by one:
    ranks numbered node by node, ``LOCAL_RANK = RANK % ranks on the node`` (deepspeed/launcher/launch.py)."""
    out, rank = [], 0
    for node, n in enumerate(counts):
        for _ in range(n):
            out.append((node, rank, rank % n, rank % n))
            rank += 1
    return out


@pytest.mark.parametrize("nodes,slots", [(1, 8), (64, 8), (4096, 8)])
def test_a_large_pdsh_plan_numbers_every_rank_as_launch_py(tmp_path, nodes: int, slots: int) -> None:
    hosts = collections.OrderedDict((f"node{i:05d}", slots) for i in range(nodes))
    plan = make_plan(_spec(tmp_path), resolve_pool(hosts), _inputs())
    assert plan.world_size == nodes * slots and len(plan.nodes) == nodes
    got = [(n.node_rank, r.global_rank, r.local_rank, r.slot) for n, r in plan.ranks()]
    assert got == _expected([slots] * nodes)
    assert [n.host for n in plan.nodes] == list(hosts)
    assert [n.ranks[0].global_rank for n in plan.nodes] == [i * slots for i in range(nodes)]  # rank offsets
    assert {n.metrics_port for n in plan.nodes} == {9100}  # ssh: every node on its own host
    last_node = plan.nodes[-1]
    first, last = plan.nodes[0].ranks[0], last_node.ranks[-1]
    for node, rank, local in ((plan.nodes[0], first, 0), (last_node, last, slots - 1)):
        env = rank.env
        assert env["RANK"] == str(rank.global_rank) and env["LOCAL_RANK"] == str(local)
        assert env["WORLD_SIZE"] == str(nodes * slots) and env["CROSS_SIZE"] == str(nodes)
        assert env["CROSS_RANK"] == env["ORCH_NODE_RANK"] == str(node.node_rank)
        assert env["LOCAL_SIZE"] == str(slots) and env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(slots)))
        assert env["ORCH_NODE"] == node.host and env["MASTER_PORT"] == "29500"
        assert rank.argv[-1] == f"--local_rank={local}"
    assert last.global_rank == nodes * slots - 1


def test_uneven_nodes_rotate_local_ranks_as_launch_py(tmp_path) -> None:
    counts = [(i % 5) + 1 for i in range(301)]  # 1..5 slots, so offsets are not a multiple of anything
    hosts = collections.OrderedDict((f"n{i}", c) for i, c in enumerate(counts))
    for launcher in ("pdsh", "nossh"):
        plan = make_plan(_spec(tmp_path, launcher=launcher), resolve_pool(hosts), _inputs())
        got = [(n.node_rank, r.global_rank, r.local_rank, r.slot) for n, r in plan.ranks()]
        assert got == _expected(counts)
        assert all(r.env["RANK"] == str(r.global_rank) for _, r in plan.ranks())


@pytest.mark.parametrize("launcher,rank_var,size_var,node_var", [
    ("standard", "RANK", "WORLD_SIZE", "GROUP_RANK"), ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", None),
    ("mpich", "PMI_RANK", "PMI_SIZE", None), ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODEID")])
def test_other_launchers_number_512_nodes_in_order(tmp_path, launcher: str, rank_var: str, size_var: str,
                                                     node_var: str | None) -> None:
    nodes, slots = 512, 8
    hosts = collections.OrderedDict((f"node{i:04d}", slots) for i in range(nodes))
    plan = make_plan(_spec(tmp_path, launcher=launcher), resolve_pool(hosts), _inputs())
    expected = [(node, rank, rank - node * slots) for node, rank, _, _ in _expected([slots] * nodes)]
    assert [(n.node_rank, r.global_rank, r.local_rank) for n, r in plan.ranks()] == expected
    for node in (plan.nodes[0], plan.nodes[-1]):
        for rank in (node.ranks[0], node.ranks[-1]):
            assert rank.env[rank_var] == str(rank.global_rank) and rank.env[size_var] == str(nodes * slots)
            assert rank.env["LOCAL_RANK"] == str(rank.local_rank)
            if node_var:
                assert rank.env[node_var] == str(node.node_rank)
    if launcher == "slurm":
        env = plan.nodes[-1].ranks[0].env
        assert env["SLURM_STEP_NODELIST"] == "node[0000-0511]" and env["SLURM_TASKS_PER_NODE"] == "8(x512)"
        assert env["SLURM_GTIDS"] == ",".join(str(nodes * slots - slots + i) for i in range(slots))


def test_local_metrics_ports_count_earlier_nodes(tmp_path) -> None:
    hosts = collections.OrderedDict((f"n{i}", 1) for i in range(100))
    plan = make_plan(_spec(tmp_path, provisioner="local"), resolve_pool(hosts), _inputs())
    assert [n.metrics_port for n in plan.nodes] == list(range(9100, 9200))


def test_a_context_refused_once_is_refused_every_time() -> None:
    """What a launcher checks once per context (and keeps) still refuses every node of a bad context."""
    bad = LaunchContext(world=(("a", (0,)), ("a", (1,))), master_addr="a", master_port=1, python="p", entrypoint="t.py")
    for name in ("pdsh", "standard", "openmpi", "slurm"):
        for node_rank in (0, 1, 0):
            with pytest.raises(LaunchError, match="a host appears twice"):
                get_launcher(name).ranks(bad, node_rank)
    uneven = LaunchContext(world=(("a", (0,)), ("b", (0, 1))), master_addr="a", master_port=1, python="p",
                           entrypoint="t.py")
    for node_rank in (0, 1):
        with pytest.raises(LaunchError, match="same number of ranks"):
            get_launcher("mpich").ranks(uneven, node_rank)
        with pytest.raises(LaunchError, match="same slot count"):
            get_launcher("slurm").ranks(uneven, node_rank)
    assert uneven.world_size == 3 and uneven.rank_offsets == (0, 1) and uneven.hosts == ("a", "b")
