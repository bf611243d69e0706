"""Checkpoint formats: how orch finds the checkpoints a script wrote, orders them, says whether each is
complete (and why not), and what a resumed script is told.

One small class per format, behind :class:`CheckpointFormat`:

============== ============================================ ==========================================
format         a checkpoint is                              complete when
============== ============================================ ==========================================
``orch``       a tag directory with ``orch_checkpoint.json`` the marker and every file it requires are
                                                            there (docs/contract.md; :mod:`.tags`)
``deepspeed``  a tag directory of ``engine.save_checkpoint`` every file DeepSpeed writes for the saved
               (``global_step<N>``), ``latest`` beside it   world is there and readable
                                                            (:mod:`.deepspeed_layout`)
``hf_trainer`` ``checkpoint-<N>`` of ``transformers.Trainer`` ``trainer_state.json``, the weights, the
                                                            optimizer (or the DeepSpeed tag inside),
                                                            one RNG file per process (:mod:`.hf`)
``accelerate`` ``checkpoint_<N>`` of ``Accelerator.save_state`` one ``random_states_<i>.pkl`` per
               (or a ``save_state`` directory itself)       process, the weights and optimizer (or the
                                                            DeepSpeed tag ``pytorch_model``) (:mod:`.hf`)
============== ============================================ ==========================================

Every file a format requires is also opened far enough to find a truncated or unreadable one
(:mod:`.headers`: a torch file's zip directory and pickle, a safetensors header, JSON), without
reading tensors. Damage inside tensor data is found by the manifest (:mod:`.integrity`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError
from .deepspeed_layout import read_latest, tag_problems
from .tags import CheckpointInfo, inspect_tag, is_universal_dir

__all__ = ["CheckpointFormat", "OrchFormat", "DeepSpeedFormat", "number_in", "newest_first", "point_latest"]


def number_in(name: str) -> int:
    """The number a directory name ends with (``global_step40``, ``checkpoint-40``, ``step_40``), or -1."""
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else -1


def newest_first(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """Sorted newest first: by step, then by the number in the name, then by name."""
    return sorted(infos, key=lambda i: (i.step, number_in(i.tag), i.tag), reverse=True)


class CheckpointFormat:
    """One checkpoint format. Subclasses set :attr:`name` and :attr:`tag_pattern` and implement
    :meth:`is_tag` and :meth:`inspect`.

    Attributes:
        name: the format's name in the spec (``resume.format``).
        tag_pattern: a regular expression every checkpoint directory's name matches (what the agents
            watch, ``agents.manifest.CheckpointWatch``).
    """

    name = ""
    tag_pattern = r"[^.].*"

    def is_tag(self, path: Path) -> bool:
        """Whether the directory ``path`` (a child of the checkpoints' directory) is a checkpoint of this format."""
        raise NotImplementedError

    def inspect(self, tag_dir: Path) -> CheckpointInfo:
        """Check one checkpoint; its ``problems`` say why it is incomplete (empty: complete)."""
        raise NotImplementedError

    def scan(self, root: str | Path) -> list[CheckpointInfo]:
        """Every checkpoint under ``root``, inspected, newest first (:func:`newest_first`). Hidden
        directories (orch's own) and universal conversions (``<tag>_universal``) are never checkpoints."""
        root = Path(root)
        try:
            children = [Path(e.path) for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")]
        except OSError:
            return []
        found = []
        for p in children:
            try:
                if is_universal_dir(p) or not re.fullmatch(self.tag_pattern, p.name) or not self.is_tag(p):
                    continue
                found.append(self.inspect(p))
            except OSError as err:  # an unreadable tag is skipped, named; it never stops the others
                found.append(CheckpointInfo(p.name, str(p), number_in(p.name), problems=(
                    f"cannot be read ({err.strerror or err}: {err.filename or p})",), format=self.name))
        return newest_first(found)

    def watch_dir(self, root: str | Path) -> tuple[str, str]:
        """``(directory, tag pattern)`` the agents watch for checkpoints under ``root``."""
        return str(root), self.tag_pattern


class OrchFormat(CheckpointFormat):
    """orch's own contract (docs/contract.md): a tag is complete once rank 0 wrote ``orch_checkpoint.json``
    last and every file it names is there; the fastest and most certain check."""

    name = "orch"

    def is_tag(self, path: Path) -> bool:
        return True  # every directory is a tag; one without the marker is an unfinished save

    def inspect(self, tag_dir: Path) -> CheckpointInfo:
        return inspect_tag(tag_dir)


class DeepSpeedFormat(CheckpointFormat):
    """``engine.save_checkpoint(save_dir, tag)`` with no marker of orch's: a tag directory holding
    DeepSpeed's ``*model_states.pt`` files, and ``<save_dir>/latest`` naming the tag saved last (written
    by rank 0 after every rank saved: ``DeepSpeedEngine.save_checkpoint``). A directory counts as a tag when
    it holds a ``.pt`` file, is named ``global_step<N>`` or is the one ``latest`` names."""

    name = "deepspeed"

    def is_tag(self, path: Path) -> bool:
        if re.fullmatch(r"global_step\d+", path.name) or read_latest(path.parent) == path.name:
            return True
        try:
            return any(n.endswith(".pt") for n in os.listdir(path))
        except OSError:
            return False

    def inspect(self, tag_dir: Path) -> CheckpointInfo:
        layout, problems = tag_problems(tag_dir)
        notes = []
        if read_latest(tag_dir.parent) == tag_dir.name:
            notes.append("DeepSpeed's latest names it")
        step = layout.global_steps if layout is not None and layout.global_steps is not None else number_in(tag_dir.name)
        return CheckpointInfo(tag_dir.name, str(tag_dir), step,
                              layout.dp_world_size * layout.mp_world_size if layout else None,
                              layout.zero_stage if layout else None, layout.dp_world_size if layout else None,
                              tuple(problems), "deepspeed", tuple(notes))


def point_latest(root: str | Path, tag: str) -> dict | None:
    """Make DeepSpeed's ``<root>/latest`` name ``tag`` (what ``engine.load_checkpoint(root)`` with no tag
    loads: ``DeepSpeedEngine._get_latest_tag`` reads it), if it names another tag or is missing. Written to
    ``.latest.orch.tmp`` beside it, then renamed over it (atomic on POSIX); the only change orch makes to
    a checkpoint directory.

    Returns:
        ``{"path", "from", "to"}`` when it was rewritten (``from`` None: there was none), else None.

    Raises:
        CheckpointError: it cannot be written (the directory is read-only, say).
    """
    path = Path(root) / "latest"
    before = read_latest(root)
    if before == tag:
        return None
    tmp = Path(root) / ".latest.orch.tmp"
    try:
        tmp.write_text(tag)
        os.replace(tmp, path)
    except OSError as err:
        raise CheckpointError(f"Cannot point DeepSpeed's {path} at {tag} ({err.strerror or err}); the script would "
                              f"load {before or 'nothing'} instead. Make {root} writable, or set resume.latest: "
                              "false and tell the script with resume.args.") from err
    return {"path": str(path), "from": before, "to": tag}
