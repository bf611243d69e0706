"""A job's progress in its line of the job list: step, loss, steps/s and ETA, read from the attempt's progress
row (``orchestrator.store.progress``) that the store keeps as steps are recorded; no log or point is read.

* ``step``: the least of the ranks' newest steps (the slowest rank's: a straggler holds it back);
* ``loss``: the newest loss of the lowest-numbered rank that reports one (rank 0's when it does), with the
  step it came with (``loss_step``);
* ``steps_per_second``: over about the last :data:`~orchestrator.store.progress.WINDOW_S` (30) seconds, not
  since the start: (newest step - the step at the window's start) / the seconds between them, on the
  controller's clock as the reports arrive (about once a second). A running job whose reports stopped for
  more than :data:`STALE_S` seconds counts the time since as time without steps, so a stalled job's rate
  falls towards 0;
* ``eta_seconds``: ``(total_steps - step) / steps_per_second`` when the total is known (a rank reported
  ``total_steps``) and the rate is above 0;
* ``total_steps``, ``progress_at`` (when the newest report was recorded).

Only a RUNNING job has a rate and an ETA; any other shows its current attempt's last step and loss. Fields a
job does not have (no step reported yet, no total) are None.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["progress_fields", "PROGRESS_KEYS", "STALE_S"]

#: The keys :func:`progress_fields` gives a job's summary.
PROGRESS_KEYS = ("step", "loss", "loss_step", "total_steps", "steps_per_second", "eta_seconds", "progress_at")
#: Seconds without a report after which a running job's rate counts the silence as time without steps.
STALE_S = 5.0
#: The shortest span (seconds) a rate is measured over.
MIN_SPAN_S = 1.0


def _loss(value: Any) -> float | str | None:
    """A loss for JSON: a finite float, or "nan"/"inf"/"-inf" (a diverged loss must not read as missing)."""
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else str(value)


def steps_per_second(samples: list[list[float]], now: float, running: bool) -> float | None:
    """The step rate over the samples' window (``[[at, step], ...]``, oldest first); None with fewer than two
    samples or a span under :data:`MIN_SPAN_S`. For a running job, reports older than :data:`STALE_S` make the
    span reach to ``now - STALE_S``."""
    if len(samples) < 2:
        return None
    (t0, s0), (t1, s1) = samples[0], samples[-1]
    end = max(t1, now - STALE_S) if running else t1
    if end - t0 < MIN_SPAN_S:
        return None
    return max(0.0, (s1 - s0) / (end - t0))


def progress_fields(summary: dict[str, Any] | None, running: bool, now: float) -> dict[str, Any]:
    """The job list's progress fields (:data:`PROGRESS_KEYS`) of a job from its current attempt's progress row
    (None: no step recorded yet), ``running``: the job is RUNNING, ``now``: the controller's clock."""
    out: dict[str, Any] = dict.fromkeys(PROGRESS_KEYS)
    if not summary or summary.get("step") is None:
        return out
    step, total = int(summary["step"]), summary.get("total_steps")
    out.update(step=step, loss=_loss(summary.get("loss")), loss_step=summary.get("loss_step"), total_steps=total,
               progress_at=summary.get("at"))
    if running:
        rate = steps_per_second(summary.get("samples") or [], now, running)
        out["steps_per_second"] = rate
        if total is not None and step >= total:
            out["eta_seconds"] = 0.0
        elif total is not None and rate:
            out["eta_seconds"] = (total - step) / rate
    return out
