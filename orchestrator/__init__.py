"""orch: cluster job orchestration for DeepSpeed ZeRO training."""

__version__ = "0.1.0"
