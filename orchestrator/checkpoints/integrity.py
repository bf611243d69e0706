"""Which checkpoint a resume starts from: the newest that is complete (its format's rules), undamaged
since its save (its manifest: the sizes and hashes the agents recorded, ``agents.manifest``; without
one, the CRC-32 that ``torch.save`` stores for every zip entry) and not marked bad (a rank crashed
loading it). See docs/contract.md ("Which checkpoint a resume uses").
"""

from __future__ import annotations

import dataclasses
import os
import stat
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from agents.manifest import hash_file

from .detect import detect_format, get_format
from .tags import CheckpointInfo

__all__ = ["Choice", "choose", "verify", "Manifest"]

#: Files hashed at once by :func:`verify`.
VERIFY_THREADS = 8
#: ``{file name relative to the tag directory: {"size", "mtime_ns", "hash", "mode"}}`` of one tag.
Manifest = Mapping[str, Mapping[str, Any]]


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def verify(info: CheckpointInfo, manifest: Manifest, contents: bool = True) -> list[str]:
    """Compare a checkpoint's files with its manifest.

    Args:
        info: the checkpoint (its ``path`` is the tag directory).
        manifest: what was recorded at the save (:data:`Manifest`).
        contents: also hash each file again, in the mode it was recorded in (False: sizes only, as
            ``orch status`` does).

    Returns:
        One problem per damaged file (by name), naming it and what changed (gone, size, content); empty
        when every recorded file is as it was. Files are hashed :data:`VERIFY_THREADS` at a time (the
        reads and xxHash release the GIL): many shards on shared storage are read in parallel.
    """
    names = sorted(manifest)
    with ThreadPoolExecutor(max_workers=min(VERIFY_THREADS, max(len(names), 1))) as pool:
        found = pool.map(lambda n: _file_problem(info.path, n, manifest[n], contents), names)
        return [p for p in found if p]


def _file_problem(tag_dir: str, name: str, rec: Mapping[str, Any], contents: bool) -> str | None:
    path = os.path.join(tag_dir, name)
    try:
        st = os.stat(path)
    except OSError:
        return f"{name} is gone (it had {rec['size']} bytes at the save)"
    if st.st_size != rec["size"]:
        how = "truncated" if st.st_size < rec["size"] else "grown"
        return f"{name} has {st.st_size} bytes, {rec['size']} at the save ({how})"
    if not contents or not rec.get("hash") or rec.get("mode") == "off":
        return None
    try:
        now = hash_file(path, name, rec["mode"])
    except OSError as err:
        return f"{name} cannot be read ({err.strerror or err})"
    if now.hash == rec["hash"]:
        return None
    when = (f"modified at {_when(st.st_mtime_ns)}, after the save at {_when(rec['mtime_ns'])}"
            if st.st_mtime_ns != rec["mtime_ns"] else "its modification time unchanged")
    return f"{name}: its bytes changed since the save ({rec['mode']} hash differs; {when})"


def crc_problems(info: CheckpointInfo, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Check every zip-format torch file of a checkpoint against the CRC-32 ``torch.save`` stored for each of
    its entries (``zipfile.ZipFile.testzip``: reads every byte; ``torch.load`` itself never checks them). The
    content check of a checkpoint with no manifest recorded (written before orch watched it, say).

    Args:
        info: the checkpoint.
        skip: names (relative to its directory) not to check: those its manifest has.

    Returns:
        One problem per file whose bytes changed since ``torch.save`` wrote them, naming the entry.
    """
    problems = []
    for top, _dirs, files in os.walk(info.path):
        for name in sorted(files):
            path = os.path.join(top, name)
            if os.path.relpath(path, info.path).replace(os.sep, "/") in skip:
                continue
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue
                with open(path, "rb") as f:
                    if f.read(4) != b"PK\x03\x04":
                        continue
                with zipfile.ZipFile(path) as z:
                    bad = z.testzip()
            except (OSError, zipfile.BadZipFile, ValueError) as err:
                bad = f"(unreadable: {err})"
            if bad:
                rel = os.path.relpath(path, info.path)
                problems.append(f"{rel}: its bytes changed since it was saved (entry {bad} fails its CRC-32)")
    return problems


@dataclass(frozen=True)
class Choice:
    """What a resume would start from.

    Attributes:
        format: the checkpoints' format; format_reason: why (given in the spec, or what detection saw).
        dir: the directory the checkpoints are in.
        chosen: the checkpoint to resume from, or None.
        checkpoints: every checkpoint found, newest first; those newer than ``chosen`` carry the
            problems that skipped them (incomplete, damaged, marked bad).
        checked: ``{tag: how it was checked}``: ``"manifest (N files, hashes)"``, ``"manifest (sizes)"``,
            ``"no manifest recorded: the zip CRC-32s of its torch files"`` or ``"files only (no manifest
            recorded)"`` (sizes only asked for), for the tags looked at.
        damaged: tags complete by their format's rules but skipped: changed since their save, or marked bad.
    """

    format: str
    format_reason: str
    dir: str
    chosen: CheckpointInfo | None
    checkpoints: tuple[CheckpointInfo, ...] = ()
    checked: Mapping[str, str] = field(default_factory=dict)
    damaged: tuple[str, ...] = ()

    @property
    def skipped(self) -> list[CheckpointInfo]:
        """The checkpoints newer than the chosen one (all of them when none is), each with its problems."""
        out = []
        for info in self.checkpoints:
            if self.chosen is not None and info.tag == self.chosen.tag:
                break
            out.append(info)
        return out

    def to_dict(self) -> dict:
        """JSON-able form (``orch resume --dry-run --output json``, ``orch status``)."""
        return {"format": self.format, "format_reason": self.format_reason, "dir": self.dir,
                "chosen": self.chosen.to_dict() if self.chosen else None, "damaged": list(self.damaged),
                "checkpoints": [{**c.to_dict(), "checked": self.checked.get(c.tag)} for c in self.checkpoints]}


def choose(root: str | Path, fmt: str = "auto", *, manifest: Callable[[str], Manifest] = lambda tag: {},
           bad: Mapping[str, str] | None = None, contents: bool = True) -> Choice:
    """Find the checkpoint a resume starts from (see the module docstring).

    Args:
        root: the directory the checkpoints are in.
        fmt: a format name (``orchestrator.checkpoints.formats.FORMAT_NAMES``) or ``auto``.
        manifest: the recorded manifest of a tag (empty when none was recorded).
        bad: ``{tag: why}`` of tags a rank crashed loading.
        contents: hash the files again to compare them (False: sizes only).

    Returns:
        The :class:`Choice`. Tags older than the chosen one are listed as their format found them,
        without their manifest checked.

    Raises:
        ValueError: an unknown format name.
    """
    reason = "given in the spec (resume.format)"
    if fmt == "auto":
        fmt, why = detect_format(root)
        reason = f"detected: {why}"
    found = get_format(fmt).scan(root)
    if reason.startswith("given") and not any(i.complete for i in found):
        seen, why = detect_format(root)
        if seen != fmt and get_format(seen).scan(root):
            reason += f"; but the directory looks like the {seen} format ({why}): is resume.format right?"
    bad = bad or {}
    out, chosen, checked, damaged = [], None, {}, []
    for info in found:
        if chosen is not None or not info.complete:
            out.append(info)
            continue
        problems = []
        if info.tag in bad:
            problems.append(f"marked bad: {bad[info.tag]}")
        recorded = manifest(info.tag)
        if recorded and not problems:
            problems += verify(info, recorded, contents)
            if contents:  # files the agents did not record (a node lost before it hashed them): their CRCs
                problems += crc_problems(info, skip=set(recorded))
            checked[info.tag] = f"manifest ({len(recorded)} files, {'hashes' if contents else 'sizes'})"
        elif not recorded and contents:
            problems += crc_problems(info)
            checked[info.tag] = "no manifest recorded: the zip CRC-32s of its torch files"
        elif not recorded:
            checked[info.tag] = "files only (no manifest recorded)"
        if problems:
            info = dataclasses.replace(info, problems=tuple(problems))
            damaged.append(info.tag)
        else:
            chosen = info
        out.append(info)
    return Choice(fmt, reason, str(root), chosen, tuple(out), checked, tuple(damaged))
