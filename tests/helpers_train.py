"""Start examples/train_gpt.py on N local "nodes" with DeepSpeed's real per-node launcher.

Each node is one ``python -m deepspeed.launcher.launch --world_info=... --node_rank=k`` process
(in its own process group, so a test can kill a whole node), all on 127.0.0.1. The ranks'
stdout is merged per node; the training script writes whole lines with one write() each, so
``parse_train_lines`` can read every rank's ``[train]`` lines back out of it.

Also usable by hand::

    python tests/helpers_train.py --nodes 2 --slots 2 --config examples/ds_zero2.json \\
        --ckpt /tmp/ckpt -- --steps 300 --checkpoint-interval 100
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_gpt.py"
EXAMPLES = REPO / "examples"

# Small and fast: what the integration tests train.
TINY_ARGS = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "32", "--corpus-bytes", "200000",
             "--log-interval", "5"]

TRAIN_RE = re.compile(r"^\[train\] step=(\d+) rank=(\d+) loss=(\S+) lr=(\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_info_b64(nodes: int, slots: int) -> str:
    info = {f"n{k}": list(range(slots)) for k in range(nodes)}
    return base64.urlsafe_b64encode(json.dumps(info).encode()).decode()


def base_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in ("ORCH_RESUME_TAG", "ORCH_CHECKPOINT_DIR", "ORCH_DEEPSPEED_CONFIG", "RANK", "LOCAL_RANK", "WORLD_SIZE",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    venv_bin = os.path.dirname(sys.executable)  # first, as orch puts it for its ranks: the same `ninja`
    if venv_bin not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", os.defpath)
    env.update(extra or {})
    return env


@dataclass
class Job:
    procs: list
    logs: list
    started: float = field(default_factory=time.time)

    def wait(self, timeout: float) -> list[int]:
        deadline = self.started + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(f"training did not finish in {timeout}s; output:\n{self.output()[-4000:]}")
        return codes

    def kill(self, sig=signal.SIGKILL) -> None:
        """Signal every node's whole process group (launcher and its ranks)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def output(self) -> str:
        return "".join(Path(f).read_text(errors="replace") for f in self.logs)


def start(config: str | Path, train_args: list[str], *, ckpt_dir: str | Path | None = None,
          resume_tag: str | None = None, nodes: int = 2, slots: int = 2, log_dir: str | Path,
          env: dict | None = None) -> Job:
    """Start ``nodes`` launchers; config goes through ``ORCH_DEEPSPEED_CONFIG`` as orch passes it."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = {"ORCH_DEEPSPEED_CONFIG": str(config)}
    if ckpt_dir is not None:
        extra["ORCH_CHECKPOINT_DIR"] = str(ckpt_dir)
    if resume_tag:
        extra["ORCH_RESUME_TAG"] = resume_tag
    extra.update(env or {})
    e = base_env(extra)
    port = free_port()
    winfo = world_info_b64(nodes, slots)
    procs, logs = [], []
    for k in range(nodes):
        cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={winfo}", f"--node_rank={k}",
               "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPT), *train_args]
        log = log_dir / f"node{k}.log"
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=e, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        logs.append(str(log))
    return Job(procs, logs)


def run(config, train_args, *, timeout: float = 300, **kw) -> tuple[list[int], str]:
    job = start(config, train_args, **kw)
    codes = job.wait(timeout)
    return codes, job.output()


def parse_train_lines(text: str) -> dict[tuple[int, int], float]:
    """``{(step, rank): loss}`` from ``[train]`` lines; a duplicate (step, rank) is an error."""
    losses = {}
    for line in text.splitlines():
        m = TRAIN_RE.match(line)
        if m:
            key = (int(m.group(1)), int(m.group(2)))
            if key in losses:
                raise AssertionError(f"duplicate [train] line for step/rank {key}")
            losses[key] = float(m.group(3))
    return losses


def attempt_losses(run_dir: str | Path) -> dict[tuple[int, int], float]:
    """``{(rank, step): loss}`` from every rank's log of one orch attempt (``<run_dir>/logs``)."""
    out = {}
    for log in (Path(run_dir) / "logs").glob("rank-*.log"):
        for (step, rank), loss in parse_train_lines(log.read_text(errors="replace")).items():
            out[(rank, step)] = loss
    return out


def training_past(orch, step: int, ranks: int = 3, timeout: float = 180) -> str:
    """The (only) job's id in ``orch``'s state, once it is RUNNING and each of its ``ranks`` ranks logged a
    step past ``step`` (AssertionError if it fails or succeeds first, or after ``timeout`` s)."""
    from conftest import wait_for
    job_id = wait_for(lambda: (orch.json("list") or [{}])[0].get("id"), 60, "the job")

    def past() -> bool:
        d = orch.json("status", job_id)
        assert d["state"] not in ("FAILED", "SUCCEEDED"), d.get("cause")
        losses = attempt_losses(Path(d["run_dir"])) if d["state"] == "RUNNING" else {}
        return bool(losses) and min(max((s for (r_, s) in losses if r_ == rank), default=0)
                                    for rank in range(ranks)) > step
    wait_for(past, timeout, f"training past step {step}", interval=0.3)
    return job_id


#: the ops prebuild_ops builds, as the directories (and libraries) they land in under TORCH_EXTENSIONS_DIR; with
#: ``async_io`` also DeepSpeed's async_io op (NVMe offload), whose load builds pin_memory first
_OPS = ("deepspeed_shm_comm", "cpu_adam")
_AIO_OPS = ("pin_memory", "async_io")
_BUILDERS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder"}
#: TORCH_EXTENSIONS_DIRs this process has built (or loaded) the ops in
_PREBUILT: set[str] = set()
#: the builds :func:`start_prebuild` started, oldest first, that nobody has waited for yet: (process, its stderr
#: file, whether it is async_io's)
_BACKGROUND: list[tuple[subprocess.Popen, Any, bool]] = []
#: the async_io build waits for the core ops' build to end (both at once would fight over 2 cores), then starts
_AIO_AFTER: list[threading.Thread] = []


def _ops_in_place(ext_dir: str, async_io: bool = False) -> bool:
    """The ops' libraries are in ``ext_dir`` and no build of any holds its lock (with ``async_io``: async_io's and
    pin_memory's alone)."""
    return all((Path(ext_dir) / op / f"{op}.so").is_file() and not (Path(ext_dir) / op / "lock").exists()
               for op in (_AIO_OPS if async_io else _OPS))


def _build_code(async_io: bool) -> str:
    names = [_BUILDERS["async_io"]] if async_io else [_BUILDERS[op] for op in _OPS]
    return ("from deepspeed.accelerator import get_accelerator\n"
            f"for n in {tuple(names)!r}:\n"
            "    get_accelerator().create_op_builder(n).load()\n")


def _spawn(async_io: bool) -> None:
    import tempfile
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-c", _build_code(async_io)], env=base_env(), stdout=subprocess.DEVNULL,
                            stderr=err, start_new_session=True)
    _BACKGROUND.append((proc, err, async_io))


def start_prebuild(async_io: bool = False) -> None:
    """Start :func:`prebuild_ops`'s build in the background (tests/conftest.py does when a session collects tests
    that need the ops, so minutes of compiling on a fresh cache overlap the tests that need none): the comm and
    Adam ops first, then, with ``async_io``, DeepSpeed's async_io op. Nothing for what is built already. The next
    :func:`prebuild_ops` waits for the build it needs, and only for that one."""
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    if _BACKGROUND or _AIO_AFTER:
        return
    core = not (ext_dir and _ops_in_place(ext_dir))
    aio = async_io and not (ext_dir and _ops_in_place(ext_dir, async_io=True))
    if core:
        _spawn(False)
    if aio and not core:
        _spawn(True)
    elif aio:
        first = _BACKGROUND[-1][0]

        def after() -> None:
            first.wait()
            _spawn(True)
        thread = threading.Thread(target=after, name="async_io prebuild", daemon=True)
        thread.start()
        _AIO_AFTER.append(thread)


def finish_prebuild(timeout: float = 1800, async_io: bool = True) -> None:
    """Wait for the background builds (only the comm and Adam ops' without ``async_io``); a build stopped midway
    would leave its lock for every later rank to wait on, so none is stopped. Raises
    ``subprocess.CalledProcessError`` with its stderr if one failed."""
    deadline = time.monotonic() + timeout
    if async_io:
        for thread in _AIO_AFTER:
            thread.join(max(0.0, deadline - time.monotonic()))
        _AIO_AFTER[:] = [t for t in _AIO_AFTER if t.is_alive()]
    for entry in [e for e in _BACKGROUND if async_io or not e[2]]:
        proc, err, aio = entry
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the background build of DeepSpeed's ops did not finish within {timeout:.0f} s "
                                 f"(pid {proc.pid})") from None
        _BACKGROUND.remove(entry)
        err.seek(0)
        text = err.read().decode(errors="replace")
        err.close()
        if code != 0:
            raise subprocess.CalledProcessError(code, proc.args, stderr=text)
        ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", "")
        if ext_dir and not aio:
            _PREBUILT.add(ext_dir)


def prebuild_ops(timeout: float = 900, async_io: bool = False) -> None:
    """JIT-build (or load from ~/.cache/torch_extensions) the C++ ops the ranks need, once, here.

    ``deepspeed_shm_comm`` is loaded by every rank when DeepSpeed's torch backend starts on the
    CPU accelerator; ``cpu_adam`` by optimizer offload; with ``async_io``, DeepSpeed's async_io op
    (NVMe offload: minutes of build on 2 cores; its load builds pin_memory first), which an ops check
    of a node with libaio then finds built. Building takes ~1 min each on 2 cores; loading a cached
    build takes seconds (a Python with torch and DeepSpeed imported: 3-5 s), so once this process
    has built or loaded them in a TORCH_EXTENSIONS_DIR whose libraries are still there and unlocked,
    later calls (every integration module makes one) return at once. A build :func:`start_prebuild`
    started is waited for first.
    """
    finish_prebuild(timeout=max(timeout, 1800), async_io=async_io)
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    for aio in ((False, True) if async_io else (False,)):
        if ext_dir and (ext_dir in _PREBUILT or aio) and _ops_in_place(ext_dir, aio):
            _PREBUILT.add(ext_dir)
            continue
        subprocess.run([sys.executable, "-c", _build_code(aio)], env=base_env(), check=True,
                       timeout=max(timeout, 1800) if aio else timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if ext_dir and not aio:
            _PREBUILT.add(ext_dir)


def _main() -> int:
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--config", default=str(EXAMPLES / "ds_zero2.json"))
    p.add_argument("--ckpt", default=None)
    p.add_argument("--resume-tag", default=None)
    p.add_argument("--log-dir", default="/tmp/train_gpt_logs")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    targs = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    t0 = time.time()
    job = start(a.config, targs, ckpt_dir=a.ckpt, resume_tag=a.resume_tag, nodes=a.nodes, slots=a.slots,
                log_dir=a.log_dir)
    codes = job.wait(a.timeout)
    text = job.output()
    print("\n".join(line for line in text.splitlines() if not line.startswith("[train]")))
    print(f"exit codes {codes}; wall {time.time() - t0:.1f}s; logs in {a.log_dir}")
    return max(codes)


if __name__ == "__main__":
    sys.exit(_main())
