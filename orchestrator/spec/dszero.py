"""The rules of a DeepSpeed config's ``zero_optimization`` section: offload devices and paths, NVMe offload
below stage 3, and ZeRO++ (pure; :func:`orchestrator.spec.dsconfig.check` applies them with the others).

Rules (source):

* offload devices are none/cpu/nvme (DeepSpeed ``OffloadDeviceEnum``); ``offload_param`` only at stage 3
  (``DeepSpeedZeroOffloadParamConfig``: "Valid only with stage 3"; Accelerate's ``offload_param_device``
  help); ``nvme`` needs an ``nvme_path`` (ZeRO-Infinity swaps to it);
* ``offload_optimizer.device: nvme`` at stage 1 or 2 is a warning: stage 1 and 2 treat any offload device
  as CPU offload (``runtime/zero/stage_1_and_2.py``);
* ZeRO++: ``zero_quantized_weights``, ``zero_quantized_nontrainable_weights`` and ``zero_quantized_gradients``
  are true or false, ``zero_hpz_partition_size`` a whole number >= 0 (``runtime/zero/config.py``
  ``DeepSpeedZeroConfig``: ``Field(1, ge=0)``; 0 and 1 both mean no secondary partition, ``stage3.py`` acts on
  ``> 1``); each is read only at stage 3 (``stage3.py``, ``partition_parameters.py``; stage 1 and 2 never
  read them), so anything else is an error; the hpz size divides the world size (``utils/groups.py``
  ``_create_zero_param_parallel_group`` asserts it) and every node's GPU count (its groups are consecutive
  ranks, meant to be one node's), and should equal it (a warning); quantized gradients with nodes of
  different rank counts are a warning (``_get_local_all_to_all_group`` groups ranks by the device count).

:func:`explain` says what the ZeRO++ options do for ``orch plan``; :func:`quantized` and :func:`nvme_paths`
say what the preflight checks on every node (``orchestrator.supervision.preflight``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["zero_rules", "quantized", "nvme_paths", "explain", "QUANTIZED_KEYS"]

AUTO = "auto"
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
#: The ZeRO++ options that quantize (``runtime/zero/config.py`` ``DeepSpeedZeroConfig``).
QUANTIZED_KEYS = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
_ZERO_PP_KEYS = (*QUANTIZED_KEYS, "zero_hpz_partition_size")

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
    """ZeRO++'s rules (module docstring)."""
    problems: list[Problem] = []
    warnings: list[str] = []
    for k in QUANTIZED_KEYS:
        value = zero.get(k, False)
        if not isinstance(value, bool):
            problems.append((f"zero_optimization.{k}", f"must be true or false; got {value!r}"))
    hpz = zero.get("zero_hpz_partition_size", 1)
    if not _is_int(hpz) or hpz < 0:  # DeepSpeedZeroConfig: Field(1, ge=0); 0 and 1 both mean no secondary copy
        problems.append(("zero_optimization.zero_hpz_partition_size", f"must be a whole number >= 0 (0 or 1: no "
                         f"secondary partition; DeepSpeed's DeepSpeedZeroConfig); got {hpz!r}"))
        return problems, warnings
    on = [k for k in _ZERO_PP_KEYS if (zero.get(k) is True if k != "zero_hpz_partition_size" else hpz > 1)]
    if stage is not None and stage != 3:
        for k in on:
            problems.append((f"zero_optimization.{k}", f"is a ZeRO++ option, which works only with ZeRO stage 3 "
                             f"(stage 1 and 2 never read it: runtime/zero/stage_1_and_2.py); the stage is {stage}. "
                             f"Set zero_optimization.stage to 3, or remove {k}"))
    if hpz > 1 and slots_per_node:
        problems += _hpz_problems(hpz, slots_per_node, warnings)
    if zero.get("zero_quantized_gradients") is True and len(set(slots_per_node)) > 1:
        warnings.append(f"zero_optimization.zero_quantized_gradients: the nodes run different numbers of ranks "
                        f"({', '.join(map(str, slots_per_node))}), but DeepSpeed's quantized gradient reduction "
                        "groups ranks into nodes of get_accelerator().device_count() consecutive ranks each "
                        "(utils/groups.py _get_local_all_to_all_group), so its groups will not match the nodes. "
                        "Run the same number of ranks on every node")
    return problems, warnings


def _hpz_problems(hpz: int, slots_per_node: tuple[int, ...], warnings: list[str]) -> list[Problem]:
    """hpZ's groups are ``hpz`` consecutive global ranks (DeepSpeed ``utils/groups.py``
    ``_create_zero_param_parallel_group``, which asserts the world size divides into them); orch gives a node
    consecutive ranks, so a size dividing every node's rank count keeps each group on one node."""
    world = sum(slots_per_node)
    if world % min(hpz, world):
        return [("zero_optimization.zero_hpz_partition_size", f"{hpz} does not divide the world size {world}; "
                 "DeepSpeed refuses it (utils/groups.py _create_zero_param_parallel_group: _ensure_divisibility). "
                 f"Set it to the GPUs per node ({max(slots_per_node)}) or a divisor of it")]
    bad = sorted({n for n in slots_per_node if n % hpz})
    if bad:
        return [("zero_optimization.zero_hpz_partition_size", f"{hpz} does not divide the GPUs per node "
                 f"({', '.join(map(str, bad))}): hierarchical partitioning keeps a secondary copy of the weights "
                 f"within groups of {hpz} consecutive ranks, meant to be on one node, and with this size a group "
                 f"spans nodes. Set it to the GPUs per node ({max(slots_per_node)}) or a divisor of it")]
    if any(n != hpz for n in slots_per_node):
        warnings.append(f"zero_optimization.zero_hpz_partition_size is {hpz} but the nodes have "
                        f"{', '.join(map(str, sorted(set(slots_per_node))))} GPUs each: it is meant to be "
                        "the number of GPUs per node")
    return []


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = config.get(key)
    return value if isinstance(value, Mapping) else {}


def quantized(config: Mapping[str, Any]) -> list[str]:
    """The ZeRO++ quantisation options a resolved config turns on at stage 3 (``zero_quantized_weights``,
    ``zero_quantized_nontrainable_weights``, ``zero_quantized_gradients``, in that order); each makes every rank
    load DeepSpeed's ``QuantizerBuilder`` op (``runtime/zero/partition_parameters.py`` ``CUDAQuantizer``,
    ``runtime/comm/coalesced_collectives.py`` ``all_to_all_quant_reduce``), which the CPU accelerator does not
    have (``accelerator/cpu_accelerator.py`` ``get_op_builder``: ``NotImplementedBuilder``)."""
    zero = _section(config, "zero_optimization")
    if zero.get("stage") != 3:
        return []
    return [k for k in QUANTIZED_KEYS if zero.get(k) is True]


def nvme_paths(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``[(section, nvme_path)]`` for each offload section of a resolved config that swaps to NVMe
    (``offload_optimizer`` at stage 3, ``offload_param``), in that order; the directories DeepSpeed's swappers
    write under (``runtime/swap_tensor``)."""
    zero = _section(config, "zero_optimization")
    out = []
    for part in ("offload_optimizer", "offload_param"):
        section = _section(zero, part)
        path = section.get("nvme_path")
        if str(section.get("device") or "none").lower() == "nvme" and zero.get("stage") == 3 and path \
                and path != AUTO:  # "auto": the script's Accelerate fills it, orch cannot know it
            out.append((part, str(path)))
    return out


def explain(config: Mapping[str, Any], nodes: Sequence[tuple[str, Sequence[int]]]) -> list[str]:
    """What a resolved config's ZeRO++ options do on this plan, one sentence each (empty without ZeRO++).

    Args:
        config: the resolved DeepSpeed config.
        nodes: ``(host, its global ranks)`` per node, in node order.

    Returns:
        Lines for ``orch plan``: quantized weights, quantized gradients, the hpZ groups (which ranks and
        nodes form each secondary partition) and the accelerator the quantisation needs.
    """
    zero = _section(config, "zero_optimization")
    if zero.get("stage") != 3:
        return []
    lines = []
    if zero.get("zero_quantized_weights") is True:
        lines.append("zero_quantized_weights (qwZ): ZeRO-3's all-gather of each layer's weights sends them as int8 "
                     "blocks with their scales, about half the bytes of fp16, and each rank dequantizes what it gets")
    if zero.get("zero_quantized_nontrainable_weights") is True:
        lines.append("zero_quantized_nontrainable_weights: frozen weights are also stored quantized (int8), not "
                     "only sent so (for LoRA-style training)")
    if zero.get("zero_quantized_gradients") is True:
        multi = len(nodes) > 1
        lines.append("zero_quantized_gradients (qgZ): gradients are reduced by an all-to-all of int4-quantized "
                     "blocks, first among the ranks of a node, then across nodes, instead of a reduce-scatter in "
                     "full precision" + ("" if multi else "; on one node DeepSpeed keeps the plain reduce-scatter "
                                          "(it quantizes only across nodes)"))
    hpz = zero.get("zero_hpz_partition_size", 1)
    if _is_int(hpz) and hpz > 1:
        lines.append(f"zero_hpz_partition_size {hpz} (hpZ): besides its ZeRO-3 shard over all ranks, each rank "
                     f"keeps a secondary shard of the weights over its group of {hpz} ranks, so the backward "
                     f"pass all-gathers within the group only; groups here: {_hpz_groups(hpz, nodes)}")
    if quantized(config):
        lines.append("quantisation runs DeepSpeed's QuantizerBuilder kernels (op_builder/quantizer.py, a CUDA op); DeepSpeed has none for "
                     "the CPU accelerator, so preflight refuses a node whose accelerator is cpu")
    return (["ZeRO++ (extensions of ZeRO stage 3):"] + [f"  {line}" for line in lines]) if lines else []


def _hpz_groups(hpz: int, nodes: Sequence[tuple[str, Sequence[int]]], shown: int = 4) -> str:
    """``ranks 0-1 (host a), ranks 2-3 (host a)``...: groups of ``hpz`` consecutive global ranks (DeepSpeed
    ``_create_zero_param_parallel_group``, of ``min(hpz, world size)``), each with the host(s) its ranks are on."""
    host_of = {r: host for host, ranks in nodes for r in ranks}
    world = len(host_of)
    size = min(hpz, world) or 1
    groups = []
    for start in range(0, world, size):
        hosts = list(dict.fromkeys(host_of.get(r, "?") for r in range(start, min(start + size, world))))
        groups.append(f"ranks {start}-{min(start + size, world) - 1} ({', '.join(hosts)})")
    more = f" and {len(groups) - shown} more" if len(groups) > shown else ""
    return ", ".join(groups[:shown]) + more
