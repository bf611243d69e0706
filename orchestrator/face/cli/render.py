"""How a job looks in a terminal: its header, cause, ranks table, and the words after it ended."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .output import ago, console, fmt_loss, printable, styled


#: The ranks table's columns in the order shown, and (``RANK_PRIORITY``) the order they are given room in.
RANK_COLUMNS = ("rank", "node", "local", "pid", "state", "exit", "step", "loss", "tokens/s", "last output")
RANK_PRIORITY = ("rank", "node", "step", "loss", "state", "exit", "tokens/s", "pid", "local", "last output")
#: Narrowest a host name is cut to (with an ellipsis), and the least room worth giving the last output.
MIN_NODE, MIN_OUTPUT = 8, 12


def _rank_cells(r: dict) -> dict[str, Any]:
    exit_ = (r.get("how") or "").replace("exit code ", "").replace("signal ", "") or "-"
    return {"rank": str(r["global_rank"]), "node": f"{r['host']} ({r['node_rank']})", "local": str(r["local_rank"]),
            "pid": str(r["pid"] or "-"), "state": styled(r["state"]), "exit": exit_,
            "step": str(r["step"] if r["step"] is not None else "-"), "loss": fmt_loss(r["loss"]),
            "tokens/s": f"{r['tokens_per_second']:.0f}" if r.get("tokens_per_second") is not None else "-",
            "last output": Text(printable(r.get("last_line") or "")[:200])}


def fit_columns(rows: list[dict[str, Any]], width: int) -> dict[str, int]:
    """Which columns of the ranks table fit in ``width`` terminal columns, and how wide each is: given room in
    :data:`RANK_PRIORITY` order (rank, node, step and loss first), one space between columns; the node is cut
    to no less than :data:`MIN_NODE`, and the last output takes what is left (if at least :data:`MIN_OUTPUT`).
    Returns column -> width."""
    natural = {c: max([len(c)] + [len(str(row[c])) if not isinstance(row[c], Text) else row[c].cell_len
                                  for row in rows]) for c in RANK_COLUMNS}
    chosen: dict[str, int] = {}
    used = -1
    for col in RANK_PRIORITY:
        if col == "last output":
            room = width - used - 1
            if room >= MIN_OUTPUT:
                chosen[col] = min(room, max(natural[col], MIN_OUTPUT), 60 if width < 200 else 120)
            continue
        want = natural[col]
        if col == "node" and used + 1 + want > width - 30:  # leave room for step, loss, state
            want = max(MIN_NODE, min(want, width - 30 - used - 1))
        if used + 1 + want <= width:
            chosen[col] = want
            used += 1 + want
    return chosen


def ranks_table(detail: dict, width: int | None = None) -> Table:
    """One line per rank, never wrapped: the columns that fit the terminal (:func:`fit_columns`; ``width``:
    the console's by default)."""
    rows = [_rank_cells(r) for r in detail.get("ranks", [])]
    fit = fit_columns(rows, width or console.width)
    t = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), collapse_padding=True)
    shown = [c for c in RANK_COLUMNS if c in fit]
    for col in shown:
        t.add_column(col, overflow="ellipsis", no_wrap=True, max_width=fit[col], min_width=min(fit[col], len(col)))
    for row in rows:
        t.add_row(*(row[c] for c in shown))
    return t


class RanksTable:
    """The ranks table as a renderable sized when it is drawn (a live view's terminal may be resized)."""

    def __init__(self, detail: dict) -> None:
        self.detail = detail

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield ranks_table(self.detail, options.max_width)


#: ``orch list``'s columns in the order shown, and (``JOB_PRIORITY``) the order they are given room in; the cause
#: takes what is left (wrapped, at most ``MAX_CAUSE``): at least ``MIN_CAUSE`` beside the progress columns, and
#: ``WIDE_CAUSE`` beside ``updated`` and the ones after it. The progress columns and the cause are left out when
#: no job listed has one.
JOB_COLUMNS = ("job", "state", "attempt", "restarts", "nodes", "world", "step", "loss", "steps/s", "eta", "updated",
               "cause")
JOB_PRIORITY = ("job", "state", "step", "loss", "steps/s", "eta", "updated", "attempt", "restarts", "world", "nodes")
_JOB_OPTIONAL = ("step", "loss", "steps/s", "eta", "cause")
MIN_CAUSE, WIDE_CAUSE, MAX_CAUSE = 16, 40, 70


def fmt_rate(v: float | None) -> str:
    """Steps per second with 3 significant digits or so (``-``: unknown)."""
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def fmt_eta(seconds: float | None) -> str:
    """A duration as ``45s``, ``4m05s``, ``2h13m``, ``3d04h`` (``-``: unknown)."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else \
        f"{s // 3600}h{s % 3600 // 60:02d}m" if s < 86400 else f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _job_cells(j: dict) -> dict[str, Any]:
    step = "-" if j.get("step") is None else str(j["step"]) + (f"/{j['total_steps']}" if j.get("total_steps") else "")
    return {"job": j["id"], "state": styled(j["state"]), "attempt": str(j["attempt"]), "restarts": str(j["restarts"]),
            "nodes": ",".join(j.get("nodes") or []), "world": str(j.get("world_size") or "-"), "step": step,
            "loss": fmt_loss(j.get("loss")), "steps/s": fmt_rate(j.get("steps_per_second")),
            "eta": fmt_eta(j.get("eta_seconds")), "updated": ago(j["updated_at"]),
            "cause": printable(j.get("cause_message") or "")}


def fit_job_columns(rows: list[dict[str, Any]], width: int) -> dict[str, int]:
    """Which columns of ``orch list`` fit in ``width`` terminal columns and how wide each is (one space between
    columns): :data:`JOB_PRIORITY` order, the id and state always, the others while they fit beside the cause's
    least room; the cause takes the rest. Returns column -> width."""
    natural = {c: max([len(c)] + [row[c].cell_len if isinstance(row[c], Text) else len(row[c]) for row in rows])
               for c in JOB_COLUMNS}
    has = {c: any(str(row[c]) not in ("", "-") for row in rows) for c in JOB_COLUMNS}
    cause = min(natural["cause"], MIN_CAUSE) if has["cause"] else 0
    chosen: dict[str, int] = {}
    used = -1
    for col in JOB_PRIORITY:
        if col in _JOB_OPTIONAL and not has[col]:
            continue
        if col == "updated" and cause:
            cause = min(natural["cause"], WIDE_CAUSE)
        reserve = 1 + cause if cause and col not in ("job", "state") else 0
        if col in ("job", "state") or used + 1 + natural[col] + reserve <= width:
            chosen[col] = natural[col]
            used += 1 + natural[col]
    cause = min(natural["cause"], MIN_CAUSE)
    if has["cause"] and width - used - 1 >= cause:
        chosen["cause"] = min(width - used - 1, natural["cause"], MAX_CAUSE)
    return chosen


def jobs_table(jobs: list[dict], width: int | None = None) -> Table:
    """``orch list``: a line per job (its cause may wrap), the columns that fit the terminal
    (:func:`fit_job_columns`; ``width``: the console's by default)."""
    rows = [_job_cells(j) for j in jobs]
    fit = fit_job_columns(rows, width or console.width)
    t = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), collapse_padding=True)
    shown = [c for c in JOB_COLUMNS if c in fit]
    for col in shown:
        right = col in ("attempt", "restarts", "world", "step", "loss", "steps/s", "eta")
        t.add_column(col, overflow="fold" if col == "cause" else "ellipsis", no_wrap=col != "cause",
                     max_width=fit[col], min_width=min(fit[col], len(col)), justify="right" if right else "left")
    for row in rows:
        t.add_row(*(row[c] for c in shown))
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
    parts.append(RanksTable(detail))
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
    pruned = view.get("pruned")
    if pruned:
        every = f", keep_every {pruned['keep_every']}" if pruned["keep_every"] else ""
        policy = f"keep_last {pruned['keep_last']}{every}"
        lines.append(f"  {pruned['tags']} older checkpoint(s) deleted by the spec's checkpoints policy ({policy}), "
                     f"{pruned['bytes'] / (1 << 20):.1f} MiB freed")
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
