"""The rules of a DeepSpeed config's ``zero_optimization`` section: offload devices and paths, NVMe offload
below stage 3, and ZeRO++ (pure; :func:`orchestrator.spec.dsconfig.check` applies them with the others).

Rules (source):

* offload devices are none/cpu/nvme (DeepSpeed ``OffloadDeviceEnum``); ``offload_param`` only at stage 3
  (``DeepSpeedZeroOffloadParamConfig``: "Valid only with stage 3"; Accelerate's ``offload_param_device``
  help); ``nvme`` needs an ``nvme_path`` (ZeRO-Infinity swaps to it);
* ``offload_optimizer.device: nvme`` at stage 1 or 2 is a warning: stage 1 and 2 treat any offload device
  as CPU offload (``runtime/zero/stage_1_and_2.py``);
* ZeRO++ (``zero_quantized_weights``, ``zero_quantized_gradients``, ``zero_hpz_partition_size`` > 1) only
  at stage 3 (Accelerate guide: ZeRO++ extends stage 3); the hpz partition size divides every node's GPU
  count, and should equal it (a warning).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["zero_rules"]

AUTO = "auto"
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_ZERO_PP_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")

Problem = tuple[str, str]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def zero_rules(zero: Mapping[str, Any], stage: int | None,
               slots_per_node: tuple[int, ...]) -> tuple[list[Problem], list[str]]:
    """The ``zero_optimization`` rules of the module docstring, as ``(problems, warnings)``.

    Args:
        zero: the config's ``zero_optimization`` section (a mapping).
        stage: its stage (0-3), or None when not known (still "auto", or invalid).
        slots_per_node: ranks on each node, in node order (empty when not known).

    Returns:
        ``(problems, warnings)``: problems as ``(key path, message with the fix)``.
    """
    problems = _offload_problems(zero, stage)
    warnings: list[str] = []
    section = zero.get("offload_optimizer")
    if isinstance(section, dict) and section.get("device") == "nvme" and stage in (1, 2):
        warnings.append(f"zero_optimization.offload_optimizer.device is \"nvme\" but the ZeRO stage is {stage}: "
                        "DeepSpeed offloads the optimizer to CPU memory instead (stage 1 and 2 treat any offload "
                        "device as CPU offload: runtime/zero/stage_1_and_2.py), and nvme_path is not used. Set "
                        "zero_optimization.stage to 3 for NVMe offload, or the device to \"cpu\" to say what runs")
    zpp = _zero_pp(zero, stage, slots_per_node)
    return problems + zpp[0], warnings + zpp[1]


def _offload_problems(zero: Mapping[str, Any], stage: int | None) -> list[Problem]:
    problems: list[Problem] = []
    for part, what, acc in (("offload_optimizer", "optimizer", "offload_optimizer"),
                            ("offload_param", "parameter", "offload_param")):
        section = zero.get(part)
        if not isinstance(section, dict):
            continue
        key = f"zero_optimization.{part}"
        device = section.get("device", "none")
        if device == AUTO:
            continue
        if device not in _OFFLOAD_DEVICES:
            problems.append((f"{key}.device", f"must be one of none, cpu, nvme; got {device!r}"))
            continue
        if part == "offload_param" and device != "none" and stage is not None and stage != 3:
            problems.append((f"{key}.device", f"is {device!r} but the ZeRO stage is {stage}: {what} offload works "
                             "only with ZeRO stage 3 (DeepSpeed: offload_param is 'valid only with stage 3'). "
                             f"Set zero_optimization.stage to 3 (zero_stage: 3), or {key}.device to \"none\""))
        path = section.get("nvme_path")
        if device == "nvme" and path != AUTO and (path is None or str(path).strip().lower() in ("", "none")):
            problems.append((f"{key}.nvme_path", f"{what} offload to NVMe needs the directory to swap to, and none "
                             f"is given (got {path!r}). Set {key}.nvme_path (or {acc}_nvme_path in the Accelerate "
                             "config) to a directory on the NVMe drive of every node"))
    return problems


def _zero_pp(zero: Mapping[str, Any], stage: int | None, slots_per_node: tuple[int, ...]) -> tuple[list[Problem], list[str]]:
    problems: list[Problem] = []
    warnings: list[str] = []
    hpz = zero.get("zero_hpz_partition_size", 1)
    if not _is_int(hpz) or hpz < 1:
        return [("zero_optimization.zero_hpz_partition_size", f"must be a whole number >= 1; got {hpz!r}")], []
    on = [k for k in _ZERO_PP_KEYS if (zero.get(k) is True if k != "zero_hpz_partition_size" else hpz > 1)]
    if stage is not None and stage != 3:
        for k in on:
            problems.append((f"zero_optimization.{k}", f"is a ZeRO++ option, which works only with ZeRO stage 3; "
                             f"the stage is {stage}. Set zero_optimization.stage to 3, or remove {k}"))
    if hpz > 1 and slots_per_node:
        bad = sorted({n for n in slots_per_node if n % hpz})
        if bad:
            problems.append(("zero_optimization.zero_hpz_partition_size", f"{hpz} does not divide the GPUs per node "
                             f"({', '.join(map(str, bad))}): hierarchical partitioning keeps a secondary copy of the "
                             "weights within groups of this size on one node. Set it to the GPUs per node "
                             f"({max(slots_per_node)}) or a divisor of it"))
        elif any(n != hpz for n in slots_per_node):
            warnings.append(f"zero_optimization.zero_hpz_partition_size is {hpz} but the nodes have "
                            f"{', '.join(map(str, sorted(set(slots_per_node))))} GPUs each: it is meant to be "
                            "the number of GPUs per node")
    return problems, warnings
