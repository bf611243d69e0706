"""The controller's own Prometheus metrics and the Prometheus targets files of running attempts.

Metrics (docs/metrics.md, "Controller"): ``orch_jobs{state}`` is read from the store at
scrape time; the counters and histograms count what this controller process saw.
``orch_job_seconds{job, category}`` (docs/goodput.md): each job's wall time by goodput category, for every job
not yet terminal and the newest :data:`GOODPUT_JOBS` jobs, read from the store at scrape time.
``orch_job_state{job, name, state, cause, node}`` (1): each of those jobs' current state, for alert rules
(dashboards/orch-alerts.yml) that name the job.

Targets: one ``file_sd`` file per running attempt, ``<targets dir>/<job>.<attempt>.json``,
listing every node agent's exporter with the labels ``job``, ``attempt`` and ``node``
(Prometheus' file_sd format: a list of ``{"targets": ["host:port"], "labels": {...}}``).
Files are written atomically (a rename), so Prometheus never reads half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..store import JobState, Store

__all__ = ["ControllerMetrics", "TargetsWriter", "default_targets_dir"]

#: Buckets of orch_time_to_running_seconds (seconds).
START_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
#: Buckets of orch_failure_detection_seconds (seconds).
DETECT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 4, 5, 7.5, 10, 20, 30, 60)


class _JobsByState(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterable[Metric]:
        counts = {s.value: 0 for s in JobState}
        for state, n in self.store.count_by_state().items():
            counts[state] = n
        family = GaugeMetricFamily("orch_jobs", "jobs in the store by state", labels=["state"])
        for state, n in sorted(counts.items()):
            family.add_metric([state], n)
        yield family


#: The newest jobs (besides every job not yet terminal) ``orch_job_seconds`` has series for.
GOODPUT_JOBS = 100


class _JobSeconds(Collector):
    """``orch_job_seconds{job, category}``: :func:`~.views.goodput_view` of each job not yet terminal and of the
    newest :data:`GOODPUT_JOBS` (a terminal job's is computed once per change, a running one's at most every
    ``GOODPUT_CACHE_S`` seconds)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterable[Metric]:
        from .views import goodput_view  # (views imports the checkpoint code: only when scraped)

        family = GaugeMetricFamily("orch_job_seconds", "a job's wall time (submission to end, or now) by goodput "
                                   "category (docs/goodput.md); the categories add up to the wall time",
                                   labels=["job", "category"])
        jobs = {j.id: j for j in [*self.store.list_jobs(GOODPUT_JOBS), *self.store.active_jobs()]}
        for job_id in sorted(jobs):
            for category, seconds in goodput_view(self.store, jobs[job_id])["seconds"].items():
                family.add_metric([job_id, category], seconds)
        yield family


class _JobState(Collector):
    """``orch_job_state{job, name, state, cause, node}``: 1 for each job not yet terminal and each of the newest
    :data:`GOODPUT_JOBS`, labelled with its current state, its latest attempt's cause kind (``rank_exit``,
    ``node_lost``, ``gpu_fault``, ...) and the node that cause names (both empty when none). One series per job:
    at most :data:`GOODPUT_JOBS` plus the jobs not finished."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("orch_job_state", "1 for a job's current state, with its latest attempt's "
                                   "cause kind (every job not finished and the newest 100)",
                                   labels=["job", "name", "state", "cause", "node"])
        jobs = {j.id: j for j in [*self.store.list_jobs(GOODPUT_JOBS), *self.store.active_jobs()]}
        for job_id in sorted(jobs):
            job = jobs[job_id]
            cause = job.cause or {}
            family.add_metric([job_id, job.name, job.state.value, str(cause.get("kind") or ""),
                               str(cause.get("node") or "")], 1)
        yield family


class ControllerMetrics:
    """The metrics of one controller process.

    Args:
        store: the job store (read at scrape time for ``orch_jobs``).
    """

    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_JobsByState(store))
        self.registry.register(_JobSeconds(store))
        from .stragglers import StragglerGauge  # orch_straggler{job, node, rank}: ranks flagged now
        self.registry.register(StragglerGauge(store))
        self.registry.register(_JobState(store))
        self.attempts = Counter("orch_attempts", "attempts this controller started", registry=self.registry)
        self.restarts = Counter("orch_restarts", "attempts this controller started that were not a job's first",
                                registry=self.registry)
        self.time_to_running = Histogram("orch_time_to_running_seconds", "from an attempt's creation to every "
                                         "rank running", registry=self.registry, buckets=START_BUCKETS)
        self.failure_detection = Histogram("orch_failure_detection_seconds", "from a failure to the job's "
                                           "FAILED state", ["cause"], registry=self.registry,
                                           buckets=DETECT_BUCKETS)

    def attempt_started(self, number: int) -> None:
        """An attempt was created (number 1: a job's first)."""
        self.attempts.inc()
        if number > 1:
            self.restarts.inc()

    def running(self, seconds: float) -> None:
        """Every rank of an attempt runs, ``seconds`` after the attempt was created."""
        self.time_to_running.observe(max(0.0, seconds))

    def failure_detected(self, kind: str, seconds: float) -> None:
        """A failure of kind ``kind`` became FAILED ``seconds`` after it happened."""
        self.failure_detection.labels(cause=kind).observe(max(0.0, seconds))


def default_targets_dir(state_dir: str | Path) -> Path:
    """``$ORCH_PROMETHEUS_TARGETS``, else ``<state dir>/prometheus/targets``."""
    env = os.environ.get("ORCH_PROMETHEUS_TARGETS")
    return Path(env).expanduser() if env else Path(state_dir) / "prometheus" / "targets"


class TargetsWriter:
    """Writes and removes Prometheus ``file_sd`` files in one directory.

    The files are world-readable (0644; a directory it creates 0755), unlike the rest of orch's state, so a
    Prometheus running as its own user reads them: they hold the exporters' addresses and job ids only.
    Under the state directory (the default), that directory's 0700 still keeps other users out: point
    ``--prometheus-targets`` elsewhere for such a Prometheus (docs/security.md).

    Args:
        directory: the targets directory (created on first write).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def write(self, name: str, groups: list[dict]) -> Path:
        """Write ``groups`` (``[{"targets": ["host:port"], "labels": {...}}]``) as ``<name>.json``.

        Raises:
            OSError: the directory cannot be written.
        """
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True)
            self.directory.chmod(0o755)  # for a Prometheus running as its own user (Debian's does)
        path = self.path(name)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(groups, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o644)  # addresses and job ids only, read by Prometheus whatever orch's umask
        os.replace(tmp, path)
        return path

    def remove(self, name: str) -> None:
        """Remove ``<name>.json`` if it is there."""
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            pass


def attempt_targets(job_id: str, attempt: int, nodes: list[tuple[str, str, int]]) -> list[dict]:
    """The file_sd groups of an attempt: one per node, from ``(node name, address, port)``."""
    return [{"targets": [f"{_bracket(addr)}:{port}"],
             "labels": {"job": job_id, "attempt": str(attempt), "node": node}}
            for node, addr, port in nodes]


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
