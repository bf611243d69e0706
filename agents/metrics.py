"""The node agent's metrics: its ``/metrics`` exporter and its ranks' progress reports.

Per attempt and node the agent owns a fresh scratch directory (``NodePlan.metrics_dir``, the attempt's
``<run_dir>/scratch`` as seen on the node, / ``node-<node rank>``) holding:

* ``prom/``: prometheus_client's multiprocess files of the ranks (``PROMETHEUS_MULTIPROC_DIR``),
  written by :mod:`agents.report`, served by :class:`NodeCollector` through
  ``MultiProcessCollector``; ``mark_process_dead`` is called when a rank exits;
* ``reports/rank-<global rank>.jsonl``: one line per reported step (``ORCH_REPORT_FILE``),
  read by :class:`ProgressReader` and forwarded to the controller.

Where orch wrote the DeepSpeed config it also turned on DeepSpeed's CSV monitor
(``NodePlan.deepspeed_monitor_dir``, on the node of global rank 0): rank 0's steps are
read from it when rank 0 does not report through :mod:`agents.report`.

All of it is scratch: the agent removes it at its end, once what it holds was forwarded; what an agent
killed before that left is removed by the sweep after the attempt (:func:`remove_scratch`) and by
``orch gc`` (docs/housekeeping.md).

Every name, type and label is documented in docs/metrics.md.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import threading
import time
from typing import Any, Callable, Iterable

import psutil
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

__all__ = ["NodeMetrics", "NodeCollector", "ProgressReader", "serve", "gpu_stats", "remove_scratch"]

_LABELS = ["job", "attempt", "node"]


class NodeMetrics:
    """The metrics scratch directory of one attempt on one node.

    Args:
        base: ``NodePlan.metrics_dir`` (the attempt's scratch directory); None: metrics and reports off.
        node_rank: this node's rank.
        prometheus: whether the ranks get a multiprocess directory (the exporter is on).
    """

    def __init__(self, base: str | None, node_rank: int, prometheus: bool) -> None:
        self.base, self.node_rank = base, node_rank
        self.root = os.path.join(base, f"node-{node_rank}") if base else None
        self.prom_dir = os.path.join(self.root, "prom") if self.root and prometheus else None
        self.report_dir = os.path.join(self.root, "reports") if self.root else None

    def create(self) -> None:
        """Make the directories fresh (a previous agent of the same attempt id left nothing to read)."""
        if self.root is None:
            return
        shutil.rmtree(self.root, ignore_errors=True)
        for d in (self.prom_dir, self.report_dir):
            if d:
                os.makedirs(d, exist_ok=True)

    def rank_env(self, global_rank: int) -> dict[str, str]:
        """The variables a rank needs to report: ``ORCH_REPORT_FILE``, ``PROMETHEUS_MULTIPROC_DIR``."""
        env = {}
        if self.report_dir:
            env["ORCH_REPORT_FILE"] = os.path.join(self.report_dir, f"rank-{global_rank}.jsonl")
        if self.prom_dir:
            env["PROMETHEUS_MULTIPROC_DIR"] = self.prom_dir
        return env

    def rank_exited(self, pid: int) -> None:
        """prometheus_client's documented clean-up for a dead process (its live gauges go)."""
        if self.prom_dir:
            try:
                mark_process_dead(pid, self.prom_dir)
            except OSError:
                pass

    def remove(self, monitor: str | None = None) -> None:
        """Remove this node's directory and ``monitor`` (DeepSpeed's monitor output, where orch put it:
        :func:`remove_scratch`), then the attempt's scratch directory once no node has anything left in it."""
        remove_scratch(self.base, [self.node_rank], monitor)


def remove_scratch(base: str | None, node_ranks: Iterable[int], monitor: str | None = None) -> list[str]:
    """Remove the scratch of these nodes of an attempt on this machine: ``<base>/node-<n>`` for each, and
    ``monitor`` (DeepSpeed's CSV monitor output) only where it is inside ``base`` (a user's own
    ``csv_monitor`` stays); then ``<base>/deepspeed`` and ``base`` once empty (another node of this machine
    may still be at work). Missing paths are skipped.

    Args:
        base: the attempt's scratch directory (``NodePlan.metrics_dir``); None: nothing to do.
        node_ranks: the nodes whose directories go.
        monitor: ``NodePlan.deepspeed_monitor_dir`` of the node that has one, or None.

    Returns:
        The paths that were there and were removed (files under them included).
    """
    if not base:
        return []
    paths = [os.path.join(base, f"node-{n}") for n in node_ranks]
    if monitor and os.path.abspath(monitor).startswith(os.path.abspath(base) + os.sep):
        paths.append(monitor)
    removed = [p for p in paths if os.path.lexists(p)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    for path in (os.path.join(base, "deepspeed"), base):
        try:
            os.rmdir(path)
            removed.append(path)
        except OSError:
            pass  # not empty, or gone
    return removed


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value


_LOG_STEP = re.compile(r"\bstep=(\d+)")
_LOG_LOSS = re.compile(r"\bloss=([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))")


class _Tail:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def lines(self) -> list[str]:
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return []
        if size <= self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        data = self.partial + data
        *done, self.partial = data.split(b"\n")
        return [line.decode("utf-8", "replace") for line in done]


class ProgressReader:
    """The latest step of every rank of a node, from the ranks' report files, (for rank 0, when
    it does not report itself) DeepSpeed's CSV monitor, and else the ``step=<n>`` (``loss=<x>``)
    lines of the rank's log (the form docs/contract.md asks scripts to print).

    Args:
        metrics: the node's :class:`NodeMetrics`.
        ranks: the node's global ranks.
        deepspeed_dir: where DeepSpeed's CSV monitor writes rank 0's files, or None.

    ``latest[rank]`` is a dict with ``step``, ``at`` and whichever of ``loss``, ``lr``,
    ``samples``, ``tokens``, ``step_seconds``, ``samples_per_second``,
    ``tokens_per_second``, ``source`` ("report", "deepspeed" or "log") are known; ``totals[rank]``
    sums ``samples`` and ``tokens``.
    """

    def __init__(self, metrics: NodeMetrics, ranks: Iterable[int], deepspeed_dir: str | None = None,
                 logs: dict[int, str] | None = None) -> None:
        self.ranks = list(ranks)
        self._logs = {r: _Tail(path) for r, path in (logs or {}).items()}
        self.latest: dict[int, dict[str, Any]] = {}
        self.totals: dict[int, dict[str, float]] = {}
        self._tails = {r: _Tail(os.path.join(metrics.report_dir, f"rank-{r}.jsonl"))
                       for r in self.ranks} if metrics.report_dir else {}
        self._ds_dir = deepspeed_dir if 0 in self.ranks else None
        self._ds: dict[str, _Tail] = {}
        self._ds_rows = 0
        self._pending: dict[int, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def poll(self) -> None:
        """Read what was appended since the last poll."""
        with self._lock:
            for rank, tail in self._tails.items():
                for line in tail.lines():
                    try:
                        point = json.loads(line)
                    except ValueError:
                        continue
                    self._take(rank, point, "report")
            if self._ds_dir and self.latest.get(0, {}).get("source") != "report":
                self._poll_deepspeed()
            for rank, tail in self._logs.items():
                lines = tail.lines()
                if self.latest.get(rank, {}).get("source") in ("report", "deepspeed"):
                    continue
                for line in lines:
                    m = _LOG_STEP.search(line)
                    if m:
                        loss = _LOG_LOSS.search(line)
                        self._take(rank, {"step": int(m.group(1)), "at": time.time(),
                                          "loss": loss.group(1) if loss else None}, "log")

    def _take(self, rank: int, point: dict[str, Any], source: str) -> None:
        point = {k: (_finite(v) if k != "step" else int(v)) for k, v in point.items() if k != "source"}
        totals = self.totals.setdefault(rank, {"samples": 0.0, "tokens": 0.0})
        for key in ("samples", "tokens"):
            if point.get(key) is not None and source == "report":
                totals[key] += point[key]
        point["source"] = source
        self.latest[rank] = point
        self._pending.setdefault(rank, []).append(point)

    def _poll_deepspeed(self) -> None:
        """DeepSpeed writes ``Train_Samples_<name>.csv`` (header ``step,<name>``; its step column
        is ``global_samples``) from rank 0, one row per optimizer step."""
        for name in ("lr", "train_loss"):
            path = os.path.join(self._ds_dir, f"Train_Samples_{name}.csv")
            tail = self._ds.setdefault(name, _Tail(path))
            for row in csv.reader(io.StringIO("\n".join(tail.lines()))):
                if len(row) != 2 or row[0] == "step":
                    continue
                samples, value = _finite(row[0]), _finite(row[1])
                if samples is None:
                    continue
                point = dict(self.latest.get(0, {})) if self.latest.get(0, {}).get("source") == "deepspeed" else {}
                if name == "lr":
                    self._ds_rows += 1
                    point.update(step=self._ds_rows, at=time.time(), lr=value)
                    self.totals.setdefault(0, {"samples": 0.0, "tokens": 0.0})["samples"] = samples
                else:
                    point.update(loss=value)
                    point.setdefault("step", self._ds_rows)
                    point.setdefault("at", time.time())
                self._take(0, point, "deepspeed")

    def changes(self, most: int = 10) -> dict[int, list[dict[str, Any]]]:
        """The new points of every rank since the previous call, oldest first: all of them, or
        ``most`` evenly spread ones ending with the newest (a chart needs no more per second)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        out = {}
        for rank in sorted(pending):
            points = pending[rank]
            if len(points) > most:
                n = len(points) - 1
                points = [points[round(i * n / (most - 1))] for i in range(most)]
            out[rank] = [dict(p) for p in points]
        return out


def gpu_stats() -> list[dict[str, float]]:
    """Utilization (0..1) and memory (bytes) of each NVIDIA GPU of this node, via NVML (:func:`agents.gpu.nvml`);
    [] where there is no NVML library or no GPU (never an error). A failure is tried again at the next call
    (the agent's own series go through :class:`agents.gpu.NodeGpus`, which also counts and reports errors)."""
    state = gpu_stats.__dict__
    try:
        from .gpu import nvml
        mod = state.get("nvml")
        if mod is None:
            mod = nvml()
            mod.nvmlInit()
            state["nvml"] = mod
        out = []
        for i in range(mod.nvmlDeviceGetCount()):
            h = mod.nvmlDeviceGetHandleByIndex(i)
            util = mod.nvmlDeviceGetUtilizationRates(h)
            mem = mod.nvmlDeviceGetMemoryInfo(h)
            out.append({"gpu": i, "utilization": util.gpu / 100.0, "used": float(mem.used),
                        "total": float(mem.total)})
        return out
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: none now; tried again next time
        state["nvml"] = None
        return []


class NodeCollector(Collector):
    """Builds the node's ``/metrics`` at scrape time (docs/metrics.md).

    Args:
        job, attempt, node: the label values of this agent.
        ranks: returns ``{global rank: (pid, return code or None while running)}``.
        metrics: the node's metrics directory (its ``prom/`` is merged in).
        progress: the node's progress reader (rank 0's DeepSpeed-monitor series).
        restarts: the attempt's restart count (attempt - 1).
        gpus: the node's ranks' GPUs (:class:`agents.gpu.NodeGpus`: the ``orch_rank_gpu_*`` series, and the
            ``orch_node_gpu_*`` ones through the same NVML), or None (``orch_node_gpu_*`` from :func:`gpu_stats`).
    """

    def __init__(self, job: str, attempt: int, node: str, ranks: Callable[[], dict[int, tuple[int, int | None]]],
                 metrics: NodeMetrics | None = None, progress: ProgressReader | None = None,
                 restarts: int = 0, gpus: Any = None) -> None:
        self.base = [job, str(attempt), node]
        self.gpus = gpus
        self.ranks = ranks
        self.metrics = metrics
        self.progress = progress
        self.restarts = restarts
        self._procs: dict[int, psutil.Process] = {}
        psutil.cpu_percent(None)  # start the utilization window

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for family in self._own():
            families[family.name] = family
        if self.metrics is not None and self.metrics.prom_dir and os.path.isdir(self.metrics.prom_dir):
            for family in MultiProcessCollector(None, path=self.metrics.prom_dir).collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        for family in self._deepspeed():
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
        return list(families.values())

    def _own(self) -> Iterable[Metric]:
        names = _LABELS
        up = GaugeMetricFamily("orch_agent_up", "1 while the node agent serves", labels=names)
        up.add_metric(self.base, 1)
        yield up
        cpu = GaugeMetricFamily("orch_node_cpu_utilization_ratio", "CPU use of the node since the previous "
                                "scrape, 0..1", labels=names)
        cpu.add_metric(self.base, psutil.cpu_percent(None) / 100.0)
        yield cpu
        vm = psutil.virtual_memory()
        used = GaugeMetricFamily("orch_node_memory_used_bytes", "memory in use on the node", labels=names)
        used.add_metric(self.base, vm.total - vm.available)
        yield used
        total = GaugeMetricFamily("orch_node_memory_total_bytes", "memory of the node", labels=names)
        total.add_metric(self.base, vm.total)
        yield total
        gpus = self.gpus.node_samples() if self.gpus is not None else gpu_stats()
        if gpus:
            g_labels = names + ["gpu"]
            util = GaugeMetricFamily("orch_node_gpu_utilization_ratio", "GPU utilization, 0..1 (NVML)",
                                     labels=g_labels)
            g_used = GaugeMetricFamily("orch_node_gpu_memory_used_bytes", "GPU memory in use (NVML)",
                                       labels=g_labels)
            g_total = GaugeMetricFamily("orch_node_gpu_memory_total_bytes", "GPU memory (NVML)", labels=g_labels)
            for g in gpus:
                key = self.base + [str(g["gpu"])]
                util.add_metric(key, g["utilization"])
                g_used.add_metric(key, g["used"])
                g_total.add_metric(key, g["total"])
            yield from (util, g_used, g_total)
        if self.gpus is not None:
            from .gpu import families
            yield from families(self.base, self.gpus)
        r_labels = names + ["rank"]
        rank_up = GaugeMetricFamily("orch_rank_up", "1 while the rank's process runs, 0 once it ended",
                                    labels=r_labels)
        exit_code = GaugeMetricFamily("orch_rank_exit_code", "exit status of an ended rank (negative: signal)",
                                      labels=r_labels)
        restarts = CounterMetricFamily("orch_rank_restarts", "times the job's ranks were started again "
                                       "(attempt - 1)", labels=r_labels)
        cpu_s = CounterMetricFamily("orch_rank_cpu_seconds", "CPU time of the rank's process (user + system)",
                                    labels=r_labels)
        rss = GaugeMetricFamily("orch_rank_memory_rss_bytes", "resident memory of the rank's process",
                                labels=r_labels)
        for rank, (pid, code) in sorted(self.ranks().items()):
            key = self.base + [str(rank)]
            rank_up.add_metric(key, 1 if code is None else 0)
            restarts.add_metric(key, self.restarts)
            if code is not None:
                exit_code.add_metric(key, code)
                self._procs.pop(rank, None)
                continue
            try:
                proc = self._procs.get(rank)
                if proc is None or proc.pid != pid:
                    proc = self._procs[rank] = psutil.Process(pid)
                with proc.oneshot():
                    times = proc.cpu_times()
                    cpu_s.add_metric(key, times.user + times.system)
                    rss.add_metric(key, proc.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        yield from (rank_up, exit_code, restarts, cpu_s, rss)

    def _deepspeed(self) -> Iterable[Metric]:
        """Rank 0's series from DeepSpeed's CSV monitor (only when rank 0 does not report itself)."""
        if self.progress is None:
            return
        self.progress.poll()
        point = self.progress.latest.get(0)
        if not point or point.get("source") != "deepspeed":
            return
        labels, key = _LABELS + ["rank"], self.base + ["0"]
        for name, field, doc in (("orch_rank_step", "step", "the last optimizer step reported"),
                                 ("orch_rank_loss", "loss", "the loss of the last step"),
                                 ("orch_rank_learning_rate", "lr", "the learning rate of the last step"),
                                 ("orch_rank_last_step_timestamp_seconds", "at", "when the last step was reported")):
            value = point.get(field)
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=labels)
                family.add_metric(key, value)
                yield family
        samples = self.progress.totals.get(0, {}).get("samples")
        if samples is not None:
            family = CounterMetricFamily("orch_rank_samples", "samples this rank processed", labels=labels)
            family.add_metric(key, samples)
            yield family


def serve(port: int, collector: Collector, addr: str = "0.0.0.0") -> tuple[Any, int, str | None]:
    """Serve ``collector`` on ``addr:port`` in a daemon thread.

    A port that cannot be bound (in use) is replaced by a free one chosen by the kernel.

    Returns:
        ``(server, port actually bound, why the asked port was not used or None)``;
        ``server.shutdown()`` stops it.

    Raises:
        OSError: not even a free port can be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    why = None
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as err:
        if port == 0:
            raise
        why = err.strerror or str(err)
        server, _thread = start_http_server(0, addr=addr, registry=registry)
    return server, server.server_address[1], why
