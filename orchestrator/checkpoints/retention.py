"""Checkpoint retention: which of a directory's checkpoints the spec's ``checkpoints.keep_last`` /
``keep_every`` lets go (:func:`select`), and their removal (:func:`remove`). See docs/jobspec.md
("checkpoints") and docs/housekeeping.md.

The rules, over the checkpoints found (newest first, as :func:`orchestrator.checkpoints.integrity.choose`
lists them, damaged ones carrying their problems):

* only checkpoints *older* than the newest complete one may go (a save in progress, or one a resume
  skipped as damaged, is newer and stays), and only those whose step is known;
* the newest ``keep_last`` complete ones stay, and every complete one whose step is a multiple of
  ``keep_every``;
* so does every tag in ``protect`` (what DeepSpeed's ``latest`` names, the checkpoint a resume would
  start from, the attempt's own start checkpoint, an HF Trainer's best model), and the universal
  conversion (``<tag>_universal``) of every tag that stays;
* incomplete checkpoints older than the newest complete one go (saves cut short: nothing resumes from them).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from .tags import UNIVERSAL_SUFFIX, CheckpointInfo

__all__ = ["Pruning", "select", "remove", "tree_bytes", "hf_best_tag"]


@dataclass(frozen=True)
class Pruning:
    """What the policy decided for one directory.

    Attributes:
        delete: the checkpoints to remove (oldest last), each a tag directory; with the universal conversions
            of those tags (``<tag>_universal``, where there is one) in ``also``.
        kept: tag -> why it stays, for the complete checkpoints older than the newest one that stay.
        also: paths of universal conversions that go with a deleted tag.
    """

    delete: tuple[CheckpointInfo, ...] = ()
    kept: Mapping[str, str] = field(default_factory=dict)
    also: tuple[str, ...] = ()


def select(found: Iterable[CheckpointInfo], keep_last: int, keep_every: int | None = None,
           protect: Mapping[str, str] | None = None) -> Pruning:
    """Apply the rules of this module's docstring.

    Args:
        found: the directory's checkpoints, newest first, problems included (``Choice.checkpoints``).
        keep_last: how many of the newest complete checkpoints stay (>= 1).
        keep_every: complete checkpoints whose step is a multiple of it stay too; None: none.
        protect: tag -> why it must stay, whatever the counts say.

    Returns:
        The :class:`Pruning` (nothing to delete while no checkpoint is complete).

    Raises:
        ValueError: ``keep_last`` below 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}")
    found = list(found)
    protect = dict(protect or {})
    complete = [i for i in found if i.complete]
    if not complete:
        return Pruning()
    newest = complete[0]
    for i in complete[:keep_last]:
        protect.setdefault(i.tag, f"one of the {keep_last} newest complete")
    if keep_every:
        for i in complete:
            if i.step >= 0 and i.step % keep_every == 0:
                protect.setdefault(i.tag, f"its step is a multiple of {keep_every}")
    delete, kept = [], {}
    for info in found:
        if info.step < 0 or info.step >= newest.step:
            continue  # newer (a save in progress, or damaged and to be saved again), or of unknown age
        if info.tag in protect:
            if info.complete:
                kept[info.tag] = protect[info.tag]
            continue
        delete.append(info)
    also = [f"{i.path}{UNIVERSAL_SUFFIX}" for i in delete if f"{i.tag}{UNIVERSAL_SUFFIX}" not in protect
            and os.path.isdir(f"{i.path}{UNIVERSAL_SUFFIX}")]
    return Pruning(tuple(delete), kept, tuple(also))


def tree_bytes(path: str | Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed; 0 when it is gone)."""
    total = 0
    for top, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                pass
    return total


def remove(paths: Iterable[str | Path]) -> tuple[dict[str, int], dict[str, str]]:
    """Remove each directory (or file) in ``paths``.

    Returns:
        ``({path: bytes freed}, {path: why it could not be removed})``; a path already gone counts as removed
        with 0 bytes.
    """
    freed: dict[str, int] = {}
    failed: dict[str, str] = {}
    for path in map(str, paths):
        size = tree_bytes(path) if os.path.isdir(path) else (os.lstat(path).st_size if os.path.lexists(path) else 0)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
        except OSError as err:
            failed[path] = f"{err.strerror or err}: {err.filename or path}"
            continue
        freed[path] = size
    return freed, failed


def hf_best_tag(newest: CheckpointInfo) -> str | None:
    """The HF Trainer's best checkpoint (``trainer_state.json``'s ``best_model_checkpoint`` in the newest
    checkpoint, which ``load_best_model_at_end`` loads at the end), as a tag name; None if none is recorded."""
    try:
        with open(os.path.join(newest.path, "trainer_state.json")) as f:
            best = json.load(f).get("best_model_checkpoint")
    except (OSError, ValueError, AttributeError):
        return None
    return os.path.basename(os.path.normpath(best)) if isinstance(best, str) and best else None
