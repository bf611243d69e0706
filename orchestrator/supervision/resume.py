"""Where a resumed attempt starts: the job's last complete checkpoint, converted to DeepSpeed's
universal format when the world size changed, or step 0 where starting over loses nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..checkpoints import MARKER, CheckpointInfo, UniversalCheckpoint, convert_to_universal
from ..errors import CheckpointError
from ..spec import JobSpec
from .prepare import rank_python
from .settings import env_seconds

__all__ = ["check_fresh_start", "convert"]


def check_fresh_start(job_id: str, resumed: list[str], spec: JobSpec, ckpt_dir: str, skipped: list[CheckpointInfo],
                      automatic: bool) -> None:
    """Allow a resume without a complete checkpoint to start from step 0, or refuse it.

    By hand (``orch resume`` without ``--fresh``) it is refused when the job had checkpointing: the
    spec names a ``checkpoint_dir`` (even an empty or missing one), or the checkpoint directory holds
    anything besides orch's own hidden entries (incomplete tags, DeepSpeed's ``latest``), or an earlier
    attempt started from a checkpoint (the directory merely existing says nothing: preflight creates
    it). An automatic restart starts from step 0 unless the job ever finished a save (a tag holds a
    completion marker, however damaged since) or an earlier attempt started from a checkpoint:
    restarting such a job from step 0 would silently throw its training away.

    Args:
        job_id: the job.
        resumed: the start checkpoints of its earlier attempts.
        spec: its spec.
        ckpt_dir: its checkpoint directory.
        skipped: the incomplete tags found there (``latest_complete``).
        automatic: a restart by the restart policy.

    Raises:
        CheckpointError: refused; names the directory and why each tag in it was skipped.
    """
    root = Path(ckpt_dir)
    if automatic:
        if not resumed and not any((Path(s.path) / MARKER).exists() for s in skipped):
            return
    elif not (spec.checkpoint_dir or resumed or skipped or _has_entries(root)):
        return
    if skipped:
        what = "every checkpoint tag in it is incomplete:\n" + "\n".join(
            f"  {s.tag}: {'; '.join(s.problems)}" for s in skipped)
    elif not root.exists():
        what = "the directory does not exist (no checkpoint was saved there)"
    else:
        what = "it holds no checkpoint tag directory"
    earlier = (f"\nEarlier attempts started from {', '.join(dict.fromkeys(resumed))}, which is gone or "
               "damaged." if resumed else "")
    then = "The automatic restart is not done, since it would start from step 0. " if automatic else ""
    raise CheckpointError(f"Job {job_id} has no complete checkpoint to resume from in {ckpt_dir}: {what}"
                          f"{earlier}\n{then}To start it again from step 0: orch resume {job_id} --fresh")


def convert(info: CheckpointInfo, spec: JobSpec, world_size: int) -> tuple[UniversalCheckpoint, dict[str, Any]]:
    """Convert ``info`` to DeepSpeed's universal format for a world of ``world_size`` ranks, on this host,
    with the spec's Python and ``env`` (``$ORCH_CONVERT_TIMEOUT_S``, default an hour).

    Returns:
        ``(the universal checkpoint, the data of its checkpoint_converted event)``.

    Raises:
        CheckpointError: see :func:`orchestrator.checkpoints.convert_to_universal`.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    universal = convert_to_universal(info, rank_python(spec), env={**env, **spec.env},
                                     timeout=env_seconds("ORCH_CONVERT_TIMEOUT_S", 3600.0))
    return universal, {
        "from_tag": info.tag, "tag": universal.tag, "step": info.step, "zero_stage": info.zero_stage,
        "from_world_size": info.world_size, "from_dp_world_size": info.dp_world_size,
        "to_world_size": world_size, "seconds": round(universal.seconds, 3), "reused": universal.reused,
        "path": universal.path}


def _has_entries(directory: Path) -> bool:
    """Whether a directory holds anything but hidden entries (orch's own, e.g. preflight's)."""
    try:
        return any(not e.name.startswith(".") for e in directory.iterdir())
    except OSError:
        return False
