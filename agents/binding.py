"""The spec's ``bind_cores`` on a node: which CPUs each rank is pinned to, and its ``OMP_NUM_THREADS``.

What DeepSpeed's ``deepspeed.launcher.launch --bind_cores_to_rank`` does (``deepspeed.utils.numa.get_numactl_cmd``):
the node's physical cores (``psutil.cpu_count(logical=False)``, taken as CPUs ``0..P-1``), or the
``--bind_core_list``, split into contiguous blocks of ``cores // local ranks`` (the remainder unused), local rank
``k`` getting block ``k``; each rank started under ``numactl -C <its cores>`` plus ``-m <node>`` (memory bound to
the NUMA node holding all its cores; ``-p`` on flat-HBM machines); and ``OMP_NUM_THREADS`` set to the block's size,
over any value the environment had. orch does the same without numactl:

- ``off``: nothing (ranks inherit the agent's CPUs; ``OMP_NUM_THREADS`` untouched).
- ``auto`` on a node whose ranks use NVIDIA GPUs (their accelerator is ``cuda``): each rank's GPU is its slot's
  device (``agents.devices``: the node's ``CUDA_VISIBLE_DEVICES`` list, else the slot itself), its PCI bus id from
  ``nvidia-smi --query-gpu=index,uuid,pci.bus_id``, its NUMA node from ``/sys/bus/pci/devices/<bus id>/numa_node``,
  that node's CPUs from ``/sys/devices/system/node/node<N>/cpulist``; the physical cores among them (the first
  hyperthread of each core, ``topology/thread_siblings_list``) that the agent may use are split into contiguous
  blocks among the ranks whose GPUs are on that NUMA node (in slot order, remainder unused). A GPU with no NUMA
  node (``-1``) counts as on a node holding every CPU.
- ``auto`` on any other node: the node's physical cores the agent may use, split the same way among all its ranks
  in local-rank order (DeepSpeed's CPU behaviour).
- a map slot -> CPU list: the slot's CPUs as given, less those the agent may not use; a slot the map lacks fails
  the start (naming slot and node).

"The agent may use": ``os.sched_getaffinity(0)`` of the agent (its cgroup cpuset, Slurm's binding); a rank left
with no CPU fails the start, naming rank, node, the CPUs asked and those allowed. Each bound rank's environment
gets ``OMP_NUM_THREADS`` = its CPU count, as DeepSpeed sets it (overriding the node's, the launcher's and the
spec's value). Memory is not bound (no ``numactl -m``): Linux's default policy allocates a pinned thread's pages
on its own NUMA node while that node has free memory, where ``-m`` would fail instead of spilling over.

Test seams (never set in production): ``ORCH_SYSFS_ROOT`` (default ``/``) is prefixed to every sysfs path read
here; ``ORCH_FAKE_GPU_BUS_IDS`` (``"0000:17:00.0,0000:b1:00.0"``: GPU 0's, GPU 1's, ...) replaces
``nvidia-smi`` and makes the node a GPU node.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Iterable, Mapping, Sequence

from . import devices
from .nodeenv import node_accelerator

__all__ = ["BindError", "parse_cpus", "cpu_text", "node_cpus", "rank_cpus", "apply", "report", "warn_native",
           "SYSFS_ENV", "FAKE_BUS_IDS_ENV"]

#: test seam: the directory standing for ``/`` when sysfs is read
SYSFS_ENV = "ORCH_SYSFS_ROOT"
#: test seam: the GPUs' PCI bus ids, by index, comma-separated (instead of asking nvidia-smi)
FAKE_BUS_IDS_ENV = "ORCH_FAKE_GPU_BUS_IDS"
OMP_VAR = "OMP_NUM_THREADS"


class BindError(ValueError):
    """The ranks of a node cannot be bound as the spec asks (the message names node, rank or slot, and why).

    Attributes:
        global_rank: the rank concerned, or None (the node's).
    """

    def __init__(self, message: str, global_rank: int | None = None) -> None:
        super().__init__(message)
        self.global_rank = global_rank


def parse_cpus(text: str) -> list[int]:
    """A Linux cpulist (``"0-3,8"``) -> sorted CPUs; ``""`` (a memory-only NUMA node) -> ``[]``.

    Raises:
        ValueError: a part is not ``N`` or ``N-M``.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part.strip():
            continue
        lo, sep, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return sorted(cpus)


def cpu_text(cpus: Iterable[int] | None) -> str | None:
    """Sorted CPUs -> the short cpulist (``[0, 1, 2, 5]`` -> ``"0-2,5"``); None stays None."""
    if cpus is None:
        return None
    out: list[list[int]] = []
    for c in sorted(set(cpus)):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _read(root: str, path: str) -> str:
    with open(os.path.join(root, path.lstrip("/")), encoding="ascii") as f:
        return f.read().strip()


def _numa_nodes(root: str) -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from sysfs ({} where sysfs has no node directory)."""
    base = os.path.join(root, "sys/devices/system/node")
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            try:
                out[int(name[4:])] = parse_cpus(_read(root, f"/sys/devices/system/node/{name}/cpulist"))
            except (OSError, ValueError):
                continue
    return out


def _physical(cpus: Sequence[int], root: str) -> list[int]:
    """The first hyperthread of each physical core among ``cpus`` (a CPU whose sibling list cannot be read
    counts as a core of its own)."""
    chosen = set(cpus)
    out = []
    for c in sorted(chosen):
        try:
            siblings = parse_cpus(_read(root, f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"))
        except (OSError, ValueError):
            siblings = [c]
        if min([s for s in siblings if s in chosen] or [c]) == c:
            out.append(c)
    return out


def _bus_ids(env: Mapping[str, str], host: str) -> dict[str, str]:
    """GPU index and UUID -> sysfs PCI address (``0000:17:00.0``), from the test seam or nvidia-smi.

    Raises:
        BindError: nvidia-smi is missing or fails.
    """
    fake = env.get(FAKE_BUS_IDS_ENV)
    if fake is not None:
        rows = [(str(i), "", bus.strip()) for i, bus in enumerate(fake.split(",")) if bus.strip()]
    else:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError) as err:
            raise BindError(f"bind_cores auto on {host}: cannot read the GPUs' PCI bus ids with nvidia-smi "
                            f"({getattr(err, 'strerror', None) or err}); give bind_cores a map slot -> CPU list, "
                            "or turn it off") from None
        rows = [tuple(p.strip() for p in line.split(",")) for line in out.splitlines() if line.count(",") == 2]
    ids: dict[str, str] = {}
    for index, uuid, bus in rows:
        domain, _, rest = bus.lower().partition(":")  # nvidia-smi: 00000000:17:00.0; sysfs: 0000:17:00.0
        address = f"{domain[-4:]}:{rest}" if rest else bus.lower()
        ids[index] = address
        if uuid:
            ids[uuid] = address
    return ids


def _blocks(cores: Sequence[int], owners: Sequence[int], host: str, where: str) -> dict[int, list[int]]:
    """``cores`` split into ``len(owners)`` contiguous blocks of ``len(cores) // len(owners)``, in order."""
    per = len(cores) // len(owners)
    if per < 1:
        raise BindError(f"bind_cores auto on {host}: {len(owners)} ranks share {where}, which has "
                        f"{len(cores)} physical core(s) this node may use ({cpu_text(cores) or 'none'}): at least "
                        "one core per rank is needed", owners[0])
    return {rank: list(cores[per * i:per * (i + 1)]) for i, rank in enumerate(owners)}


def _auto_gpu(ranks: Sequence[Mapping[str, Any]], env: Mapping[str, str], host: str, root: str,
              allowed: set[int]) -> dict[int, list[int]]:
    ids = _bus_ids(env, host)
    assigned = devices.assigned(env)
    groups: dict[int, list[int]] = {}
    for r in sorted(ranks, key=lambda r: (int(r["slot"]), int(r["global_rank"]))):
        slot = int(r["slot"])
        gpu = (assigned[slot] if slot < len(assigned) else None) if assigned is not None else str(slot)
        bus = ids.get(gpu) if gpu is not None else None
        if bus is None:
            raise BindError(f"bind_cores auto on {host}: slot {slot} (rank {r['global_rank']}) uses GPU "
                            f"{gpu if gpu is not None else '(none assigned)'}, which is not among this node's GPUs "
                            f"({', '.join(k for k in ids if k.isdigit()) or 'none found'})", int(r["global_rank"]))
        try:
            numa = int(_read(root, f"/sys/bus/pci/devices/{bus}/numa_node"))
        except (OSError, ValueError) as err:
            raise BindError(f"bind_cores auto on {host}: cannot read the NUMA node of GPU {gpu} ({bus}) of rank "
                            f"{r['global_rank']}: {getattr(err, 'strerror', None) or err}", int(r["global_rank"]))
        groups.setdefault(numa, []).append(int(r["global_rank"]))
    nodes = _numa_nodes(root)
    out: dict[int, list[int]] = {}
    for numa, owners in groups.items():
        cpus = nodes.get(numa) if numa >= 0 else sorted(allowed)
        if cpus is None:
            raise BindError(f"bind_cores auto on {host}: NUMA node {numa} (of rank {owners[0]}'s GPU) has no "
                            "CPU list in /sys/devices/system/node", owners[0])
        where = f"NUMA node {numa}" if numa >= 0 else "the node (their GPUs have no NUMA node)"
        out.update(_blocks(_physical([c for c in cpus if c in allowed], root), owners, host, where))
    return out


def rank_cpus(bind: Any, ranks: Sequence[Mapping[str, Any]], host: str, env: Mapping[str, str],
              allowed: Iterable[int], gpus: bool) -> dict[int, list[int]]:
    """Each rank's CPUs on this node under ``bind`` (module docstring).

    Args:
        bind: the node plan's ``bind_cores``: ``"off"``, ``"auto"`` or slot -> cpulist (slot keys int or str).
        ranks: the node's ranks (``{"global_rank", "local_rank", "slot", ...}``, the plan's order).
        host: the node's name, for messages.
        env: the node's environment (``CUDA_VISIBLE_DEVICES``, and the test seams).
        allowed: the CPUs the agent may use.
        gpus: whether the ranks use NVIDIA GPUs (``auto`` binds them to their GPUs' NUMA nodes).

    Returns:
        global rank -> its sorted CPUs; ``{}`` for ``off``.

    Raises:
        BindError: a slot the map lacks, a rank left without CPUs, or (``auto`` with GPUs) a GPU or NUMA node
            that cannot be found; the message names node, rank or slot.
    """
    allowed = set(allowed)
    root = env.get(SYSFS_ENV) or "/"
    if bind in (None, "off", False):
        return {}
    if bind == "auto":
        if gpus:
            return _auto_gpu(ranks, env, host, root, allowed)
        order = [int(r["global_rank"]) for r in sorted(ranks, key=lambda r: (int(r["local_rank"]),
                                                                              int(r["global_rank"])))]
        return _blocks(_physical(sorted(allowed), root), order, host, "the node") if order else {}
    if not isinstance(bind, Mapping):
        raise BindError(f"bind_cores on {host}: expected off, auto or a map slot -> CPU list; got {bind!r}")
    table = {int(k): v for k, v in bind.items()}
    out = {}
    for r in ranks:
        slot, rank = int(r["slot"]), int(r["global_rank"])
        if slot not in table:
            raise BindError(f"bind_cores on {host}: slot {slot} (rank {rank}) is not in the map (it has slots "
                            f"{', '.join(str(s) for s in sorted(table))}): add it", rank)
        asked = parse_cpus(str(table[slot]))
        kept = [c for c in asked if c in allowed]
        if not kept:
            raise BindError(f"bind_cores on {host}: rank {rank} (slot {slot}) asks for CPUs {cpu_text(asked)}, none "
                            f"of which this node's agent may use (allowed: {cpu_text(allowed) or 'none'}; a cgroup "
                            "cpuset or the scheduler's binding)", rank)
        out[rank] = kept
    return out


def node_cpus(node: Mapping[str, Any], env: Mapping[str, str],
              rank_envs: Sequence[dict[str, str]]) -> dict[int, list[int]]:
    """:func:`rank_cpus` for a node plan (``node["bind_cores"]``, ``node["ranks"]``) with the agent's own
    allowed CPUs, on a GPU node when the ranks' accelerator is ``cuda`` (``agents.nodeenv.node_accelerator`` of
    the first rank's environment) or the test seam names GPUs; sets ``OMP_NUM_THREADS`` in each bound rank's
    environment (``rank_envs``, in ``node["ranks"]``'s order) to its CPU count, as DeepSpeed's launcher does.
    Returns global rank -> CPUs ({} when ``off``).

    Raises:
        BindError: as :func:`rank_cpus`.
    """
    bind = node.get("bind_cores", "off")
    if bind in (None, "off", False):
        return {}
    # the accelerator a rank gets (DS_ACCELERATOR may be the spec's): the node's cuda ranks use its GPUs
    gpus = FAKE_BUS_IDS_ENV in env or node_accelerator(dict(rank_envs[0] if rank_envs else env)) == "cuda"
    cpus = rank_cpus(bind, node["ranks"], node["host"], env, os.sched_getaffinity(0), gpus)
    for r, renv in zip(node["ranks"], rank_envs):
        if int(r["global_rank"]) in cpus:
            renv[OMP_VAR] = str(len(cpus[int(r["global_rank"])]))
    return cpus


def apply(cpus: Iterable[int] | None) -> None:
    """Pin the calling process (in a rank's child, before the rank's code) to ``cpus``; None: no-op.

    Raises:
        OSError: the kernel refuses (a CPU went offline, or the cpuset changed since the start was planned).
    """
    if cpus:
        os.sched_setaffinity(0, cpus)


def report(cpus: Iterable[int] | None) -> dict[str, str]:
    """What a rank's entry in the agent's ``started`` message adds: ``{"cpus": "0-3"}``, or ``{}`` unbound."""
    return {"cpus": cpu_text(cpus) or ""} if cpus else {}


def warn_native(node: Mapping[str, Any], send: Any) -> None:
    """``launch_mode native`` (the real launcher starts the ranks, ``agents.adopted``): ``bind_cores`` is not
    applied there; unless it is ``off``, ``send`` (the agent's message writer's) gets a warning saying so."""
    if node.get("bind_cores", "off") not in (None, "off", False):
        send({"type": "warning", "message": f"bind_cores is not applied on {node['host']} in launch_mode native "
                                            "(the real launcher starts the ranks; use launch_mode emulated)"})
