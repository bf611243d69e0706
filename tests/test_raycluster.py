"""The Ray test cluster itself (tests/raycluster.py): every worker node runs on its own host's
address and network namespace, a killed node is seen dead by the GCS, a cut link too, nodes
restart, and teardown leaves no process of the cluster behind, also when the test body raises.

Timings are printed (``pytest -s``): start-up, teardown, how long Ray takes to notice."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from raycluster import RayTestCluster

pytestmark = pytest.mark.integration

# One task per worker node, pinned with NodeAffinitySchedulingStrategy(soft=False); each returns
# what it sees of its host. Prints one JSON line: {node_id: {...}}.
PROBE = textwrap.dedent("""
    import json, os, subprocess, sys
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(logging_level="ERROR", log_to_driver=False)     # RAY_ADDRESS from the environment

    @ray.remote(num_cpus=1)
    def where():
        eth0 = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout
        m = [w for w in eth0.split() if "/" in w and w[0].isdigit()]
        return {"ray_ip": ray.util.get_node_ip_address(), "eth0": m[0].split("/")[0] if m else None,
                "netns_ino": os.stat("/proc/self/ns/net").st_ino,
                "node_id": ray.get_runtime_context().get_node_id()}

    ids = json.loads(sys.argv[1])
    refs = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(i, soft=False)).remote() for i in ids]
    print(json.dumps(dict(zip(ids, ray.get(refs, timeout=60)))))
""")


def probe(cluster: RayTestCluster, node_ids: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(node_ids)],
                       capture_output=True, text=True, timeout=120, env=cluster.env(), check=False)
    assert r.returncode == 0, f"driver failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_tasks_on_own_hosts(cluster: RayTestCluster) -> None:
    net = cluster.net
    ids = cluster.node_ids
    assert len(set(ids)) == len(ids) == len(net.hosts)
    seen = probe(cluster, ids)
    for i, nid in enumerate(ids):
        addr = net.addresses[i]
        assert seen[nid] == {"ray_ip": addr, "eth0": addr, "netns_ino": os.stat(f"/run/netns/{net.namespaces[i]}").st_ino,
                             "node_id": nid}, f"task pinned to host {i}'s node ran elsewhere: {seen[nid]}"


def ray_processes_ps(cluster: RayTestCluster) -> list[str]:
    """``pgrep -fa 'raylet|gcs_server|ray::'``, narrowed to this cluster: its sessions or its
    temp dir (``ps`` instead of pgrep to get the session id)."""
    sids = set(cluster.session_ids)
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        _pid, sid, _stat, args = (line.split(None, 3) + [""])[:4]
        if not re.search(r"raylet|gcs_server|ray::|default_worker|dashboard|log_monitor|ray start", args):
            continue
        if int(sid) in sids or (cluster.temp_dir is not None and str(cluster.temp_dir) in args):
            found.append(line.strip())
    return found


# --------------------------------------------------------------------------- the session's 4 hosts


def test_nodes_have_their_hosts_addresses(ray4: RayTestCluster) -> None:
    net = ray4.net
    print(f"\n4-host Ray cluster: start-up {ray4.setup_seconds:.1f} s {ray4.last_start_seconds}")
    nodes = ray4.nodes()
    alive = [n for n in nodes if n["alive"]]
    heads = [n for n in alive if n["is_head"]]
    assert len(heads) == 1 and heads[0]["ip"] == net.controller_addr
    assert heads[0]["resources"].get("CPU", 0) == 0, "work must not land on the head"
    workers = sorted((n for n in alive if not n["is_head"]), key=lambda n: n["ip"])
    assert [n["ip"] for n in workers] == net.addresses
    assert [n["node_id"] for n in workers] == ray4.node_ids
    assert all(n["resources"]["CPU"] == 2 for n in workers)
    assert ray4.address == f"{net.controller_addr}:{ray4.gcs_port}"
    assert [ray4.node_ip(i) for i in range(len(net.hosts))] == net.addresses


def test_tasks_land_on_their_own_hosts(ray4: RayTestCluster) -> None:
    check_tasks_on_own_hosts(ray4)
    # a driver inside host 1 attaches to host 1's node when told its address (without it
    # Ray picks the head's raylet: namespaces share the process table and file system)
    code = (f"import ray; ray.init(_node_ip_address={ray4.node_ip(1)!r}, logging_level='ERROR', "
            "log_to_driver=False); print(ray.get_runtime_context().get_node_id())")
    r = ray4.run_python(code, host=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == ray4.node_id(1)


def test_killed_node_is_seen_dead_and_restarts(ray4: RayTestCluster) -> None:
    try:
        old = ray4.node_id(1)
        assert ray4.processes(1)
        t0 = time.monotonic()
        ray4.kill_node(1)
        killed = time.monotonic() - t0
        assert ray4.processes(1) == [], "kill_node left processes of host 1's node"
        assert ray4.processes(0) and ray4.processes(2) and ray4.processes(-1), "kill_node hit other nodes"
        noticed = ray4.wait_dead(1, timeout=60)
        print(f"\nkill_node took {killed:.2f} s; Ray (default health checks) marked the node dead "
              f"{noticed:.1f} s later")
        nodes = {n["node_id"]: n for n in ray4.nodes()}
        assert not nodes[old]["alive"]
        assert nodes[ray4.node_id(0)]["alive"] and nodes[ray4.node_id(2)]["alive"]
        t0 = time.monotonic()
        assert ray4.reset() == [1]
        print(f"restart of host 1's node: {time.monotonic() - t0:.1f} s")
        assert ray4.node_id(1) != old
        check_tasks_on_own_hosts(ray4)
    finally:
        ray4.reset()


# --------------------------------------------------------------------------- cut link, teardown


class _Boom(Exception):
    pass


def test_cut_link_then_teardown_when_the_body_raises(make_net) -> None:
    net = make_net(2)
    cluster = RayTestCluster(net, env=RayTestCluster.FAST_FAILURE_DETECTION, num_cpus=1,
                             resources=[{"slot_a": 1}, {"slot_b": 2}])
    with pytest.raises(_Boom), cluster:
        nodes = {n["ip"]: n for n in cluster.nodes() if n["alive"]}
        assert nodes[net.addresses[0]]["resources"]["slot_a"] == 1
        assert nodes[net.addresses[1]]["resources"]["slot_b"] == 2
        assert nodes[net.addresses[1]]["resources"]["CPU"] == 1
        old = cluster.node_id(0)
        cluster.cut_link(0)
        noticed = cluster.wait_dead(0, timeout=30)
        print(f"\ncut link: Ray (FAST_FAILURE_DETECTION) marked the node dead after {noticed:.1f} s")
        cluster.restore_link(0)
        assert cluster.reset() == [0]
        assert cluster.node_id(0) != old
        check_tasks_on_own_hosts(cluster)
        assert ray_processes_ps(cluster), "the scoped process check finds nothing of a live cluster"
        raise _Boom()
    print(f"teardown of a 2-host cluster: {cluster.teardown_seconds:.1f} s")
    assert ray_processes_ps(cluster) == []
    assert cluster.leftovers() == []
    assert cluster.temp_dir is not None and not cluster.temp_dir.exists()


CRASHER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from nethosts import TestNetwork
    from raycluster import RayTestCluster
    net = TestNetwork(1).start()
    cluster = RayTestCluster(net).start()
    print(cluster.temp_dir, " ".join(map(str, cluster.session_ids)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)           # no close(), no atexit
""")


def test_cluster_of_a_killed_test_process_is_cleaned_up() -> None:
    """The cluster's watcher kills what is left of it once its test process is gone (SIGKILL)."""
    import nethosts
    from conftest import wait_for

    r = subprocess.run([sys.executable, "-c", CRASHER, os.path.dirname(__file__)], capture_output=True,
                       text=True, timeout=120, check=False)
    try:
        assert r.returncode == -9, f"the crashing test process did not get that far:\n{r.stdout}\n{r.stderr[-3000:]}"
        temp_dir, *sids = r.stdout.split()
        sids_set = {int(x) for x in sids}

        def left() -> list[str]:
            out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
            return [line for line in out.splitlines()
                    if int(line.split()[1]) in sids_set or temp_dir in line]
        t0 = time.monotonic()
        wait_for(lambda: not left() and not os.path.exists(temp_dir), 20, f"the watcher to clean up {left()}")
        print(f"\nwatcher cleaned up a crashed session's cluster in {time.monotonic() - t0:.1f} s")
    finally:
        nethosts.cleanup_stale()                    # the crashed process's namespaces, sshd


# A 4-host cluster (``ray4``) is checked the same way (every worker node at its host's address, tasks pinned
# to a node run in its host) by tests/test_ray.py's first test, on the 4-host cluster that module starts anyway.
