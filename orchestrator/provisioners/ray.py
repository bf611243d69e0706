"""The ray provisioner: one agent actor per node of the plan, pinned to that node.

The spec names the cluster (``ray.address``): ``local`` starts a Ray instance on this
machine (the default), ``auto`` joins the one ``ray start`` made here (or ``$RAY_ADDRESS``),
``host:port`` joins that GCS, and ``ray://host:port`` goes through Ray Client.

**Hostfile hosts to Ray nodes.** A hostfile host is the Ray node whose address
(``NodeManagerAddress``) equals the host, or equals what the host's name resolves to on
this machine, or, failing both, whose hostname (``NodeManagerHostname``) is the host and
belongs to that node only. A host with no alive node is an error naming it and the alive
nodes; two hosts may not be the same node. **Without a hostfile** the pool is the
cluster's alive nodes that can run work (their ``GPU`` count, else their ``CPU`` count, as
slots), named by address in the order Ray lists them, and ``include``/``exclude``/
``num_nodes``/``num_gpus`` apply to it exactly as to a hostfile.

**Actors.** Each node gets an :class:`agents.ray_actor.AgentActor` scheduled with
``NodeAffinitySchedulingStrategy(node_id, soft=False)`` and reserving the slots it uses
(``num_gpus`` on GPU nodes, else ``num_cpus``), named ``orch/<attempt id>/<node rank>`` in
the ``orch`` namespace. The actor runs the same ``python -m agents.agent`` process as the
other provisioners and relays its message stream over Ray calls. Node loss is detected
by orch's own heartbeats on that stream (0.5 s, lost after 3 s), not by Ray's health
checks (a cut link takes Ray about a minute to notice). Every actor of the attempt is
killed at its end, so the cluster is left clean.
"""

from __future__ import annotations

import collections
import ipaddress
import os
import queue
import socket
import threading
import time
from collections.abc import Collection
from typing import Any

from agents.link import decode, encode
from agents.ray_actor import EOF_LINE, make_actor_class

from ..errors import ProvisionError
from ..planning import JobPlan, NodePlan, ResourcePool
from . import ray_access
from .base import AgentHandle, Provisioner

__all__ = ["RayProvisioner", "RayAgent", "connect", "match_node"]

NAMESPACE = "orch"
_CONNECT_LOCK = threading.Lock()
_CONNECTED: dict[str, Any] = {}


def connect(address: str, timeout: float = 30.0) -> Any:
    """Connect this process to the Ray cluster at ``address`` once; return the ``ray`` module.

    ``local`` starts a one-node Ray here (shut down, and its session directory removed, when this
    process exits); ``auto`` and ``host:port`` join a running cluster, in Ray's token mode where a
    token is available (:mod:`.ray_access`), after reading its GCS once, so a refused token is one
    clear error at once instead of Ray's 20 s of retries.

    Raises:
        ProvisionError: the address cannot be reached or refuses this controller's token, or this
            process is already connected to another cluster.
    """
    with _CONNECT_LOCK:
        import ray
        if ray.is_initialized():
            if _CONNECTED.get("address") not in (None, address):
                raise ProvisionError(f"this orch process is connected to the Ray cluster at "
                                     f"{_CONNECTED['address']}; it cannot also use {address}")
            return ray
        target = ray_access.resolve_address(address)
        if target != "local" and not target.startswith("ray://"):
            # reachable, and the token accepted: one clear error at once (ray.init retries for 20 s)
            ray_access.read_nodes(target, min(timeout, 10.0))
        kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "configure_logging": False}
        if target == "local":
            kwargs.update(include_dashboard=False, num_cpus=os.cpu_count())
        else:
            kwargs["address"] = target
        before = dict(os.environ)
        try:
            with ray_access.token_auth() as (token_mode, how):
                try:
                    ray.init(**kwargs)
                except Exception as err:  # ray raises ConnectionError, RuntimeError, ValueError...
                    if ray_access.is_auth_error(err):
                        raise ProvisionError(ray_access.auth_message(target, token_mode, how)) from err
                    raise ProvisionError(f"cannot connect to the Ray cluster at {address}: {err}") from err
        finally:
            _restore_environ(before)
        if target == "local":
            ray_access.remove_session_on_exit(ray)
        _CONNECTED["address"] = address
        return ray


def _restore_environ(before: dict[str, str]) -> None:
    """Undo what ``ray.init`` wrote into ``os.environ`` (e.g. ``PYTHONBREAKPOINT``, set for the
    driver's own ``breakpoint()``): the controller's environment is what ranks inherit under the
    pdsh launcher's export rule, and it must stay the one the user started orch with."""
    for key in [k for k in os.environ if k not in before]:
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _slots_of(node: dict[str, Any]) -> int:
    res = node.get("Resources", {})
    return int(res.get("GPU", 0)) or int(res.get("CPU", 0))


def _is_loopback_name(host: str) -> bool:
    """Whether ``host`` means this machine by a loopback address (``localhost``, ``127.0.0.1``, ``::1``)."""
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(ips) and all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips)


def match_node(host: str, nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The Ray node (an entry of ``ray.nodes()``) a hostfile host stands for, or None.

    By address (``NodeManagerAddress == host``), else by what ``host`` resolves to here, else by
    hostname (``NodeManagerHostname == host``) when exactly one node has it. A loopback name
    (``localhost``) is the one node on this machine: the node whose address is an address of this
    machine's interfaces.
    """
    by_ip = {n["NodeManagerAddress"]: n for n in nodes}
    if host in by_ip:
        return by_ip[host]
    try:
        ips = sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except socket.gaierror:
        ips = []
    for ip in ips:
        if ip in by_ip:
            return by_ip[ip]
    named = [n for n in nodes if n.get("NodeManagerHostname") == host]
    if len(named) == 1:
        return named[0]
    if _is_loopback_name(host):
        here = ray_access.local_addresses()
        local = [n for n in nodes if n["NodeManagerAddress"] in here]
        return local[0] if len(local) == 1 else None
    return None


class RayAgent(AgentHandle):
    """The controller's side of one agent actor: a poller thread turns ``recv`` into events."""

    def __init__(self, ray: Any, node: NodePlan, actor: Any, events: "queue.Queue[tuple[int, dict]]") -> None:
        self.ray = ray
        self.node_rank = node.node_rank
        self.host = node.host
        self.actor = actor
        self._events = events
        self._done = threading.Event()
        threading.Thread(target=self._poll, name=f"agent-{node.node_rank}-poll", daemon=True).start()

    def _poll(self) -> None:
        while not self._done.is_set():
            try:
                lines = self.ray.get(self.actor.recv.remote(0.5))
            except Exception:  # noqa: BLE001 - the actor (or its node) died: the link is gone
                lines = [EOF_LINE]
            for line in lines:
                if line == EOF_LINE:
                    self._done.set()
                    self._events.put((self.node_rank, {"type": "eof"}))
                    return
                if line.strip():
                    self._events.put((self.node_rank, decode(line)))

    def send(self, msg: dict[str, Any]) -> bool:
        if self._done.is_set():
            return False
        self.actor.send.remote(encode(msg))
        return True

    def close(self) -> None:
        if not self._done.is_set():
            self.actor.send.remote(EOF_LINE)

    def _status(self, timeout: float = 2.0) -> dict[str, Any] | None:
        try:
            return self.ray.get(self.actor.status.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - dead actor or timeout
            return None

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            status = self._status(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            if status is None or status["returncode"] is not None or self._done.is_set():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def kill(self) -> None:
        try:
            self.ray.get(self.actor.kill.remote(), timeout=5)
        except Exception:  # noqa: BLE001
            pass
        self.ray.kill(self.actor, no_restart=True)

    def diagnostics(self) -> str:
        status = self._status()
        if status is None:
            return "the agent's actor is gone (its node may have died)"
        text = status["stderr"]
        if status["returncode"] is not None:
            text += f"\n(the agent exited with status {status['returncode']})"
        return text.strip()


class RayProvisioner(Provisioner):
    """Places agents as pinned Ray actors; see the module docstring.

    Args:
        options: the spec's ``ray`` section.
        python: interpreter of the agents (the spec's ``python``; default: the Ray worker's).
        look_only: for ``orch plan``: start nothing and join nothing. The nodes are read from the
            cluster's GCS when one is up (``local``: the one node a Ray started here would have); what
            cannot be checked is said in :meth:`plan_notes`.
    """

    name = "ray"

    def __init__(self, options: Any, python: str | None = None, look_only: bool = False) -> None:
        self.options = options
        self.python = python
        self.look_only = look_only
        self.max_parallel = 64
        self._ray: Any = None
        self._node_of: dict[str, dict[str, Any]] = {}
        self._actors: dict[int, Any] = {}
        self._notes: list[str] = []

    @property
    def ray(self) -> Any:
        if self._ray is None:
            self._ray = connect(self.options.address, self.options.connect_timeout)
        return self._ray

    def plan_notes(self) -> tuple[str, ...]:
        return tuple(self._notes)

    # -- nodes --------------------------------------------------------------------------------

    def _nodes(self) -> list[dict[str, Any]]:
        """The cluster's alive nodes: from the driver once connected; looking only, from the GCS (or, for
        ``local``, the node a Ray started here would be)."""
        if not self.look_only:
            return [n for n in self.ray.nodes() if n.get("Alive")]
        if self.options.address == "local":
            return [_local_node_preview()]
        return [n for n in ray_access.read_nodes(self.options.address, self.options.connect_timeout) if n["Alive"]]

    def discover(self) -> "collections.OrderedDict[str, int]":
        """The pool of a job without a hostfile: ``{node address: slots}`` of the alive nodes that can
        run work, in the order Ray lists them.

        Raises:
            ProvisionError: the cluster has no such node, or (looking only) cannot be read.
        """
        hosts = collections.OrderedDict()
        for node in self._nodes():
            if _slots_of(node) > 0:
                hosts[node["NodeManagerAddress"]] = _slots_of(node)
        if not hosts:
            raise ProvisionError(f"the Ray cluster at {self.options.address} has no alive node with CPUs or GPUs")
        return hosts

    def check(self, pool: ResourcePool) -> None:
        """Map every host of the pool to an alive Ray node with enough CPUs/GPUs for its slots, whose
        raylet answers (a node Ray still lists as alive may be gone: Ray notices after 15-60 s).

        Raises:
            ProvisionError: naming every host without a node, sharing a node, short of slots or gone.
        """
        try:
            nodes = self._nodes()
        except ProvisionError as err:
            if not self.look_only:
                raise
            self._notes.append(f"the hosts were not checked against the Ray cluster: {err}")
            return
        problems, seen, gone = [], {}, []
        for host, slots in pool.nodes:
            node = match_node(host, nodes)
            if node is None:
                alive = ", ".join(f"{n['NodeManagerAddress']} ({n.get('NodeManagerHostname')})" for n in nodes)
                problems.append(f"host {host} has no alive Ray node (alive nodes: {alive or 'none'})")
                gone.append(host)
                continue
            if node["NodeID"] in seen:
                problems.append(f"hosts {seen[node['NodeID']]} and {host} are the same Ray node "
                                f"{node['NodeManagerAddress']}")
                continue
            seen[node["NodeID"]] = host
            kind = "GPU" if node.get("Resources", {}).get("GPU", 0) else "CPU"
            have = int(node.get("Resources", {}).get(kind, 0))
            if have < len(slots):
                problems.append(f"host {host} (Ray node {node['NodeManagerAddress']}) has {have} {kind}s; "
                                f"the plan needs {len(slots)} slot(s) there")
            self._node_of[host] = node
        for node_id, why in ray_access.unreachable_nodes([self._node_of[h] for h in seen.values()]).items():
            host = seen[node_id]
            problems.append(f"host {host}: Ray still lists its node {self._node_of[host]['NodeManagerAddress']} as "
                            f"alive, but {why}: the node is gone")
            gone.append(host)
        if problems:
            hint = (f"\n  (a job that ran there continues without them: orch resume JOB --exclude {','.join(gone)})"
                    if gone else "")
            raise ProvisionError("Cannot place the job on the Ray cluster:\n  " + "\n  ".join(problems) + hint)

    def master_addr(self, host: str) -> str:
        node = self._node_of.get(host)
        if node is None:
            try:
                node = match_node(host, self._nodes())
            except ProvisionError:
                node = None
        if node is None:
            if self.look_only:
                return host
            raise ProvisionError(f"host {host} has no alive Ray node")
        return str(node["NodeManagerAddress"])

    # -- agents -------------------------------------------------------------------------------

    def start_agent(self, node: NodePlan, plan: JobPlan,
                    events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        ray = self.ray
        info = self._node_of.get(node.host) or match_node(node.host, self._nodes())
        if info is None:
            raise ProvisionError(f"host {node.host} has no alive Ray node", reason="no alive Ray node")
        gpu = bool(info.get("Resources", {}).get("GPU", 0))
        actor_class = make_actor_class(ray)
        log_dir = os.path.join(plan.run_dir, "agents")
        os.makedirs(log_dir, exist_ok=True)
        try:
            actor = actor_class.options(
                name=f"orch/{plan.attempt_id}/{node.node_rank}", namespace=NAMESPACE,
                num_cpus=0 if gpu else len(node.slots), num_gpus=len(node.slots) if gpu else 0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=info["NodeID"], soft=False),
            ).remote(self.python, node.workdir,
                     {"ORCH_AGENT_ATTEMPT_ID": plan.attempt_id, "ORCH_AGENT_NODE_RANK": str(node.node_rank)},
                     os.path.join(log_dir, f"node-{node.node_rank}.log"))
        except Exception as err:  # noqa: BLE001
            raise ProvisionError(f"cannot place the agent actor on {node.host}: {err}",
                                 reason=f"cannot place the agent actor: {err}") from err
        self._actors[node.node_rank] = actor
        return RayAgent(ray, node, actor, events)

    def sweep(self, plan: JobPlan, spare: Collection[int] = ()) -> list[int]:
        """Kill what the attempt left on every live node (a task pinned there), then every actor."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        ray = self.ray
        killed: list[int] = []

        def sweep_node(attempt_id: str) -> list[int]:
            from agents.ranks import kill_marked
            return kill_marked(attempt_id) + kill_marked(attempt_id, key="ORCH_AGENT_ATTEMPT_ID")

        task = ray.remote(num_cpus=0, max_retries=0)(sweep_node)
        refs = []
        for node in plan.nodes:
            info = self._node_of.get(node.host)
            if info is None or node.node_rank not in self._actors:
                continue
            refs.append(task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=info["NodeID"], soft=False)).remote(plan.attempt_id))
        for ref in refs:
            try:
                killed += ray.get(ref, timeout=15)
            except Exception:  # noqa: BLE001 - a dead or cut node: its agent's lease stops it
                ray.cancel(ref, force=True)
        return killed

    def forget(self, node_rank: int) -> None:
        actor = self._actors.pop(node_rank, None)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)

    def close(self) -> None:
        """Kill every actor of the attempt: nothing of the job stays on the cluster."""
        for node_rank in list(self._actors):
            self.forget(node_rank)


def _local_node_preview() -> dict[str, Any]:
    """The node a Ray started here (``address: local``) would have, without starting it: Ray's own
    choice of the node address, this machine's CPUs (as ``connect`` gives them) and its GPUs."""
    gpus = 0
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource
        gpus = int(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators() or 0)
    except Exception:  # noqa: BLE001 - no accelerator support: CPUs only
        gpus = 0
    resources = {"CPU": float(os.cpu_count() or 1), **({"GPU": float(gpus)} if gpus else {})}
    return {"NodeID": "(a Ray started here for the job)", "Alive": True, "NodeManagerAddress": ray_access.local_node_ip(),
            "NodeManagerHostname": socket.gethostname(), "NodeManagerPort": None, "Resources": resources}
