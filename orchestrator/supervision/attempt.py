"""One attempt of one job, supervised on its own thread.

The lifecycle, in :class:`AttemptRun`:

1. provisioning (:mod:`.provisioning`): one agent per node, every hello awaited;
2. the preflight round (:class:`~.preflight.PreflightRound`), unless the spec turns it off;
3. ``start``: every node gets its plan and starts its ranks;
4. one turn per agent message, each handled by one small handler of the one table
   :data:`~.messages.AttemptMessages.HANDLERS` (:mod:`.messages`: ``started`` on every node ->
   RUNNING; a rank's non-zero exit, a spawn failure, an agent's link closing early -> FAILED with a
   cause; every rank exiting 0 -> SUCCEEDED), then the watches:
   node silence (:class:`~.watches.HeartbeatWatch`), hangs (:class:`~.watches.ProgressWatch`),
   the preflight's deadline, a cancel request, the agents' lease;
5. teardown (:class:`~.teardown.Teardown`), whatever happened: every agent stops its ranks (SIGTERM,
   grace, SIGKILL), agents that do not go are killed, any process still marked with the attempt's id
   is swept, the master port is released and ``stopped_at`` recorded.

Reaching FAILED does not wait for teardown, so the time to detect a failure is not hidden behind
the grace period; :meth:`~orchestrator.supervision.Controller.wait` waits for both. The state of the
job is changed only here, by the attempt's own thread (a cancel is a flag that thread reads).
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import NotFoundError, OrchError, StoreFullError
from ..observe import ControllerMetrics, TargetsWriter, attempt_targets
from ..planning import JobPlan
from ..provisioners import AgentHandle, Provisioner
from ..spec import JobSpec
from ..store import JobState, Store
from .messages import AttemptMessages
from .ports import PortLease
from .preflight import PreflightRound
from .prepare import rank_python
from .provisioning import await_hellos, provision_failure, start_agents
from .pruning import CheckpointPruner
from .settings import Timings
from .stragglers import StragglerWatch
from .teardown import Teardown, root_cause
from .warm import Relay, WarmPool, adopt_warm, keep_warm_for, parkable, spare_pids
from .watches import ENDED, HeartbeatWatch, ProgressWatch

__all__ = ["AttemptRun", "AttemptServices"]


@dataclass(frozen=True)
class AttemptServices:
    """What an attempt uses of its controller.

    Attributes:
        store: where the job's state, events and progress are recorded.
        metrics: the controller's Prometheus metrics.
        targets: writes the attempt's Prometheus file_sd file.
        timings: heartbeats, node timeout, lease, provisioning and preflight deadlines.
        on_ended: called with the attempt once its processes are gone (the restart policy).
        warm: where a failed attempt parks its healthy nodes' agents for the restart (:mod:`.warm`), or None.
    """

    store: Store
    metrics: ControllerMetrics
    targets: TargetsWriter
    timings: Timings
    on_ended: Callable[["AttemptRun"], None]
    warm: WarmPool | None = None


class AttemptRun(AttemptMessages):
    """Supervises one attempt of one job on its own thread (see the module docstring).

    Args:
        services: the store, metrics, targets writer, timings and end callback of the controller.
        spec: the job's spec.
        plan: this attempt's plan.
        lease: the master port reservation, released at teardown.
        provisioner: starts the agents.
        adopt: take over the running attempt a controller that died started (:meth:`_reattach`) instead of
            starting one.
    """

    #: How long every agent has to answer a new controller's ``attach`` (seconds).
    REATTACH_TIMEOUT_S = 20.0

    def __init__(self, services: AttemptServices, spec: JobSpec, plan: JobPlan, lease: PortLease,
                 provisioner: Provisioner, adopt: bool = False) -> None:
        self.services = services
        self.store = services.store
        self.timings = services.timings
        self.spec = spec
        self.plan = plan
        self.lease = lease
        self.provisioner = provisioner
        self.job_id = plan.job_id
        self.events: "queue.Queue[tuple[int, dict]]" = queue.Queue()
        self.agents: dict[int, AgentHandle] = {}
        self.node_state: dict[int, str] = {n.node_rank: "starting" for n in plan.nodes}
        self.exits: dict[int, int] = {}
        self.metrics_ports: dict[int, int | None] = {}
        self.state = JobState.PENDING
        self.cancel_event = threading.Event()
        self.cancel_reason = "cancelled by the user"
        self.done = threading.Event()
        self.heartbeats = HeartbeatWatch(self.timings.node_timeout_s, self.timings.heartbeat_s)
        self.progress = ProgressWatch(spec.hang_timeout, plan.run_dir, startup_timeout=spec.startup_timeout,
                                      floor_s=self.timings.hang_floor_s)
        self._preflight: PreflightRound | None = None  # between every hello and the start
        self._rank_node = {r.global_rank: n for n, r in plan.ranks()}
        self.stragglers = StragglerWatch(spec.straggler,
                                         {r: (n.host, n.node_rank) for r, n in self._rank_node.items()})
        self._last_ping = 0.0
        self._last_checks = 0.0
        self._progress_rows: list[tuple[int, dict]] = []  # reported points not stored yet (_flush_progress)
        self._failed_at: float | None = None
        self._tearing_down = False
        self._targets_written = False
        self.cause: dict | None = None  # the attempt's end cause, as this thread knows it (recorded or not)
        self.unrecorded: list[tuple] = []  # writes the store refused (disk full), replayed by _record_later
        self.adopt = adopt
        self._reattach_by: float | None = None  # adopting: when every agent must have answered
        self.previous_server: str | None = None  # adopting: the URL of the server that died
        self._recorded_state: JobState | None = None  # adopting: the job's state in the store then
        self._stack_requests: list[dict] = []  # orch stacks: {"waiting": nodes, "answers": {node: msg}, "done": Event}
        self._stack_lock = threading.Lock()
        self.relays: dict[int, Relay] = {}  # node rank -> its agent's relay (warm agents: .warm)
        self.idle: dict[int, dict] = {}  # node rank -> its agent's ``idle`` (its attempt ended; it stays warm)
        self.keep_warm_s = keep_warm_for(services.warm, spec, plan, provisioner, self.timings.keep_warm_s)
        self.pruner = CheckpointPruner(self.store, self.job_id, plan.attempt, spec, plan, self._log)
        self._thread = threading.Thread(target=self._main, name=f"attempt-{plan.attempt_id}", daemon=True)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start supervising on a new thread."""
        self._thread.start()

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Ask the attempt to stop (from any thread); the attempt's own thread acts on it."""
        self.cancel_reason = reason
        self.cancel_event.set()

    def _main(self) -> None:
        try:
            if self.adopt:
                self._reattach()
            else:
                self._set(JobState.PROVISIONING)
                self._provision()
            while not self.state.is_terminal():
                self._turn()
        except StoreFullError as err:  # progress, checkpoints, exits can no longer be recorded: stop
            self._fail({"kind": "store_full", "message": f"the attempt was stopped: what its ranks do can no "
                                                         f"longer be recorded. {err}"})
        except Exception as err:  # an orch bug must still leave nothing running
            self._log(traceback.format_exc())
            self._fail({"kind": "internal_error", "message": f"orch internal error: {err!r} "
                        f"(details in {self.plan.run_dir}/controller.log)"})
        finally:
            self._teardown()

    def _provision(self) -> None:
        """Start every node's agent and await every hello; then the preflight round, or the start."""
        warm = adopt_warm(self.services.warm, self.job_id, self.plan, self.provisioner, self.events)
        for node_rank, (_, relay, kept) in warm.items():
            self.relays[node_rank] = relay
            self.node_state[node_rank] = "up"
            self._event("agent_kept", {"node_rank": node_rank, "host": self._host(node_rank),
                                       "pid": kept.idle.get("pid"), "template": kept.idle.get("template"),
                                       "from_attempt": kept.idle.get("attempt_id"),
                                       **({"from_job": kept.job_id} if kept.job_id != self.job_id else {})})
        self.agents, failures = start_agents(self.provisioner, self.plan, self.events, self.cancel_event, self.relays,
                                             skip=warm)
        if not failures and not self.cancel_event.is_set():
            failures, gone = await_hellos(self.events, self.agents, self.timings.provision_timeout_s,
                                          self.cancel_event, self._on_hello)
            self.node_state.update({n: "gone" for n in gone})
        self.agents.update({n: handle for n, (handle, _, _) in warm.items()})
        if self.cancel_event.is_set():
            return self._finish_cancelled()
        if failures:
            return self._fail(provision_failure(failures, self.plan))
        if self.spec.preflight.enabled:
            return self._begin_preflight()
        self._send_start()

    def _reattach(self) -> None:
        """Take over the attempt a controller that died was running: link to every node's agent (its ranks
        kept running: ``agents.attach``), in parallel; each answers ``attached`` (:meth:`_on_attached`) within
        :data:`REATTACH_TIMEOUT_S`, else the attempt fails with ``controller_lost`` (and is restarted)."""
        self._recorded_state = self.store.get_job(self.job_id).state  # RUNNING, or PROVISIONING if it died first
        self.state = JobState.RUNNING
        self.node_state = {n.node_rank: "reattaching" for n in self.plan.nodes}
        self._reattach_by = time.monotonic() + self.REATTACH_TIMEOUT_S
        self.progress.watch(r.global_rank for _, r in self.plan.ranks())
        failures: dict[int, str] = {}

        def attach(node: Any) -> None:
            try:
                self.agents[node.node_rank] = self.provisioner.attach_agent(node, self.plan, self.events)
            except OrchError as err:
                failures[node.node_rank] = str(err)
        with ThreadPoolExecutor(max(1, min(self.provisioner.max_parallel, len(self.plan.nodes)))) as pool:
            list(pool.map(attach, self.plan.nodes))
        self.heartbeats.expect(self.agents)
        if failures:
            self.node_state.update({n: "gone" for n in failures})
            self._reattach_failed("; ".join(failures[n] for n in sorted(failures)))

    def _reattach_failed(self, why: str) -> None:
        self._fail({"kind": "controller_lost", "server": self.previous_server,
                    "message": f"the controller running this job went away, and its "
                    f"successor could not take over the running ranks: {why} (orch's own trouble: the job is "
                    "restarted from its last checkpoint whatever its restart policy says)"})

    def _check_reattach(self) -> None:
        """Adopting: every agent answered by the deadline, or the attempt fails."""
        if self._reattach_by is None or time.monotonic() < self._reattach_by:
            return
        self._reattach_by = None
        late = [n for n, st in self.node_state.items() if st == "reattaching"]
        if late and self._open():
            self._reattach_failed(f"no answer within {self.REATTACH_TIMEOUT_S:.0f} s from the agent(s) on "
                                  + ", ".join(f"{self._host(n)} (node {n})" for n in late))

    def _send_start(self) -> None:
        """Send every node its plan: the ranks start."""
        t = self.timings
        reattach_s = t.reattach_s if self.provisioner.reattaches else 0.0
        start_msg = {"type": "start", "attempt_id": self.plan.attempt_id, "grace": self.plan.grace,
                     "heartbeat_s": t.heartbeat_s, "lease_s": t.agent_lease_s, "reattach_s": reattach_s,
                     "fast_start": self.spec.fast_start, "launcher": self.plan.launcher, "keep_warm_s": self.keep_warm_s}
        self.heartbeats.expect(n.node_rank for n in self.plan.nodes)
        for node in self.plan.nodes:
            self.agents[node.node_rank].send({**start_msg, "node": node.to_dict()})

    #: The timed checks (heartbeats, progress, deadlines, pings) run at most this often (seconds): each looks at
    #: every node or rank, and a message per check made them O(nodes) per message (1,000 agents' heartbeats)
    CHECK_EVERY_S = 0.05
    #: The most messages one turn handles before the timed checks get their turn.
    BATCH = 2000

    def _turn(self) -> None:
        """Handle the messages waiting (or wait up to 0.1 s for one), then look at everything that is timed
        (at most every :data:`CHECK_EVERY_S`)."""
        try:
            node_rank, msg = self.events.get(timeout=0.1)
        except queue.Empty:
            node_rank, msg = None, None
        handled = 0
        while msg is not None:
            self._dispatch(node_rank, msg)
            handled += 1
            if handled >= self.BATCH or self.state.is_terminal():
                break
            try:
                node_rank, msg = self.events.get_nowait()
            except queue.Empty:
                break
        self._flush_progress()
        now = time.monotonic()
        if now - self._last_checks < self.CHECK_EVERY_S and not self.cancel_event.is_set():
            return
        self._last_checks = now
        if self.cancel_event.is_set() and not self.state.is_terminal():
            self._finish_cancelled()
        self._check_heartbeats()
        self._check_progress()
        self._check_preflight()
        self._check_reattach()
        self._ping()

    def _dispatch(self, node_rank: int, msg: dict) -> None:
        """Hand a message to its handler in :data:`HANDLERS` (while tearing down, only to the ones
        that run then)."""
        if msg.get("type") != "eof":  # a closed link is not a word from the agent
            self.heartbeats.heard(node_rank)
        if msg.get("type") not in ("progress", "heartbeat"):
            self._flush_progress()  # what came before this message is stored before it is handled
        handler, in_teardown = self.HANDLERS.get(msg.get("type"), (AttemptRun._on_unknown, False))
        if in_teardown or not self._tearing_down:
            handler(self, node_rank, msg)

    def _flush_progress(self) -> None:
        """Store the points reported since the last flush, in one transaction: a 1,000-node job's progress
        messages of one turn cost one write of the attempt's progress row, not one each."""
        if self._progress_rows:
            rows, self._progress_rows = self._progress_rows, []
            self.store.add_progress(self.job_id, self.plan.attempt, rows)

    def _ping(self) -> None:
        """Renew every agent's lease (agents stop their ranks when the controller falls silent)."""
        now = time.monotonic()
        if now - self._last_ping < self.timings.heartbeat_s:
            return
        self._last_ping = now
        for node_rank, handle in self.agents.items():
            if self.node_state[node_rank] not in ENDED:
                handle.send({"type": "ping"})

    def stacks(self, timeout: float = 30.0) -> dict[int, dict]:
        """Every running rank's Python stacks now (``orch stacks``): each running node's agent dumps its ranks
        (``py-spy``, files next to their logs) and answers; returns node rank -> its ``dumped`` message, for
        the nodes that answered within ``timeout`` seconds (none while the ranks are not running)."""
        running = [n for n, st in self.node_state.items() if st == "running"]
        request = {"waiting": set(running), "answers": {}, "done": threading.Event()}
        if not running:
            return {}
        with self._stack_lock:
            self._stack_requests.append(request)
        for node_rank in running:
            self.agents[node_rank].send({"type": "dump"})
        request["done"].wait(timeout)
        with self._stack_lock:
            if request in self._stack_requests:
                self._stack_requests.remove(request)
        return dict(request["answers"])

    def stack_report(self, rank: int | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """:meth:`stacks`, per rank (all, or ``rank``'s): ``{"job", "attempt", "ranks": {rank: {"file", "where",
        "doing", "kind", "frames"} | {"error"}}, "silent_nodes": [node ranks that did not answer in time]}``.

        Raises:
            NotFoundError: the attempt has no such rank.
        """
        if rank is not None and rank not in self._rank_node:
            raise NotFoundError(f"Job {self.job_id} has no rank {rank} (world size {self.plan.world_size}).")
        answers = self.stacks(timeout)
        ranks: dict[str, Any] = {}
        for msg in answers.values():
            for r, summary in (msg.get("summaries") or {}).items():
                ranks[r] = {"file": (msg.get("files") or {}).get(r), **summary}
            for r, error in (msg.get("errors") or {}).items():
                ranks[r] = {"error": error}
        if rank is not None:
            ranks = {k: v for k, v in ranks.items() if k == str(rank)}
        running = {n for n, st in self.node_state.items() if st == "running"}
        return {"job": self.job_id, "attempt": self.plan.attempt,
                "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0]))), "silent_nodes": sorted(running - set(answers))}

    def _stacks_answered(self, node_rank: int, msg: dict) -> None:
        """A node's ``dumped``: it answers every ``orch stacks`` request waiting for it."""
        with self._stack_lock:
            for request in list(self._stack_requests):
                if node_rank in request["waiting"]:
                    request["waiting"].discard(node_rank)
                    request["answers"][node_rank] = msg
                    if not request["waiting"]:
                        request["done"].set()
                        self._stack_requests.remove(request)

    # -- preflight ----------------------------------------------------------------------------

    def _begin_preflight(self) -> None:
        """Ask every node to run its checks; heartbeats (and node-loss detection) start now."""
        t = self.timings
        self._preflight = PreflightRound(self.spec, self.plan, rank_python(self.spec), timeout_s=t.preflight_timeout_s,
                                         heartbeat_s=t.heartbeat_s, lease_s=t.agent_lease_s)
        requests = self._preflight.requests()
        self.heartbeats.expect(requests)
        for node_rank, msg in requests.items():
            self.agents[node_rank].send(msg)

    def _check_preflight(self) -> None:
        """Fail the attempt when nodes are still checking past the preflight timeout."""
        pf = self._preflight
        if pf is not None and pf.phase != "done" and not self.state.is_terminal() and pf.overdue():
            self._finish_preflight()

    def _finish_preflight(self) -> None:
        """Record every node's results (event ``preflight``); then fail or start the ranks."""
        assert self._preflight is not None
        event, cause = self._preflight.verdict()
        self._preflight.phase = "done"
        self._event("preflight", event)
        if cause is not None:
            return self._fail(cause)
        self._send_start()

    # -- watches ------------------------------------------------------------------------------

    def _check_heartbeats(self) -> None:
        """A node whose agent stayed silent past the node timeout is lost."""
        found = self.heartbeats.check(self.node_state, quiet=not self.state.is_terminal() and self.events.empty())
        if found is None:
            return
        node_rank, silence = found
        self.node_state[node_rank] = "lost"  # unreachable: teardown will not wait for it
        self.services.metrics.failure_detected("node_lost", silence)
        self._fail({"kind": "node_lost", "node": self._host(node_rank), "node_rank": node_rank,
                    "message": f"node lost: no heartbeat from the agent on {self._host(node_rank)} "
                               f"(node {node_rank}) for {silence:.1f} s"})

    def _check_progress(self) -> None:
        """Start-up and hang deadlines: one passed has every running node dump its ranks' stacks, then
        the attempt fails with ``startup_timeout``/``no_progress`` naming what the ranks are stuck in, or
        the ranks get more time where they are exiting or saving (:class:`~.watches.ProgressWatch`)."""
        if self.state != JobState.RUNNING:
            return
        verdict = self.progress.due()
        if verdict is not None:
            what, data = verdict
            if what == "fail":
                return self._fail(data)
            self._event("hang_dismissed", data)
            return
        cause = self.progress.stalled(self.exits)
        if cause is None:
            return
        running = {n for n, st in self.node_state.items() if st == "running"}
        for node_rank in running:
            self.agents[node_rank].send({"type": "dump"})
        self._event("hang_detected" if cause["kind"] == "no_progress" else "startup_timeout_passed",
                    {"ranks": cause["ranks"], "steps": cause["steps"]})
        self.progress.await_stacks(cause, running)

    # -- state --------------------------------------------------------------------------------

    def _host(self, node_rank: int) -> str:
        return self.plan.nodes[node_rank].host

    def _open(self) -> bool:
        """Whether what the agents say can still change the attempt's state."""
        return not self.state.is_terminal() and not self._tearing_down

    def _event(self, kind: str, data: dict) -> None:
        try:
            self.store.add_event(self.job_id, self.plan.attempt, kind, data)
        except StoreFullError:
            self.unrecorded.append(("event", kind, data))

    def _set(self, state: JobState, cause: dict | None = None) -> None:
        """Change the job's state (the store's transition table applies); a disk that refuses the write
        does not stop the attempt from acting on it: the write is replayed once it can be (:meth:`_record_later`)."""
        if state in (JobState.SUCCEEDED, JobState.CANCELLED) and self.keep_warm_s > 0 and self._shares_warm():
            self.services.warm.expect(self.job_id, {n.host for n in self.plan.nodes})  # before anyone sees the end
        try:
            self.store.set_state(self.job_id, state, cause=cause)
        except StoreFullError:
            self.unrecorded.append(("state", state, cause))
        self.state = state
        if cause is not None:
            self.cause = cause

    def _fail(self, cause: dict) -> None:
        if self.state.is_terminal():
            self._event("later_failure", cause)
            return
        self._failed_at = time.monotonic()
        self._set(JobState.FAILED, cause)

    def _finish_cancelled(self) -> None:
        if not self.state.is_terminal():
            self._set(JobState.CANCELLED, {"kind": "cancelled", "message": self.cancel_reason})

    def _log(self, text: str) -> None:
        try:
            os.makedirs(self.plan.run_dir, exist_ok=True)
            with open(os.path.join(self.plan.run_dir, "controller.log"), "a") as f:
                f.write(text + "\n")
        except OSError:
            pass  # (a full disk: the log is lost, the attempt goes on)

    def _write_targets(self) -> None:
        """The attempt's Prometheus file_sd file: every node's exporter (see orchestrator.observe)."""
        nodes = []
        for node in self.plan.nodes:
            port = self.metrics_ports.get(node.node_rank)
            if port:
                addr = node.metrics_addr
                if addr in ("0.0.0.0", "::"):  # every interface: the one the controller reaches the node at
                    try:
                        addr = self.provisioner.master_addr(node.host)
                    except OrchError:
                        addr = node.host
                nodes.append((node.host, addr, int(port)))
        if not nodes:
            return
        targets = self.services.targets
        try:
            path = targets.write(self.plan.attempt_id, attempt_targets(self.job_id, self.plan.attempt, nodes))
            self._targets_written = True
            self._event("metrics_targets", {"path": str(path), "targets": [f"{a}:{p}" for _, a, p in nodes]})
        except OSError as err:
            self._event("warning", {"message": f"cannot write the Prometheus targets file in {targets.directory}: "
                                               f"{err.strerror or err}"})

    # -- teardown -----------------------------------------------------------------------------

    def _drain(self) -> None:
        """Handle every message waiting (rank exits, nodes stopping) without waiting for more."""
        while True:
            try:
                node_rank, msg = self.events.get_nowait()
            except queue.Empty:
                self._flush_progress()
                return
            self._dispatch(node_rank, msg)

    def _teardown(self) -> None:
        """Stop, kill, sweep (:class:`~.teardown.Teardown`); then release everything and record the end."""
        self._tearing_down = True
        try:
            cause = self.cause or self.store.get_job(self.job_id).cause or {}
            reason = cause.get("message", "attempt ended")
            hung = (cause.get("kill") or cause.get("ranks") or []) if cause.get("kind") in ("no_progress",
                                                                                          "startup_timeout") else []
            teardown = Teardown(self.agents, self.node_state, self.heartbeats, self.provisioner, self._drain,
                                exits_known=lambda: len(self.exits) >= self.plan.world_size, idle=self.idle)
            lost = teardown.stop(reason, self.plan.grace, self._failed_at, kill=hung)
            if teardown.silence_wait:  # nodes whose ranks' fate was unknown were given the node timeout
                self._event("silence_wait", teardown.silence_wait)
            self._revise_cause(lost)
            park = parkable(self.node_state, self.idle, self.relays, self.agents,
                            {n.node_rank: n.host for n in self.plan.nodes}) \
                if self.keep_warm_s > 0 and (self.state == JobState.FAILED or self._shares_warm()) else {}
            swept = teardown.finish(self.plan, keep={w.relay.node_rank for w in park.values()}, spare=spare_pids(park))
            if park and self.services.warm is not None:
                self.services.warm.park(self.job_id, self.plan.attempt, self.provisioner, park, self.keep_warm_s)
                self._event("agents_parked", {"hosts": sorted(park), "keep_s": self.keep_warm_s})
            if swept:
                self._event("swept", {"pids": swept})
        except Exception:  # noqa: BLE001 - teardown must finish
            self._log(traceback.format_exc())
        finally:
            self._release()

    def _shares_warm(self) -> bool:
        """Whether the agents of an attempt that did not fail are kept too (for other jobs: ``orch server
        --keep-warm``)."""
        return self.services.warm is not None and self.services.warm.share_s > 0

    def _revise_cause(self, lost: set[int]) -> None:
        """Name a lost node as the root cause of a rank's failure on another node (:func:`~.teardown.root_cause`)."""
        if self.state != JobState.FAILED or self._failed_at is None or self.unrecorded:
            return
        cause = self.store.get_job(self.job_id).cause or {}
        revised = root_cause(cause, lost, self.heartbeats, self._failed_at, {n.node_rank: n.host for n in self.plan.nodes})
        if revised is not None:
            self.store.revise_cause(self.job_id, self.plan.attempt, revised)

    def _release(self) -> None:
        """The targets file, preflight tokens and master port go; the end is recorded; the controller hears."""
        if self._targets_written:
            self.services.targets.remove(self.plan.attempt_id)
        if self._preflight is not None:  # tokens of agents that could not remove their own (where seen)
            shutil.rmtree(self._preflight.shared_dir, ignore_errors=True)
        self.lease.release()
        self.pruner.close()  # the spec's checkpoint retention, over what the last saves completed
        try:
            if self.unrecorded:
                raise StoreFullError("earlier writes are still to be recorded")
            self.store.mark_stopped(self.job_id, self.plan.attempt)
            self.store.set_owner(self.job_id, None)
        except StoreFullError:
            self.unrecorded += [("stopped",), ("owner",)]
            threading.Thread(target=self._record_later, name=f"record-{self.plan.attempt_id}", daemon=True).start()
        try:
            self.services.on_ended(self)  # before done: whoever waits for the job sees a restart coming
        except Exception:  # noqa: BLE001 - the attempt must still end
            self._log(traceback.format_exc())
        self.done.set()

    #: How long writes the store refused are retried, and how often (seconds).
    RECORD_FOR_S, RECORD_EVERY_S = 3600.0, 2.0

    def _record_later(self) -> None:
        """Replay, in order, the writes a full disk refused (state changes, events, the stop, the owner),
        every :data:`RECORD_EVERY_S` until they all went in or :data:`RECORD_FOR_S` passed. Meanwhile the
        controller shows the attempt's own state (:meth:`~orchestrator.supervision.Controller.unrecorded`)."""
        deadline = time.monotonic() + self.RECORD_FOR_S
        while self.unrecorded and time.monotonic() < deadline:
            try:
                what = self.unrecorded[0]
                if what[0] == "state":
                    self.store.set_state(self.job_id, what[1], cause=what[2])
                elif what[0] == "event":
                    self.store.add_event(self.job_id, self.plan.attempt, what[1], what[2])
                elif what[0] == "stopped":
                    self.store.mark_stopped(self.job_id, self.plan.attempt)
                else:
                    self.store.set_owner(self.job_id, None)
                self.unrecorded.pop(0)
            except StoreFullError:
                time.sleep(self.RECORD_EVERY_S)
            except Exception:  # noqa: BLE001 - an illegal replay (the job moved on): drop it, say why
                self._log(traceback.format_exc())
                self.unrecorded.pop(0)
