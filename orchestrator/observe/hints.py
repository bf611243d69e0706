"""What to do after a job stopped short: the command that continues it, or what to fix first.

Every hint is true for the cause it follows. A lost node is left out of the resume (a spare host takes
its place, or the job runs on the nodes left); a node that could not be set up is fixed (or left out)
before a resume; a problem in the job's spec gets no resume hint, since a resume runs the job's stored
spec and would fail the same way: it needs a new job from the fixed spec.
"""

from __future__ import annotations

from typing import Any

__all__ = ["next_steps", "SPEC_CHECKS"]

#: Preflight checks about what the spec names (its Python, workdir, entrypoint, the network settings of
#: its env and master_addr): failing on every node, the spec itself is wrong; on some nodes only, those
#: nodes are.
SPEC_CHECKS = ("python", "workdir", "entrypoint", "network")


def next_steps(detail: dict[str, Any]) -> list[str]:
    """The hints for a job (:func:`orchestrator.observe.job_detail`), each one line; ``[]`` for a job
    that is running or succeeded, or whose restart policy already restarts it."""
    if detail.get("state") not in ("FAILED", "CANCELLED"):
        return []
    job = detail["id"]
    cause = detail.get("cause") or {}
    kind = cause.get("kind")
    if kind == "allocation":  # Slurm refused, or never granted, the nodes (slurm from a login node)
        return [f"fix the request (the spec's num_nodes, num_gpus, slurm.sbatch_args; or slurm.queue_timeout), then "
                f"run the fixed spec as a new job (orch run SPEC); if it was only the queue: orch resume {job}"]
    if (detail.get("state") == "CANCELLED" or kind in (None, "cancelled")) and not detail.get("attempts"):
        return [f"it never started (cancelled while waiting for its nodes); start it again: orch resume {job}"]
    if detail.get("state") == "CANCELLED" or kind in (None, "cancelled"):
        return [f"resume it from its last complete checkpoint: orch resume {job}"]
    if kind == "node_lost":
        hosts = ",".join(cause.get("nodes") or [cause.get("node") or "HOST"])
        return [f"resume without the lost node: orch resume {job} --exclude {hosts} (a spare host of the hostfile "
                "takes its place; without one the job continues on the nodes left); once it is back, "
                f"orch resume {job} uses it again"]
    if kind == "gpu_fault":
        host = cause.get("node") or "HOST"
        return [f"resume without the node whose GPU failed: orch resume {job} --exclude {host} (a spare host of the "
                f"hostfile takes its place); have the GPU checked (nvidia-smi -q, the driver's log: "
                f"the cause names the Xid or ECC error), then orch doctor SPEC before using {host} again"]
    if kind == "startup_timeout":
        return [f"free what the ranks wait on (named above: a build lock to delete, a master that is not up), then: "
                f"orch resume {job}; if the script reports no step at all (no agents.report, no DeepSpeed engine, no "
                "step=<n> line), run it with startup_timeout: null"]
    if kind in ("controller_lost", "controller_stalled"):  # orch's own trouble: nothing in the job to fix
        return [f"resume from the last complete checkpoint: orch resume {job} (nothing in the job to fix: its "
                "controller died or stalled; under orch server, run a server on this state dir to have it done)"]
    if kind == "store_full":
        return [f"free space on the state directory's disk (the cause names it), then: orch resume {job}"]
    if kind == "provision_failed":
        return _provision_steps(job, cause)
    if kind == "preflight_failed":
        return _preflight_steps(job, cause, len(_nodes_of(detail)))
    if kind == "spawn_failed" and cause.get("launcher"):  # launch_mode native: the real tool did not start them
        return [f"read the launcher's output ({cause['launcher']} in the attempt's logs: launcher.log) and fix its "
                "installation on the first node or the spec's launcher_args, then run the fixed spec as a new job "
                "(orch run SPEC); orch plan SPEC shows the command it runs"]
    if kind == "spawn_failed":
        return [f"fix the rank's command (the spec's python or entrypoint, or the node named above), then run the "
                f"fixed spec as a new job (orch run SPEC); if the node was at fault: orch resume {job}"]
    if kind == "rank_exit" and cause.get("after_last_step") is not None:
        return [f"the rank had reported its last step (step {cause['after_last_step']}) and failed on its way out: "
                "read the end of its log above (a crash in the interpreter's teardown, e.g. gloo's 'terminate called "
                "without an active exception', exits with SIGABRT); what it saved is as it left it, and "
                f"orch resume {job} starts from its last complete checkpoint"]
    return [f"resume from the last complete checkpoint: orch resume {job} (after fixing the cause above, where it is "
            "in the script or its data)"]


def _nodes_of(detail: dict[str, Any]) -> list[str]:
    attempts = detail.get("attempts") or []
    return list(attempts[-1].get("nodes") or []) if attempts else []


def _provision_steps(job: str, cause: dict[str, Any]) -> list[str]:
    hosts = ",".join(n["node"] for n in cause.get("nodes") or [] if n.get("node")) or "HOST"
    return [f"fix the node(s) first (each reason is above: a host down, sshd not running, a key or host key not "
            f"accepted, the spec's Python missing there), then: orch resume {job}",
            f"or leave them out: orch resume {job} --exclude {hosts}"]


def _preflight_steps(job: str, cause: dict[str, Any], nodes: int) -> list[str]:
    failures = cause.get("failures") or []
    failing: dict[str, set[str]] = {}
    for f in failures:
        failing.setdefault(f.get("check", ""), set()).update(f.get("nodes") or [f.get("node")])
    in_spec = sorted(check for check, where in failing.items() if check in SPEC_CHECKS and nodes and len(where) >= nodes)
    on_nodes = sorted(check for check in failing if check not in in_spec)
    steps = []
    if in_spec:
        steps.append(f"fix the spec ({', '.join(in_spec)} failed on every node) and run it again as a new job: "
                     "orch run SPEC; a resume would run the job's stored spec and fail the same way")
    if on_nodes:
        steps.append(f"fix {', '.join(on_nodes)} on the nodes named above, then: orch resume {job}"
                     if not in_spec else f"and fix {', '.join(on_nodes)} on the nodes named above")
    return steps
