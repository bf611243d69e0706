"""Export a ZeRO checkpoint as one consolidated fp32 ``state_dict`` file (``orch export``).

Usage::

    result = export_checkpoint("/state/jobs/quickstart-3f9c2a/checkpoints", "model.pt")
    model.load_state_dict(torch.load("model.pt", weights_only=True))   # the unwrapped nn.Module

Which checkpoint: by default the newest *complete* tag (:func:`orchestrator.checkpoints.latest_complete`),
never the tag in DeepSpeed's ``latest`` file, which DeepSpeed writes before orch's completion
marker exists; a tag named by the caller must be complete too (its problems are the error).

How, by the ZeRO stage the tag was saved at (its marker's ``zero_stage``):

* stages 1-3: DeepSpeed's own
  ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(dir, tag=tag)``. It
  concatenates every data-parallel rank's fp32 master partition (``*_optim_states.pt``:
  ``single_partition_of_fp32_groups`` at stages 1-2, ``fp32_flat_groups`` at stage 3) and cuts
  it by the parameter shapes of the model-states file(s); buffers come from the model-states
  file, turned to fp32. These are the fp32 master weights also when training ran in fp16/bf16.
* stage 0: nothing is partitioned and there is no ZeRO optimizer state (zero_to_fp32 fails on
  such a tag), but ``mp_rank_00_model_states.pt`` holds the whole module's ``state_dict()`` under
  ``module`` (``DeepSpeedEngine._save_checkpoint``), which is exported as it is when its
  floating-point tensors are fp32. In fp16/bf16 training that copy is 16-bit and the fp32 master
  weights are in the stage-0 optimizer's own state, which no DeepSpeed tool consolidates: such a
  tag is refused.

The output is ``torch.save`` of a plain ``{name: tensor}`` dict (loadable with
``torch.load(..., weights_only=True)``), every tensor with a storage of its own (never a view of
DeepSpeed's flat buffers, so the file holds no padding) and tied parameters still one tensor. It
is written to a temporary file beside the output and renamed into place, so a failed export never
leaves a partial file under the output's name (an existing file of that name is replaced).
Memory: the fp32 weights about twice over (DeepSpeed's merged buffers and the copies).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ExportError
from .tags import MARKER, UNIVERSAL_MARKER, CheckpointInfo, inspect_tag, is_universal_dir, latest_complete, scan

__all__ = ["ExportResult", "choose_tag", "consolidated_state_dict", "export_checkpoint"]

#: DeepSpeed's model-states file of ZeRO stages 0-2 (``DeepSpeedEngine._get_ckpt_name``).
MODEL_STATES = "mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        output: absolute path of the file written.
        tag: the checkpoint tag exported; ``step``: its step (-1 if unknown).
        source: the tag's directory.
        zero_stage, world_size: as the checkpoint's marker records them.
        method: ``"zero_to_fp32"`` (stages 1-3) or ``"module_states"`` (stage 0).
        tensors: entries in the state dict; ``params``: numbers in them (parameters and
            persistent buffers; a tied tensor counted once).
        dtypes: the distinct dtypes of the tensors, e.g. ``["float32"]``.
        bytes: size of the file written.
        seconds: wall-clock time of the whole export (reading, merging, writing).
    """

    output: str
    tag: str
    step: int
    source: str
    zero_stage: int | None
    world_size: int | None
    method: str
    tensors: int
    params: int
    dtypes: list[str]
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


def _tag_list(infos: list[CheckpointInfo]) -> str:
    return ", ".join(f"{i.tag} ({'complete' if i.complete else 'incomplete'})" for i in infos) or "none"


def choose_tag(checkpoint_dir: str | Path, tag: str | None = None, label: str = "The job") -> CheckpointInfo:
    """The complete checkpoint to export: ``tag``, or the newest complete one.

    Args:
        checkpoint_dir: the job's checkpoint directory (holds one directory per tag).
        tag: a tag name, or None for the newest complete tag.
        label: how messages name the owner, e.g. ``"Job quickstart-3f9c2a"``.

    Raises:
        ExportError: the directory does not exist; no tag is complete (each newer incomplete
            tag is listed with its problems); ``tag`` does not exist (the tags are listed) or
            is incomplete (its problems are listed).
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise ExportError(f"{label} saved no checkpoint: its checkpoint directory {root} does not exist (a "
                          "script saves into $ORCH_CHECKPOINT_DIR; examples/train_gpt.py does with "
                          "--checkpoint-interval N or --save-final).")
    if tag is None:
        info, skipped = latest_complete(root)
        if info is None and not skipped:
            raise ExportError(f"{label} saved no checkpoint: {root} holds no checkpoint tags (examples/train_gpt.py "
                              "saves with --checkpoint-interval N or --save-final).")
        if info is None:
            why = "; ".join(f"{s.tag}: {', '.join(s.problems)}" for s in skipped)
            if all(MARKER in " ".join(s.problems) and len(s.problems) == 1 for s in skipped):
                why += (f". orch counts a tag as complete once the script wrote {MARKER} after every rank's "
                        "save (docs/contract.md)")
            raise ExportError(f"{label} has no complete checkpoint in {root} to export ({why}).")
        return info
    if not tag or "/" in tag or tag in (".", "..") or not (root / tag).is_dir():
        raise ExportError(f"{label} has no checkpoint tag {tag!r} in {root}; its tags: {_tag_list(scan(root))}.")
    if is_universal_dir(root / tag):
        meta = _universal_source(root / tag)
        raise ExportError(f"Checkpoint {tag} in {root} is a universal checkpoint orch converted for a resume on "
                          f"another world size; export the checkpoint it was converted from instead "
                          f"(--tag {meta or tag.removesuffix('_universal')}): it holds the same weights.")
    info = inspect_tag(root / tag)
    if not info.complete:
        newest, _ = latest_complete(root)
        hint = f"; the newest complete one is {newest.tag}" if newest else "; no tag is complete"
        raise ExportError(f"Checkpoint {tag} in {root} is incomplete, so it is not exported: "
                          f"{'; '.join(info.problems)}{hint}.")
    return info


def _universal_source(path: Path) -> str | None:
    """The tag a universal checkpoint was converted from (its marker's ``source_tag``), or None."""
    try:
        return json.loads((path / UNIVERSAL_MARKER).read_text()).get("source_tag")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def _deepspeed_output_captured() -> Iterator[io.StringIO]:
    """Send what DeepSpeed prints (``print``, its logger, tqdm bars, the accelerator notice at import)
    to a buffer instead of this process's stdout and stderr (``--output json`` keeps stdout clean).

    The logger's handler holds the ``sys.stdout`` object of DeepSpeed's import time, so file
    descriptor 1 itself is pointed at a temporary file for the duration, where it has one.
    """
    buf = io.StringIO()
    sys.stdout.flush()
    try:
        fd: int | None = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        fd = None
    with tempfile.TemporaryFile() as sink:
        saved = None
        if fd is not None:
            saved = os.dup(fd)
            os.dup2(sink.fileno(), fd)
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                yield buf
        finally:
            sys.stdout.flush()
            if saved is not None:
                os.dup2(saved, fd)  # type: ignore[arg-type]
                os.close(saved)
                sink.seek(0)
                buf.write(sink.read().decode("utf-8", "replace"))


def _standalone(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Every tensor with a contiguous storage of its own; entries that were one tensor stay one."""
    import torch
    out: dict[str, Any] = {}
    first: dict[int, str] = {}
    for name, t in state_dict.items():
        if id(t) in first:
            out[name] = out[first[id(t)]]
            continue
        first[id(t)] = name
        t = t.detach()
        if not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)
        out[name] = t
    return out


def _stage0_state_dict(info: CheckpointInfo) -> dict[str, Any]:
    import torch
    path = Path(info.path) / MODEL_STATES
    # DeepSpeed's model-states file pickles more than tensors (its config, the script's args):
    # read it as DeepSpeed does (``weights_only=False``); it is the job's own file.
    states = torch.load(path, map_location="cpu", weights_only=False)
    module = states.get("module") if isinstance(states, dict) else None
    if not isinstance(module, dict) or not module:
        raise ExportError(f"{path} holds no module state_dict ('module'); it is not a DeepSpeed ZeRO stage-0 "
                          "model-states file.")
    low = sorted({str(v.dtype).replace("torch.", "") for v in module.values()
                  if v.is_floating_point() and v.dtype != torch.float32})
    if low:
        raise ExportError(f"Checkpoint {info.tag} was saved at ZeRO stage 0 with {'/'.join(low)} weights: its "
                          f"{MODEL_STATES} holds the module in {'/'.join(low)}, and the fp32 master weights are in "
                          "the stage-0 optimizer's state, which DeepSpeed's zero_to_fp32 does not read. Train with "
                          "ZeRO stage 1-3 to export fp32 weights, or load the 16-bit module from that file's "
                          "'module' entry.")
    return module


def consolidated_state_dict(info: CheckpointInfo) -> tuple[dict[str, Any], str]:
    """The full fp32 ``state_dict`` of a complete checkpoint, and how it was read.

    Args:
        info: a complete tag (:func:`choose_tag`), saved at ZeRO stage 0-3.

    Returns:
        ``({name: CPU tensor}, method)`` with ``method`` ``"zero_to_fp32"`` (stages 1-3) or
        ``"module_states"`` (stage 0); see the module docstring for where each comes from.

    Raises:
        ExportError: DeepSpeed cannot read the tag (its message is given), or a stage-0 tag
            holds 16-bit weights.
    """
    try:
        with _deepspeed_output_captured():
            if info.zero_stage:
                from deepspeed.utils.zero_to_fp32 import (
                    get_fp32_state_dict_from_zero_checkpoint,
                )
                # the tag is passed, so zero_to_fp32 never reads DeepSpeed's ``latest`` file
                sd, method = get_fp32_state_dict_from_zero_checkpoint(str(Path(info.path).parent),
                                                                     tag=info.tag), "zero_to_fp32"
            else:
                sd, method = _stage0_state_dict(info), "module_states"
    except ExportError:
        raise
    except Exception as err:
        raise ExportError(f"DeepSpeed could not read checkpoint {info.path} (ZeRO stage {info.zero_stage}): "
                          f"{type(err).__name__}: {err}.") from err
    return _standalone(sd), method


def _open_output(output: Path) -> tuple[Any, Path]:
    """A new temporary file beside ``output`` (proves it can be written before the slow part)."""
    if output.is_dir():
        raise ExportError(f"Output {output} is a directory; give a file name, e.g. {output / 'model.pt'}.")
    if not output.parent.is_dir():
        what = "is not a directory" if output.parent.exists() else "does not exist"
        raise ExportError(f"Cannot write {output}: {output.parent} {what}.")
    tmp = output.with_name(f".{output.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:  # mode 0666 less the umask, as the file a plain open() would make
        f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")
    except OSError as err:
        raise ExportError(f"Cannot write {output}: {err.strerror or err} (in {output.parent}).") from err
    return f, tmp


def export_checkpoint(checkpoint_dir: str | Path, output: str | Path, tag: str | None = None, *,
                      label: str = "The job", progress: Callable[[str], None] | None = None) -> ExportResult:
    """Write the consolidated fp32 ``state_dict`` of a complete ZeRO checkpoint to ``output``.

    Args:
        checkpoint_dir: the directory holding the tag directories (a job's ``ORCH_CHECKPOINT_DIR``).
        output: the file to write (``torch.save`` format); its directory must exist.
        tag: the tag to export; None: the newest complete one.
        label: how messages name the checkpoints' owner, e.g. ``"Job quickstart-3f9c2a"``.
        progress: called with a short sentence as each phase starts (reading, writing).

    Returns:
        What was written (:class:`ExportResult`).

    Raises:
        ExportError: no such directory or tag, no complete tag, an incomplete tag named, a
            checkpoint DeepSpeed cannot read, a 16-bit stage-0 checkpoint, or an output that
            cannot be written (a directory, a missing directory, no permission, disk full).
    """
    t0 = time.monotonic()
    say = progress or (lambda _msg: None)
    info = choose_tag(checkpoint_dir, tag, label)
    out = Path(output).expanduser().absolute()
    f, tmp = _open_output(out)
    try:
        with f:
            import torch  # after the checks above: a bad request fails without torch's import time
            world = f"{info.world_size} rank(s)" if info.world_size else "unknown world size"
            say(f"Reading checkpoint {info.tag} (ZeRO stage {info.zero_stage}, {world}) with DeepSpeed's "
                f"{'zero_to_fp32' if info.zero_stage else 'model-states file'}")
            sd, method = consolidated_state_dict(info)
            unique = {id(t): t for t in sd.values()}.values()
            params = sum(t.numel() for t in unique)
            say(f"Writing {len(sd)} tensors ({params:,} numbers) to {out}")
            try:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            except (OSError, RuntimeError) as err:  # torch's zip writer raises RuntimeError on a full disk
                raise ExportError(f"Cannot write {out}: {getattr(err, 'strerror', None) or err}.") from err
        try:
            os.replace(tmp, out)
        except OSError as err:
            raise ExportError(f"Cannot write {out}: {err.strerror or err}.") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in unique})
    return ExportResult(str(out), info.tag, info.step, info.path, info.zero_stage, info.world_size, method,
                        len(sd), params, dtypes, out.stat().st_size, round(time.monotonic() - t0, 3))
