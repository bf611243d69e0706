"""Per-rank GPU telemetry and GPU faults, through one NVML seam (docs/metrics.md, docs/recovery.md).

**The seam.** :func:`nvml` is the only place NVML comes from: ``pynvml`` (the ``nvidia-ml-py``
package), or, for tests only, the Python file named by ``ORCH_FAKE_NVML`` (``tests/fake_nvml.py``), loaded
as a module with ``pynvml``'s API names, so the same code runs against both. The agent looks for
``ORCH_FAKE_NVML`` in its own environment, then in its ranks' environment as the plan sets it (the local
provisioner passes no ``ORCH_*`` variable to its agents, so a test names it in the spec's ``env`` or
``node_env``). A fake module may define ``orch_configure(env)``: it is called with the environment the
path was found in (the fake reads its state file's name from there).

**Rank -> physical GPU** (:func:`rank_device`): the rank's ``LOCAL_RANK``-th entry of its
``CUDA_VISIBLE_DEVICES`` (torch's usual ``cuda:LOCAL_RANK``; with one entry, that one; unset: every
GPU), which is an index or a ``GPU-``/``MIG-`` UUID (a unique prefix, as CUDA accepts). An index counts
CUDA's order: with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` it is NVML's index (NVML enumerates by PCI bus id).
CUDA's default, ``FASTEST_FIRST``, orders by speed, ties in PCI bus order: on a node whose GPUs are all
one model that is NVML's order too, and the index is taken as NVML's; on a mixed node it may differ, so
the index is still taken as NVML's and the agent warns once, naming ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or
UUIDs as the fix. A GPU is named by its PCI bus id (``00000000:3B:00.0``) and NVML index.

**Faults.** Each poll (every heartbeat, :meth:`NodeGpus.poll`) waits 0 ms on an NVML event set
registered for Xid critical errors and double-bit ECC errors on the node's GPUs (those its ranks use): an
Xid in :data:`FAULT_XIDS` or a double-bit ECC error becomes a ``gpu_fault`` message to the controller,
which fails the attempt (cause ``gpu_fault``).

**NVML errors** are counted (``orch_gpu_nvml_errors_total``), retried at the next scrape or poll (NVML is
shut down and initialised again after :data:`REINIT_AFTER` failures in a row), and reported: one
``warning`` to the controller per call and error kind, never silently off. ``NVMLError_NotSupported``
(ECC on a consumer GPU, say) is no error: that value is absent.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any, Callable, Mapping

__all__ = ["FAKE_VAR", "FAULT_XIDS", "REINIT_AFTER", "THROTTLE_REASONS", "nvml", "visible_entries",
           "rank_device", "bus_id", "NodeGpus", "rank_envs", "start", "families"]

FAKE_VAR = "ORCH_FAKE_NVML"
#: Xids that are a fault of the GPU (NVIDIA's Xid catalogue): 48 double-bit ECC error, 63/64 ECC page
#: retirement or row remapping event/failure, 74 NVLink error, 79 the GPU has fallen off the bus.
FAULT_XIDS = {48: "double-bit ECC error", 63: "ECC page retirement / row remapping event",
              64: "ECC page retirement / row remapping failure", 74: "NVLink error",
              79: "the GPU has fallen off the bus"}
REINIT_AFTER = 3
#: NVML's clock throttle (event) reason bits -> names.
THROTTLE_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
_XID_EVENT, _DBE_EVENT = 0x8, 0x2  # nvmlEventTypeXidCriticalError, nvmlEventTypeDoubleBitEccError
_fakes: dict[str, Any] = {}


def nvml(env: Mapping[str, str] | None = None) -> Any:
    """The NVML module: the fake named by ``ORCH_FAKE_NVML`` in ``env`` (default ``os.environ``), else ``pynvml``.

    Raises:
        ImportError: no ``pynvml`` (nor a fake) here; OSError: the fake's file cannot be read.
    """
    env = os.environ if env is None else env
    path = env.get(FAKE_VAR)
    if not path:
        import pynvml
        return pynvml
    module = _fakes.get(path)
    if module is None:
        spec = importlib.util.spec_from_file_location(f"orch_fake_nvml_{len(_fakes)}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{FAKE_VAR}={path}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _fakes[path] = module
    if hasattr(module, "orch_configure"):
        module.orch_configure(dict(env))
    return module


def visible_entries(env: Mapping[str, str]) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` as CUDA reads them (up to the first invalid one), or None when
    unset (every GPU visible). An empty value hides every GPU: ``[]``."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    out = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            out.append(entry)
        else:
            break  # CUDA ignores this entry and every one after it
    return out


def bus_id(mod: Any, handle: Any) -> str:
    """The GPU's PCI bus id (``00000000:3B:00.0``, upper case), from NVML."""
    raw = mod.nvmlDeviceGetPciInfo(handle).busId
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).upper()


def _by_uuid(mod: Any, entry: str) -> Any:
    """The GPU handle of a ``GPU-``/``MIG-`` entry (a unique UUID prefix, as CUDA accepts; a MIG device's parent)."""
    if entry.startswith("MIG-"):
        return mod.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mod.nvmlDeviceGetHandleByUUID(entry))
    matches = []
    for i in range(mod.nvmlDeviceGetCount()):
        h = mod.nvmlDeviceGetHandleByIndex(i)
        uuid = mod.nvmlDeviceGetUUID(h)
        if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(entry):
            matches.append(h)
    if len(matches) != 1:
        raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry} matches {len(matches)} GPUs")
    return matches[0]


def rank_device(mod: Any, env: Mapping[str, str]) -> tuple[Any, str | None] | None:
    """The rank's physical GPU: ``(NVML handle, a warning or None)``, or None when the rank sees no GPU.

    Args:
        mod: an initialised NVML module (:func:`nvml`).
        env: the rank's environment (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``, ``LOCAL_RANK``).

    Raises:
        LookupError: an entry names no GPU of this node (a UUID nobody has, an index past the count).
        NVMLError: from NVML.
    """
    entries = visible_entries(env)
    count = mod.nvmlDeviceGetCount()
    if entries is None:
        entries = [str(i) for i in range(count)]
    if not entries:
        return None
    pick = 0 if len(entries) == 1 else int(env.get("LOCAL_RANK", "0") or 0)
    if pick >= len(entries):
        raise LookupError(f"LOCAL_RANK {pick} but CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')} "
                          f"names {len(entries)} GPU(s)")
    entry = entries[pick]
    if not entry.isdigit():
        return _by_uuid(mod, entry), None
    if int(entry) >= count:
        raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry}: this node has {count} GPU(s)")
    warning = None
    if env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID":
        names = {_text(mod.nvmlDeviceGetName(mod.nvmlDeviceGetHandleByIndex(i))) for i in range(count)}
        if len(names) > 1:
            warning = (f"this node's GPUs are of {len(names)} models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: "
                       f"CUDA's device {entry} may not be NVML's, so the per-rank GPU series may name another GPU; "
                       "set CUDA_DEVICE_ORDER=PCI_BUS_ID or give CUDA_VISIBLE_DEVICES as GPU UUIDs")
    return mod.nvmlDeviceGetHandleByIndex(int(entry)), warning


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def rank_envs(base_env: Mapping[str, str], node: dict) -> dict[int, dict[str, str]]:
    """Each rank's environment as the agent gives it (the plan's, laid over the node's; slots mapped to the
    node's assigned devices, :mod:`agents.devices`), by global rank; a rank whose slots cannot be mapped
    keeps the plan's value (the start reports that)."""
    from . import devices
    from .nodeenv import rank_env
    out = {}
    for r in node["ranks"]:
        env = rank_env(dict(base_env), node, r)
        try:
            physical = devices.mapped(r.get("env") or {}, base_env, node["host"])
        except ValueError:
            physical = None
        if physical is not None:
            env[devices.VAR] = physical
        out[int(r["global_rank"])] = env
    return out


def _error_name(err: BaseException) -> str:
    name = type(err).__name__
    return name.split("NVMLError_", 1)[1] if name.startswith("NVMLError_") else name


class NodeGpus:
    """The GPUs of one node's ranks, sampled at scrape time and polled for faults.

    Args:
        envs: each rank's environment, by global rank (:func:`rank_envs`).
        host, node_rank: this node, for messages.
        send: sends a message to the controller (``warning``, ``gpu_fault``); must be thread-safe.
        expect_gpus: whether this node should have NVIDIA GPUs (its accelerator is ``cuda``, or a fake NVML is
            named): NVML failing to load then is reported; otherwise it means "no GPU here", silently.

    ``samples()`` and ``poll()`` never raise: NVML errors are counted in ``errors`` (``{(call, error): n}``).
    """

    def __init__(self, envs: dict[int, dict[str, str]], host: str, node_rank: int,
                 send: Callable[[dict], None], expect_gpus: bool = False) -> None:
        self.envs, self.host, self.node_rank, self.send = envs, host, node_rank, send
        self.expect_gpus = expect_gpus or any(FAKE_VAR in e for e in envs.values()) or FAKE_VAR in os.environ
        self.errors: dict[tuple[str, str], int] = {}
        self.xids: dict[tuple[str, int], int] = {}  # (bus id, xid) -> events seen
        self.faults: list[dict] = []
        self._mod: Any = None
        self._absent = False  # no NVML library or driver (a CPU node), known since the first init
        self._gpus: dict[str, dict] = {}  # bus id -> {"handle", "index", "ranks"}
        self._events: Any = None
        self._failures = 0
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- NVML state ---------------------------------------------------------------------------------------------

    def _error(self, call: str, err: BaseException) -> None:
        """Count an NVML error, warn once per (call, kind); after REINIT_AFTER in a row NVML starts afresh."""
        key = (call, _error_name(err))
        self.errors[key] = self.errors.get(key, 0) + 1
        self._failures += 1
        if key not in self._warned:
            self._warned.add(key)
            self.send({"type": "warning", "message": f"NVML on {self.host} (node {self.node_rank}): {call} failed "
                       f"({key[1]}: {err}); counted in orch_gpu_nvml_errors_total and retried at each scrape"})
        if self._failures >= REINIT_AFTER:
            self._reset()

    def _reset(self) -> None:
        if self._mod is not None:
            try:
                if self._events is not None:
                    self._mod.nvmlEventSetFree(self._events)
                self._mod.nvmlShutdown()
            except Exception:  # noqa: BLE001 - starting afresh anyway
                pass
        self._mod, self._events, self._gpus, self._failures = None, None, {}, 0

    def _ready(self) -> bool:
        """NVML loaded, initialised, the ranks' GPUs found and the event set registered; False if not (counted)."""
        if self._mod is not None:
            return True
        if self._absent:
            return False
        env = next((e for e in self.envs.values() if FAKE_VAR in e), os.environ)
        try:
            mod = nvml(env)
            mod.nvmlInit()
        except Exception as err:  # noqa: BLE001 - no library / no driver: a CPU node unless GPUs are expected
            if not self.expect_gpus:
                self._absent = True
                return False
            self._error("nvmlInit", err)
            return False
        self._mod = mod
        try:
            self._find(mod)
            self._register(mod)
        except Exception as err:  # noqa: BLE001 - counted; NVML starts afresh at the next call
            self._error("device lookup", err)
            self._reset()
            return False
        return True

    def _find(self, mod: Any) -> None:
        for rank, env in sorted(self.envs.items()):
            try:
                found = rank_device(mod, env)
            except LookupError as err:
                self._warn_once(("map", str(err)), f"rank {rank} on {self.host}: {err}; no GPU series for it")
                continue
            if found is None:
                continue
            handle, warning = found
            if warning:
                self._warn_once(("order", ""), f"{self.host}: {warning}")
            bus = bus_id(mod, handle)
            gpu = self._gpus.setdefault(bus, {"handle": handle, "index": int(mod.nvmlDeviceGetIndex(handle)),
                                              "ranks": []})
            gpu["ranks"].append(rank)

    def _register(self, mod: Any) -> None:
        self._events = mod.nvmlEventSetCreate()
        for bus, gpu in self._gpus.items():
            for kind in (_XID_EVENT, _DBE_EVENT):
                try:
                    mod.nvmlDeviceRegisterEvents(gpu["handle"], kind, self._events)
                except mod.NVMLError_NotSupported:
                    continue

    def _warn_once(self, key: tuple[str, str], message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.send({"type": "warning", "message": message})

    # -- what the agent calls -----------------------------------------------------------------------------------

    def samples(self) -> list[dict]:
        """One dict per GPU of the node's ranks: ``gpu`` (bus id), ``gpu_index``, ``ranks`` and whichever of
        ``utilization`` (0..1), ``memory_used``/``memory_total`` (bytes), ``power_watts``, ``temperature_c``,
        ``sm_clock_mhz``, ``memory_clock_mhz``, ``throttle`` (reason names), ``ecc_single``/``ecc_double``
        (volatile counts) NVML gives; [] without NVML. Errors are counted, never raised."""
        with self._lock:
            if not self._ready():
                return []
            out = []
            for bus, gpu in sorted(self._gpus.items()):
                row = {"gpu": bus, "gpu_index": gpu["index"], "ranks": list(gpu["ranks"])}
                ok = True
                for name, read in self._readers():
                    try:
                        row.update(read(gpu["handle"]))
                    except self._mod.NVMLError_NotSupported:
                        continue
                    except Exception as err:  # noqa: BLE001 - counted, retried next scrape
                        ok = False
                        self._error(name, err)
                        if self._mod is None:
                            return out
                if ok:
                    self._failures = 0
                out.append(row)
            return out

    def _readers(self) -> list[tuple[str, Callable[[Any], dict]]]:
        """(NVML call, handle -> the values it gives) for each group of values of :meth:`samples`."""
        m = self._mod

        def memory(h: Any) -> dict:
            info = m.nvmlDeviceGetMemoryInfo(h)
            return {"memory_used": float(info.used), "memory_total": float(info.total)}

        def clocks(h: Any) -> dict:
            return {"sm_clock_mhz": float(m.nvmlDeviceGetClockInfo(h, m.NVML_CLOCK_SM)),
                    "memory_clock_mhz": float(m.nvmlDeviceGetClockInfo(h, m.NVML_CLOCK_MEM))}

        def throttle(h: Any) -> dict:
            bits = int(m.nvmlDeviceGetCurrentClocksThrottleReasons(h))
            return {"throttle": [name for bit, name in THROTTLE_REASONS.items() if bits & bit]}

        def ecc(h: Any) -> dict:
            def count(kind: int) -> float:
                return float(m.nvmlDeviceGetTotalEccErrors(h, kind, m.NVML_VOLATILE_ECC))
            return {"ecc_single": count(m.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                    "ecc_double": count(m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)}

        return [
            ("nvmlDeviceGetUtilizationRates", lambda h: {"utilization": m.nvmlDeviceGetUtilizationRates(h).gpu / 100}),
            ("nvmlDeviceGetMemoryInfo", memory),
            ("nvmlDeviceGetPowerUsage", lambda h: {"power_watts": m.nvmlDeviceGetPowerUsage(h) / 1000.0}),
            ("nvmlDeviceGetTemperature",
             lambda h: {"temperature_c": float(m.nvmlDeviceGetTemperature(h, m.NVML_TEMPERATURE_GPU))}),
            ("nvmlDeviceGetClockInfo", clocks),
            ("nvmlDeviceGetCurrentClocksThrottleReasons", throttle),
            ("nvmlDeviceGetTotalEccErrors", ecc),
        ]

    def node_samples(self) -> list[dict]:
        """Every GPU of the node (the ``orch_node_gpu_*`` series): ``gpu`` (NVML index), ``utilization``, ``used``,
        ``total``; [] without NVML. Errors are counted, never raised."""
        with self._lock:
            if not self._ready():
                return []
            m, out = self._mod, []
            try:
                for i in range(m.nvmlDeviceGetCount()):
                    h = m.nvmlDeviceGetHandleByIndex(i)
                    mem = m.nvmlDeviceGetMemoryInfo(h)
                    out.append({"gpu": i, "utilization": m.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
                                "used": float(mem.used), "total": float(mem.total)})
            except Exception as err:  # noqa: BLE001 - counted, retried next scrape
                self._error("node GPU sample", err)
            return out

    def poll(self) -> list[dict]:
        """Read the NVML events that arrived (0 ms wait); send and return a ``gpu_fault`` message for each fault:
        ``{"type": "gpu_fault", "gpu": bus id, "gpu_index", "xid" (or None), "ecc": "double_bit" (or None),
        "what", "ranks", "at"}``. Other Xids are counted (``xids``) only."""
        found = []
        with self._lock:
            if not self._ready() or self._events is None:
                return []
            m = self._mod
            for _ in range(64):  # what arrived since the last poll, at most
                try:
                    data = m.nvmlEventSetWait(self._events, 0)
                except m.NVMLError_Timeout:
                    break
                except Exception as err:  # noqa: BLE001 - counted, retried next poll
                    self._error("nvmlEventSetWait", err)
                    break
                fault = self._event(m, data)
                if fault is not None:
                    found.append(fault)
        for fault in found:
            self.faults.append(fault)
            self.send(fault)
        return found

    def _event(self, m: Any, data: Any) -> dict | None:
        try:
            bus = bus_id(m, data.device)
        except Exception as err:  # noqa: BLE001
            self._error("nvmlDeviceGetPciInfo", err)
            return None
        gpu = self._gpus.get(bus, {"index": None, "ranks": []})
        xid = int(data.eventData) if int(data.eventType) & _XID_EVENT else None
        if xid is not None:
            self.xids[(bus, xid)] = self.xids.get((bus, xid), 0) + 1
        if xid is not None and xid not in FAULT_XIDS:
            return None
        what = f"Xid {xid} ({FAULT_XIDS[xid]})" if xid is not None else "a double-bit ECC error"
        return {"type": "gpu_fault", "gpu": bus, "gpu_index": gpu["index"], "xid": xid,
                "ecc": None if xid is not None else "double_bit", "what": what, "ranks": list(gpu["ranks"]),
                "at": time.time()}

    def run(self, interval_s: float) -> None:
        """Poll every ``interval_s`` seconds until :meth:`close` (the agent runs this on a thread of its own)."""
        while not self._stop.wait(interval_s):
            self.poll()

    def close(self) -> None:
        """Stop polling and shut NVML down."""
        self._stop.set()
        with self._lock:
            self._reset()


def start(base_env: Mapping[str, str], node: dict, send: Callable[[dict], None], interval_s: float,
          expect_gpus: bool) -> NodeGpus:
    """The node's :class:`NodeGpus` for the plan's ranks, polled for faults every ``interval_s`` (at most 1 s)
    on a daemon thread; :meth:`NodeGpus.close` stops it."""
    gpus = NodeGpus(rank_envs(base_env, node), node["host"], int(node["node_rank"]), send, expect_gpus)
    threading.Thread(target=gpus.run, args=(min(float(interval_s), 1.0),), name="gpu-watch", daemon=True).start()
    return gpus


_RANK_SERIES = (  # (name, sample key, help); labels job, attempt, node, rank, gpu, gpu_index
    ("orch_rank_gpu_utilization_ratio", "utilization", "GPU busy time over the driver's last sample period, 0..1"),
    ("orch_rank_gpu_memory_used_bytes", "memory_used", "memory in use on the rank's GPU"),
    ("orch_rank_gpu_memory_total_bytes", "memory_total", "memory of the rank's GPU"),
    ("orch_rank_gpu_power_watts", "power_watts", "power draw of the rank's GPU"),
    ("orch_rank_gpu_temperature_celsius", "temperature_c", "core temperature of the rank's GPU"),
    ("orch_rank_gpu_sm_clock_hertz", "sm_clock_mhz", "SM clock of the rank's GPU"),
    ("orch_rank_gpu_memory_clock_hertz", "memory_clock_mhz", "memory clock of the rank's GPU"),
)


def families(base: list[str], gpus: NodeGpus) -> list[Any]:
    """The Prometheus families of the node's ranks' GPUs (docs/metrics.md), ``base`` being the values of the
    labels ``job, attempt, node``; the NVML error counter is there once an error was counted."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    labels = ["job", "attempt", "node", "rank", "gpu", "gpu_index"]
    rows = gpus.samples()
    out: dict[str, Any] = {}
    for row in rows:
        for rank in row["ranks"]:
            key = base + [str(rank), row["gpu"], str(row["gpu_index"])]
            for name, field, doc in _RANK_SERIES:
                if row.get(field) is not None:
                    fam = out.setdefault(name, GaugeMetricFamily(name, doc + " (NVML)", labels=labels))
                    fam.add_metric(key, row[field] * (1e6 if field.endswith("_mhz") else 1))
            if "throttle" in row:
                fam = out.setdefault("orch_rank_gpu_clock_throttle", GaugeMetricFamily(
                    "orch_rank_gpu_clock_throttle", "1 while NVML reports this clock throttle reason, else 0",
                    labels=labels + ["reason"]))
                for reason in THROTTLE_REASONS.values():
                    fam.add_metric(key + [reason], 1 if reason in row["throttle"] else 0)
            for kind in ("single", "double"):
                if row.get(f"ecc_{kind}") is not None:
                    fam = out.setdefault("orch_rank_gpu_ecc_errors", CounterMetricFamily(
                        "orch_rank_gpu_ecc_errors", "ECC errors of the rank's GPU since the driver loaded (volatile)",
                        labels=labels + ["type"]))
                    fam.add_metric(key + [f"{kind}_bit"], row[f"ecc_{kind}"])
            xids = [(x, n) for (bus, x), n in gpus.xids.items() if bus == row["gpu"]]
            if xids:
                fam = out.setdefault("orch_rank_gpu_xid_events", CounterMetricFamily(
                    "orch_rank_gpu_xid_events", "Xid events NVML reported for the rank's GPU while the agent ran",
                    labels=labels + ["xid"]))
                for xid, n in sorted(xids):
                    fam.add_metric(key + [str(xid)], n)
    if gpus.errors:
        fam = CounterMetricFamily("orch_gpu_nvml_errors", "NVML calls that failed (each retried at the next "
                                  "scrape or poll)", labels=["job", "attempt", "node", "call", "error"])
        for (call, error), n in sorted(gpus.errors.items()):
            fam.add_metric(base + [call, error], n)
        out[fam.name] = fam
    return list(out.values())
