"""The commands that start and stop jobs: ``plan``, ``run``, ``submit``, ``resume``, ``cancel``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
import uuid
import time
from typing import Any, Callable, Iterable, Iterator

from rich.text import Text

from agents import devices

from .backends import StoreBackend, http_backend, find_server, pick_backend, state_dir_of
from .options import load_job, report_shell_env
from .output import UsageError, console, emit_detail, err_console, print_json
from .planview import SUMMARY_ABOVE_NODES, print_layout, print_real_commands


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, as it was after. ``orch plan`` of 4,096 x 8 makes about a
    million containers (ranks, their environments and argvs, then their JSON-able copies), none of them garbage
    until the command ends: the collector's passes over them took ~0.2 s of the command's ~1.5 s."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def cmd_plan(args: argparse.Namespace) -> int:
    """``orch plan``: the plan of the job, nothing started (table or ``--output json``)."""
    with _gc_paused():
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    from ...spec.secrets import redact
    from ...supervision.prepare import network_preview, prepare_plan
    spec = load_job(args)
    plan, _lease = prepare_plan(spec, state_dir_of(args), f"{spec.name}-plan", hold_port=False,
                                offline=getattr(args, "offline", False))
    interfaces = network_preview(plan)
    plan = redact(plan, spec.secret_env)  # what is shown: secret-looking values are **** (docs/security.md)
    report_shell_env(args)
    if args.output == "json":
        whole = {**plan.to_dict(shared=True), "network": {str(n): v for n, v in interfaces.items()}}
        if len(plan.nodes) > SUMMARY_ABOVE_NODES:  # on one line (indent=2 took 2 s of 4,096 x 8): planjson's docstring
            from .planjson import iterencode_plan
            return _to_stdout(iterencode_plan(whole))
        print_json(whole)
        return 0
    c = console
    summary = len(plan.nodes) > SUMMARY_ABOVE_NODES and not getattr(args, "all", False)  # planview's docstring
    c.print(Text(f"Plan for job '{plan.job_name}' (nothing started)", style="bold"))
    c.print(f"launcher {plan.launcher}, provisioner {plan.provisioner}, {len(plan.nodes)} node(s), "
            f"world size {plan.world_size}, master {plan.master_addr}:{plan.master_port}",
            markup=False, highlight=False)
    for w in plan.warnings:  # at the top, where a reader starts: what will not run as written comes first
        err_console.print(Text(f"warning: {w}", style="yellow"), soft_wrap=True)
    here = print_layout(plan, interfaces, summary, getattr(args, "all", False))
    c.print(devices_line(plan, here), markup=False, highlight=False, soft_wrap=True)
    defaults = {k: v for n in plan.nodes for k, v in n.env_defaults.items()}
    if defaults:
        c.print("Set where a node's environment lacks them: " +
                " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(defaults.items())), markup=False,
                highlight=False, soft_wrap=True)
    firsts = sorted({n.path_prepend for n in plan.nodes if n.path_prepend})
    if firsts:
        c.print(f"PATH of every rank starts with {', '.join(firsts)} (the ranks' Python's directory; "
                "prepend_python_bin), unless it is on the node's PATH already", markup=False, highlight=False,
                soft_wrap=True)
    if plan.deepspeed_config:
        c.print(Text(f"DeepSpeed config, resolved (a run writes it to {plan.deepspeed_config_path}):", style="bold"))
        c.print(json.dumps(plan.deepspeed_config, indent=2), markup=False, highlight=False, soft_wrap=True)
    if plan.deepspeed_autos:
        c.print(autos_line(plan.deepspeed_autos), markup=False, highlight=False, soft_wrap=True)
    ops = ops_line(spec, plan)
    if ops:
        c.print(ops, markup=False, highlight=False, soft_wrap=True)
    for line in zero_pp_lines(plan):
        c.print(line, markup=False, highlight=False, soft_wrap=True)
    c.print(checkpoints_line(spec, plan), markup=False, highlight=False, soft_wrap=True)
    print_real_commands(plan, summary)
    native = plan.nodes[0].native.get("command") if plan.nodes and plan.nodes[0].native else None
    if native:
        c.print(Text(f"launch_mode native: the agent on {plan.nodes[0].host} runs (the first of "
                     f"{', '.join(native['tools'])} on its PATH; {native['shim_token']} is orch's per-rank program):",
                     style="bold"))
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in native["env"].items())
        c.print(f"  {prefix + ' ' if prefix else ''}{shlex.join(native['argv'])}", markup=False, highlight=False,
                soft_wrap=True)
    if plan.warnings:
        err_console.print(Text(f"{len(plan.warnings)} warning(s), shown above the plan", style="yellow"))
    return 0


#: the exit status of a command whose reader went away (a shell's for one killed by SIGPIPE, as `cat` is)
EXIT_READER_GONE = 128 + 13


def _to_stdout(pieces: Iterable[str]) -> int:
    """Write ``pieces`` and a newline to standard output; 0, or :data:`EXIT_READER_GONE` without a word
    when the reader closed the pipe (``orch plan -o json big.yaml | head -c 100``): the rest is not
    written, and standard output points at /dev/null so the interpreter's last flush does not fail."""
    try:
        _write_joined(pieces, sys.stdout.write)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_READER_GONE
    return 0


def _write_joined(pieces: Iterable[str], write: Callable[[str], Any], at_least: int = 1 << 18) -> None:
    """``write`` each run of ``pieces`` joined, once it holds ``at_least`` characters (and the rest at the end).
    A write per node of a plan of 4,096 (7.5 KB each) cost ~20-80 ms more into a pipe than 256 KiB at a time."""
    run: list[str] = []
    size = 0
    for piece in pieces:
        run.append(piece)
        size += len(piece)
        if size >= at_least:
            write("".join(run))
            run, size = [], 0
    if run:
        write("".join(run))


def devices_line(plan, here) -> str:
    """How slots become devices: positions in a node's own CUDA_VISIBLE_DEVICES (the scheduler's), if set."""
    assigned = devices.assigned(here)
    if assigned is not None:
        return (f"devices: CUDA_VISIBLE_DEVICES={','.join(assigned)} on this machine (the scheduler's or yours): slot k "
                "is its k-th device, and every rank's CUDA_VISIBLE_DEVICES is mapped to those")
    if plan.provisioner == "local":
        return "devices: slot k is device k (no CUDA_VISIBLE_DEVICES here)"
    return ("devices: on a node whose environment has CUDA_VISIBLE_DEVICES (set by the scheduler), slot k is its k-th "
            "device; elsewhere device k")


def checkpoints_line(spec, plan) -> str:
    """Where a resume of the job looks for checkpoints, in which format, and how it tells the script."""
    from ...checkpoints.detect import detect_format
    fmt, why = (spec.resume.format, "resume.format") if spec.resume.format != "auto" else detect_format(plan.resume_dir)
    args = spec.resume.resume_args(fmt)
    told = (f"adds {' '.join(args)}" if args else
            "points DeepSpeed's latest at the chosen tag" if spec.resume.rewrites_latest(fmt) else
            "sets ORCH_RESUME_CHECKPOINT and ORCH_RESUME_TAG only")
    return (f"checkpoints: {plan.resume_dir} ({fmt} format: {why}); agents hash them ({spec.resume.hash}); "
            f"a resume {told}")


def zero_pp_lines(plan) -> list[str]:
    """What the resolved DeepSpeed config's ZeRO++ options do on this plan (``orchestrator.spec.dszero.explain``:
    quantized weights and gradients, the hpZ groups with their hosts, the accelerator quantisation needs)."""
    from ...spec.dszero import explain
    if not plan.deepspeed_config:
        return []
    return explain(plan.deepspeed_config, [(n.host, [r.global_rank for r in n.ranks]) for n in plan.nodes])


def ops_line(spec, plan) -> str | None:
    """What the preflight builds (or finds built) on every node before the ranks start: the DeepSpeed ops
    of the job's config (``orchestrator.spec.dsops``); None when the preflight does not build them."""
    from ...spec.dsops import ops_needed
    from ...supervision.preflight import skipped_checks
    if not spec.preflight.enabled or "ops" in skipped_checks(spec, plan):
        return None
    ops = ops_needed(plan.deepspeed_config)
    return ("DeepSpeed ops the preflight builds, or finds built, on every node before the ranks start: "
            + ", ".join(f"{op['name']} ({op['why']})" for op in ops))


def autos_line(autos: dict) -> str:
    """``deepspeed config: "auto" values filled by the script (detected: ...); left auto: a, b`` (a plan's
    ``deepspeed_autos``: ``{"filled_by", "why", "left_auto"}``)."""
    who = "the script" if autos["filled_by"] == "script" else "orch"
    left = f"; left auto: {', '.join(autos['left_auto'])}" if autos.get("left_auto") else ""
    return f"deepspeed config: \"auto\" values filled by {who} ({autos['why']}){left}"


def cmd_run(args: argparse.Namespace) -> int:
    from ...supervision import Controller
    from .follow import follow_embedded  # (here: orch plan does without the store's views, ~40 ms to import)
    spec = load_job(args)
    controller = Controller(state_dir_of(args))
    try:
        job = controller.submit(spec)
        report_shell_env(args)
        if args.output != "json":
            console.print(f"Submitted job {job.id} ({spec.launcher} launcher, state dir {controller.state_dir})",
                           markup=False, highlight=False)
        return follow_embedded(controller, job.id, args)
    finally:
        controller.close(cancel=True)


def _resume_preview(args: argparse.Namespace, url: str | None) -> int:
    from .render import resume_preview_lines  # here, not at the top: orch plan does without rich's tables
    if url:
        preview = http_backend(args, url).resume_preview(args.job, args.exclude)
    else:
        from ...supervision import Controller
        StoreBackend(state_dir_of(args)).store  # noqa: B018 - a clear error when there are no jobs at all
        controller = Controller(state_dir_of(args))
        try:
            preview = controller.resume_preview(args.job, exclude_hosts=args.exclude)
        finally:
            controller.close(cancel=False)
    code = 0 if not preview.get("refused") and (preview["resume_tag"] or (preview.get("fresh_start") or "")
                                                .startswith("no checkpoint was ever")) else 2
    if args.output == "json":
        print_json(preview)
        return code
    for line in resume_preview_lines(preview):
        console.print(line, markup=False, highlight=False)
    return code


def cmd_resume(args: argparse.Namespace) -> int:
    from .render import start_checkpoint
    url = find_server(args)
    if args.dry_run:
        return _resume_preview(args, url)
    if url:
        detail = http_backend(args, url).resume(args.job, args.exclude, args.fresh)
        if _waits_for_nodes(detail):
            emit_detail(detail, args, f"Resumed job {detail['id']}: its next attempt waits for the nodes it asked "
                                       f"Slurm for (orch status {detail['id']})")
            return 0
        start = start_checkpoint(detail["attempts"][-1])
        emit_detail(detail, args, f"Resumed job {detail['id']}: attempt {detail['attempt']} from checkpoint "
                                   f"{start if start != '-' else '(none: from the start)'}")
        return 0
    from ...supervision import Controller
    from .follow import follow_embedded
    state_dir = state_dir_of(args)
    StoreBackend(state_dir).store  # noqa: B018 - a clear error when there are no jobs at all
    controller = Controller(state_dir)
    try:
        before = controller.store.events(controller.get(args.job).id)
        job = controller.resume(args.job, exclude_hosts=args.exclude, fresh=args.fresh)
        if controller.busy(job.id) and controller.active_run(job.id) is None:  # its nodes are to come (Slurm)
            if args.output != "json":
                console.print(f"Resuming job {job.id}: its next attempt waits for the nodes it asks Slurm for",
                              markup=False, highlight=False)
            return follow_embedded(controller, job.id, args, since_event=before[-1].id if before else 0)
        attempt = controller.store.get_attempt(job.id, job.attempt)
        if args.output != "json":
            start = start_checkpoint(attempt.to_dict())
            none = "(none: from step 0, as --fresh asks)" if args.fresh else "(none found: from the start)"
            console.print(f"Resuming job {job.id}: attempt {job.attempt} from checkpoint "
                           f"{start if start != '-' else none}", markup=False, highlight=False)
        return follow_embedded(controller, job.id, args, since_event=before[-1].id if before else 0)
    finally:
        controller.close(cancel=True)


def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_job(args)
    from ..limits import idempotency_key_ok
    key = args.idempotency_key
    if key is not None and not idempotency_key_ok(key):
        raise UsageError(f"--idempotency-key {key!r}: expected 1 to 200 printable ASCII characters.")
    url = find_server(args)
    if not url:
        raise UsageError(f"No orch server is running for state dir {state_dir_of(args)}. Start one with "
                         "`orch server`, or run the job in the foreground with `orch run`.")
    key = key or f"orch-submit-{uuid.uuid4()}"  # one per invocation: its own retries are one submit
    detail = http_backend(args, url).submit(spec.to_dict(), str(args.spec), key)
    report_shell_env(args)
    emit_detail(detail, args, f"Submitted job {detail['id']}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Ask for the cancel, then say what happens: cancelling (and how to wait), cancelled, or nothing to
    cancel. With ``--wait S``: exit 0 once every process is gone, 1 if it is still stopping after S s."""
    backend = pick_backend(args)
    before = backend.detail(args.job)
    ended, queued = _stopped(before), _waits_for_nodes(before)
    detail = backend.cancel(args.job)
    job = detail["id"]
    if ended:
        emit_detail(detail, args, f"Job {job} had already ended ({detail['state']}); nothing is running (an "
                                  "automatic restart it was waiting for, if any, is called off)")
        return 0
    if not args.wait and queued:
        emit_detail(detail, args, f"Cancelling job {job} ({detail['state']}): no rank had started; the request for "
                                  f"its nodes is cancelled (scancel). Watch it with: orch status {job}")
        return 0
    if not args.wait:
        grace = (detail.get("spec") or {}).get("stop_grace_seconds", 10)
        emit_detail(detail, args, f"Cancelling job {job} ({detail['state']}): every rank is stopped within its "
                                  f"grace period ({grace:g} s). Wait for it with: orch cancel {job} --wait 60; "
                                  f"watch it with: orch status {job}")
        return 0
    started = time.monotonic()
    deadline = started + args.wait
    while not _stopped(detail) and time.monotonic() < deadline:
        time.sleep(0.25)
        detail = backend.detail(job)
    if _stopped(detail):
        emit_detail(detail, args, f"Job {job}: {detail['state']}; every process is gone "
                                  f"({time.monotonic() - started:.1f} s)")
        return 0
    emit_detail(detail, args, f"Job {job} is still stopping after {args.wait:g} s ({detail['state']}); see "
                              f"orch status {job}")
    return 1


_TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def _waits_for_nodes(detail: dict) -> bool:
    """The job is PENDING with its next attempt still waiting for a scheduler's nodes: no attempt yet, or
    only ended ones (``orchestrator.supervision.orphans.waits_for_nodes``, on a job's detail)."""
    attempts = detail.get("attempts") or []
    return detail.get("state") == "PENDING" and (not attempts or bool(attempts[-1].get("ended_at")))


def _stopped(detail: dict) -> bool:
    """The job ended and its last attempt's processes are gone."""
    return detail["state"] in _TERMINAL and (not detail["attempts"] or bool(detail["attempts"][-1]["stopped_at"]))
