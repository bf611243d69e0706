"""Ranks a real launcher started (``launch_mode: native``), supervised by their node's agent.

Under native mode ``mpirun``/``mpiexec``/``srun`` start every rank through
``agents/native_rank.py``, which records its pid and exit status in ``<log dir>/.native``.
:class:`AdoptedRank` reads those files and offers what the agent uses of a
:class:`~agents.ranks.RankProcess` (``poll``, ``signal_group``, ``wait``, ``join_output``,
``pid``), so supervision, stop and cleanup are the same code for both modes. :func:`write_plans`
writes, before the tool starts, the environment each of the node's ranks is to get.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from typing import Iterable, Mapping

__all__ = ["AdoptedRank", "state_dir", "write_plans", "log_tail", "wrong_tool", "SHIM", "LOST_RETURNCODE"]

#: The per-rank program the real launcher runs (a file: see its docstring).
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_rank.py")
#: Return code reported for a rank whose process vanished without recording its end (SIGKILL).
LOST_RETURNCODE = -signal.SIGKILL


def state_dir(log_dir: str) -> str:
    """Where the node's native ranks' plan, pid and exit files live."""
    return os.path.join(log_dir, ".native")


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_plans(log_dir: str, host: str, workdir: str, world_size: int,
                ranks: Iterable[tuple[int, int, Mapping[str, str]]]) -> None:
    """Write ``rank-<r>.json`` for every ``(global rank, local rank, env)`` of this node.

    Raises:
        OSError: the log directory cannot be written.
    """
    d = state_dir(log_dir)
    os.makedirs(d, exist_ok=True)
    for rank, local, env in ranks:
        path = os.path.join(d, f"rank-{rank}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"global_rank": rank, "local_rank": local, "world_size": world_size, "host": host,
                       "cwd": workdir, "env": dict(env)}, f)
        os.replace(tmp, path)


class AdoptedRank:
    """One rank of this node started by the real launcher.

    Args:
        global_rank: the rank.
        log_dir: the node's log directory (``rank-<r>.log`` and ``.native/``).
    """

    def __init__(self, global_rank: int, log_dir: str) -> None:
        self.global_rank = global_rank
        self.log_path = os.path.join(log_dir, f"rank-{global_rank}.log")
        self._dir = state_dir(log_dir)
        self._pid: int | None = None
        self._child: int | None = None
        self._code: int | None = None
        self._gone_at: float | None = None

    @property
    def pid(self) -> int | None:
        """The rank's own process (the script), once it started."""
        self._look()
        return self._child

    @property
    def started(self) -> bool:
        """The launcher has started this rank."""
        self._look()
        return self._child is not None or self._code is not None

    def _look(self) -> None:
        if self._child is None:
            info = _read(os.path.join(self._dir, f"rank-{self.global_rank}.pid"))
            if info:
                self._pid, self._child = int(info["pid"]), int(info["child"])

    def poll(self) -> int | None:
        """The rank's return code once it ended (from its exit record; ``LOST_RETURNCODE`` when its
        processes vanished without one for a second), else None."""
        if self._code is not None:
            return self._code
        info = _read(os.path.join(self._dir, f"rank-{self.global_rank}.exit"))
        if info is not None:
            self._code = int(info["returncode"])
            return self._code
        self._look()
        if self._child is None or _alive(self._child) or (self._pid is not None and _alive(self._pid)):
            self._gone_at = None
            return None
        if self._gone_at is None:
            self._gone_at = time.monotonic()
        if time.monotonic() - self._gone_at > 1.0:  # the record would have been written by now
            self._code = LOST_RETURNCODE
        return self._code

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the rank's process group and, while the rank runs, to its wrapper; a no-op
        once gone. A wrapper whose rank has ended is left to exit on its own: killed in between, the
        tool (Hydra, srun) would count it a failed rank and abort the other nodes' ranks."""
        self._look()
        wrapper = self._pid if self.poll() is None else None
        for target, group in ((self._child, True), (wrapper, False)):
            if target is None:
                continue
            try:
                os.killpg(target, signum) if group else os.kill(target, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds for the rank to end; its code or None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None or not self.started:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def join_output(self, timeout: float = 5.0) -> None:
        """Nothing to join: the wrapper writes the log itself."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def log_tail(path: str, lines: int = 3, size: int = 8192) -> str:
    """The last non-blank lines of a log file, joined by " | ", for a message ("(no output)" if none);
    banners of dashes and asterisks are skipped."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no output)"
    kept = [ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip().strip("-*=") ]
    return " | ".join(kept[-lines:])[-600:] or "(no output)"


def wrong_tool(tool: str, family: str | None, env: dict[str, str]) -> str | None:
    """Why ``tool`` is not the MPI the launcher needs (``--version`` tells Open MPI from a Hydra), or None."""
    if family not in ("openmpi", "hydra"):
        return None
    try:
        r = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=15, env=env,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{tool} --version failed: {err}"
    text = r.stdout + r.stderr
    openmpi = "Open MPI" in text or "OpenRTE" in text
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "(no output)")
    if family == "openmpi" and not openmpi:
        return f"{shutil.which(tool, path=env.get('PATH'))} is not Open MPI's mpirun ({tool} --version: {first}); put Open MPI first on the node's PATH"
    if family == "hydra" and openmpi:
        return (f"{shutil.which(tool, path=env.get('PATH'))} is Open MPI's ({first}), not the Hydra mpiexec/mpirun this launcher's "
                "MPI (MPICH, Intel MPI, MVAPICH2) runs; put that MPI's bin first on the node's PATH")
    return None
