"""The spec's ``resume`` section: where a job's checkpoints are, in which format, and how a resumed
script is told which one to load. See docs/jobspec.md ("resume") and docs/contract.md.
"""

from __future__ import annotations

import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ResumeOptions", "FORMATS", "PLACEHOLDERS", "HASH_MODES"]

#: Checkpoint formats orch reads (``orchestrator.checkpoints.formats``); ``auto`` detects one.
FORMATS = ("auto", "orch", "deepspeed", "hf_trainer", "accelerate")
#: What ``resume.args`` may name: the checkpoint's directory, its tag (directory name), the
#: directory the tags are in, and the step it saved (-1 when unknown).
PLACEHOLDERS = ("checkpoint", "tag", "dir", "step")
#: How each checkpoint file is hashed into the job's manifest (``agents.manifest``).
HASH_MODES = ("auto", "full", "sampled", "off")


class ResumeOptions(BaseModel):
    """How orch resumes the job (the spec's ``resume`` section).

    Attributes:
        format: the checkpoints' format; ``auto`` (default) detects it in ``dir``: orch's marker
            wins, then HF Trainer's ``checkpoint-<N>``, Accelerate's ``checkpoint_<N>`` (or a
            ``save_state`` directory itself), then DeepSpeed's tag directories.
        dir: the directory the checkpoints are in (relative paths: to the spec's file); default
            ``checkpoint_dir`` (or the job's own directory under the state dir).
        args: appended to the entrypoint's arguments on a resumed attempt, each with the
            placeholders of :data:`PLACEHOLDERS` filled (``["--resume_from_checkpoint",
            "{checkpoint}"]``); default: that for ``hf_trainer``, nothing for the others.
        env: the name of a variable set to the checkpoint's directory on a resumed attempt (every
            resumed rank also gets ``ORCH_RESUME_CHECKPOINT`` and ``ORCH_RESUME_TAG``).
        latest: rewrite DeepSpeed's ``latest`` file (``<dir>/latest``) to name the chosen tag before
            a resumed attempt, so a script that calls ``engine.load_checkpoint(dir)`` with no tag loads
            it; only when ``latest`` names another tag, atomically; default: true for the
            ``deepspeed`` format, false for the others.
        hash: how the agents hash each checkpoint file into the manifest: ``full`` (every byte),
            ``sampled`` (size plus evenly spaced 1 MiB blocks), ``off`` (sizes only), ``auto``
            (full up to ``sample_above_mib``, sampled above).
        sample_above_mib: the file size above which ``auto`` samples.
        watch_seconds: how often the agents look for new checkpoint files.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["auto", "orch", "deepspeed", "hf_trainer", "accelerate"] = Field(
        "auto", description="Checkpoint format: auto (detect), orch, deepspeed, hf_trainer, accelerate.")
    dir: str | None = Field(None, description="Where the checkpoints are; default checkpoint_dir.")
    args: list[str] | None = Field(None, description="Arguments added on a resumed attempt, with {checkpoint}, "
                                   "{tag}, {dir}, {step} filled; default for hf_trainer: "
                                   "[--resume_from_checkpoint, \"{checkpoint}\"].")
    env: str | None = Field(None, description="A variable set to the checkpoint's directory on a resumed attempt.")
    latest: bool | None = Field(None, description="Point DeepSpeed's `latest` file at the chosen tag; default: "
                                "true for the deepspeed format.")
    hash: Literal["auto", "full", "sampled", "off"] = Field(
        "auto", description="How checkpoint files are hashed into the manifest: auto, full, sampled, off.")
    sample_above_mib: float = Field(1024.0, gt=0, description="auto hashes files up to this size in full, "
                                    "larger ones sampled.")
    watch_seconds: float = Field(5.0, ge=0.5, le=3600, description="How often the agents look for new "
                                 "checkpoint files.")

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str] | None) -> list[str] | None:
        for arg in v or []:
            try:
                fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(arg) if name is not None]
            except ValueError as err:
                raise ValueError(f"{arg!r} is not a valid template ({err}); write {{{{ and }}}} for braces") from None
            if any(spec or conv for _, spec, conv in fields):
                raise ValueError(f"{arg!r}: a placeholder takes no conversion or format (write {{checkpoint}}, not "
                                 "{checkpoint!r} or {step:d})")
            names = [name for name, _, _ in fields]
            unknown = [n for n in names if n not in PLACEHOLDERS]
            if unknown:
                raise ValueError(f"{arg!r} names {{{unknown[0]}}}; the placeholders are "
                                 + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: str | None) -> str | None:
        if v is not None and (not v or not (v[0].isalpha() or v[0] == "_")
                              or not all(c.isalnum() or c == "_" for c in v)):
            raise ValueError(f"expected an environment variable name (letters, digits, '_'); got {v!r}")
        return v

    def resume_args(self, fmt: str) -> list[str]:
        """The argument template for a checkpoint of format ``fmt`` (the spec's, or the format's default)."""
        if self.args is not None:
            return list(self.args)
        return ["--resume_from_checkpoint", "{checkpoint}"] if fmt == "hf_trainer" else []

    def rewrites_latest(self, fmt: str) -> bool:
        """Whether DeepSpeed's ``latest`` is pointed at the chosen tag for a checkpoint of format ``fmt``."""
        return self.latest if self.latest is not None else fmt == "deepspeed"
