"""ZeRO-Inference through orch: examples/zero_infer.py on 2 local "nodes", parameters offloaded to CPU or NVMe.

The jobs are the shipped specs (examples/zero-inference.yaml, examples/zero-inference-nvme.yaml) with fewer
prompts and tokens, an NVMe path of the test's own, and absolute paths. The CPU and NVMe runs must generate
the same tokens: the weights ZeRO-3 gathers are the seeded model's, whether their partitions were kept in
CPU memory or in files read back through DeepSpeed's async_io op. (The example's single-process reference,
``--reference 2``, is bit-exact only in fp32: in bf16 DeepSpeed's ZeRO-3 linear, a matmul then an add,
rounds differently from ``F.linear``, and some greedy choices differ; the configs are bf16 because on a CPU
without fp16 DeepSpeed swaps parameters to NVMe as bf16 whatever the model's dtype.)

5 prompts at 2 a pass: rank 0 has 2 (one batch), rank 1 has 3 (two), so rank 0 also runs a batch whose
output it drops (ZeRO-3's gathers are collective); a rank that did not would leave the other hanging.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

import helpers_train
from conftest import ROOT, Orch, assert_no_leftovers, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed, pytest.mark.async_io]

EXAMPLES = ROOT / "examples"
PROMPTS, NEW_TOKENS, BATCH = 5, 8, 2
ARGS = ["--num-prompts", str(PROMPTS), "--new-tokens", str(NEW_TOKENS)]
#: forward passes per rank: the most batches any rank has (rank 1: 3 prompts, 2 batches) x tokens
FORWARDS = 2 * NEW_TOKENS


def _spec(write_spec, tmp_path: Path, offload: str, *, name: str, args: list[str] = ARGS) -> Path:
    """The shipped spec of ``offload`` (``cpu`` or ``nvme``), with ``args``, this test's NVMe path and absolute paths."""
    spec = yaml.safe_load((EXAMPLES / ("zero-inference.yaml" if offload == "cpu" else
                                       "zero-inference-nvme.yaml")).read_text())
    config = json.loads((EXAMPLES / spec["deepspeed_config"]).read_text())
    assert config["train_micro_batch_size_per_gpu"] == BATCH
    if offload == "nvme":
        config["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "nvme")
    spec.update(name=name, hostfile=str((EXAMPLES / spec["hostfile"]).resolve()), workdir=str(EXAMPLES),
                args=args, deepspeed_config=config, stop_grace_seconds=5)
    return write_spec(**spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(offload)``: ``(orch, orch run's CompletedProcess, job id, nvme dir)``, one run per offload and module."""
    done: dict = {}

    def get(offload: str):
        if offload not in done:
            if offload == "nvme":  # the async_io op built (or the session's background build waited for)
                helpers_train.prebuild_ops(async_io=True)
            tmp = tmp_path_factory.mktemp(f"infer-{offload}")
            (tmp / "state").mkdir()
            orch = Orch(tmp / "state")

            def write_spec(**fields) -> Path:
                (tmp / "job.yaml").write_text(yaml.safe_dump(fields, sort_keys=False))
                return tmp / "job.yaml"
            r = orch("run", str(_spec(write_spec, tmp, offload, name=f"infer-{offload}")))
            jobs = orch.json("list")
            done[offload] = (orch, r, jobs[0]["id"] if jobs else None, tmp / "nvme")
        return done[offload]
    return get


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_inference_job_runs_to_completion_on_two_nodes(runs, offload) -> None:
    orch, r, job_id, nvme = runs(offload)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert detail["state"] == "SUCCEEDED" and detail["world_size"] == 2
    assert [(x["global_rank"], x["host"], x["returncode"], x["step"]) for x in detail["ranks"]] == [
        (0, "node-0", 0, FORWARDS), (1, "node-1", 0, FORWARDS)]
    outputs = Path(detail["run_dir"]) / "outputs"
    assert sorted(p.name for p in outputs.iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    got = {rank: _rows(outputs / f"rank-{rank}.jsonl") for rank in (0, 1)}
    assert [[row["index"] for row in got[rank]] for rank in (0, 1)] == [[0, 1], [2, 3, 4]]  # each prompt once
    assert all(len(row["tokens"]) == NEW_TOKENS for rows in got.values() for row in rows)
    assert len({tuple(row["tokens"]) for rows in got.values() for row in rows}) > 1  # not one constant output

    logs = orch("logs", job["id"])
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    for rank in (0, 1):
        setup = next(line for line in lines if line.startswith(f"[rank {rank}] [setup] "))
        assert f" world_size=2 zero_stage=3 offload_param={offload} " in setup, setup
        assert f"[rank {rank}] [gen] step={FORWARDS} rank={rank} " in logs.stdout
        assert any(line.startswith(f"[rank {rank}] [done] rank={rank} prompts={len(got[rank])} "
                                   f"forwards={FORWARDS} ") for line in lines)
    if offload == "nvme":  # the MLP weights' partitions (1 MiB each) went to files; the rest stayed in memory
        assert all(" partitions=cpu:25,nvme:4 " in line for line in lines if "[setup]" in line), logs.stdout
        for rank in (0, 1):
            swapped = list((nvme / "zero_stage_3" / "bfloat16params" / f"rank{rank}").glob("*.swp"))
            assert len(swapped) == 4 and all(p.stat().st_size >= 1 << 20 for p in swapped), swapped
    assert_no_leftovers(job["id"], timeout=1)


def test_cpu_and_nvme_offload_generate_the_same_tokens(runs) -> None:
    got = {}
    for offload in ("cpu", "nvme"):
        orch, r, job_id, _ = runs(offload)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        outputs = Path(orch.json("status", job_id)["run_dir"]) / "outputs"
        got[offload] = {rank: _rows(outputs / f"rank-{rank}.jsonl") for rank in (0, 1)}
    assert got["cpu"] == got["nvme"]


def test_cancel_mid_generation_stops_every_rank_and_writes_no_outputs(orch, write_spec, tmp_path) -> None:
    spec = _spec(write_spec, tmp_path, "cpu", name="infer-cancel",
                 args=["--num-prompts", str(PROMPTS), "--new-tokens", "80", "--token-delay-s", "0.5"])
    proc = orch.popen("run", str(spec))
    try:
        job_id = wait_for(lambda: [j["id"] for j in orch.json("list")], 60, "the job")[0]
        logs = Path(wait_for(lambda: orch.json("status", job_id).get("run_dir"), 60, "the run dir")) / "logs"
        # the preflight (ops built or found per node) and the imports take minutes on a loaded machine
        def generating() -> bool:
            state = orch.json("status", job_id)["state"]
            assert state in ("PENDING", "PROVISIONING", "RUNNING"), (state, _text(logs / "rank-0.log")[-2000:])
            return all("[gen] step=" in _text(logs / f"rank-{rank}.log") for rank in (0, 1))
        wait_for(generating, 600, "both ranks generating")
        assert orch.json("status", job_id)["state"] == "RUNNING"
        r = orch("cancel", job_id, "--wait", "30")
        assert r.returncode == 0 and r.stdout.startswith(f"Job {job_id}: CANCELLED"), r.stdout + r.stderr
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_no_leftovers(job_id, timeout=1)
    detail = orch.json("status", job_id)
    assert detail["state"] == "CANCELLED" and detail["cause"]["kind"] == "cancelled"
    assert all(0 < (x["step"] or 0) < 2 * 80 for x in detail["ranks"]), detail["ranks"]  # stopped mid-generation
    outputs = Path(detail["run_dir"]) / "outputs"
    assert not outputs.exists() or list(outputs.iterdir()) == []  # written whole at the end only
    assert "[done]" not in orch("logs", job_id).stdout


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
