"""DeepSpeed configs resolved before anything starts: every ``"auto"`` filled, every rule checked.

A DeepSpeed config may say ``"auto"`` where Hugging Face Accelerate fills the value in. orch
fills the same values the same way (Accelerate 1.15, read in its source), so that ``orch plan``
shows the config the ranks will really use and its problems are reported before any rank
starts. :func:`resolve` takes a config, the job's :class:`DeepSpeedSettings` (what
``accelerate launch`` gets from its config file and flags) and the :class:`RunFacts` (world
size, slots per node, micro batch, hidden size), and returns a :class:`ResolvedConfig` or raises
:class:`~orchestrator.errors.ConfigError` listing every problem, one per key path, each with
its fix.

Where each value comes from (Accelerate ``utils/dataclasses.py`` ``DeepSpeedPlugin``, its
``__post_init__``, ``fill_match`` and ``set_mixed_precision``; ``accelerator.py``
``_prepare_deepspeed``):

==============================================================  ===============================================
key                                                             value of ``"auto"``
==============================================================  ===============================================
``zero_optimization.stage``                                     ``zero_stage`` (default 2)
``zero_optimization.offload_optimizer.device`` / ``.nvme_path``  ``offload_optimizer_device`` / ``_nvme_path``
                                                                (default ``"none"``)
``zero_optimization.offload_param.device`` / ``.nvme_path``      ``offload_param_device`` / ``_nvme_path``
``zero_optimization.stage3_gather_16bit_weights_on_model_save``  ``zero3_save_16bit_model`` (default false)
``gradient_accumulation_steps``                                 ``gradient_accumulation_steps`` (default 1)
``gradient_clipping``                                           ``gradient_clipping`` (default 1.0)
``fp16.enabled`` / ``bf16.enabled``                             ``mixed_precision`` is fp16 / bf16 or fp8
``train_micro_batch_size_per_gpu``                              the micro batch (Accelerate: the DataLoader's)
``train_batch_size``                                            micro x accumulation x world size
``zero_optimization.reduce_bucket_size``                        hidden_size ** 2
``zero_optimization.stage3_prefetch_bucket_size``               int(0.9 x hidden_size ** 2)
``zero_optimization.stage3_param_persistence_threshold``        10 x hidden_size
``optimizer.params.lr`` / ``weight_decay``, ``scheduler.params.  left to the script's Accelerate
warmup_min_lr`` / ``warmup_max_lr`` / ``warmup_num_steps`` /     (``DummyOptim`` / ``DummyScheduler``); an
``total_num_steps``                                             error without Accelerate
==============================================================  ===============================================

Any other ``"auto"`` is an error, as in Accelerate (``fill_match``: "not found in kwargs").
The checks (:func:`check`) are DeepSpeed's and Accelerate's own rules, each named where it is
applied.

With ``filled_by="script"`` (a script that fills the config itself: the HF Trainer, or Accelerate)
orch fills only the ZeRO settings it hands the ranks as ``ACCELERATE_DEEPSPEED_*``; every other
"auto" the script fills (:data:`HF_TRAINER_KEYS`, :data:`ACCELERATE_KEYS`) is left to it, and the
rules are checked on the values that are not "auto".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, Mapping

from ..errors import ConfigError
from .dssources import hidden_size_from_model_config  # re-exported: callers import it from here
from .dszero import zero_rules

__all__ = ["AUTO", "DeepSpeedSettings", "RunFacts", "ResolvedConfig", "plugin_config", "resolve", "check",
           "hidden_size_from_model_config", "HIDDEN_SIZE_KEYS", "SCRIPT_FILLED_KEYS", "SETTING_KEYS",
           "ACCELERATE_KEYS", "HF_TRAINER_KEYS"]

AUTO = "auto"

#: Accelerate's DeepSpeedPlugin attribute -> the config key it fills (``plugin_to_config_mapping``).
SETTING_KEYS: dict[str, str] = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
#: The "auto" keys Accelerate fills from the model's hidden size (``_prepare_deepspeed``).
HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "zero_optimization.stage3_param_persistence_threshold")
#: The "auto" keys Accelerate fills from the script's DummyOptim / DummyScheduler (``_prepare_deepspeed``).
SCRIPT_FILLED_KEYS = ("optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                      "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                      "scheduler.params.total_num_steps")
_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size")
#: The "auto" keys a script's own Accelerate fills (``DeepSpeedPlugin.__post_init__``, ``set_mixed_precision``,
#: ``Accelerator._prepare_deepspeed``; any other fails there: "not found in kwargs").
ACCELERATE_KEYS = (*SETTING_KEYS.values(), "fp16.enabled", "bf16.enabled", *_BATCH_KEYS, *HIDDEN_SIZE_KEYS,
                   *SCRIPT_FILLED_KEYS)
#: ... and the HF Trainer, which runs on Accelerate (transformers 5.24 ``integrations/deepspeed.py``,
#: ``HfTrainerDeepSpeedConfig.trainer_config_process`` and ``trainer_config_finalize``: Adam's betas and eps too).
HF_TRAINER_KEYS = (*ACCELERATE_KEYS, "optimizer.params.betas", "optimizer.params.eps")
#: The settings orch still fills under a script: the HF Trainer fills accumulation and clipping itself, first.
_ZERO_SETTINGS = tuple(n for n in SETTING_KEYS if n not in ("gradient_accumulation_steps", "gradient_clipping"))

Problem = tuple[str, str]


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The job's DeepSpeed settings, as Accelerate's ``DeepSpeedPlugin`` holds them.

    What ``accelerate launch`` takes from the ``deepspeed_config`` section of its config file
    and from its flags (``--zero_stage`` ...) and passes to the script as ``ACCELERATE_*``
    variables. ``None`` means "not given": Accelerate's default then applies (see
    :meth:`value`).

    Attributes:
        zero_stage: 0-3 (default 2).
        gradient_accumulation_steps: micro batches per optimizer step (default: the
            script's ``Accelerator(gradient_accumulation_steps=)``, 1 unless it passes one).
        gradient_clipping: max gradient norm (default 1.0 when the config says "auto").
        offload_optimizer_device, offload_param_device: ``none`` | ``cpu`` | ``nvme`` (default none).
        offload_optimizer_nvme_path, offload_param_nvme_path: directories for NVMe offload.
        zero3_save_16bit_model: gather 16-bit weights when saving at stage 3 (default false).
        zero3_init_flag: ``deepspeed.zero.Init`` at stage 3 (only a variable for the script).
        mixed_precision: ``no`` | ``fp16`` | ``bf16`` | ``fp8`` (default no).
        explicit: names of the attributes given by the user (their values win warnings
            when the config keeps another value).
    """

    zero_stage: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_save_16bit_model: bool | None = None
    zero3_init_flag: bool | None = None
    mixed_precision: str | None = None
    explicit: frozenset[str] = field(default_factory=frozenset)

    def value(self, name: str) -> Any:
        """The setting as ``DeepSpeedPlugin.__post_init__`` would hold it with nothing given:
        stage 2, devices and NVMe paths ``"none"``, 16-bit save false, accumulation and clipping
        ``"auto"`` (filled later by ``_prepare_deepspeed``), mixed precision ``"no"``."""
        v = getattr(self, name)
        if v is not None:
            return v
        return {"zero_stage": 2, "offload_optimizer_device": "none", "offload_param_device": "none",
                "offload_optimizer_nvme_path": "none", "offload_param_nvme_path": "none",
                "zero3_save_16bit_model": False, "mixed_precision": "no"}.get(name, AUTO)


@dataclass(frozen=True)
class RunFacts:
    """What the resolution needs from the job's plan and spec.

    Attributes:
        world_size: number of ranks (DeepSpeed's data-parallel world for plain ZeRO).
        slots_per_node: ranks on each node, in node order (for ZeRO++'s hpz partition).
        micro_batch_size: samples per rank per micro step (the spec's ``micro_batch_size``), or None.
        hidden_size: the model's hidden size (the spec's ``hidden_size``, or read from
            ``model_config``), or None.
        hidden_size_source: where ``hidden_size`` came from, for messages.
    """

    world_size: int
    slots_per_node: tuple[int, ...] = ()
    micro_batch_size: int | None = None
    hidden_size: int | None = None
    hidden_size_source: str = "hidden_size"


@dataclass(frozen=True)
class ResolvedConfig:
    """A resolved DeepSpeed config.

    Attributes:
        config: the config with every "auto" orch can fill filled (a new dict).
        warnings: things the user should know (settings the config overrides, keys left
            "auto" for the script's Accelerate, rules that are advice rather than errors).
        left_auto: key paths still "auto": SCRIPT_FILLED_KEYS under Accelerate; with
            ``filled_by="script"``, every "auto" the script fills.
    """

    config: dict
    warnings: tuple[str, ...] = ()
    left_auto: tuple[str, ...] = ()


def plugin_config(settings: DeepSpeedSettings) -> dict:
    """The DeepSpeed config Accelerate builds from its settings when no config file is named.

    Source: ``DeepSpeedPlugin.__post_init__`` (the branch without ``hf_ds_config``): batch sizes
    "auto", the ZeRO stage, both offload sections (an NVMe path only with device ``nvme``,
    else null), the 16-bit save flag, and ``gradient_clipping`` only when it is set (non-zero
    or "auto").

    Args:
        settings: the job's settings.

    Returns:
        A new config dict (still holding "auto" values; pass it to :func:`resolve`).
    """
    v = settings.value
    config: dict[str, Any] = {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": v("gradient_accumulation_steps"),
        "zero_optimization": {
            "stage": v("zero_stage"),
            "offload_optimizer": {"device": v("offload_optimizer_device"),
                                  "nvme_path": v("offload_optimizer_nvme_path")
                                  if v("offload_optimizer_device") == "nvme" else None},
            "offload_param": {"device": v("offload_param_device"),
                              "nvme_path": v("offload_param_nvme_path") if v("offload_param_device") == "nvme" else None},
            "stage3_gather_16bit_weights_on_model_save": v("zero3_save_16bit_model"),
        },
    }
    if v("gradient_clipping"):
        config["gradient_clipping"] = v("gradient_clipping")
    return config


def _leaves(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, dict, str, Any]]:
    """``(dotted key, parent dict, key, value)`` for every non-mapping value, depth first (lists
    are values: Accelerate does not look inside them)."""
    for key, value in list(config.items()):
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, path + ".")
        else:
            yield path, config, key, value  # type: ignore[misc]


def _node(config: dict, dotted: str) -> tuple[dict | None, str]:
    """The dict holding ``dotted``'s last part, or None where a section is missing
    (``HfDeepSpeedConfig.find_config_node``)."""
    *parents, key = dotted.split(".")
    for part in parents:
        config = config.get(part)  # type: ignore[assignment]
        if not isinstance(config, dict):
            return None, key
    return config, key


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    node, key = _node(config, dotted)
    return default if node is None else node.get(key, default)


def _fill(config: dict, dotted: str, value: Any) -> bool:
    """Set ``dotted`` to ``value`` if it is "auto" (``fill_match`` with ``must_match=False``);
    True if it was."""
    node, key = _node(config, dotted)
    if node is not None and node.get(key) == AUTO:
        node[key] = value
        return True
    return False


def _fill_settings(config: dict, settings: DeepSpeedSettings, warnings: list[str],
                   names: tuple[str, ...] = tuple(SETTING_KEYS)) -> None:
    """Accelerate's ``DeepSpeedPlugin.__post_init__``: each setting fills its key where the
    config says "auto"; where the config has a value, the config's value is kept (and a
    setting the user gave is reported as overridden)."""
    for name in names:
        key, value = SETTING_KEYS[name], settings.value(name)
        if _fill(config, key, value):
            continue
        have = _get(config, key)
        if name in settings.explicit and have is not None and have != AUTO and have != value:
            warnings.append(f"{name} {value!r} is not used: the DeepSpeed config sets {key} to {have!r}, and "
                            f"Accelerate keeps the config's value (write \"auto\" there to take the setting)")


def _mixed_precision(config: dict, settings: DeepSpeedSettings, accelerate: bool) -> list[Problem]:
    """``DeepSpeedPlugin.set_mixed_precision``: under Accelerate, the fp16/bf16 sections; always,
    their "auto" ``enabled`` values."""
    mp = settings.value("mixed_precision")
    problems: list[Problem] = []
    if accelerate:
        if mp == "fp16" and "fp16" not in config:
            config["fp16"] = {"enabled": True, "auto_cast": True}
        elif mp in ("bf16", "fp8") and "bf16" not in config:
            config["bf16"] = {"enabled": True}
        if mp != "no":
            other = "bf16" if mp == "fp16" else "fp16"
            section = config.get(other)
            if isinstance(section, dict) and str(section.get("enabled", "False")).lower() == "true":
                problems.append((f"{other}.enabled", f"is true in the DeepSpeed config while mixed_precision is "
                                 f"{mp!r}; Accelerate refuses the pair (DeepSpeedPlugin.set_mixed_precision). Set "
                                 f"mixed_precision to {other!r} or 'no', or set {other}.enabled to false"))
        for dtype in ("fp16", "bf16"):
            config.setdefault(dtype, {"enabled": False})
    _fill(config, "fp16.enabled", mp == "fp16")
    _fill(config, "bf16.enabled", mp in ("bf16", "fp8"))
    return problems


def _run_values(config: dict, run: RunFacts) -> dict[str, Any]:
    """What ``Accelerator._prepare_deepspeed`` fills "auto" keys with, from the run."""
    values: dict[str, Any] = {"gradient_clipping": 1.0,
                              "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
    micro = config.get("train_micro_batch_size_per_gpu")
    if micro == AUTO:
        micro = run.micro_batch_size
    gas = config.get("gradient_accumulation_steps", 1)  # DeepSpeed: 1 when only a micro batch is given
    if micro is not None and micro != AUTO:
        values["train_micro_batch_size_per_gpu"] = micro
        if _is_int(micro) and _is_int(gas):
            values["train_batch_size"] = micro * gas * run.world_size
    if run.hidden_size is not None:
        h = run.hidden_size
        values.update({HIDDEN_SIZE_KEYS[0]: h * h, HIDDEN_SIZE_KEYS[1]: int(0.9 * h * h),
                       HIDDEN_SIZE_KEYS[2]: 10 * h})
    return values


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unfilled_problem(key: str, accelerate: bool, script: bool = False) -> Problem:
    if script:
        return (key, "is \"auto\", but neither orch nor the script fills it: the HF Trainer and Accelerate fill "
                     "only the keys listed in docs/accelerate.md (Accelerate fails on any other: \"not found in "
                     "kwargs\"). Write the value here")
    if key == "train_batch_size":
        return (key, "is \"auto\" (micro batch x accumulation x world size) and the micro batch is not known; "
                     "set micro_batch_size in the job spec (orch run/submit --micro-batch-size N), or write a number")
    if key in _BATCH_KEYS:
        return (key, "is \"auto\" and the micro batch is not known: Accelerate takes it from the DataLoader "
                     "given to accelerator.prepare(), which orch cannot see. Set micro_batch_size in the job spec "
                     "(orch run/submit --micro-batch-size N) to that DataLoader's batch_size, or write a number here")
    if key in HIDDEN_SIZE_KEYS:
        return (key, "is \"auto\" and no hidden size is known: Accelerate fills reduce_bucket_size = hidden^2, "
                     "stage3_prefetch_bucket_size = 0.9 x hidden^2 and stage3_param_persistence_threshold = "
                     "10 x hidden from model.config.hidden_size (or max(hidden_sizes)). Set hidden_size or "
                     "model_config in the job spec, or write numbers for these three keys")
    if key in SCRIPT_FILLED_KEYS:
        return (key, "is \"auto\", which only Accelerate's DummyOptim/DummyScheduler in the script can fill; this "
                     "job does not run under Accelerate (no accelerate_config), so DeepSpeed would get the word "
                     "\"auto\". Write the value here")
    return (key, "is \"auto\", but nothing fills this key (Accelerate fills only the keys listed in "
                 "docs/accelerate.md and fails on any other: \"not found in kwargs\"). Write the value here")


def resolve(config: Mapping[str, Any], settings: DeepSpeedSettings, run: RunFacts, *, accelerate: bool,
            from_file: bool = True, source: str = "DeepSpeed config", filled_by: str = "orch",
            script_keys: Collection[str] = HF_TRAINER_KEYS) -> ResolvedConfig:
    """Fill every "auto" of ``config`` as Accelerate would, then :func:`check` the result.

    Steps, in Accelerate's order: (1) a config file without ``gradient_accumulation_steps``
    gets 1 and one without ``zero_optimization`` is refused (``DeepSpeedPlugin.__post_init__``,
    only under Accelerate); (2) the settings fill their keys (:data:`SETTING_KEYS`); (3) mixed
    precision (``set_mixed_precision``); (4) the run's values (``_prepare_deepspeed``): clipping
    1.0, 16-bit save false, accumulation 1, micro batch, train batch = micro x accumulation x
    world size, the three hidden-size keys; (5) :data:`SCRIPT_FILLED_KEYS` stay "auto" under
    Accelerate (a warning) and are errors without it; any other "auto" is an error.

    With ``filled_by="script"`` the script fills its "auto" values itself, so orch fills only what
    the script's filling would agree with: the ZeRO settings under Accelerate (orch gives the ranks
    them as ``ACCELERATE_DEEPSPEED_*`` and ``DeepSpeedPlugin`` fills from those); the rest of
    ``script_keys`` stays "auto" (``left_auto``): the HF Trainer fills batch sizes, accumulation,
    clipping, optimizer and scheduler params and fp16/bf16 from its ``TrainingArguments`` and
    *refuses* a value that differs (``HfTrainerDeepSpeedConfig.fill_match``), the hidden-size keys
    from the model it loads. Any other "auto" is an error; the rules apply to the other values.

    Args:
        config: the DeepSpeed config (not modified).
        settings: the job's settings (``DeepSpeedSettings()`` for a job without Accelerate:
            Accelerate's defaults).
        run: world size, slots per node, micro batch, hidden size.
        accelerate: the script runs under Accelerate (mixed-precision sections added, the
            script's optimizer/scheduler values left "auto", settings reported when overridden).
        from_file: the config is the user's (a file or inline), not :func:`plugin_config`'s.
        source: how to name the config in the error message.
        filled_by: ``"orch"`` (orch fills, as above) or ``"script"``.
        script_keys: under ``"script"``, the keys the script fills (:data:`HF_TRAINER_KEYS`, or
            :data:`ACCELERATE_KEYS` for a script on Accelerate without the Trainer).

    Returns:
        The :class:`ResolvedConfig`.

    Raises:
        ConfigError: every problem at once, one line per key path with its fix.
    """
    config = copy.deepcopy(dict(config))
    problems: list[Problem] = []
    warnings: list[str] = []
    script = filled_by == "script"
    if (accelerate or script) and from_file:  # the HF Trainer builds a DeepSpeedPlugin from its file too
        if not script:
            config.setdefault("gradient_accumulation_steps", 1)
        if "zero_optimization" not in config:
            problems.append(("zero_optimization", "is missing; Accelerate requires the ZeRO section in a DeepSpeed "
                             "config file (DeepSpeedPlugin: 'Please specify the ZeRO optimization config'). Add "
                             "\"zero_optimization\": {\"stage\": 2} (or the stage you want)"))
    if script:
        if accelerate:
            _fill_settings(config, settings, warnings, _ZERO_SETTINGS)
        values: dict[str, Any] = {}
    else:
        _fill_settings(config, settings, warnings)
        problems += _mixed_precision(config, settings, accelerate)
        _fill(config, "gradient_accumulation_steps", 1)  # the Accelerator's own default
        values = _run_values(config, run)
    left: list[str] = []
    for key, parent, name, value in _leaves(config):
        if value != AUTO:
            continue
        if key in values:
            parent[name] = values[key]
        elif (key in script_keys) if script else (accelerate and key in SCRIPT_FILLED_KEYS):
            left.append(key)
        else:
            problems.append(_unfilled_problem(key, accelerate, script))
    if left and not script:
        warnings.append(f"left \"auto\" for the script's Accelerate to fill from its DummyOptim/DummyScheduler in "
                        f"accelerator.prepare(): {', '.join(left)} (a script without them fails on these)")
    if not problems:
        more_problems, more_warnings = check(config, run, settings if accelerate else None)
        problems += more_problems
        warnings += more_warnings
    if problems:
        raise _error(source, problems)
    return ResolvedConfig(config, tuple(warnings), tuple(left))


def _error(source: str, problems: list[Problem]) -> ConfigError:
    noun = "problem" if len(problems) == 1 else "problems"
    lines = [f"  {key}: {msg}" for key, msg in problems]
    return ConfigError(f"{source} has {len(problems)} {noun}:\n" + "\n".join(lines), path=source, problems=problems)


def check(config: Mapping[str, Any], run: RunFacts,
          settings: DeepSpeedSettings | None = None) -> tuple[list[Problem], list[str]]:
    """DeepSpeed's and Accelerate's rules about a resolved config, as ``(problems, warnings)``.

    Rules (source):

    * ``zero_optimization.stage`` is 0-3 (DeepSpeed ``ZeroStageEnum``);
    * the ``zero_optimization`` rules (offload devices and paths, NVMe offload below stage 3, ZeRO++):
      :func:`orchestrator.spec.dszero.zero_rules`;
    * a ``scheduler`` without an ``optimizer`` section: a warning (DeepSpeed builds the config's
      scheduler over a client optimizer; Accelerate's guide says a DeepSpeed scheduler goes
      with a DeepSpeed optimizer);
    * not both ``fp16.enabled`` and ``bf16.enabled`` (DeepSpeed ``DeepSpeedConfig``: "bfloat16
      and fp16 modes cannot be simultaneously enabled");
    * batch sizes (DeepSpeed ``_set_batch_related_parameters`` + ``_batch_assertion``): at least
      one of train_batch_size / train_micro_batch_size_per_gpu, all positive integers, and
      train_batch_size = micro x accumulation x world size;
    * ``zero3_init_flag`` only at stage 3 (a warning; Accelerate turns it off).

    A value still "auto" (the script fills it) is unknown: the rules that need it are skipped, but
    a ``train_batch_size`` must still be a multiple of what is known of micro x accumulation x world.

    Args:
        config: a resolved config ("auto" left only where the script fills it).
        run: world size and slots per node.
        settings: the Accelerate settings (for ``zero3_init_flag``), or None.

    Returns:
        ``(problems, warnings)``: problems as ``(key path, message with the fix)``.
    """
    problems: list[Problem] = []
    warnings: list[str] = []
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        problems.append(("zero_optimization", f"must be a mapping (e.g. {{\"stage\": 2}}); got {zero!r}"))
        zero = {}
    stage = zero.get("stage", 0)
    if stage == AUTO:
        stage = None
    elif not _is_int(stage) or not 0 <= stage <= 3:
        problems.append(("zero_optimization.stage", f"must be 0, 1, 2 or 3; got {stage!r}"))
        stage = None
    zero_problems, zero_warnings = zero_rules(zero, stage, run.slots_per_node)
    problems += zero_problems
    warnings += zero_warnings
    if "scheduler" in config and "optimizer" not in config:
        warnings.append("the DeepSpeed config has a scheduler but no optimizer: DeepSpeed then builds the "
                        "scheduler over the script's own optimizer, and under Accelerate the script must pass "
                        "accelerate.utils.DummyScheduler; add an \"optimizer\" section to let DeepSpeed build both")
    if _enabled(config, "fp16") and _enabled(config, "bf16"):
        problems.append(("bf16.enabled", "fp16.enabled and bf16.enabled are both true; DeepSpeed refuses it "
                                         "(\"bfloat16 and fp16 modes cannot be simultaneously enabled\"). Keep one"))
    if config:
        problems += _batch_problems(config, run.world_size)
    if settings is not None and settings.zero3_init_flag and stage is not None and stage != 3:
        warnings.append(f"zero3_init_flag is true but the ZeRO stage is {stage}: deepspeed.zero.Init applies only "
                        "at stage 3, and Accelerate turns the flag off (with a warning of its own)")
    return problems, warnings


def _enabled(config: Mapping[str, Any], dtype: str) -> bool:
    section = config.get(dtype)
    return isinstance(section, dict) and section.get("enabled") is True


def _batch_problems(config: Mapping[str, Any], world: int) -> list[Problem]:
    """DeepSpeed's batch rules (deepspeed/runtime/config.py ``_set_batch_related_parameters`` and
    ``_batch_assertion``), with the values DeepSpeed would derive."""
    tb, mb, ga = (config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps"))
    problems: list[Problem] = []
    for key, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                       ("gradient_accumulation_steps", ga)):
        if value is not None and value != AUTO and (not _is_int(value) or value <= 0):
            problems.append((key, f"must be a whole number greater than 0; got {value!r}"))
    if problems:
        return problems
    if AUTO in (tb, mb, ga):
        return _batch_auto_problems(tb, mb, ga, world)
    if tb is None and mb is None:
        return [("train_micro_batch_size_per_gpu", "neither train_batch_size nor train_micro_batch_size_per_gpu "
                 "is set; DeepSpeed needs one of them. Set train_micro_batch_size_per_gpu (or \"auto\" with "
                 "micro_batch_size in the job spec)")]
    if tb is not None and mb is not None and ga is not None:
        derived = None
    elif tb is not None and mb is not None:
        ga, derived = tb // mb // world, "gradient_accumulation_steps"
    elif tb is not None and ga is not None:
        mb, derived = tb // world // ga, "train_micro_batch_size_per_gpu"
    elif tb is not None:
        ga, mb, derived = 1, tb // world, "train_micro_batch_size_per_gpu"
    else:
        return []
    if ga <= 0 or mb <= 0 or tb != mb * ga * world:
        how = f" (DeepSpeed would derive {derived} = {mb if derived.startswith('train') else ga})" if derived else ""
        return [("train_batch_size", f"{tb} != train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps "
                 f"{ga} x world size {world}{how}; DeepSpeed refuses it (\"Check batch related parameters\"). "
                 f"Set train_batch_size to \"auto\", or to micro x accumulation x {world}")]
    return []


def _batch_auto_problems(tb: Any, mb: Any, ga: Any, world: int) -> list[Problem]:
    """Batch sizes the script fills ("auto": train_batch_size = micro x accumulation x world size,
    ``HfTrainerDeepSpeedConfig.trainer_config_process``): a ``train_batch_size`` given as a number must
    be a multiple of the world size times the factors given as numbers, or no filling can match it."""
    known = world * (mb if _is_int(mb) else 1) * (ga if _is_int(ga) else 1)
    if not _is_int(tb) or tb % known == 0:
        return []
    return [("train_batch_size", f"{tb} is not a multiple of {known} (world size {world} x the micro batch and "
             "accumulation given as numbers): no micro batch x accumulation the script fills in gives "
             f"{tb}, and it refuses the mismatch. Set train_batch_size to \"auto\", or to a multiple of {known}")]

