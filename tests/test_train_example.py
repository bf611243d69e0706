"""examples/train_gpt.py's per-rank state, on the session's shared ZeRO runs (tests/zero_runs.py: 2 local
"nodes", CPU, gloo, a checkpoint every 10 steps).

Run with::

    . .venv/bin/activate && pytest -m integration tests/test_train_example.py -v

What is checked:

(Every ZeRO stage training through orch, and exact resume after a killed rank, are in
tests/test_training.py.)

Per-rank state is per rank: the saved files differ and name their rank, DeepSpeed's
    shared client_state holds none of it, and a resume where rank 1 gets rank 0's generator
    state (what happens if that state travels in client_state under ZeRO 1/2) is caught;
plus that ds_to_universal accepts a ZeRO-1 checkpoint, and unit tests of the per-rank state.

The checkpoints are the shared runs' (read, or copied where a file is changed); the one launch of its own,
the tampered resume, is DeepSpeed's launch.py on each "node" (tests/helpers_train.py) with the shared run's
config and arguments: the ranks orch started are DeepSpeed's, so its untampered losses are the shared run's.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train as h
from zero_runs import INTERVAL, ZeroRun

CKPT_AT = INTERVAL  # the resume point: the shared runs' first tag, step_10
REL_TOL = 1e-4
TIMEOUT = 240


# --------------------------------------------------------------------------- per-rank state is per rank


def _losses(run: ZeroRun) -> dict[tuple[int, int], float]:
    """``{(step, rank): loss}`` of the shared run's attempt."""
    return {(step, rank): loss for (rank, step), loss in h.attempt_losses(run.run_dir).items()}


@pytest.mark.integration
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 3])
def test_saved_rank_states_are_distinct(stage, zero_run):
    import torch
    run = zero_run(stage)
    tag_dir = run.ckpt / f"step_{CKPT_AT}"
    world = run.world
    states = [torch.load(tag_dir / f"orch_rank_{r}.pt", weights_only=True) for r in range(world)]
    assert [s["global_rank"] for s in states] == list(range(world))
    assert all(s["step"] == CKPT_AT for s in states)
    for key in ("torch_rng",):
        assert len({bytes(s[key].numpy()) for s in states}) == world, key
    assert len({bytes(s["data"]["generator"].numpy()) for s in states}) == world
    assert len({tuple(s["data"]["bounds"]) for s in states}) == world
    assert len({tuple(s["python_rng"][1]) for s in states}) == world
    # DeepSpeed's single shared copy (ZeRO 0-2; per dp rank under ZeRO-3) carries nothing rank-specific
    for f in list(tag_dir.glob("*model_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        assert not {"data", "torch_rng", "numpy_rng", "python_rng", "generator"} & set(sd)
        assert sd["iteration"] == CKPT_AT and "universal_checkpoint_info" in sd


@pytest.mark.integration
@pytest.mark.deepspeed
def test_resume_with_rank0_state_on_rank1_is_detected(zero_run, tmp_path):
    """Negative control for the exact-resume comparison (tests/test_training.py's
    test_kill_a_rank_then_resume_matches_an_uninterrupted_run): give rank 1 rank 0's generator/RNG state, as a
    ZeRO-1/2 client_state would. Rank 1's loss at the first resumed step must then differ from the shared run's
    while rank 0's still matches, so that comparison really checks every rank.
    """
    import torch
    ref = zero_run(1)
    tag = f"step_{CKPT_AT}"
    (tmp_path / "ckpt").mkdir()  # only the tag resumed from, nothing of the run's later steps
    shutil.copytree(ref.ckpt / tag, tmp_path / "ckpt" / tag)
    tag_dir = tmp_path / "ckpt" / tag
    s0 = torch.load(tag_dir / "orch_rank_0.pt", weights_only=True)
    s1 = torch.load(tag_dir / "orch_rank_1.pt", weights_only=True)
    s0["global_rank"] = 1
    s0["data"]["bounds"] = s1["data"]["bounds"]  # rank 1's own shard, rank 0's generator position
    torch.save(s0, tag_dir / "orch_rank_1.pt")
    spec = yaml.safe_load(ref.spec.read_text())
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(spec["deepspeed_config"]))
    args = list(spec["args"])
    args[args.index("--steps") + 1] = str(CKPT_AT + 1)
    codes, text = h.run(config, args, ckpt_dir=tmp_path / "ckpt", log_dir=tmp_path / "logs", slots=ref.slots,
                        resume_tag=tag, timeout=TIMEOUT)
    assert codes == [0] * len(codes), f"exit codes {codes}\n{text[-5000:]}"
    resumed, losses = h.parse_train_lines(text), _losses(ref)
    s = CKPT_AT + 1
    assert resumed[(s, 0)] == pytest.approx(losses[(s, 0)], rel=REL_TOL)
    assert resumed[(s, 1)] != pytest.approx(losses[(s, 1)], rel=REL_TOL)


# --------------------------------------------------------------------------- universal checkpoint


@pytest.mark.integration
@pytest.mark.deepspeed
def test_ds_to_universal_accepts_zero1_checkpoint(zero_run, tmp_path):
    ref = zero_run(1)
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(ref.ckpt / f"step_{CKPT_AT}"), "--output_folder", str(tmp_path / "uc"),
                           "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          check=False, env=h.base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "uc" / "zero" / "head.weight" / "fp32.pt").is_file()
    assert (tmp_path / "uc" / "zero" / "head.weight" / "exp_avg.pt").is_file()


# --------------------------------------------------------------------------- unit tests (no launch)


def _train_module():
    spec = importlib.util.spec_from_file_location("train_gpt", h.SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rank_state_roundtrip_and_rank_check(tmp_path):
    import random

    import numpy as np
    import torch
    tg = _train_module()
    corpus = torch.arange(10_000, dtype=torch.int64).remainder(256).to(torch.uint8)
    sampler = tg.RankSampler(corpus, 1, 2, 16, seed=5)
    tg.seed_rank_rngs(7, 1)
    sampler.next_batch(3)
    state = tg.capture_rank_state(sampler, 4, 1, {})
    tg.atomic_write_bytes(tmp_path / "r.pt", lambda f: torch.save(state, f))
    want = (sampler.next_batch(3)[0], torch.rand(3), np.random.rand(), random.random())
    fresh = tg.RankSampler(corpus, 1, 2, 16, seed=99)
    tg.seed_rank_rngs(8, 0)
    loaded = torch.load(tmp_path / "r.pt", weights_only=True)
    tg.restore_rank_state(loaded, fresh, 1, 4)
    got = (fresh.next_batch(3)[0], torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]) and want[2:] == got[2:]
    assert fresh.samples_drawn == 6
    with pytest.raises(RuntimeError, match="belongs to rank 1"):
        tg.restore_rank_state(loaded, tg.RankSampler(corpus, 0, 2, 16, seed=1), 0, 4)
    with pytest.raises(RuntimeError, match="shard changed"):
        tg.restore_rank_state(loaded, tg.RankSampler(corpus, 0, 2, 16, seed=1), 1, 4)


def test_corpus_is_stdlib_and_deterministic():
    tg = _train_module()
    a, info = tg.load_corpus(50_000)
    b, info2 = tg.load_corpus(50_000)
    assert info == info2 and a.numel() == 50_000 and bytes(a[:200].numpy()) == bytes(b[:200].numpy())
    assert b"import" in bytes(a.numpy()) or b"def " in bytes(a.numpy())
