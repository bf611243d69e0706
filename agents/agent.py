"""The node agent: starts the ranks of one node, supervises them, reports to the controller.

Run as ``python -m agents.agent``. It talks to its controller over stdin/stdout with
the messages of :mod:`agents.link` (whatever carries them: a local pipe, an SSH
channel). Its stdout is reserved for that stream: anything else printed to it (by a
library, say) is moved to stderr, which is the agent's own log.

Lifecycle, written once here for every provisioner:

1. say ``hello`` (proving the node's Python runs orch), then answer the controller's
   ``preflight`` requests (:mod:`agents.preflight`: the spec's Python, DeepSpeed, the
   workdir and entrypoint, the checkpoint directory, the master port, shared storage),
   with heartbeats, and wait for ``start`` (the node's plan), which the controller sends
   once every node passed;
2. host the c10d store the launcher asks for (torchrun's static rendezvous), if any;
3. start every rank in its own session (:class:`agents.ranks.RankProcess`), with the
   interface of its collectives named (:mod:`agents.network`), answer ``started`` (or
   ``spawn_failed`` and stop what was started);
4. loop: report every rank exit (``rank_exit``), send ``heartbeat``s, obey ``stop``;
5. stop the ranks (SIGTERM, the grace period, SIGKILL) when told to, when the
   controller goes away (end of stream; or no message for ``lease_s`` seconds), or
   on SIGTERM/SIGINT; then exit. An ``orch server``'s agent (``reattach_s`` > 0) takes
   the end of stream for its controller's death: its ranks run on, and a new controller
   may re-attach within ``reattach_s`` (:mod:`agents.attach`). Each node's ranks run in
   a cgroup of the attempt's where one can be made (:mod:`agents.cgroups`). No rank outlives its agent: ranks also carry
   ``PR_SET_PDEATHSIG``, and the agent is a child subreaper, so a rank's orphaned
   children are re-parented to it, killed and reaped when the node ends (no zombies).
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any

from . import binding, devices, network, stacks
from .attach import AttachPoint, RelinkWriter, write_outcome
from .cgroups import AttemptCgroup
from .adopted import SHIM, AdoptedRank, log_tail, write_plans, wrong_tool
from .before import BeforeStart, stay_warm
from .forkserver import ForkedRank, ForkServer, open_server
from .sweep import carry_record
from .nodeenv import node_accelerator, node_env, rank_env, read_env_files
from .link import MessageReader, MessageWriter
from .ranks import RankProcess, become_subreaper, private_files, describe_returncode, kill_descendants, kill_marked, stop_all

__all__ = ["Agent", "main", "rank_env"]


class Agent:
    """Supervises the ranks of one node for one attempt.

    Args:
        start: the ``start`` message: ``{"node": {...}, "attempt_id": str, "grace": float,
            "heartbeat_s": float, "lease_s": float}``; ``node`` is a NodePlan dict
            (``orchestrator.planning.NodePlan.to_dict``).
        writer: where messages to the controller go.
        inbox: messages from the controller (the reader's queue).
        base_env: the node's environment that every rank's env is laid over.
        template: the fork-server template an earlier attempt on this node kept warm, or None.
    """

    def __init__(self, start: dict[str, Any], writer: MessageWriter,
                 inbox: "queue.Queue[tuple[Any, dict]]", base_env: dict[str, str],
                 template: ForkServer | None = None) -> None:
        self.node = start["node"]
        self.attempt_id = start["attempt_id"]
        self.grace = float(start.get("grace", 10.0))
        self.heartbeat_s = float(start.get("heartbeat_s", 1.0))
        self.lease_s = float(start.get("lease_s", 30.0))
        self.writer = writer
        self.inbox = inbox
        self.base_env = base_env
        self.ranks: list[RankProcess] = []
        self.exited: dict[int, int] = {}
        self._store = None
        self._exporter = None
        self.metrics_port: int | None = None
        from .metrics import NodeMetrics, ProgressReader
        self.metrics = NodeMetrics(self.node.get("metrics_dir"), self.node["node_rank"],
                                   prometheus=self.node.get("metrics_port") is not None)
        self.progress = ProgressReader(self.metrics, [r["global_rank"] for r in self.node["ranks"]],
                                       self.node.get("deepspeed_monitor_dir"),
                                       logs={r["global_rank"]: os.path.join(self.node["log_dir"],
                                                                            f"rank-{r['global_rank']}.log")
                                             for r in self.node["ranks"]})
        self._progress_sent = 0.0
        self._watch = None
        self._signalled: int | None = None
        self._finished = threading.Event()
        self.native = self.node.get("native")  # launch_mode native: the real launcher starts the ranks
        self.launcher: RankProcess | None = None
        self._announce: tuple[float, dict] | None = None  # native: (deadline, the `started` message)
        self._launcher_wait: float | None = None  # native, node 0: until when the tool may still run
        self._start_timeout = float((self.native or {}).get("start_timeout", 120.0))
        self._slurm_step = os.environ.get("ORCH_AGENT_SLURM_STEP") == "1"  # the slurm provisioner's agent
        self.reattach_s = float(start.get("reattach_s") or 0)  # > 0: a closed link waits for a new one (agents.attach)
        self._attach: AttachPoint | None = None
        self._link_tag: Any = "controller"
        self._detached_at: float | None = None
        self._outcome_written = False
        self._cgroup: AttemptCgroup | None = None
        self._no_cgroup = ""  # why the ranks have no cgroup (agents.cgroups)
        self.fast_start = str(start.get("fast_start") or "off")  # ranks forked from a template (agents.forkserver)
        self._fast_start_note: dict[str, Any] | None = None  # how this node's ranks were started, and why
        self._launcher_name = start.get("launcher")
        #: > 0: once this attempt ends (told to stop, or every rank exited) the agent, and its template, stay up
        #: this many seconds for the controller's next attempt (:func:`main`); 0: the agent exits
        self.keep_warm_s = float(start.get("keep_warm_s") or 0)
        self.template = template
        self.may_stay = False  # the attempt ended as the controller expects (stop, or done): warm may follow
        self.gpus = None  # the ranks' GPUs: telemetry and faults (agents.gpu)

    # -- steps ------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the node to its end; return the agent's exit status (0: every rank exited 0)."""
        threading.Thread(target=self._heartbeats, name="heartbeats", daemon=True).start()
        self.metrics.create()
        self._watch_gpus()
        self._start_exporter()
        if not self._host_store():
            return 1
        self._make_watch()
        if not self._start_ranks():
            return 1
        self._listen()
        if self._watch is not None:
            self._watch.start()
        return self._supervise()

    def _make_watch(self) -> None:
        """Look at the checkpoint directory before the ranks start (``agents.manifest``: what is there is
        not recorded again), to watch it while they run; if the plan says so."""
        watch = self.node.get("checkpoint_watch")
        if not watch:
            return
        from .manifest import CheckpointWatch
        self._watch = CheckpointWatch(watch, [r["global_rank"] for r in self.node["ranks"]], self.node["node_rank"],
                                      self.writer.send)

    def _stop_watch(self) -> None:
        """Hash what the ranks left (at most 2 s: within the controller's slack for a stopping agent), then stop
        watching; before the last report."""
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.stop(final_deadline_s=2.0)
            for error in watch.errors[:5]:
                self.writer.send({"type": "warning", "message": f"checkpoint manifest on {self.node['host']}: {error}"})

    def _watch_gpus(self) -> None:
        """Per-rank GPU series and ``gpu_fault`` messages, polled every heartbeat (:mod:`agents.gpu`)."""
        from . import gpu
        self.gpus = gpu.start(self.base_env, self.node, self.writer.send, self.heartbeat_s,
                              expect_gpus=node_accelerator(self.base_env) == "cuda")

    def _start_exporter(self) -> None:
        """Serve ``/metrics`` (docs/metrics.md) on the plan's port, 0 meaning any free port; a
        port in use is replaced by a free one and a warning. The port bound goes to the
        controller in ``started`` (it writes the Prometheus targets)."""
        port = self.node.get("metrics_port")
        if port is None:
            return
        from .metrics import NodeCollector, serve
        job, _, attempt = self.attempt_id.rpartition(".")
        collector = NodeCollector(job, int(attempt), self.node["host"], self._rank_codes, self.metrics,
                                  self.progress, restarts=int(attempt) - 1, gpus=self.gpus)
        addr = self.node.get("metrics_addr") or "0.0.0.0"
        try:
            try:
                self._exporter, self.metrics_port, why = serve(int(port), collector, addr)
            except OSError as err:
                if err.errno != errno.EADDRNOTAVAIL:
                    raise
                self._exporter, self.metrics_port, why = serve(int(port), collector, "0.0.0.0")
                self.writer.send({"type": "warning", "message": f"{addr}, the address the controller reaches "
                                  f"{self.node['host']} at, is not one of that node's own (NAT?): its metrics exporter "
                                  "listens on every interface instead; set the spec's metrics_addr"})
        except OSError as err:  # metrics must not stop training: say so and go on
            self.writer.send({"type": "warning", "message": f"the metrics exporter on {self.node['host']} cannot "
                              f"listen ({err.strerror or err}); this node exports no metrics"})
            return
        if why:
            self.writer.send({"type": "warning", "message": f"metrics port {port} on {self.node['host']} cannot be "
                              f"used ({why}); the node's metrics are on port {self.metrics_port} instead"})

    def _rank_codes(self) -> dict[int, tuple[int, int | None]]:
        return {p.global_rank: (p.pid, self.exited.get(p.global_rank)) for p in self.ranks}

    def _send_progress(self, force: bool = False) -> None:
        """Forward the ranks' new reported steps (at most 10 per rank), at most once a second
        (and at the end)."""
        now = time.monotonic()
        if not force and now - self._progress_sent < 1.0:
            return
        self._progress_sent = now
        self.progress.poll()
        changes = self.progress.changes()
        if changes:
            self.writer.send({"type": "progress", "points": {str(k): v for k, v in changes.items()},
                              "totals": {str(k): self.progress.totals.get(k, {}) for k in changes}})

    def _host_store(self) -> bool:
        store = self.node.get("agent_store")
        if not store:
            return True
        try:
            from datetime import timedelta

            from torch.distributed import TCPStore
            addr, port = store["addr"], int(store["port"])
            # Hosted like torchrun's static rendezvous does on node 0 (multi-tenant, so
            # rank 0's own store creation does not clash); never wait for clients here.
            self._store = TCPStore(addr, port, None, True,
                                   timedelta(seconds=float(store.get("timeout_s", 900))),
                                   wait_for_workers=False, multi_tenant=True)
            return True
        except Exception as err:  # noqa: BLE001 - reported to the controller as data
            self.writer.send({"type": "error", "message": f"cannot host the rendezvous store at "
                              f"{store.get('addr')}:{store.get('port')}: {err}"})
            return False

    def _choose_network(self) -> network.Choice:
        """The interface of the ranks' collectives (:mod:`agents.network`); a problem is reported as a
        warning (the preflight's ``network`` check fails the attempt before this, when it runs)."""
        ranks = self.node["ranks"]
        choice = network.choose(rank_env(self.base_env, self.node, ranks[0]) if ranks else self.base_env,
                                self.node.get("master"))
        if choice.problem:
            self.writer.send({"type": "warning", "message": f"network on {self.node['host']}: {choice.detail}"})
        return choice

    def _rank_env(self, r: dict, choice: network.Choice) -> dict[str, str]:
        """The rank's environment (raises ValueError: its slots are not among the node's assigned devices)."""
        env = rank_env(self.base_env, self.node, r)
        env.update(read_env_files(self.node.get("env_from_file") or {}, self.node["workdir"], self.node["host"]))
        physical = devices.mapped(r["env"], self.base_env, self.node["host"])
        if physical is not None:
            env[devices.VAR] = physical
        for key, value in choice.sets.items():
            env.setdefault(key, value)  # the user's own value wins
        env.update(self.metrics.rank_env(r["global_rank"]))
        return env

    def _start_ranks(self) -> bool:
        log_dir = self.node["log_dir"]
        self._cgroup, self._no_cgroup = AttemptCgroup.create(self.attempt_id, self.node["node_rank"])
        choice = self._choose_network()
        if self.native:
            binding.warn_native(self.node, self.writer.send)  # the real launcher starts the ranks: not pinned
            return self._fork_server([]) is not False and self._start_native(choice)
        try:
            envs = [self._rank_env(r, choice) for r in self.node["ranks"]]
            cpus = binding.node_cpus(self.node, self.base_env, envs)  # and OMP_NUM_THREADS in envs
        except ValueError as err:
            return self._spawn_failed(str(err), global_rank=getattr(err, "global_rank", None))
        server = self._fork_server(envs)
        if server is False:
            return False
        try:
            for i, (r, env) in enumerate(zip(self.node["ranks"], envs)):
                log = os.path.join(log_dir, f"rank-{r['global_rank']}.log")
                proc = (ForkedRank(server, server.plan.mains[i], r["global_rank"], r["argv"], env, self.node["workdir"],
                                   log, cgroup=self._cgroup, cpus=cpus.get(r["global_rank"])) if server else
                        RankProcess(r["global_rank"], r["argv"], env, self.node["workdir"], log, cgroup=self._cgroup,
                                    cpus=cpus.get(r["global_rank"])))
                try:
                    proc.start()
                except OSError as err:
                    self._spawn_failed(f"{err.strerror or err}: {r['argv'][0]}", global_rank=r["global_rank"])
                    self._stop("spawn failed")
                    return False
                self.ranks.append(proc)
        finally:
            if server and server is not self.template:
                server.close()  # the ranks are the agent's children now
        self.writer.send({"type": "started", "metrics_port": self.metrics_port, "network": choice.to_dict(),
                          "ranks": [{"global_rank": p.global_rank, "pid": p.pid, **binding.report(p.cpus)}
                                    for p in self.ranks],
                          "cgroup": self._cgroup.path if self._cgroup else None, "no_cgroup": self._no_cgroup,
                          "fast_start": self._fast_start_note})
        return True

    def _fork_server(self, envs: list[dict[str, str]]) -> "ForkServer | None | bool":
        """The spec's ``fast_start`` on this node (:mod:`agents.forkserver`): a started template to fork the
        ranks from, None to exec them (``auto`` says why in the ``started`` message's ``fast_start``), or False:
        ``on`` cannot fork them (the start failed, with the reason)."""
        warm = self.template  # (open_server closes it unless it serves this attempt's ranks)
        server, why, job_wide = open_server(
            self.fast_start, [r["argv"] for r in self.node["ranks"]], envs, self.node["workdir"],
            os.path.join(self.node["log_dir"], f"forkserver-node{self.node['node_rank']}.log"),
            launcher=self._launcher_name, native=bool(self.native), warm=warm, kept=self.keep_warm_s > 0)
        self.template = server if self.keep_warm_s > 0 and server is not None else None
        if why and self.fast_start == "on":
            return self._spawn_failed(f"fast_start on: the ranks cannot be forked on {self.node['host']}: {why}")
        # auto's choice is no fault of the job's: said in the started message (the ranks_started event, orch
        # status) and the agent's log, not as a warning on every MPI, native or plain-script job
        self._fast_start_note = {"mode": self.fast_start, "forked": server is not None,
                                 **({"template": server.popen.pid, "kept": server is warm} if server and server.popen
                                    else {}),
                                 **({"why": why, "job_wide": bool(job_wide)} if why else {})}
        if why:
            print(f"fast_start {self.fast_start}: the ranks on {self.node['host']} are started as new processes, "
                  f"not forked: {why}", file=sys.stderr, flush=True)
        return server

    def _start_native(self, choice: network.Choice) -> bool:
        """launch_mode native: write the ranks' plans, start the real launcher (node 0), adopt the ranks."""
        log_dir = self.node["log_dir"]
        world = int(self.native["world_size"])
        try:
            write_plans(log_dir, self.node["host"], self.node["workdir"], world,
                        [(r["global_rank"], r["local_rank"], self._rank_env(r, choice)) for r in self.node["ranks"]])
        except ValueError as err:
            return self._spawn_failed(str(err))
        except OSError as err:
            return self._spawn_failed(f"cannot write the ranks' plans in {log_dir}: {err}")
        self.ranks = [AdoptedRank(r["global_rank"], log_dir) for r in self.node["ranks"]]
        command = self.native.get("command")
        if command:
            tool = next((t for t in command["tools"] if shutil.which(t, path=self.base_env.get("PATH"))), None)
            wrong = wrong_tool(tool, command.get("family"), self.base_env) if tool else None
            if tool is None or wrong:
                return self._spawn_failed(wrong or f"none of {', '.join(command['tools'])} is on this node's PATH",
                                          launcher=command["tools"][0])
            argv = [tool] + [SHIM if a == command["shim_token"] else a for a in command["argv"][1:]]
            # marked with the attempt, not with this node: Hydra and srun pass their environment on to
            # every wrapper on every node, which a node's own sweep (ORCH_NODE_RANK) must not take for its own
            env = {**self.base_env, **command.get("env", {}), "ORCH_ATTEMPT_ID": self.attempt_id}
            self.launcher = RankProcess(-1, argv, env, self.node["workdir"], os.path.join(log_dir, "launcher.log"),
                                        cgroup=self._cgroup)
            try:
                self.launcher.start()
            except OSError as err:
                return self._spawn_failed(f"{err.strerror or err}: {tool}")
        self._announce = (time.monotonic() + self._start_timeout,
                          {"type": "started", "metrics_port": self.metrics_port, "network": choice.to_dict(),
                           "fast_start": self._fast_start_note})
        return True

    def _spawn_failed(self, error: str, global_rank: int | None = None, launcher: str | None = None) -> bool:
        """Tell the controller the node's ranks could not be started (``launcher``: the native tool's
        name, for the hint); False, for the caller to return."""
        msg = {"type": "spawn_failed", "error": error,
               "global_rank": self.node["ranks"][0]["global_rank"] if global_rank is None else global_rank}
        self.writer.send({**msg, **({"launcher": launcher} if launcher else {})})
        return False

    def _native_turn(self) -> int | None:
        """launch_mode native, each turn: announce the ranks once all started; fail the start when the
        launcher ended first or the deadline passed. Returns the agent's exit status when it must stop."""
        if self._announce is not None:
            deadline, msg = self._announce
            waiting = [p.global_rank for p in self.ranks if not p.started]
            if not waiting:
                self.writer.send({**msg, "ranks": [{"global_rank": p.global_rank, "pid": p.pid} for p in self.ranks]})
                self._announce = None
            else:
                code = self.launcher.poll() if self.launcher else None
                if code is not None:
                    why = (f"the launcher ({self.launcher.argv[0]}) exited with {describe_returncode(code)} before "
                           f"starting rank(s) {waiting}; its last words: {log_tail(self.launcher.log_path)}")
                elif time.monotonic() > deadline:
                    why = f"the launcher did not start rank(s) {waiting} within {self._start_timeout:.0f} s"
                else:
                    return None
                self._spawn_failed(why, global_rank=waiting[0],
                                   launcher=self.native["command"]["tools"][0] if self.launcher else "launcher")
                return self._stop("the native launcher failed to start the ranks")
        return None

    def _launcher_ended(self) -> bool:
        """Node 0, native, its own ranks ended: the tool ends once every node's ranks did; it gets
        ``start_timeout`` seconds more to do so, then is stopped (with a warning)."""
        assert self.launcher is not None
        if self.launcher.poll() is not None:
            return True
        if self._launcher_wait is None:
            self._launcher_wait = time.monotonic() + self._start_timeout
        if time.monotonic() < self._launcher_wait:
            return False
        self.writer.send({"type": "warning", "message": f"the launcher ({self.launcher.argv[0]}) did not exit "
                          f"{self._start_timeout:.0f} s after this node's ranks ended; stopped"})
        stop_all([self.launcher], self.grace)
        return True

    def _heartbeats(self) -> None:
        """Tell the controller this node is alive, on a thread of its own so that nothing the
        main loop does (starting ranks, stopping them) delays a heartbeat."""
        while not self._finished.wait(self.heartbeat_s):
            self.writer.send({"type": "heartbeat", "at": time.time()})  # (a link re-attached later hears them)

    def _supervise(self) -> int:
        last_heard = time.monotonic()
        while True:
            msg = self._next_message(0.05)
            now = time.monotonic()
            if msg is not None:
                last_heard = now
                kind = msg.get("type")
                if kind == "stop":
                    self.may_stay = True
                    return self._stop(msg.get("reason", "stop requested"), kill=msg.get("kill") or ())
                if kind == "eof" and self._attach is None:
                    return self._stop("controller went away (end of stream)", report=False)
                if kind == "eof":  # ranks go on; a new controller may re-attach within reattach_s
                    self._detached_at = self._detached_at or now
                    self.writer.detach()
                if kind == "relink":
                    self._relink(msg)
                if kind == "dump":
                    threading.Thread(target=self._dump_stacks, name="stack-dumps", daemon=True).start()
            if self._signalled is not None:
                return self._stop_on_own(f"the agent received {signal.Signals(self._signalled).name}",
                                         taken=self._slurm_step and self._signalled == signal.SIGTERM)
            if self._detached_at is not None and now - self._detached_at > self.reattach_s:
                return self._stop_on_own(f"no controller re-attached within {self.reattach_s:.0f} s of the link closing")
            if self._detached_at is None and now - last_heard > self.lease_s:
                return self._stop_on_own(f"no word from the controller for {self.lease_s:.0f} s", lease=True)
            if self.native:
                stopped = self._native_turn()
                if stopped is not None:
                    return stopped
            self._reap()
            if self._detached_at is not None:
                self._detached_turn()
            self._send_progress(force=len(self.exited) == len(self.ranks))
            if len(self.exited) == len(self.ranks) and self._announce is None and self._detached_at is None:
                if self.launcher is not None and not self._launcher_ended():
                    continue
                self._stop_watch()
                self.writer.send({"type": "done", "exits": {str(k): v for k, v in self.exited.items()}})
                self._cleanup()
                self.may_stay = True
                return 0 if all(v == 0 for v in self.exited.values()) else 1

    def _next_message(self, timeout: float) -> dict | None:
        """The next message of the controller linked now (or a new link), or None."""
        try:
            tag, msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        return msg if tag in (self._link_tag, "attach") else None

    def _listen(self) -> None:
        """Listen for a new controller (``agents.attach``), when the plan asks for re-attach."""
        if self.reattach_s > 0:
            try:
                self._attach = AttachPoint(self.attempt_id, self.node["node_rank"], self.inbox)
            except OSError as err:
                self.writer.send({"type": "warning", "message": f"{self.node['host']} cannot listen for a new "
                                  f"controller ({err.strerror or err}): its ranks stop if this one goes"})

    def _detached_turn(self) -> None:
        """No controller is linked: a rank that failed ends the attempt (the rest of the node's ranks are
        stopped, as a controller would); once every rank ended, their exits are recorded for whoever finds the
        controller gone (``agents.attach.write_outcome``)."""
        if any(c != 0 for c in self.exited.values()) and len(self.exited) < len(self.ranks):
            stop_all([p for p in self.ranks if p.global_rank not in self.exited], self.grace)
            self._reap()
        if len(self.exited) == len(self.ranks) and not self._outcome_written:
            self._outcome_written = True
            write_outcome(self.node["log_dir"], self.node["node_rank"], self.exited)

    def _relink(self, msg: dict) -> None:
        """A new controller linked: tell it the node's state, then what it missed."""
        self._link_tag, detached, self._detached_at = msg["reader_tag"], self._detached_at, None
        self.writer.relink(msg["writer"], {
            "type": "attached", "host": self.node["host"], "pid": os.getpid(), "metrics_port": self.metrics_port,
            "ranks": [{"global_rank": p.global_rank, "pid": p.pid} for p in self.ranks],
            "exits": {str(k): v for k, v in self.exited.items()},
            "detached_s": round(time.monotonic() - detached, 3) if detached else 0.0})

    def _reap(self) -> None:
        ended = [(proc, code) for proc in self.ranks if proc.global_rank not in self.exited
                 for code in (proc.poll(),) if code is not None]
        if ended:  # the steps they reported last go first: the controller judges an exit by the rank's last step
            self._send_progress(force=True)
        for proc, code in ended:
            self.exited[proc.global_rank] = code
            self.metrics.rank_exited(proc.pid)
            self.writer.send({"type": "rank_exit", "global_rank": proc.global_rank, "returncode": code,
                              "how": describe_returncode(code), "at": time.time()})

    def _dump_stacks(self) -> None:
        """Write every running rank's Python stacks next to its log and tell the controller what each
        rank's main thread is doing (``dumped``; :mod:`agents.stacks`)."""
        dumps = stacks.dump_all([p for p in self.ranks if p.global_rank not in self.exited], self.node["log_dir"])
        self.writer.send({"type": "dumped", "files": {r: d["file"] for r, d in dumps.items() if "file" in d},
                          "errors": {r: d["error"] for r, d in dumps.items() if "error" in d},
                          "summaries": {r: {k: d.get(k) for k in ("where", "doing", "kind", "frames")}
                                        for r, d in dumps.items() if "file" in d}})

    def _stop_on_own(self, reason: str, taken: bool = False, lease: bool = False) -> int:
        """Stop without being told to: say why first, so the controller records the cause. ``taken``:
        the scheduler is taking the node away (an srun step's SIGTERM: preemption, scancel, a node
        failure), which the controller counts as a node loss."""
        self.writer.send({"type": "stopping", "reason": reason, **({"taken_by": "slurm"} if taken else {}),
                          **({"lease_expired": True} if lease else {})})
        return self._stop(reason)

    def _stop(self, reason: str, report: bool = True, kill: Any = ()) -> int:
        """Stop every rank (``kill``: global ranks found hung, SIGKILLed at once: a hung rank does not
        answer SIGTERM, and its stacks are already dumped); the rest get SIGTERM and the grace period."""
        hung = {int(r) for r in kill if isinstance(r, int) or str(r).isdigit()}
        for proc in self.ranks:
            if proc.global_rank in hung:
                proc.signal_group(signal.SIGKILL)
        stop_all([*self.ranks, *([self.launcher] if self.launcher else [])], self.grace)
        self._reap()
        if report:
            self._send_progress(force=True)
            self._stop_watch()
        self._cleanup()
        if report:
            self.writer.send({"type": "stopped", "reason": reason,
                              "exits": {str(k): v for k, v in self.exited.items()}})
        return 1

    def _cleanup(self) -> None:
        for proc in [*self.ranks, *([self.launcher] if self.launcher else [])]:  # what a finished rank left
            proc.signal_group(signal.SIGKILL)
        if self._cgroup is not None:
            self._cgroup.kill()  # every process of the ranks, however far it went (agents.cgroups)
        if all(p.poll() is not None for p in self.ranks if isinstance(p, RankProcess)):
            # orphans re-parented to this subreaper, then reap everything but a template kept warm
            kill_descendants(spare=[self.template.popen.pid] if self.template and self.template.popen else [])
        kill_marked(self.attempt_id, node_rank=self.node["node_rank"])
        if self._attach is not None:
            self._attach.close()
        self._store = None
        if self.gpus is not None:
            self.gpus.close()
        self._finished.set()
        if self._exporter is not None:
            self._exporter.shutdown()
            self._exporter.server_close()
        # scratch: forwarded already; DeepSpeed's monitor output only where orch put it (agents.metrics.remove_scratch)
        self.metrics.remove(self.node.get("deepspeed_monitor_dir"))

    def on_signal(self, signum: int, _frame: Any) -> None:
        """SIGTERM/SIGINT: stop the ranks at the next turn of the loop."""
        self._signalled = signum


def main() -> int:
    """Entry point of ``python -m agents.agent``: serve one node over stdin/stdout."""
    private_files()  # the agent's logs and records: 0600; its ranks keep the user's umask
    link_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to the agent log, not into the message stream
    sys.stdout = os.fdopen(1, "w", buffering=1)
    writer = RelinkWriter(MessageWriter(os.fdopen(link_fd, "wb", buffering=0), background=True))  # never blocks
    inbox: "queue.Queue[tuple[Any, dict]]" = queue.Queue()
    MessageReader(sys.stdin.buffer, name="controller-link", sink=inbox, tag="controller")
    from orchestrator import __version__
    base_env = node_env(os.environ)
    writer.send({"type": "hello", "host": socket.gethostname(), "pid": os.getpid(), "python": sys.executable,
                 "version": __version__, "accelerator": node_accelerator(base_env)})
    before = BeforeStart(writer, inbox, base_env)
    first = before.wait()
    before.close()
    if first is None:
        writer.close()  # (what waits is sent first)
        return 2
    become_subreaper()
    template: ForkServer | None = None
    try:
        while True:
            agent = Agent(first, writer, inbox, base_env, template)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, agent.on_signal)
            status = agent.run()
            template = agent.template
            if not (agent.may_stay and agent.keep_warm_s > 0):
                return status
            first = stay_warm(agent.keep_warm_s, writer, inbox, base_env,
                              {"attempt_id": agent.attempt_id, "template": template.popen.pid if template else None})
            if first is None:
                return status
            carry_record(first["attempt_id"], int(first["node"]["node_rank"]))  # a sweep of that attempt finds us
    finally:
        if template is not None:
            template.close()
        writer.close()  # what waits is sent first (10 s at most)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the link reader thread may still block on stdin: do not wait for it
