"""The I/O part of planning an attempt: what the pure planner needs, gathered from the world.

:func:`prepare_plan` reads the hostfile (or asks the provisioner for its nodes), applies the filters
and orch's own ``exclude_hosts``, checks the nodes can be reached as the provisioner is configured,
reads the job's DeepSpeed and Accelerate configs and the ``.deepspeed_env`` files DeepSpeed's runner
reads, reserves the master port, and calls :func:`orchestrator.planning.make_plan`.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from agents import devices, network
from agents.nodeenv import rank_env

from ..checkpoints.detect import detect_format, get_format
from ..errors import FilterError, HostfileError, PlanError, SpecError
from ..launchers.deepspeed import ACCELERATOR_EXPORT_PREFIXES, deepspeed_env_files
from ..planning import JobPlan, PlanInputs, ResourcePool, load_hostfile, make_plan, resolve_pool
from ..provisioners import Provisioner, get_provisioner
from ..spec import JobSpec, job_deepspeed
from .ports import PortLease, default_lock_dir, reserve_port

__all__ = ["prepare_plan", "pool_of", "checkpoint_dir_of", "resume_dir_of", "rank_python", "network_preview", "checkpoint_watch"]


def checkpoint_dir_of(spec: JobSpec, state_dir: str | Path, job_id: str) -> str:
    """The job's checkpoint directory: the spec's, else ``<state dir>/jobs/<job id>/checkpoints``."""
    return spec.checkpoint_dir or str((Path(state_dir) / "jobs" / job_id / "checkpoints").resolve())


def output_dir_arg(spec: JobSpec) -> str | None:
    """The ``--output_dir`` (or ``--output-dir``) the spec's arguments give the script (HF Trainer's
    ``TrainingArguments.output_dir``, where it writes ``checkpoint-<N>``), absolute (relative: to the
    workdir; the last given, as argparse reads them); None if they give none."""
    if not spec.args:
        return None
    from ..spec.deepspeed_cmd import script_flag  # (only then: ~7 ms of import for orch plan)
    found = script_flag(spec.args, ("--output_dir", "--output-dir"))
    return str((Path(spec.workdir) / os.path.expanduser(found[1])).resolve()) if found else None


def resume_dir_of(spec: JobSpec, state_dir: str | Path, job_id: str) -> str:
    """Where the job's checkpoints are looked for: the spec's ``resume.dir``; else its ``checkpoint_dir``;
    else the ``--output_dir`` its arguments give (an HF Trainer script's); else orch's directory for the job."""
    return (spec.resume.dir or spec.checkpoint_dir or output_dir_arg(spec)
            or checkpoint_dir_of(spec, state_dir, job_id))


def checkpoint_watch(spec: JobSpec, state_dir: str | Path, job_id: str) -> dict:
    """What every agent watches for checkpoint files to hash (``agents.manifest.CheckpointWatch``): the
    resume directory (for ``auto``, every directory in it; a format's own names otherwise)."""
    root = resume_dir_of(spec, state_dir, job_id)
    fmt = spec.resume.format
    if fmt == "auto":
        found, _ = detect_format(root)
        fmt = found if any(Path(root).glob("*")) else None
    directory, pattern = get_format(fmt).watch_dir(root) if fmt else (root, r"[^.].*")
    return {"dir": directory, "tag_pattern": pattern, "hash": spec.resume.hash,
            "sample_above": int(spec.resume.sample_above_mib * (1 << 20)), "interval_s": spec.resume.watch_seconds}


def _deepspeed_env_lines(workdir: str) -> tuple[str, ...]:
    """Lines of the ``.deepspeed_env`` files DeepSpeed's runner would read (home, then workdir)."""
    lines: list[str] = []
    for path in deepspeed_env_files(os.environ, os.path.expanduser("~"), workdir):
        if os.path.isfile(path):
            with open(path) as f:
                lines += f.readlines()
    return tuple(lines)


def _accelerator() -> str:
    """DeepSpeed's accelerator name without importing DeepSpeed: ``DS_ACCELERATOR``, else CUDA when
    an NVIDIA device is present, else CPU."""
    return os.environ.get("DS_ACCELERATOR") or ("cuda" if os.path.exists("/dev/nvidiactl") else "cpu")


def _accelerator_exports() -> tuple[str, ...]:
    """``get_accelerator().export_envs()`` without importing DeepSpeed (see :func:`_accelerator`)."""
    return tuple(ACCELERATOR_EXPORT_PREFIXES.get(_accelerator(), ()))


def _deepspeed_dir() -> str:
    """The installed ``deepspeed`` package's directory, found without importing it ("" if none)."""
    try:
        found = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return ""
    return os.path.dirname(found.origin) if found and found.origin else ""


def _hostfile_is_pool(spec: JobSpec) -> bool:
    """The spec's hostfile as written is the pool: nothing filters or excludes any of it."""
    return bool(spec.hostfile) and not (spec.include or spec.exclude or spec.exclude_hosts) \
        and spec.num_nodes == -1 and spec.num_gpus == -1


def rank_python(spec: JobSpec) -> str:
    """The ranks' interpreter as an absolute path (the real launchers run their resolved one)."""
    if not spec.python:
        return sys.executable
    return shutil.which(spec.python) or spec.python


def prepare_plan(spec: JobSpec, state_dir: str | Path, job_id: str, *, attempt: int = 1,
                 resume_tag: str | None = None, hold_port: bool = True,
                 resume_universal_from: str | None = None, resume_args: tuple[str, ...] = (),
                 resume_env: dict[str, str] | None = None,
                 provisioner: Provisioner | None = None, offline: bool = False) -> tuple[JobPlan, PortLease]:
    """Gather what the planner needs (the I/O part) and plan one attempt.

    Reads the hostfile, applies the filters, checks the nodes can be reached as the
    provisioner is configured (keys, names), reads the DeepSpeed (and Accelerate) config and
    resolves it for the pool's world size (``orchestrator.spec.job_deepspeed``),
    reserves the master port, then calls the pure :func:`orchestrator.planning.make_plan`.

    Args:
        spec: the validated spec.
        state_dir: orch's state directory (run directories).
        job_id: the job's id.
        attempt: 1-based attempt number.
        resume_tag: the checkpoint tag to resume from, or None.
        hold_port: keep the port reserved; False for ``orch plan``, which only looks: then nothing is
            started or joined either (a Ray cluster is read, not joined; no Ray is started).
        resume_universal_from: when ``resume_tag`` is a universal checkpoint, the tag it was
            converted from (see :class:`orchestrator.planning.PlanInputs`).
        resume_args, resume_env: how the resumed script is told its checkpoint (:class:`PlanInputs`).
        provisioner: the one to plan for (default: the spec's, made here); a queued attempt's is the one
            inside the allocation granted to it.
        offline: ``orch plan --offline``, for hosts this machine cannot reach: the checks that need them
            (reaching them as the provisioner is configured, names resolving) are skipped and listed among the
            plan's warnings, and host names stand as written for the addresses they would resolve to.

    Returns:
        ``(plan, lease)``; release the lease when the attempt is over.

    Raises:
        OrchError: HostfileError, FilterError, SpecError, PlanError, LaunchError, ProvisionError.
    """
    state_dir = Path(state_dir)
    if provisioner is None:
        provisioner = get_provisioner(spec.provisioner, spec, look_only=not hold_port)
    pool = pool_of(spec, provisioner)
    skipped = OFFLINE_SKIPS.get(spec.provisioner, OFFLINE_SKIPS["local"]) if offline else ()
    if not offline:
        provisioner.check(pool)
    _check_assigned_devices(spec, pool)
    if attempt == 1 and not provisioner.granted:  # a restart that has just used the spare must still run;
        # nodes a scheduler granted this attempt alone are asked for again (without the lost ones) by a restart
        _check_restart_policy(spec, provisioner, pool)
    job_ds = job_deepspeed(spec, [len(slots) for _, slots in pool.nodes], os.environ)  # resolved for this world
    if spec.master_addr and not offline:
        _check_resolves(spec.master_addr)
    address = (lambda host: host) if offline else provisioner.master_addr  # noqa: E731 - offline: names as written
    master_addr = spec.master_addr or address(pool.hosts[0])
    lease = reserve_port(default_lock_dir(), spec.master_port, master_addr,
                         check_bind=spec.provisioner == "local", hold=hold_port)
    try:
        job_dir = state_dir / "jobs" / job_id
        inputs = PlanInputs(
            job_id=job_id, attempt=attempt, master_port=lease.port,
            run_dir=str((job_dir / f"attempt-{attempt}").resolve()),
            checkpoint_dir=checkpoint_dir_of(spec, state_dir, job_id),
            python=rank_python(spec), default_master_addr=master_addr,
            resume_tag=resume_tag, resume_universal_from=resume_universal_from,
            controller_env=dict(os.environ), controller_cwd=spec.workdir,
            deepspeed_env_lines=_deepspeed_env_lines(spec.workdir),
            deepspeed_config=job_ds.config, accelerator_exports=_accelerator_exports(),
            accelerator=_accelerator(), deepspeed_dir=_deepspeed_dir(), hostfile_is_pool=_hostfile_is_pool(spec),
            accelerate_env_defaults=job_ds.env_defaults(),
            config_warnings=tuple(job_ds.warnings) + provisioner.plan_notes(),
            resume_args=tuple(resume_args), resume_env=dict(resume_env or {}),
            checkpoint_watch=checkpoint_watch(spec, state_dir, job_id), resume_dir=resume_dir_of(spec, state_dir, job_id),
            node_addresses={} if spec.metrics_addr != "auto" or spec.metrics_port is None else
            {host: address(host) for host in dict.fromkeys(pool.hosts)})
        inputs = dataclasses.replace(inputs, accelerate_env=job_ds.env(inputs.deepspeed_config_path))
        plan = make_plan(spec, pool, inputs)
        plan = dataclasses.replace(plan, deepspeed_autos=job_ds.autos, warnings=plan.warnings + tuple(skipped))
        return plan, lease
    except BaseException:
        lease.release()
        raise


#: What ``orch plan --offline`` does not check, by provisioner (said among the plan's warnings).
OFFLINE_SKIPS = {
    "local": ("offline: not checked: that master_addr resolves",),
    "ssh": ("offline: not checked: that each host's name resolves, that its host key is in known_hosts, that the "
            "identity files can be used, and that master_addr resolves; addresses are the host names as written",),
    "slurm": ("offline: not checked: that master_addr resolves",),
    "ray": ("offline: not checked: that master_addr resolves (the Ray cluster is still read)",),
}


def _check_assigned_devices(spec: JobSpec, pool: ResourcePool) -> None:
    """Local agents' node environment is this one: slots past its CUDA_VISIBLE_DEVICES are refused now
    (other provisioners' agents check their node's own, before any rank starts: agents.devices).

    Raises:
        PlanError: a node uses a slot the assigned devices do not have.
    """
    assigned = devices.assigned(os.environ) if spec.provisioner == "local" else None
    if assigned is None:
        return
    twice = devices.duplicate(os.environ)
    if twice is not None:
        raise PlanError(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} (set before orch started, by the "
                        f"scheduler or you) names device {twice} twice: two slots would share it.")
    for host, slots in pool.nodes:
        if slots and max(slots) >= len(assigned):
            raise PlanError(f"{host} uses slot(s) {','.join(map(str, slots))}, but CUDA_VISIBLE_DEVICES="
                            f"{os.environ['CUDA_VISIBLE_DEVICES']} (set before orch started, by the scheduler or you) "
                            f"gives this machine {len(assigned)} device(s): slots are positions in that list "
                            f"(0..{len(assigned) - 1}); use fewer slots or a filter within them.")


def _check_restart_policy(spec: JobSpec, provisioner: Provisioner, pool: ResourcePool) -> None:
    """A policy that restarts without a lost node needs somewhere to restart.

    A spare host takes the lost one's place; without one, a job that uses every host
    (``num_nodes`` and ``include`` not set) restarts on the nodes left, from its last checkpoint
    converted to DeepSpeed's universal format (:func:`orchestrator.checkpoints.convert_to_universal`).
    A fixed ``num_nodes`` or ``include`` with no host beyond them, or a single host, cannot be
    satisfied.

    Raises:
        SpecError: ``exclude_failed_nodes`` with no host to restart on.
    """
    policy = spec.restart
    if not (policy.exclude_failed_nodes and policy.max_restarts and "node_lost" in policy.retry_on):
        return
    every = pool_of(spec.model_copy(update={"num_nodes": -1}), provisioner)
    if len(every.nodes) > len(pool.nodes):
        return
    if spec.num_nodes == -1 and not spec.include and len(pool.nodes) > 1:
        return  # the restart runs on fewer nodes
    if spec.num_nodes != -1:
        why = (f"num_nodes is {spec.num_nodes} and the hostfile (after the filters) has no host beyond them: "
               f"a restart without a lost node would have nowhere to go")
        fix = f"set num_nodes below its {len(every.nodes)} host(s), "
    elif spec.include:
        why = (f"include {spec.include!r} names every host the job uses: a restart without a lost node would "
               "have nowhere to go")
        fix = ""
    else:
        why = "the job runs on a single host: a restart without it would have no node to run on"
        fix = ""
    raise SpecError(f"restart.exclude_failed_nodes: {why}. Add a spare host to the hostfile, {fix}or turn "
                    "exclude_failed_nodes off.")


def pool_of(spec: JobSpec, provisioner: Provisioner) -> ResourcePool:
    """The filtered resource pool of a spec, refusing pools a job cannot run on.

    The hosts are the hostfile's; without one, what the provisioner finds (a Ray
    cluster's nodes), else ``localhost`` with ``num_gpus`` (or 1) slots.

    Raises:
        HostfileError: the hostfile is bad, or a host left in the pool has ``slots=0``
            (named with its line).
        FilterError: the filters are bad, or leave no slot at all.
    """
    discovered = None if spec.hostfile else provisioner.discover()
    if spec.hostfile or discovered:
        hosts = load_hostfile(spec.hostfile) if spec.hostfile else discovered
        source = spec.hostfile or f"<the {provisioner.name} cluster's nodes>"
        # a host missing from a discovered pool is simply gone (a dead Ray node); from a hostfile, a typo
        unknown = [h for h in spec.exclude_hosts if h not in hosts] if spec.hostfile else []
        if unknown:
            raise FilterError(f"exclude_hosts names {', '.join(unknown)}, not in {source} (its hosts: "
                              f"{', '.join(hosts)}).")
        for host in spec.exclude_hosts:  # orch's own exclusion (lost nodes): before DeepSpeed's filters
            hosts.pop(host, None)
        if not hosts:
            raise FilterError(f"exclude_hosts leaves no host of {source}.")
    else:  # DeepSpeed's runner: the devices CUDA_VISIBLE_DEVICES leaves this machine, else num_gpus, else 1
        assigned = devices.assigned(os.environ) if spec.provisioner == "local" else None
        count = spec.num_gpus if spec.num_gpus > 0 else len(assigned) if assigned else 1
        hosts = collections.OrderedDict(localhost=count)
        source = "<no hostfile: localhost>"
    pool = resolve_pool(hosts, spec.include, spec.exclude, spec.num_nodes, spec.num_gpus, source=source)
    empty = [host for host, slots in pool.nodes if not slots]
    if empty:
        where = ", ".join(f"{h} (line {getattr(hosts, 'lines', {}).get(h, '?')})" for h in empty)
        raise HostfileError(f"Hostfile {source}: host(s) {where} have slots=0, so they would run no rank; "
                            "remove those lines or exclude the hosts.", path=source)
    _check_counts_fit(spec, hosts, pool, source)
    if not pool.nodes:
        used = " and ".join(f"{name} {getattr(spec, name)!r}" for name in ("include", "exclude")
                            if getattr(spec, name))
        raise FilterError(f"No slot of hostfile {source} is left after {used or 'the filters'}; "
                          f"the hostfile has {', '.join(hosts)}.")
    return pool


#: How long the spec's master_addr may take to resolve here (seconds).
RESOLVE_TIMEOUT_S = 5.0


def _check_resolves(addr: str) -> None:
    """The spec's ``master_addr`` must resolve (an IP address is not looked up), within
    :data:`RESOLVE_TIMEOUT_S`: a name that does not would leave every rank waiting in the rendezvous.

    Raises:
        PlanError: it does not resolve, or not in time.
    """
    import ipaddress
    import socket
    import threading
    try:
        ipaddress.ip_address(addr)
        return
    except ValueError:
        pass
    found: dict[str, Any] = {}

    def look() -> None:
        try:
            found["ok"] = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as err:
            found["error"] = getattr(err, "strerror", None) or str(err)
    t = threading.Thread(target=look, name="resolve-master", daemon=True)
    t.start()
    t.join(RESOLVE_TIMEOUT_S)
    if "ok" in found:
        return
    why = found.get("error") or f"no answer within {RESOLVE_TIMEOUT_S:g} s"
    raise PlanError(f"master_addr {addr!r} does not resolve on this machine ({why}); expected a host name every "
                    "node can resolve, or an IP address (DeepSpeed would leave every rank waiting in the rendezvous).")


def _check_counts_fit(spec: JobSpec, hosts: collections.OrderedDict, pool: ResourcePool, source: str) -> None:
    """``num_gpus`` and ``num_nodes`` must fit the hosts: where DeepSpeed's runner only warns (num_gpus over
    a host's slots: the node then fails at start; num_nodes over the hosts: fewer nodes, a different world
    size), orch refuses at plan time, naming the hosts and lines (docs/jobspec.md)."""
    lines = getattr(hosts, "lines", {})
    via = " (from accelerate_config's num_machines/num_processes)" if spec.accelerate_config else ""
    if spec.num_gpus > 0:
        short = [h for h, _ in pool.nodes if hosts.get(h, 0) < spec.num_gpus]
        if short:
            where = ", ".join(f"{h} slots={hosts[h]}" + (f" (line {lines[h]})" if h in lines else "")
                              for h in short[:5]) + (f" and {len(short) - 5} more" if len(short) > 5 else "")
            raise HostfileError(f"num_gpus={spec.num_gpus}{via} is more than the slots {source} gives {where}; "
                                "expected num_gpus at most every used host's slots (DeepSpeed would start the "
                                "ranks and fail on the node).", path=source)
    if spec.num_nodes > len(pool.nodes):
        left = f"{len(pool.nodes)} host(s) ({', '.join(h for h, _ in pool.nodes)})" if len(pool.nodes) <= 8 \
            else f"{len(pool.nodes)} hosts"
        raise FilterError(f"num_nodes={spec.num_nodes}{via} is more than the {left} {source} has"
                          f"{' after exclude_hosts' if spec.exclude_hosts else ''}; expected at most that many "
                          "(DeepSpeed would run on fewer nodes, with a different world size).")


def network_preview(plan: JobPlan) -> dict[int, str]:
    """Each node's interface for the ranks' collectives, as ``orch plan`` can tell it without starting
    anything: the job's own ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``; for local agents (this
    machine) the interface :func:`agents.network.choose` picks here; on other machines, what the node's
    agent will choose there (the interface that routes to the master address).
    """
    out = {}
    elsewhere = f"chosen on the node: the one that routes to {plan.master_addr}"
    for node in plan.nodes:
        # what the plan gives a rank, whatever the node's own: its defaults, then its own variables (rank_env would
        # add PATH and TORCH_EXTENSIONS_DIR, no interface, at ~3 ms a node for 4,096 nodes: only for local agents);
        # looked up in both, not merged into a new dict (~4 us a node of 36 variables)
        own, defaults = (node.ranks[0].env if node.ranks else {}), node.env_defaults
        values = [(k, own[k] if k in own else defaults.get(k)) for k in network.IFNAME_VARS]
        user = ", ".join(f"{k}={v}" for k, v in values if v)
        if plan.provisioner == "local":  # a local agent's node environment is this process's
            first = node.ranks[0].to_dict() if node.ranks else {}
            choice = network.choose(rank_env(dict(os.environ), node.to_dict(), first), node.master)
            out[node.node_rank] = (f"problem: {choice.detail}" if choice.problem else
                                   f"{choice.ifname} ({choice.address})" + (f", {user}" if user else ""))
        elif user:
            out[node.node_rank] = f"{user} (the job's environment)"
        else:
            out[node.node_rank] = elsewhere
    return out
