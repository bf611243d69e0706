"""Accelerate config files (what ``accelerate config`` writes) as job settings for orch.

A job spec's ``accelerate_config`` (or ``orch run/submit/plan --accelerate-config FILE``) names
the YAML file ``accelerate launch --config_file FILE`` reads. orch takes from it what Accelerate
1.15's DeepSpeed launcher takes (``accelerate/commands/launch.py`` ``_validate_launch_command``
and ``launch_command``; ``accelerate/utils/launch.py`` ``prepare_deepspeed_cmd_env``):

* where the job runs: ``num_machines``, ``num_processes``, ``main_process_ip``/``_port`` and the
  ``deepspeed_config`` section's ``deepspeed_hostfile``, ``deepspeed_inclusion_filter``,
  ``deepspeed_exclusion_filter``, ``deepspeed_multinode_launcher``, merged into the spec's
  ``hostfile``, ``include``/``exclude``, ``num_nodes``/``num_gpus``, ``master_addr``/``_port``,
  ``launcher`` and ``no_local_rank`` where the spec does not set them (:meth:`AccelerateConfig.spec_fields`);
* the DeepSpeed settings (``zero_stage``, offload devices and NVMe paths, accumulation,
  clipping, ``zero3_*``, ``mixed_precision``; :meth:`AccelerateConfig.settings`), from which
  :mod:`orchestrator.spec.dsconfig` builds or resolves the DeepSpeed config;
* the environment ``accelerate launch`` gives the script (``ACCELERATE_*``, ``PYTHONPATH``;
  :meth:`AccelerateConfig.launch_env`), so the script runs unchanged.

Accelerate's ambiguity rule is applied when the file is read (:meth:`AccelerateConfig.ambiguity_problems`):
with a DeepSpeed config file, the settings Accelerate would ignore must not be in the file.
Every problem of a file is reported at once, by key path and line, with its fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigError
from .dsconfig import SETTING_KEYS, DeepSpeedSettings
from .accelerate_settings import AccelerateSettings, _Device, _Precision
from .files import line_of, read_yaml

__all__ = ["AccelerateSettings", "AccelerateConfig", "load_accelerate_config", "read_for_spec",
           "DEEPSPEED_SECTION_KEYS", "AMBIGUOUS_KEYS"]

#: Keys Accelerate ignores when a DeepSpeed config file is used, and refuses to see beside one
#: (``DeepSpeedPlugin._deepspeed_config_checks``: ``env_variable_names_to_ignore``), with the
#: DeepSpeed config key that takes their place.
AMBIGUOUS_KEYS: dict[str, str] = {**SETTING_KEYS, "mixed_precision": "fp16.enabled / bf16.enabled"}

class _DeepSpeedSection(BaseModel):
    """The ``deepspeed_config`` section of an Accelerate config (``accelerate config``'s questions)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # built when a file is read: not for every orch plan

    zero_stage: int | None = Field(None, ge=0, le=3)
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    gradient_clipping: float | None = Field(None, ge=0)
    offload_optimizer_device: _Device | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_device: _Device | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    deepspeed_config_file: str | None = None
    deepspeed_hostfile: str | None = None
    deepspeed_inclusion_filter: str | None = None
    deepspeed_exclusion_filter: str | None = None
    deepspeed_multinode_launcher: Literal["pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh",
                                          "slurm"] | None = None
    deepspeed_moe_layer_cls_names: str | None = None


#: The ``deepspeed_config`` section's keys.
DEEPSPEED_SECTION_KEYS = tuple(_DeepSpeedSection.model_fields)


class _AccelerateFile(BaseModel):
    """An Accelerate config file's keys (``commands/config/config_args.py`` ``ClusterConfig``)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    compute_environment: Literal["LOCAL_MACHINE", "AMAZON_SAGEMAKER"] = "LOCAL_MACHINE"
    distributed_type: str | None = None
    mixed_precision: _Precision | None = None
    use_cpu: bool = False
    debug: bool = False
    num_processes: int | None = Field(None, ge=-1)
    machine_rank: int = Field(0, ge=0)
    num_machines: int = Field(1, ge=1)
    gpu_ids: str | int | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = Field(None, ge=0, le=65535)
    rdzv_backend: str | None = "static"
    same_network: bool | None = None
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    deepspeed_config: _DeepSpeedSection | None = None
    fsdp_config: dict | None = None
    fp8_config: dict | None = None
    parallelism_config: dict | None = None
    megatron_lm_config: dict | None = None
    mpirun_config: dict | None = None
    dynamo_config: dict | None = None
    downcast_bf16: bool | str | None = None
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str | None = None
    commands: list[str] | None = None
    tpu_vm: list[str] | None = None
    tpu_env: list[str] | None = None
    fp16: bool | None = None          # old files: fp16: true means mixed_precision fp16 (process_config)
    dynamo_backend: str | None = None  # old files: dynamo_config's backend


@dataclass(frozen=True)
class AccelerateConfig:
    """A read and validated Accelerate config file.

    Attributes:
        source: the file's path (absolute), or ``"<inline>"``.
        base_dir: directory its relative paths are taken from (the file's).
        data: the file's mapping, as YAML read it.
        deepspeed: the ``deepspeed_config`` section as written (keys in file order).
        parsed: the validated file.
    """

    source: str
    base_dir: str
    data: Mapping[str, Any]
    deepspeed: Mapping[str, Any]
    parsed: _AccelerateFile = field(repr=False)

    # -- what it says ---------------------------------------------------------------------------

    @property
    def num_machines(self) -> int:
        """``num_machines`` (default 1)."""
        return self.parsed.num_machines

    def _path(self, value: str | None) -> str | None:
        if value is None:
            return None
        p = Path(os.path.expanduser(value))
        return str(p if p.is_absolute() else (Path(self.base_dir) / p).resolve())

    @property
    def deepspeed_config_file(self) -> str | None:
        """The section's ``deepspeed_config_file``, absolute (relative to the file's directory)."""
        return self._path(self.deepspeed.get("deepspeed_config_file"))

    @property
    def mixed_precision_from_file(self) -> str | None:
        """``mixed_precision`` as the file gives it (``fp16: true`` in old files counts), or None."""
        if self.parsed.mixed_precision is not None:
            return self.parsed.mixed_precision
        return "fp16" if self.parsed.fp16 else None

    def settings(self, flags: AccelerateSettings | None = None) -> DeepSpeedSettings:
        """The job's DeepSpeed settings: ``flags`` (the spec's ``accelerate`` section) over the
        file's ``deepspeed_config`` section and ``mixed_precision``.

        Source: ``_validate_launch_command`` copies the file's section onto the arguments only
        where no flag was given; ``DeepSpeedPlugin.__post_init__`` reads them back.
        """
        given = {k: v for k, v in self.parsed.deepspeed_config.model_dump().items() if v is not None} \
            if self.parsed.deepspeed_config else {}
        if self.mixed_precision_from_file is not None:
            given["mixed_precision"] = self.mixed_precision_from_file
        given.update((flags or AccelerateSettings()).given())
        names = set(DeepSpeedSettings.__dataclass_fields__) - {"explicit"}
        values = {k: v for k, v in given.items() if k in names}
        return DeepSpeedSettings(**values, explicit=frozenset(values))

    # -- rules ----------------------------------------------------------------------------------

    def ambiguity_problems(self, config_file: str | None) -> list[tuple[str, str]]:
        """Accelerate's ambiguity rule: beside a DeepSpeed config file, none of :data:`AMBIGUOUS_KEYS`.

        Source: ``DeepSpeedPlugin._deepspeed_config_checks`` refuses a run when any key of the
        file's ``deepspeed_config`` section (``ACCELERATE_CONFIG_DS_FIELDS``), or a
        ``mixed_precision`` that came from the file, is one it would ignore. A key counts when
        it is present, whatever its value (``offload_param_device: none`` counts).

        Args:
            config_file: the DeepSpeed config file in use (the section's ``deepspeed_config_file``
                or the spec's ``deepspeed_config``), or None.

        Returns:
            ``(key path, message)`` per conflicting key, in file order.
        """
        if config_file is None:
            return []
        name = "given inline in the job spec" if config_file == "<inline>" else os.path.basename(config_file)
        keys = [f"deepspeed_config.{k}" for k in self.deepspeed if k in AMBIGUOUS_KEYS]
        if self.mixed_precision_from_file is not None:
            keys.append("mixed_precision" if self.parsed.mixed_precision is not None else "fp16")
        out = []
        for key in keys:
            short = key.rsplit(".", 1)[-1]
            target = AMBIGUOUS_KEYS["mixed_precision" if short == "fp16" else short]
            out.append((key, f"is set beside a DeepSpeed config file ({name}), which Accelerate refuses: it would "
                        f"ignore {short}. Remove {short} here and set {target} in the DeepSpeed config file "
                        "instead, or drop the DeepSpeed config file"))
        return out

    def problems(self) -> list[tuple[str, str]]:
        """Rules of the file itself, as ``(key path, message)``: a DeepSpeed job on this machine kind."""
        p = self.parsed
        out = []
        if p.distributed_type is None:
            out.append(("distributed_type", "is missing; Accelerate requires it. orch runs DeepSpeed jobs: "
                                            "set distributed_type: DEEPSPEED"))
        elif p.distributed_type != "DEEPSPEED":
            out.append(("distributed_type", f"is {p.distributed_type!r}; orch runs DeepSpeed jobs only (Accelerate's "
                                            "DeepSpeed launcher): set distributed_type: DEEPSPEED"))
        if p.compute_environment != "LOCAL_MACHINE":
            out.append(("compute_environment", f"is {p.compute_environment!r}; orch starts processes on your own "
                                               "machines: set compute_environment: LOCAL_MACHINE"))
        ids = [d.strip() for d in str(p.gpu_ids).split(",") if d.strip()] if p.gpu_ids not in (None, "all") else []
        if ids and ids != [str(i) for i in range(len(ids))]:
            out.append(("gpu_ids", f"{p.gpu_ids!r}: Accelerate would run on these devices alone, but orch gives each "
                                   "machine's ranks its slots 0..n-1, so it would use others. Remove gpu_ids and set "
                                   f"CUDA_VISIBLE_DEVICES={','.join(ids)} where the agents start (orch maps slot k to "
                                   "the k-th device it lists)"))
        n, procs = p.num_machines, p.num_processes
        if procs not in (None, -1) and (procs < n or procs % n):
            out.append(("num_processes", f"{procs} is not a multiple of num_machines {n}: Accelerate starts "
                                         f"num_processes // num_machines = {procs // n} on each machine. Set "
                                         f"num_processes to {max(1, procs // n) * n}"))
        return out

    def notes(self) -> list[str]:
        """Keys of the file that orch does not use, each with why (shown by ``orch plan``)."""
        p, ds = self.parsed, self.deepspeed
        notes = []
        one = p.num_machines == 1
        if p.machine_rank:
            notes.append(f"machine_rank {p.machine_rank} is not used: orch starts the processes of every machine itself")
        if p.gpu_ids not in (None, "all"):
            notes.append(f"gpu_ids {p.gpu_ids!r} is not used: each node's ranks get that node's hostfile slots "
                         "(CUDA_VISIBLE_DEVICES); choose slots with include/exclude")
        if p.use_cpu:
            notes.append("use_cpu is not used: Accelerate's DeepSpeed launcher ignores it too (only the --cpu flag "
                         "turns DeepSpeed off)")
        if one:
            for key in ("deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter",
                        "deepspeed_multinode_launcher"):
                if ds.get(key) is not None:
                    notes.append(f"deepspeed_config.{key} is not used with num_machines 1: Accelerate then runs "
                                 "torchrun on this machine (orch: launcher standard)")
            if p.main_process_ip:
                notes.append("main_process_ip is not used with num_machines 1 (torchrun on one machine rendezvouses "
                             "at 127.0.0.1)")
        elif ds.get("deepspeed_inclusion_filter") and ds.get("deepspeed_exclusion_filter"):
            notes.append("deepspeed_config.deepspeed_inclusion_filter is not used: with both filters Accelerate "
                         "passes only the exclusion filter")
        if p.rdzv_backend not in (None, "static") or p.same_network is False and not one:
            notes.append("rdzv_backend/same_network are not used: orch's ranks rendezvous at master_addr:master_port "
                         "(torchrun's static rendezvous)")
        for key in ("fsdp_config", "fp8_config", "parallelism_config", "megatron_lm_config", "mpirun_config",
                    "dynamo_config"):
            if getattr(p, key):
                notes.append(f"{key} is not used: orch runs Accelerate's DeepSpeed launch only")
        if p.dynamo_backend not in (None, "NO", "no"):
            notes.append(f"dynamo_backend {p.dynamo_backend!r} is not used: Accelerate's DeepSpeed launcher does not "
                         "pass it either")
        for key in ("tpu_name", "tpu_zone", "command_file", "commands", "tpu_vm", "tpu_env"):
            if getattr(p, key):
                notes.append(f"{key} is not used (TPU pods)")
        if p.main_training_function != "main":
            notes.append("main_training_function is not used (it is for notebook_launcher)")
        return [f"Accelerate config {self.source}: {n}" for n in notes]

    # -- what it gives the job ------------------------------------------------------------------

    def spec_fields(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The job spec fields this file implies that ``spec`` does not set itself.

        Mapping (``prepare_deepspeed_cmd_env``): with one machine Accelerate runs torchrun here
        (``launcher: standard``, ``num_gpus: num_processes``); with several it runs ``deepspeed
        --hostfile <deepspeed_hostfile> --no_local_rank --launcher <launcher>`` (``--node_rank ..
        --no_ssh`` and no ``--no_local_rank`` for nossh) with ``--exclude`` (else ``--include``,
        else ``--num_gpus num_processes // num_machines``), ``--master_addr main_process_ip``,
        ``--master_port main_process_port``; ``standard`` runs torchrun on every machine. orch
        adds ``num_nodes: num_machines`` (DeepSpeed's runner would use every host of the
        hostfile). ``main_process_port`` 0 or unset: ``auto``. The DeepSpeed config file becomes
        ``deepspeed_config``.

        Args:
            spec: the spec's own fields (which win; empty strings and -1 count as unset for
                the filters and counts).

        Returns:
            The fields to add (paths absolute).
        """
        p, ds = self.parsed, self.deepspeed
        out: dict[str, Any] = {}
        multi = p.num_machines > 1
        launcher = spec.get("launcher") or ((ds.get("deepspeed_multinode_launcher") or "pdsh") if multi else "standard")
        out["launcher"] = launcher
        if multi and ds.get("deepspeed_hostfile"):
            out["hostfile"] = self._path(ds["deepspeed_hostfile"])
        filters = any(spec.get(k) for k in ("include", "exclude"))
        counts = any(spec.get(k) not in (None, -1) for k in ("num_nodes", "num_gpus"))
        if multi and not filters and not counts:
            if ds.get("deepspeed_exclusion_filter"):
                out["exclude"] = ds["deepspeed_exclusion_filter"]
                filters = True
            elif ds.get("deepspeed_inclusion_filter"):
                out["include"] = ds["deepspeed_inclusion_filter"]
                filters = True
        if not filters:
            out["num_nodes"] = p.num_machines
            if p.num_processes not in (None, -1):
                out["num_gpus"] = max(1, p.num_processes // p.num_machines)
        if multi and p.main_process_ip:
            out["master_addr"] = p.main_process_ip
        if p.main_process_port:
            out["master_port"] = p.main_process_port
        out["no_local_rank"] = launcher not in ("nossh", "standard")
        if self.deepspeed_config_file:
            out["deepspeed_config"] = self.deepspeed_config_file
        return {k: v for k, v in out.items() if k not in spec or (k in ("num_nodes", "num_gpus") and spec[k] == -1)
                or (k in ("include", "exclude") and not spec[k])}

    def launch_env(self, flags: AccelerateSettings | None, *, config_file: str | None, workdir: str,
                   pythonpath: str | None) -> dict[str, str]:
        """The variables ``accelerate launch`` adds to the script's environment for this job.

        Source: ``prepare_deepspeed_cmd_env``: ``PYTHONPATH`` with the launch directory
        appended (orch: ``workdir``), ``ACCELERATE_MIXED_PRECISION``,
        ``ACCELERATE_CONFIG_DS_FIELDS`` (the section's keys, plus ``mixed_precision`` when it
        came from the file; lower case), ``ACCELERATE_USE_DEEPSPEED=true``, one
        ``ACCELERATE_*`` per setting given (as ``str(value).lower()`` where Accelerate lowers it),
        ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` (orch: the resolved copy), ``ACCELERATE_DEBUG_MODE``,
        ``ACCELERATE_CPU_AFFINITY``, ``ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES``. One addition:
        ``ACCELERATE_DEEPSPEED_OFFLOAD_*_NVME_PATH`` where an NVMe path is given (Accelerate's
        plugin reads them, but its launcher never sets them, so the path would be lost).

        Args:
            flags: the spec's ``accelerate`` section.
            config_file: the resolved DeepSpeed config the script reads, when the job uses a
                DeepSpeed config file; None when Accelerate builds the config from the settings.
            workdir: the ranks' working directory.
            pythonpath: the ``PYTHONPATH`` the launch starts from (the spec's ``env``, else the
                controller's), or None.
        """
        flags = flags or AccelerateSettings()
        given = flags.given()
        raw = {**self.deepspeed, **given}
        mp_flag = given.get("mixed_precision")
        mp = (mp_flag or self.mixed_precision_from_file or "no").lower()
        fields = list(self.deepspeed)
        if mp_flag is None and self.mixed_precision_from_file is not None:
            fields.append("mixed_precision")
        paths = [p for p in (pythonpath or "").split(":") if p] + [workdir]
        env = {"PYTHONPATH": ":".join(paths), "ACCELERATE_MIXED_PRECISION": mp,
               "ACCELERATE_CONFIG_DS_FIELDS": ",".join(fields).lower(), "ACCELERATE_USE_DEEPSPEED": "true"}
        if self.parsed.debug:
            env["ACCELERATE_DEBUG_MODE"] = "true"
        for key, var, lower in (
                ("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE", False),
                ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", False),
                ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", True),
                ("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", True),
                ("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", True),
                ("zero3_init_flag", "ACCELERATE_DEEPSPEED_ZERO3_INIT", True),
                ("zero3_save_16bit_model", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", True),
                ("offload_optimizer_nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", False),
                ("offload_param_nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", False)):
            if raw.get(key) is not None:
                env[var] = str(raw[key]).lower() if lower else str(raw[key])
        if config_file is not None:
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = config_file
        if self.parsed.enable_cpu_affinity:
            env["ACCELERATE_CPU_AFFINITY"] = "1"
        if raw.get("deepspeed_moe_layer_cls_names") is not None:
            env["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"] = str(raw["deepspeed_moe_layer_cls_names"])
        return env


def _key_path(e: Any) -> tuple:
    """A validation error's location as the file's keys (pydantic adds the members of a union,
    e.g. ``literal['none','cpu','nvme']``, which are not keys)."""
    loc = tuple(e["loc"])
    if e["type"] == "extra_forbidden" or not loc:
        return loc
    keys = [loc[0]]
    if loc[0] == "deepspeed_config" and len(loc) > 1 and loc[1] in DEEPSPEED_SECTION_KEYS:
        keys.append(loc[1])
    elif loc[0] in ("commands", "tpu_vm", "tpu_env") and len(loc) > 1 and isinstance(loc[1], int):
        keys.append(loc[1])
    return tuple(keys)


def _yaml_problems(err: ValidationError, tree: yaml.Node | None) -> list[tuple[str, str, int | None]]:
    out, seen = [], set()
    for e in err.errors():
        loc = _key_path(e)
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(file)"
        if path in seen:  # a union reports once per member
            continue
        seen.add(path)
        if e["type"] == "extra_forbidden":
            section = loc[0] == "deepspeed_config" and len(loc) > 1
            valid = DEEPSPEED_SECTION_KEYS if section else tuple(_AccelerateFile.model_fields)
            msg = f"unknown key (Accelerate 1.15 has no such key); valid keys{' of deepspeed_config' if section else ''}" \
                  f" are: {', '.join(valid)}"
        elif e["type"] in ("model_type", "model_attributes_type", "dict_type"):
            msg = f"expected a mapping of keys (e.g. {loc[-1]}: {{zero_stage: 2}}); got {type(e.get('input')).__name__}"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if "input" in e and not isinstance(e["input"], (dict, list)):
                msg = f"{msg}; got {e['input']!r}"
        out.append((path, msg, line_of(tree, loc)))
    return out


def _read(source: str | Mapping[str, Any], base_dir: str | Path) -> tuple[AccelerateConfig | None,
                                                                           list[tuple[str, str, int | None]]]:
    """Read and validate; ``(config or None, problems with lines)``. Raises ConfigError for a
    file that cannot be read or is not YAML."""
    tree = None
    if isinstance(source, Mapping):
        data, name, base = dict(source), "<inline>", Path(base_dir).resolve()
    else:
        p = Path(os.path.expanduser(str(source)))
        p = p if p.is_absolute() else (Path(base_dir) / p)
        name, base = str(p.resolve()), p.resolve().parent
        tree, data = read_yaml(p, "Accelerate config", ConfigError)
    if not isinstance(data, dict):
        return None, [("(file)", f"expected a mapping of keys (distributed_type: DEEPSPEED, ...); got "
                                 f"{type(data).__name__}", None)]
    try:
        parsed = _AccelerateFile.model_validate(data)
    except ValidationError as err:
        return None, _yaml_problems(err, tree)
    section = data.get("deepspeed_config") or {}
    cfg = AccelerateConfig(name, str(base), data, dict(section), parsed)
    return cfg, [(k, m, line_of(tree, tuple(k.split(".")))) for k, m in cfg.problems()]


def _raise(source: str, problems: list[tuple[str, str, int | None]]) -> None:
    problems = sorted(problems, key=lambda p: (p[2] is None, p[2] or 0))
    lines = [f"  {k}{f' (line {n})' if n else ''}: {m}" for k, m, n in problems]
    noun = "problem" if len(problems) == 1 else "problems"
    raise ConfigError(f"Accelerate config {source} has {len(problems)} {noun}:\n" + "\n".join(lines),
                      path=source, problems=[(k, m) for k, m, _ in problems])


def load_accelerate_config(source: str | os.PathLike | Mapping[str, Any], base_dir: str | Path = ".",
                           config_file: str | None = None) -> AccelerateConfig:
    """Read an Accelerate config file (or an inline mapping) and check it.

    Args:
        source: the YAML file (relative to ``base_dir``), or its content as a mapping.
        base_dir: where a relative ``source`` is, and (for a mapping) where its relative
            paths are taken from.
        config_file: a DeepSpeed config file given besides (the spec's ``deepspeed_config``),
            for the ambiguity rule; the file's own ``deepspeed_config_file`` always counts.

    Returns:
        The :class:`AccelerateConfig`.

    Raises:
        ConfigError: the file is missing, unreadable or not YAML, or has problems: every one
            listed with its key path (``deepspeed_config.zero_stage``), line and fix.
    """
    src = source if isinstance(source, Mapping) else os.fspath(source)
    cfg, problems = _read(src, base_dir)
    name = cfg.source if cfg else (str(src) if not isinstance(src, Mapping) else "<inline>")
    if cfg is not None:
        lines = _section_lines(cfg)
        problems += [(k, m, lines.get(k)) for k, m in cfg.ambiguity_problems(config_file or cfg.deepspeed_config_file)]
    if problems:
        _raise(name, problems)
    return cfg  # type: ignore[return-value]


def read_for_spec(data: dict, base_dir: str | Path) -> tuple[dict, list[tuple[str, str]]]:
    """The spec's ``accelerate_config`` read and merged into the spec's fields (for ``spec_from_dict``).

    Args:
        data: the spec's fields (``accelerate_config`` a path relative to ``base_dir``, or a mapping).
        base_dir: the spec file's directory.

    Returns:
        ``(data with the file's fields added where the spec lacks them, problems)``; each
        problem is ``("accelerate_config.<key path>", "<file> line N: message")``.
    """
    source = data["accelerate_config"]
    try:
        cfg, problems = _read(source, base_dir)
    except ConfigError as err:
        return data, [("accelerate_config", str(err))]
    name = os.path.basename(cfg.source) if cfg else str(source)
    out = [(f"accelerate_config.{k}", f"{name}{f' line {n}' if n else ''}: {m}") for k, m, n in problems]
    if cfg is None:
        return data, out
    merged = {**data, **cfg.spec_fields(data)}
    ds = merged.get("deepspeed_config")
    named = ds if isinstance(ds, str) else ("<inline>" if ds is not None else None)
    lines = _section_lines(cfg)
    for key, msg in cfg.ambiguity_problems(named):
        n = lines.get(key)
        out.append((f"accelerate_config.{key}", f"{name}{f' line {n}' if n else ''}: {msg}"))
    return merged, out


def _section_lines(cfg: AccelerateConfig) -> dict[str, int]:
    """``{key path: line}`` for the file's top-level keys and its deepspeed_config section."""
    if cfg.source == "<inline>":
        return {}
    try:
        tree, _ = read_yaml(Path(cfg.source), "Accelerate config", ConfigError)
    except ConfigError:
        return {}
    keys = [k for k in cfg.data] + [f"deepspeed_config.{k}" for k in cfg.deepspeed]
    return {k: line_of(tree, tuple(k.split("."))) for k in keys}
