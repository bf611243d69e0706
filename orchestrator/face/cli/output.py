"""What every ``orch`` command prints with: the consoles (stdout, stderr), JSON output, state colours,
and the error every command raises for a request it cannot carry out."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import time
from typing import Any, NoReturn

from rich.console import Console
from rich.text import Text

from ...errors import OrchError

class _TextConsole(Console):
    """A console whose every string (a table cell, a printed line) is shown as text: terminal control
    sequences in it (:func:`printable`: a host name, an argument, a rank's output) are dropped, never obeyed.
    Its own styling still reaches a terminal."""

    def render_str(self, text: str, **kwargs: Any) -> Text:  # (rich's hook from str to Text)
        return super().render_str(printable(text), **kwargs)


# markup off: host names, job names and paths are the user's text, and "node[/x]" is not a style tag
def _tty(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for a closed one: Python sets it to None)."""
    return stream is not None and stream.isatty()


console = _TextConsole(width=None if _tty(sys.stdout) else 200, markup=False)


err_console = _TextConsole(stderr=True, width=None if _tty(sys.stderr) else 200, markup=False)


STATE_STYLE = {"PENDING": "yellow", "PROVISIONING": "yellow", "RUNNING": "cyan", "SUCCEEDED": "green",
                "FAILED": "bold red", "CANCELLED": "magenta", "running": "cyan", "exited": "green",
                "failed": "bold red", "stopped": "magenta", "pending": "yellow", "not started": "dim"}


#: Terminal control sequences a rank may print (CSI: colours, cursor moves, clearing; OSC: the window title,
#: hyperlinks, the clipboard; DCS/APC/PM strings; other escapes), and control characters but tab and newline
_CONTROL = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]|\x1b[\]P^_X][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -~]?|"
                      r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


#: Lone surrogates: what Python makes of command-line bytes that are not UTF-8; no stream can write them as such
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` without terminal control sequences and control characters (tab and newline kept), and with
    lone surrogates written as ``\\udXXX``: what ranks print, or a command line of bytes that are not UTF-8,
    reaches the user's terminal as text, never as commands to it nor as an encoding error (the log files keep
    the raw bytes; ``--output json`` escapes them)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", _CONTROL.sub("", text))


class Parser(argparse.ArgumentParser):
    """``argparse``'s parser, whose refusals quote the command line as text (:func:`printable`): an argument
    holding terminal control sequences is shown, never obeyed."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if wrong:  # (Python 3.14's argparse suggests too; until then, difflib)
            close = difflib.get_close_matches(wrong[1], re.findall(r"'([^']*)'", wrong[2]), n=1, cutoff=0.6)
            if close:
                message += f"; did you mean '{close[0]}'?"
        super().error(printable(message))


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


def human_bytes(n: int) -> str:
    """Bytes for people: ``123 B``, ``123.4 KiB`` ... up to TiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def fmt_loss(v: Any) -> str:
    return "-" if v is None else v if isinstance(v, str) else f"{v:.4f}"


def emit_detail(detail: dict, args: argparse.Namespace, message: str) -> None:
    if args.output == "json":
        print_json(detail)
    else:
        console.print(message, markup=False, highlight=False)
