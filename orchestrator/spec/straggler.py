"""The spec's ``straggler`` section: when a rank counts as a straggler, and what orch does then
(docs/jobspec.md, "straggler"; the detector is orchestrator/supervision/stragglers.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["StragglerOptions"]


class StragglerOptions(BaseModel):
    """Straggler detection (the spec's ``straggler`` section).

    A rank is a straggler when its per-step time (the ``compute_seconds`` it reports, else its
    ``step_seconds``) stays above ``(1 + threshold)`` times the median of the other ranks' recent
    times, and above it by at least ``min_excess_seconds``, for ``window_steps`` steps in a row. It
    stops being one after ``window_steps`` steps in a row within the threshold.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Watch for stragglers (needs 2 ranks or more that report steps).")
    threshold: float = Field(0.2, gt=0, le=100, description="How far above the other ranks' median step time a "
                             "rank must be (0.2: 20% over).")
    window_steps: int = Field(20, ge=2, le=100_000, description="Steps in a row over the threshold before a rank "
                              "is flagged (and within it before the flag is lifted).")
    min_excess_seconds: float = Field(0.01, ge=0, le=3600, description="The least excess over the median (seconds) "
                                      "that counts: jitter of millisecond steps is no straggler.")
    on_straggler: Literal["warn", "exclude_on_restart"] = Field("warn", description="warn: a `straggler` event and "
                                                                "metric; exclude_on_restart: also leave the "
                                                                "straggler's node out of the job's next restart.")
