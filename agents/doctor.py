"""Per-node part of ``orch doctor``: what a node's agent reports about its environment, the master
port's listener (node 0) and the connection to it (every other node).

The controller's side is :mod:`orchestrator.supervision.doctor`; the agent answers each ``doctor``
message (between its ``hello`` and a ``start`` that never comes, as :mod:`agents.before` answers the
preflight's) with a ``doctor_result`` of the same ``phase``:

``report`` (on a thread)
    ``{"report": {...}}``: the spec's Python, run with a deadline (``timeout_s``) on a probe that
    imports torch and DeepSpeed and asks DeepSpeed's accelerator its device name, as the ranks
    would (``python``, ``torch``, ``cuda``, ``nccl``, ``deepspeed``, ``accelerator``, ``gpus``;
    ``error`` when the probe did not run or an import failed); the free bytes of the file systems
    of the workdir and the checkpoint dir (``disk``), the node's available memory in bytes
    (``memory``), and its clock (``clock``, :func:`node_clock`).
``listen`` (node 0, at once)
    ``{"status": "passed" | "failed", "detail"}``: a plain TCP listener on the master port, on
    every address, that accepts and closes connections until the agent ends.
``connect`` (every other node, on a thread)
    ``{"status", "detail"}``: a TCP connection to ``addr:port`` within ``timeout_s``.
``unlisten`` (node 0, at once)
    the listener closes, so the all-reduce's rendezvous can take the port.
``allreduce`` (on a thread)
    ``{"status", "detail", "result": {"seconds", "bytes", "iters", "algbw", "busbw", "correct", "backend",
    "device", "links", "rounds", "rounds_done", "links_error"?}}``: a short all-reduce among every node
    (rank = node rank) through the master port, run by the spec's Python with the interface the ranks'
    collectives would use, with ``backend`` (``gloo`` on CPU tensors; ``nccl`` on the GPU the node's first
    rank would use, :func:`device_index`); ``busbw`` is ``algbw * 2 (n - 1) / n`` in bytes/s. Then, in the
    same process group, the link tests of the request's ``rounds`` (lists of disjoint ``[a, b]`` pairs, one
    round at a time): this node and its partner of the round send each other ``pair_bytes`` at once, a
    warm-up then ``pair_iters`` timed; ``links`` is ``[{"peer", "seconds", "bytes", "gbps", "correct"}]``
    (``gbps``: 10^9 bytes/s each way). ``links_error`` says why fewer than every round finished (killed at
    ``timeout_s``, or the script failed); what was measured until then is kept.
``clock`` (at once)
    ``{"at": node_clock(env)}``: read the moment the request is taken, so the controller can weigh
    it against the round trip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Callable, Mapping

from .ranks import _die_with_parent

__all__ = ["NodeDoctor", "node_clock", "device_index", "run_in_thread", "CLOCK_OFFSET_ENV"]

#: Test seam: seconds added to this node's clock as :func:`node_clock` reads it (from the node's environment,
#: e.g. one host's sshd ``SetEnv``, or the spec's ``env``). Never set it outside tests.
CLOCK_OFFSET_ENV = "ORCH_DOCTOR_CLOCK_OFFSET_S"
_MARK = "@@orch-doctor@@"

# Run by the spec's Python; %-formatting only, so an old Python 3 still reports.
_PROBE = r"""
import json, sys
out = {"python": "%d.%d.%d" % tuple(sys.version_info[:3]), "executable": sys.executable, "errors": []}
try:
    import torch
    out["torch"] = str(torch.__version__)
    out["cuda"] = getattr(torch.version, "cuda", None)
    out["gpus"] = 0
    if out["cuda"]:
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except BaseException as e:
            out["errors"].append("NCCL version: %s: %s" % (type(e).__name__, e))
        try:
            out["gpus"] = torch.cuda.device_count()
        except BaseException as e:
            out["errors"].append("torch.cuda.device_count(): %s: %s" % (type(e).__name__, e))
except BaseException as e:
    out["errors"].append("cannot import torch: %s: %s" % (type(e).__name__, e))
try:
    import deepspeed
    out["deepspeed"] = getattr(deepspeed, "__version__", None)
    from deepspeed.accelerator import get_accelerator
    out["accelerator"] = get_accelerator().device_name()
except BaseException as e:
    out["errors"].append("cannot import deepspeed: %s: %s" % (type(e).__name__, e))
if "deepspeed" in out:
    try:  # as ds_report's op report: installed prebuilt, compatible (may build here); nothing is built
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        try:
            from deepspeed.git_version_info import installed_ops, accelerator_name
        except BaseException:
            installed_ops, accelerator_name = {}, None
        try:
            from deepspeed.ops.op_builder.builder import probe_is_compatible
        except ImportError:
            probe_is_compatible = lambda builder, verbose: builder.is_compatible(verbose)
        here = getattr(get_accelerator(), "_name", None)
        ops = {}
        for name in sorted(ALL_OPS):
            try:
                ok = bool(probe_is_compatible(ALL_OPS[name], False))
            except BaseException:
                ok = False
            ops[name] = {"installed": bool(installed_ops.get(name)) and accelerator_name == here, "compatible": ok}
        out["ops"] = ops
    except BaseException as e:
        out["ops_error"] = "cannot list DeepSpeed's ops: %s: %s" % (type(e).__name__, e)
sys.stdout.flush()
sys.stdout.write("\n" + "@@MARK@@" + json.dumps(out) + "\n")
""".replace("@@MARK@@", _MARK)


# The all-reduce, then the link tests, run by the spec's Python: argv [a JSON object: addr, port, rank, world, bytes,
# iters, timeout, backend, device, rounds, pair_bytes, pair_iters]. It prints its result after the all-reduce and
# again after every round of link tests, so what it measured comes back even if a later round hangs and is killed.
_COLLECTIVES = r"""
import datetime, json, sys, time
import torch
import torch.distributed as dist
c = json.loads(sys.argv[1])
rank, world = c["rank"], c["world"]
dev = torch.device("cpu")
if c["backend"] == "nccl":
    dev = torch.device("cuda", c["device"])
    torch.cuda.set_device(dev)
def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
def say(out):
    sys.stdout.write("\n@@MARK@@" + json.dumps(out) + "\n")
    sys.stdout.flush()
def fence():
    dist.all_reduce(torch.zeros(1, device=dev))
    sync()
dist.init_process_group(c["backend"], init_method="tcp://%s:%d" % (c["addr"], c["port"]), rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=c["timeout"]))
x = torch.ones(max(1, c["bytes"] // 4), dtype=torch.float32, device=dev)
dist.all_reduce(x)
fence()
started = time.perf_counter()
for _ in range(c["iters"]):
    x.fill_(1.0)
    dist.all_reduce(x)
sync()
seconds = (time.perf_counter() - started) / c["iters"]
algbw = x.numel() * 4 / seconds
out = {"backend": c["backend"], "device": str(dev), "seconds": seconds, "bytes": x.numel() * 4,
       "iters": c["iters"], "algbw": algbw, "busbw": algbw * 2 * (world - 1) / world,
       "correct": float(x[0].item()) == float(world), "links": [], "rounds": len(c["rounds"]), "rounds_done": 0}
say(out)
mine = torch.full((max(1, c["pair_bytes"] // 4),), float(rank + 1), dtype=torch.float32, device=dev)
theirs = torch.zeros_like(mine)
def exchange(peer):
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
for i, pairs in enumerate(c["rounds"]):
    peer = None
    for a, b in pairs:
        if rank in (a, b):
            peer = b if rank == a else a
    if peer is not None:
        exchange(peer)
        sync()
        started = time.perf_counter()
        for _ in range(c["pair_iters"]):
            exchange(peer)
        sync()
        s = (time.perf_counter() - started) / c["pair_iters"]
        out["links"].append({"peer": peer, "seconds": s, "bytes": mine.numel() * 4,
                             "gbps": mine.numel() * 4 / s / 1e9, "correct": float(theirs[0].item()) == peer + 1.0})
    fence()
    out["rounds_done"] = i + 1
    say(out)
dist.destroy_process_group()
""".replace("@@MARK@@", _MARK)


def node_clock(environ: Mapping[str, str] | None = None) -> float:
    """This node's wall clock (``time.time()``, seconds since the epoch), plus
    ``$ORCH_DOCTOR_CLOCK_OFFSET_S`` when ``environ`` (default: this process's environment; the doctor passes
    the node's first rank's, which holds the agent's and the spec's ``env``) sets it: the one seam through
    which a test fakes a node's skewed clock. A value that is not a number is ignored."""
    try:
        offset = float((os.environ if environ is None else environ).get(CLOCK_OFFSET_ENV) or 0.0)
    except ValueError:
        offset = 0.0
    return time.time() + offset


def _free_bytes(path: str) -> tuple[str, int | None, str | None]:
    """``(the path measured, free bytes, None)`` for the nearest existing ancestor of ``path``, or
    ``(path, None, why)``."""
    probe = os.path.abspath(path or "/")
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return probe, shutil.disk_usage(probe).free, None
    except OSError as err:
        return probe, None, err.strerror or str(err)


def _available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_index(env: Mapping[str, str], slot: int) -> int:
    """The CUDA device (torch's index under ``env``) the node's first rank would use: ``cuda:LOCAL_RANK`` where its
    environment sets ``LOCAL_RANK`` (DeepSpeed's launcher sets it with ``CUDA_VISIBLE_DEVICES`` = the node's
    slots), else the first slot ``slot`` (a position in the node's ``CUDA_VISIBLE_DEVICES``, or a device index
    where that is unset: :mod:`agents.devices`)."""
    try:
        return max(0, int(env["LOCAL_RANK"]))
    except (KeyError, ValueError):
        return slot


class NodeDoctor:
    """One node's answers to ``orch doctor``'s ``doctor`` messages (see the module's docstring).

    Example::

        doc = NodeDoctor(env=rank_env)
        answer = doc.run({"phase": "report", "python": "/usr/bin/python3", "workdir": "/w", ...})
        doc.close()                                 # the listener (node 0) and a running probe go

    Args:
        env: the environment of the node's first rank (the probe runs with it, as a rank would).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._listener: socket.socket | None = None
        self._probe: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one ``doctor`` message: ``{"type": "doctor_result", "phase", ..., "seconds"}``; never
        raises for what it finds (a failure is an answer)."""
        started = time.monotonic()
        phase = str(msg.get("phase"))
        if phase == "clock":
            body: dict[str, Any] = {"at": node_clock(self.env)}
        elif phase == "report":
            body = {"report": self._report(msg)}
        elif phase == "listen":
            body = self._listen(str(msg.get("addr") or ""), int(msg.get("port") or 0))
        elif phase == "unlisten":
            self._unlisten()
            body = {"status": "passed", "detail": "the listener is closed"}
        elif phase == "allreduce":
            body = self._allreduce(msg)
        elif phase == "connect":
            body = self._connect(str(msg.get("addr") or ""), int(msg.get("port") or 0),
                                 float(msg.get("timeout_s") or 5.0))
        else:
            body = {"status": "failed", "detail": f"unknown doctor phase {phase!r}"}
        return {"type": "doctor_result", "phase": phase, **body, "seconds": round(time.monotonic() - started, 4)}

    # -- report -------------------------------------------------------------------------------

    def _report(self, msg: dict[str, Any]) -> dict[str, Any]:
        python = str(msg.get("python") or "python3")
        workdir = str(msg.get("workdir") or "/")
        out: dict[str, Any] = {"errors": []}
        out.update(self._run_probe(python, workdir if os.path.isdir(workdir) else "/",
                                   float(msg.get("timeout_s") or 60.0)))
        disk = {}
        for what, path in (("workdir", workdir), ("checkpoint_dir", str(msg.get("checkpoint_dir") or workdir))):
            measured, free, why = _free_bytes(path)
            disk[what] = {"path": path, "measured": measured, "free": free, **({"error": why} if why else {})}
        out["disk"] = disk
        out["memory"] = _available_memory()
        out["clock"] = node_clock(self.env)
        return out

    def _run_probe(self, python: str, cwd: str, timeout: float) -> dict[str, Any]:
        """What the probe found, or ``{"errors": [why the Python did not run]}``."""
        found, why, timed_out = self._run_script([python, "-c", _PROBE], self.env, timeout, cwd=cwd, lines=3)
        if timed_out:
            return {"errors": [f"python {python} did not import torch and deepspeed within {timeout:g} s"]}
        return found if found else {"errors": [why]}

    def _kill_probe(self) -> None:
        with self._lock:
            proc = self._probe
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    # -- the master port ----------------------------------------------------------------------

    def _listen(self, addr: str, port: int) -> dict[str, Any]:
        family, wildcard = (socket.AF_INET6, "::") if ":" in addr else (socket.AF_INET, "0.0.0.0")
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((wildcard, port))
            sock.listen(128)
        except OSError as err:
            sock.close()
            return {"status": "failed", "detail": f"cannot listen on the master port {port}: {err.strerror or err}"}
        with self._lock:
            if self._closed:
                sock.close()
                return {"status": "failed", "detail": "the doctor was called off"}
            self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), name="doctor-listener", daemon=True).start()
        return {"status": "passed", "detail": f"listening on the master port {port}"}

    @staticmethod
    def _accept(sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            conn.close()

    @staticmethod
    def _connect(addr: str, port: int, timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=timeout):
                pass
        except socket.timeout:
            return {"status": "failed", "detail": f"cannot reach the master port {addr}:{port}: no answer within "
                                                  f"{timeout:g} s"}
        except OSError as err:
            return {"status": "failed", "detail": f"cannot reach the master port {addr}:{port}: "
                                                  f"{err.strerror or err}"}
        return {"status": "passed", "detail": f"reached the master port {addr}:{port} in "
                                              f"{(time.monotonic() - started) * 1000:.0f} ms"}

    # -- the all-reduce -----------------------------------------------------------------------

    def _allreduce(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The all-reduce among every node (rank = node rank; node 0 hosts the rendezvous on the master port, its
        listener closed first), then the link tests of ``rounds``, with ``backend`` (``nccl``: on the node's
        first slot's GPU) and the interface the ranks' collectives would use. Killed at ``timeout_s``; the
        collectives' own timeout is 0.8 of it, so a hung peer ends as an error rather than a kill."""
        from . import network
        env = dict(self.env)
        for key, value in network.choose(env, msg.get("master")).sets.items():
            env.setdefault(key, value)
        timeout = float(msg.get("timeout_s") or 30.0)
        backend = str(msg.get("backend") or "gloo")
        config = {"addr": str(msg.get("addr")), "port": int(msg.get("port") or 0), "rank": int(msg.get("rank") or 0),
                  "world": int(msg.get("world") or 1), "bytes": int(msg.get("bytes") or 1 << 22),
                  "iters": int(msg.get("iters") or 5), "timeout": max(1.0, timeout * 0.8), "backend": backend,
                  "device": device_index(env, int(msg.get("slot") or 0)), "rounds": list(msg.get("rounds") or []),
                  "pair_bytes": int(msg.get("pair_bytes") or 1 << 22), "pair_iters": int(msg.get("pair_iters") or 3)}
        argv = [str(msg.get("python") or "python3"), "-c", _COLLECTIVES, json.dumps(config)]
        found, why, timed_out = self._run_script(argv, env, timeout, lines=3)
        if not found:
            return {"status": "failed", "detail": f"the all-reduce ({backend}) failed: {why}"}
        if found.get("rounds_done", 0) < len(config["rounds"]):
            done = f"after {found.get('rounds_done', 0)} of {len(config['rounds'])} rounds"
            found["links_error"] = (f"the link tests did not finish within {timeout:g} s ({done})" if timed_out
                                    else f"the link tests stopped {done}: {why or 'no reason given'}")
        return {"status": "passed", "detail": "", "result": found}

    def _run_script(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str = "/",
                    lines: int = 2) -> tuple[dict[str, Any], str, bool]:
        """``(what the script printed last after the mark, why it failed, timed out)``: killed at ``timeout``
        seconds. ``found`` is ``{}`` when it printed nothing marked; ``why`` is ``""`` when it exited 0 after
        printing, else says how it ended, with the last ``lines`` lines of its standard error."""
        try:
            with self._lock:
                if self._closed:
                    return {}, "the doctor was called off", False
                proc = self._probe = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as err:
            return {}, f"python {argv[0]} cannot be run: {err.strerror or err}", False
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_probe()
            out, err = proc.communicate()
            timed_out = True
        finally:
            with self._lock:
                self._probe = None
        found: dict[str, Any] = {}
        for line in reversed(out.decode("utf-8", "replace").splitlines()):
            if line.startswith(_MARK):
                try:
                    found = json.loads(line[len(_MARK):])
                except ValueError:
                    pass
                break
        if timed_out:
            return found, f"no result within {timeout:g} s", True
        if found and proc.returncode == 0:
            return found, "", False
        tail = " ".join(err.decode("utf-8", "replace").strip().splitlines()[-lines:])[-100 * (lines + 1):]
        how = (f"exited with status {proc.returncode}" if proc.returncode >= 0
               else f"was killed by {signal.Signals(-proc.returncode).name}")
        return found, f"python {argv[0]} {how}{': ' + tail if tail else ''}", False

    def _unlisten(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()

    # -- ending -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the listener and kill a running probe; later phases answer that the doctor was called off."""
        with self._lock:
            self._closed = True
        self._unlisten()
        self._kill_probe()


def run_in_thread(doc: NodeDoctor, msg: dict[str, Any], send: Callable[[dict[str, Any]], Any]) -> threading.Thread:
    """Run ``doc.run(msg)`` on a thread of its own and ``send`` its answer; returns the thread."""
    thread = threading.Thread(target=lambda: send(doc.run(msg)), name=f"doctor-{msg.get('phase')}", daemon=True)
    thread.start()
    return thread
