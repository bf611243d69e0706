"""The program a real launcher starts for each rank under ``launch_mode: native``.

``mpirun``/``mpiexec``/``srun`` start this file (run as a script: it imports only the standard
library, so the ranks' interpreter need not have orch installed) in place of the training
script, on whichever node the tool places the rank::

    python -u native_rank.py --dir <log dir> --flavour openmpi|hydra|slurm [--helper] -- <argv...>

It makes the rank the node's agent can supervise as its own (:mod:`agents.adopted`):

1. reads its global and local rank and the world size from the tool's variables (Open MPI
   ``OMPI_COMM_WORLD_*``; Hydra ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``; srun
   ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``);
2. waits (at most ``--wait`` seconds) for ``<dir>/.native/rank-<r>.json``, which the agent of
   the node orch planned that rank on writes: the environment emulation would have given it;
   refuses to run (exit 3) when the tool placed the rank elsewhere than planned;
3. runs ``argv`` with that environment, the tool's own variables laid over it (its live wiring:
   URIs, PMI file descriptors; Open MPI's ``OMPI_COMMAND``/``OMPI_ARGV`` describe ``argv``, as if
   the tool had started it directly), stdout and stderr appended to ``<dir>/rank-<r>.log``, in a
   session of its own that dies with this process;
4. records ``.native/rank-<r>.pid`` when the rank starts and ``.native/rank-<r>.exit`` when it
   ends, forwards SIGTERM/SIGINT/SIGHUP to the rank's process group, and exits with the rank's
   status (128 + N for signal N), so the tool sees the rank's own end.

``--helper`` (mpich): set RANK/LOCAL_RANK from ``PMI_RANK``/``MPI_LOCALRANKID`` as DeepSpeed's
``launcher_helper.py`` does, instead of running that helper (which exits 0 whatever the script did).
Exit status 3: this file's own failure (no plan for the rank, a placement orch did not plan).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

#: (global rank, world size, local rank) variables of each tool family.
FLAVOURS = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "hydra": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}
#: Variable prefixes that are the tool's own: its values win over the plan's.
TOOL_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "MPIR_", "HYDRA_", "MV2_", "SLURM", "I_MPI_")
OWN_FAILURE = 3


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _fail(message: str) -> int:
    print(f"orch native rank: {message}", file=sys.stderr, flush=True)
    return OWN_FAILURE


def _load_plan(path: str, wait: float) -> dict | None:
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--flavour", required=True, choices=sorted(FLAVOURS))
    p.add_argument("--helper", action="store_true")
    p.add_argument("--wait", type=float, default=120.0)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _fail("no command to run")
    _die_with_parent()
    rank_var, size_var, local_var = FLAVOURS[args.flavour]
    tool = dict(os.environ)
    try:
        rank, size, local = int(tool[rank_var]), int(tool[size_var]), int(tool[local_var])
    except (KeyError, ValueError):
        return _fail(f"started without {rank_var}/{size_var}/{local_var}: not under the {args.flavour} tool?")
    state = os.path.join(args.dir, ".native")
    plan = _load_plan(os.path.join(state, f"rank-{rank}.json"), args.wait)
    if plan is None:
        return _fail(f"no plan for rank {rank} in {state} within {args.wait:.0f} s: the tool placed it on a node "
                     "whose agent does not run it")
    if plan.get("world_size") != size or plan.get("local_rank") != local:
        return _fail(f"the tool started rank {rank} as local rank {local} of world {size}; orch planned local rank "
                     f"{plan.get('local_rank')} of world {plan.get('world_size')} on {plan.get('host')}")
    env = dict(plan["env"])
    env.update({k: v for k, v in tool.items() if k.startswith(TOOL_PREFIXES)})
    if "OMPI_COMMAND" in tool:  # Open MPI describes the program it started: the rank's, not this file
        env["OMPI_COMMAND"], env["OMPI_ARGV"] = os.path.basename(command[0]), " ".join(command[1:])
    if args.helper:  # launcher_helper.py's mapping
        env["RANK"], env["LOCAL_RANK"] = tool[rank_var], tool[local_var]
    log = open(os.path.join(args.dir, f"rank-{rank}.log"), "ab", buffering=0)
    try:
        child = subprocess.Popen(command, env=env, cwd=plan.get("cwd") or None, stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=_die_with_parent)
    except OSError as err:
        _write(os.path.join(state, f"rank-{rank}.exit"), {"returncode": 127, "error": str(err)})
        return _fail(f"cannot start {command[0]}: {err}")
    _write(os.path.join(state, f"rank-{rank}.pid"), {"pid": os.getpid(), "child": child.pid, "at": time.time()})

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(child.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    code = child.wait()
    _write(os.path.join(state, f"rank-{rank}.exit"), {"returncode": code, "at": time.time()})
    try:
        os.killpg(child.pid, signal.SIGKILL)  # what the rank left in its group
    except (ProcessLookupError, PermissionError):
        pass
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
