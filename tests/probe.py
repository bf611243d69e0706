"""A rank that reports how it was started, and a comparison of two such reports.

As a script (started by a launcher in place of a training script)::

    PROBE_OUT_DIR=/tmp/out python -u tests/probe.py --local_rank=0 a b

it writes ``$PROBE_OUT_DIR/rank<RANK>.json`` (``RANK`` from its environment; ``pid<pid>`` when
``RANK`` is unset) holding::

    {"argv": sys.argv, "orig_argv": sys.orig_argv, "executable": sys.executable,
     "cwd": os.getcwd(), "pid": os.getpid(), "netns": "net:[<inode>]" (the host it ran on),
     "env": dict(os.environ), "pg": null | {...}}

``env`` is captured first thing, before anything is imported that could change it. The probe
takes *no* arguments of its own (everything after the script is whatever the launcher passed,
so the launchers' argv handling is seen unchanged); it is configured only by environment:

* ``PROBE_OUT_DIR`` (required): directory the JSON file is written to (created if missing).
* ``PROBE_INIT_PG=1``: also join the default process group with
  ``torch.distributed.init_process_group("gloo")`` (``env://``: ``MASTER_ADDR``,
  ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, and ``TORCHELASTIC_USE_AGENT_STORE``), all-reduce
  ``rank + 1`` and record ``{"rank", "world_size", "sum"}`` under ``"pg"``; proves rendezvous works.
* ``PROBE_EXIT_CODE=N``: exit with status ``N`` after writing (default 0).
* ``PROBE_DS_DISCOVERY=1``: first do what ``deepspeed.init_distributed()`` does when one of
  RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK is missing: DeepSpeed's own
  ``deepspeed.comm.comm.mpi_discovery`` (mpi4py; ``distributed_port`` from ``PROBE_DS_PORT``,
  default 29500), and record those five as they are then under ``"derived"`` (also when nothing
  was missing). The report is named by the derived RANK.

As a module, :func:`compare_probe_outputs` compares the reports of two ways of starting the
same job (the real tool vs. orch's agent), rank by rank; :func:`load_probe_outputs` reads a
directory of reports.
"""

from __future__ import annotations

import os
import sys

_ENV_AT_START = dict(os.environ)

import importlib  # noqa: E402  (imported after the environment snapshot on purpose)
import json  # noqa: E402
from typing import Mapping  # noqa: E402

__all__ = ["load_probe_outputs", "compare_probe_outputs", "format_differences", "main"]


def load_probe_outputs(directory: str) -> dict[int, dict]:
    """Return ``{global rank: report}`` for every ``rank<N>.json`` in ``directory``."""
    out: dict[int, dict] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out[int(name[4:-5])] = json.load(f)
    return out


def compare_probe_outputs(real: Mapping[int, dict], ours: Mapping[int, dict],
                          ignore: Mapping[str, str] | None = None, *,
                          compare: tuple[str, ...] = ("orig_argv", "cwd")) -> list[str]:
    """Compare two runs' probe reports rank by rank; return every difference (empty: same).

    Args:
        real: ``{rank: report}`` from the real tool (see :func:`load_probe_outputs`).
        ours: ``{rank: report}`` from orch's side.
        ignore: environment variables whose value *and presence* may differ, each with the
            reason why it must (e.g. ``{"TORCHELASTIC_ERROR_FILE": "torchrun's temp dir"}``).
            A reason must be given: an empty reason is itself reported as a difference.
            Every other variable must be present on both sides with the same value.
        compare: report fields, besides ``env``, that must be equal (``orig_argv`` is the whole
            command line as the kernel saw it, interpreter and its options included).

    Returns:
        human-readable lines such as ``"rank 1: env MASTER_PORT: real '29500' != ours '29501'"``.
    """
    ignore = dict(ignore or {})
    problems = [f"ignore {k!r} has no reason" for k, why in ignore.items() if not str(why).strip()]
    if set(real) != set(ours):
        problems.append(f"ranks differ: real {sorted(real)} != ours {sorted(ours)}")
    for rank in sorted(set(real) & set(ours)):
        r, o = real[rank], ours[rank]
        for key in compare:
            if r.get(key) != o.get(key):
                problems.append(f"rank {rank}: {key}: real {r.get(key)!r} != ours {o.get(key)!r}")
        renv, oenv = r.get("env", {}), o.get("env", {})
        for var in sorted(set(renv) | set(oenv)):
            if var in ignore:
                continue
            if var not in oenv:
                problems.append(f"rank {rank}: env {var} only on the real side ({renv[var]!r})")
            elif var not in renv:
                problems.append(f"rank {rank}: env {var} only on our side ({oenv[var]!r})")
            elif renv[var] != oenv[var]:
                problems.append(f"rank {rank}: env {var}: real {renv[var]!r} != ours {oenv[var]!r}")
    return problems


def format_differences(problems: list[str]) -> str:
    """Join :func:`compare_probe_outputs` lines into one assertion message."""
    return "\n".join(["probe outputs differ:"] + ["  " + p for p in problems])


def _join_process_group() -> dict:
    # imported by name, not with an import statement: orch's fast_start auto forks only ranks whose source
    # imports torch (agents/forkserver.py), and a template importing torch and DeepSpeed on every node would
    # cost the probe seconds it needs only with PROBE_INIT_PG
    torch = importlib.import_module("torch")
    dist = importlib.import_module("torch.distributed")

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.item()}
    finally:
        dist.destroy_process_group()


DISCOVERED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _deepspeed_discovery() -> dict:
    if not all(v in os.environ for v in DISCOVERED):  # comm.init_distributed's test
        mpi_discovery = importlib.import_module("deepspeed.comm.comm").mpi_discovery  # (see _join_process_group)
        mpi_discovery(distributed_port=int(os.environ.get("PROBE_DS_PORT", "29500")), verbose=False)
    return {v: os.environ.get(v) for v in DISCOVERED}


def main() -> int:
    """Write this process's report (see the module docstring); return the exit status."""
    out_dir = _ENV_AT_START.get("PROBE_OUT_DIR")
    if not out_dir:
        print("probe: PROBE_OUT_DIR is not set", file=sys.stderr)
        return 2
    report = {
        "argv": list(sys.argv),
        "orig_argv": list(getattr(sys, "orig_argv", sys.argv)),
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "netns": os.readlink("/proc/self/ns/net"),
        "env": _ENV_AT_START,
        "pg": None,
    }
    if _ENV_AT_START.get("PROBE_DS_DISCOVERY") == "1":
        report["derived"] = _deepspeed_discovery()
    if _ENV_AT_START.get("PROBE_INIT_PG") == "1":
        report["pg"] = _join_process_group()
    name = f"rank{os.environ['RANK']}" if "RANK" in os.environ else f"pid{os.getpid()}"
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".{name}.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, f"{name}.json"))
    return int(_ENV_AT_START.get("PROBE_EXIT_CODE", "0"))


if __name__ == "__main__":
    sys.exit(main())
