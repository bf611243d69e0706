"""How a job looks in a terminal: its header, cause, ranks table, and the words after it ended."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .output import console, fmt_loss, printable, styled


def ranks_table(detail: dict) -> Table:
    t = Table(box=None, pad_edge=False)
    for col in ("rank", "node", "local", "pid", "state", "exit", "step", "loss", "tokens/s", "last output"):
        t.add_column(col, overflow="ellipsis", no_wrap=col in ("last output", "state", "exit"),
                     max_width=60 if col == "last output" else None)
    for r in detail.get("ranks", []):
        exit_ = (r.get("how") or "").replace("exit code ", "").replace("signal ", "") or "-"
        t.add_row(str(r["global_rank"]), f"{r['host']} ({r['node_rank']})", str(r["local_rank"]),
                  str(r["pid"] or "-"), styled(r["state"]), exit_,
                  str(r["step"] if r["step"] is not None else "-"), fmt_loss(r["loss"]),
                  f"{r['tokens_per_second']:.0f}" if r.get("tokens_per_second") is not None else "-",
                  Text((r.get("last_line") or "")[:200]))
    return t


def header_line(detail: dict) -> Text:
    t = Text()
    t.append(f"job {detail['id']}  ", style="bold")
    t.append_text(styled(detail["state"]))
    t.append(f"  attempt {detail['attempt']}  world size {detail.get('world_size', '-')}"
             f"  master {detail.get('master_addr', '-')}:{detail.get('master_port', '-')}")
    return t


def cause_lines(detail: dict) -> list[str]:
    cause = detail.get("cause") or {}
    lines = []
    if cause.get("lines") and cause.get("summary"):  # preflight_failed: a line per finding and its nodes
        lines.append(f"cause: {cause['summary']}:")
        lines += [f"  {line}" for line in cause["lines"]]
    elif cause.get("message"):
        lines.append(f"cause: {cause['message']}")
    with_tail = cause if cause.get("log_tail") else (cause.get("first_symptom") or {})
    tail = with_tail.get("log_tail") or []
    if tail:
        lines.append(f"last lines of rank {with_tail.get('global_rank')}'s log:")
        lines += [f"  | {ln}" for ln in tail[-10:]]
    return [printable(line) for line in lines]


def queue_line(detail: dict) -> str | None:
    """What the job waits for: while PENDING in a scheduler's queue (slurm from a login node), what the scheduler
    says; while its dead server's ranks await a new one, how long a new server has."""
    if detail.get("awaiting_server"):
        return str(detail["awaiting_server"]["message"])
    alloc = detail.get("allocation")
    if detail.get("state") != "PENDING" or not alloc or alloc.get("state") == "RUNNING":
        return None
    return f"waiting for Slurm: {alloc.get('message')}"


def render_detail(detail: dict) -> Group:
    parts: list[Any] = [header_line(detail)]
    waiting = queue_line(detail)
    if waiting:
        parts.append(Text(waiting, style="yellow"))

    for line in cause_lines(detail):
        parts.append(Text(line, style="red" if line.startswith("cause") else ""))
    parts.append(ranks_table(detail))
    return Group(*parts)


def resume_words(data: dict) -> str:
    """Where a new attempt starts, and the newer checkpoints it skipped and why (a state event's data)."""
    words = f"  starts from checkpoint {data['resume_tag']}" if data.get("resume_tag") else \
        "  starts from the beginning (no complete checkpoint)"
    for s in data.get("skipped_checkpoints") or []:
        words += f"; skipped {s['tag']}: {'; '.join(s['problems'])}"
    if data.get("resume_args"):
        words += f"; the script gets {' '.join(data['resume_args'])}"
    latest = data.get("latest_rewritten")
    if latest:
        words += f"; DeepSpeed's {latest['path']} now names {latest['to']} (it named {latest['from'] or 'nothing'})"
    return words


def final_words(detail: dict, header: bool = True) -> None:
    c = console
    if header:
        c.print(header_line(detail))
        for line in cause_lines(detail):
            c.print(line, markup=False, highlight=False, style="red" if line.startswith("cause") else None)
    if detail.get("run_dir"):
        c.print(f"logs: {detail['run_dir']}/logs", markup=False, highlight=False)
    for step in detail.get("next_steps") or []:
        c.print(f"next: {step}", markup=False, highlight=False)


def start_checkpoint(attempt: dict) -> str:
    """An attempt's start checkpoint in words: its tag, and for a universal one the tag it came from."""
    tag = attempt.get("resume_tag")
    if not tag:
        return "-"
    source = attempt.get("resume_universal_from")
    return f"{tag} (converted from {source})" if source else tag


#: Checkpoints listed in a terminal, newest first (the chosen one always).
SHOWN_CHECKPOINTS = 6


def checkpoint_lines(view: dict | None) -> list[str]:
    """A job's checkpoints (``orchestrator.observe.checkpoints.checkpoints_view`` or a resume preview's
    ``checkpoints``): the directory and format, one line per checkpoint, newest first."""
    if not view:
        return []
    lines = [f"checkpoints in {view['dir']} ({view.get('format', '?')} format, {view.get('format_reason', '')})"]
    if view.get("error"):
        return lines + [f"  {view['error']}"]
    if not view.get("checkpoints"):
        return lines + ["  none found"]
    chosen = (view.get("chosen") or {}).get("tag")
    shown = [c for i, c in enumerate(view["checkpoints"]) if i < SHOWN_CHECKPOINTS or c["tag"] == chosen]
    for c in shown:
        step = f"step {c['step']}" if c.get("step", -1) >= 0 else "step ?"
        if c["tag"] == chosen:
            state = ("complete, the next resume's" + (" (by sizes; orch resume --dry-run also hashes it)"
                                                      if "sizes" in (c.get("checked") or "") else ""))
        elif c["complete"]:
            state = "complete"
        else:
            state = "skipped: " + "; ".join(c["problems"])
        checked = f" [{c['checked']}]" if c.get("checked") else ""
        lines.append(f"  {c['tag']:<20} {step:<10} {state}{checked}")
        lines += [f"    note: {n}" for n in c.get("notes") or []]
    left = len(view["checkpoints"]) - len(shown)
    if left:
        lines.append(f"  ... and {left} older (--output json lists them all)")
    return lines


def resume_preview_lines(preview: dict) -> list[str]:
    """``orch resume --dry-run``'s words (``Controller.resume_preview``)."""
    lines = [f"Job {preview['job']} ({preview['state']}): nothing started"]
    lines += checkpoint_lines(preview["checkpoints"])
    if preview.get("resume_tag"):
        lines.append(f"a resume starts from {preview['resume_tag']}")
        if preview.get("resume_args"):
            lines.append(f"  the script gets the arguments {' '.join(preview['resume_args'])}")
        for k, v in (preview.get("resume_env") or {}).items():
            lines.append(f"  and {k}={v}")
        if preview.get("latest"):
            lines.append(f"  DeepSpeed's latest would be pointed at {preview['latest']['to']} "
                         f"(it names {preview['latest']['from'] or 'nothing'})")
    else:
        lines.append(f"a resume finds no checkpoint to start from: {preview.get('fresh_start')}")
    if preview.get("refused"):
        lines.append(f"but a resume would be refused: {preview['refused']}")
    elif preview.get("world_size"):
        lines.append(f"on {preview['world_size']} rank(s)")
    return lines
