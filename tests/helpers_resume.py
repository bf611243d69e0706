"""Shared steps of the native-resume tests: run a job in the foreground and kill one of its ranks mid-run,
read the losses out of the rank logs, and damage checkpoint files the ways disks and people do."""

from __future__ import annotations

import os
import re
import signal
import struct
import zipfile
from pathlib import Path
from typing import Any

from conftest import wait_for


def wait_listed(orch: Any, timeout: float = 60) -> str:
    """The id of the state dir's only job, once it is listed."""
    return wait_for(lambda: (orch.json("list") or [None])[0], timeout, "the job to be listed")["id"]


def kill_rank_at(orch: Any, job: str, rank: int, at_step: int, pattern: str = r"^step=(\d+) ",
                 timeout: float = 300, log_rank: int | None = None) -> int:
    """SIGKILL rank ``rank`` of the job's first attempt once the log of rank ``log_rank`` (default: the same)
    shows a step >= ``at_step`` (``pattern``'s group 1); returns that step."""
    log = orch.state_dir / "jobs" / job / "attempt-1" / "logs" / f"rank-{rank if log_rank is None else log_rank}.log"
    pid: int | None = None

    def step_now() -> int | None:
        nonlocal pid
        if pid is None:
            ranks = orch.json("status", job).get("ranks") or []
            pid = next((r["pid"] for r in ranks if r["global_rank"] == rank and r["pid"]), None)
            return None
        try:
            text = log.read_text(errors="replace").replace("\r", "\n")  # progress bars' carriage returns
            steps = [int(m) for m in re.findall(pattern, text, re.MULTILINE)]
        except OSError:
            return None
        return max(steps) if steps and max(steps) >= at_step else None
    step = wait_for(step_now, timeout, f"rank {rank} to reach step {at_step}", interval=0.01)
    os.kill(pid, signal.SIGKILL)
    return step


def wait_state(orch: Any, job: str, state: str, attempt: int, timeout: float = 120) -> dict:
    """The job's status once it is ``state`` at attempt ``attempt``."""
    return wait_for(lambda: (lambda d: d if d["state"] == state and d["attempt"] == attempt else None)(
        orch.json("status", job)), timeout, f"job {job} to be {state} at attempt {attempt}", interval=0.2)


def stop(proc: Any) -> None:
    """Kill a background ``orch`` and its session if it is still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_and_kill(orch: Any, spec: Path, rank: int, at_step: int, pattern: str = r"^step=(\d+) ",
                 timeout: float = 300, log_rank: int | None = None) -> str:
    """``orch run spec`` in the background, rank ``rank`` killed at step ``at_step`` or later
    (:func:`kill_rank_at`). Returns the job id, once the run has ended FAILED."""
    proc = orch.popen("run", str(spec))
    try:
        job = wait_listed(orch)
        kill_rank_at(orch, job, rank, at_step, pattern, timeout, log_rank)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, out[-2000:] + err[-2000:]
    finally:
        stop(proc)
    assert orch.json("status", job)["state"] == "FAILED"
    return job


def losses(log: Path, pattern: str = r"^step=(\d+) rank=\d+ loss=(\S+)") -> dict[int, str]:
    """``{step: loss as printed}`` of one rank's log (the last line of a step wins)."""
    text = log.read_text(errors="replace").replace("\r", "\n")  # progress bars' carriage returns
    return {int(s): loss for s, loss in re.findall(pattern, text, re.MULTILINE)}


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut a file to ``keep`` of its size."""
    os.truncate(path, int(path.stat().st_size * keep))


def _data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where an entry's bytes start: after its local header, whose extra field (torch pads it to align
    tensors) may differ from the central directory's."""
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len


def flip_tensor_byte(path: Path) -> None:
    """Change one byte inside the first tensor's data of a torch zip file, keeping its size and its zip
    directory (what ``torch.load`` reads back silently)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if re.search(r"/data/\d+$", i.filename) and i.file_size > 16)
    offset = _data_offset(path, info) + info.file_size // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def break_byteorder(path: Path) -> None:
    """Rewrite a torch zip file's ``byteorder`` record in place (same size, same zip directory): the
    cheap checks pass and ``torch.load`` raises "Unknown endianness type"."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/byteorder"))
    with open(path, "r+b") as f:
        f.seek(_data_offset(path, info))
        f.write(b"x" * info.file_size)
