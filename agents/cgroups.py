"""One cgroup (v2) per attempt on each node: ``cgroup.kill`` ends every process of the node's ranks.

Process groups, ``PR_SET_PDEATHSIG``, the agent being a child subreaper and the marker sweep
(``ORCH_ATTEMPT_ID`` in the environment) each miss something: a grandchild that started a new session
*and* cleared its environment after its agent was SIGKILLed escapes them all. A cgroup does not let go:
every process a rank starts stays in its cgroup, whatever it does to its session or environment.

Where the node has a cgroup v2 hierarchy and the agent may create a child of its own cgroup (root, or
a delegated systemd user slice), the agent creates ``orch-<hash of attempt and node>`` there, each rank
joins it between fork and exec (so even its first child is inside), and its path is recorded next to
the agent's socket (``agents.attach.attach_dir``). Teardown writes ``1`` to its ``cgroup.kill`` (Linux
5.14; before that, every pid in ``cgroup.procs`` is SIGKILLed until none is left) and removes it. The
sweep after an attempt (:func:`sweep`: ``python -m agents.sweep``, the local provisioner, orch commands
finding a dead controller's jobs) does the same from the record, so a node whose agent was SIGKILLed is
emptied too. Where no cgroup can be made, the agent says why in its ``started`` message and the other
layers remain.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Iterable

from .attach import attach_dir, node_key, private_dir

__all__ = ["AttemptCgroup", "sweep", "v2_root", "record_path"]


def v2_root(mounts: str = "/proc/self/mounts") -> str | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup``, or ``.../unified`` on a hybrid
    system), or None."""
    try:
        with open(mounts) as f:
            found = [line.split()[1] for line in f if len(line.split()) > 2 and line.split()[2] == "cgroup2"]
    except OSError:
        return None
    return found[0] if found else None


def own_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup v2 path (``0::/...`` in ``/proc/self/cgroup``), or None."""
    try:
        with open(proc_cgroup) as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def record_path(attempt_id: str, node_rank: int) -> str:
    """Where the path of the cgroup of ``node_rank`` in ``attempt_id`` is recorded on its node (next to the
    agent's socket)."""
    return os.path.join(attach_dir(), f"{node_key(attempt_id, node_rank)}.cgroup")


_record = record_path


class AttemptCgroup:
    """The cgroup of one node's ranks in one attempt.

    Attributes:
        path: its directory in the cgroup v2 hierarchy.
        procs: its ``cgroup.procs`` file, which a rank writes ``0`` into to join (:meth:`join`).
    """

    def __init__(self, path: str, record: str | None = None) -> None:
        self.path = path
        self.procs = os.path.join(path, "cgroup.procs")
        self._record = record

    @classmethod
    def create(cls, attempt_id: str, node_rank: int) -> "tuple[AttemptCgroup | None, str]":
        """Make the cgroup under this process's own; returns ``(cgroup, "")`` or ``(None, why not)``."""
        root, own = v2_root(), own_cgroup()
        if root is None or own is None:
            return None, "this node has no cgroup v2 hierarchy"
        path = os.path.join(root, own.lstrip("/"), f"orch-{node_key(attempt_id, node_rank)[:16]}")
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        except OSError as err:
            return None, f"cannot create a cgroup in {os.path.dirname(path)} ({err.strerror or err})"
        if not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
            _rmdir(path)
            return None, f"cannot move processes into a cgroup under {os.path.dirname(path)}"
        record = _record(attempt_id, node_rank)
        try:
            private_dir(attach_dir())
            with open(record, "w") as f:
                f.write(path)
        except OSError:
            record = None
        return cls(path, record), ""

    def join(self) -> None:
        """Move the calling process into the cgroup (between fork and exec: the rank's own preexec)."""
        fd = os.open(self.procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        """The processes in it now."""
        try:
            with open(self.procs) as f:
                return [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill(self, timeout: float = 5.0) -> list[int]:
        """SIGKILL everything in it (``cgroup.kill``, else pid by pid), wait until it is empty, remove it and
        its record; returns the pids that were in it."""
        found = self.pids()
        try:
            with open(os.path.join(self.path, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while True:
            left = self.pids()
            for pid in left:  # (older kernels have no cgroup.kill; a fork racing it is caught here)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            found += [p for p in left if p not in found]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        _rmdir(self.path)
        if self._record:
            try:
                os.unlink(self._record)
            except OSError:
                pass
        return found


def _rmdir(path: str) -> None:
    for _ in range(50):  # a cgroup is removable only once its last process was reaped
        try:
            os.rmdir(path)
            return
        except OSError as err:
            if err.errno != errno.EBUSY:
                return
        time.sleep(0.02)


def sweep(attempt_id: str, node_ranks: Iterable[int]) -> list[int]:
    """Kill and remove the recorded cgroups of these nodes of the attempt on this machine (what an agent
    SIGKILLed before its teardown left); returns the pids killed."""
    killed: list[int] = []
    for node_rank in node_ranks:
        record = _record(attempt_id, node_rank)
        try:
            with open(record) as f:
                path = f.read().strip()
        except OSError:
            continue
        if os.path.basename(path).startswith("orch-") and os.path.isdir(path):
            killed += AttemptCgroup(path, record).kill()
        else:
            try:
                os.unlink(record)
            except OSError:
                pass
    return killed
