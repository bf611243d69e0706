"""Finding the last complete checkpoint: partial saves are never chosen, and are reported."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.checkpoints import MARKER, inspect_tag, latest_complete


def _tag(root: Path, tag: str, step: int, *, world: int = 2, stage: int = 2, marker: bool = True,
         drop: str | None = None) -> Path:
    d = root / tag
    d.mkdir(parents=True)
    files = [f"orch_rank_{r}.pt" for r in range(world)]
    if stage >= 3:
        files += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    else:
        files.append("mp_rank_00_model_states.pt")
    if stage >= 1:
        files += [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    for f in files:
        if f != drop:
            (d / f).write_bytes(b"x")
    if marker:
        (d / MARKER).write_text(json.dumps({"tag": tag, "step": step, "world_size": world, "zero_stage": stage,
                                            "dp_world_size": world,
                                            "rank_files": [f"orch_rank_{r}.pt" for r in range(world)]}))
    return d


def test_latest_complete_skips_partial_saves(tmp_path: Path) -> None:
    _tag(tmp_path, "step_10", 10)
    _tag(tmp_path, "step_20", 20)
    _tag(tmp_path, "step_30", 30, marker=False)            # killed before the marker
    _tag(tmp_path, "step_40", 40, drop="orch_rank_1.pt")    # marker but a file lost
    info, skipped = latest_complete(tmp_path)
    assert info is not None and info.tag == "step_20" and info.step == 20 and info.complete
    assert [s.tag for s in skipped] == ["step_40", "step_30"]
    assert "orch_rank_1.pt" in skipped[0].problems[0]
    assert "did not finish" in skipped[1].problems[0]


def test_zero3_needs_every_model_shard(tmp_path: Path) -> None:
    d = _tag(tmp_path, "step_5", 5, stage=3, world=3, drop="zero_pp_rank_2_mp_rank_00_model_states.pt")
    info = inspect_tag(d)
    assert not info.complete and any("zero_pp_rank_2" in p for p in info.problems)


def test_optimizer_shard_per_data_parallel_rank(tmp_path: Path) -> None:
    d = _tag(tmp_path, "step_5", 5, stage=1, world=2, drop="bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert any("data-parallel rank 1" in p for p in inspect_tag(d).problems)


def test_empty_or_missing_dir(tmp_path: Path) -> None:
    assert latest_complete(tmp_path / "nope") == (None, [])
    assert latest_complete(tmp_path) == (None, [])
