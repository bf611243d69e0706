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

A checkpoint resumed on another world size is first converted to DeepSpeed's universal
format (:func:`convert_to_universal`, DeepSpeed's own ``ds_to_universal`` tool) into the
sibling directory ``<tag>_universal``, which counts as finished only once orch wrote its
marker ``orch_universal.json`` there. Such directories are not tags of their own: :func:`scan`
leaves them out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from ..errors import CheckpointError

__all__ = ["CheckpointInfo", "inspect_tag", "scan", "latest_complete", "MARKER", "UNIVERSAL_MARKER", "is_universal_dir",
           "UNIVERSAL_SUFFIX", "UniversalCheckpoint", "needs_universal", "convert_to_universal"]

#: The completion marker rank 0 writes last.
MARKER = "orch_checkpoint.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """One tag directory and what was found in it.

    Attributes:
        tag: the directory name (DeepSpeed's checkpoint tag).
        path: the tag directory.
        step: the step saved (from the marker), or -1 if unknown.
        world_size, zero_stage, dp_world_size: from the marker (or the format's own files), or None.
        problems: why the tag is incomplete (or damaged, or marked bad); empty when complete.
        format: the format that read it (``orchestrator.checkpoints.formats``): ``orch``,
            ``deepspeed``, ``hf_trainer`` or ``accelerate``.
        notes: things worth saying that do not make it incomplete.
    """

    tag: str
    path: str
    step: int = -1
    world_size: int | None = None
    zero_stage: int | None = None
    dp_world_size: int | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)
    format: str = "orch"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def complete(self) -> bool:
        """True when nothing is missing."""
        return not self.problems

    def to_dict(self) -> dict:
        """JSON-able form (``orch status``, ``orch resume --dry-run``)."""
        return {"tag": self.tag, "path": self.path, "step": self.step, "format": self.format,
                "complete": self.complete, "problems": list(self.problems), "notes": list(self.notes),
                "world_size": self.world_size, "zero_stage": self.zero_stage, "dp_world_size": self.dp_world_size}


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
    """Inspect every tag directory under ``checkpoint_dir``, newest step first.

    Hidden directories (orch's own, such as preflight's ``.orch-preflight-*``) and universal
    conversions (``<tag>_universal``) are not tags."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    infos = [inspect_tag(p) for p in root.iterdir()
             if p.is_dir() and not p.name.startswith(".") and not is_universal_dir(p)]
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


# -- universal checkpoints (resuming on another world size) ------------------------------------

#: The marker orch writes into a universal checkpoint once DeepSpeed's converter finished.
UNIVERSAL_MARKER = "orch_universal.json"
#: The universal checkpoint of tag ``T`` is the sibling directory ``T + UNIVERSAL_SUFFIX``.
UNIVERSAL_SUFFIX = "_universal"
#: DeepSpeed's converter, run as ``<python> -m <this>``.
CONVERTER = "deepspeed.checkpoint.ds_to_universal"


@dataclass(frozen=True)
class UniversalCheckpoint:
    """A complete checkpoint converted to DeepSpeed's universal format.

    Load it with ``engine.load_checkpoint(<checkpoint dir>, tag=<tag>)`` under a DeepSpeed config
    with ``"checkpoint": {"load_universal": true}``, at any data-parallel world size.

    Attributes:
        tag: ``<source tag>_universal``.
        path: its directory, beside the source tag's.
        source: the checkpoint it was converted from.
        seconds: wall-clock seconds the conversion took (the earlier conversion's, when reused).
        reused: True when a finished conversion of the very same save was found and used.
    """

    tag: str
    path: str
    source: CheckpointInfo
    seconds: float
    reused: bool


def is_universal_dir(path: Path) -> bool:
    """A conversion's output (finished or not): ``<T>_universal`` beside ``<T>``, or one with orch's marker."""
    name = path.name
    if not name.endswith(UNIVERSAL_SUFFIX):
        return False
    return (path / UNIVERSAL_MARKER).exists() or (path.parent / name[: -len(UNIVERSAL_SUFFIX)]).is_dir()


def needs_universal(info: CheckpointInfo, world_size: int) -> bool:
    """Whether resuming ``info`` with ``world_size`` ranks needs a universal checkpoint.

    DeepSpeed loads ZeRO optimizer partitions only at the data-parallel world size that saved
    them (``DeepSpeedEngine._load_zero_checkpoint`` raises "The checkpoint being loaded used a DP
    world size of ..."), and orch's per-rank files name the saving ranks. A marker without a
    ``world_size`` (not written by an orch-contract script) is resumed as it is.
    """
    return info.world_size is not None and info.world_size != world_size


def _read_source_marker(info: CheckpointInfo) -> dict:
    try:
        return json.loads((Path(info.path) / MARKER).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"Cannot read {Path(info.path) / MARKER}: {err}.") from err


def _source_files(tag_dir: Path, stage: int, dp: int) -> list[str]:
    """The DeepSpeed files of the saving world (model states, one optimizer partition per
    data-parallel rank): what the converter must read, and nothing a larger earlier save left."""
    if stage >= 3:
        names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)]
    else:
        names = ["mp_rank_00_model_states.pt"]
    present = os.listdir(tag_dir)
    for r in range(dp):  # ``zero_pp_rank_<r>_...`` or ``bf16_zero_pp_rank_<r>_...``, as in _deepspeed_problems
        suffix = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        names += [n for n in present if n.endswith(suffix)]
    return sorted(set(names))


def _finished(out: Path, source_tag: str, source_marker: dict) -> dict | None:
    """The marker of a finished conversion of exactly this save (same source marker), else None."""
    try:
        meta = json.loads((out / UNIVERSAL_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(meta, dict) and meta.get("source_tag") == source_tag and meta.get("source") == source_marker:
        return meta
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (two controllers never convert one tag at once)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _output_problems(out: Path, stage: int) -> list[str]:
    """What a converter run that said it succeeded failed to leave in ``out``."""
    problems = []
    zero = out / "zero"
    if not zero.is_dir() or not any((d / "fp32.pt").is_file() for d in zero.iterdir() if d.is_dir()):
        problems.append(f"no {zero}/<parameter>/fp32.pt")
    model = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage >= 3 else "mp_rank_00_model_states.pt"
    if not _nonempty(out / model):
        problems.append(f"no {model}")
    return problems


def _tail(path: Path, lines: int = 6) -> str:
    """The last non-blank lines of a log (progress bars' carriage returns split lines), joined by ``" | "``."""
    try:
        text = path.read_bytes()[-8192:].decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join([ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()][-lines:])


def _run_converter(argv: list[str], log: Path, env: Mapping[str, str] | None, timeout: float | None,
                   popen: Callable[..., Any]) -> int:
    """Run the converter in its own process group (its worker processes go with it on a timeout)."""
    with open(log, "wb") as f:
        try:
            proc = popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env=dict(env) if env is not None else None, start_new_session=True)
        except OSError as err:
            raise CheckpointError(f"Cannot run DeepSpeed's checkpoint converter with {argv[0]}: "
                                  f"{err.strerror or err}.") from err
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise CheckpointError(f"DeepSpeed's checkpoint converter ran longer than {timeout:g} s and was "
                                  f"stopped; its output is in {log}.") from None


def convert_to_universal(info: CheckpointInfo, python: str, *, env: Mapping[str, str] | None = None,
                         timeout: float | None = None,
                         popen: Callable[..., Any] = subprocess.Popen) -> UniversalCheckpoint:
    """Convert a complete ZeRO checkpoint to DeepSpeed's universal format, or reuse a finished conversion.

    Runs ``<python> -m deepspeed.checkpoint.ds_to_universal --input_folder <in> --output_folder
    <tag>_universal`` (DeepSpeed's tool: it merges every data-parallel rank's optimizer partition
    into ``zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt`` and copies the model-states
    files; it also writes ``latest_universal`` beside the tags, which orch does not use). ``<in>``
    is a directory of links to exactly the files the marker's world saved, so files an earlier,
    larger save left in the tag are never merged in. On success orch writes ``orch_universal.json``
    (``format``, ``tag``, ``source_tag``, ``step``, ``source``: the source's marker,
    ``seconds``, ``time``) last; a directory without it is a conversion cut short and is removed
    and redone. A finished conversion of the same save (equal source marker) is reused. Runs
    where this is called: the controller's host, which must see the checkpoint directory.

    Args:
        info: a complete checkpoint (:func:`inspect_tag`), saved at ZeRO stage 1, 2 or 3.
        python: interpreter with DeepSpeed installed (the job spec's ``python``).
        env: the converter's environment (None: this process's).
        timeout: seconds before the converter is killed (None: no limit).
        popen: ``subprocess.Popen`` or a stand-in (tests).

    Returns:
        The universal checkpoint.

    Raises:
        CheckpointError: the checkpoint is incomplete or of ZeRO stage 0 (``ds_to_universal``
            reads ZeRO optimizer partitions, which stage 0 has none of), the converter could
            not run, failed (its last lines and log file are named), ran past ``timeout``, or
            left no weights.
    """
    src = Path(info.path)
    if not info.complete:
        raise CheckpointError(f"Checkpoint {src} is incomplete ({'; '.join(info.problems)}); it cannot be converted "
                              "to DeepSpeed's universal format.")
    if not info.zero_stage:
        raise CheckpointError(f"Checkpoint {src} was saved at ZeRO stage 0 by {info.world_size} rank(s); DeepSpeed's "
                              "universal converter (ds_to_universal) reads ZeRO stage 1-3 checkpoints only, so orch "
                              "cannot resume it on another number of ranks. Resume it on as many ranks as saved it, "
                              "or use ZeRO stage 1-3.")
    source_marker = _read_source_marker(info)
    out = src.with_name(info.tag + UNIVERSAL_SUFFIX)
    with _locked(src.with_name(f".{out.name}.lock")):
        done = _finished(out, info.tag, source_marker)
        if done is not None:
            return UniversalCheckpoint(out.name, str(out), info, float(done.get("seconds", 0.0)), True)
        if out.exists():
            shutil.rmtree(out)  # a conversion cut short, or one of an earlier save of this tag
        staging = out / ".source"
        staging.mkdir(parents=True)
        for name in _source_files(src, info.zero_stage, info.dp_world_size or info.world_size or 1):
            (staging / name).symlink_to((src / name).resolve())
        log = out / "orch_convert.log"
        argv = [python, "-m", CONVERTER, "--input_folder", str(staging), "--output_folder", str(out)]
        t0 = time.monotonic()
        code = _run_converter(argv, log, env, timeout, popen)
        seconds = time.monotonic() - t0
        if code != 0:
            raise CheckpointError(f"DeepSpeed's checkpoint converter failed on {src} (exit status {code}): "
                                  f"{_tail(log) or 'no output'}. Full output: {log}.")
        problems = _output_problems(out, info.zero_stage)
        if problems:
            raise CheckpointError(f"DeepSpeed's checkpoint converter exited 0 but left {'; '.join(problems)} in "
                                  f"{out}; its output is in {log}.")
        shutil.rmtree(staging)
        marker = {"format": 1, "tag": out.name, "source_tag": info.tag, "step": info.step, "source": source_marker,
                  "seconds": round(seconds, 3), "time": time.time()}
        tmp = out / f".{UNIVERSAL_MARKER}.tmp"
        tmp.write_text(json.dumps(marker, indent=1) + "\n")
        os.replace(tmp, out / UNIVERSAL_MARKER)
    return UniversalCheckpoint(out.name, str(out), info, seconds, False)
