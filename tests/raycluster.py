"""A real multi-node Ray cluster on one machine, whose nodes have their own addresses.

    with TestNetwork(3) as net, RayTestCluster(net) as ray_cluster:
        ray_cluster.address          # '10.x.y.1:<port>' for ray.init(address=...) / RAY_ADDRESS
        ray_cluster.env()            # {'RAY_ADDRESS': ..., 'RAY_AUTH_MODE': 'disabled'}
        ray_cluster.node_ip(0)       # '10.x.y.11': host 0's address, its Ray node's address
        ray_cluster.node_id(0)       # host 0's Ray node id (hex)
        ray_cluster.nodes()          # [{'node_id', 'ip', 'alive', 'resources', ...}] (from a subprocess)
        ray_cluster.kill_node(1)     # SIGKILL every Ray process of host 1 (raylet, agents, workers)
        ray_cluster.wait_dead(1)     # until the GCS reports it dead; returns the seconds it took
        ray_cluster.restart_node(1)  # a fresh Ray node on host 1 (new node id)
        ray_cluster.cut_link(2)      # = net.cut_link(2); restore_link(2)
        ray_cluster.reset()          # links up, dead/missing nodes restarted (shared fixtures)

Layout: the head (GCS, raylet with ``--num-cpus=0``, the minimal dashboard process Ray always
starts) runs in the root namespace on the network's bridge address ``net.controller_addr``;
one worker node per namespace host runs inside that host's namespace (``ip netns exec``) with
``--node-ip-address=<host address>``, so tasks pinned to it see the host's address and
network. ``ray.cluster_utils.Cluster`` cannot do this: all its nodes share one address.

Ownership: every ``ray start`` is started in a new session (``setsid``); Ray never leaves its
session (it only calls ``setpgrp``), so every process a node ever spawns (raylet, GCS, agents,
``ray::`` workers, also after it was re-parented to init) carries that session id, and the
kernel does not reuse a pid number as a session id while a member of that session lives.
Teardown and ``kill_node`` SIGKILL exactly those sessions' processes (plus anything whose
command line names this cluster's temp dir) and never run ``ray stop``, which would kill every
Ray process on the machine, other sessions' included.

Drivers: ``ray.init(address=...)`` attaches the driver to a raylet it finds in the process
table (``ps``) that the GCS knows, preferring the head. Namespaces share the process table and
the file system, so a driver started inside a host's namespace attaches to the HEAD's raylet
(through its unix socket), unlike on a real machine; pass ``_node_ip_address=<host address>``
to ``ray.init`` to attach it to its own host's node. Always give the address explicitly:
``address="auto"`` would see every session's GCS on the machine.

Things this module pins down that Ray would otherwise take from the machine:

* ``RAY_AUTH_MODE=disabled`` for every node: Ray 2.60's ``ray.init()`` writes
  ``~/.ray/auth_token``, after which ``ray start --head`` silently enables token auth while
  ``ray start --address`` (workers) does not send a token, so the workers cannot join.
* Every port the head binds in the (shared) root namespace is a free one chosen here (GCS,
  dashboard, dashboard agent, Ray client server when ``grpc`` is installed), so sessions
  running clusters at the same time do not collide; namespace nodes have their own ports.
* A temp dir of its own per node (``/tmp/orchray-<pid>-*/<node>``), short enough for Ray's
  unix sockets (``<temp>/session_<date>_<pid>/sockets/plasma_store`` must fit the 107 bytes
  of ``sun_path``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import nethosts
from nethosts import TestNetwork

FAMILY = "orchray"
SUN_PATH_MAX = 107                              # usable bytes of sockaddr_un.sun_path
# <temp>/session_2026-11-29_11-47-51_300642_4194304/sockets/plasma_store.NN
_SESSION_SUFFIX_LEN = len("/session_2026-11-29_11-47-51_300642_4194304/sockets/plasma_store.99")
MIN_OBJECT_STORE = 80 * 1024 * 1024             # Ray refuses less than 75 MiB
_TMP_RE = re.compile(rf"^{FAMILY}-(\d+)-")

_registry_lock = threading.Lock()
_active: dict[str, RayTestCluster] = {}         # temp root -> open cluster of this process


class RayClusterError(RuntimeError):
    """The Ray test cluster could not be started, queried or torn down."""


def ray_cli() -> str:
    """The ``ray`` command of the running interpreter's environment."""
    cand = Path(sys.executable).with_name("ray")
    if cand.exists():
        return str(cand)
    found = shutil.which("ray")
    if found is None:
        raise RayClusterError(f"no `ray` command next to {sys.executable} or on PATH: install ray")
    return found


def check_prerequisites() -> None:
    """Raise RayClusterError naming what is missing (ray, the ray CLI); namespace hosts have
    their own check (nethosts.check_prerequisites)."""
    problems = []
    try:
        import ray  # noqa: F401
    except ImportError as err:
        problems.append(f"cannot import ray ({err}): install ray in {sys.prefix}")
    else:
        try:
            ray_cli()
        except RayClusterError as err:
            problems.append(str(err))
    if problems:
        raise RayClusterError("Ray test cluster unavailable: " + "; ".join(problems))


# --------------------------------------------------------------------------- processes

@dataclass
class _Proc:
    pid: int
    sid: int
    zombie: bool
    cmdline: str


def _processes() -> list[_Proc]:
    """One snapshot of /proc: pid, session id, zombie or not, command line (or ``[comm]``)."""
    me = os.getpid()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        head, _, rest = stat.rpartition(")")
        fields = rest.split()
        if len(fields) < 4:
            continue
        comm = head.partition("(")[2]
        out.append(_Proc(int(entry.name), int(fields[3]), fields[0] in ("Z", "X"), cmd or f"[{comm}]"))
    return out


def _kill_until_gone(match: Any, timeout: float = 10.0, reaped: bool = True,
                     popens: Sequence[subprocess.Popen] = ()) -> list[_Proc]:
    """SIGKILL every live process ``match(proc)`` accepts until none is left; with ``reaped``,
    then wait (up to the same deadline) for the zombies among them to be reaped by whoever is
    their parent now (init, for Ray's daemons: on this machine it reaps about once a second),
    so that no ``[raylet] <defunct>`` shows up in a ``pgrep``. Returns the live survivors
    (empty on success). ``popens``: our own children among them, reaped here."""
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    while True:
        for p in popens:
            p.poll()
        live = [p for p in _processes() if not p.zombie and match(p)]
        if not live:
            break
        for p in live:
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.add(p.pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return live
        time.sleep(0.01)
    while reaped and killed and time.monotonic() < deadline:   # zombies: wait for their reaper
        for p in popens:
            p.poll()
        killed = {pid for pid in killed if os.path.exists(f"/proc/{pid}")}
        if killed:
            time.sleep(0.02)
    return []


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip() or "(empty)"
    except OSError:
        return "(none)"


# --------------------------------------------------------------------------- GCS queries
# Run in a subprocess (`python -c`): no Ray state in the test process. GcsClient reads the
# node table without registering a driver (no job, no worker prestart); `ray.init` is the
# fallback should that private API change.
_QUERY = r'''
import json, sys, time
args = json.loads(sys.argv[1])
deadline = time.monotonic() + args["timeout"]
def table_gcs():
    from ray._raylet import GcsClient
    client = GcsClient(address=args["address"])
    def read():
        out = []
        for nid, n in client.get_all_node_info(timeout=5).items():
            out.append({"node_id": nid.hex(), "ip": n.node_manager_address, "alive": n.state == 0,
                        "state": "ALIVE" if n.state == 0 else "DEAD",
                        "resources": dict(n.resources_total), "is_head": bool(n.is_head_node),
                        "death_reason": n.death_info.reason_message if n.state != 0 else ""})
        return out
    return read
def table_driver():
    import ray
    ray.init(address=args["address"], logging_level="ERROR", log_to_driver=False)
    def read():
        return [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "alive": bool(n["Alive"]),
                 "state": "ALIVE" if n["Alive"] else "DEAD", "resources": dict(n["Resources"]),
                 "is_head": "node:__internal_head__" in n["Resources"], "death_reason": ""}
                for n in ray.nodes()]
    return read
try:
    read = table_driver() if args.get("driver") else table_gcs()
except (ImportError, AttributeError):
    read = table_driver()
want = args.get("until") or {}
def done(nodes):
    alive = {n["node_id"] for n in nodes if n["alive"]}
    alive_ips = [n["ip"] for n in nodes if n["alive"]]
    fresh_ips = [n["ip"] for n in nodes if n["alive"] and n["node_id"] not in want.get("old_ids", [])]
    return (all(ip in fresh_ips for ip in want.get("alive_ips", []))
            and all(i in alive for i in want.get("alive_ids", []))
            and not any(i in alive for i in want.get("dead_ids", []))
            and all(ip not in alive_ips for ip in want.get("dead_ips", []))
            and len(alive) >= want.get("min_alive", 0))
t0 = time.monotonic()
while True:
    nodes = read()
    ok = done(nodes)
    if ok or time.monotonic() > deadline:
        break
    time.sleep(args.get("interval", 0.1))
print(json.dumps({"ok": ok, "waited": time.monotonic() - t0, "nodes": nodes}))
'''


# --------------------------------------------------------------------------- the cluster

@dataclass
class RayNode:
    index: int                      # host index; -1 for the head
    ip: str
    temp_dir: Path
    sids: list[int] = field(default_factory=list)   # session ids of every `ray start` of it
    temp_dirs: list[Path] = field(default_factory=list)   # of every generation
    ids: list[str] = field(default_factory=list)    # Ray node ids of every generation
    node_id: str = ""
    generation: int = 0
    popen: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = None         # output of the latest `ray start`


class RayTestCluster:
    """A head in the root namespace plus one Ray worker node per host of ``net``; a context
    manager (``start()`` / ``close()``).

    ``num_cpus``/``resources``: for every host, or one entry per host. ``env``: extra
    environment for every Ray process (e.g. ``RAY_health_check_period_ms``; see
    ``FAST_FAILURE_DETECTION``). ``log_monitor``/``autoscaler_monitor``: Ray's log forwarder
    (worker prints reaching drivers) and the autoscaler's status monitor (``ray status``),
    off by default to save ~80 MB each."""

    __test__ = False

    #: GCS health checks every 0.5 s, dead after 2 misses of 1 s: a dead node in ~1-2 s
    #: instead of Ray's default (3 s period, 5 misses, 10 s timeout: ~15 s, more for a cut).
    FAST_FAILURE_DETECTION: Mapping[str, str] = {
        "RAY_health_check_initial_delay_ms": "0",
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "1000",
        "RAY_health_check_failure_threshold": "2",
    }

    def __init__(self, net: TestNetwork, *, num_cpus: int | Sequence[int] = 2,
                 resources: Mapping[str, float] | Sequence[Mapping[str, float] | None] | None = None,
                 object_store_memory: int = 100 * 1024 * 1024, env: Mapping[str, str] | None = None,
                 log_monitor: bool = False, autoscaler_monitor: bool = False,
                 startup_timeout: float = 60.0) -> None:
        if not net.hosts:
            raise RayClusterError(f"{net!r} is not started")
        n = len(net.hosts)
        self.net = net
        self.num_cpus = list(num_cpus) if isinstance(num_cpus, Sequence) else [num_cpus] * n
        if resources is None or isinstance(resources, Mapping):
            self.resources = [dict(resources or {}) for _ in range(n)]
        else:
            self.resources = [dict(r or {}) for r in resources]
        if len(self.num_cpus) != n or len(self.resources) != n:
            raise ValueError(f"num_cpus and resources need one entry per host ({n})")
        self.object_store_memory = max(int(object_store_memory), MIN_OBJECT_STORE)
        self.extra_env = dict(env or {})
        self.log_monitor = log_monitor
        self.autoscaler_monitor = autoscaler_monitor
        self.startup_timeout = startup_timeout
        self.head_ip = net.controller_addr
        self.gcs_port = 0
        self.temp_dir: Path | None = None
        self.head: RayNode | None = None
        self.workers: list[RayNode] = []
        self.setup_seconds = 0.0
        self.teardown_seconds = 0.0
        self.last_start_seconds: dict[str, float] = {}
        self._started = False
        self._closed = False
        self._watcher: subprocess.Popen | None = None

    # ---------------------------------------------------------------- properties
    @property
    def address(self) -> str:
        """``<head ip>:<gcs port>``: for ``ray.init(address=...)`` and ``RAY_ADDRESS``."""
        return f"{self.head_ip}:{self.gcs_port}"

    def node_ip(self, i: int) -> str:
        return self.workers[i].ip

    def node_id(self, i: int) -> str:
        """Ray node id (hex) of host i's current node (changes with ``restart_node``)."""
        return self.workers[i].node_id

    @property
    def node_ids(self) -> list[str]:
        return [w.node_id for w in self.workers]

    @property
    def session_ids(self) -> list[int]:
        """Session ids of every `ray start` of this cluster: all its processes carry one."""
        return [sid for n in [self.head, *self.workers] if n is not None for sid in n.sids]

    @property
    def head_node_id(self) -> str:
        assert self.head is not None
        return self.head.node_id

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """``os.environ`` plus what a driver of this cluster needs (``RAY_ADDRESS``, the same
        ``RAY_AUTH_MODE`` as the nodes), plus ``extra``."""
        env = dict(os.environ)
        env.update(self._ray_env())
        env["RAY_ADDRESS"] = self.address
        env.update(extra or {})
        return env

    def __repr__(self) -> str:
        return f"RayTestCluster({self.address}, nodes={[w.ip for w in self.workers]})"

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> RayTestCluster:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except Exception as err:
            if exc_type is None:
                raise
            warnings.warn(f"teardown of {self!r} failed: {err}", RuntimeWarning, stacklevel=2)

    def start(self) -> RayTestCluster:
        if self._started:
            raise RayClusterError("a RayTestCluster starts once")
        self._started = True
        check_prerequisites()
        t0 = time.monotonic()
        try:
            self._setup()
        except BaseException:
            try:
                self.close()
            except Exception as err:   # noqa: BLE001
                warnings.warn(f"clean-up after a failed start failed: {err}", RuntimeWarning)
            raise
        self.setup_seconds = time.monotonic() - t0
        return self

    def _setup(self) -> None:
        cleanup_stale()
        self.temp_dir = Path(tempfile.mkdtemp(prefix=f"{FAMILY}-{os.getpid()}-", dir=_temp_base()))
        with _registry_lock:
            _active[str(self.temp_dir)] = self
        self._watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(Path(__file__).resolve().parent), str(self.temp_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.head = RayNode(-1, self.head_ip, self.temp_dir / "h")
        self.workers = [RayNode(h.index, h.addr, self.temp_dir / str(h.index)) for h in self.net.hosts]
        t0 = time.monotonic()
        for attempt in range(3):           # a chosen free port may be taken meanwhile
            try:
                self._spawn_head()
                self._wait_gcs_port()
                break
            except _PortTaken:
                if attempt == 2:
                    raise
                self._kill([self.head], timeout=10)
        self.last_start_seconds = {"gcs_up": time.monotonic() - t0}
        self._start_workers(list(range(len(self.workers))), also=[self.head])
        self.last_start_seconds["total"] = time.monotonic() - t0

    def close(self) -> None:
        """SIGKILL every process of this cluster, wait for them to be gone, remove the temp
        dir. Idempotent; does every step even when one fails, then raises."""
        if self._closed:
            return
        t0 = time.monotonic()
        errors = []
        nodes = [n for n in [self.head, *self.workers] if n is not None]
        left = self._kill(nodes, timeout=15)
        if left:
            errors.append("processes survived SIGKILL: " + "; ".join(f"{p.pid} {p.cmdline[:100]}" for p in left))
        for n in nodes:
            if n.popen is not None and n.popen.poll() is None:
                try:
                    n.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    errors.append(f"`ray start` {n.popen.pid} did not exit")
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            if self.temp_dir.exists():
                errors.append(f"could not remove {self.temp_dir}")
            with _registry_lock:
                _active.pop(str(self.temp_dir), None)
        if self._watcher is not None:
            try:
                self._watcher.stdin.close()            # type: ignore[union-attr]
                self._watcher.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired) as err:
                errors.append(f"cluster watcher {self._watcher.pid}: {err}")
        self.teardown_seconds = time.monotonic() - t0
        self._closed = True
        if errors:
            raise RayClusterError(f"teardown of {self!r}: " + "; ".join(errors))

    # ---------------------------------------------------------------- starting nodes
    def _ray_env(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    def _node_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(key, None)
        env.update(self._ray_env())
        env.update(self.extra_env)
        return env

    def _common_args(self, node: RayNode) -> list[str]:
        args = [f"--node-ip-address={node.ip}", f"--temp-dir={node.temp_dir}",
                f"--object-store-memory={self.object_store_memory}", "--disable-usage-stats",
                f"--include-log-monitor={'true' if self.log_monitor else 'false'}"]
        return args

    def _spawn_head(self) -> None:
        head = self.head
        assert head is not None
        head.generation += 1
        self.gcs_port = _free_port(self.head_ip)
        argv = [ray_cli(), "start", "--head", f"--port={self.gcs_port}", "--num-cpus=0", "--num-gpus=0",
                *self._common_args(head), "--include-dashboard=false",
                f"--dashboard-port={_free_port('127.0.0.1')}",
                f"--dashboard-agent-listen-port={_free_port('0.0.0.0')}"]
        if not self.autoscaler_monitor:
            argv.append("--no-monitor")
        try:
            import grpc  # noqa: F401       # with it Ray starts a client server on 10001
            argv.append(f"--ray-client-server-port={_free_port('0.0.0.0')}")
        except ImportError:
            pass
        self._spawn(head, argv)

    def _spawn_worker(self, node: RayNode) -> None:
        i = node.index
        node.generation += 1
        if node.generation > 1:
            node.temp_dir = self._temp_root / f"{i}.{node.generation}"
        argv = [ray_cli(), "start", f"--address={self.address}", f"--num-cpus={self.num_cpus[i]}",
                "--num-gpus=0", *self._common_args(node)]
        if self.resources[i]:
            argv.append(f"--resources={json.dumps(self.resources[i])}")
        self._spawn(node, argv, ns=self.net.host(i).ns)

    @property
    def _temp_root(self) -> Path:
        assert self.temp_dir is not None
        return self.temp_dir

    def _spawn(self, node: RayNode, argv: list[str], ns: str | None = None) -> None:
        node.temp_dir.mkdir(parents=True, exist_ok=True)
        if node.temp_dir not in node.temp_dirs:
            node.temp_dirs.append(node.temp_dir)
        node.log = self._temp_root / f"start-{'h' if node.index < 0 else node.index}.{node.generation}.log"
        if ns is not None:
            argv = ["ip", "netns", "exec", ns, *argv]   # execs: the pid is ray start's own
        with open(node.log, "wb") as log:
            # a new session per `ray start`: every process of the node inherits its id
            node.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=self._node_env(), start_new_session=True, cwd=str(self._temp_root))
        node.sids.append(node.popen.pid)
        with open(self._temp_root / "sids", "a") as f:     # for cleanup_stale after a crash
            f.write(f"{node.popen.pid}\n")
        node.node_id = ""

    def _wait_gcs_port(self) -> None:
        """Until the GCS accepts connections (the head's `ray start` still runs then: workers
        can be started alongside the rest of the head)."""
        head = self.head
        assert head is not None and head.popen is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                with socket.create_connection((self.head_ip, self.gcs_port), timeout=0.5):
                    return
            except OSError:
                pass
            rc = head.popen.poll()
            if rc is not None:
                out = _tail(head.log) if head.log else ""
                if rc != 0 and ("already in use" in out or "Address in use" in out or "bind" in out.lower()):
                    raise _PortTaken(out)
                raise RayClusterError(f"`ray start --head` exited {rc} before its GCS listened on "
                                      f"{self.address}:\n{out}")
            if time.monotonic() > deadline:
                raise RayClusterError(f"the GCS did not listen on {self.address} within {self.startup_timeout} s:\n"
                                      f"{_tail(head.log) if head.log else ''}")
            time.sleep(0.02)

    def _start_workers(self, indices: Sequence[int], also: Sequence[RayNode] = ()) -> None:
        """Start worker nodes of ``indices`` in parallel; wait for their (and ``also``'s)
        `ray start` to succeed and for the GCS to report all of them alive."""
        nodes = [self.workers[i] for i in indices]
        for node in nodes:
            self._spawn_worker(node)
        waiting = [*also, *nodes]
        # the node table poll runs meanwhile (its `import ray` overlaps the starts)
        query = self._query_popen({"alive_ips": [n.ip for n in waiting],
                                   "old_ids": [nid for n in waiting for nid in n.ids]},
                                  timeout=self.startup_timeout)
        try:
            t0 = time.monotonic()
            deadline = t0 + self.startup_timeout
            pending = list(waiting)
            while pending:                  # fail fast: whichever `ray start` fails first
                for node in list(pending):
                    assert node.popen is not None
                    rc = node.popen.poll()
                    if rc is None:
                        continue
                    if rc != 0:
                        raise RayClusterError(f"`ray start` of {self._label(node)} exited {rc}:\n"
                                              f"{_tail(node.log) if node.log else ''}")
                    pending.remove(node)
                    self.last_start_seconds[f"ray start {node.index if node.index >= 0 else 'head'}"] = \
                        round(time.monotonic() - t0, 2)
                if pending and time.monotonic() > deadline:
                    raise RayClusterError(f"`ray start` of {[self._label(n) for n in pending]} did not return "
                                          f"within {self.startup_timeout} s:\n"
                                          + "\n".join(_tail(n.log) if n.log else '' for n in pending))
                time.sleep(0.02)
            result = self._query_result(query, timeout=max(5.0, deadline - time.monotonic()))
        finally:
            if query.poll() is None:
                query.kill()
                query.wait()
        if not result["ok"]:
            raise RayClusterError(f"the GCS did not report {[self._label(n) for n in waiting]} alive within "
                                  f"{self.startup_timeout} s: {self._describe(result['nodes'])}")
        self._assign_ids(result["nodes"], waiting)

    def _assign_ids(self, nodes: list[dict[str, Any]], which: Sequence[RayNode]) -> None:
        for node in which:
            old = set(node.ids)
            alive = [n for n in nodes if n["alive"] and n["ip"] == node.ip and n["node_id"] not in old]
            if len(alive) != 1:
                raise RayClusterError(f"expected one live Ray node at {node.ip}, found {self._describe(nodes)}")
            node.node_id = alive[0]["node_id"]
            node.ids.append(node.node_id)

    @staticmethod
    def _label(node: RayNode) -> str:
        return f"the head ({node.ip})" if node.index < 0 else f"host {node.index} ({node.ip})"

    @staticmethod
    def _describe(nodes: list[dict[str, Any]]) -> str:
        return ", ".join(f"{n['ip']} {n['state']} {n['node_id'][:8]}" for n in nodes) or "no nodes"

    # ---------------------------------------------------------------- queries
    def _query_popen(self, until: Mapping[str, Any] | None, timeout: float,
                     ns: str | None = None) -> subprocess.Popen:
        args = {"address": self.address, "timeout": timeout, "until": dict(until or {})}
        argv = [sys.executable, "-c", _QUERY, json.dumps(args)]
        if ns is not None:
            argv = ["ip", "netns", "exec", ns, *argv]
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self._node_env(), cwd=str(self._temp_root))

    def _query_result(self, p: subprocess.Popen, timeout: float) -> dict[str, Any]:
        try:
            out, err = p.communicate(timeout=timeout + 15)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise RayClusterError(f"node table query did not finish (is the GCS at {self.address} up?): "
                                  f"{err[-2000:]}") from None
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise RayClusterError(f"node table query exited {p.returncode}: {err[-3000:]}") from None

    def query(self, until: Mapping[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """Read the GCS node table from a subprocess, polling (every 0.1 s) until ``until``
        holds: ``alive_ips``, ``alive_ids``, ``dead_ids``, ``dead_ips``, ``min_alive``.
        Returns ``{'ok': bool, 'waited': seconds, 'nodes': [...]}``."""
        return self._query_result(self._query_popen(until, timeout), timeout)

    def nodes(self) -> list[dict[str, Any]]:
        """Every node the GCS knows, dead ones included: dicts with ``node_id`` (hex), ``ip``,
        ``alive``, ``state``, ``resources`` (totals), ``is_head``, ``death_reason``."""
        return sorted(self.query(timeout=0)["nodes"], key=lambda n: (not n["is_head"], n["ip"], not n["alive"]))

    def alive(self, i: int) -> bool:
        """Does the GCS report host i's current node alive?"""
        return any(n["node_id"] == self.node_id(i) and n["alive"] for n in self.nodes())

    def wait_dead(self, i: int, timeout: float = 60.0, node_id: str | None = None) -> float:
        """Until the GCS reports host i's node (or ``node_id``) dead; returns the seconds it
        took (from this call). Raises RayClusterError on timeout."""
        nid = node_id or self.node_id(i)
        t0 = time.monotonic()
        r = self.query({"dead_ids": [nid]}, timeout=timeout)
        if not r["ok"]:
            raise RayClusterError(f"the GCS still reports node {nid[:8]} of host {i} alive after {timeout} s")
        return time.monotonic() - t0

    def wait_alive(self, indices: Sequence[int] | None = None, timeout: float = 60.0) -> None:
        idx = range(len(self.workers)) if indices is None else indices
        r = self.query({"alive_ids": [self.node_id(i) for i in idx]}, timeout=timeout)
        if not r["ok"]:
            raise RayClusterError(f"nodes of hosts {list(idx)} not all alive: {self._describe(r['nodes'])}")

    # ---------------------------------------------------------------- processes
    def _owns(self, nodes: Sequence[RayNode]) -> Any:
        sids = {sid for n in nodes for sid in n.sids}
        frags = [str(d) + "/" for n in nodes for d in n.temp_dirs]
        if self.temp_dir is not None and len(nodes) == len(self.workers) + 1:
            frags.append(str(self.temp_dir) + "/")          # whole cluster: all its dirs
        return lambda p: p.sid in sids or any(f in p.cmdline for f in frags)

    def _kill(self, nodes: Sequence[RayNode | None], timeout: float, reaped: bool = True) -> list[_Proc]:
        real = [n for n in nodes if n is not None]
        popens = [n.popen for n in real if n.popen is not None]
        return _kill_until_gone(self._owns(real), timeout=timeout, reaped=reaped, popens=popens)

    def processes(self, i: int | None = None) -> list[tuple[int, str]]:
        """Live processes of this cluster (or of host i's node; ``i=-1``: the head):
        ``(pid, command line)``."""
        nodes = [n for n in [self.head, *self.workers] if n is not None] if i is None else \
            [self.head if i == -1 else self.workers[i]]
        match = self._owns([n for n in nodes if n is not None])
        return [(p.pid, p.cmdline) for p in _processes() if not p.zombie and match(p)]

    def leftovers(self) -> list[str]:
        """After close(): what of this cluster still exists (empty list = clean)."""
        left = [f"process {pid} {cmd[:120]}" for pid, cmd in self.processes()]
        if self.temp_dir is not None and self.temp_dir.exists():
            left.append(f"dir {self.temp_dir}")
        return left

    # ---------------------------------------------------------------- failure injection
    def kill_node(self, i: int, host: bool = False, timeout: float = 10.0) -> None:
        """SIGKILL every process of host i's Ray node (raylet, agents, ``ray::`` workers, also
        those of earlier generations); with ``host``, every process in the host's namespace
        (``net.kill_host``: its sshd too). Returns when they are gone; the GCS notices later
        (``wait_dead``)."""
        if host:
            self.net.kill_host(i, timeout=timeout)
        left = self._kill([self.workers[i]], timeout=timeout, reaped=False)
        if left:
            raise RayClusterError(f"processes of host {i}'s Ray node survived SIGKILL: {[p.pid for p in left]}")

    def kill_head(self, timeout: float = 10.0) -> None:
        """SIGKILL the head's processes (GCS, raylet, ...)."""
        left = self._kill([self.head], timeout=timeout, reaped=False)
        if left:
            raise RayClusterError(f"processes of the head survived SIGKILL: {[p.pid for p in left]}")

    def cut_link(self, i: int) -> None:
        """Host i's eth0 down (``net.cut_link``): its Ray node goes silent, nothing is reset."""
        self.net.cut_link(i)

    def restore_link(self, i: int, wait: bool = False) -> None:
        self.net.restore_link(i, wait=wait)

    def restart_node(self, i: int | Sequence[int]) -> None:
        """A fresh Ray node on host i (or on each of several hosts, started in parallel):
        leftovers of its old node killed first, its link brought up if cut. Waits until the
        GCS reports the new node alive; ``node_id(i)`` is then the new id."""
        indices = [i] if isinstance(i, int) else list(i)
        for j in indices:
            if not self.net.link_up(j):
                self.net.restore_link(j, wait=False)
            self.kill_node(j)
        self._start_workers(indices)

    def reset(self, timeout: float = 60.0) -> list[int]:
        """Back to a healthy cluster for the next test of a shared fixture: links up, sshds
        killed with ``kill_node(i, host=True)`` restarted, every host whose node is not
        alive (or whose processes are gone) gets a fresh node, and the GCS reports each
        host's earlier nodes dead (a killed node stays listed alive until the GCS's health
        check fails it, so a host would show two alive nodes). Returns the hosts restarted.
        Raises RayClusterError when an earlier node is still alive after ``timeout`` s."""
        for j in range(len(self.workers)):
            if not self.net.link_up(j):
                self.net.restore_link(j, wait=False)
            self.net.start_sshd(j)                  # no-op while it runs
        nodes = self.nodes()
        alive = {n["node_id"] for n in nodes if n["alive"]}
        redo = [j for j, w in enumerate(self.workers)
                if w.node_id not in alive or not self.processes(j)]
        if redo:
            self.restart_node(redo)
        earlier = [nid for w in self.workers for nid in w.ids if nid != w.node_id]
        if redo or any(nid in alive for nid in earlier):
            r = self.query({"dead_ids": earlier}, timeout=timeout)
            if not r["ok"]:
                raise RayClusterError(f"the GCS still reports earlier nodes alive after {timeout} s: "
                                      f"{self._describe(r['nodes'])}")
        return redo

    # ---------------------------------------------------------------- drivers
    def run_python(self, code: str, host: int | None = None, timeout: float = 120.0,
                   env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``python -c code`` (a driver: ``ray.init()`` finds the cluster by ``RAY_ADDRESS``)
        in the root namespace, or inside host ``host``'s namespace."""
        argv = [sys.executable, "-c", code]
        if host is not None:
            argv = ["ip", "netns", "exec", self.net.host(host).ns, *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env(env),
                              stdin=subprocess.DEVNULL, check=False)


class _PortTaken(RayClusterError):
    pass


def _temp_base() -> str:
    """A temp dir short enough for Ray's socket paths: $TMPDIR when it is, else /tmp."""
    base = tempfile.gettempdir()
    longest = len(base) + len(f"/{FAMILY}-{os.getpid()}-XXXXXXXX/0.99") + _SESSION_SUFFIX_LEN
    if longest > SUN_PATH_MAX:
        base = "/tmp"
    return base


def cleanup_stale() -> list[str]:
    """Kill processes and remove temp dirs of Ray test clusters whose session is gone: its
    process no longer runs (no nethosts session lock held), or it is this process's pid but no
    open cluster (an earlier process with our pid). Returns what it removed."""
    removed: list[str] = []
    stale = []
    for base in {tempfile.gettempdir(), "/tmp"}:
        for d in Path(base).glob(f"{FAMILY}-*"):
            m = _TMP_RE.match(d.name)
            if not m or not d.is_dir():
                continue
            pid = int(m.group(1))
            with _registry_lock:
                mine = str(d) in _active
            if pid == os.getpid():
                if not mine:
                    stale.append(d)
            else:
                with nethosts._global_lock():
                    if not nethosts._owner_alive(pid, None):
                        stale.append(d)
    if stale:
        removed += _reap(stale)
    return removed


def _reap(dirs: Sequence[Path], timeout: float = 10.0) -> list[str]:
    """Kill every process of the clusters whose temp dirs are ``dirs`` (command line names the
    dir, or a session id recorded in its ``sids`` file on a Ray-looking process) and remove
    the dirs. Returns what it did (one line each)."""
    done: list[str] = []
    frags = [str(d) + "/" for d in dirs]
    sids: set[int] = set()
    for d in dirs:
        try:
            sids.update(int(x) for x in (Path(d) / "sids").read_text().split() if x.isdigit())
        except OSError:
            pass

    def match(p: _Proc) -> bool:
        # a recorded session id alone is not proof (the number may be reused once all its
        # members died): also a Ray-looking process
        ray_like = p.cmdline.startswith(("ray::", "[ray::", "[raylet]", "[gcs_server]")) or "/ray/" in p.cmdline
        return any(f in p.cmdline for f in frags) or (p.sid in sids and ray_like)
    left = _kill_until_gone(match, timeout=timeout)
    if left:
        done.append(f"could not kill {[p.pid for p in left]}")
    for d in dirs:
        if Path(d).exists():
            shutil.rmtree(d, ignore_errors=True)
            done.append(f"dir {d}")
    return done


# The watcher: a small process per cluster (no Ray in it) that holds the read end of a pipe
# whose write end only the test process has; EOF means the test process is gone (also by
# SIGKILL) or closed the cluster: it then kills whatever of the cluster is left.
_WATCHER = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)          # a ^C of pytest's process group
sys.path.insert(0, sys.argv[1])
while sys.stdin.buffer.read(65536):
    pass
import raycluster
raycluster._reap([raycluster.Path(sys.argv[2])])
"""
