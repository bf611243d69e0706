"""The Hugging Face formats: HF Trainer's ``checkpoint-<N>`` and Accelerate's ``save_state`` directories.

File names and the order of writes are those of the installed libraries:

* ``transformers.Trainer._save_checkpoint`` (5.x): ``save_model`` (``model.safetensors``, or the
  shards of ``model.safetensors.index.json``; nothing under ZeRO-3 unless
  ``stage3_gather_16bit_weights_on_model_save``), then ``_save_optimizer_and_scheduler``
  (``optimizer.pt``, ``scheduler.pt``; with DeepSpeed ``engine.save_checkpoint(checkpoint-<N>)``
  instead, so a ``global_step<N>`` tag and ``latest`` inside), ``_save_rng_state``
  (``rng_state.pth`` for one process, else ``rng_state_<process index>.pth``), and last
  ``trainer_state.json`` (``global_step``) from the main process. Resumed with
  ``--resume_from_checkpoint <checkpoint-N>``.
* ``accelerate.Accelerator.save_state`` (1.x, ``accelerate.checkpointing.save_accelerator_state``):
  ``model.safetensors`` (``pytorch_model.bin`` without safetensors; ``model_<i>`` for more models),
  ``optimizer.bin``, ``scheduler.bin``, ``sampler.bin``, and one ``random_states_<process index>.pkl``
  per process (holding ``step``); with the DeepSpeed plugin ``engine.save_checkpoint(dir,
  "pytorch_model")`` instead of the model and optimizer files. With ``automatic_checkpoint_naming``
  the directories are ``<project_dir>/checkpoints/checkpoint_<save number>``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .deepspeed_layout import DeepSpeedLayout, read_latest, tag_problems
from .formats import CheckpointFormat, number_in
from .headers import file_problem, read_torch_pickle
from .tags import CheckpointInfo

__all__ = ["HFTrainerFormat", "AccelerateFormat", "per_process_problems"]

WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def per_process_problems(names: list[str], pattern: str, what: str, expected: int | None) -> tuple[int, list[str]]:
    """Check the per-process files of a checkpoint (``rng_state_<i>.pth``, ``random_states_<i>.pkl``).

    Args:
        names: the file names in the checkpoint directory.
        pattern: a regex with one group, the process index (``r"rng_state_(\\d+)\\.pth"``).
        what: how to name the files in a problem.
        expected: how many processes saved it, when known (from the DeepSpeed layout), else None.

    Returns:
        ``(how many processes the files show, problems)``: a gap in the indexes, or fewer files than
        ``expected``, is a missing file of the process named.
    """
    found = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(pattern, n)))
    count = max(found[-1] + 1 if found else 0, expected or 0)
    missing = [i for i in range(count) if i not in found]
    sample = pattern.replace(r"(\d+)", "{}").replace("\\", "")
    return count, [f"{sample.format(i)} is missing ({what} of process {i})" for i in missing]


def _weights_problems(d: Path, names: list[str], required: bool) -> list[str]:
    for index in INDEXES:
        if index in names:
            try:
                shards = sorted(set(json.loads((d / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                return [f"{index} is unreadable ({err})"]
            return [f"{s} is missing (a shard {index} lists)" for s in shards if s not in names]
    if not any(w in names for w in WEIGHTS) and required:
        return ["no model weights (model.safetensors or pytorch_model.bin)"]
    return []


def _files_problems(d: Path, skip: set[str] = frozenset()) -> list[str]:
    """Header problems of every file directly in ``d`` (sub-directories are checked by their own rules)."""
    problems = []
    for name in sorted(os.listdir(d)):
        path = d / name
        if name in skip or name.startswith(".") or not path.is_file():
            continue
        problem = file_problem(path)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _deepspeed_inside(d: Path) -> tuple[DeepSpeedLayout | None, list[str]]:
    """The DeepSpeed tag saved inside a checkpoint directory (``latest`` names it), checked: its layout
    (None when unreadable) and its problems, each prefixed with the tag."""
    tag = read_latest(d)
    if tag is None:
        return None, ["DeepSpeed's latest is missing (it names the tag saved inside)"]
    if not (d / tag).is_dir():
        return None, [f"DeepSpeed's latest names {tag}, which is missing"]
    layout, problems = tag_problems(d / tag)
    return layout, [f"{tag}/{p}" for p in problems]


class HFTrainerFormat(CheckpointFormat):
    """``transformers.Trainer`` checkpoints, ``<output_dir>/checkpoint-<global step>`` (see the module docstring)."""

    name = "hf_trainer"
    tag_pattern = r"checkpoint-\d+"

    def is_tag(self, path: Path) -> bool:
        return True

    def inspect(self, tag_dir: Path) -> CheckpointInfo:
        names = sorted(os.listdir(tag_dir)) if tag_dir.is_dir() else []
        problems, step = [], number_in(tag_dir.name)
        if "trainer_state.json" not in names:
            problems.append("trainer_state.json is missing (the Trainer writes it last: the save did not finish)")
        elif problem := file_problem(tag_dir / "trainer_state.json"):  # not a regular file, not JSON, ...
            problems.append(f"trainer_state.json: {problem}")
        else:
            try:
                step = int(json.loads((tag_dir / "trainer_state.json").read_text())["global_step"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                problems.append(f"trainer_state.json has no global_step ({err})")
        deepspeed = "latest" in names or any(re.fullmatch(r"global_step\d+", n) for n in names)
        layout = None
        if deepspeed:
            layout, ds_problems = _deepspeed_inside(tag_dir)
            problems += ds_problems
        elif "optimizer.pt" not in names:
            problems.append("optimizer.pt is missing (the optimizer's state)")
        problems += _weights_problems(tag_dir, names, required=not deepspeed)
        dp = getattr(layout, "dp_world_size", None)
        if "rng_state.pth" not in names or dp not in (None, 1):
            _, rng = per_process_problems(names, r"rng_state_(\d+)\.pth", "the RNG state", dp if dp != 1 else None)
            problems += rng
        problems += _files_problems(tag_dir, skip={"trainer_state.json"})  # checked above
        return CheckpointInfo(tag_dir.name, str(tag_dir), step, dp, getattr(layout, "zero_stage", None), dp,
                              tuple(problems), self.name)


class AccelerateFormat(CheckpointFormat):
    """``Accelerator.save_state`` directories: ``checkpoint_<n>`` under ``<project_dir>/checkpoints``, or a
    directory ``save_state(dir)`` wrote, given as ``resume.dir`` itself (see the module docstring)."""

    name = "accelerate"
    tag_pattern = r"checkpoint_\d+"

    def is_tag(self, path: Path) -> bool:
        return True

    @staticmethod
    def is_state_dir(root: str | Path) -> bool:
        """Whether ``root`` is itself one ``save_state`` directory (``resume.dir`` naming it), not their parent."""
        return os.path.exists(Path(root) / "random_states_0.pkl")

    def scan(self, root: str | Path) -> list[CheckpointInfo]:
        if self.is_state_dir(root):
            return [self.inspect(Path(root))]
        return super().scan(root)

    def watch_dir(self, root: str | Path) -> tuple[str, str]:
        root = Path(root)
        if self.is_state_dir(root):
            return str(root.parent), re.escape(root.name)
        return str(root), self.tag_pattern

    def inspect(self, tag_dir: Path) -> CheckpointInfo:
        names = sorted(os.listdir(tag_dir)) if tag_dir.is_dir() else []
        problems, step = [], -1
        deepspeed = (tag_dir / "pytorch_model").is_dir() or "latest" in names
        layout = None
        if deepspeed:
            layout, problems = _deepspeed_inside(tag_dir)
        else:
            problems += _weights_problems(tag_dir, names, required=True)
            if "optimizer.bin" not in names:
                problems.append("optimizer.bin is missing (the optimizer's state)")
        dp = getattr(layout, "dp_world_size", None)
        processes, rng = per_process_problems(names, r"random_states_(\d+)\.pkl", "the RNG state and step", dp)
        if not processes:
            rng = ["random_states_0.pkl is missing (Accelerate writes one per process, last)"]
        problems += rng
        problems += _files_problems(tag_dir)
        if "random_states_0.pkl" in names and not any(p.startswith("random_states_0.pkl") for p in problems):
            try:
                state = read_torch_pickle(tag_dir / "random_states_0.pkl")
                step = int(state["step"]) if isinstance(state, dict) and "step" in state else -1
            except Exception:  # noqa: BLE001 - any unreadable state leaves the step unknown; the header check spoke
                step = -1
        return CheckpointInfo(tag_dir.name, str(tag_dir), step, processes or None, getattr(layout, "zero_stage", None),
                              dp or processes or None, tuple(problems), self.name)
