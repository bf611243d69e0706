"""The job spec's ``accelerate`` section (:class:`AccelerateSettings`: ``accelerate launch``'s DeepSpeed flags),
apart from the rules for Accelerate config files (``orchestrator.spec.accelerate``), which a spec without an
``accelerate_config`` never needs: ``orch plan`` of such a spec does without importing them (~25 ms).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AccelerateSettings"]

_Device = Literal["none", "cpu", "nvme"]
_Precision = Literal["no", "fp16", "bf16", "fp8"]


class AccelerateSettings(BaseModel):
    """The job spec's ``accelerate`` section: ``accelerate launch``'s DeepSpeed flags.

    Each field, when set, wins over the same key of the Accelerate config file, as a flag of
    ``accelerate launch`` wins over its ``--config_file`` (and, like a flag, does not count
    for the ambiguity rule). Unset fields take the file's value, then Accelerate's default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mixed_precision: _Precision | None = Field(None, description="no | fp16 | bf16 | fp8 (--mixed_precision).")
    zero_stage: int | None = Field(None, ge=0, le=3, description="ZeRO stage 0-3 (--zero_stage).")
    gradient_accumulation_steps: int | None = Field(None, ge=1, description="--gradient_accumulation_steps.")
    gradient_clipping: float | None = Field(None, ge=0, description="--gradient_clipping.")
    offload_optimizer_device: _Device | None = Field(None, description="--offload_optimizer_device.")
    offload_param_device: _Device | None = Field(None, description="--offload_param_device.")
    offload_optimizer_nvme_path: str | None = Field(None, description="--offload_optimizer_nvme_path.")
    offload_param_nvme_path: str | None = Field(None, description="--offload_param_nvme_path.")
    zero3_init_flag: bool | None = Field(None, description="--zero3_init_flag.")
    zero3_save_16bit_model: bool | None = Field(None, description="--zero3_save_16bit_model.")
    deepspeed_moe_layer_cls_names: str | None = Field(None, description="--deepspeed_moe_layer_cls_names.")

    def given(self) -> dict[str, Any]:
        """The fields that are set."""
        return {k: v for k, v in self.model_dump().items() if v is not None}
