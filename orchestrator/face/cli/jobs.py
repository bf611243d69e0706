"""The commands that start and stop jobs: ``plan``, ``run``, ``submit``, ``resume``, ``cancel``."""

from __future__ import annotations

import argparse
import json
import shlex
import time

from rich.table import Table
from rich.text import Text

from .backends import HttpBackend, StoreBackend, find_server, pick_backend, state_dir_of
from .follow import follow_embedded
from .options import load_job
from .output import UsageError, console, emit_detail, err_console, print_json
from .render import start_checkpoint


def cmd_plan(args: argparse.Namespace) -> int:
    from ...supervision import prepare_plan
    spec = load_job(args)
    plan, _lease = prepare_plan(spec, state_dir_of(args), f"{spec.name}-plan", hold_port=False)
    if args.output == "json":
        print_json(plan.to_dict())
        return 0
    c = console
    c.print(Text(f"Plan for job '{plan.job_name}' (nothing started)", style="bold"))
    c.print(f"launcher {plan.launcher}, provisioner {plan.provisioner}, {len(plan.nodes)} node(s), "
            f"world size {plan.world_size}, master {plan.master_addr}:{plan.master_port}",
            markup=False, highlight=False)
    nodes = Table(title="Nodes", box=None, title_justify="left", pad_edge=False)
    for col in ("node rank", "host", "slots", "global ranks", "metrics"):
        nodes.add_column(col)
    for n in plan.nodes:
        nodes.add_row(str(n.node_rank), n.host, ",".join(map(str, n.slots)),
                      ",".join(str(r.global_rank) for r in n.ranks),
                      f":{n.metrics_port}/metrics" if n.metrics_port else "-")
    c.print(nodes)
    pairs = plan.ranks()
    envs = [dict(r.env) for _, r in pairs]
    common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)}
    c.print(Text("Environment of every rank (over its node's own):", style="bold"))
    for k in sorted(common):
        c.print(f"  {k}={shlex.quote(common[k])}", markup=False, highlight=False, soft_wrap=True)
    ranks = Table(title="Ranks", box=None, title_justify="left", pad_edge=False)
    for col in ("rank", "node", "local rank", "slot", "rank's own environment", "command line"):
        ranks.add_column(col, overflow="fold")
    for (n, r), env in zip(pairs, envs):
        own = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in common)
        ranks.add_row(str(r.global_rank), f"{n.host} ({n.node_rank})", str(r.local_rank), str(r.slot), own,
                      shlex.join(r.argv))
    c.print(ranks)
    defaults = {k: v for n in plan.nodes for k, v in n.env_defaults.items()}
    if defaults:
        c.print("Set where a node's environment lacks them: " +
                " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(defaults.items())), markup=False,
                highlight=False, soft_wrap=True)
    if plan.deepspeed_config:
        c.print(Text(f"DeepSpeed config, resolved (a run writes it to {plan.deepspeed_config_path}):", style="bold"))
        c.print(json.dumps(plan.deepspeed_config, indent=2), markup=False, highlight=False, soft_wrap=True)
    c.print(Text(f"What the real {plan.launcher} launcher would run:", style="bold"))
    for cmd in plan.real_commands:
        where = f"on {cmd.where}" if cmd.where else "on the launching machine"
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        c.print(f"  {where}: {prefix + ' ' if prefix else ''}{shlex.join(cmd.argv)}", markup=False,
                highlight=False, soft_wrap=True)
    for w in plan.warnings:
        err_console.print(Text(f"warning: {w}", style="yellow"))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ...supervision import Controller
    spec = load_job(args)
    controller = Controller(state_dir_of(args))
    try:
        job = controller.submit(spec)
        if args.output != "json":
            console.print(f"Submitted job {job.id} ({spec.launcher} launcher, state dir {controller.state_dir})",
                           markup=False, highlight=False)
        return follow_embedded(controller, job.id, args)
    finally:
        controller.close(cancel=True)


def cmd_resume(args: argparse.Namespace) -> int:
    url = find_server(args)
    if url:
        detail = HttpBackend(url).resume(args.job, args.exclude, args.fresh)
        start = start_checkpoint(detail["attempts"][-1])
        emit_detail(detail, args, f"Resumed job {detail['id']}: attempt {detail['attempt']} from checkpoint "
                                   f"{start if start != '-' else '(none: from the start)'}")
        return 0
    from ...supervision import Controller
    state_dir = state_dir_of(args)
    StoreBackend(state_dir).store  # noqa: B018 - a clear error when there are no jobs at all
    controller = Controller(state_dir)
    try:
        before = controller.store.events(controller.get(args.job).id)
        job = controller.resume(args.job, exclude_hosts=args.exclude, fresh=args.fresh)
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
    url = find_server(args)
    if not url:
        raise UsageError(f"No orch server is running for state dir {state_dir_of(args)}. Start one with "
                         "`orch server`, or run the job in the foreground with `orch run`.")
    detail = HttpBackend(url).submit(spec.to_dict(), str(args.spec))
    emit_detail(detail, args, f"Submitted job {detail['id']}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    backend = pick_backend(args)
    detail = backend.cancel(args.job)
    if args.wait:
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            detail = backend.detail(args.job)
            if detail["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and \
                    (not detail["attempts"] or detail["attempts"][-1]["stopped_at"]):
                break
            time.sleep(0.25)
    emit_detail(detail, args, f"Job {detail['id']}: {detail['state']}")
    return 0
