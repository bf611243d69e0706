"""Spawn, poll, signal and reap rank processes.

Each rank runs in its own session (and so its own process group), so that one signal
to the group reaches the rank and everything it started (data loader workers, a JIT
compiler). Ranks also get ``PR_SET_PDEATHSIG=SIGKILL``: if the agent dies without
stopping them, the kernel kills them. Because the kernel ties that signal to the
*thread* that forked the child, ranks must be spawned from a thread that lives as long
as the agent (the agent's main loop), never from a short-lived worker thread.

Output (stdout and stderr merged) is copied line by line, unchanged, into the rank's
log file and handed to a callback, which the agent uses to stream lines to the
controller.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Collection, Mapping, Sequence

import psutil

__all__ = ["RankProcess", "private_files", "user_umask_env", "compose_env", "describe_returncode", "kill_marked", "stop_all", "become_subreaper",
           "kill_descendants", "MARKER_ENV", "NODE_RANK_ENV"]

#: Environment variable whose value tags every process of one attempt, so stragglers
#: that left the rank's process group can still be found (see :func:`kill_marked`).
MARKER_ENV = "ORCH_ATTEMPT_ID"
#: Environment variable holding the node rank of a rank's node.
NODE_RANK_ENV = "ORCH_NODE_RANK"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except OSError:
        return False


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``).

    A rank's child whose parent dies is then re-parented to the agent instead of init, so
    the agent can still find it (:func:`kill_descendants`) and reap it: no zombie and no
    orphan outlives the agent. Returns False where the kernel refuses.
    """
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def kill_descendants(spare: Collection[int] = ()) -> list[int]:
    """SIGKILL every descendant of this process and reap them all; returns the pids killed.

    ``spare``: pids kept alive with their own descendants (a node's warm fork-server template, kept for the
    next attempt: ``agents.forkserver``).

    Call only once every rank's :class:`RankProcess` has been reaped (``wait``/``poll``
    returned): reaping with ``waitpid(-1)`` would otherwise steal a rank's exit status
    from ``subprocess``.
    """
    me = psutil.Process()
    kept: set[int] = set()
    for pid in spare:
        try:
            kept |= {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            continue
    killed = []
    for child in me.children(recursive=True):
        if child.pid in kept:
            continue
        try:
            child.kill()
            killed.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not [c for c in me.children() if c.pid not in kept]:
            break
        try:
            pid = next((c.pid for c in me.children() if c.pid not in kept), 0)
            pid, _ = os.waitpid(pid, os.WNOHANG) if pid else (0, 0)
        except ChildProcessError:
            pid = 0
        if pid == 0:
            time.sleep(0.02)
    return killed


def compose_env(base: Mapping[str, str], overlay: Mapping[str, str]) -> dict[str, str]:
    """Return the environment of a rank: the node's ``base`` with ``overlay`` laid over it.

    This is what ``deepspeed.launcher.launch`` and ``torchrun`` do: copy their own
    ``os.environ`` and set the rank's variables on top.
    """
    env = dict(base)
    env.update(overlay)
    return env


def describe_returncode(returncode: int) -> str:
    """Return ``"exit code 3"`` or ``"signal SIGKILL"`` for a Popen return code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"



#: the umask ranks (and native launchers) start with: the user's, while orch's own files are private
#: (:func:`private_files`); -1 (unchanged) until then
USER_UMASK = -1
#: how a controller tells the agents it starts the user's umask (an ``ORCH_AGENT_*`` marker: not the ranks')
USER_UMASK_ENV = "ORCH_AGENT_USER_UMASK"


def private_files() -> int:
    """Make the files this process creates from now on private (umask 077: files 0600, directories 0700),
    while ranks keep starting with the user's umask (``$ORCH_AGENT_USER_UMASK`` when the controller that
    started this agent had already narrowed its own, else the umask this process had); returns that umask.

    Run once by the controller and by every agent (docs/security.md); a second call changes nothing.
    """
    global USER_UMASK
    old = os.umask(0o077)
    if USER_UMASK == -1:
        given = os.environ.get(USER_UMASK_ENV, "")
        try:
            USER_UMASK = int(given, 8) & 0o777 if given else old
        except ValueError:
            USER_UMASK = old
    return USER_UMASK


def user_umask_env() -> dict[str, str]:
    """What a provisioner adds to an agent's environment so its ranks get the user's umask."""
    return {USER_UMASK_ENV: f"{USER_UMASK:03o}"} if USER_UMASK != -1 else {}


class RankProcess:
    """One rank's process: started in its own session, output copied to a log file.

    Example::

        p = RankProcess(0, ["python", "-u", "train.py"], env, "/work", "/logs/rank0.log")
        p.start()
        ...
        if p.poll() is not None: ...
        p.stop(grace=10.0)

    Args:
        global_rank: the rank's global rank (used in messages).
        argv: the command line.
        env: the complete environment of the process.
        cwd: its working directory.
        log_path: file its merged stdout/stderr is appended to, created with parents.
        on_line: optional callback ``(global_rank, line: str)`` for every output line.
        cgroup: an :class:`agents.cgroups.AttemptCgroup` the process joins before it runs (so every process
            it starts is in it), or None.
        cpus: the CPUs the process is pinned to before it runs (the spec's ``bind_cores``: ``agents.binding``),
            or None (the agent's own).
    """

    def __init__(self, global_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str,
                 log_path: str, on_line: Callable[[int, str], None] | None = None, cgroup: Any = None,
                 cpus: Collection[int] | None = None) -> None:
        self.global_rank = global_rank
        self.cpus = sorted(cpus) if cpus else None
        self.cgroup = cgroup  # an agents.cgroups.AttemptCgroup the process joins before it runs, or None
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.log_path = log_path
        self.on_line = on_line
        self.popen: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The process id, or None before :meth:`start`."""
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        """Start the process.

        Raises:
            OSError: the executable cannot be started (not found, not executable), or the process cannot be
                pinned to its ``cpus``.
        """
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        try:
            self.popen = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=self._before_exec, close_fds=True, umask=USER_UMASK)
        except subprocess.SubprocessError as err:  # what fails in _before_exec: only the pinning may raise
            raise OSError(f"rank {self.global_rank} cannot be pinned to CPUs {self.cpus} ({err})") from None
        self._reader = threading.Thread(target=self._copy_output, daemon=True,
                                        name=f"rank{self.global_rank}-output")
        self._reader.start()

    def _before_exec(self) -> None:  # in the child, between fork and exec
        _die_with_parent()
        if self.cgroup is not None:
            try:
                self.cgroup.join()
            except OSError:
                pass  # (the other layers of cleanup remain)
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # bind_cores (agents.binding); a failure fails the start

    def _copy_output(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        with open(self.log_path, "ab", buffering=0) as log:
            for raw in iter(self.popen.stdout.readline, b""):
                log.write(raw)
                if self.on_line is not None:
                    self.on_line(self.global_rank, raw.decode("utf-8", "replace").rstrip("\n"))

    def poll(self) -> int | None:
        """Return the return code if the process ended (reaping it), else None."""
        return self.popen.poll() if self.popen else None

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the rank's whole process group; a no-op once it is gone."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds for the process to end; return its code or None."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def join_output(self, timeout: float = 5.0) -> None:
        """Wait until every output line has been copied (after the process ended)."""
        if self._reader is not None:
            self._reader.join(timeout)


def stop_all(ranks: Sequence[RankProcess], grace: float) -> None:
    """Stop ``ranks`` together: SIGCONT and SIGTERM to every group, wait ``grace`` seconds, SIGKILL the rest.

    SIGCONT first: a stopped (SIGSTOPped) process would hold a SIGTERM pending and cost the whole grace
    period. The group is signalled even when the rank itself has already exited, so children it left
    behind in its group are stopped too. Every process is reaped.
    """
    for r in ranks:
        r.signal_group(signal.SIGCONT)
        r.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for r in ranks:
        r.wait(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        r.signal_group(signal.SIGKILL)
        r.wait(5.0)
        r.join_output(1.0)


def kill_marked(marker_value: str, *, node_rank: int | None = None,
                exclude_pids: Sequence[int] = (), key: str = MARKER_ENV,
                node_key: str = NODE_RANK_ENV) -> list[int]:
    """SIGKILL every process whose environment has ``ORCH_ATTEMPT_ID=marker_value``.

    The last line of defence against stragglers that escaped their process group
    (e.g. a rank that daemonized a child). Only processes we may read are considered.
    With ``node_rank``, only processes that also have ``ORCH_NODE_RANK=<node_rank>``
    (so an agent sweeping its node spares the other nodes sharing its machine). ``key`` and
    ``node_key`` name other marker variables (agents carry ``ORCH_AGENT_ATTEMPT_ID`` and
    ``ORCH_AGENT_NODE_RANK``).

    Returns:
        the pids that were killed.
    """
    killed = []
    needle = marker_value
    skip = set(exclude_pids) | {os.getpid()}
    for proc in psutil.process_iter(["pid"]):
        if proc.pid in skip:
            continue
        try:
            env = proc.environ()
            if env.get(key) == needle and (node_rank is None or env.get(node_key) == str(node_rank)):
                proc.kill()
                killed.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return killed
