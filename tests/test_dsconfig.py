"""DeepSpeed config resolution (orchestrator.spec.dsconfig): every "auto" filled as Accelerate fills it,
and every rule checked, each with a failing and a passing case. Pure: no processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.spec.dsconfig import (ACCELERATE_KEYS, DeepSpeedSettings, RunFacts, check,
                                        hidden_size_from_model_config, plugin_config, resolve)
from conftest import cli
from orchestrator.errors import ConfigError, SpecError

RUN = RunFacts(world_size=4, slots_per_node=(2, 2), micro_batch_size=8)
DEFAULTS = DeepSpeedSettings()  # nothing given: Accelerate's defaults


def _problems(config, settings=DEFAULTS, run=RUN, accelerate=True, from_file=True, **kw) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        resolve(config, settings, run, accelerate=accelerate, from_file=from_file, source="ds.json", **kw)
    assert isinstance(err.value, SpecError)  # the CLI prints it, exit status 2, no traceback
    problems = dict(err.value.problems)
    for key, msg in problems.items():  # one line per problem, by key path, in the message
        assert f"  {key}: {msg}" in str(err.value)
    return problems


def _zero(stage=2, **more):
    return {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage, **more}}


# ---------------------------------------------------------------------------------- building and autos


def test_plugin_config_is_accelerates_default_config() -> None:
    # DeepSpeedPlugin.__post_init__ without a config file and with nothing set
    assert plugin_config(DeepSpeedSettings()) == {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "nvme_path": None},
                              "offload_param": {"device": "none", "nvme_path": None},
                              "stage3_gather_16bit_weights_on_model_save": False},
        "gradient_clipping": "auto"}
    nvme = plugin_config(DeepSpeedSettings(zero_stage=3, offload_param_device="nvme", offload_param_nvme_path="/nv",
                                           offload_optimizer_nvme_path="/unused", gradient_clipping=0.0))
    assert nvme["zero_optimization"]["offload_param"] == {"device": "nvme", "nvme_path": "/nv"}
    assert nvme["zero_optimization"]["offload_optimizer"] == {"device": "none", "nvme_path": None}
    assert "gradient_clipping" not in nvme  # 0.0 is falsy: Accelerate leaves the key out


def test_every_auto_is_filled_from_settings_and_run() -> None:
    config = {"bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
                                    "offload_optimizer": {"device": "auto", "nvme_path": "auto"},
                                    "offload_param": {"device": "auto"}, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"},
              "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "steps_per_print": 2000000}
    settings = DeepSpeedSettings(mixed_precision="fp16", zero_stage=3, gradient_accumulation_steps=5,
                                 gradient_clipping=1.0, offload_param_device="cpu", offload_optimizer_device="nvme",
                                 offload_optimizer_nvme_path="/nvme", zero3_save_16bit_model=True)
    run = RunFacts(world_size=4, slots_per_node=(4,), micro_batch_size=2, hidden_size=1024)
    out = resolve(config, settings, run, accelerate=True)
    assert out.config == {
        "bf16": {"enabled": False}, "fp16": {"enabled": True, "auto_cast": True},
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                              "offload_param": {"device": "cpu"}, "reduce_bucket_size": 1024 * 1024,
                              "stage3_prefetch_bucket_size": int(0.9 * 1024 * 1024),
                              "stage3_param_persistence_threshold": 10 * 1024},
        "gradient_clipping": 1.0, "train_batch_size": 2 * 5 * 4, "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 5, "steps_per_print": 2000000}
    assert out.warnings == () and out.left_auto == ()
    assert config["zero_optimization"]["stage"] == "auto"  # the input is not modified


def test_accelerate_defaults_fill_autos_nothing_sets() -> None:
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
              "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": "auto"},
              "fp16": {"enabled": "auto"}}
    out = resolve(config, DeepSpeedSettings(), RUN, accelerate=False).config
    assert out == {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 32, "gradient_clipping": 1.0,
                   "gradient_accumulation_steps": 1, "fp16": {"enabled": False},
                   "zero_optimization": {"stage": 2, "stage3_gather_16bit_weights_on_model_save": False}}


def test_a_setting_the_config_overrides_is_reported() -> None:
    settings = DeepSpeedSettings(zero_stage=3, explicit=frozenset({"zero_stage"}))
    out = resolve(_zero(2), settings, RUN, accelerate=True)
    assert out.config["zero_optimization"]["stage"] == 2  # Accelerate keeps the config's value
    assert any("zero_stage 3 is not used" in w and "zero_optimization.stage" in w for w in out.warnings)
    quiet = resolve(_zero(2), DeepSpeedSettings(zero_stage=2, explicit=frozenset({"zero_stage"})), RUN,
                    accelerate=True)
    assert not quiet.warnings


def test_micro_batch_auto_without_a_micro_batch_names_both_keys() -> None:
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "zero_optimization": {}}
    problems = _problems(config, run=RunFacts(world_size=2))
    assert set(problems) == {"train_micro_batch_size_per_gpu", "train_batch_size"}
    assert "micro_batch_size" in problems["train_micro_batch_size_per_gpu"]
    assert "DataLoader" in problems["train_micro_batch_size_per_gpu"]
    ok = resolve(config, DeepSpeedSettings(), RunFacts(world_size=2, micro_batch_size=3), accelerate=True)
    assert ok.config["train_batch_size"] == 6 and ok.config["train_micro_batch_size_per_gpu"] == 3


def test_train_batch_auto_from_a_numeric_micro_batch() -> None:
    config = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": "auto", "gradient_accumulation_steps": 3,
              "zero_optimization": {"stage": 1}}
    assert resolve(config, DeepSpeedSettings(), RunFacts(world_size=5), accelerate=True).config["train_batch_size"] == 60


def test_hidden_size_autos_need_a_hidden_size() -> None:
    config = _zero(3, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                   stage3_param_persistence_threshold="auto")
    problems = _problems(config)
    assert set(problems) == {"zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                             "zero_optimization.stage3_param_persistence_threshold"}
    assert all("hidden_size or model_config" in m for m in problems.values())
    out = resolve(config, DeepSpeedSettings(), RunFacts(world_size=4, micro_batch_size=8, hidden_size=10),
                  accelerate=True).config["zero_optimization"]
    assert (out["reduce_bucket_size"], out["stage3_prefetch_bucket_size"],
            out["stage3_param_persistence_threshold"]) == (100, 90, 100)


def test_hidden_size_from_a_model_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 768, "hidden_sizes": [1, 2]}))
    assert hidden_size_from_model_config(tmp_path) == 768  # a folder: its config.json; hidden_size first
    sizes = tmp_path / "convnext.json"
    sizes.write_text(json.dumps({"hidden_sizes": [96, 192, 384, 768]}))
    assert hidden_size_from_model_config(sizes) == 768  # else the largest of hidden_sizes
    none = tmp_path / "none.json"
    none.write_text(json.dumps({"vocab_size": 5}))
    with pytest.raises(ConfigError, match="neither a positive hidden_size nor hidden_sizes.*set hidden_size"):
        hidden_size_from_model_config(none)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        hidden_size_from_model_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        hidden_size_from_model_config(tmp_path / "missing.json")


def test_optimizer_and_scheduler_autos_are_the_scripts_under_accelerate_only() -> None:
    config = {**_zero(2), "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}
    out = resolve(config, DeepSpeedSettings(), RUN, accelerate=True)
    assert out.left_auto == ("optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.warmup_max_lr",
                             "scheduler.params.warmup_num_steps")
    assert out.config["optimizer"]["params"]["lr"] == "auto"
    assert any("DummyOptim" in w for w in out.warnings)
    problems = _problems(config, accelerate=False)
    assert set(problems) == set(out.left_auto) and "Write the value" in problems["optimizer.params.lr"]


def test_an_auto_nothing_fills_is_an_error() -> None:
    problems = _problems({**_zero(2, sub_group_size="auto"), "optimizer": {"params": {"betas": "auto"}}})
    assert set(problems) == {"zero_optimization.sub_group_size", "optimizer.params.betas"}
    assert "nothing fills this key" in problems["zero_optimization.sub_group_size"]


def test_accelerate_needs_a_zero_section_in_a_config_file() -> None:
    problems = _problems({"train_micro_batch_size_per_gpu": 1})
    assert set(problems) == {"zero_optimization"} and "Please specify the ZeRO" in problems["zero_optimization"]
    # DeepSpeed itself does not need one, nor does a config Accelerate builds
    assert resolve({"train_micro_batch_size_per_gpu": 1}, DeepSpeedSettings(), RUN, accelerate=False).config == {
        "train_micro_batch_size_per_gpu": 1}
    built = resolve({"train_micro_batch_size_per_gpu": 1}, DeepSpeedSettings(), RUN, accelerate=True,
                    from_file=False).config
    assert built == {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": False}, "bf16": {"enabled": False}}


# ---------------------------------------------------------------------------------- the rules


def test_offload_param_needs_stage_3() -> None:
    problems = _problems(_zero(2, offload_param={"device": "cpu"}))
    assert list(problems) == ["zero_optimization.offload_param.device"]
    assert "only with ZeRO stage 3" in problems["zero_optimization.offload_param.device"]
    assert "zero_stage: 3" in problems["zero_optimization.offload_param.device"]
    resolve(_zero(3, offload_param={"device": "cpu"}), DeepSpeedSettings(), RUN, accelerate=True)
    resolve(_zero(2, offload_param={"device": "none"}, offload_optimizer={"device": "cpu"}), DeepSpeedSettings(),
            RUN, accelerate=True)


def test_nvme_offload_needs_a_path() -> None:
    config = _zero(3, offload_optimizer={"device": "nvme"}, offload_param={"device": "nvme", "nvme_path": "none"})
    problems = _problems(config)
    assert set(problems) == {"zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path"}
    assert "offload_optimizer_nvme_path" in problems["zero_optimization.offload_optimizer.nvme_path"]
    # the path given through the settings fills an "auto" nvme_path
    ok = _zero(3, offload_optimizer={"device": "nvme", "nvme_path": "auto"})
    out = resolve(ok, DeepSpeedSettings(offload_optimizer_nvme_path="/local_nvme"), RUN, accelerate=True)
    assert out.config["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/local_nvme"


def test_zero_plus_plus_needs_stage_3() -> None:
    zpp = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
    problems = _problems(_zero(2, **zpp))
    assert set(problems) == {f"zero_optimization.{k}" for k in zpp}
    assert all("ZeRO++" in m for m in problems.values())
    resolve(_zero(3, **zpp), DeepSpeedSettings(), RUN, accelerate=True)
    resolve(_zero(2, zero_quantized_weights=False, zero_hpz_partition_size=1), DeepSpeedSettings(), RUN,
            accelerate=True)


def test_hpz_partition_size_divides_the_gpus_per_node() -> None:
    run = RunFacts(world_size=8, slots_per_node=(4, 4), micro_batch_size=1)
    problems = _problems(_zero(3, zero_hpz_partition_size=3), run=run)
    assert list(problems) == ["zero_optimization.zero_hpz_partition_size"]
    assert "3 does not divide the world size 8; DeepSpeed refuses it" in \
        problems["zero_optimization.zero_hpz_partition_size"]
    uneven = RunFacts(world_size=6, slots_per_node=(4, 2), micro_batch_size=1)  # 3 divides 6, not 4 or 2
    problems = _problems(_zero(3, zero_hpz_partition_size=3), run=uneven)
    assert "does not divide the GPUs per node (2, 4)" in problems["zero_optimization.zero_hpz_partition_size"]
    assert resolve(_zero(3, zero_hpz_partition_size=4), DeepSpeedSettings(), run, accelerate=True).warnings == ()
    warned = resolve(_zero(3, zero_hpz_partition_size=2), DeepSpeedSettings(), run, accelerate=True).warnings
    assert len(warned) == 1 and "meant to be the number of GPUs per node" in warned[0]


def test_a_scheduler_without_an_optimizer_is_a_warning() -> None:
    sched = {**_zero(2), "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    problems, warnings = check(sched, RUN)
    assert problems == [] and len(warnings) == 1 and "scheduler but no optimizer" in warnings[0]
    assert check({**sched, "optimizer": {"type": "AdamW"}}, RUN) == ([], [])


def test_fp16_and_bf16_both_on() -> None:
    problems = _problems({**_zero(2), "fp16": {"enabled": True}, "bf16": {"enabled": True}}, accelerate=False)
    assert list(problems) == ["bf16.enabled"] and "cannot be simultaneously enabled" in problems["bf16.enabled"]
    resolve({**_zero(2), "fp16": {"enabled": True}, "bf16": {"enabled": False}}, DeepSpeedSettings(), RUN,
            accelerate=False)


def test_mixed_precision_against_the_other_dtype_in_the_config() -> None:
    config = {**_zero(2), "bf16": {"enabled": True}}
    problems = _problems(config, DeepSpeedSettings(mixed_precision="fp16"))
    assert list(problems) == ["bf16.enabled"] and "set_mixed_precision" in problems["bf16.enabled"]
    out = resolve(config, DeepSpeedSettings(mixed_precision="bf16"), RUN, accelerate=True).config
    assert out["bf16"] == {"enabled": True} and out["fp16"] == {"enabled": False}


@pytest.mark.parametrize("config, world, ok", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, True),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, False),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, True),   # DeepSpeed derives accumulation 2
    ({"train_batch_size": 36, "train_micro_batch_size_per_gpu": 4}, 4, False),  # 36 // 4 // 4 = 2: 32 != 36
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 4, True),      # derives micro 2
    ({"train_batch_size": 6}, 4, False),                                        # micro 1: 4 != 6
    ({"train_batch_size": 2}, 4, False),                                        # micro 0
    ({"train_micro_batch_size_per_gpu": 4}, 4, True),
    ({"gradient_accumulation_steps": 4}, 4, False),                             # neither batch size
    ({"train_micro_batch_size_per_gpu": 0}, 4, False),
])
def test_batch_sizes_must_multiply_out(config, world, ok) -> None:
    problems, _ = check(config, RunFacts(world_size=world))
    assert (problems == []) == ok, problems
    if not ok:
        assert len(problems) == 1


def test_batch_mismatch_message_names_the_numbers() -> None:
    problems = _problems({**_zero(2), "train_batch_size": 30, "gradient_accumulation_steps": 2})
    assert "30 != train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 2 x world size 4" in \
        problems["train_batch_size"]


def test_stage_and_devices_are_checked() -> None:
    problems = _problems(_zero(5, offload_optimizer={"device": "disk"}))
    assert set(problems) == {"zero_optimization.stage", "zero_optimization.offload_optimizer.device"}
    problems = _problems({"train_micro_batch_size_per_gpu": 1, "zero_optimization": 2})
    assert list(problems) == ["zero_optimization"] and "must be a mapping" in problems["zero_optimization"]


def test_every_problem_is_listed_at_once() -> None:
    config = {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"},
                                                               "zero_quantized_weights": True}}
    with pytest.raises(ConfigError) as err:
        resolve(config, DeepSpeedSettings(), RUN, accelerate=False, source="DeepSpeed config ds.json")
    assert str(err.value).startswith("DeepSpeed config ds.json has 4 problems:\n")
    assert [k for k, _ in err.value.problems] == ["zero_optimization.offload_param.device",
                                                   "zero_optimization.zero_quantized_weights", "bf16.enabled",
                                                   "train_batch_size"]


def test_zero3_init_flag_outside_stage_3_is_a_warning() -> None:
    warned = resolve(_zero(2), DeepSpeedSettings(zero3_init_flag=True), RUN, accelerate=True).warnings
    assert any("zero3_init_flag" in w for w in warned)
    assert not resolve(_zero(3), DeepSpeedSettings(zero3_init_flag=True), RUN, accelerate=True).warnings


def test_the_guides_zero_plus_plus_example() -> None:
    """Accelerate guide: ZeRO++ with zero_hpz_partition_size 8, "ideally the GPUs per node" (8 here).
    The guide shows only the ZeRO section; the batch sizes are its other examples' "auto"."""
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "zero_quantized_weights": True,
                                    "zero_hpz_partition_size": 8, "zero_quantized_gradients": True,
                                    "contiguous_gradients": True, "overlap_comm": True}}

    def run(*slots: int) -> RunFacts:
        return RunFacts(world_size=sum(slots), slots_per_node=slots, micro_batch_size=1, hidden_size=64)
    out = resolve(config, DEFAULTS, run(8, 8), accelerate=True)
    assert out.warnings == () and out.config["zero_optimization"]["reduce_bucket_size"] == 4096
    assert out.config["train_batch_size"] == 16
    assert len(resolve(config, DEFAULTS, run(16), accelerate=True).warnings) == 1  # divides 16, is not 16
    assert list(_problems(config, run=run(4, 4))) == ["zero_optimization.zero_hpz_partition_size"]


# ---------------------------------------------------------------------------------- filled by the script

#: Hugging Face's ZeRO-2 example config for the Trainer (transformers docs, "DeepSpeed"): every value the
#: Trainer fills from its TrainingArguments is "auto".
HF_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_LEFT = ("fp16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
           "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
           "scheduler.params.warmup_num_steps", "zero_optimization.reduce_bucket_size",
           "gradient_accumulation_steps", "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu")


@pytest.mark.parametrize("accelerate", [False, True])
def test_an_hf_style_config_is_left_to_the_script_that_fills_it(accelerate) -> None:
    # HfTrainerDeepSpeedConfig.trainer_config_process fills these from TrainingArguments and refuses a value
    # that differs (fill_match, must_match): orch writes none of them, not even the micro batch it knows
    out = resolve(HF_AUTO, DEFAULTS, RUN, accelerate=accelerate, filled_by="script")
    assert out.config == HF_AUTO and out.left_auto == HF_LEFT and out.warnings == ()
    assert HF_AUTO["fp16"]["enabled"] == "auto"  # the input is not modified


def test_an_hf_style_config_is_refused_when_orch_fills_it() -> None:
    problems = _problems(HF_AUTO, accelerate=False)  # today's messages
    assert "nothing fills this key" in problems["optimizer.params.betas"]
    assert "nothing fills this key" in problems["optimizer.params.eps"]
    assert "DummyOptim" in problems["optimizer.params.lr"]
    assert "hidden_size or model_config" in problems["zero_optimization.reduce_bucket_size"]
    assert set(problems) == {"optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                             "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                             "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                             "zero_optimization.reduce_bucket_size"}  # RUN gives the micro batch
    assert _problems(HF_AUTO, accelerate=False, filled_by="orch") == problems


@pytest.mark.parametrize("change, key, words", [
    ({"stage": 7}, "zero_optimization.stage", "must be 0, 1, 2 or 3; got 7"),
    ({"offload_param": {"device": "cpu"}}, "zero_optimization.offload_param.device", "only with ZeRO stage 3"),
    ({"offload_optimizer": {"device": "disk"}}, "zero_optimization.offload_optimizer.device", "none, cpu, nvme"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "zero_optimization.offload_optimizer.nvme_path",
     "needs the directory"),
    ({"zero_quantized_weights": True}, "zero_optimization.zero_quantized_weights", "ZeRO++"),
])
def test_the_rules_still_apply_to_what_is_not_auto_under_the_script(change, key, words) -> None:
    config = {**HF_AUTO, "zero_optimization": {**HF_AUTO["zero_optimization"], **change}}
    problems = _problems(config, accelerate=False, filled_by="script")
    assert list(problems) == [key] and words in problems[key]


def test_batch_sizes_given_beside_autos_must_still_multiply_out() -> None:
    run = RunFacts(world_size=4, slots_per_node=(4,))
    problems = _problems({**HF_AUTO, "train_batch_size": 30}, run=run, accelerate=False, filled_by="script")
    assert list(problems) == ["train_batch_size"] and "not a multiple of 4" in problems["train_batch_size"]
    problems = _problems({**HF_AUTO, "train_batch_size": 36, "train_micro_batch_size_per_gpu": 2}, run=run,
                         accelerate=False, filled_by="script")
    assert "not a multiple of 8" in problems["train_batch_size"]
    ok = resolve({**HF_AUTO, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}, DEFAULTS, run,
                 accelerate=False, filled_by="script")
    assert ok.config["train_batch_size"] == 32 and "train_batch_size" not in ok.left_auto
    assert list(_problems({**HF_AUTO, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": 0},
                          accelerate=False, filled_by="script")) == ["train_micro_batch_size_per_gpu"]


def test_under_the_script_an_auto_nothing_fills_is_still_an_error() -> None:
    config = {**HF_AUTO, "zero_optimization": {**HF_AUTO["zero_optimization"], "sub_group_size": "auto"}}
    problems = _problems(config, accelerate=False, filled_by="script")
    assert list(problems) == ["zero_optimization.sub_group_size"]
    assert "neither orch nor the script fills it" in problems["zero_optimization.sub_group_size"]
    # a script on Accelerate without the Trainer: its DummyOptim gives lr and weight_decay, not Adam's betas/eps
    problems = _problems(HF_AUTO, accelerate=False, filled_by="script", script_keys=ACCELERATE_KEYS)
    assert set(problems) == {"optimizer.params.betas", "optimizer.params.eps"}


def test_under_the_script_orch_fills_only_the_zero_settings_it_gives_the_ranks() -> None:
    config = {**HF_AUTO, "zero_optimization": {"stage": "auto", "offload_param": {"device": "auto"},
                                               "stage3_gather_16bit_weights_on_model_save": "auto"}}
    settings = DeepSpeedSettings(zero_stage=3, offload_param_device="cpu", gradient_accumulation_steps=4,
                                 gradient_clipping=0.5, mixed_precision="bf16")
    out = resolve(config, settings, RUN, accelerate=True, filled_by="script")
    # DeepSpeedPlugin fills these from the ACCELERATE_DEEPSPEED_* variables orch sets on every rank
    assert out.config["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"},
                                               "stage3_gather_16bit_weights_on_model_save": False}
    # the Trainer fills accumulation, clipping and fp16 from its TrainingArguments before the plugin does
    assert out.config["gradient_accumulation_steps"] == "auto" and out.config["gradient_clipping"] == "auto"
    assert out.config["fp16"]["enabled"] == "auto" and "bf16" not in out.config
    # without an Accelerate config orch does not know the stage: it stays "auto", and the rules that need it wait
    out = resolve(config, DEFAULTS, RUN, accelerate=False, filled_by="script")
    assert out.config["zero_optimization"]["stage"] == "auto"
    assert {"zero_optimization.stage", "zero_optimization.offload_param.device"} <= set(out.left_auto)
    # the Trainer builds a DeepSpeedPlugin from its file too, which wants the ZeRO section
    no_zero = {k: v for k, v in HF_AUTO.items() if k != "zero_optimization"}
    problems = _problems(no_zero, accelerate=False, filled_by="script")
    assert list(problems) == ["zero_optimization"] and "Please specify the ZeRO" in problems["zero_optimization"]


@pytest.mark.parametrize("stage", [1, 2])
def test_nvme_optimizer_offload_below_stage_3_is_said_to_become_cpu_offload(stage) -> None:
    config = _zero(stage, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"})
    problems, warnings = check(config, RUN)
    assert problems == [] and len(warnings) == 1
    assert f"ZeRO stage is {stage}: DeepSpeed offloads the optimizer to CPU memory instead" in warnings[0]
    assert check(_zero(3, offload_optimizer={"device": "nvme", "nvme_path": "/nvme"}), RUN) == ([], [])
    assert check(_zero(stage, offload_optimizer={"device": "cpu"}), RUN) == ([], [])


def test_orch_plan_prints_its_warnings_before_the_plan(tmp_path) -> None:
    (tmp_path / "t.py").write_text("")
    (tmp_path / "ds.json").write_text(json.dumps(_zero(2, offload_optimizer={"device": "nvme", "nvme_path": "/n"})))
    (tmp_path / "job.yaml").write_text("name: t\nentrypoint: t.py\ndeepspeed_config: ds.json\n")
    r = cli("plan", str(tmp_path / "job.yaml"), env={**os.environ, "ORCH_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("warning: zero_optimization.offload_optimizer.device is \"nvme\"") and \
        "1 warning(s), shown above the plan" in r.stderr.splitlines()[-1]


def test_zero_plus_plus_values_as_deepspeed_takes_them() -> None:
    """DeepSpeedZeroConfig: zero_hpz_partition_size is an int >= 0 (0 and 1: off), the quantisation flags bools."""
    assert check(_zero(3, zero_hpz_partition_size=0), RUN) == ([], [])
    assert check(_zero(2, zero_hpz_partition_size=1, zero_quantized_gradients=False), RUN) == ([], [])
    problems = _problems(_zero(3, zero_hpz_partition_size=-1, zero_quantized_nontrainable_weights="yes"))
    assert set(problems) == {"zero_optimization.zero_hpz_partition_size",
                             "zero_optimization.zero_quantized_nontrainable_weights"}
    assert "whole number >= 0" in problems["zero_optimization.zero_hpz_partition_size"]
    assert "must be true or false; got 'yes'" in problems["zero_optimization.zero_quantized_nontrainable_weights"]
    assert list(_problems(_zero(1, zero_quantized_nontrainable_weights=True))) == [
        "zero_optimization.zero_quantized_nontrainable_weights"]


def test_quantized_gradients_on_nodes_of_different_sizes_is_a_warning() -> None:
    run = RunFacts(world_size=6, slots_per_node=(4, 2), micro_batch_size=1)
    problems, warnings = check(_zero(3, zero_quantized_gradients=True), run)
    assert problems == [] and len(warnings) == 1 and "_get_local_all_to_all_group" in warnings[0]
    assert check(_zero(3, zero_quantized_gradients=True), RUN) == ([], [])


def test_what_zero_plus_plus_needs_of_the_nodes() -> None:
    from orchestrator.spec.dszero import nvme_paths, quantized
    config = _zero(3, zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=2,
                   offload_param={"device": "nvme", "nvme_path": "/nvme/p"},
                   offload_optimizer={"device": "nvme", "nvme_path": "/nvme/o"})
    assert quantized(config) == ["zero_quantized_weights", "zero_quantized_gradients"]
    assert quantized(_zero(3, zero_hpz_partition_size=2)) == []  # hpZ alone runs on the CPU (no quantizer)
    assert nvme_paths(config) == [("offload_optimizer", "/nvme/o"), ("offload_param", "/nvme/p")]
    # stage 2 treats the nvme device as CPU offload: nothing is swapped to the path
    assert nvme_paths(_zero(2, offload_optimizer={"device": "nvme", "nvme_path": "/n"})) == []
    assert nvme_paths(_zero(3, offload_param={"device": "nvme", "nvme_path": "auto"})) == []  # the script fills it


def test_orch_plan_explains_the_zero_plus_plus_example(tmp_path) -> None:
    """examples/ds_zeropp.json on examples/quickstart.yaml's 2 nodes x 2 slots: accepted, and each option said."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    job = tmp_path / "job.yaml"
    job.write_text(f"name: zpp\nhostfile: {examples.parent / 'hostfiles' / 'local-2x2'}\nworkdir: {examples}\n"
                   f"entrypoint: train_gpt.py\ndeepspeed_config: {examples / 'ds_zeropp.json'}\n")
    r = cli("plan", str(job), env={**os.environ, "ORCH_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    out = r.stdout
    assert "ZeRO++ (extensions of ZeRO stage 3):" in out
    assert "zero_quantized_weights (qwZ): ZeRO-3's all-gather of each layer's weights sends them as int8" in out
    assert "zero_quantized_gradients (qgZ): gradients are reduced by an all-to-all of int4-quantized" in out
    assert "groups here: ranks 0-1 (node-0), ranks 2-3 (node-1)" in out
    assert "DeepSpeed has none for the CPU accelerator, so preflight refuses a node whose accelerator is cpu" in out
