"""Find the last complete checkpoint of a job.

A checkpoint tag is *complete* when (see docs/contract.md):

* ``<dir>/<tag>/orch_checkpoint.json`` exists (rank 0 writes it only after every rank
  finished saving), is valid JSON and names the tag it is in;
* every per-rank file it lists (``orch_rank_<global rank>.pt``) exists and is not empty;
* DeepSpeed's own files for the saved world are there: ``mp_rank_00_model_states.pt``
  (ZeRO stages 0-2; with ZeRO-3 each data-parallel rank writes
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``) and, for ZeRO stages 1-3, one
  ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank (file names as
  ``deepspeed.runtime.engine.DeepSpeedEngine`` writes them).

Anything else (a save killed half-way, a directory someone copied in) is skipped, and
the reason is reported so ``orch resume`` can say why it did not pick a newer tag.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CheckpointInfo", "inspect_tag", "scan", "latest_complete", "MARKER"]

#: The completion marker rank 0 writes last.
MARKER = "orch_checkpoint.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """One tag directory and what was found in it.

    Attributes:
        tag: the directory name (DeepSpeed's checkpoint tag).
        path: the tag directory.
        step: the step saved (from the marker), or -1 if unknown.
        world_size, zero_stage, dp_world_size: from the marker, or None.
        problems: why the tag is incomplete; empty when complete.
    """

    tag: str
    path: str
    step: int = -1
    world_size: int | None = None
    zero_stage: int | None = None
    dp_world_size: int | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def complete(self) -> bool:
        """True when nothing is missing."""
        return not self.problems


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _deepspeed_problems(tag_dir: Path, stage: int, dp: int) -> list[str]:
    problems = []
    if stage >= 3:
        required = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)]
    else:
        required = ["mp_rank_00_model_states.pt"]
    problems += [f"missing {name}" for name in required if not _nonempty(tag_dir / name)]
    if stage >= 1:
        names = os.listdir(tag_dir)
        for r in range(dp):
            suffix = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            if not any(n.endswith(suffix) and _nonempty(tag_dir / n) for n in names):
                problems.append(f"missing the optimizer states of data-parallel rank {r} (*{suffix})")
    return problems


def _step_from_name(tag: str) -> int:
    """The number a tag name ends with (``step_40``, ``global_step40``), or -1."""
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else -1


def inspect_tag(tag_dir: str | Path) -> CheckpointInfo:
    """Check one tag directory against the rules in this module's docstring."""
    tag_dir = Path(tag_dir)
    tag = tag_dir.name
    marker = tag_dir / MARKER
    guess = _step_from_name(tag)
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        return CheckpointInfo(tag, str(tag_dir), guess, problems=(f"no {MARKER}: the save did not finish",))
    except (OSError, ValueError) as err:
        return CheckpointInfo(tag, str(tag_dir), guess, problems=(f"unreadable {MARKER}: {err}",))
    if not isinstance(meta, dict):
        return CheckpointInfo(tag, str(tag_dir), guess, problems=(f"{MARKER} is not a JSON object",))
    step = int(meta.get("step", guess))
    world = meta.get("world_size")
    stage = int(meta.get("zero_stage", 0))
    dp = int(meta.get("dp_world_size", world or 1))
    problems = []
    if meta.get("tag", tag) != tag:
        problems.append(f"{MARKER} names tag {meta.get('tag')!r}, not {tag!r}")
    for name in meta.get("rank_files", []):
        if not _nonempty(tag_dir / name):
            problems.append(f"missing per-rank file {name}")
    problems += _deepspeed_problems(tag_dir, stage, dp)
    return CheckpointInfo(tag, str(tag_dir), step, world, stage, dp, tuple(problems))


def scan(checkpoint_dir: str | Path) -> list[CheckpointInfo]:
    """Inspect every tag directory under ``checkpoint_dir``, newest step first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    infos = [inspect_tag(p) for p in root.iterdir() if p.is_dir()]
    return sorted(infos, key=lambda i: (i.step, i.tag), reverse=True)


def latest_complete(checkpoint_dir: str | Path) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """Return the newest complete checkpoint and the newer incomplete ones it skipped.

    Returns:
        ``(info or None, skipped)`` where ``skipped`` lists tags newer than the chosen
        one (by step, or without a readable step) that are incomplete, with their problems.
    """
    skipped = []
    for info in scan(checkpoint_dir):
        if info.complete:
            return info, skipped
        skipped.append(info)
    return None, skipped
