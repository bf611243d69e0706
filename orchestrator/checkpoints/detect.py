"""Which checkpoint format a directory holds, and the format of a name (``resume.format``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .formats import CheckpointFormat

# The formats are imported where they are used: ``orch plan`` asks which format a directory that is usually
# not there yet holds, and loading every format for that was ~25 ms of its start-up.

__all__ = ["get_format", "detect_format", "FORMAT_NAMES"]

#: The formats orch reads, in the order ``auto`` tries them.
FORMAT_NAMES = ("orch", "hf_trainer", "accelerate", "deepspeed")


def get_format(name: str) -> CheckpointFormat:
    """The format called ``name`` (one of :data:`FORMAT_NAMES`).

    Raises:
        ValueError: no such format.
    """
    from .formats import DeepSpeedFormat, OrchFormat
    from .hf import AccelerateFormat, HFTrainerFormat
    formats = {"orch": OrchFormat, "deepspeed": DeepSpeedFormat, "hf_trainer": HFTrainerFormat,
               "accelerate": AccelerateFormat}
    if name not in formats:
        raise ValueError(f"unknown checkpoint format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    return formats[name]()


def detect_format(root: str | Path) -> tuple[str, str]:
    """Which format the checkpoints under ``root`` are in, and why: ``(name, reason)``.

    The first that matches: a tag with orch's marker (``orch``); a ``checkpoint-<N>`` directory
    (``hf_trainer``); a ``checkpoint_<N>`` directory, or ``root`` itself holding ``random_states_0.pkl``
    (``accelerate``); anything else, an empty or missing directory included (``deepspeed``).
    """
    root = Path(root)
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except FileNotFoundError:
        return "deepspeed", f"{root} does not exist yet"
    except OSError as err:
        return "deepspeed", f"{root} cannot be read ({err.strerror or err})"
    from .hf import AccelerateFormat
    from .tags import MARKER
    for p in children:
        if os.path.exists(p / MARKER):  # False, not an error, for an unreadable tag
            return "orch", f"{p.name}/{MARKER}"
    for p in children:
        if re.fullmatch(r"checkpoint-\d+", p.name):
            return "hf_trainer", f"{p.name} (HF Trainer's checkpoint-<step>)"
    if AccelerateFormat.is_state_dir(root):
        return "accelerate", f"{root.name}/random_states_0.pkl (Accelerate's save_state)"
    for p in children:
        if re.fullmatch(r"checkpoint_\d+", p.name):
            return "accelerate", f"{p.name} (Accelerate's checkpoint_<n>)"
    if os.path.isfile(root / "latest"):
        return "deepspeed", "latest (DeepSpeed's)"
    return "deepspeed", "no orch, HF Trainer or Accelerate checkpoint in it"
