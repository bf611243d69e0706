"""DeepSpeed's JIT-built ops, built (or found built) once per node by the preflight, before any rank starts.

DeepSpeed builds a C++ op the first time a process loads it (``get_accelerator().create_op_builder(name)
.load()`` -> ``torch.utils.cpp_extension.load``) into ``$TORCH_EXTENSIONS_DIR/<op name>`` (torch's
``_get_build_directory``; without the variable, ``~/.cache/torch_extensions/py<ver>_<accelerator>/<op name>``).
Ranks that start together then all wait on one build's lock, a build killed midway leaves a lock every later
rank waits on forever (:mod:`agents.buildlocks`), and two environments that share the default directory
rebuild each other's ops (torch rebuilds a library whose build flags or sources changed).

So:

* :func:`default_extensions_dir`: a DeepSpeed job's ranks whose environment does not set
  ``TORCH_EXTENSIONS_DIR`` get a directory of their Python environment's own under torch's default root,
  ``orch-<key>``, the key hashing the environment's prefix (``sys.prefix``: the virtualenv), the interpreter
  and the installed torch and DeepSpeed distributions (:func:`environment_key`): two environments never
  share one, and a torch or DeepSpeed upgrade starts a fresh one.
* :func:`build` (the preflight's ``ops`` check, :mod:`agents.preflight`): the ops the job's config needs
  (``orchestrator.spec.dsops``) that are not built there yet are built by the ranks' Python, with the first
  rank's environment, in one process; an op whose library is there and has no build lock is found built
  without starting anything.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any, Mapping, Sequence

from . import buildlocks

__all__ = ["kill_group", "environment_key", "default_extensions_dir", "rank_python", "built", "build", "BUILT", "CACHED",
           "NOT_NEEDED", "FAILED"]

#: Each op's outcome.
BUILT, CACHED, NOT_NEEDED, FAILED = "built", "cached", "not_needed", "failed"
_MARK = "@@orch-opbuild@@"

# Run by the ranks' Python with argv [JSON list of ops]; prints one JSON line per op after the mark.
_BUILD = r"""
import json, os, sys, time
ops = json.loads(sys.argv[1])
def say(out):
    sys.stdout.write("\n" + "@@MARK@@" + json.dumps(out) + "\n")
    sys.stdout.flush()
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory
accelerator = get_accelerator()
for op in ops:
    t = time.monotonic()
    out = {"name": op["name"]}
    try:
        builder = accelerator.create_op_builder(op["builder"])
        if builder is None or type(builder).__name__ == "NotImplementedBuilder":
            out.update(status="not_needed", detail="the %s accelerator has no %s" % (
                accelerator.device_name(), op["builder"]))
        elif op.get("if_compatible") and not __import__("deepspeed.ops").ops.__compatible_ops__.get(builder.NAME):
            out.update(status="not_needed", detail="DeepSpeed finds it incompatible here and does not load it")
        else:
            lib = os.path.join(_get_build_directory(builder.name, False), builder.name + ".so")
            before = os.stat(lib).st_mtime_ns if os.path.exists(lib) else None
            builder.load(verbose=False)
            after = os.stat(lib).st_mtime_ns if os.path.exists(lib) else None
            out.update(status="cached" if before is not None and before == after else "built", path=lib)
    except BaseException as e:
        out.update(status="failed", detail="%s: %s" % (type(e).__name__, (str(e).strip().splitlines() or [""])[-1]))
    out["seconds"] = round(time.monotonic() - t, 3)
    say(out)
""".replace("@@MARK@@", _MARK)


def rank_python(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The Python a rank runs (its ``argv[0]`` when that is a Python, else ``python3`` on the rank's ``PATH``),
    as a path (not resolved: a virtualenv's ``bin/python`` is a link out of it); None when none is found."""
    first = argv[0] if argv else ""
    if os.path.basename(first).startswith("python"):
        found = first if os.sep in first else shutil.which(first, path=env.get("PATH", os.defpath))
    else:
        found = shutil.which("python3", path=env.get("PATH", os.defpath))
    return os.path.abspath(found) if found else None


def environment_key(python: str) -> str:
    """A short hash naming a Python environment: its prefix (the virtualenv holding ``pyvenv.cfg`` above the
    interpreter's directory, else the resolved interpreter's installation), the resolved interpreter, and
    the torch and DeepSpeed ``.dist-info`` directories of its ``site-packages`` (their versions). Reads the
    file system only (no interpreter is started)."""
    prefix = os.path.dirname(os.path.dirname(python))
    real = os.path.realpath(python)
    if not os.path.isfile(os.path.join(prefix, "pyvenv.cfg")):
        prefix = os.path.dirname(os.path.dirname(real))
    dists = sorted(os.path.basename(p) for name in ("torch", "deepspeed")
                   for p in glob.glob(os.path.join(glob.escape(prefix), "lib", "python*", "site-packages",
                                                   f"{name}-*.dist-info")))
    return hashlib.sha256(json.dumps([prefix, real, dists]).encode()).hexdigest()[:16]


def default_extensions_dir(python: str, env: Mapping[str, str]) -> str:
    """The ranks' ``TORCH_EXTENSIONS_DIR`` where their environment sets none: ``orch-<environment key>``
    under torch's default root (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``torch_extensions``)."""
    root = buildlocks.extensions_dir({k: v for k, v in env.items() if k != "TORCH_EXTENSIONS_DIR"})
    return os.path.join(root, f"orch-{environment_key(python)}")


def built(env: Mapping[str, str], name: str) -> str | None:
    """The op's library where the ranks would load it (``$TORCH_EXTENSIONS_DIR/<name>/<name>.so``) if it is
    there and no build of it is under way (no ``lock`` beside it); else None."""
    if not env.get("TORCH_EXTENSIONS_DIR"):
        return None  # torch's own default directory depends on the interpreter: let it say
    directory = os.path.join(buildlocks.extensions_dir(env), name)
    lib = os.path.join(directory, f"{name}.so")
    return lib if os.path.isfile(lib) and not os.path.exists(os.path.join(directory, "lock")) else None


def build(python: str, env: Mapping[str, str], ops: list[dict[str, Any]], cwd: str, timeout: float,
          started: list[subprocess.Popen[bytes]] | None = None) -> list[dict[str, Any]]:
    """Build or find built every op of ``ops`` (``orchestrator.spec.dsops.ops_needed``) for the ranks.

    Args:
        python: the ranks' Python.
        env: the first rank's environment (``TORCH_EXTENSIONS_DIR`` included).
        ops: ``[{"builder", "name", "if_compatible"}]``.
        cwd: where to run (the ranks' workdir).
        timeout: seconds the builds may take together; past them the build is killed (its process group),
            and a build lock it left is removed.
        started: the build process is appended here while it runs (to be killed from another thread).

    Returns:
        ``[{"name", "status": built | cached | not_needed | failed, "seconds", "detail"?, "path"?}]``, one per
        op, in order. Never raises: a failure is a result.
    """
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for op in ops:
        lib = built(env, op["name"])
        if lib:
            results[op["name"]] = {"name": op["name"], "status": CACHED, "seconds": 0.0, "path": lib}
        else:
            todo.append(op)
    if todo:
        for out in _run(python, env, todo, cwd, timeout, started):
            results[out["name"]] = out
    return [results.get(op["name"]) or {"name": op["name"], "status": FAILED, "seconds": 0.0,
                                        "detail": "no answer from the build"} for op in ops]


def _locks(env: Mapping[str, str], ops: list[dict[str, Any]]) -> set[str]:
    root = buildlocks.extensions_dir(env)
    return {p for op in ops for p in glob.glob(os.path.join(glob.escape(root), "*", op["name"], "lock"))
            + [os.path.join(root, op["name"], "lock")] if os.path.exists(p)}


def _run(python: str, env: Mapping[str, str], ops: list[dict[str, Any]], cwd: str, timeout: float,
         started: list[subprocess.Popen[bytes]] | None) -> list[dict[str, Any]]:
    locks_before = _locks(env, ops)
    t = time.monotonic()
    try:
        proc = subprocess.Popen([python, "-c", _BUILD, json.dumps(ops)], cwd=cwd, env=dict(env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
    except OSError as err:
        return [{"name": op["name"], "status": FAILED, "seconds": 0.0,
                 "detail": f"{python} cannot be run: {err.strerror or err}"} for op in ops]
    if started is not None:
        started.append(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
        why = None
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        why = f"the build did not finish within {timeout:.0f} s and was stopped"
        held = sorted(lock for lock in locks_before if os.path.exists(lock))
        if held:  # torch's FileBaton waits for another build's lock with no deadline
            why += (f": it waited on the build lock {held[0]}, which did not go (another build of the op that "
                    "does not end, or a lock a killed build left: delete it if no build runs)")
    if proc.returncode < 0:  # killed (past its time, or the preflight was called off) midway
        for lock in _locks(env, ops) - locks_before:  # ours: a lock left by a killed build hangs every rank
            try:
                os.unlink(lock)
            except OSError:
                pass
    text = out.decode("utf-8", "replace")
    found = []
    for line in text.splitlines():
        if line.startswith(_MARK):
            try:
                found.append(json.loads(line[len(_MARK):]))
            except ValueError:
                continue
    if len(found) < len(ops):
        tail = " ".join(text.strip().splitlines()[-3:])[-400:]
        if why is None:
            why = f"the build exited with status {proc.returncode}" if proc.returncode >= 0 else \
                f"the build was killed by {signal.Signals(-proc.returncode).name}"
        done = {f["name"] for f in found}
        found += [{"name": op["name"], "status": FAILED, "seconds": round(time.monotonic() - t, 3),
                   "detail": f"{why}{': ' + tail if tail else ''}"} for op in ops if op["name"] not in done]
    return found


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (it was started with ``start_new_session=True``); nothing if it is gone
    or not ours. Does not wait for it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
