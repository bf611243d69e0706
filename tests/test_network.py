"""agents.network: the interface a node's ranks use for their collectives, chosen on this machine's
real interfaces (``lo`` always; the route to a loopback master is ``lo``), and the job's own choice
checked. The choice across real hosts is tested in test_ssh.py and test_ray.py."""

from __future__ import annotations

import socket

from agents import network

LOCAL = {"addr": "127.0.0.1", "port": 29500, "spans_hosts": False}


def test_the_interface_of_the_route_to_the_master_is_set_for_gloo_and_nccl() -> None:
    choice = network.choose({}, LOCAL)
    assert choice.sets == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert (choice.ifname, choice.address, choice.problem) == ("lo", "127.0.0.1", None)
    assert choice.detail == "lo (127.0.0.1) routes to the master 127.0.0.1: GLOO_SOCKET_IFNAME and " \
                            "NCCL_SOCKET_IFNAME set to lo"
    assert network.choose({}, {**LOCAL, "addr": "localhost"}).ifname == "lo"  # a name is resolved on the node


def test_a_loopback_master_of_a_job_that_spans_hosts_is_a_problem() -> None:
    choice = network.choose({}, {**LOCAL, "spans_hosts": True})
    assert choice.sets == {} and choice.problem == "the master address 127.0.0.1 is a loopback address and the job " \
                                                   "spans hosts"
    assert "set master_addr to node 0's address on the network the nodes share" in choice.detail


def test_the_jobs_own_values_win_and_are_checked() -> None:
    # gloo's is the job's (and exists); NCCL's is still chosen
    choice = network.choose({"GLOO_SOCKET_IFNAME": "lo"}, LOCAL)
    assert choice.sets == {"NCCL_SOCKET_IFNAME": "lo"} and choice.user == {"GLOO_SOCKET_IFNAME": "lo"}
    assert choice.problem is None and choice.detail.startswith("GLOO_SOCKET_IFNAME=lo (the job's environment): lo has ")
    # an interface the node does not have
    choice = network.choose({"GLOO_SOCKET_IFNAME": "lo,orch-nonesuch0"}, LOCAL)
    assert choice.problem == "GLOO_SOCKET_IFNAME=lo,orch-nonesuch0 names no interface orch-nonesuch0 on this node"
    assert "(its interfaces: " in choice.detail and "lo" in choice.detail
    # NCCL's prefixes and exclusions name no one interface: taken as written
    choice = network.choose({"NCCL_SOCKET_IFNAME": "^docker,lo"}, LOCAL)
    assert choice.problem is None and choice.sets == {"GLOO_SOCKET_IFNAME": "lo"}
    assert network.choose({"NCCL_SOCKET_IFNAME": "=orch-nonesuch0"}, LOCAL).problem is not None  # exact: checked
    # both set by the job: nothing to set
    both = network.choose({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}, LOCAL)
    assert both.sets == {} and both.problem is None


def test_no_route_to_the_master_is_a_problem_that_says_why() -> None:
    choice = network.choose({}, {**LOCAL, "addr": "no-such-host.invalid"})
    assert choice.sets == {} and choice.problem.startswith("no route from this node to the master address "
                                                           "no-such-host.invalid (")
    try:
        loopback = socket.gethostbyname(socket.gethostname()).startswith("127.")
    except OSError:
        loopback = False
    # where this machine's own hostname resolves to loopback, the message says what gloo would do then
    assert ("a loopback address, so gloo left to itself would listen there" in choice.detail) == loopback


def test_without_a_master_in_the_plan_nothing_is_set() -> None:
    choice = network.choose({}, None)
    assert choice.sets == {} and choice.problem is None and "choose their interface themselves" in choice.detail
    assert network.choose({}, None).to_dict()["sets"] == {}
