"""Every rank's Python stacks (``py-spy dump``), and what each rank's main thread is doing, read from them.

The controller asks for a dump when a deadline passes (start-up, a hang); the agent writes each rank's
stacks next to its log (``rank-<global rank>.stacks.txt``) and answers with a summary per rank
(:func:`summarize`), so a controller on another machine can name what a rank is stuck in without
reading the node's files, and tell a rank that is stuck from one that is exiting or saving.

py-spy prints, per thread, ``Thread <tid> (<idle|active>): "<name>"`` (no name where the rank never
imported ``threading``: its main thread's id is then the pid) and then the frames, innermost first, as ``    <function> (<file>:<line>)``. A script's main code runs under a ``<module>`` frame
(``python script.py``) or runpy's ``_run_module_as_main`` (``python -m``): a main thread whose outermost
frame is neither is past the script's main code, in its ``atexit`` handlers or the interpreter's
shutdown (``threading._shutdown``). A rank forked from a fork-server (``fast_start``) has the template's
frames (``agents/forktemplate.py``) outside its own: they are left out, so it reads as an exec'd rank.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Iterable

__all__ = ["summarize", "dump_all", "process_state", "DOING"]

_THREAD = re.compile(r'^Thread (?:0x)?([0-9A-Fa-f]+) \((\w+)\)(?:: "(.*)")?')
_PROCESS = re.compile(r"^Process (\d+):")
_FRAME = re.compile(r"^\s+(\S.*?) \((.*):(\d+)\)\s*$")

#: What a rank is doing, by the first (innermost) main-thread frame that matches: (pattern, words, kind).
#: kind: "exiting" and "saving" are not hangs (the controller gives the rank more time); "stuck" are.
DOING: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"^(FileBaton\.wait|FileBaton\.try_acquire)$"), "waiting for a torch extension build lock "
     "(another build of the op, or a stale 'lock' file a killed build left)", "stuck"),
    (re.compile(r"(_jit_compile|_write_ninja_file_and_compile_objects|_run_ninja_build|jit_load)$"),
     "building a torch/DeepSpeed extension op", "stuck"),
    (re.compile(r"(save_checkpoint|_save_checkpoint|_save_zero_checkpoint|save_16bit_model|"
                r"_save_moe_checkpoint|^save$|^_save$|_legacy_save|save_pretrained|_save_state)$"),
     "saving a checkpoint", "saving"),
    (re.compile(r"(destroy_process_group|_shutdown$|_exit_function$|_run_finalizers$)"), "exiting", "exiting"),
    (re.compile(r"(rendezvous|_store_based_barrier|TCPStore|_create_c10d_store|init_process_group|"
                r"_env_rendezvous_handler|_tcp_rendezvous_handler|init_distributed|mpi_discovery)"),
     "in the rendezvous (init_process_group: waiting for the master or the other ranks)", "stuck"),
    (re.compile(r"(all_reduce|allreduce|all_gather|allgather|reduce_scatter|broadcast|barrier|all_to_all|"
                r"^(c10d\.)?(send|recv)$|^wait$|Work\.wait|inference_all_reduce)"),
     "in a collective (waiting for the other ranks)", "stuck"),
)


def summarize(text: str) -> dict[str, Any]:
    """What the main thread of one ``py-spy dump`` is doing.

    Returns:
        ``{"frames": [...], "where": str | None, "doing": str | None, "kind": str | None}``: ``frames``
        the main thread's innermost frames (at most 8, ``"func (file:line)"``), ``where`` the innermost,
        ``doing`` and ``kind`` from the first frame that matches :data:`DOING` (``kind`` ``"exiting"``
        also when the outermost frame is not the script's ``<module>``/runpy's); all None when the
        dump has no main thread (py-spy failed: the text says why).
    """
    frames: list[tuple[str, str]] = []
    in_main = False
    pid = None
    for line in text.splitlines():
        p = _PROCESS.match(line)
        if p:
            pid = p.group(1)
        t = _THREAD.match(line)
        if t:
            if in_main:
                break
            # the main thread: named so, or (no threading module: no names) the thread whose id is the pid
            in_main = t.group(3) == "MainThread" or (t.group(3) is None and t.group(1) == pid)
            continue
        f = _FRAME.match(line) if in_main else None
        if f and os.path.basename(f.group(2)) == "forktemplate.py":
            in_main = False  # a forked rank's outer frames are its fork-server's (agents/forktemplate.py)
            continue
        if f:
            frames.append((f.group(1), f"{f.group(1)} ({os.path.basename(f.group(2))}:{f.group(3)})"))
    if not frames:
        return {"frames": [], "where": None, "doing": None, "kind": None}
    doing = kind = None
    for name, _ in frames:
        hit = next(((words, k) for pattern, words, k in DOING if pattern.search(name)), None)
        if hit:
            doing, kind = hit
            break
    outermost = frames[-1][0]
    if outermost not in ("<module>", "_run_module_as_main", "_run_code") and kind != "saving":
        doing, kind = "exiting (past the script's main code: atexit handlers or the interpreter's shutdown)", "exiting"
    return {"frames": [shown for _, shown in frames[:8]], "where": frames[0][1], "doing": doing, "kind": kind}


def process_state(pid: int | None) -> str | None:
    """The one-letter state of a process (``/proc/<pid>/stat``: R, S, D, T, Z, ...), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return None


def dump_all(ranks: Iterable[Any], log_dir: str) -> dict[str, dict[str, Any]]:
    """``py-spy dump`` every rank given (objects with ``global_rank`` and ``pid``) at once, each into
    ``<log_dir>/rank-<global rank>.stacks.txt``.

    Returns:
        global rank (str) -> ``{"file": path, **summarize(...)}``, or ``{"error": why}`` where py-spy is
        missing or failed (20 s at most per rank).
    """
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    out: dict[str, dict[str, Any]] = {}

    def dump(proc: Any) -> None:
        rank = str(proc.global_rank)
        if py_spy is None:
            out[rank] = {"error": "py-spy is not installed on this node"}
            return
        stopped = process_state(proc.pid) == "T"
        if stopped:  # py-spy cannot read a stopped process; its state says enough
            text = "(not dumped: the process is stopped by a signal, state T; py-spy cannot read it)"
        else:
            try:
                r = subprocess.run([py_spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True,
                                   timeout=20)
                text = r.stdout + (f"\n(py-spy exited {r.returncode}: {r.stderr.strip()})" if r.returncode else "")
            except (OSError, subprocess.TimeoutExpired) as err:
                text = f"(py-spy failed: {err})"
        path = os.path.join(log_dir, f"rank-{rank}.stacks.txt")
        with open(path, "w") as f:
            f.write(f"stacks of rank {rank} (pid {proc.pid}) at {time.strftime('%H:%M:%S')}\n")
            f.write(text)
        summary = summarize(text)
        if stopped:
            summary.update(doing="stopped by a signal (SIGSTOP or SIGTSTP): it runs nothing", kind="stuck")
        out[rank] = {"file": path, **summary}

    threads = [threading.Thread(target=dump, args=(p,)) for p in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
