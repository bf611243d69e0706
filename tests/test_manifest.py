"""agents.manifest: hashing checkpoint files (full, sampled, off), who hashes which file, and the watch that
records each settled file once (and again after it changes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agents import manifest
from agents.manifest import BLOCK, CheckpointWatch, hash_file, owner_rank


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_full_hash_changes_with_any_byte_and_sampled_only_within_its_blocks(tmp_path: Path) -> None:
    size = BLOCK * 40
    data = bytearray(os.urandom(size))
    f = _write(tmp_path / "a.pt", bytes(data))
    full, sampled = hash_file(str(f), "a.pt", "full"), hash_file(str(f), "a.pt", "sampled")
    assert full.mode == "full" and sampled.mode == "sampled" and full.hash != sampled.hash
    assert full.hash.startswith("xxh3-128:") and full.size == size
    offsets = manifest._sample_offsets(size)
    assert len(offsets) == manifest.SAMPLE_BLOCKS and offsets[0] == 0 and offsets[-1] == size - BLOCK
    inside = offsets[5] + 10  # a byte that sampling reads
    gap = next(o + BLOCK + 10 for o, nxt in zip(offsets, offsets[1:]) if nxt - o > BLOCK + 20)  # one it skips
    for where, sampled_sees in ((inside, True), (gap, False)):
        changed = bytearray(data)
        changed[where] ^= 0xFF
        f.write_bytes(bytes(changed))
        assert hash_file(str(f), "a.pt", "full").hash != full.hash
        assert (hash_file(str(f), "a.pt", "sampled").hash != sampled.hash) is sampled_sees
    f.write_bytes(bytes(data[:-1]))  # truncated by a byte: the size is hashed too
    assert hash_file(str(f), "a.pt", "sampled").hash != sampled.hash


def test_auto_hashes_small_files_in_full_and_large_ones_sampled(tmp_path: Path) -> None:
    f = _write(tmp_path / "x.bin", os.urandom(3 * BLOCK))
    assert hash_file(str(f), "x.bin", "auto", sample_above=3 * BLOCK).mode == "full"
    assert hash_file(str(f), "x.bin", "auto", sample_above=3 * BLOCK - 1).mode == "sampled"
    off = hash_file(str(f), "x.bin", "off")
    assert off.hash is None and off.size == 3 * BLOCK


@pytest.mark.parametrize("name, rank", [
    ("zero_pp_rank_3_mp_rank_00_optim_states.pt", 3), ("bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt", 12),
    ("zero_pp_rank_1_mp_rank_00_model_states.pt", 1), ("global_step20/zero_pp_rank_2_mp_rank_00_optim_states.pt", 2),
    ("rng_state_5.pth", 5), ("random_states_4.pkl", 4), ("orch_rank_7.pt", 7),
    ("mp_rank_00_model_states.pt", None), ("trainer_state.json", None), ("rng_state.pth", None), ("latest", None)])
def test_owner_rank_from_the_file_name(name: str, rank: int | None) -> None:
    assert owner_rank(name) == rank


def _tag(root: Path, tag: str, world: int) -> None:
    _write(root / tag / "mp_rank_00_model_states.pt", b"m" * 100)
    for r in range(world):
        _write(root / tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", bytes([r]) * 50)


def test_each_node_hashes_its_own_ranks_files_and_node_0_the_rest(tmp_path: Path) -> None:
    sent: dict[int, list[dict]] = {0: [], 1: []}
    watches = [CheckpointWatch({"dir": str(tmp_path), "world_size": 4, "interval_s": 1}, ranks, node,
                               lambda m, n=node: sent[n].extend(m["files"]) or True)
               for node, ranks in ((0, [0, 1]), (1, [2, 3]))]
    _tag(tmp_path, "global_step10", 4)  # written by the ranks, after the agents started
    for w in watches:
        assert w.poll() == 0  # first look: nothing has settled yet
        w.poll()
    names = {n: sorted(f["name"] for f in files) for n, files in sent.items()}
    assert names[0] == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert names[1] == ["zero_pp_rank_2_mp_rank_00_optim_states.pt", "zero_pp_rank_3_mp_rank_00_optim_states.pt"]
    assert {f["tag"] for f in sent[0] + sent[1]} == {"global_step10"}


def test_a_file_is_recorded_once_settled_and_again_after_it_changes(tmp_path: Path) -> None:
    out: list[dict] = []
    w = CheckpointWatch({"dir": str(tmp_path), "world_size": 1}, [0], 0, lambda m: out.extend(m["files"]) or True)
    _tag(tmp_path, "global_step10", 1)
    (tmp_path / "global_step10_universal").mkdir()  # orch's conversions and hidden entries are not watched
    _write(tmp_path / "global_step10_universal" / "mp_rank_00_model_states.pt", b"u")
    _write(tmp_path / ".orch-preflight-x" / "probe", b"p")
    _write(tmp_path / "latest", b"global_step10")  # not inside a tag
    w.poll()
    assert w.poll() == 2 and w.poll() == 0
    f = tmp_path / "global_step10" / "mp_rank_00_model_states.pt"
    f.write_bytes(b"n" * 120)
    os.utime(f, ns=(f.stat().st_mtime_ns + 10**9,) * 2)
    assert w.poll() == 0  # changed since the last look: not settled yet
    assert w.poll() == 1 and out[-1]["size"] == 120
    f.write_bytes(b"z" * 7)
    w.stop(final_deadline_s=5)  # the ranks stopped: whatever is left is hashed at once
    assert out[-1]["size"] == 7


def test_tag_pattern_limits_what_is_watched(tmp_path: Path) -> None:
    out: list[dict] = []
    w = CheckpointWatch({"dir": str(tmp_path), "tag_pattern": r"checkpoint-\d+", "world_size": 2}, [0, 1], 0,
                        lambda m: out.extend(m["files"]) or True)
    _write(tmp_path / "checkpoint-10" / "trainer_state.json", b"{}")
    _write(tmp_path / "runs" / "events.out", b"tb")
    w.stop(final_deadline_s=5)
    assert [(f["tag"], f["name"]) for f in out] == [("checkpoint-10", "trainer_state.json")]


def test_files_there_before_the_attempt_are_not_recorded_again(tmp_path: Path) -> None:
    """A file damaged while no attempt ran keeps the manifest of its save; one the ranks write again is new."""
    _tag(tmp_path, "global_step10", 1)
    out: list[dict] = []
    w = CheckpointWatch({"dir": str(tmp_path), "world_size": 1}, [0], 0, lambda m: out.extend(m["files"]) or True)
    w.poll()
    w.poll()
    w.stop(final_deadline_s=5)
    assert out == []
    w = CheckpointWatch({"dir": str(tmp_path), "world_size": 1}, [0], 0, lambda m: out.extend(m["files"]) or True)
    f = tmp_path / "global_step10" / "mp_rank_00_model_states.pt"
    f.write_bytes(b"saved again")
    os.utime(f, ns=(f.stat().st_mtime_ns + 10**9,) * 2)
    w.stop(final_deadline_s=5)
    assert [(x["name"], x["size"]) for x in out] == [("mp_rank_00_model_states.pt", 11)]


def test_a_file_deleted_while_its_tag_is_listed_is_left_out_not_an_error(tmp_path: Path, monkeypatch) -> None:
    """A file the ranks remove between the watch's listing of a tag and its look at the file (DeepSpeed's
    temporary files, a save replaced) is skipped: the rest of the tag is recorded and no error is kept."""
    out: list[dict] = []
    w = CheckpointWatch({"dir": str(tmp_path), "world_size": 1}, [0], 0, lambda m: out.extend(m["files"]) or True)
    _tag(tmp_path, "global_step10", 1)
    gone = _write(tmp_path / "global_step10" / "zz_scratch.pt", b"s")
    real_walk = os.walk

    def walk_then_remove(top, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - os.walk's
        for entry in real_walk(top, *args, **kwargs):
            if gone.exists() and gone.name in entry[2]:
                gone.unlink()  # listed, then removed before it is looked at
            yield entry
    monkeypatch.setattr(manifest.os, "walk", walk_then_remove)
    w.stop(final_deadline_s=5)
    assert not gone.exists()
    assert sorted(f["name"] for f in out) == ["mp_rank_00_model_states.pt",
                                              "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert w.errors == []
