"""The spec's ``checkpoints`` section: which of a job's checkpoints orch keeps once newer ones are complete.
See docs/jobspec.md ("checkpoints") and docs/housekeeping.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

__all__ = ["CheckpointRetention"]


class CheckpointRetention(BaseModel):
    """Checkpoint retention (the spec's ``checkpoints`` section). Without ``keep_last`` every checkpoint is kept.

    Example::

        checkpoints: {keep_last: 2, keep_every: 1000}   # the 2 newest complete ones, and steps 1000, 2000, ...

    Attributes:
        keep_last: keep the newest N complete checkpoints; older ones (complete or not) are deleted by the
            controller once a newer checkpoint is complete. None: keep everything.
        keep_every: also keep every complete checkpoint whose step is a multiple of K (needs ``keep_last``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    keep_last: StrictInt | None = Field(None, ge=1, le=1_000_000, description="Keep the newest N complete "
                                        "checkpoints, delete older ones; null: keep every checkpoint.")
    keep_every: StrictInt | None = Field(None, ge=1, description="Also keep each complete checkpoint whose step "
                                         "is a multiple of K (needs keep_last).")

    @model_validator(mode="after")
    def _every_needs_last(self) -> "CheckpointRetention":
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError("keep_every only spares checkpoints keep_last would delete: set keep_last too "
                             "(without it every checkpoint is kept)")
        return self

    @property
    def prunes(self) -> bool:
        """Whether any checkpoint may be deleted (``keep_last`` is set)."""
        return self.keep_last is not None
