"""Planning and listing at scale (issue 18): ``make_plan`` in process, ``orch plan --output json``, ``orch list``.

* ``make_plan`` of N hosts x 8 slots (pdsh, ssh provisioner; and the other launchers at the largest N), in
  this process, best and median of ``--rounds``; the baseline beside it is the same plan's ``to_dict()`` (what
  any caller does with a plan next), so the ratio says what planning costs against merely walking the result;
* ``orch plan --output json`` of 4,096 x 8 (``--offline``), wall time of the command, and of ``orch
  --version`` beside it (the interpreter's and the CLI's own start-up), interleaved;
* ``orch list`` (the default page: 50 jobs) and ``GET /api/jobs``'s code path (``observe.job_list``) of a store
  filled directly with 1k/10k/100k finished jobs (each with an attempt and a progress row), in process, and
  the ``orch list`` command's wall time beside ``orch --version``; the baseline beside the page is the same page
  with the list's index dropped (the store as it was before it).

    .venv/bin/python bench/plan_scale.py               # 64/512/4,096 nodes, 1k/10k/100k jobs, 5 rounds
    .venv/bin/python bench/plan_scale.py --quick       # 64/512 nodes, 1k/10k jobs, 1 round

Targets (issue 18): 4,096 x 8 < 200 ms in process and < 1 s for ``orch plan --output json``; 100k jobs < 100 ms
per page. Nothing is asserted: this measures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.planning import PlanInputs, make_plan, resolve_pool  # noqa: E402
from orchestrator.spec import spec_from_dict  # noqa: E402

PYTHON = sys.executable  # the interpreter running the benchmark: its virtualenv has orch, wherever it is


def _ms(values: list[float]) -> str:
    return f"{min(values) * 1000:.1f} / {statistics.median(values) * 1000:.1f} / {max(values) * 1000:.1f}"


def _plan_inputs(workdir: Path, nodes: int, launcher: str):
    spec = spec_from_dict({"name": "scale", "entrypoint": "train.py", "workdir": str(workdir), "launcher": launcher,
                           "provisioner": "ssh", "metrics_port": 9400, "env": {"NCCL_DEBUG": "WARN"}}, workdir)
    inputs = PlanInputs(job_id="scale-1", master_port=29500, run_dir="/runs/scale/attempt-1", checkpoint_dir="/ck",
                        python="/usr/bin/python3", controller_env={"PYTHONPATH": str(workdir)})
    pool = resolve_pool(collections.OrderedDict((f"node{i:05d}", 8) for i in range(nodes)))
    return spec, pool, inputs


def plan_in_process(sizes: list[int], rounds: int, workdir: Path) -> list[str]:
    """Rows of the make_plan table."""
    rows = ["| launcher | nodes x slots | ranks | make_plan ms (min / median / max) | its CPU ms (min) | "
            "to_dict ms (median) | plan / to_dict |", "|---|---|---|---|---|---|---|"]
    cases = [("pdsh", n) for n in sizes] + [(name, sizes[-1]) for name in ("standard", "openmpi", "slurm")]
    for launcher, nodes in cases:
        spec, pool, inputs = _plan_inputs(workdir, nodes, launcher)
        plan_s, dict_s, cpu_s = [], [], []
        for _ in range(rounds):  # A B A B: the plan, then walking it
            c0, t0 = time.process_time(), time.perf_counter()
            plan = make_plan(spec, pool, inputs)
            t1, c1 = time.perf_counter(), time.process_time()
            plan.to_dict()
            dict_s.append(time.perf_counter() - t1)
            plan_s.append(t1 - t0)
            cpu_s.append(c1 - c0)
        ratio = statistics.median(plan_s) / statistics.median(dict_s)
        rows.append(f"| {launcher} | {nodes:,} x 8 | {nodes * 8:,} | {_ms(plan_s)} | {min(cpu_s) * 1000:.1f} | "
                    f"{statistics.median(dict_s) * 1000:.1f} | {ratio:.2f} |")
    return rows


#: CPU seconds (user + system) of the last command _wall ran: on a loaded machine, closer to what it costs
_LAST_CPU: list[float] = [0.0]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _wall(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int]:
    c0, t0 = _children_cpu(), time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.decode()[-2000:]}")
    _LAST_CPU[0] = _children_cpu() - c0
    return time.perf_counter() - t0, len(r.stdout)


def plan_command(nodes: int, rounds: int, workdir: Path) -> list[str]:
    """Rows of the ``orch plan --output json`` table."""
    (workdir / "hostfile").write_text("".join(f"node{i:05d} slots=8\n" for i in range(nodes)))
    (workdir / "job.yaml").write_text(json.dumps({"name": "scale", "hostfile": "hostfile", "provisioner": "ssh",
                                                  "launcher": "pdsh", "entrypoint": "train.py",
                                                  "env": {"NCCL_DEBUG": "WARN"}, "metrics_port": 9400}))
    env = {**os.environ, "ORCH_STATE_DIR": str(workdir / "state")}
    orch = [PYTHON, "-m", "orchestrator"]
    plan_s, version_s, plan_cpu, version_cpu, size = [], [], [], [], 0
    for _ in range(rounds):
        version_s.append(_wall(orch + ["--version"], env, workdir)[0])
        version_cpu.append(_LAST_CPU[0])
        took, size = _wall(orch + ["plan", "--offline", "--output", "json", "job.yaml"], env, workdir)
        plan_s.append(took)
        plan_cpu.append(_LAST_CPU[0])
    return ["| command | wall ms (min / median / max) | CPU ms (min / median / max) | output |", "|---|---|---|---|",
            f"| `orch --version` (start-up) | {_ms(version_s)} | {_ms(version_cpu)} | |",
            f"| `orch plan --offline --output json`, {nodes:,} x 8 | {_ms(plan_s)} | {_ms(plan_cpu)} | "
            f"{size / 2**20:.1f} MiB |"]


def fill_store(path: Path, jobs: int) -> None:
    """A store of ``jobs`` SUCCEEDED jobs, each with one attempt and a progress row, written in one transaction."""
    from orchestrator.store import Store
    store = Store(path)
    spec = json.dumps({"name": "bench", "entrypoint": "train.py", "hostfile": "hosts"})
    plan = json.dumps({"nodes": [{"node_rank": 0, "host": "a", "ranks": [{"global_rank": 0}]}], "world_size": 1})
    t0 = 1.7e9
    with store._tx() as db:
        db.executemany("INSERT INTO jobs (id, name, state, spec, attempt, cause, owner, cancel_requested, created_at, "
                       "updated_at) VALUES (?, ?, 'SUCCEEDED', ?, 1, NULL, NULL, 0, ?, ?)",
                       ((f"bench-{i:06d}", "bench", spec, t0 + i, t0 + i + 60) for i in range(jobs)))
        db.executemany("INSERT INTO attempts (job_id, number, state, plan, created_at, running_at, ended_at) "
                       "VALUES (?, 1, 'SUCCEEDED', ?, ?, ?, ?)",
                       ((f"bench-{i:06d}", plan, t0 + i, t0 + i + 1, t0 + i + 60) for i in range(jobs)))
        db.executemany("INSERT INTO attempt_worlds (job_id, number, world_size, hosts) VALUES (?, 1, 1, '[\"a\"]')",
                       ((f"bench-{i:06d}",) for i in range(jobs)))
        db.executemany("INSERT INTO progress_summary (job_id, attempt, data) VALUES (?, 1, ?)",
                       ((f"bench-{i:06d}", json.dumps({"ranks": {"0": 100}, "step": 100, "at": t0 + i + 60,
                                                       "samples": [[t0 + i + 30, 50], [t0 + i + 60, 100]]}))
                        for i in range(jobs)))
    store.close()


def list_page(counts: list[int], rounds: int, workdir: Path) -> list[str]:
    """Rows of the ``orch list`` table."""
    from orchestrator.observe import job_list
    from orchestrator.store import Store
    rows = ["| jobs in the store | page ms (min / median / max) | without the index ms (median) | with / without | "
            "`orch list` wall ms (median) | `orch --version` wall ms (median) |", "|---|---|---|---|---|---|"]
    for count in counts:
        state = workdir / f"state-{count}"
        state.mkdir()
        fill_store(state / "orch.db", count)
        store = Store(state / "orch.db")
        page_s, scan_s = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            page = job_list(store, 51)  # orch list asks for one more than its default 50
            page_s.append(time.perf_counter() - t0)
        assert len(page) == 51 and page[0]["id"] == f"bench-{count - 1:06d}", page[0]
        store._db.execute("DROP INDEX jobs_newest")  # the baseline: the store as it was before the index
        for _ in range(rounds):
            t0 = time.perf_counter()
            assert job_list(store, 51) == page
            scan_s.append(time.perf_counter() - t0)
        store._db.execute("CREATE INDEX jobs_newest ON jobs(created_at DESC, id)")
        store.close()
        env = {**os.environ, "ORCH_STATE_DIR": str(state)}
        orch = [PYTHON, "-m", "orchestrator"]
        cli_s, version_s = [], []
        for _ in range(rounds):
            version_s.append(_wall(orch + ["--version"], env, workdir)[0])
            cli_s.append(_wall(orch + ["list"], env, workdir)[0])
        ratio = statistics.median(page_s) / statistics.median(scan_s)
        rows.append(f"| {count:,} | {_ms(page_s)} | {statistics.median(scan_s) * 1000:.1f} | {ratio:.3f} | "
                    f"{statistics.median(cli_s) * 1000:.0f} | {statistics.median(version_s) * 1000:.0f} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="64/512 nodes, 1k/10k jobs, one round")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    sizes = [64, 512] if args.quick else [64, 512, 4096]
    counts = [1000, 10_000] if args.quick else [1000, 10_000, 100_000]
    with tempfile.TemporaryDirectory(prefix="orch-bench-plan-") as d:
        work = Path(d)
        (work / "train.py").write_text("")
        print(f"make_plan, in process ({rounds} rounds; ssh provisioner, 8 slots a node):\n")
        print("\n".join(plan_in_process(sizes, rounds, work)) + "\n")
        print(f"orch plan, the command ({rounds} rounds, interleaved with orch --version):\n")
        print("\n".join(plan_command(sizes[-1], rounds, work)) + "\n")
        print(f"orch list, the default page of 50 ({rounds} rounds):\n")
        print("\n".join(list_page(counts, rounds, work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
