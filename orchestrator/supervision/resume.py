"""Where a resumed attempt starts: the job's last complete, undamaged checkpoint (in whatever format
its script wrote, ``orchestrator.checkpoints.integrity.choose``), converted to DeepSpeed's universal
format when the world size changed, or step 0 where starting over loses nothing; how the script is
told (arguments, variables, DeepSpeed's ``latest``); and which tags a crash on load marks bad.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..checkpoints import MARKER, CheckpointInfo, UniversalCheckpoint, convert_to_universal
from ..checkpoints.deepspeed_layout import read_latest
from ..checkpoints.detect import detect_format
from ..checkpoints.formats import number_in, point_latest
from ..checkpoints.integrity import Choice
from ..errors import CheckpointError
from ..observe.checkpoints import job_choice
from ..spec import JobSpec
from ..planning import JobPlan
from ..store import JobState, Store
from .messages import rank_log_tail
from .prepare import rank_python, resume_dir_of
from .settings import env_seconds

__all__ = ["mark_if_crashed_loading", "check_fresh_start", "check_reachable", "check_world", "fresh_start_note", "convert", "find_start", "tell_script", "LOAD_FRAMES",
           "crashed_loading"]


def find_start(store: Store, job_id: str, spec: JobSpec, state_dir: str | Path, contents: bool = True) -> Choice:
    """The checkpoint the job's next attempt would start from, every checkpoint found and why the newer ones
    were skipped (:func:`orchestrator.observe.checkpoints.job_choice` over the spec's resume directory).

    Args:
        store: the job's store (manifests, bad tags).
        job_id, spec: the job.
        state_dir: orch's state directory (the default checkpoint directory is under it).
        contents: hash the chosen files again against the manifest (False: compare sizes only).

    Raises:
        CheckpointError: the spec names an unknown format (cannot happen for a validated spec).
    """
    try:
        return job_choice(store, job_id, resume_dir_of(spec, state_dir, job_id), spec.resume.format, contents)
    except ValueError as err:
        raise CheckpointError(f"Job {job_id}: {err}.") from err


def fresh_start_note(spec: JobSpec, state_dir: str | Path, job_id: str) -> str | None:
    """What ``--fresh`` cannot do, said before it starts: a DeepSpeed script that calls
    ``engine.load_checkpoint(dir)`` itself loads the tag ``<dir>/latest`` names whatever orch says (orch
    rewrites ``latest`` only to point at a chosen tag, never away). None when there is no such file."""
    root = resume_dir_of(spec, state_dir, job_id)
    fmt = spec.resume.format if spec.resume.format != "auto" else detect_format(root)[0]
    latest = read_latest(root) if fmt in ("deepspeed", "orch") else None
    if latest is None:
        return None
    return (f"--fresh: DeepSpeed's {Path(root) / 'latest'} names {latest}; a script that calls "
            f"engine.load_checkpoint({root}) loads that tag anyway, whatever orch records (a start from step 0). "
            f"To really start over, remove the script's load argument or move {Path(root) / 'latest'} away")


def check_reachable(store: Store, job_id: str, choice: Choice) -> None:
    """With no checkpoint to start from, refuse to call a job "never saved" when its agents recorded
    checkpoints in a directory this host cannot see now (storage not mounted, permissions).

    Raises:
        CheckpointError: the directory is missing or unreadable, or holds none of the tags recorded there.
    """
    if choice.chosen is not None:
        return
    recorded = store.manifest_tags(job_id, choice.dir)
    if not recorded:
        return
    try:
        entries = os.listdir(choice.dir)
        why = None if choice.checkpoints else f"holds none of them now ({len(entries)} other entries)"
    except FileNotFoundError:
        why = "is missing on this host"
    except OSError as err:
        why = f"cannot be read ({err.strerror or err})"
    if why is None:
        return
    newest = max(recorded, key=lambda t: (number_in(t), t))
    raise CheckpointError(f"Job {job_id}'s agents recorded {len(recorded)} checkpoint(s) in {choice.dir} (newest "
                          f"{newest}), but the directory {why}: is its storage mounted here, and readable? Nothing "
                          f"was started. Once it is back: orch resume {job_id}")


def check_world(info: CheckpointInfo, world_size: int) -> None:
    """A DeepSpeed, HF Trainer or Accelerate checkpoint saved at ZeRO stage 1-3 resumes only on as many
    data-parallel ranks as saved it: DeepSpeed loads ZeRO optimizer partitions at the saving data-parallel
    world size alone (``DeepSpeedEngine._load_zero_checkpoint``: "The checkpoint being loaded used a DP
    world size of ..."). orch converts only its own format's checkpoints to the universal format.

    The attempt's data-parallel size is ``world_size`` divided by the checkpoint's model-parallel degree
    (``info.world_size // info.dp_world_size``: pipeline stages x tensor slices, which the script fixes),
    so a 2-stage pipeline saved by 1 data-parallel rank resumes on 2 ranks.

    Raises:
        CheckpointError: it was saved by another number of data-parallel ranks; names both and what to do.
    """
    saved = info.dp_world_size
    if not info.zero_stage or saved is None or saved <= 0:
        return
    mp = info.world_size // saved if info.world_size and info.world_size % saved == 0 else 1
    if world_size % mp == 0 and world_size // mp == saved:
        return
    model = f" x {mp} model-parallel ranks" if mp > 1 else ""
    raise CheckpointError(f"Checkpoint {info.path} ({info.format} format, ZeRO stage {info.zero_stage}) was saved by "
                          f"{saved} data-parallel ranks{model}, but this attempt has {world_size} ranks: DeepSpeed "
                          "loads ZeRO optimizer partitions only at the data-parallel world size that saved them, and "
                          "orch converts only checkpoints of its own contract to DeepSpeed's universal format. Resume "
                          f"on {saved * mp} ranks (the same hosts and slots), or start over with --fresh.")


def tell_script(spec: JobSpec, choice: Choice) -> tuple[tuple[str, ...], dict[str, str]]:
    """How the resumed script learns its checkpoint: ``(arguments added, variables set)`` (the spec's
    ``resume.args`` with ``{checkpoint}``, ``{tag}``, ``{dir}``, ``{step}`` filled, or the format's
    default; ``ORCH_RESUME_CHECKPOINT`` and the spec's ``resume.env``, each the checkpoint's directory)."""
    info = choice.chosen
    if info is None:
        return (), {}
    values = {"checkpoint": info.path, "tag": info.tag, "dir": choice.dir, "step": info.step}
    args = tuple(a.format(**values) for a in spec.resume.resume_args(choice.format))
    env = {"ORCH_RESUME_CHECKPOINT": info.path}
    if spec.resume.env:
        env[spec.resume.env] = info.path
    return args, env


def rewrite_latest(spec: JobSpec, choice: Choice) -> dict | None:
    """Point DeepSpeed's ``latest`` at the chosen tag when the spec's ``resume.latest`` (default: for the
    ``deepspeed`` format) says so and it names another one (:func:`orchestrator.checkpoints.formats.point_latest`).

    Returns:
        The ``checkpoint_latest_rewritten`` event's data (``path``, ``from``, ``to``), or None (nothing changed).

    Raises:
        CheckpointError: ``latest`` cannot be written.
    """
    if choice.chosen is None or not spec.resume.rewrites_latest(choice.format):
        return None
    return point_latest(choice.dir, choice.chosen.tag)


#: Traceback frames that say a rank died loading its checkpoint: DeepSpeed's, HF Trainer's and
#: Accelerate's load functions, and the file readers they call.
LOAD_FRAMES = ("in load_checkpoint", "in _load_checkpoint", "in _load_zero_checkpoint", "in load_state",
               "in load_accelerator_state", "in _load_from_checkpoint", "in _load_rng_state",
               "in _load_optimizer_and_scheduler", "in deepspeed_load_checkpoint", "in load_module_state_dict",
               "torch/serialization.py", "safetensors", "PytorchStreamReader failed", "in _load_universal")


def crashed_loading(log_tail: list[str]) -> str | None:
    """The line that shows a rank died in checkpoint-loading code (its last traceback passes through one
    of :data:`LOAD_FRAMES`), or None. Lines may carry a prefix (torch's ``[rank1]:``)."""
    start = max((i for i, ln in enumerate(log_tail) if "Traceback (most recent call last)" in ln), default=None)
    if start is None:
        return None
    frames = log_tail[start:]
    if not any(f in ln for ln in frames for f in LOAD_FRAMES):
        return None
    last = next((ln for ln in reversed(frames) if ln.strip()), "")
    return re.sub(r"^\[rank\d+\]:\s*", "", last.strip()) or None


def check_fresh_start(job_id: str, resumed: list[str], spec: JobSpec, ckpt_dir: str, skipped: list[CheckpointInfo],
                      automatic: bool, ever_saved: bool = False) -> None:
    """Allow a resume without a complete checkpoint to start from step 0, or refuse it.

    By hand (``orch resume`` without ``--fresh``) it is refused when the job had checkpointing: the
    spec names a ``checkpoint_dir`` (even an empty or missing one), or the checkpoint directory holds
    anything besides orch's own hidden entries (incomplete tags, DeepSpeed's ``latest``), or an earlier
    attempt started from a checkpoint (the directory merely existing says nothing: preflight creates
    it). An automatic restart starts from step 0 unless the job ever finished a save (a tag holds a
    completion marker, or one complete by its format was skipped as damaged or bad) or an earlier attempt
    started from a checkpoint:
    restarting such a job from step 0 would silently throw its training away.

    Args:
        job_id: the job.
        resumed: the start checkpoints of its earlier attempts.
        spec: its spec.
        ckpt_dir: its checkpoint directory.
        skipped: the incomplete tags found there (``latest_complete``).
        automatic: a restart by the restart policy.
        ever_saved: a checkpoint complete by its format's rules was skipped (damaged since, or marked bad).

    Raises:
        CheckpointError: refused; names the directory and why each tag in it was skipped.
    """
    root = Path(ckpt_dir)
    if automatic:
        if not resumed and not ever_saved and not any((Path(s.path) / MARKER).exists() for s in skipped):
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


def mark_if_crashed_loading(store: Store, plan: JobPlan, root: str) -> None:
    """A resumed attempt (``plan``) whose failing rank died in checkpoint-loading code (:func:`crashed_loading`)
    before any rank reported a training step marks that tag bad in ``root`` (the job's resume directory): no
    resume, automatic or by hand, starts from it again until it is saved again (event ``checkpoint_marked_bad``)."""
    job = store.get_job(plan.job_id)
    cause = job.cause or {}
    cause = cause.get("first_symptom", cause)
    if not plan.resume_tag or job.state != JobState.FAILED or cause.get("kind") != "rank_exit":
        return
    start = plan.resume_universal_from or plan.resume_tag
    line = crashed_loading(rank_log_tail(plan.to_dict(), int(cause["global_rank"]), lines=80))
    if line is None or store.latest_progress(job.id, plan.attempt):  # a step means it had loaded
        return
    reason = f"rank {cause['global_rank']} of attempt {plan.attempt} crashed loading it ({line})"
    store.mark_checkpoint_bad(job.id, plan.attempt, root, start, reason)
    store.add_event(job.id, plan.attempt, "checkpoint_marked_bad", {"tag": start, "reason": reason})
