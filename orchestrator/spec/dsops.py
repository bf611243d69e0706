"""Which DeepSpeed ops a job's DeepSpeed config makes its ranks JIT-build (or load), read from the installed
DeepSpeed's own code, so that preflight builds them once per node before any rank starts (pure).

The rules, from DeepSpeed's sources (``deepspeed/comm/torch.py``, ``deepspeed/runtime/engine.py``):

* ``deepspeed_shm_comm`` (``ShareMemCommBuilder``): ``TorchBackend.__init__`` calls ``build_shm_op``, which
  loads it whenever the accelerator has the builder and ``deepspeed.ops.__compatible_ops__`` says it is
  compatible: every job that calls ``deepspeed.init_distributed`` (or ``deepspeed.initialize``).
* The optimizer of the config's ``optimizer`` section (``DeepSpeedEngine._configure_basic_optimizer``):
  ``Adam``/``AdamW`` is ``DeepSpeedCPUAdam`` (``cpu_adam``) when ZeRO offloads the optimizer to ``cpu`` or
  ``nvme`` (``zero_use_cpu_optimizer``), ``torch.optim`` with ``params.torch_adam: true``, else ``FusedAdam``
  (``fused_adam``); ``Adagrad`` and ``Lion`` are ``cpu_adagrad``/``cpu_lion`` when offloaded, and a fused
  ``Lion`` (``fused_lion``) otherwise (``Adagrad`` is then ``torch.optim.Adagrad``: no op).
* ``async_io`` (``AsyncIOBuilder``): an ``nvme`` offload of the optimizer or the parameters swaps through it
  (``deepspeed/runtime/swap_tensor``).

A script that passes its own optimizer (no ``optimizer`` section) builds what that optimizer needs when it
makes it; only the communication op is known then.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["OPS", "ops_needed"]

#: Op builder class name -> the op's name (the builder's ``NAME``: its directory and library under
#: ``TORCH_EXTENSIONS_DIR``), as in ``deepspeed/ops/op_builder`` (``tests/test_opbuild.py`` checks them).
OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "FusedAdamBuilder": "fused_adam", "CPUAdamBuilder": "cpu_adam",
       "CPUAdagradBuilder": "cpu_adagrad", "CPULionBuilder": "cpu_lion", "FusedLionBuilder": "fused_lion",
       "AsyncIOBuilder": "async_io"}


def _op(builder: str, why: str, if_compatible: bool = False) -> dict[str, Any]:
    return {"builder": builder, "name": OPS[builder], "why": why, "if_compatible": if_compatible}


def _device(section: Any) -> str:
    return str((section or {}).get("device") or "none").lower() if isinstance(section, Mapping) else "none"


def ops_needed(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ops a DeepSpeed config makes every rank load, in load order (module docstring for the rules).

    Args:
        config: the job's resolved DeepSpeed config (a JSON object).

    Returns:
        ``[{"builder": op builder class name, "name": the op's name, "why": one sentence, "if_compatible":
        bool (loaded only where DeepSpeed finds it compatible)}]``; never empty (the communication op).
    """
    ops = [_op("ShareMemCommBuilder", "deepspeed.comm loads it at init_distributed", if_compatible=True)]
    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), Mapping) else {}
    kind = str(optimizer.get("type") or "").lower()
    params = optimizer.get("params") if isinstance(optimizer.get("params"), Mapping) else {}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), Mapping) else {}
    offload = _device(zero.get("offload_optimizer"))
    offloaded = offload in ("cpu", "nvme")
    if kind in ("adam", "adamw") and params.get("torch_adam") is not True:
        ops.append(_op("CPUAdamBuilder", f"optimizer {optimizer.get('type')} offloaded to {offload}") if offloaded
                   else _op("FusedAdamBuilder", f"optimizer {optimizer.get('type')} is DeepSpeed's FusedAdam"))
    elif kind == "adagrad" and offloaded:
        ops.append(_op("CPUAdagradBuilder", f"optimizer Adagrad offloaded to {offload}"))
    elif kind == "lion":
        ops.append(_op("CPULionBuilder", f"optimizer Lion offloaded to {offload}") if offloaded
                   else _op("FusedLionBuilder", "optimizer Lion is DeepSpeed's FusedLion"))
    if "nvme" in (offload, _device(zero.get("offload_param"))):
        ops.append(_op("AsyncIOBuilder", "ZeRO offloads to nvme"))
    return ops
