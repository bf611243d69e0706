"""The node agent's Prometheus exporter: ``/metrics`` with node stats and rank liveness.

Served by every agent whose job sets ``metrics_port`` (each node's port is in its plan:
``NodePlan.metrics_port``). Values are read at scrape time, nothing is sampled in the
background. Names follow Prometheus conventions (``snake_case``, unit suffixes); labels
are ``job``, ``attempt``, ``node`` and, per rank, ``rank`` (never a pid):

* ``orch_agent_up{job,attempt,node}``: 1 while the agent serves.
* ``orch_rank_up{job,attempt,node,rank}``: 1 while the rank's process runs, 0 once it ended.
* ``orch_rank_exit_code{job,attempt,node,rank}``: the exit status of an ended rank
  (negative: the signal that killed it).
* ``orch_node_cpu_utilization_ratio{job,attempt,node}``: CPU use of the node since the last
  scrape, 0..1 (psutil).
* ``orch_node_memory_used_bytes`` / ``orch_node_memory_total_bytes{job,attempt,node}``.
"""

from __future__ import annotations

from typing import Callable, Iterable

import psutil
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["NodeCollector", "serve"]


class NodeCollector(Collector):
    """Builds the node's metrics at scrape time.

    Args:
        job, attempt, node: the label values of this agent.
        ranks: returns ``{global rank: return code or None while running}``.
    """

    def __init__(self, job: str, attempt: int, node: str, ranks: Callable[[], dict[int, int | None]]) -> None:
        self.base = [job, str(attempt), node]
        self.ranks = ranks
        psutil.cpu_percent(None)  # start the utilization window

    def collect(self) -> Iterable[Metric]:
        names = ["job", "attempt", "node"]
        up = GaugeMetricFamily("orch_agent_up", "1 while the node agent serves", labels=names)
        up.add_metric(self.base, 1)
        yield up
        rank_up = GaugeMetricFamily("orch_rank_up", "1 while the rank's process runs, 0 once it ended",
                                    labels=names + ["rank"])
        exit_code = GaugeMetricFamily("orch_rank_exit_code", "exit status of an ended rank (negative: signal)",
                                      labels=names + ["rank"])
        for rank, code in sorted(self.ranks().items()):
            rank_up.add_metric(self.base + [str(rank)], 1 if code is None else 0)
            if code is not None:
                exit_code.add_metric(self.base + [str(rank)], code)
        yield rank_up
        yield exit_code
        cpu = GaugeMetricFamily("orch_node_cpu_utilization_ratio", "CPU utilization of the node since the last "
                                "scrape (0..1)", labels=names)
        cpu.add_metric(self.base, psutil.cpu_percent(None) / 100.0)
        yield cpu
        vm = psutil.virtual_memory()
        used = GaugeMetricFamily("orch_node_memory_used_bytes", "memory in use on the node", labels=names)
        used.add_metric(self.base, vm.total - vm.available)
        yield used
        total = GaugeMetricFamily("orch_node_memory_total_bytes", "memory of the node", labels=names)
        total.add_metric(self.base, vm.total)
        yield total


def serve(port: int, collector: NodeCollector, addr: str = "0.0.0.0"):
    """Serve ``collector`` on ``addr:port`` in a daemon thread; returns the server (``shutdown()`` it).

    Raises:
        OSError: the port cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
