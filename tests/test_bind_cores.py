"""``bind_cores`` (agents/binding.py): which CPUs each rank gets, computed against a fake sysfs tree (the
``ORCH_SYSFS_ROOT`` and ``ORCH_FAKE_GPU_BUS_IDS`` seams), and end to end on the local provisioner: ranks
pinned to their slots' CPUs with ``OMP_NUM_THREADS`` set, exec'd and forked (``fast_start on``); a slot the
map lacks fails the start by name; ``orch plan`` shows the CPUs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from agents import binding
from conftest import assert_no_leftovers

ALL = range(16)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture()
def sysfs(tmp_path: Path) -> Path:
    """2 NUMA nodes x 8 CPUs (0-7, 8-15, no hyperthreads); 4 GPUs: 0000:17 and 0000:31 on node 0,
    0000:b1 and 0000:ca on node 1."""
    root = tmp_path / "root"
    for node, cpus in ((0, "0-7"), (1, "8-15")):
        _write(root / f"sys/devices/system/node/node{node}/cpulist", cpus)
    for cpu in ALL:
        _write(root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", str(cpu))
    for bus, node in (("17", 0), ("31", 0), ("b1", 1), ("ca", 1)):
        _write(root / f"sys/bus/pci/devices/0000:{bus}:00.0/numa_node", str(node))
    return root


def _env(root: Path, **more: str) -> dict[str, str]:
    # nvidia-smi's form (8-digit domain, upper case) for two of them: the seam takes both
    return {binding.SYSFS_ENV: str(root),
            binding.FAKE_BUS_IDS_ENV: "00000000:17:00.0,0000:31:00.0,00000000:B1:00.0,0000:ca:00.0", **more}


def _ranks(n: int, first_slot: int = 0) -> list[dict]:
    return [{"global_rank": 10 + i, "local_rank": i, "slot": first_slot + i} for i in range(n)]


def test_auto_gives_each_rank_cores_of_its_gpu_s_numa_node(sysfs) -> None:
    got = binding.rank_cpus("auto", _ranks(4), "gpu-a", _env(sysfs), ALL, gpus=True)
    assert got == {10: [0, 1, 2, 3], 11: [4, 5, 6, 7], 12: [8, 9, 10, 11], 13: [12, 13, 14, 15]}


def test_auto_follows_the_node_s_assigned_devices(sysfs) -> None:
    # CUDA_VISIBLE_DEVICES=2,3,0,1 (a scheduler's): slots 0 and 1 are GPUs 2 and 3, both on NUMA node 1
    got = binding.rank_cpus("auto", _ranks(2), "gpu-a", _env(sysfs, CUDA_VISIBLE_DEVICES="2,3,0,1"), ALL, gpus=True)
    assert got == {10: [8, 9, 10, 11], 11: [12, 13, 14, 15]}


def test_auto_splits_only_the_cpus_the_agent_may_use(sysfs) -> None:
    got = binding.rank_cpus("auto", _ranks(4), "gpu-a", _env(sysfs), {0, 1, 2, 3, 8, 9}, gpus=True)
    assert got == {10: [0, 1], 11: [2, 3], 12: [8], 13: [9]}


def test_auto_with_too_few_cores_for_a_numa_node_s_ranks_names_node_and_numa_node(sysfs) -> None:
    with pytest.raises(binding.BindError) as err:
        binding.rank_cpus("auto", _ranks(4), "gpu-a", _env(sysfs), {0, 8, 9}, gpus=True)
    assert "gpu-a" in str(err.value) and "NUMA node 0" in str(err.value) and "at least one core" in str(err.value)
    assert err.value.global_rank == 10


def test_auto_with_a_gpu_the_node_lacks_names_slot_and_rank(sysfs) -> None:
    with pytest.raises(binding.BindError, match=r"gpu-a: slot 4 \(rank 14\) uses GPU 4, which is not among"):
        binding.rank_cpus("auto", _ranks(5), "gpu-a", _env(sysfs), ALL, gpus=True)


def test_auto_without_gpus_splits_the_node_s_physical_cores_as_deepspeed_does(sysfs) -> None:
    got = binding.rank_cpus("auto", _ranks(4), "cpu-a", {binding.SYSFS_ENV: str(sysfs)}, ALL, gpus=False)
    assert got == {10: [0, 1, 2, 3], 11: [4, 5, 6, 7], 12: [8, 9, 10, 11], 13: [12, 13, 14, 15]}
    # 3 ranks: 16 // 3 = 5 cores each, the last one unused (get_numactl_cmd's integer division)
    got = binding.rank_cpus("auto", _ranks(3), "cpu-a", {binding.SYSFS_ENV: str(sysfs)}, ALL, gpus=False)
    assert got == {10: [0, 1, 2, 3, 4], 11: [5, 6, 7, 8, 9], 12: [10, 11, 12, 13, 14]}


def test_auto_without_gpus_takes_one_hyperthread_per_core(tmp_path) -> None:
    # 8 cores x 2 threads: CPU i and i+8 are siblings (Linux's usual numbering): DeepSpeed binds cores 0..7
    root = tmp_path / "ht"
    for cpu in ALL:
        _write(root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", f"{cpu % 8},{cpu % 8 + 8}")
    got = binding.rank_cpus("auto", _ranks(4), "cpu-b", {binding.SYSFS_ENV: str(root)}, ALL, gpus=False)
    assert got == {10: [0, 1], 11: [2, 3], 12: [4, 5], 13: [6, 7]}


def test_a_map_gives_each_slot_its_cpus_less_those_not_allowed(sysfs) -> None:
    bind = {"0": "0-3", "1": "4,6-7", 2: "8-15"}  # (slot keys arrive as strings after JSON)
    assert binding.rank_cpus(bind, _ranks(3), "n1", {}, ALL, gpus=False) == {
        10: [0, 1, 2, 3], 11: [4, 6, 7], 12: list(range(8, 16))}
    assert binding.rank_cpus(bind, _ranks(3), "n1", {}, {1, 2, 6, 9}, gpus=False) == {10: [1, 2], 11: [6], 12: [9]}


def test_a_map_whose_slot_cpus_are_all_disallowed_names_rank_node_and_both_sets() -> None:
    with pytest.raises(binding.BindError) as err:
        binding.rank_cpus({0: "0-1", 1: "6-7"}, _ranks(2), "n1", {}, {0, 1, 2, 3}, gpus=False)
    message = str(err.value)
    assert "n1: rank 11 (slot 1) asks for CPUs 6-7" in message and "allowed: 0-3" in message, message
    assert err.value.global_rank == 11


def test_a_slot_missing_from_the_map_is_named_with_its_node() -> None:
    with pytest.raises(binding.BindError, match=r"bind_cores on n2: slot 1 \(rank 11\) is not in the map"):
        binding.rank_cpus({0: "0"}, _ranks(2), "n2", {}, ALL, gpus=False)


def test_off_binds_nothing_and_node_cpus_sets_omp_num_threads_over_any_value() -> None:
    assert binding.rank_cpus("off", _ranks(2), "n", {}, ALL, gpus=False) == {}
    mine = sorted(os.sched_getaffinity(0))
    node = {"host": "n", "ranks": _ranks(2), "bind_cores": {0: str(mine[0]), 1: binding.cpu_text(mine)}}
    envs = [{"OMP_NUM_THREADS": "7"}, {}]  # DeepSpeed's launch.py sets it whatever the environment had
    assert binding.node_cpus(node, {"DS_ACCELERATOR": "cpu"}, envs) == {10: mine[:1], 11: mine}
    assert envs == [{"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": str(len(mine))}]
    off = [{"OMP_NUM_THREADS": "7"}]
    assert binding.node_cpus({**node, "bind_cores": "off"}, {}, off) == {} and off == [{"OMP_NUM_THREADS": "7"}]


def test_cpu_lists_read_and_written() -> None:
    assert binding.parse_cpus("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8] and binding.parse_cpus("") == []
    assert binding.cpu_text([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8" and binding.cpu_text(None) is None
    assert binding.report([3, 1, 2]) == {"cpus": "1-3"} and binding.report(None) == {}


# ------------------------------------------------------------------------------------------ end to end
PROBE = """import json, os, sys
import torch  # noqa: F401  (fast_start forks only ranks that import torch)
out = os.path.join(os.environ["BIND_OUT"], f"rank{os.environ['RANK']}.json")
with open(out, "w") as f:
    json.dump({"cpus": sorted(os.sched_getaffinity(0)), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
"""


def _bound_job(orch, write_spec, hostfile, tmp_path: Path, fast_start: str, bind) -> tuple[object, str]:
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / f"out-{fast_start}"
    out.mkdir()
    spec = write_spec(name=f"bind-{fast_start}", hostfile=str(hostfile("node-0 slots=2\n")), workdir=str(tmp_path),
                      entrypoint="probe.py", fast_start=fast_start, bind_cores=bind, stop_grace_seconds=2,
                      env={"BIND_OUT": str(out), "DS_ACCELERATOR": "cpu"})
    r = orch("run", str(spec), timeout=300)
    job_id = orch.json("list")[0]["id"]
    return r, job_id


@pytest.mark.integration
@pytest.mark.parametrize("fast_start", ["off", "on"], ids=["exec", "forked"])
def test_ranks_run_pinned_to_their_slots_cpus(orch, write_spec, hostfile, tmp_path, fast_start) -> None:
    assert {0, 1} <= os.sched_getaffinity(0), "this test needs CPUs 0 and 1"
    r, job_id = _bound_job(orch, write_spec, hostfile, tmp_path, fast_start, {0: "0", 1: "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = {int(p.stem[4:]): json.loads(p.read_text()) for p in (tmp_path / f"out-{fast_start}").glob("rank*.json")}
    assert seen == {0: {"cpus": [0], "omp": "1"}, 1: {"cpus": [1], "omp": "1"}}
    (started,) = orch.events(job_id, "ranks_started")
    assert [(x["global_rank"], x["cpus"]) for x in started.data["ranks"]] == [(0, "0"), (1, "1")]
    assert started.data["fast_start"]["forked"] is (fast_start == "on"), started.data["fast_start"]
    assert_no_leftovers(job_id, timeout=10)


@pytest.mark.integration
def test_a_slot_missing_from_the_map_fails_the_start_naming_it(orch, write_spec, hostfile, tmp_path) -> None:
    r, job_id = _bound_job(orch, write_spec, hostfile, tmp_path, "off", {0: "0"})
    assert r.returncode != 0
    cause = orch.json("status", job_id)["cause"]
    assert cause["kind"] == "spawn_failed", cause
    assert "bind_cores on node-0: slot 1 (rank 1) is not in the map" in cause["message"], cause
    assert "Traceback" not in r.stdout + r.stderr
    assert not list((tmp_path / "out-off").iterdir())  # no rank ran


@pytest.mark.integration
def test_orch_plan_shows_each_rank_s_cpus_and_what_auto_does(orch, write_spec, hostfile, tmp_path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    common = dict(hostfile=str(hostfile("node-0 slots=2\n")), workdir=str(tmp_path), entrypoint="probe.py")
    shown = orch("plan", str(write_spec(name="m", bind_cores={0: "0-3", 1: "4-7"}, **common)))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "0, CPUs 0-3" in shown.stdout and "1, CPUs 4-7" in shown.stdout, shown.stdout
    assert "bind_cores map: each rank is pinned to its slot's CPUs" in " ".join(shown.stdout.split())
    auto = orch("plan", str(write_spec(name="a", bind_cores="auto", **common)))
    assert "bind_cores auto: on nodes whose accelerator is cuda, each rank is pinned to physical cores of its " \
           "GPU's NUMA node" in " ".join(auto.stdout.split()), auto.stdout
    plan = orch.json("plan", str(write_spec(name="j", bind_cores={0: "0-3", 1: "4-7"}, **common)))
    assert plan["nodes"][0]["bind_cores"] == {"0": "0-3", "1": "4-7"}


@pytest.mark.integration
def test_an_exec_d_rank_is_pinned_before_exec_and_a_refused_pin_is_an_os_error(tmp_path) -> None:
    from agents.ranks import RankProcess
    first = min(os.sched_getaffinity(0))
    proc = RankProcess(3, [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], dict(os.environ),
                       str(tmp_path), str(tmp_path / "r3.log"), cpus=[first])
    proc.start()
    assert proc.wait(60) == 0
    proc.join_output()
    assert (tmp_path / "r3.log").read_text().strip() == f"[{first}]"
    absent = RankProcess(4, ["true"], {}, str(tmp_path), str(tmp_path / "r4.log"), cpus=[os.cpu_count() + 4096])
    with pytest.raises(OSError, match="rank 4 cannot be pinned to CPUs"):
        absent.start()


def test_native_mode_says_bind_cores_is_not_applied() -> None:
    sent: list[dict] = []
    binding.warn_native({"host": "n3", "bind_cores": "auto"}, sent.append)
    binding.warn_native({"host": "n4", "bind_cores": "off"}, sent.append)
    assert [m["message"] for m in sent] == [
        "bind_cores is not applied on n3 in launch_mode native (the real launcher starts the ranks; use "
        "launch_mode emulated)"]
