"""What each message of an agent does to its attempt: one small handler per message type, and the one
table that maps a type to its handler (:data:`AttemptMessages.HANDLERS`).

A part of :class:`~.attempt.AttemptRun` (it is mixed in there): the handlers read and change the
attempt's node states, rank exits and watches, and end it through its ``_fail``/``_set``; the
lifecycle that calls them (and when: running, or tearing down) is in :mod:`.attempt`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.ranks import describe_returncode

from ..store import JobState

__all__ = ["AttemptMessages", "rank_log_tail"]


def rank_log_tail(plan: dict, global_rank: int, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of a rank's log file (empty if it has none yet)."""
    path = Path(plan["nodes"][0]["log_dir"]) / f"rank-{global_rank}.log"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return [ln.decode("utf-8", "replace") for ln in data.splitlines()[-lines:]]


class AttemptMessages:
    """The handlers of :class:`~.attempt.AttemptRun`, one per agent message type (see the module docstring).

    A handler gets ``(node rank, message)``; one that fails the attempt does so with a cause naming
    the node (and rank), so failure is data the store keeps.
    """

    def _on_hello(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "up"
        self._event("agent_up", {"node_rank": node_rank, "host": self._host(node_rank), "pid": msg.get("pid"),
                                 "accelerator": msg.get("accelerator")})

    def _on_preflight_result(self, node_rank: int, msg: dict) -> None:
        pf = self._preflight
        if pf is None or pf.phase == "done" or self.state.is_terminal():
            return
        pf.record(node_rank, msg)
        if not pf.phase_complete():
            return
        if pf.phase == "check":
            for n, request in pf.list_requests().items():
                self.agents[n].send(request)
            if pf.phase == "list":
                return
        self._finish_preflight()

    def _on_started(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "running"
        self.metrics_ports[node_rank] = msg.get("metrics_port")
        self._event("ranks_started", {"node_rank": node_rank, "host": self._host(node_rank),
                                      "ranks": msg.get("ranks", []), "metrics_port": msg.get("metrics_port"),
                                      "network": msg.get("network"), "cgroup": msg.get("cgroup"),
                                      "fast_start": msg.get("fast_start"),
                                      **({"no_cgroup": msg["no_cgroup"]} if msg.get("no_cgroup") else {})})
        if self.state == JobState.PROVISIONING and all(s in ("running", "done") for s in self.node_state.values()):
            self._set(JobState.RUNNING)
            attempt = self.store.get_attempt(self.job_id, self.plan.attempt)
            self.services.metrics.running((attempt.running_at or 0) - attempt.created_at)
            self._write_targets()
            self.progress.watch(r.global_rank for _, r in self.plan.ranks())

    def _on_attached(self, node_rank: int, msg: dict) -> None:
        """An agent a dead controller started answered this one's ``attach``: its ranks ran on meanwhile
        (``exits``: those that ended since, replayed as ``rank_exit``s); all answered: the attempt goes on."""
        if self.node_state.get(node_rank) != "reattaching":
            return
        self.node_state[node_rank] = "running"
        self.metrics_ports[node_rank] = msg.get("metrics_port")
        self.agents[node_rank].pid = msg.get("pid")
        self._event("agent_reattached", {"node_rank": node_rank, "host": self._host(node_rank), "pid": msg.get("pid"),
                                         "ranks": msg.get("ranks", []), "detached_s": msg.get("detached_s")})
        for rank, code in sorted((msg.get("exits") or {}).items(), key=lambda kv: int(kv[0])):
            self._on_rank_exit(node_rank, {"global_rank": int(rank), "returncode": int(code),
                                           "how": describe_returncode(int(code))})
        if not any(s == "reattaching" for s in self.node_state.values()):
            self._reattach_by = None
            if self._recorded_state == JobState.PROVISIONING:  # it died after the ranks started, before it said so
                self.state = JobState.PROVISIONING
                self._set(JobState.RUNNING)
            self._event("reattached", {"nodes": len(self.node_state), "ranks": self.plan.world_size})
            self._write_targets()

    def _on_progress(self, node_rank: int, msg: dict) -> None:
        rows = [(int(rank), p) for rank, points in (msg.get("points") or {}).items() if isinstance(points, list)
                for p in points if isinstance(p, dict) and "step" in p]
        if rows:  # stored in one transaction per turn (AttemptRun._flush_progress), not one per message
            self._progress_rows.extend(rows)
            self.progress.record(rows)
            for kind, data in self.stragglers.record(rows):  # (supervision/stragglers.py)
                self._event(kind, data)

    def _on_rank_exit(self, node_rank: int, msg: dict) -> None:
        rank, code = int(msg["global_rank"]), int(msg["returncode"])
        if rank in self.exits:  # (told again by an agent that re-attached)
            return
        self.exits[rank] = code
        self.progress.ended(rank, code)
        self._event("rank_exit", {"global_rank": rank, "node_rank": node_rank, "host": self._host(node_rank),
                                  "returncode": code, "how": msg.get("how"), "during_teardown": self._tearing_down})
        if code == 0 or not self._open():
            return
        node = self._rank_node[rank]
        local = next(r.local_rank for r in node.ranks if r.global_rank == rank)
        if isinstance(msg.get("at"), (int, float)):
            self.services.metrics.failure_detected("rank_exit", time.time() - msg["at"])
        cause = {"kind": "rank_exit", "global_rank": rank, "local_rank": local, "node": node.host,
                 "node_rank": node.node_rank, "returncode": code,
                 "message": f"rank {rank} (local rank {local}) on {node.host} (node {node.node_rank}) "
                            f"exited with {msg.get('how') or code}",
                 "log_tail": rank_log_tail(self.plan.to_dict(), rank)}
        finished = self.progress.finished_at(rank)
        if finished is not None:  # the training was done: what failed came on the way out (a crash at exit)
            step, total = finished
            cause["after_last_step"] = step
            cause["message"] += f" after its last step (step {step}{f' of {total}' if total else ''})"
        self._fail(cause)

    def _on_done(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "done"
        every_rank_ok = len(self.exits) == self.plan.world_size and all(c == 0 for c in self.exits.values())
        if all(s == "done" for s in self.node_state.values()) and every_rank_ok and self._open():
            self._set(JobState.SUCCEEDED)

    def _on_stopped(self, node_rank: int, msg: dict) -> None:
        self.node_state[node_rank] = "stopped"

    def _on_idle(self, node_rank: int, msg: dict) -> None:
        """The agent's attempt is over on its node (its processes gone) and it stays up for the next (:mod:`.warm`)."""
        self.idle[node_rank] = msg

    def _on_stopping(self, node_rank: int, msg: dict) -> None:
        if msg.get("taken_by") == "slurm":  # its srun step got SIGTERM: Slurm takes the node away
            self._fail(self._slurm_lost(node_rank))
            return
        if msg.get("lease_expired"):  # the controller was silent: its own stall, not the job's fault
            self._fail({"kind": "controller_stalled", "node": self._host(node_rank), "node_rank": node_rank,
                        "message": f"the controller stalled: the agent on {self._host(node_rank)} (node {node_rank}) "
                                   f"stopped its ranks after {msg.get('reason')} (orch's own trouble: the job is "
                                   "restarted whatever its restart policy says)"})
            return
        self._fail({"kind": "agent_stopped", "node": self._host(node_rank), "node_rank": node_rank,
                    "message": f"the agent on {self._host(node_rank)} (node {node_rank}) stopped its ranks: "
                               f"{msg.get('reason')}"})

    def _slurm_lost(self, node_rank: int) -> dict:
        """The cause when node ``node_rank``'s agent step got SIGTERM from Slurm. Slurm ends every step of the
        allocation when it takes one node away, so the first step to report is not always the lost node's: the node
        sinfo shows out of service (down, drained, failing) is named when there is one, else the reporting node."""
        ranks = {n.host: n.node_rank for n in self.plan.nodes}
        down = self.provisioner.unavailable(list(ranks))
        if not down:
            return {"kind": "node_lost", "node": self._host(node_rank), "node_rank": node_rank,
                    "message": f"node lost: Slurm took {self._host(node_rank)} (node {node_rank}) away: its "
                               f"agent's step got SIGTERM (preemption, scancel, or the node failing)"}
        lost = ranks[down[0]]
        also = f" (also out of service: {', '.join(down[1:])})" if len(down) > 1 else ""
        return {"kind": "node_lost", "node": down[0], "node_rank": lost, **({"nodes": down} if len(down) > 1 else {}),
                "message": f"node lost: Slurm took {down[0]} (node {lost}) out of service{also} and ended the "
                           f"allocation's steps (the agent on {self._host(node_rank)} got SIGTERM)"}

    def _on_spawn_failed(self, node_rank: int, msg: dict) -> None:
        self._fail({"kind": "spawn_failed", "node": self._host(node_rank), "node_rank": node_rank,
                    "global_rank": msg.get("global_rank"), **({"launcher": msg["launcher"]} if msg.get("launcher") else {}),
                    "message": f"rank {msg.get('global_rank')} on {self._host(node_rank)} (node {node_rank}) "
                               f"could not be started: {msg.get('error')}"})

    def _on_error(self, node_rank: int, msg: dict) -> None:
        self._fail({"kind": "agent_error", "node": self._host(node_rank), "node_rank": node_rank,
                    "message": f"the agent on {self._host(node_rank)} (node {node_rank}) failed: {msg.get('message')}"})

    def _on_eof(self, node_rank: int, msg: dict) -> None:
        if self.node_state.get(node_rank) in ("done", "stopped", "lost"):
            return
        if self.node_state.get(node_rank) == "reattaching":
            self.node_state[node_rank] = "gone"
            why = self.agents[node_rank].diagnostics().strip().splitlines()
            return self._reattach_failed(f"the link to the agent on {self._host(node_rank)} (node {node_rank}) "
                                         f"closed before it answered{': ' + why[-1] if why else ''}")
        self.node_state[node_rank] = "gone"
        if self._open():
            self.services.metrics.failure_detected("node_lost", 0.0)  # the link closing is the news
            self._fail({"kind": "node_lost", "node": self._host(node_rank), "node_rank": node_rank,
                        "message": f"node lost: the agent on {self._host(node_rank)} (node {node_rank}) "
                                   "went away (its link closed)"})

    def _on_gpu_fault(self, node_rank: int, msg: dict) -> None:
        """A GPU of the node reported an Xid that is a fault of the GPU, or a double-bit ECC error (``agents.gpu``):
        the attempt fails with cause ``gpu_fault`` naming node and GPU (a restart policy that leaves failed nodes
        out leaves this one out, as for ``node_lost``: supervision/restarts.py)."""
        host = self._host(node_rank)
        self._event("gpu_fault", {"node_rank": node_rank, "host": host,
                                  **{k: msg.get(k) for k in ("gpu", "gpu_index", "xid", "ecc", "ranks")}})
        if not self._open():
            return
        if isinstance(msg.get("at"), (int, float)):
            self.services.metrics.failure_detected("gpu_fault", time.time() - msg["at"])
        ranks = msg.get("ranks") or []
        self._fail({"kind": "gpu_fault", "node": host, "node_rank": node_rank, "gpu": msg.get("gpu"),
                    "gpu_index": msg.get("gpu_index"), "xid": msg.get("xid"), "ecc": msg.get("ecc"), "ranks": ranks,
                    "message": f"GPU fault on {host} (node {node_rank}): GPU {msg.get('gpu_index')} "
                               f"({msg.get('gpu')}) reported {msg.get('what') or 'a fault'}"
                               f"{f'; rank(s) {ranks} ran on it' if ranks else ''}"})

    def _on_dumped(self, node_rank: int, msg: dict) -> None:
        self.progress.dumped(node_rank, msg)
        self._stacks_answered(node_rank, msg)

    def _on_heartbeat(self, node_rank: int, msg: dict) -> None:
        if self._preflight is not None and self._preflight.phase != "done":
            self._preflight.current[node_rank] = msg.get("preflight")  # named if the preflight times out

    def _on_warning(self, node_rank: int, msg: dict) -> None:
        self._event("warning", {"node_rank": node_rank, "host": self._host(node_rank), "message": msg.get("message")})

    def _on_checkpoint_files(self, node_rank: int, msg: dict) -> None:
        files = [f for f in msg.get("files") or [] if isinstance(f, dict) and {"tag", "name", "size", "mtime_ns"} <= f.keys()]
        if files and isinstance(msg.get("dir"), str):
            self.store.record_checkpoint_files(self.job_id, self.plan.attempt, msg["dir"], node_rank, files)
            tags = sorted({f["tag"] for f in files})
            self._event("checkpoint_files", {"node_rank": node_rank, "host": self._host(node_rank), "tags": tags,
                                             "files": len(files), "bytes": sum(int(f["size"]) for f in files)})
            self.pruner.seen()  # the spec's checkpoints.keep_last (supervision/pruning.py)

    def _on_unknown(self, node_rank: int, msg: dict) -> None:
        self._event("agent_message", {"node_rank": node_rank, "message": msg})

    #: Agent message type -> (handler, whether it also runs while the attempt is torn down).
    #: Any other type is recorded as an ``agent_message`` event (not while tearing down).
    HANDLERS: dict[str, tuple[Callable[[Any, int, dict], None], bool]] = {
        "hello": (_on_hello, False),
        "preflight_result": (_on_preflight_result, False),
        "started": (_on_started, False),
        "attached": (_on_attached, False),
        "progress": (_on_progress, True),
        "rank_exit": (_on_rank_exit, True),
        "done": (_on_done, True),
        "stopped": (_on_stopped, True),
        "idle": (_on_idle, True),
        "stopping": (_on_stopping, False),
        "spawn_failed": (_on_spawn_failed, False),
        "error": (_on_error, False),
        "eof": (_on_eof, True),
        "dumped": (_on_dumped, False),
        "gpu_fault": (_on_gpu_fault, False),
        "heartbeat": (_on_heartbeat, False),
        "warning": (_on_warning, False),
        "checkpoint_files": (_on_checkpoint_files, True),
    }
