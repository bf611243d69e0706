"""A fake NVML with ``pynvml``'s API names, for agents/gpu.py's test seam (``ORCH_FAKE_NVML=<this file>``).

Its machine is the JSON file named by ``ORCH_FAKE_NVML_STATE`` (in the environment given to
``orch_configure``, else ``os.environ``), read again at every call so that a test can change it while a
job runs::

    {"gpus": [{"bus_id": "00000000:3B:00.0", "uuid": "GPU-...", "name": "...", "util": 37, "mem_used": ...,
               "mem_total": ..., "power_mw": ..., "temp": ..., "sm_clock": ..., "mem_clock": ...,
               "throttle": <bitmask>, "ecc": {"single": n, "double": n} or null (not supported),
               "mig": ["MIG-..."]}],
     "events": [{"gpu": <index>, "xid": 79} or {"gpu": <index>, "dbe": true}],   # appended by the test
     "fail": {"<nvml function name>": <calls to fail, or -1: always>}}

An event set delivers only the events appended after it was created (as NVML delivers only events that
happen after registration), each once, for the GPUs registered on it.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
nvmlEventTypeSingleBitEccError, nvmlEventTypeDoubleBitEccError, nvmlEventTypeXidCriticalError = 1, 2, 8


class NVMLError(Exception):
    """pynvml's base error."""
    value = 999


class NVMLError_Uninitialized(NVMLError):
    value = 1


class NVMLError_NotSupported(NVMLError):
    value = 3


class NVMLError_Timeout(NVMLError):
    value = 10


class NVMLError_GpuIsLost(NVMLError):
    value = 15


class NVMLError_Unknown(NVMLError):
    value = 999


_config: dict = {"path": None}
_inited = [False]
_failed: dict[str, int] = {}


def orch_configure(env: dict) -> None:
    """agents.gpu.nvml calls this with the environment ORCH_FAKE_NVML was found in."""
    _config["path"] = env.get("ORCH_FAKE_NVML_STATE") or os.environ.get("ORCH_FAKE_NVML_STATE")


def _state() -> dict:
    path = _config["path"] or os.environ.get("ORCH_FAKE_NVML_STATE")
    with open(path) as f:
        return json.load(f)


def _call(name: str) -> dict:
    """The state, after failing this call as the state's ``fail`` says."""
    state = _state()
    budget, key = (state.get("fail") or {}).get(name), f"{_config['path']}:{name}"  # counted per state file
    if budget is not None and (budget < 0 or _failed.get(key, 0) < budget):
        _failed[key] = _failed.get(key, 0) + 1
        raise NVMLError_Unknown(f"fake failure of {name}")
    if not _inited[0] and name != "nvmlInit":
        raise NVMLError_Uninitialized("Uninitialized")
    return state


def _gpu(state: dict, handle: SimpleNamespace) -> dict:
    return state["gpus"][handle.index]


def nvmlInit() -> None:
    _call("nvmlInit")
    _inited[0] = True


def nvmlShutdown() -> None:
    _inited[0] = False


def nvmlDeviceGetCount() -> int:
    return len(_call("nvmlDeviceGetCount")["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> SimpleNamespace:
    if not 0 <= index < len(_call("nvmlDeviceGetHandleByIndex")["gpus"]):
        raise NVMLError(f"no GPU {index}")
    return SimpleNamespace(index=index, mig=None)


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> SimpleNamespace:
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    for i, g in enumerate(_call("nvmlDeviceGetHandleByUUID")["gpus"]):
        if g.get("uuid") == uuid:
            return SimpleNamespace(index=i, mig=None)
        if uuid in (g.get("mig") or []):
            return SimpleNamespace(index=i, mig=uuid)
    raise NVMLError(f"NotFound: {uuid}")


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(index=handle.index, mig=None)


def nvmlDeviceGetIndex(handle: SimpleNamespace) -> int:
    _call("nvmlDeviceGetIndex")
    return handle.index


def nvmlDeviceGetUUID(handle: SimpleNamespace) -> str:
    return _gpu(_call("nvmlDeviceGetUUID"), handle)["uuid"]


def nvmlDeviceGetName(handle: SimpleNamespace) -> str:
    return _gpu(_call("nvmlDeviceGetName"), handle).get("name", "Fake GPU")


def nvmlDeviceGetPciInfo(handle: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(busId=_gpu(_call("nvmlDeviceGetPciInfo"), handle)["bus_id"])


def nvmlDeviceGetUtilizationRates(handle: SimpleNamespace) -> SimpleNamespace:
    g = _gpu(_call("nvmlDeviceGetUtilizationRates"), handle)
    return SimpleNamespace(gpu=g.get("util", 0), memory=g.get("mem_util", 0))


def nvmlDeviceGetMemoryInfo(handle: SimpleNamespace) -> SimpleNamespace:
    g = _gpu(_call("nvmlDeviceGetMemoryInfo"), handle)
    return SimpleNamespace(used=g.get("mem_used", 0), total=g.get("mem_total", 0),
                           free=g.get("mem_total", 0) - g.get("mem_used", 0))


def nvmlDeviceGetPowerUsage(handle: SimpleNamespace) -> int:
    return _gpu(_call("nvmlDeviceGetPowerUsage"), handle).get("power_mw", 0)


def nvmlDeviceGetTemperature(handle: SimpleNamespace, sensor: int) -> int:
    return _gpu(_call("nvmlDeviceGetTemperature"), handle).get("temp", 0)


def nvmlDeviceGetClockInfo(handle: SimpleNamespace, clock: int) -> int:
    g = _gpu(_call("nvmlDeviceGetClockInfo"), handle)
    return g.get("sm_clock", 0) if clock == NVML_CLOCK_SM else g.get("mem_clock", 0)


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: SimpleNamespace) -> int:
    return _gpu(_call("nvmlDeviceGetCurrentClocksThrottleReasons"), handle).get("throttle", 0)


def nvmlDeviceGetTotalEccErrors(handle: SimpleNamespace, error_type: int, counter_type: int) -> int:
    ecc = _gpu(_call("nvmlDeviceGetTotalEccErrors"), handle).get("ecc")
    if ecc is None:
        raise NVMLError_NotSupported("Not Supported")
    return ecc["double" if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "single"]


def nvmlEventSetCreate() -> SimpleNamespace:
    return SimpleNamespace(seen=len(_call("nvmlEventSetCreate").get("events") or []), gpus={})


def nvmlDeviceRegisterEvents(handle: SimpleNamespace, types: int, event_set: SimpleNamespace) -> None:
    _call("nvmlDeviceRegisterEvents")
    event_set.gpus[handle.index] = event_set.gpus.get(handle.index, 0) | types


def nvmlEventSetWait(event_set: SimpleNamespace, timeout_ms: int) -> SimpleNamespace:
    events = _call("nvmlEventSetWait").get("events") or []
    while event_set.seen < len(events):
        event = events[event_set.seen]
        event_set.seen += 1
        kind = nvmlEventTypeDoubleBitEccError if event.get("dbe") else nvmlEventTypeXidCriticalError
        if event_set.gpus.get(event["gpu"], 0) & kind:
            return SimpleNamespace(device=SimpleNamespace(index=event["gpu"], mig=None), eventType=kind,
                                   eventData=event.get("xid", 0), gpuInstanceId=0, computeInstanceId=0)
    raise NVMLError_Timeout("Timeout")


def nvmlEventSetFree(event_set: SimpleNamespace) -> None:
    event_set.gpus.clear()
