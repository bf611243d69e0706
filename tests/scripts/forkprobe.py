"""A rank that writes what a script can see of how it was started, for tests/test_fast_start.py.

``FORKPROBE_OUT=<dir> python -u forkprobe.py args...`` writes ``<dir>/rank<RANK>.json`` with argv,
orig_argv, the environment, sys.path, ``__main__``'s attributes, signal dispositions, thread counts,
umask, cwd, whether torch was already imported (a forked rank's template imported it), and three
random draws each from Python's ``random``, numpy's global generator and torch's default one (taken
before any seeding; with ``FORKPROBE_SEED=n`` after seeding all three with n).
"""

import os
import signal
import sys
import threading

_PRELOADED = "torch" in sys.modules  # before anything here imports it
_THREADS = (threading.active_count(), len(os.listdir("/proc/self/task")))


def _spec(spec: object) -> object:
    return None if spec is None else [spec.name, spec.origin, type(spec.loader).__name__, spec.parent]


def _main_attrs() -> dict:
    m = sys.modules["__main__"]
    return {"name": __name__, "file": m.__dict__.get("__file__"), "spec": _spec(m.__dict__.get("__spec__")),
            "package": m.__dict__.get("__package__"), "cached": m.__dict__.get("__cached__"),
            "loader": type(m.__dict__.get("__loader__")).__name__,
            "builtins": type(m.__dict__.get("__builtins__")).__name__,
            "same_module": m.__dict__ is globals(), "keys": sorted(k for k in m.__dict__ if k.startswith("__"))}


def _signals() -> dict:
    out = {}
    for s in sorted(signal.valid_signals()):
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        h = signal.getsignal(s)
        out[str(int(s))] = h if isinstance(h, int) else getattr(h, "__qualname__", repr(h))
    return out


def _draws() -> dict:
    import random

    import numpy
    import torch
    seed = os.environ.get("FORKPROBE_SEED")
    if seed is not None:
        random.seed(int(seed))
        numpy.random.seed(int(seed))
        torch.manual_seed(int(seed))
    return {"python": [random.random() for _ in range(3)], "numpy": numpy.random.rand(3).tolist(),
            "torch": torch.rand(3).tolist()}


def _proc(name: str) -> list[str]:
    """What others see of this process in /proc (ps, psutil): NUL-separated words, up to an empty one."""
    with open(f"/proc/self/{name}", "rb") as f:
        words = f.read().decode(errors="replace").split("\0")
    return words[:words.index("")] if "" in words else words


def main() -> int:
    import json
    umask = os.umask(0)
    os.umask(umask)
    report = {"argv": sys.argv, "orig_argv": sys.orig_argv, "env": dict(os.environ), "path": sys.path,
              "main": _main_attrs(), "signals": _signals(), "threads": _THREADS, "umask": umask,
              "cwd": os.getcwd(), "preloaded": _PRELOADED, "executable": sys.executable, "flags": repr(sys.flags),
              "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
              "stdin_tty": os.isatty(0), "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
              "proc_cmdline": _proc("cmdline"), "proc_environ": _proc("environ"), "draws": _draws()}
    out = os.environ["FORKPROBE_OUT"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{os.environ.get('RANK', os.getpid())}.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    print(f"forkprobe rank {os.environ.get('RANK')} done", flush=True)
    return int(os.environ.get("FORKPROBE_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
