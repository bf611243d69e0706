"""Stragglers as users see them, read from an attempt's ``straggler`` / ``straggler_cleared`` events
(orchestrator/supervision/stragglers.py records them): the ranks flagged now, the Prometheus gauge
``orch_straggler{job, node, rank}`` (1 while flagged), and the hosts ``on_straggler:
exclude_on_restart`` leaves out of a restart."""

from __future__ import annotations

from typing import Any, Iterable

from ..store import Store

__all__ = ["flagged_ranks", "StragglerGauge"]


def flagged_ranks(events: Iterable[Any], attempt: int) -> dict[int, dict[str, Any]]:
    """The ranks of attempt number ``attempt`` flagged as stragglers after ``events`` (a job's event
    records, oldest first, with ``kind``, ``attempt``, ``data``): global rank -> its ``straggler`` event's
    data (``node``, ``node_rank``, ``seconds``, ``median_seconds``, ``ratio``, ...)."""
    out: dict[int, dict[str, Any]] = {}
    for ev in events:
        if ev.attempt != attempt or ev.kind not in ("straggler", "straggler_cleared"):
            continue
        rank = ev.data.get("global_rank")
        if ev.kind == "straggler":
            out[rank] = ev.data
        else:
            out.pop(rank, None)
    return out


class StragglerGauge:
    """``orch_straggler{job, node, rank}`` = 1 for each rank flagged now in a job not yet terminal
    (read from the store at scrape time). A prometheus_client collector; that package is imported only when
    scraped, so the views that use :func:`flagged_ranks` need none."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterable[Any]:
        """The gauge family (prometheus_client's ``Collector.collect``)."""
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("orch_straggler", "1 while a rank of a running job is flagged as a straggler "
                                   "(its step time over the others' median by the spec's straggler.threshold)",
                                   labels=["job", "node", "rank"])
        for job in self.store.active_jobs():
            for rank, data in sorted(flagged_ranks(self.store.events(job.id), job.attempt).items()):
                family.add_metric([job.id, str(data.get("node")), str(rank)], 1)
        yield family
