"""One call per optimizer step to report a rank's training metrics to orch.

Usage in a training script::

    from agents import report

    report.step(step, loss=loss.item(), samples=batch, tokens=batch * seq_len, lr=lr, total_steps=steps)

What it does with a step (see docs/metrics.md for every name):

* updates the rank's Prometheus series (``orch_rank_step``, ``orch_rank_loss``, ...) in
  prometheus_client's multiprocess mode, in the scratch directory the agent gave the
  rank (``PROMETHEUS_MULTIPROC_DIR``); the agent serves them on its ``/metrics``;
* appends one JSON line to ``$ORCH_REPORT_FILE``, which the agent reads and forwards to
  the controller (``orch status``, the dashboard's charts).

Outside orch (no ``ORCH_JOB_ID``), ``step`` does nothing. It never raises: a failure to
report is printed once to stderr and training goes on. A step costs a few microseconds
(a file append and a handful of mmap writes).

The duration of a step is the time since the previous call (the first call has none),
unless ``step_seconds`` is given.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

__all__ = ["step", "STEP_BUCKETS"]

#: Buckets of ``orch_rank_step_duration_seconds`` (seconds): 1 ms to 2 min.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

_state: dict[str, Any] = {}


def _init() -> dict[str, Any] | None:
    """Metrics and labels of this rank, made once; None outside orch."""
    if "ready" in _state:
        return _state["ready"]
    env = os.environ
    if not env.get("ORCH_JOB_ID"):
        _state["ready"] = None
        return None
    labels = {"job": env["ORCH_JOB_ID"], "attempt": env.get("ORCH_ATTEMPT", "1"),
              "node": env.get("ORCH_NODE", ""), "rank": env.get("RANK", "0")}
    ready: dict[str, Any] = {"labels": labels, "file": None, "metrics": None, "last": None}
    path = env.get("ORCH_REPORT_FILE")
    if path:
        ready["file"] = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the rank's life
    if env.get("PROMETHEUS_MULTIPROC_DIR"):  # this rank's children, looked up once
        ready["metrics"] = {k: m.labels(**labels) for k, m in _metrics(list(labels)).items()}
    _state["ready"] = ready
    return ready


def _metrics(names: list[str]) -> dict[str, Any]:
    """The rank's metrics; prometheus_client picks multiprocess values from the environment."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    reg = CollectorRegistry()  # never served from here: the agent serves the directory

    def gauge(name: str, doc: str, mode: str) -> Any:
        return Gauge(name, doc, names, registry=reg, multiprocess_mode=mode)
    return {
        "step": gauge("orch_rank_step", "the last optimizer step reported", "mostrecent"),
        "loss": gauge("orch_rank_loss", "the loss of the last step", "mostrecent"),
        "lr": gauge("orch_rank_learning_rate", "the learning rate of the last step", "mostrecent"),
        "at": gauge("orch_rank_last_step_timestamp_seconds", "when the last step was reported", "mostrecent"),
        "sps": gauge("orch_rank_samples_per_second", "samples of the last step / its duration", "livemostrecent"),
        "tps": gauge("orch_rank_tokens_per_second", "tokens of the last step / its duration", "livemostrecent"),
        "samples": Counter("orch_rank_samples", "samples this rank processed", names, registry=reg),
        "tokens": Counter("orch_rank_tokens", "tokens this rank processed", names, registry=reg),
        "duration": Histogram("orch_rank_step_duration_seconds", "time between two reported steps", names,
                              registry=reg, buckets=STEP_BUCKETS),
    }


def step(step: int, *, loss: float | None = None, samples: float | None = None, tokens: float | None = None,
         lr: float | None = None, step_seconds: float | None = None, final: bool = False,
         total_steps: int | None = None, compute_seconds: float | None = None) -> None:
    """Report one optimizer step of this rank.

    Args:
        step: the global step just completed (1-based, as the script counts it).
        loss: the step's loss on this rank (a float; NaN and inf are kept as they are).
        samples: samples this rank processed in the step.
        tokens: tokens this rank processed in the step.
        lr: the learning rate used.
        step_seconds: the step's duration (default: time since the previous call).
        final: this is the rank's last step: orch's hang watch stops watching the rank, so a long
            exit (a final save, an upload at exit) is not taken for a hang.
        total_steps: the step the run ends at, when the script knows it: the job list shows an ETA from it
            and the recent step rate (orch has no other way to know a run's length).
        compute_seconds: the part of the step this rank spent on its own work before it entered the
            step's collectives (seconds). Ranks that wait for each other every step all take the
            slowest one's wall time; this is what tells orch's straggler detector which rank is slow
            (the spec's ``straggler`` section; without it the detector judges ``step_seconds``).
    """
    try:
        _report(int(step), loss, samples, tokens, lr, step_seconds, final, total_steps, compute_seconds)
    except Exception as err:  # noqa: BLE001 - reporting must never stop training
        if not _state.get("warned"):
            _state["warned"] = True
            print(f"orch report: cannot report step {step}: {err!r} (further failures are not shown)",
                  file=sys.stderr)


def _report(step_no: int, loss: float | None, samples: float | None, tokens: float | None, lr: float | None,
            step_seconds: float | None, final: bool = False, total_steps: int | None = None,
            compute_seconds: float | None = None) -> None:
    ready = _init()
    if ready is None:
        return
    now = time.time()
    if step_seconds is None and ready["last"] is not None:
        step_seconds = now - ready["last"]
    ready["last"] = now
    sps = samples / step_seconds if samples is not None and step_seconds else None
    tps = tokens / step_seconds if tokens is not None and step_seconds else None
    m = ready["metrics"]
    if m is not None:
        m["step"].set(step_no)
        m["at"].set(now)
        if loss is not None:
            m["loss"].set(float(loss))
        if lr is not None:
            m["lr"].set(float(lr))
        if samples is not None:
            m["samples"].inc(float(samples))
        if tokens is not None:
            m["tokens"].inc(float(tokens))
        if sps is not None:
            m["sps"].set(sps)
        if tps is not None:
            m["tps"].set(tps)
        if step_seconds is not None:
            m["duration"].observe(step_seconds)
    f = ready["file"]
    if f is not None:
        point = {"step": step_no, "at": now, "loss": _num(loss), "lr": _num(lr), "samples": _num(samples),
                 "tokens": _num(tokens), "step_seconds": _num(step_seconds), "samples_per_second": _num(sps),
                 "tokens_per_second": _num(tps), "final": True if final else None,
                 "total_steps": int(total_steps) if total_steps is not None else None,
                 "compute_seconds": _num(compute_seconds)}
        f.write(json.dumps({k: v for k, v in point.items() if v is not None}) + "\n")


def _num(value: Any) -> float | str | None:
    """A JSON-safe number: NaN and inf become the strings "nan", "inf", "-inf"."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)
