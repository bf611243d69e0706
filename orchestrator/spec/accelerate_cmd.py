"""The ``accelerate launch`` command line as a job spec: its arguments (Accelerate 1.15,
``accelerate/commands/launch.py`` ``launch_command_parser``) and what each becomes under
``orch accelerate-launch`` (pure but for reading the Accelerate config file).

``orch accelerate-launch [accelerate launch arguments] script.py [script arguments]`` parses the
arguments of Accelerate's DeepSpeed launch as Accelerate parses them
(``tests/test_dropin_accelerate.py`` holds :data:`LAUNCH_OPTIONS` to the installed parser), with
Accelerate's precedence (``_validate_launch_command``): a flag given wins over the config file's key,
the file wins over Accelerate's default. The result is the job ``orch run --accelerate-config FILE
script.py`` runs (docs/accelerate.md), so every rule there applies:

* the file's top-level keys a flag overrides (``--num_processes``, ``--num_machines``,
  ``--main_process_ip``/``_port``, ``--machine_rank``, ``--gpu_ids``, ...) are laid over a copy of the
  file, given to the spec inline; without such a flag the spec names the file itself;
* the DeepSpeed settings' flags (``--zero_stage``, ``--mixed_precision``, ``--offload_*``, ...) are the
  spec's ``accelerate`` section, which wins over the file and, as a flag, does not count for
  Accelerate's ambiguity rule;
* ``--deepspeed_config_file`` is the spec's ``deepspeed_config``; ``--deepspeed_hostfile``, the two
  filters and ``--deepspeed_multinode_launcher`` are the spec's ``hostfile``, ``exclude`` (else
  ``include``: Accelerate passes only one) and ``launcher`` where the job spans machines.

Options of Accelerate's other launches (FSDP, Megatron-LM, TPU, FP8 recipes, ``--cpu``,
``--multi_gpu``...) are refused by name: orch runs Accelerate's DeepSpeed launch only. Options with no
effect there (torchrun's logging and restart options, dynamo's, which the DeepSpeed launch does not
pass either) are accepted and noted.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, SpecError
from .deepspeed_cmd import RunnerJob, RunnerOption, add_options, script_job_name
from .files import read_yaml

__all__ = ["LAUNCH_OPTIONS", "REFUSED_FAMILIES", "add_launch_arguments", "refused_family", "accelerate_job",
           "default_config_file"]


def _o(dest: str, kind: str, type_: type | None, default: Any, handling: str, meaning: str,
       choices: tuple[str, ...] | None = None, short: str = "") -> RunnerOption:
    flags = tuple(f for f in (short, f"--{dest}", f"--{dest.replace('_', '-')}") if f)
    return RunnerOption(tuple(dict.fromkeys(flags)), dest, kind, type_, default, handling, meaning, choices)


_DS = "the spec's accelerate section (wins over the file's deepspeed_config)"
_TORCHRUN = "not used: orch supervises and logs every rank itself (torchrun's own option)"
_DYNAMO = "not used: Accelerate's DeepSpeed launch does not pass it either"

#: The arguments of ``accelerate launch`` that Accelerate's DeepSpeed launch reads (or accepts), in
#: its order; with dashes or underscores, as Accelerate takes them. ``handling``: ``top`` (the config
#: file's top-level key of that name, overridden), ``spec``, ``note`` or ``refused``.
LAUNCH_OPTIONS: tuple[RunnerOption, ...] = (
    RunnerOption(("--config_file", "--config-file"), "config_file", "store", None, None, "spec",
                 "accelerate_config: the Accelerate config file (default: accelerate config's default file)"),
    RunnerOption(("--quiet", "-q"), "quiet", "store_true", None, None, "note", "not used: orch's output is its own"),
    _o("cpu", "store_true", None, False, "refused", "refused: --cpu runs Accelerate without DeepSpeed"),
    _o("multi_gpu", "store_true", None, False, "refused", "refused: --multi_gpu runs Accelerate without DeepSpeed"),
    _o("tpu", "store_true", None, False, "refused", "refused: TPUs are not DeepSpeed's"),
    _o("mixed_precision", "store", str, None, "spec", _DS, ("no", "fp16", "bf16", "fp8")),
    _o("num_processes", "store", int, None, "top", "num_processes: ranks in all (num_gpus = it / num_machines)"),
    _o("num_machines", "store", int, None, "top", "num_machines: nodes (num_nodes)"),
    _o("num_cpu_threads_per_process", "store", int, None, "note", "not used: Accelerate's DeepSpeed launch does not "
       "use it either; set OMP_NUM_THREADS in the job's env"),
    _o("enable_cpu_affinity", "store_true", None, False, "top", "enable_cpu_affinity: ACCELERATE_CPU_AFFINITY=1"),
    _o("dynamo_backend", "store", str, None, "note", _DYNAMO,
       ("no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi", "fx2trt",
        "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torhchxla_trace_once", "tvm")),
    _o("dynamo_mode", "store", str, "default", "note", _DYNAMO, ("default", "reduce-overhead", "max-autotune")),
    _o("dynamo_use_fullgraph", "store_true", None, False, "note", _DYNAMO),
    _o("dynamo_use_dynamic", "store_true", None, False, "note", _DYNAMO),
    _o("dynamo_use_regional_compilation", "store_true", None, False, "note", _DYNAMO),
    _o("use_deepspeed", "store_true", None, False, "spec", "distributed_type: DEEPSPEED, whatever the file says"),
    _o("use_fsdp", "store_true", None, False, "refused", "refused: FSDP is not DeepSpeed"),
    _o("use_parallelism_config", "store_true", None, False, "refused", "refused: ParallelismConfig is FSDP2's"),
    _o("use_megatron_lm", "store_true", None, False, "refused", "refused: Megatron-LM is not DeepSpeed"),
    _o("gpu_ids", "store", None, None, "top", "gpu_ids (not used: each node's ranks get its hostfile slots)"),
    _o("same_network", "store_true", None, False, "top", "same_network (not used: a static rendezvous)"),
    _o("machine_rank", "store", int, None, "top", "machine_rank (not used: orch starts every machine itself)"),
    _o("main_process_ip", "store", str, None, "top", "main_process_ip: master_addr"),
    _o("main_process_port", "store", int, None, "top", "main_process_port: master_port (0: a free one)"),
    _o("tee", "store", str, "0", "note", _TORCHRUN, short="-t"),
    _o("log_dir", "store", str, None, "note", _TORCHRUN),
    _o("role", "store", str, "default", "note", _TORCHRUN),
    _o("rdzv_backend", "store", str, "static", "top", "rdzv_backend (not used: a static rendezvous)"),
    _o("rdzv_conf", "store", str, "", "note", _TORCHRUN),
    _o("max_restarts", "store", int, 0, "note", "not used: orch's restart policy (restart.max_restarts in a spec) "
       "restarts the whole job from its last checkpoint"),
    _o("monitor_interval", "store", float, 0.1, "note", _TORCHRUN),
    _o("module", "store_true", None, None, "spec", "module: run the script as python -m", short="-m"),
    _o("no_python", "store_true", None, None, "spec", "no_python: run the script itself"),
    _o("main_training_function", "store", str, None, "top", "main_training_function (not used: notebook_launcher's)"),
    _o("downcast_bf16", "store_true", None, False, "note", "not used: it is for TPUs"),
    _o("deepspeed_config_file", "store", str, None, "spec", "deepspeed_config: the DeepSpeed config file"),
    _o("zero_stage", "store", int, None, "spec", _DS),
    _o("offload_optimizer_device", "store", str, None, "spec", _DS),
    _o("offload_param_device", "store", str, None, "spec", _DS),
    _o("offload_optimizer_nvme_path", "store", str, None, "spec", _DS),
    _o("offload_param_nvme_path", "store", str, None, "spec", _DS),
    _o("gradient_accumulation_steps", "store", int, None, "spec", _DS),
    _o("gradient_clipping", "store", float, None, "spec", _DS),
    _o("zero3_init_flag", "store", str, None, "spec", _DS),
    _o("zero3_save_16bit_model", "store", str, None, "spec", _DS),
    _o("deepspeed_hostfile", "store", str, None, "spec", "hostfile (several machines)"),
    _o("deepspeed_exclusion_filter", "store", str, None, "spec", "exclude (several machines)"),
    _o("deepspeed_inclusion_filter", "store", str, None, "spec", "include (several machines; not with an exclusion)"),
    _o("deepspeed_multinode_launcher", "store", str, None, "spec", "launcher (several machines)"),
    _o("deepspeed_moe_layer_cls_names", "store", str, None, "refused", "refused as a flag: set "
       "deepspeed_moe_layer_cls_names in the Accelerate config file's deepspeed_config section"),
    _o("debug", "store_true", None, None, "top", "debug: ACCELERATE_DEBUG_MODE=true"),
)

#: Option prefixes of Accelerate's other launches, each with what it is for: refused by name.
REFUSED_FAMILIES: dict[str, str] = {
    "fsdp_": "FSDP", "megatron_lm_": "Megatron-LM", "fp8_": "FP8 recipes (Transformer Engine, MS-AMP, torchao)",
    "parallelism_config_": "ParallelismConfig (FSDP2)", "tpu_": "TPU pods", "no_tpu_": "TPU pods", "vm": "TPU pods",
    "env": "TPU pods", "aws_": "SageMaker", "mpirun_": "Accelerate's MPI launch of CPU training",
}

#: ``--flag`` -> the spec's ``accelerate`` section key (AccelerateSettings).
_SETTINGS = ("mixed_precision", "zero_stage", "offload_optimizer_device", "offload_param_device",
             "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps",
             "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model")


def refused_family(option: str) -> str | None:
    """What an option of ``accelerate launch`` that orch does not take is for (``--fsdp_version`` ->
    ``"FSDP"``), or None if it is no option of Accelerate's other launches."""
    name = option.split("=", 1)[0].lstrip("-").replace("-", "_")
    for prefix, what in REFUSED_FAMILIES.items():
        if name == prefix or (prefix.endswith("_") and name.startswith(prefix)):
            return what
    return None


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add :data:`LAUNCH_OPTIONS` and the positionals ``training_script`` and ``training_script_args``
    (everything after the script) to ``parser``; the namespace also gets ``runner_given``."""
    group = parser.add_argument_group("accelerate launch's arguments", "parsed as accelerate launch parses them; "
                                      "after each, what it is under orch (FSDP, Megatron-LM, TPU and FP8 options "
                                      "are refused: orch runs Accelerate's DeepSpeed launch)")
    add_options(group, LAUNCH_OPTIONS)
    parser.add_argument("training_script", type=str, help="the training script, then its arguments")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="the script's arguments")


def default_config_file(env: Mapping[str, str]) -> str:
    """Where ``accelerate config`` writes its file and ``accelerate launch`` reads it without
    ``--config_file``: ``$HF_HOME/accelerate/default_config.yaml``, ``HF_HOME`` defaulting to
    ``$XDG_CACHE_HOME/huggingface`` (``~/.cache/huggingface``) (``accelerate/commands/config/config_args.py``)."""
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME", "~"), ".cache")
    home = env.get("HF_HOME") or os.path.join(cache, "huggingface")
    return os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")


def _abs(path: str, base: str) -> str:
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else (Path(base) / p).resolve())


def _file_data(path: str) -> dict[str, Any]:
    """The config file's mapping, its deepspeed_config paths made absolute (from the file's directory)."""
    _tree, data = read_yaml(Path(path), "Accelerate config", ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"Accelerate config {path}: expected a mapping of keys (distributed_type: DEEPSPEED, ...)")
    data = dict(data)
    section = dict(data.get("deepspeed_config") or {})
    for key in ("deepspeed_config_file", "deepspeed_hostfile"):
        if isinstance(section.get(key), str):
            section[key] = _abs(section[key], os.path.dirname(path))
    if section:
        data["deepspeed_config"] = section
    return data


def accelerate_job(ns: argparse.Namespace, cwd: str, env: Mapping[str, str], *,
                   local_slots: int) -> RunnerJob:
    """Job spec fields from a parsed ``accelerate launch`` command line (module docstring).

    Args:
        ns: the namespace of a parser given :func:`add_launch_arguments` (``unknown``: the options it
            did not know, from ``parse_known_args``).
        cwd: the directory the command runs in: the job's ``workdir``; flags' paths are taken from it.
        env: the environment (where Accelerate's default config file is).
        local_slots: ranks on this machine when neither a file nor ``--num_processes`` says.

    Returns:
        The :class:`RunnerJob`.

    Raises:
        SpecError: options orch refuses, unknown options (each named with what it is for), or a
            launch that would not be Accelerate's DeepSpeed launch.
        ConfigError: the config file cannot be read.
    """
    given = set(getattr(ns, "runner_given", ()) or ())
    problems = [f"--{o.dest} is not supported: {o.meaning.removeprefix('refused: ')}"
                for o in LAUNCH_OPTIONS if o.handling == "refused" and o.dest in given]
    for word in getattr(ns, "unknown", None) or []:
        option, what = word.split("=", 1)[0], refused_family(word)
        problems.append(f"{option} is for {what}: orch runs Accelerate's DeepSpeed launch only" if what else
                        f"{option} is not an option of accelerate launch")
    if problems:  # (after an unknown option, the words that follow may not be what they seem: stop here)
        raise SpecError("The accelerate launch command line has arguments orch cannot run:\n  " + "\n  ".join(problems))
    path = _abs(ns.config_file, cwd) if ns.config_file else None
    if path is None and os.path.isfile(default_config_file(env)):
        path = default_config_file(env)
    data = _file_data(path) if path else {"compute_environment": "LOCAL_MACHINE"}
    top = {o.dest: getattr(ns, o.dest) for o in LAUNCH_OPTIONS if o.handling == "top" and o.dest in given}
    if ns.use_deepspeed or not path:
        top["distributed_type"] = "DEEPSPEED" if ns.use_deepspeed else None
    if not path and ns.use_deepspeed and "num_processes" not in top:
        top["num_processes"] = local_slots * int(top.get("num_machines") or 1)
    if not path and not ns.use_deepspeed:
        problems.append("no Accelerate config file (--config_file, or accelerate config's "
                        f"{default_config_file(env)}) and no --use_deepspeed: accelerate launch would not use "
                        "DeepSpeed, and orch runs DeepSpeed jobs")
    if problems:
        raise SpecError("The accelerate launch command line has arguments orch cannot run:\n  " + "\n  ".join(problems))
    merged = {**data, **top}
    script = ns.training_script.rsplit(".", 1)[-1] if ns.module else ns.training_script
    fields: dict[str, Any] = {"name": script_job_name(script), "workdir": cwd, "entrypoint": ns.training_script,
                              "args": list(ns.training_script_args),
                              "accelerate_config": merged if top or not path else path}
    settings = {k: getattr(ns, k) for k in _SETTINGS if k in given}
    if settings:
        fields["accelerate"] = settings
    for key in ("module", "no_python"):
        if getattr(ns, key):
            fields[key] = True
    if ns.deepspeed_config_file:
        fields["deepspeed_config"] = _abs(ns.deepspeed_config_file, cwd)
    section = merged.get("deepspeed_config") or {}
    if int(merged.get("num_machines") or 1) > 1:
        if ns.deepspeed_hostfile:
            fields["hostfile"] = _abs(ns.deepspeed_hostfile, cwd)
        if ns.deepspeed_multinode_launcher:
            fields["launcher"] = ns.deepspeed_multinode_launcher
        exclusion = ns.deepspeed_exclusion_filter or section.get("deepspeed_exclusion_filter")
        inclusion = ns.deepspeed_inclusion_filter or section.get("deepspeed_inclusion_filter")
        if exclusion and (ns.deepspeed_exclusion_filter or ns.deepspeed_inclusion_filter):
            fields["exclude"] = exclusion
        elif inclusion and ns.deepspeed_inclusion_filter:
            fields["include"] = inclusion
    notes = [f"--{o.dest} is {o.meaning}" for o in LAUNCH_OPTIONS
             if o.handling == "note" and o.dest in given and getattr(ns, o.dest) != o.default]
    if path and not ns.config_file:
        notes.append(f"the Accelerate config is accelerate config's default file {path}, as accelerate launch reads it")
    return RunnerJob(fields, notes)
