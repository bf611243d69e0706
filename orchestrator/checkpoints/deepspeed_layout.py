"""What DeepSpeed 0.19.8's ``engine.save_checkpoint(save_dir, tag)`` writes into ``<save_dir>/<tag>``.

The rules follow the installed DeepSpeed's own naming code (``deepspeed/runtime/engine.py`` unless
another file is named; line numbers of 0.19.8):

* Model states, ``DeepSpeedEngine._get_ckpt_name`` (4336): ZeRO stages 0-2 write
  ``mp_rank_<mp:02d>_model_states.pt``, by data-parallel rank 0 of each model-parallel rank only
  (``_configure_checkpointing`` 1899, ``CheckpointEngine.is_data_parallel_writer``); ZeRO-3
  (``zero_optimization_partition_weights``) has every rank write
  ``zero_pp_rank_<dp>_mp_rank_<mp:02d>_model_states.pt``. ``_save_checkpoint`` (5377) fills it with
  ``_common_checkpoint_state`` (5017): ``module``, ``optimizer``, ``param_shapes``, ``global_steps``,
  ``dp_world_size``, ``mp_world_size``, ``checkpoint_parallel_dimensions`` (``pp_degree``,
  ``tp_degree``; ``_checkpoint_parallel_metadata`` 420), ``ds_config`` (the config dict),
  ``ds_version``, ...
* Optimizer partitions, ``_get_zero_ckpt_name`` (4331) / ``_get_rank_zero_ckpt_name`` (4322) /
  ``_get_zero_ckpt_prefix`` (4319): ``[bf16_]zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt``,
  one per data-parallel rank of each model-parallel rank, written by ``_save_zero_checkpoint`` (5549)
  when the optimizer has a ``dp_process_group`` (``_configure_checkpointing``): the ZeRO optimizers
  (stages 1-3) and ``BF16_Optimizer``, which ``_do_optimizer_sanity_check`` (2294) picks at stage 0
  only for bf16 pipelines with bf16 gradient accumulation. The ``bf16_`` prefix is
  ``bfloat16_enabled()`` (1675: the config's ``bf16``, or legacy ``bfloat16``, ``enabled``), whatever
  the optimizer. ZeRO stages 1-2 without an optimizer write none (``param_shapes`` is then None).
* Pipeline parallelism (``PipelineEngine.module_state_dict``, runtime/pipe/engine.py 1308, leaves
  ``module`` None): each layer with a ``state_dict`` is ``layer_<idx:02d>[-<rank repr>]-model_states.pt``
  (``PipelineModule.ckpt_layer_path``, runtime/pipe/module.py 588; the rank repr is ``model_<tp:02d>``
  when the topology has a ``model`` axis, ``ProcessTopology.get_rank_repr``, runtime/pipe/topology.py
  69), written by data-parallel rank 0 of each stage (``save_state_dict`` 607), or spread over the stage's
  data-parallel ranks with ``checkpoint.parallel_write.pipeline_stage`` (``ds_utils.partition_uniform``;
  ``get_checkpoint_parallel_write_pipeline``, runtime/config.py 398). ``mp_world_size`` is stages x tensor
  slices (``PipelineParallelGrid.get_model_parallel_rank``, topology.py 446). Pipelines take ZeRO stage 0 or
  1 only (``PipelineEngine.__init__``, runtime/pipe/engine.py 76). Layers without parameters (an activation
  module, whose empty ``state_dict`` is saved too) and every layer of a stage-0 save (no ``param_shapes``)
  are known only from the files present: the manifest finds such a file deleted after a save orch watched,
  and DeepSpeed's ``load_state_dir`` fails on one that is missing.
* MoE, ``_save_moe_checkpoint`` (5040): ``layer_<moe layer>_expert_<expert>_mp_rank_<mp:02d>_model_states.pt``
  per MoE layer and global expert (``_get_expert_ckpt_name`` 4368; none for AutoEP under ZeRO-3);
  without ZeRO also ``expp_rank_<ep>_mp_rank_<mp:02d>_optim_states.pt`` per expert-parallel rank of
  the largest expert group (``_get_optimizer_ckpt_name`` 4362, ``groups._get_max_expert_size_name``).
* NVMe optimizer offload (``zero_nvme_offload_optimizer`` 1633, ZeRO-3): ``save_checkpoint`` (4869)
  copies each rank's swap folder to ``offloaded_tensors/rank<rank:02d>/``.
* Not per tag: ``save_checkpoint`` writes ``<save_dir>/latest`` (the tag, no newline; 4961) and
  ``_copy_recovery_script`` (5530) ``<save_dir>/zero_to_fp32.py`` and ``zero_to_torch.py``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .headers import file_problem, read_torch_pickle

__all__ = [
    "MODEL_STATES",
    "ZERO3_MODEL_STATES",
    "DeepSpeedLayout",
    "layout_from_header",
    "read_latest",
    "required_files",
    "tag_problems",
]

#: The model-states file of data-parallel rank 0, model-parallel rank 0: ZeRO stages 0-2, ZeRO-3.
MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"

_LAYER_FILE = re.compile(r"^layer_(\d+)(-model_(\d+))?-model_states\.pt$")
_EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_BF16_NAMES = ("bf16", "bfloat16", "torch.bfloat16")


@dataclass(frozen=True)
class DeepSpeedLayout:
    """The shape of one DeepSpeed save, read from its model-states header.

    Attributes:
        zero_stage: ``ds_config.zero_optimization.stage`` (0-3).
        dp_world_size: data-parallel ranks (``dp_world_size``: the sequence-data-parallel world).
        mp_world_size: model-parallel ranks (tensor slices x pipeline stages).
        bf16: bf16 enabled, so optimizer partitions carry the ``bf16_`` prefix
            (``DeepSpeedEngine._get_zero_ckpt_prefix``).
        optimizer_shards: whether one optimizer partition per data-parallel rank is written.
        global_steps: the engine's step count at the save, if recorded.
        pipeline: saved by a ``PipelineEngine`` (``module`` is None in the header).
        pp_degree, tp_degree: ``checkpoint_parallel_dimensions``.
        pipeline_layers: the ``layer_XX-...model_states.pt`` files required (pipeline only).
        pipeline_parallel_write: ``checkpoint.parallel_write.pipeline_stage``: a stage's layer files are
            spread over its data-parallel ranks, not all written by its data-parallel rank 0.
        moe_experts: experts per MoE layer (``num_experts``); empty without MoE.
        expert_parallel_size: ranks of the largest expert-parallel group (MoE without ZeRO), or None.
        autoep: AutoEP layers (``ds_autoep_layers``) are recorded.
        nvme_offload: the optimizer is swapped to NVMe (ZeRO-3), so ``offloaded_tensors/`` is saved.
        node_local_storage: ``checkpoint.use_node_local_storage`` (offload folders named by local rank).
        ds_version: the DeepSpeed version that saved.
        model_states: the file the header came from.
    """

    zero_stage: int
    dp_world_size: int
    mp_world_size: int = 1
    bf16: bool = False
    optimizer_shards: bool = False
    global_steps: int | None = None
    pipeline: bool = False
    pp_degree: int = 1
    tp_degree: int = 1
    pipeline_layers: tuple[str, ...] = ()
    pipeline_parallel_write: bool = False
    moe_experts: tuple[int, ...] = ()
    expert_parallel_size: int | None = None
    autoep: bool = False
    nvme_offload: bool = False
    node_local_storage: bool = False
    ds_version: str | None = None
    model_states: str = MODEL_STATES

    @property
    def moe(self) -> bool:
        """Whether the model has MoE layers."""
        return bool(self.moe_experts)

    @property
    def optimizer_prefix(self) -> str:
        """``"bf16_"`` or ``""``, as ``DeepSpeedEngine._get_zero_ckpt_prefix``."""
        return "bf16_" if self.bf16 else ""


# -- reading the config the header carries ----------------------------------------------------------

def _flag(value: Any) -> bool:
    """A config boolean as DeepSpeed's pydantic models read it (``true``, ``"true"``, ``1``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "y", "t")
    return bool(value)


def _section(cfg: dict, key: str) -> dict:
    value = cfg.get(key)
    return value if isinstance(value, dict) else {}


def _zero_stage(cfg: dict) -> int:
    """``zero_optimization.stage``; the legacy boolean form is stage 1 (``read_zero_config_deprecated``,
    runtime/zero/config.py 60)."""
    zero = cfg.get("zero_optimization")
    if isinstance(zero, bool):
        return 1 if zero else 0
    if isinstance(zero, dict):
        try:
            return int(zero.get("stage", 0) or 0)
        except (TypeError, ValueError):
            raise CheckpointError(f"ds_config has zero_optimization.stage {zero.get('stage')!r}") from None
    return 0


def _bf16(cfg: dict) -> bool:
    """``bf16.enabled``, else legacy ``bfloat16.enabled`` (``get_bfloat16_config``, runtime/precision_config.py 34)."""
    section = cfg.get("bf16")
    if section is None:
        section = cfg.get("bfloat16", {})
    return isinstance(section, dict) and _flag(section.get("enabled", False))


def _optimizer_shards(header: dict, cfg: dict, stage: int, bf16: bool, pipeline: bool) -> bool:
    """Whether ``_save_zero_checkpoint`` ran (the optimizer has a ``dp_process_group``)."""
    if stage >= 3:
        return True  # a ZeRO-3 optimizer, or DeepSpeedZeRoOffload without one: both have the group
    if stage >= 1:
        return "param_shapes" not in header or header.get("param_shapes") is not None
    accum = _section(cfg, "data_types").get("grad_accum_dtype")
    same_dtype = accum is None or str(accum).lower() in _BF16_NAMES
    return bf16 and pipeline and same_dtype and header.get("optimizer") is not None


def _int(header: dict, key: str, default: int | None = None) -> int:
    value = header.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"the header's {key} is {value!r}, not a positive number: not written by "
                              "DeepSpeed's save_checkpoint")
    return value


# -- pipeline layers and MoE expert-parallel ranks --------------------------------------------------

def _listing(tag_dir: Path) -> list[str]:
    try:
        return sorted(os.listdir(tag_dir))
    except OSError:
        return []


def _stage_layers(header: Any) -> set[int]:
    """Layer indices with parameters, from a pipeline stage's ``param_shapes`` (names ``<idx>.<param>``,
    as ``PipelineModule._build`` registers layers)."""
    found: set[int] = set()
    groups = header.get("param_shapes") if isinstance(header, dict) else None
    for group in groups if isinstance(groups, list) else []:
        for name in group if isinstance(group, dict) else []:
            head = str(name).split(".", 1)[0]
            if head.isdigit():
                found.add(int(head))
    return found


def _pipeline_layers(tag_dir: Path, header: dict, mp: int, tp: int) -> tuple[str, ...]:
    """The layer files: those present, and for ZeRO saves each stage's layers with parameters (read from
    the ``param_shapes`` of every ``mp_rank_XX_model_states.pt``). A layer without parameters (an
    activation) or behind a stage-0 save is only known when present."""
    present = {n: m for n in _listing(tag_dir) if (m := _LAYER_FILE.match(n))}
    sliced = any(m.group(2) for m in present.values())
    names = set(present)
    for rank in range(mp):
        if rank == 0:
            stage_header = header
        else:
            try:
                stage_header = read_torch_pickle(tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
            except CheckpointError:
                continue  # reported as that file's problem
        for idx in _stage_layers(stage_header):
            names.add(f"layer_{idx:02d}-model_{rank % tp:02d}-model_states.pt" if sliced
                      else f"layer_{idx:02d}-model_states.pt")
    return tuple(sorted(names))


def _expert_parallel_size(tag_dir: Path, header: dict) -> int:
    """The largest expert group's size: its ``ep_size_<n>`` param group (``MoE.expert_group_name``,
    moe/layer.py 61) in the saved optimizer, or AutoEP's ``ep_size``; else one more than the highest
    ``expp_rank_<r>`` file present (at least 1)."""
    sizes = []
    optimizer = header.get("optimizer")
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    for group in groups if isinstance(groups, list) else []:
        m = re.fullmatch(r"ep_size_(\d+)", str(group.get("name", ""))) if isinstance(group, dict) else None
        if m:
            sizes.append(int(m.group(1)))
    for layer in header.get("ds_autoep_layers") or []:
        if isinstance(layer, dict) and isinstance(layer.get("ep_size"), int):
            sizes.append(layer["ep_size"])
    if sizes:
        return max(sizes)
    present = [int(m.group(1)) for n in _listing(tag_dir) if (m := _EXPP_FILE.match(n))]
    return max(present, default=0) + 1


def layout_from_header(header: dict, tag_dir: str | os.PathLike) -> DeepSpeedLayout:
    """The layout of a save, from the restricted unpickle of its model-states file.

    Args:
        header: :func:`headers.read_torch_pickle` of ``mp_rank_00_model_states.pt`` (ZeRO 0-2) or
            ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO-3): the dict
            ``DeepSpeedEngine._common_checkpoint_state`` builds (``dp_world_size``, ``mp_world_size``,
            ``ds_config``, ``global_steps``, ``checkpoint_parallel_dimensions``, ``ds_version``, ...).
        tag_dir: the tag directory; read only for pipeline saves (the other stages' model-states
            headers and the layer files present) and MoE saves without a recorded expert group size.

    Returns:
        The :class:`DeepSpeedLayout`.

    Raises:
        CheckpointError: ``header`` is not a dict with DeepSpeed's ``dp_world_size``, ``mp_world_size``
            and ``ds_config`` (not written by ``DeepSpeedEngine._save_checkpoint``).
    """
    if not isinstance(header, dict):
        raise CheckpointError(f"the model states hold a {type(header).__name__}, not DeepSpeed's dict")
    cfg = header.get("ds_config")
    if not isinstance(cfg, dict):
        raise CheckpointError("no ds_config dict in the model states: not written by DeepSpeed's save_checkpoint")
    tag_dir = Path(tag_dir)
    dp, mp = _int(header, "dp_world_size"), _int(header, "mp_world_size", 1)
    stage, bf16 = _zero_stage(cfg), _bf16(cfg)
    dims = header.get("checkpoint_parallel_dimensions")
    dims = dims if isinstance(dims, dict) else {}
    pp = dims.get("pp_degree") if isinstance(dims.get("pp_degree"), int) else 1
    tp = dims.get("tp_degree") if isinstance(dims.get("tp_degree"), int) else 1
    pipeline = ("module" in header and header["module"] is None) or pp > 1
    experts = header.get("num_experts") or []
    experts = tuple(int(n) for n in experts if isinstance(n, int)) if isinstance(experts, list) else ()
    offload = _section(_section(cfg, "zero_optimization"), "offload_optimizer").get("device")
    steps = header.get("global_steps")
    return DeepSpeedLayout(
        zero_stage=stage, dp_world_size=dp, mp_world_size=mp, bf16=bf16,
        optimizer_shards=_optimizer_shards(header, cfg, stage, bf16, pipeline),
        global_steps=steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
        pipeline=pipeline, pp_degree=max(pp, 1), tp_degree=max(tp, 1),
        pipeline_layers=_pipeline_layers(tag_dir, header, mp, max(tp, 1)) if pipeline else (),
        pipeline_parallel_write=pipeline and _flag(
            _section(_section(cfg, "checkpoint"), "parallel_write").get("pipeline_stage", False)),
        moe_experts=experts,
        expert_parallel_size=_expert_parallel_size(tag_dir, header) if experts and stage == 0 else None,
        autoep=bool(header.get("ds_autoep_layers")),
        nvme_offload=stage >= 3 and str(offload).lower() == "nvme",
        node_local_storage=_flag(_section(cfg, "checkpoint").get("use_node_local_storage", False)),
        ds_version=str(header["ds_version"]) if header.get("ds_version") is not None else None,
        model_states=ZERO3_MODEL_STATES if stage >= 3 else MODEL_STATES)


# -- the files of a layout --------------------------------------------------------------------------

def _rank_words(layout: DeepSpeedLayout, dp: int | None, mp: int) -> str:
    parts = [] if dp is None else [f"data-parallel rank {dp}"]
    if layout.mp_world_size > 1:
        parts.append(f"model-parallel rank {mp}")
    return " of ".join(parts) if parts else "rank 0"


def _model_and_optimizer(layout: DeepSpeedLayout) -> list[tuple[str, str]]:
    out = []
    for mp in range(layout.mp_world_size):
        if layout.zero_stage >= 3:
            out += [(f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt",
                     f"written by {_rank_words(layout, dp, mp)}") for dp in range(layout.dp_world_size)]
        else:
            out.append((f"mp_rank_{mp:02d}_model_states.pt", f"written by {_rank_words(layout, 0, mp)}"))
        if layout.optimizer_shards:
            out += [(f"{layout.optimizer_prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt",
                     f"written by {_rank_words(layout, dp, mp)}") for dp in range(layout.dp_world_size)]
    return out


def _moe_files(layout: DeepSpeedLayout) -> list[tuple[str, str]]:
    out = []
    for mp in range(layout.mp_world_size):
        if not (layout.autoep and layout.zero_stage >= 3):
            out += [(f"layer_{layer}_expert_{expert}_mp_rank_{mp:02d}_model_states.pt",
                     f"expert {expert} of MoE layer {layer}")
                    for layer, count in enumerate(layout.moe_experts) for expert in range(count)]
        if layout.zero_stage == 0 and layout.expert_parallel_size:
            out += [(f"expp_rank_{ep}_mp_rank_{mp:02d}_optim_states.pt", f"written by expert-parallel rank {ep}")
                    for ep in range(layout.expert_parallel_size)]
    return out


def _expected(layout: DeepSpeedLayout) -> list[tuple[str, str]]:
    """``[(name relative to the tag directory, who writes it)]`` in a stable order."""
    out = _model_and_optimizer(layout)
    writer = ("one of its stage's data-parallel ranks (checkpoint.parallel_write.pipeline_stage)"
              if layout.pipeline_parallel_write else "data-parallel rank 0 of its stage")
    for name in layout.pipeline_layers:
        out.append((name, f"a pipeline layer's weights, written by {writer}"))
    if layout.moe:
        out += _moe_files(layout)
    if layout.nvme_offload and not layout.node_local_storage:
        world = layout.dp_world_size * layout.mp_world_size
        out += [(f"offloaded_tensors/rank{rank:02d}/", f"rank {rank}'s NVMe swap files") for rank in range(world)]
    return out


def required_files(layout: DeepSpeedLayout) -> list[str]:
    """Every file (and, ending in ``/``, directory) DeepSpeed writes for one tag of this layout.

    Names are relative to the tag directory, in a stable order: model states
    (``DeepSpeedEngine._get_ckpt_name``), optimizer partitions (``_get_zero_ckpt_name``), pipeline
    layers (``PipelineModule.ckpt_layer_path``), MoE experts (``_get_expert_ckpt_name``,
    ``_get_optimizer_ckpt_name``), NVMe swap folders (``save_checkpoint``); see the module docstring.
    Files outside the tag (``latest``, ``zero_to_fp32.py``) are not listed. Raises nothing.
    """
    return [name for name, _ in _expected(layout)]


def _find_header(tag_dir: Path) -> tuple[str | None, Any, list[str]]:
    """``(name, header, problems)`` of the model-states file to read: the ZeRO 0-2 or ZeRO-3 one; with
    both present (a tag saved twice under different stages), the one whose stage matches its name."""
    present = [n for n in (MODEL_STATES, ZERO3_MODEL_STATES) if (tag_dir / n).is_file()]
    if not present:
        return None, None, [(f"neither {MODEL_STATES} nor {ZERO3_MODEL_STATES} is there: not a DeepSpeed "
                             "checkpoint, or its save did not get that far")]
    read: list[tuple[str, Any]] = []
    problems = []
    for name in present:
        try:
            header = read_torch_pickle(tag_dir / name)
        except CheckpointError as err:
            problems.append(f"{name}: {getattr(err, 'reason', err)}")
            continue
        cfg = header.get("ds_config") if isinstance(header, dict) else None
        stage = _zero_stage(cfg) if isinstance(cfg, dict) else None
        if stage is not None and (stage >= 3) == (name == ZERO3_MODEL_STATES):
            return name, header, []
        read.append((name, header))
    if read:
        return read[0][0], read[0][1], []
    return None, None, problems


def tag_problems(tag_dir: str | os.PathLike) -> tuple[DeepSpeedLayout | None, list[str]]:
    """Whether one DeepSpeed tag directory is complete and undamaged, without reading tensors.

    Reads the model-states header (:func:`headers.read_torch_pickle`), derives the layout
    (:func:`layout_from_header`), then checks each of :func:`required_files` with
    :func:`headers.file_problem` (zip directory, entry bounds, ``data.pkl`` CRC and pickle, storage
    sizes). Bytes changed inside tensor data are not found (no checksum covers them).

    Args:
        tag_dir: ``<save_dir>/<tag>``.

    Returns:
        ``(layout or None, problems)``: layout None when no header could be read; problems phrased for a
        user, each naming its file: ``"zero_pp_rank_1_mp_rank_00_optim_states.pt is missing (written by
        data-parallel rank 1)"``, ``"mp_rank_00_model_states.pt: truncated: the zip directory is
        unreadable (File is not a zip file)"``. Empty when complete. Raises nothing.
    """
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return None, [f"{tag_dir} is not a directory"]
    name, header, problems = _find_header(tag_dir)
    if name is None:
        return None, problems
    try:
        layout = layout_from_header(header, tag_dir)
    except CheckpointError as err:
        return None, [f"{name}: {err}"]
    for required, who in _expected(layout):
        if required == name:
            continue  # read whole above
        problem = file_problem(tag_dir / required) if not required.endswith("/") else \
            (None if (tag_dir / required).is_dir() else "missing")
        if problem == "missing":
            problems.append(f"{required} is missing ({who})")
        elif problem:
            problems.append(f"{required}: {problem}")
    return layout, problems


def read_latest(root: str | os.PathLike, universal: bool = False) -> str | None:
    """The tag DeepSpeed's ``latest`` file names, as ``DeepSpeedEngine.load_checkpoint`` reads it.

    ``save_checkpoint`` writes the tag (no newline) to ``<root>/latest`` on global rank 0 after the save
    (engine.py 4961); ``load_checkpoint`` (4395) reads ``<root>/latest`` (``latest_universal`` when
    loading a universal checkpoint) and strips it (4432).

    Args:
        root: the ``save_dir`` holding the tags.
        universal: read ``latest_universal`` (written by ``ds_to_universal``) instead.

    Returns:
        The tag, or None when the file is missing, unreadable or blank. Raises nothing.
    """
    try:
        text = (Path(root) / ("latest_universal" if universal else "latest")).read_text(errors="replace")
    except OSError:
        return None
    return text.strip() or None
