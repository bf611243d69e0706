"""The template process of a node's fork-server: imports once, forks each rank.

Run by :class:`agents.forkserver.ForkServer` with the ranks' own Python, interpreter options and
working directory, as ``python [options] -c BOOT <this file> <socket fd> <agent pid> <argv room>``,
where BOOT executes this file (the ranks' Python need not have orch installed: this module uses only
the standard library until it imports what the ranks will use). It:

1. imports torch and DeepSpeed, and what ``deepspeed.initialize`` would import lazily (``torch._dynamo``,
   the ZeRO optimizer modules, DeepSpeed's Muon optimizer module), and caches py-cpuinfo's
   ``get_cpu_info()`` (a description of the node's CPU, the same for every process on it: DeepSpeed's
   CPU op builder asks for it twice, each time running subprocesses); it never touches CUDA
   (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` while importing) and refuses to serve if CUDA was initialised;
2. answers ``{"op": "ready"}`` (or ``{"op": "failed", "error": ...}``) on its socket (``SOCK_SEQPACKET``);
3. for each ``{"op": "fork", ...}`` request (with the write end of the rank's output pipe attached as
   ``SCM_RIGHTS``) forks twice: the middle process exits at once, so the rank is re-parented to the
   agent (a child subreaper) and the agent reaps it like a child it spawned. The rank starts its own
   session, joins the attempt's cgroup, is pinned to its CPUs (``bind_cores``, :mod:`agents.binding`; a
   refusal answers ``{"op": "failed"}``), waits to be the agent's child, takes ``PR_SET_PDEATHSIG=SIGKILL``,
   becomes what an exec'd rank would be (argv, environment, ``sys.path``, a fresh ``__main__``, signal dispositions, umask,
   working directory, fresh random state drawn from the OS), answers ``{"op": "started", "pid"}`` and
   runs the entrypoint; its exit is Python's (``SystemExit``, an uncaught exception's status 1, a
   KeyboardInterrupt's SIGINT), after joining non-daemon threads and running ``atexit`` handlers.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import signal
import socket
import sys
import time
from typing import Any

# what a fresh interpreter has, captured before any import can change it
_SIGNALS = {s: signal.getsignal(s) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) is not None}
_PATH_TAIL = list(sys.path[1:])  # sys.path less its first entry ('' for -c): the rest an exec'd rank gets too

_PR_SET_PDEATHSIG = 1
_PR_SET_MM = 35
_PR_SET_MM_ARG_END = 9
_PR_SET_MM_ENV_END = 11
_libc = ctypes.CDLL(None, use_errno=True)


def _preload() -> None:
    """Import what the ranks will import; raise what failed."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # a CUDA check that does not initialise CUDA
    cpu = _start_cpuinfo()
    import torch
    import torch._dynamo  # noqa: F401  (imported lazily by the first optimizer step otherwise)
    try:
        import deepspeed  # noqa: F401
    except ImportError:  # a torch script without DeepSpeed: torch alone is preloaded
        deepspeed = None
    if deepspeed is not None:
        import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
        import deepspeed.runtime.zero.stage3  # noqa: F401
        try:  # imported by deepspeed.runtime.zero.utils.is_zero_supported_optimizer; it compiles at import
            import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
        except ImportError:
            pass
    _cache_cpuinfo(cpu)
    if torch.cuda.is_initialized():
        raise RuntimeError("importing torch and DeepSpeed initialised CUDA in the template: a forked rank "
                           "cannot use it")


def _start_cpuinfo() -> "tuple[Any, Any] | None":
    """Start what py-cpuinfo's ``get_cpu_info()`` runs (``python cpuinfo.py --json``, its
    ``get_cpu_info_json``) while the imports go on; ``(module, process)``, or None without py-cpuinfo."""
    try:
        import subprocess

        import cpuinfo.cpuinfo as impl
    except ImportError:
        return None
    try:
        return impl, subprocess.Popen([sys.executable, impl.__file__, "--json"], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    except OSError:
        return None


def _cache_cpuinfo(started: "tuple[Any, Any] | None") -> None:
    """Answer py-cpuinfo's ``get_cpu_info()`` from memory (a copy each time), with what the process
    :func:`_start_cpuinfo` started printed, read as ``get_cpu_info`` reads it; left alone if it failed."""
    if started is None:
        return
    impl, proc = started
    try:
        out = proc.communicate(timeout=60)[0]
    except Exception:  # noqa: BLE001 - then each rank asks py-cpuinfo itself
        proc.kill()
        proc.wait()
        return
    if proc.returncode != 0:
        return
    found = json.loads(out.decode("utf-8"), object_hook=impl._utf_to_str)
    import copy
    import functools

    import cpuinfo

    @functools.wraps(impl.get_cpu_info)
    def get_cpu_info():  # type: ignore[no-untyped-def]
        return copy.deepcopy(found)

    cpuinfo.get_cpu_info = impl.get_cpu_info = get_cpu_info


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def serve(fd: int, agent_pid: int) -> None:
    """The template's loop: preload, say ``ready`` (or ``failed``), fork on each request until the
    socket closes (the agent went), then exit."""
    sock = socket.socket(fileno=fd)
    try:
        _preload()
    except BaseException as err:  # noqa: BLE001 - reported to the agent, which falls back to exec
        _send(sock, {"op": "failed", "error": f"{type(err).__name__}: {err}"})
        os._exit(3)
    _send(sock, {"op": "ready", "pid": os.getpid()})
    while True:
        fds = array.array("i")
        try:
            data, anc, _, _ = sock.recvmsg(1 << 22, socket.CMSG_SPACE(fds.itemsize))
        except InterruptedError:
            continue
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
        if not data:
            os._exit(0)
        request = json.loads(data)
        out = fds[0] if fds else os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):  # nothing of the template's buffered output goes to a rank
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        try:
            middle = os.fork()
        except OSError as err:
            _send(sock, {"op": "error", "id": request["id"], "error": f"fork: {err.strerror}"})
            os.close(out)
            continue
        if middle == 0:
            try:
                if os.fork() == 0:
                    _become_rank(sock, out, request, agent_pid)
            finally:
                os._exit(0)
        os.close(out)
        os.waitpid(middle, 0)


def _become_rank(sock: socket.socket, out: int, request: dict, agent_pid: int) -> None:
    """In the rank, from the fork to its exit (never returns)."""
    code = 70
    try:
        os.setsid()
        if request.get("cgroup"):  # the attempt's cgroup on the node (agents.cgroups): as an exec'd rank joins it
            try:
                fd = os.open(request["cgroup"], os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
            except OSError:
                pass  # (as for an exec'd rank: the cgroup sweep then misses it, the markers do not)
        if request.get("cpus"):  # bind_cores (agents.binding): pinned before the rank's code, as an exec'd rank
            try:
                os.sched_setaffinity(0, request["cpus"])
            except OSError as err:
                _send(sock, {"op": "failed", "id": request["id"],
                             "error": f"cannot pin it to CPUs {request['cpus']}: {err.strerror or err}"})
                os._exit(73)
        deadline = time.monotonic() + 10.0
        while os.getppid() != agent_pid:  # the middle process exits: re-parented to the agent (a subreaper)
            if time.monotonic() > deadline:
                os._exit(71)
            time.sleep(0.001)
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != agent_pid:
            os._exit(72)  # the agent died in between
        _as_exec(out, request)
        _send(sock, {"op": "started", "id": request["id"], "pid": os.getpid()})
        sock.close()
        code = _run_main(request)
    finally:
        os._exit(code)


def _as_exec(out: int, request: dict) -> None:
    """Make this process what an exec'd rank would be before its first line runs."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in (null, out):
        os.close(fd)
    os.umask(int(request["umask"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for signum, handler in _SIGNALS.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    _reseed()
    main = request["main"]
    if main["kind"] == "module":
        sys.path[:] = [os.getcwd()] + _PATH_TAIL
        sys.argv[:] = ["-m"] + list(main["args"])
    else:
        sys.path[:] = [os.path.dirname(os.path.realpath(main["target"]))] + _PATH_TAIL
        sys.argv[:] = [main.get("argv0", main["target"])] + list(main["args"])
    sys.orig_argv[:] = list(request["argv"])
    _show(request["argv"], request["env"])


def _reseed() -> None:
    """Fresh random state, as a new process draws it from the OS (``random`` reseeds itself at fork)."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()


def _show(argv: list[str], env: dict[str, str]) -> None:
    """What ``/proc/<pid>/cmdline`` and ``/proc/<pid>/environ`` show: the rank's argv and environment,
    written over the template's own (which has room enough); the areas end where the text does, where
    the kernel lets us (``PR_SET_MM``), else the rest is NULs. Best effort: a rank that does not fit
    keeps showing the template's."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    except (OSError, ValueError, IndexError):
        return
    for start, end, blob, opt in (
            (arg_start, arg_end, b"".join(a.encode() + b"\0" for a in argv), _PR_SET_MM_ARG_END),
            (env_start, env_end, b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()), _PR_SET_MM_ENV_END)):
        if len(blob) + 1 > end - start:
            continue
        ctypes.memmove(start, blob + b"\0" * (end - start - len(blob)), end - start)
        _libc.prctl(_PR_SET_MM, opt, start + len(blob), 0, 0)


def _run_main(request: dict) -> int:
    """Run the entrypoint as ``__main__`` and end as the interpreter would; the exit status."""
    import atexit
    import threading
    import types
    main = request["main"]
    module = types.ModuleType("__main__")
    module.__dict__.update(__builtins__=__builtins__, __annotations__={})
    sys.modules["__main__"] = module
    code, interrupted = 0, False
    try:
        if main["kind"] == "module":
            import runpy
            runpy._run_module_as_main(main["target"], alter_argv=True)  # what `python -m` runs
        else:
            _run_script(module, main["target"])
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            code = 120 if code == 0 else code
    if interrupted:  # what CPython does after an uncaught KeyboardInterrupt: die of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _run_script(module: object, path: str) -> None:
    """What ``python path`` does with ``__main__``: ``__file__`` absolute, a source loader, no spec."""
    from importlib.machinery import SourceFileLoader
    full = os.path.abspath(path)
    namespace = module.__dict__  # type: ignore[attr-defined]
    namespace.update(__file__=full, __cached__=None, __loader__=SourceFileLoader("__main__", full),
                     __spec__=None, __package__=None)
    with open(full, "rb") as f:
        source = f.read()
    exec(compile(source, full, "exec", dont_inherit=True), namespace)  # noqa: S102 - the rank's own script


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(value)`` gives (CPython's ``_Py_HandleSystemExit``)."""
    value = exc.code
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        print(value, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


if __name__ == "__orch_fork_template__":
    serve(int(sys.argv[2]), int(sys.argv[3]))  # sys.argv: ['-c', this file, socket fd, agent pid, argv room]
