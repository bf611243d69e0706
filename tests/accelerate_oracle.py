"""Accelerate 1.15 itself as the oracle for orch's Accelerate support (used by the tests).

* :func:`accelerate_launch`: what ``accelerate launch --config_file X [flags] train.py --x`` prepares,
  by Accelerate's own code run in this process (``launch_command_parser``,
  ``_validate_launch_command``, ``prepare_deepspeed_cmd_env``), nothing started;
* :func:`accelerate_ds_config`: the DeepSpeed config a script's Accelerate ends up with, given the
  ``ACCELERATE_*`` variables it was started with (``DeepSpeedPlugin``, ``set_mixed_precision``, then
  ``Accelerator._prepare_deepspeed``'s fills). ``Accelerator.prepare`` itself cannot run here:
  Accelerate 1.15 needs transformers for it, and runs DeepSpeed only on an accelerator device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["accelerate_launch", "accelerate_ds_config", "printless"]


def accelerate_launch(config: Path, flags: dict, cwd: Path, monkeypatch) -> tuple[list[str] | None, dict[str, str]]:
    """What ``accelerate launch --config_file <config> <flags> train.py --x`` prepares (run in this
    process: Accelerate's own parsing and ``prepare_deepspeed_cmd_env``, nothing started): the
    command (multi-machine) or None (torchrun here), and the variables it adds or changes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env
    monkeypatch.chdir(cwd)
    argv = ["--config_file", str(config)]
    for k, v in flags.items():
        argv += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    args = launch_command_parser().parse_args(argv + ["train.py", "--x"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)  # as launch_command does
    cmd, env = prepare_deepspeed_cmd_env(args)
    return cmd, {k: v for k, v in env.items() if os.environ.get(k) != v}


def accelerate_ds_config(env: dict[str, str], cwd: Path, monkeypatch, *, micro: int, world: int,
                         hidden: int | None = None) -> dict:
    """The DeepSpeed config the script's Accelerate would end up with, given the ``ACCELERATE_*``
    variables ``env``: ``DeepSpeedPlugin()`` (as ``Accelerator()`` builds it), ``set_mixed_precision``
    (``AcceleratorState``), then the fills of ``Accelerator._prepare_deepspeed`` with a DataLoader
    of batch size ``micro``, the script's default accumulation (1) and a model of ``hidden``. The
    script's DummyOptim/DummyScheduler values are passed as "auto" (orch leaves those to the script)."""
    from accelerate.utils import DeepSpeedPlugin
    with monkeypatch.context() as m:
        for k in [k for k in os.environ if k.startswith("ACCELERATE_")]:
            m.delenv(k)
        for k, v in env.items():
            if k.startswith("ACCELERATE_"):
                m.setenv(k, v)
        m.chdir(cwd)
        plugin = DeepSpeedPlugin()
        plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
        plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=1)
        kwargs = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
                  "optimizer.params.lr": "auto", "optimizer.params.weight_decay": "auto",
                  "scheduler.params.warmup_min_lr": "auto", "scheduler.params.warmup_max_lr": "auto",
                  "scheduler.params.warmup_num_steps": "auto", "scheduler.params.total_num_steps": "auto"}
        if not plugin.is_auto("train_micro_batch_size_per_gpu"):
            micro = plugin.get_value("train_micro_batch_size_per_gpu")
        kwargs["train_micro_batch_size_per_gpu"] = micro
        kwargs["train_batch_size"] = micro * plugin.get_value("gradient_accumulation_steps") * world
        if hidden:
            kwargs.update({"zero_optimization.reduce_bucket_size": hidden * hidden,
                           "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                           "zero_optimization.stage3_param_persistence_threshold": 10 * hidden})
        plugin.deepspeed_config_process(must_match=False, **kwargs)
        config = json.loads(json.dumps(plugin.deepspeed_config))
    config.pop("steps_per_print")  # Accelerate sets inf in the script (it stops DeepSpeed's logging)
    return config


def printless(config: dict) -> dict:
    """``config`` without ``steps_per_print``, which the script's Accelerate replaces by inf whatever
    the file says (orch keeps the file's value)."""
    return {k: v for k, v in config.items() if k != "steps_per_print"}
