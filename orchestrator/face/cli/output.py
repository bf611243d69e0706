"""What every ``orch`` command prints with: the consoles (stdout, stderr), JSON output, state colours,
and the error every command raises for a request it cannot carry out."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.text import Text

from ...errors import OrchError

console = Console(width=None if sys.stdout.isatty() else 200)


err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


STATE_STYLE = {"PENDING": "yellow", "PROVISIONING": "yellow", "RUNNING": "cyan", "SUCCEEDED": "green",
                "FAILED": "bold red", "CANCELLED": "magenta", "running": "cyan", "exited": "green",
                "failed": "bold red", "stopped": "magenta", "pending": "yellow", "not started": "dim"}


class UsageError(OrchError):
    """A command cannot be carried out as asked (e.g. submit with no server running)."""


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def styled(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def ago(t: float | None) -> str:
    if not t:
        return "-"
    s = max(0, int(time.time() - t))
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


def fmt_loss(v: Any) -> str:
    return "-" if v is None else v if isinstance(v, str) else f"{v:.4f}"


def emit_detail(detail: dict, args: argparse.Namespace, message: str) -> None:
    if args.output == "json":
        print_json(detail)
    else:
        console.print(message, markup=False, highlight=False)
