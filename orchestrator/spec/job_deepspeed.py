"""The job's DeepSpeed config, ready for the planner: the spec's own config (a file or a mapping) or one
built from its Accelerate config, every ``"auto"`` resolved for the planned world (:mod:`.dsconfig`),
with the ``ACCELERATE_*`` environment ``accelerate launch`` would give the ranks (:mod:`.accelerate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ConfigError
from .dssources import Filler, has_auto, who_fills
from .files import read_deepspeed_config

if TYPE_CHECKING:  # (imported where used: a job without a DeepSpeed or Accelerate config needs neither, ~25 ms)
    from .accelerate import AccelerateConfig
    from .accelerate_settings import AccelerateSettings
    from .dsconfig import DeepSpeedSettings, ResolvedConfig, RunFacts

__all__ = ["JobDeepSpeed", "job_deepspeed"]

_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size")


@dataclass(frozen=True)
class JobDeepSpeed:
    """A job's DeepSpeed config and Accelerate environment, ready for the planner.

    Attributes:
        config: the resolved DeepSpeed config ({} when the job has none).
        warnings: notes on the Accelerate config and the resolution.
        accelerate: the job's Accelerate config, or None.
        flags: the spec's ``accelerate`` section.
        from_file: the DeepSpeed config is a file (the script gets ``ACCELERATE_DEEPSPEED_CONFIG_FILE``).
        workdir, pythonpath: for :meth:`env`.
        spec_env: names the spec's ``env`` sets: those win over the ``ACCELERATE_*`` variables
            (``PYTHONPATH`` is built from the spec's instead).
        autos: for a config of the spec's with "auto" values, who fills them and what is left
            "auto": ``{"filled_by": "orch" | "script", "why": ..., "left_auto": [key paths]}``; else None.
    """

    config: dict
    warnings: tuple[str, ...] = ()
    accelerate: AccelerateConfig | None = None
    flags: AccelerateSettings | None = None
    from_file: bool = False
    workdir: str = "."
    pythonpath: str | None = None
    spec_env: frozenset[str] = frozenset()
    autos: Mapping[str, Any] | None = None

    def env(self, config_path: str) -> dict[str, str]:
        """The ``ACCELERATE_*`` variables (and ``PYTHONPATH``) of every rank; {} without Accelerate.

        Args:
            config_path: where the resolved config is written for the ranks.
        """
        if self.accelerate is None:
            return {}
        env = self.accelerate.launch_env(self.flags, config_file=config_path if self.from_file else None,
                                         workdir=self.workdir, pythonpath=self.pythonpath)
        return {k: v for k, v in env.items() if k == "PYTHONPATH" or k not in self.spec_env}

    def env_defaults(self) -> dict[str, str]:
        """Set where a node lacks them: ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which ``accelerate
        launch`` has in its environment after importing DeepSpeed (``deepspeed/__init__.py``
        ``os.environ.setdefault``) and passes on to torchrun's workers."""
        return {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"} if self.accelerate is not None else {}


def job_deepspeed(spec: Any, slots_per_node: list[int] | tuple[int, ...],
                  controller_env: Mapping[str, str]) -> JobDeepSpeed:
    """Read a spec's DeepSpeed and Accelerate configs and resolve the DeepSpeed config for a world.

    Args:
        spec: the validated :class:`~orchestrator.spec.JobSpec`.
        slots_per_node: ranks per node, in node order (the planned pool's).
        controller_env: the controller's environment (``PYTHONPATH`` for the ranks).

    Returns:
        The :class:`JobDeepSpeed`.

    Raises:
        ConfigError: a config cannot be read or resolved (every problem listed).
        SpecError: the DeepSpeed config file is missing or not JSON.
    """
    user = read_deepspeed_config(spec.deepspeed_config)
    acc = None
    if spec.accelerate_config is not None:
        from .accelerate import load_accelerate_config
        base = spec.workdir if isinstance(spec.accelerate_config, Mapping) else "."
        acc = load_accelerate_config(spec.accelerate_config, base,
                                     config_file=spec.deepspeed_config if isinstance(spec.deepspeed_config, str)
                                     else ("<inline>" if spec.deepspeed_config is not None else None))
    if acc is None and not user:
        return JobDeepSpeed({})
    from .dsconfig import DeepSpeedSettings, RunFacts, hidden_size_from_model_config, plugin_config
    hidden, source = spec.hidden_size, "hidden_size"
    if hidden is None and spec.model_config_path:
        hidden, source = (hidden_size_from_model_config(spec.model_config_path),
                          f"model_config {spec.model_config_path}")
    run = RunFacts(world_size=sum(slots_per_node), slots_per_node=tuple(slots_per_node),
                   micro_batch_size=spec.micro_batch_size, hidden_size=hidden, hidden_size_source=source)
    where = spec.deepspeed_config if isinstance(spec.deepspeed_config, str) else "(inline in the job spec)"
    filler = _filler(spec, user)
    if acc is None:
        resolved = _resolve(user, DeepSpeedSettings(), run, filler, accelerate=False, source=f"DeepSpeed config {where}")
        return JobDeepSpeed(resolved.config, resolved.warnings, autos=_autos(filler, resolved))
    settings = acc.settings(spec.accelerate)
    from_file = spec.deepspeed_config is not None
    base_config = user if from_file else plugin_config(settings)
    what = f"DeepSpeed config {where}" if from_file else \
        f"DeepSpeed config built from Accelerate config {acc.source}"
    if not from_file or (filler is not None and filler.filled_by == "orch" and spec.deepspeed_config_filled_by == "auto"):
        filler = _accelerate_fills(spec, from_file)
    resolved = _resolve(base_config, settings, run, filler, accelerate=True, from_file=from_file, source=what)
    pythonpath = spec.env.get("PYTHONPATH", controller_env.get("PYTHONPATH"))
    return JobDeepSpeed(resolved.config, tuple(acc.notes()) + resolved.warnings, acc, spec.accelerate, from_file,
                        spec.workdir, pythonpath, frozenset(spec.env), _autos(filler, resolved))


def _accelerate_fills(spec: Any, from_file: bool) -> Filler | None:
    """Who fills the "auto" values of a config Accelerate reads (an Accelerate job whose spec does not say
    who fills them, and whose script orch did not find to fill them itself): orch where the spec gives the
    micro batch or the hidden size, else the script's Accelerate, which fills them in ``accelerator.prepare()`` from the
    DataLoader and the model (``Accelerator._prepare_deepspeed``), as under ``accelerate launch``,
    which never asks for the micro batch. Accelerate alone reads the config (through
    ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` or, without a file, the ``ACCELERATE_*`` settings)."""
    if (spec.micro_batch_size, spec.hidden_size, spec.model_config_path) != (None, None, None):
        return None
    what = "the DeepSpeed config file of an Accelerate job" if from_file else "built from an Accelerate config"
    return Filler("script", "accelerate", f"{what}: Accelerate fills its \"auto\" values in the script's "
                                          "accelerator.prepare() (micro_batch_size or hidden_size makes orch fill them)")


def _filler(spec: Any, user: Mapping[str, Any]) -> Filler | None:
    """Who fills the "auto" values of the spec's own config (``deepspeed_config_filled_by``); None
    where it has none (orch resolves it as always)."""
    if not user or not has_auto(user):
        return None
    return who_fills(spec.deepspeed_config_filled_by, spec.entrypoint, module=spec.module,
                     no_python=spec.no_python, args=spec.args)


def _resolve(config: Mapping[str, Any], settings: DeepSpeedSettings, run: RunFacts, filler: Filler | None,
             **kw: Any) -> ResolvedConfig:
    """:func:`~.dsconfig.resolve` as ``filler`` says; an "auto" orch refuses gets a hint of
    ``deepspeed_config_filled_by``, and why orch was to fill it. Under the script, a micro batch or
    hidden size the spec gives for keys the script fills is reported unused."""
    from .dsconfig import ACCELERATE_KEYS, HF_TRAINER_KEYS, HIDDEN_SIZE_KEYS, resolve
    if filler is None or filler.filled_by == "orch":
        try:
            return resolve(config, settings, run, **kw)
        except ConfigError as err:
            if filler is None or not any('is "auto"' in msg for _, msg in err.problems):
                raise
            raise ConfigError(f"{err}\n(\"auto\" values are filled by orch: {filler.why}. If the script fills them "
                              "itself, as the HF Trainer or Accelerate does, set deepspeed_config_filled_by: script "
                              "in the job spec)", path=err.path, problems=err.problems) from err
    keys = ACCELERATE_KEYS if filler.library == "accelerate" else HF_TRAINER_KEYS
    resolved = resolve(config, settings, run, filled_by="script", script_keys=keys, **kw)
    unused = [f"{name} is not used: the script fills {', '.join(left)} itself" for name, value, left in (
        ("micro_batch_size", run.micro_batch_size, [k for k in _BATCH_KEYS if k in resolved.left_auto]),
        (run.hidden_size_source, run.hidden_size, [k for k in HIDDEN_SIZE_KEYS if k in resolved.left_auto]))
        if value is not None and left]
    return dataclasses.replace(resolved, warnings=resolved.warnings + tuple(unused))


def _autos(filler: Filler | None, resolved: ResolvedConfig) -> dict[str, Any] | None:
    if filler is None:
        return None
    return {"filled_by": filler.filled_by, "why": filler.why, "left_auto": list(resolved.left_auto)}

