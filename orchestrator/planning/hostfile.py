"""DeepSpeed hostfiles, read exactly as ``deepspeed.launcher.runner`` reads them.

This module reproduces, rule for rule, the installed DeepSpeed (0.19.8) functions
``_parse_hostfile`` and ``fetch_hostfile``; the filters and the pool they select are in
:mod:`.pool`. ``tests/test_hostfile_differential.py`` checks both against DeepSpeed's own
functions on thousands of generated inputs. Everywhere DeepSpeed raises, this module raises a
:class:`~orchestrator.errors.HostfileError` whose message is one sentence naming the file and
line and what was expected.

Hostfile format (``_parse_hostfile``)::

    # comment lines and blank lines are ignored
    worker-0 slots=8
    worker-1 slots=8

After stripping surrounding whitespace, a line that is empty or starts with ``#`` is
skipped; any other line must *start* with ``<host> slots=<n>``: a run of non-whitespace,
whitespace, the literal ``slots=`` and decimal digits. Each host may appear once and at
least one host is required.

DeepSpeed quirks reproduced here (same hosts as DeepSpeed), each reported in
:attr:`Hostfile.warnings` rather than silently (the filters' quirks are listed in :mod:`.pool`):

1. Text after ``slots=<n>`` on a hostfile line is ignored (``w1 slots=8 max_slots=16``,
   ``w1 slots=8abc``); ``w1 slots=8 # comment`` is fine and gives no warning.
2. ``slots=`` accepts any Unicode decimal digits (``slots=٣`` is 3) and leading zeros.
3. Host names may contain any non-whitespace character, including invisible ones such as
   a UTF-8 byte-order mark (a hostfile saved "with BOM" names its first host
   ``'\\ufeffworker-0'``), and ``:`` or ``@`` (e.g. IPv6 addresses), which a filter
   cannot name because ``:`` and ``@`` are filter separators.

Deliberate differences from DeepSpeed, none of which change the hosts DeepSpeed would read:

* :func:`load_hostfile` raises on a missing, unreadable or directory path, where
  ``fetch_hostfile`` warns and falls back to the local GPUs.
* Hostfiles are read as UTF-8 (DeepSpeed uses the locale's encoding, UTF-8 on any sane
  cluster); invalid UTF-8 is a :class:`HostfileError`.
"""

from __future__ import annotations

import collections
import os
import re
import stat

from ..errors import HostfileError
from ..spec.files import MAX_INPUT_BYTES
from .words import clip

__all__ = ["HOSTFILE_FORM", "Hostfile", "parse_hostfile", "load_hostfile"]

#: The form every non-comment hostfile line must have.
HOSTFILE_FORM = "<host> slots=<n>"

# A host line: the first whitespace-free run, whitespace, then "slots=" and digits.
# \S, \s and \d are the Unicode classes (the same ones str.split()/int() use).
_HOST_LINE = re.compile(r"(?P<host>\S+)\s+slots=(?P<slots>\d+)(?P<rest>.*)", re.DOTALL)

_EXAMPLE_LINE = "worker-0 slots=8"


class Hostfile(collections.OrderedDict):
    """Hosts and their slot counts in file order (an ``OrderedDict[str, int]``).

    It compares equal to the ``OrderedDict`` DeepSpeed's ``_parse_hostfile`` returns and
    carries, in addition, where it came from and what looked odd.

    Attributes:
        path: the hostfile's path, or ``"<hostfile>"`` for text given inline.
        lines: host -> 1-based line number it was defined on.
        warnings: human-readable notes about lines DeepSpeed accepts but probably should
            not (trailing text, non-ASCII digits, invisible characters in host names).
    """

    path: str
    lines: dict[str, int]
    warnings: tuple[str, ...]


#: what a hostfile line is made of (host names, IPv4/IPv6 addresses, ``slots=<n>``, comments' words)
_HOSTFILE_TEXT = re.compile(r"\ufeff?[\w.\-=:\[\],@#%]{1,80}(?:[ \t]+[\w.\-=:\[\],@#%'\"]{1,80}){0,12}")


def looks_like_hostfile_text(line: str) -> bool:
    """Whether a bad line reads as hostfile text, so a message may quote it: only name, address and
    ``slots=`` characters, a dozen words at most. A line of another file given as the hostfile (a
    password hash, a key, a script) does not, and is then never echoed (docs/security.md)."""
    if len(line) > 160 or _HOSTFILE_TEXT.fullmatch(line) is None:
        return False
    # a host name's label has at most 63 characters (RFC 1035): a longer bare word is a key or a hash
    return all(len(label) <= 63 for word in line.split() for label in re.split(r"[.:=\[\],@#%]", word))


def _bad_line(path: str, line_no: int, line: str) -> HostfileError:
    """The error for a line that is not ``<host> slots=<n>``: quoting it only if it reads as hostfile text."""
    if len(line.split()) == 1 and not line.startswith("slots=") and looks_like_hostfile_text(line):
        # one word: a host name without its slots, or a key or token file given as the hostfile: not quoted
        return HostfileError(
            f"Line {line_no} of hostfile {path} has one field ({len(line)} characters, not shown) and no 'slots=<n>' "
            f"field after it; expected '{HOSTFILE_FORM}' (e.g. '{_EXAMPLE_LINE}').", path=path, line_no=line_no,
            line=line)
    if not looks_like_hostfile_text(line):  # another file given as the hostfile: never quoted
        return HostfileError(
            f"Line {line_no} of hostfile {path} is not of the form '{HOSTFILE_FORM}' (e.g. '{_EXAMPLE_LINE}') "
            f"and does not read as hostfile text either (its {len(line)} character(s) include ones no host name "
            "or slot count has), so it is not shown; check that this is the right file.", path=path, line_no=line_no)
    return HostfileError(
        f"Line {line_no} of hostfile {path} is {clip(line)}, which is not of the form "
        f"'{HOSTFILE_FORM}' (e.g. '{_EXAMPLE_LINE}'): {_diagnose_line(line)}.",
        path=path, line_no=line_no, line=line)


def _diagnose_line(line: str) -> str:
    """Say, in a clause, why ``line`` is not ``<host> slots=<n>``."""
    fields = line.split()
    if fields[0].startswith("slots="):
        return f"it has no host name before {clip(fields[0])}"
    if len(fields) == 1:
        return "it has a host name but no 'slots=<n>' field after it"
    second = fields[1]
    if second == "slots" and len(fields) > 2 and fields[2].startswith("="):
        return "'slots=<n>' must be written without spaces around '='"
    if second.startswith("slots="):
        value = second[len("slots="):]
        if value == "":
            return "nothing follows 'slots=' (write the number right after '=', no space)"
        if value[0] in "+-":
            return f"the slot count {clip(value)} must be a non-negative whole number"
        return f"the slot count {clip(value)} must start with a digit"
    if second.lower().startswith("slots"):
        return (f"its second field is {clip(second)}; write 'slots=<n>' in lower case with "
                f"no spaces")
    if second.isdigit():
        return f"the slot count must be written as 'slots={second}'"
    return f"its second field is {clip(second)}, not 'slots=<n>'"


def parse_hostfile(text: str, path: str = "<hostfile>") -> Hostfile:
    """Parse the text of a DeepSpeed hostfile.

    Rules (DeepSpeed ``runner._parse_hostfile``): the text is split into lines as a file
    opened in text mode would be (``\\n``, ``\\r\\n`` and ``\\r`` end a line); each line is
    stripped; empty lines and lines starting with ``#`` are skipped; every other line must
    start with ``<host> slots=<n>`` (anything after ``<n>`` is ignored); a host may appear
    only once; and at least one host is required. ``slots=0`` is accepted.

    Args:
        text: the hostfile's contents.
        path: the name to use in messages (the file's path, or ``"<hostfile>"``).

    Returns:
        A :class:`Hostfile`: an ``OrderedDict`` of host -> slot count in file order, equal
        to what DeepSpeed returns, with ``path``, ``lines`` and ``warnings`` attached.

    Raises:
        HostfileError: a line is not ``<host> slots=<n>`` (the message names the path,
            line number, the line's text and the expected form), a host is listed twice
            (naming both line numbers), the slot count has more digits than Python's
            ``int()`` converts, or the file has no host lines at all.
    """
    path = str(path)
    # Universal newlines, as open(..., "r") gives DeepSpeed's readlines(); other Unicode
    # line separators (\x85, \u2028, ...) stay inside a line, as they do there.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    hosts = Hostfile()
    lines: dict[str, int] = {}
    warnings: list[str] = []
    for line_no, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _HOST_LINE.match(line)
        if m is None:
            raise _bad_line(path, line_no, line)
        host, digits, rest = m.group("host"), m.group("slots"), m.group("rest")
        try:
            slots = int(digits)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
            raise HostfileError(
                f"Line {line_no} of hostfile {path} gives host {host!r} a slot count of "
                f"{len(digits)} digits, too long to be a number; expected '{HOSTFILE_FORM}' "
                f"with a plausible <n> (e.g. '{_EXAMPLE_LINE}').",
                path=path, line_no=line_no, line=line) from None
        if host in lines:
            raise HostfileError(
                f"Hostfile {path} lists host {host!r} twice, on line {lines[host]} and on "
                f"line {line_no} ({clip(line)}); give each host one line '{HOSTFILE_FORM}' "
                f"with its total slot count.",
                path=path, line_no=line_no, line=line)
        hosts[host] = slots
        lines[host] = line_no
        where = f"Line {line_no} of hostfile {path} ({clip(line)})"
        if rest.strip() and not rest.lstrip().startswith("#"):
            warnings.append(
                f"{where}: the text {clip(rest.strip())} after "
                f"'slots={clip(digits)[1:-1]}' is ignored, "
                f"as DeepSpeed reads only '{HOSTFILE_FORM}' at the start of a line.")
        if not digits.isascii():
            warnings.append(
                f"{where}: the slot count {digits!r} uses non-ASCII digits; it is read as "
                f"{slots}.")
        if not host.isprintable():
            warnings.append(
                f"{where}: host name {host!r} contains invisible or control characters "
                f"(a UTF-8 byte-order mark?); DeepSpeed uses the name as written.")
    if not hosts:
        raise HostfileError(
            f"Hostfile {path} has no host lines, only blank lines and comments; expected "
            f"at least one line of the form '{HOSTFILE_FORM}' (e.g. '{_EXAMPLE_LINE}').",
            path=path)
    hosts.path = path
    hosts.lines = lines
    hosts.warnings = tuple(warnings)
    return hosts


def load_hostfile(path: str | os.PathLike) -> Hostfile:
    """Read and parse a DeepSpeed hostfile.

    Unlike DeepSpeed's ``runner.fetch_hostfile``, which logs a warning and falls back to
    the local GPUs when the path is not a file, a path that cannot be read is an error.
    The file is read as UTF-8 text with universal newlines.

    Args:
        path: the hostfile's path.

    Returns:
        The :class:`Hostfile` (host -> slot count, in file order) that
        :func:`parse_hostfile` gives for the file's text.

    Raises:
        HostfileError: the path does not exist, is a directory, cannot be read or is not
            UTF-8 text (the message names the path), or its contents are invalid (see
            :func:`parse_hostfile`).
    """
    name = os.fsdecode(path)
    expected = f"a text file of lines '{HOSTFILE_FORM}'"
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # a pipe would be waited on forever
            raise HostfileError(f"Hostfile {name} is not a regular file (a pipe, socket or device); expected the "
                                f"path of {expected}.", path=name)
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_INPUT_BYTES + 1)  # /proc files say size 0
        if len(text) > MAX_INPUT_BYTES:
            raise HostfileError(f"Hostfile {name} is larger than {MAX_INPUT_BYTES >> 20} MiB, the most orch reads; "
                                f"expected {expected}.", path=name)
    except FileNotFoundError:
        raise HostfileError(
            f"Hostfile {name} does not exist; expected the path of {expected}.",
            path=name) from None
    except IsADirectoryError:
        raise HostfileError(
            f"Hostfile {name} is a directory; expected the path of {expected}.",
            path=name) from None
    except UnicodeDecodeError as err:
        raise HostfileError(
            f"Hostfile {name} is not UTF-8 text (bad byte at offset {err.start}); expected "
            f"{expected}.", path=name) from None
    except OSError as err:
        reason = err.strerror or str(err)
        raise HostfileError(
            f"Hostfile {name} could not be read ({reason}); expected the path of a "
            f"readable {expected[2:]}.", path=name) from None
    return parse_hostfile(text, path=name)
