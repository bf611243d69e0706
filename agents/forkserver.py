"""A node's fork-server (the spec's ``fast_start``): ranks forked from a process that has imported torch
and DeepSpeed once, instead of each rank exec'ing Python and importing them again.

The agent decides per node and attempt (:func:`open_server`): the ranks' command lines must all be
``<python> [options] <script>|-m <module> ...`` with one Python and one set of options; no variable
that torch, DeepSpeed or the interpreter read at import time (:data:`IMPORT_TIME_VARS`, ``PYTHON*``,
``LD_*``) may differ between the node's ranks; the launcher must start its ranks itself (not an MPI
runner's or srun's ranks, :data:`EXEC_LAUNCHERS`); the agent must be a child subreaper (the forked rank
is re-parented to it, so it reaps the rank like one it spawned). Then it starts the template
(:mod:`agents.forktemplate`) with the environment the node's ranks share, in the ranks' working
directory and cgroup, and forks each rank from it (:class:`ForkedRank`, with
:class:`agents.ranks.RankProcess`'s interface); it closes the template once they all started. Where a
condition fails, the template fails to start or import, or CUDA was initialised in it, ``auto`` falls
back to exec'ing the ranks with one warning saying why, and ``on`` fails the start with that reason.
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import json
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from . import ranks as _ranks
from .ranks import RankProcess

__all__ = ["ForkServer", "ForkedRank", "NodeReason", "TemplatePlan", "plan_template", "open_server",
           "IMPORT_TIME_VARS", "EXEC_LAUNCHERS", "READY_TIMEOUT_S"]

#: variables read when torch, DeepSpeed or their libraries are imported (or when the interpreter or
#: the dynamic loader start): one that differs between a node's ranks keeps them exec'd
IMPORT_TIME_VARS = frozenset({
    "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK",
    "ASCEND_RT_VISIBLE_DEVICES", "HABANA_VISIBLE_MODULES", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "GOMP_CPU_AFFINITY",
    "PYTORCH_CUDA_ALLOC_CONF", "TORCH_LOGS", "TORCHDYNAMO_DISABLE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
    "DS_BUILD_OPS", "DS_SKIP_CUDA_CHECK", "HOME", "PATH"})
_IMPORT_TIME_PREFIXES = ("PYTHON", "LD_")
#: launchers whose real tool (an MPI runner, srun) starts the ranks: a forked rank would not be its child
EXEC_LAUNCHERS = frozenset({"openmpi", "mpich", "impi", "mvapich", "slurm"})
#: seconds the template has to import torch and DeepSpeed before the agent falls back to exec
READY_TIMEOUT_S = 180.0
#: seconds a fork request has to answer (the rank's pid) before the rank counts as not started
FORK_TIMEOUT_S = 30.0

_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forktemplate.py")
_BOOT = ("import sys;p=sys.argv[1];exec(compile(open(p,'rb').read(),p,'exec'),"
         "{'__name__':'__orch_fork_template__','__file__':p,'__builtins__':__builtins__})")
_PYTHON = re.compile(r"^python[0-9.]*$")
_FLAGS = set("bBdEIOqsSuv")  # one-letter interpreter options without a value, as CPython 3.8-3.13 take them
_PR_GET_CHILD_SUBREAPER = 37


class NodeReason(ValueError):
    """Why one node's ranks cannot be forked, where another node's might be (its files, its ranks'
    environment); a plain ValueError is the job's reason (its command line, launcher or launch mode)."""


@dataclass(frozen=True)
class TemplatePlan:
    """What a node's template runs with, and each rank's entrypoint.

    Attributes:
        python: the ranks' interpreter (their ``argv[0]``).
        options: its options, shared by every rank (``("-u",)``).
        env: the variables every rank of the node has with the same value.
        cwd: the ranks' working directory.
        mains: per rank, in order: ``{"kind": "script"|"module", "target": path|name, "args": [...]}`` (a
            script's also ``"argv0"``: its path as the command line has it).
        room: bytes the template's command line and environment must hold for a rank's to be written
            over them (``/proc/<pid>/cmdline`` and ``environ`` show the rank's), as ``(argv, env)``.
    """

    python: str
    options: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    mains: tuple[Mapping[str, Any], ...]
    room: tuple[int, int]

    def key(self) -> tuple:
        """What a started template's imports depend on: the interpreter, its options, the working directory and
        the import-time variables (:data:`IMPORT_TIME_VARS`, ``PYTHON*``, ``LD_*``). A template kept warm from an
        earlier attempt serves a new one whose plan has the same key (and whose ranks' argv and environment fit
        its room)."""
        imports = sorted((k, v) for k, v in self.env.items()
                         if k in IMPORT_TIME_VARS or k.startswith(_IMPORT_TIME_PREFIXES))
        return (self.python, self.options, self.cwd, tuple(imports))


def _parse(argv: Sequence[str], cwd: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(options, main)`` of ``python [options] script|-m module args``; raises ValueError(why not)."""
    if not argv or not _PYTHON.match(os.path.basename(argv[0])):
        raise ValueError(f"the ranks' program {argv[0] if argv else '(none)'!r} is not Python (no_python)")
    i, options = 1, []
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        word = argv[i]
        if word == "-m" and i + 1 < len(argv):
            return tuple(options), {"kind": "module", "target": argv[i + 1], "args": list(argv[i + 2:])}
        if word in ("-X", "-W") and i + 1 < len(argv):
            options += argv[i:i + 2]
            i += 2
            continue
        if not (word[:2] in ("-X", "-W") or (word[1:] and set(word[1:]) <= _FLAGS)):
            raise ValueError(f"the ranks' interpreter option {word!r} is not one a fork-server reproduces")
        options.append(word)
        i += 1
    if i >= len(argv) or argv[i] == "-":
        raise ValueError("the ranks' Python runs no script file or module")
    if not os.path.isfile(os.path.join(cwd, argv[i])):
        raise NodeReason(f"the ranks' entrypoint {argv[i]!r} is not a file in {cwd}")
    return tuple(options), {"kind": "script", "target": os.path.join(cwd, argv[i]), "argv0": argv[i],
                            "args": list(argv[i + 1:])}


_IMPORTS = re.compile(rb"^[ \t]*(?:import[ \t]+[\w., \t]*?|from[ \t]+)\b(?:torch|deepspeed|transformers|accelerate)\b",
                      re.M)


def _imports_torch(main: Mapping[str, Any], cwd: str) -> bool:
    """Whether the entrypoint's source imports torch, DeepSpeed, transformers or accelerate (a module not
    found as a file under ``cwd`` counts as yes)."""
    if main["kind"] == "module":
        base = os.path.join(cwd, *main["target"].split("."))
        path = next((p for p in (base + ".py", os.path.join(base, "__main__.py")) if os.path.isfile(p)), None)
    else:
        path = main["target"]
    if path is None:
        return True
    try:
        with open(path, "rb") as f:
            return _IMPORTS.search(f.read(1 << 20)) is not None
    except OSError:
        return True


def _block(words: Sequence[str]) -> int:
    return sum(len(w.encode()) + 1 for w in words)


def plan_template(argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], cwd: str,
                  launcher: str | None = None) -> TemplatePlan:
    """The template of one node's ranks (``argvs[i]`` and ``envs[i]``: rank i's command line and
    complete environment; ``cwd`` their working directory).

    Raises:
        ValueError: the ranks cannot be forked from one template; the message says why (the line
            ``fast_start: auto`` logs, and ``on`` fails with); a :class:`NodeReason` where the reason is
            this node's own.
    """
    if launcher in EXEC_LAUNCHERS:
        raise ValueError(f"the {launcher} launcher's ranks are started by its own tool's process model")
    if not argvs:
        raise ValueError("the node has no ranks")
    parsed = [_parse(a, cwd) for a in argvs]
    if len({(a[0], p[0]) for a, p in zip(argvs, parsed)}) > 1:
        raise ValueError("the node's ranks run different interpreters or interpreter options")
    if not any(_imports_torch(p[1], cwd) for p in parsed):
        raise ValueError("the entrypoint imports neither torch nor DeepSpeed (nor transformers, accelerate): "
                         "nothing to preload")
    common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
    for var in sorted({k for e in envs for k in e} - set(common)):
        if var in IMPORT_TIME_VARS or var.startswith(_IMPORT_TIME_PREFIXES):
            raise NodeReason(f"{var} differs between the node's ranks, and it is read when Python, torch or "
                             "DeepSpeed start")
    room = (max(_block(a) for a in argvs) + 1, max(_block(f"{k}={v}" for k, v in e.items()) for e in envs) + 1)
    return TemplatePlan(argvs[0][0], parsed[0][0], common, cwd, tuple(p[1] for p in parsed), room)


def _is_subreaper() -> bool:
    value = ctypes.c_int(0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) == 0 and value.value == 1
    except (OSError, AttributeError):
        return False


class ForkServer:
    """The template process of one node, and the socket to it; kept from one attempt to the next while the
    agent stays warm (:meth:`serves`).

    Example::

        server = ForkServer(plan, log_path)
        why = server.start()          # None: ready; else why it is not
        pid = server.fork(0, argv, env, plan.mains[0], write_fd)
        server.close()

    Args:
        plan: what the template runs with (:func:`plan_template`).
        log_path: file the template's own output is appended to.

    The template joins no attempt's cgroup (each forked rank joins its own: :meth:`fork`) and carries no
    attempt's markers, so an attempt's cleanup leaves it for the next; it has room for command lines and
    environments :data:`SPARE_ROOM` bytes longer than the first attempt's (a resumed script's arguments).
    """

    #: Bytes of argv and environment room beyond the first attempt's ranks' (a later attempt's may be longer).
    SPARE_ROOM = (4096, 16384)

    def __init__(self, plan: TemplatePlan, log_path: str) -> None:
        self.plan = dataclasses.replace(plan, room=(plan.room[0] + self.SPARE_ROOM[0], plan.room[1] + self.SPARE_ROOM[1]))
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None

    def start(self, timeout: float = READY_TIMEOUT_S) -> str | None:
        """Start the template and wait (``timeout`` seconds at most) until it has imported what it
        preloads. Returns None when it is ready, else why not (the template is then stopped)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        head = [self.plan.python, *self.plan.options, "-c", _BOOT, _TEMPLATE, str(theirs.fileno()), str(os.getpid())]
        head.append("-" * max(1, self.plan.room[0] - _block(head)))
        # not marked as the attempt's (its sweep, and the cleanup of its node, would kill a template kept warm for
        # the next attempt); it dies with the agent (PR_SET_PDEATHSIG), and each rank shows its own markers
        env = {k: v for k, v in self.plan.env.items() if k not in (_ranks.MARKER_ENV, _ranks.NODE_RANK_ENV)}
        shown = _block(f"{k}={v}" for k, v in env.items())
        env["ORCH_FORK_ROOM"] = "-" * max(1, self.plan.room[1] - shown)
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        try:
            with open(self.log_path, "ab") as log:
                self.popen = subprocess.Popen(
                    head, env=env, cwd=self.plan.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, pass_fds=(theirs.fileno(),), preexec_fn=self._before_exec,
                    umask=_ranks.USER_UMASK)
        except OSError as err:
            self.close()
            return f"the template cannot start ({err.strerror or err}: {self.plan.python})"
        finally:
            theirs.close()
        reply = self._receive(timeout)
        if reply is not None and reply.get("op") == "ready":
            return None
        self.close()
        if reply is None:
            return f"the template did not import torch and DeepSpeed within {timeout:.0f} s"
        why = reply.get("error") or "it ended"
        return f"the template failed ({why}; its log: {self.log_path})"

    def _before_exec(self) -> None:  # in the template, between fork and exec
        _ranks._die_with_parent()

    def _receive(self, timeout: float) -> dict | None:
        """The template's next message, or None (it ended, or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while self.sock is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.sock], [], [], min(left, 0.5))
            if ready:
                data = self.sock.recv(1 << 16)
                return json.loads(data) if data else None
            if self.popen is not None and self.popen.poll() is not None:
                return None
        return None

    def fork(self, rank_id: int, argv: Sequence[str], env: Mapping[str, str], main: Mapping[str, Any],
             out_fd: int, cwd: str | None = None, timeout: float = FORK_TIMEOUT_S, cgroup: str | None = None,
             cpus: Sequence[int] | None = None) -> int:
        """Fork one rank whose stdout and stderr are ``out_fd``; return its pid once it is the agent's
        child, in its own session, with ``PR_SET_PDEATHSIG``, in the cgroup whose ``cgroup.procs`` file is
        ``cgroup`` (if given), pinned to ``cpus`` (if given: ``agents.binding``; then it runs ``main``).

        Raises:
            OSError: the template is gone, the fork failed, or no answer came within ``timeout`` s.
        """
        if self.sock is None:
            raise OSError("the fork-server's template is not running")
        request = {"op": "fork", "id": rank_id, "argv": list(argv), "env": dict(env), "main": dict(main),
                   "cwd": cwd or self.plan.cwd, "cgroup": cgroup, "cpus": list(cpus) if cpus else None,
                   "umask": _ranks.USER_UMASK if _ranks.USER_UMASK != -1 else _umask()}
        self.sock.sendmsg([json.dumps(request).encode()],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [out_fd]))])
        reply = self._receive(timeout)
        if reply is None or reply.get("id") != rank_id or reply.get("op") != "started":
            raise OSError(f"the fork-server did not start rank {rank_id}: "
                          f"{(reply or {}).get('error') or 'no answer from the template'}")
        return int(reply["pid"])

    def serves(self, plan: TemplatePlan) -> bool:
        """Whether this running template can fork the ranks of ``plan`` (a later attempt's): the same
        :meth:`TemplatePlan.key`, and room for their command lines and environments."""
        return (self.sock is not None and self.popen is not None and self.popen.poll() is None
                and self.plan.key() == plan.key() and plan.room[0] <= self.plan.room[0]
                and plan.room[1] <= self.plan.room[1])

    def adopt(self, plan: TemplatePlan) -> None:
        """Serve ``plan``'s ranks from now on (its entrypoints; :meth:`serves` must be true)."""
        self.plan = dataclasses.replace(plan, room=self.plan.room)

    def close(self) -> None:
        """Stop the template (the ranks forked from it run on: they are the agent's children)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.popen.wait(5.0)
            except subprocess.TimeoutExpired:
                pass


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


class ForkedRank(RankProcess):
    """A rank forked from a node's template: :class:`agents.ranks.RankProcess`'s interface (``start``,
    ``poll``, ``wait``, ``signal_group``, ``join_output``, ``pid``), its exit status read as the
    agent's own child's (``-N``: killed by signal N, as :class:`subprocess.Popen` reports it).

    Args:
        server: the node's started :class:`ForkServer`.
        main: the rank's entrypoint (``server.plan.mains[i]``).
        The rest as :class:`agents.ranks.RankProcess`'s.
    """

    def __init__(self, server: ForkServer, main: Mapping[str, Any], global_rank: int, argv: Sequence[str],
                 env: Mapping[str, str], cwd: str, log_path: str,
                 on_line: Callable[[int, str], None] | None = None, cgroup: Any = None,
                 cpus: Sequence[int] | None = None) -> None:
        super().__init__(global_rank, argv, env, cwd, log_path, on_line, cgroup, cpus)
        self.server = server
        self.main = dict(main)
        self._pid: int | None = None
        self.returncode: int | None = None
        self._out: Any = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The process id, or None before :meth:`start`."""
        return self._pid

    def start(self) -> None:
        """Fork the rank from the template.

        Raises:
            OSError: the template could not fork it (why in the message).
        """
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        read_end, write_end = os.pipe()
        try:
            self._pid = self.server.fork(self.global_rank, self.argv, self.env, self.main, write_end, self.cwd,
                                         cgroup=self.cgroup.procs if self.cgroup is not None else None, cpus=self.cpus)
        except OSError:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._out = os.fdopen(read_end, "rb")
        self._reader = threading.Thread(target=self._copy_output, daemon=True, name=f"rank{self.global_rank}-output")
        self._reader.start()

    def _copy_output(self) -> None:
        with open(self.log_path, "ab", buffering=0) as log, self._out:
            for raw in iter(self._out.readline, b""):
                log.write(raw)
                if self.on_line is not None:
                    self.on_line(self.global_rank, raw.decode("utf-8", "replace").rstrip("\n"))

    def poll(self) -> int | None:
        """Return the return code if the process ended (reaping it), else None."""
        with self._lock:
            if self.returncode is not None or self._pid is None:
                return self.returncode
            try:
                pid, status = os.waitpid(self._pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: what subprocess reports then
                self.returncode = 0
                return 0
            if pid == 0:
                return None
            self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: until it ends) for the rank to end; its code or None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None or self._pid is None:
                return code
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the rank's whole process group; a no-op once it is gone."""
        if self._pid is None:
            return
        try:
            os.killpg(self._pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


#: why ``auto`` execs a node's only rank when no template would be kept: a template imports what that rank would
#: import and more (torch._dynamo, both ZeRO optimizers, the Muon module), so forking one rank from it costs more
#: than starting it (docs/fast_start.md; bench/fast_start.py's 2 nodes x 1 slot)
ONE_RANK = ("one rank on this node and no later attempt or job keeps its template (no restart policy, no "
            "--keep-warm): a template would cost more than the rank's own start")


def open_server(mode: str, argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], cwd: str,
                log_path: str, *, launcher: str | None = None, native: bool = False,
                warm: ForkServer | None = None, kept: bool = False) -> tuple[ForkServer | None, str | None, bool]:
    """Decide how one node's ranks start, and start its template when they are to be forked.

    Args:
        mode: the spec's ``fast_start``: ``"auto"``, ``"on"`` or ``"off"``.
        argvs, envs: each rank's command line and complete environment, in the node's order.
        cwd: the ranks' working directory.
        log_path: the template's log file.
        launcher: the plan's launcher name; native: whether the real launcher starts the ranks.
        warm: the template an earlier attempt on this node kept: it serves these ranks if it can
            (:meth:`ForkServer.serves`); else it is closed here (before any new one starts), whatever is returned.
        kept: a template started now would be kept for a later attempt or job (the agent's ``keep_warm_s``);
            without it, ``auto`` starts a node's only rank as a new process (:data:`ONE_RANK`).

    Returns:
        ``(server, None, _)``: fork the ranks from ``server``; ``(None, None, _)``: exec them (mode off);
        ``(None, why, job_wide)``: exec them (auto: ``why`` is the line to log), or, with mode ``on``, fail
        the start with ``why``; ``job_wide``: the reason is the job's (its command line, launcher or
        launch mode: every node finds the same), not this node's.
    """
    plan, why, job_wide = None, None, False
    if mode in ("auto", "on"):
        try:
            if native:
                raise ValueError("launch_mode native: the real launcher starts the ranks")
            plan = plan_template(argvs, envs, cwd, launcher)
        except ValueError as err:
            why, job_wide = str(err), not isinstance(err, NodeReason)
        if plan is not None and not _is_subreaper():
            plan, why = None, ("the agent is not a child subreaper (PR_SET_CHILD_SUBREAPER), so it could not reap a "
                               "forked rank")
    if warm is not None and plan is not None and warm.serves(plan):
        warm.adopt(plan)
        return warm, None, False
    if warm is not None:
        warm.close()  # (before a new template imports: two never hold the node's memory at once)
    if plan is None:
        return None, why, job_wide
    if mode == "auto" and len(argvs) == 1 and not kept:
        return None, ONE_RANK, False
    server = ForkServer(plan, log_path)
    why = server.start()
    return (server, None, False) if why is None else (None, why, False)
