"""orchestrator.checkpoints.headers and .deepspeed_layout: is a DeepSpeed tag complete and undamaged,
decided without loading a tensor.

Unit tests build files by hand (zip, pickle, safetensors, JSON) or with ``torch.save``. The integration
tests check the rules against REAL saves: this module, run as a script under ``torch.distributed.run``
with 2 CPU ranks (``DS_ACCELERATOR=cpu``, gloo), saves one tag per configuration (ZeRO stages 0-3,
bf16 with the BF16 optimizer and with ZeRO, a 2-stage pipeline, MoE with 2 expert-parallel ranks),
once per module, and the tests assert that :func:`required_files` is exactly what DeepSpeed wrote,
then damage copies.

Not found by design: bytes changed *inside tensor data* (no checksum covers them without reading
them); the per-file hash manifest finds those.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from orchestrator.checkpoints.deepspeed_layout import (
    DeepSpeedLayout,
    layout_from_header,
    read_latest,
    required_files,
    tag_problems,
)
from orchestrator.checkpoints.headers import (
    Opaque,
    TensorRef,
    file_problem,
    json_problem,
    read_torch_pickle,
    safetensors_problem,
    torch_file_problem,
)
from orchestrator.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
TAG = "step1"

# --------------------------------------------------------------------------- the saving script
# name -> (kind, DeepSpeed config additions)
SAVES = {
    "zero0": ("plain", {}),
    "zero1": ("plain", {"zero_optimization": {"stage": 1}}),
    "zero2": ("plain", {"zero_optimization": {"stage": 2}}),
    "zero3": ("plain", {"zero_optimization": {"stage": 3}}),
    "bf16_zero0": ("plain", {"bf16": {"enabled": True}}),
    "bf16_zero1": ("plain", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                             "data_types": {"grad_accum_dtype": "fp32"}}),   # BF16_Optimizer
    "bf16_zero2": ("plain", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}),
    "bf16_zero3": ("plain", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}),
    "moe_zero0": ("moe", {}),
    "moe_zero2": ("moe", {"zero_optimization": {"stage": 2}}),
    "pipe_zero1": ("pipe", {"zero_optimization": {"stage": 1}}),
    "pipe_bf16": ("pipe", {"bf16": {"enabled": True}}),   # BF16_Optimizer at stage 0
}
#: name -> (zero_stage, bf16, optimizer_shards, pipeline, moe_experts, expert_parallel_size)
EXPECTED = {
    "zero0": (0, False, False, False, (), None), "zero1": (1, False, True, False, (), None),
    "zero2": (2, False, True, False, (), None), "zero3": (3, False, True, False, (), None),
    "bf16_zero0": (0, True, False, False, (), None), "bf16_zero1": (1, True, True, False, (), None),
    "bf16_zero2": (2, True, True, False, (), None), "bf16_zero3": (3, True, True, False, (), None),
    "moe_zero0": (0, False, False, False, (4,), 2), "moe_zero2": (2, False, True, False, (4,), None),
    "pipe_zero1": (1, False, True, True, (), None), "pipe_bf16": (0, True, True, True, (), None),
}


def _engine(kind: str, extra: dict):  # runs in the ranks only
    import deepspeed
    import torch
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    cfg.update(json.loads(json.dumps(extra)))
    dtype = torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else torch.float32
    if kind == "pipe":
        from deepspeed.pipe import PipelineModule
        cfg["gradient_accumulation_steps"] = 2
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=lambda out, y: out.float().pow(2).mean())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        engine.train_batch(data_iter=iter([(torch.randn(2, 8, dtype=dtype), torch.zeros(2, 4, dtype=dtype))] * 2))
        return engine
    if kind == "moe":  # saved before any step: gloo has no all_to_all for the experts' forward
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import (
            split_params_into_different_moe_groups_for_optimizer,
        )
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        model.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=4, ep_size=2, k=1)
        params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
        return engine
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.randn(2, 8, dtype=dtype)).float().pow(2).mean())
    engine.step()
    return engine


def _save_main(out: str, names: list[str]) -> None:
    """In each rank: one engine per configuration, each saving tag ``step1`` under ``<out>/<name>``
    (plain before MoE before pipeline: the pipeline's grid must come last)."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    order = {"plain": 0, "moe": 1, "pipe": 2}
    for name in sorted(names, key=lambda n: order[SAVES[n][0]]):
        kind, extra = SAVES[name]
        _engine(kind, extra).save_checkpoint(os.path.join(out, name), tag=TAG)


def _run_saves(out: Path, names: list[str], timeout: float = 300) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
                "TORCH_EXTENSIONS_DIR": env.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))})
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", os.defpath)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(Path(__file__).resolve()), "--save", str(out), *names]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
    if r.returncode != 0:
        raise AssertionError(f"the DeepSpeed saves failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{name: <root>}``: every configuration of SAVES saved once by 2 DeepSpeed ranks."""
    out = tmp_path_factory.mktemp("ds_saves")
    started = time.monotonic()
    _run_saves(out, list(SAVES))
    print(f"{len(SAVES)} DeepSpeed saves by 2 ranks took {time.monotonic() - started:.1f} s")
    return {name: out / name for name in SAVES}


def _copy_tag(saves: dict[str, Path], name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name / TAG
    shutil.copytree(saves[name] / TAG, dst)
    return dst


# --------------------------------------------------------------------------- helpers for damage
def _entry_span(path: Path, suffix: str) -> tuple[int, int]:
    """``(first, end)`` byte of the data of the zip entry whose name ends with ``suffix``."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    start = info.header_offset + 30 + struct.unpack("<H", head[26:28])[0] + struct.unpack("<H", head[28:30])[0]
    return start, start + info.compress_size


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _torch_file(tmp_path: Path, name: str = "t.pt", **kw) -> Path:
    import torch
    path = tmp_path / name
    torch.save({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3, dtype=torch.bfloat16),
                "step": 7, "names": ["a", "b"]}, path, **kw)
    return path


# --------------------------------------------------------------------------- unit: torch files
def test_a_torch_save_file_reads_without_its_tensors(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    assert torch_file_problem(path) is None
    obj = read_torch_pickle(path)
    assert obj["step"] == 7 and obj["names"] == ["a", "b"]
    w, b = obj["w"], obj["b"]
    assert isinstance(w, TensorRef) and w.shape == (8, 8) and w.dtype == "float32" and w.storage.numel == 64
    assert b.dtype == "bfloat16" and b.shape == (3,)


def test_every_truncation_of_a_torch_file_is_found(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.pt"
    # every cut inside the last 300 bytes (the zip directory), every 7th before
    for size in sorted(set(range(0, len(data), 7)) | set(range(max(0, len(data) - 300), len(data)))):
        cut.write_bytes(data[:size])
        assert torch_file_problem(cut) is not None, f"cut to {size} of {len(data)} bytes passed"
    cut.write_bytes(data[:len(data) // 2])
    assert torch_file_problem(cut).startswith("truncated: the zip directory is unreadable")


def test_a_changed_byte_in_data_pkl_is_a_crc_mismatch_but_one_in_tensor_data_is_not_seen(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    start, end = _entry_span(path, "/data.pkl")
    _flip(path, (start + end) // 2)
    assert torch_file_problem(path) == "data.pkl: CRC mismatch (its bytes changed after torch.save wrote them)"
    with pytest.raises(CheckpointError, match="CRC mismatch") as err:
        read_torch_pickle(path)
    assert str(path) in str(err.value) and err.value.reason.startswith("data.pkl: CRC")
    path = _torch_file(tmp_path, "t2.pt")
    start, _ = _entry_span(path, "/data/0")
    _flip(path, start + 5)
    assert torch_file_problem(path) is None  # tensor bytes are never read: the hash manifest's job


def _rewrite(src: Path, dst: Path, change: dict[str, bytes | None]) -> None:
    """Copy a zip, replacing (bytes) or dropping (None) the entries ending with the keys of ``change``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            hit = next((k for k in change if info.filename.endswith(k)), None)
            if hit is None:
                zout.writestr(info.filename, zin.read(info))
            elif change[hit] is not None:
                zout.writestr(info.filename, change[hit])


def test_storages_must_match_the_entries_data_pkl_names(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    _rewrite(path, tmp_path / "nodata.pt", {"/data/1": None})
    assert torch_file_problem(tmp_path / "nodata.pt") == \
        "data.pkl refers to storage 1, but there is no entry data/1"
    _rewrite(path, tmp_path / "short.pt", {"/data/0": b"\0" * 100})
    assert torch_file_problem(tmp_path / "short.pt") == \
        "entry data/0 holds 100 bytes, but data.pkl expects 256 (64 x float32)"
    _rewrite(path, tmp_path / "nopkl.pt", {"/data.pkl": None})
    assert torch_file_problem(tmp_path / "nopkl.pt") == "no <archive>/data.pkl entry: not a torch.save file"
    _rewrite(path, tmp_path / "badpkl.pt", {"/data.pkl": b"\x80\x02}q\x00(X\x01"})
    assert torch_file_problem(tmp_path / "badpkl.pt").startswith("data.pkl: not a valid pickle (")


def test_an_entry_past_the_end_of_the_file_is_found(tmp_path: Path) -> None:
    path = _torch_file(tmp_path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        names = [i.filename for i in zf.infolist()]
    at = data.rfind(b"PK\x01\x02")  # the last entry's central-directory header
    assert data[at + 46: at + 46 + len(names[-1])] == names[-1].encode()
    struct.pack_into("<II", data, at + 20, 10**6, 10**6)  # compressed and uncompressed size of the last entry
    path.write_bytes(bytes(data))
    problem = torch_file_problem(path)
    assert problem is not None and f"entry {names[-1]} ends at byte" in problem and \
        f"past the end of the file ({len(data)} bytes)" in problem


def test_the_restricted_unpickler_imports_and_calls_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    plain = tmp_path / "evil.pkl"
    plain.write_bytes(pickle.dumps({"x": Evil()}))
    obj = read_torch_pickle(plain)
    assert isinstance(obj["x"], Opaque) and obj["x"].qualname == "system" and obj["x"].args == (f"touch {marker}",)
    zipped = tmp_path / "evil.pt"
    with zipfile.ZipFile(zipped, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps([Evil()], protocol=2))
        zf.writestr("evil/version", "3\n")
    assert torch_file_problem(zipped) is None
    assert isinstance(read_torch_pickle(zipped)[0], Opaque)
    assert not marker.exists()


def test_legacy_torch_files_and_plain_pickles(tmp_path: Path) -> None:
    legacy = _torch_file(tmp_path, "legacy.pt", _use_new_zipfile_serialization=False)
    assert torch_file_problem(legacy) is None
    assert read_torch_pickle(legacy)["w"].shape == (8, 8)
    data = legacy.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:-10])
    assert torch_file_problem(tmp_path / "cut.pt").startswith("truncated: storage ")
    (tmp_path / "long.pt").write_bytes(data + b"xx")
    assert torch_file_problem(tmp_path / "long.pt") == f"2 bytes after the last storage (ends at byte {len(data)})"
    (tmp_path / "p.pkl").write_bytes(pickle.dumps({"a": 1}))
    assert file_problem(tmp_path / "p.pkl") is None and read_torch_pickle(tmp_path / "p.pkl") == {"a": 1}
    (tmp_path / "junk.pt").write_bytes(b"hello world")
    assert torch_file_problem(tmp_path / "junk.pt").startswith("neither a zip-format torch file nor a readable pickle")
    (tmp_path / "empty.pt").write_bytes(b"")
    assert torch_file_problem(tmp_path / "empty.pt") == "empty (0 bytes)"
    assert torch_file_problem(tmp_path / "nope.pt") == "missing"
    with pytest.raises(CheckpointError, match="nope.pt: missing"):
        read_torch_pickle(tmp_path / "nope.pt")


def test_a_1gib_torch_file_is_checked_in_milliseconds(tmp_path: Path) -> None:
    """The check reads no tensor byte: a 1 GiB file (written sparse with torch's skip_data, so its
    tensor bytes are zeros that do not match their CRC) passes, in well under 50 ms."""
    import torch
    path = tmp_path / "big.pt"
    with torch.serialization.skip_data():
        torch.save({"w": torch.empty(2**28, dtype=torch.float32)}, path)
    assert path.stat().st_size > 2**30
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        assert torch_file_problem(path) is None
        best = min(best, time.perf_counter() - started)
    print(f"torch_file_problem on a {path.stat().st_size} byte file: {best * 1e3:.2f} ms")
    assert best < 0.05


# --------------------------------------------------------------------------- unit: other formats
def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]], extra: bytes = b"",
                 meta: dict | None = None) -> Path:
    """A .safetensors file: ``{name: (dtype, shape, nbytes)}`` laid out in order."""
    header, at = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    if meta is not None:
        header["__metadata__"] = meta
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\1" * at + extra)
    return path


def test_safetensors_structure(tmp_path: Path) -> None:
    good = _safetensors(tmp_path / "g.safetensors", {"a": ("F32", [2, 3], 24), "b": ("BF16", [4], 8)},
                        meta={"format": "pt"})
    assert safetensors_problem(good) is None and file_problem(good) is None
    data = good.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-1])
    assert safetensors_problem(tmp_path / "cut.safetensors") == \
        f"truncated: the tensors end at byte {len(data)}, the file has {len(data) - 1} bytes"
    (tmp_path / "long.safetensors").write_bytes(data + b"junk")
    assert safetensors_problem(tmp_path / "long.safetensors") == \
        f"4 bytes of trailing data after the last tensor (ends at byte {len(data)})"
    (tmp_path / "head.safetensors").write_bytes(data[:20])
    assert safetensors_problem(tmp_path / "head.safetensors").startswith("truncated or damaged: the header claims")
    bad = _safetensors(tmp_path / "b.safetensors", {"a": ("F32", [2, 3], 20)})
    assert safetensors_problem(bad) == "tensor 'a': 20 bytes for 6 x F32"
    hole = tmp_path / "h.safetensors"
    raw = json.dumps({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}).encode()
    hole.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    assert safetensors_problem(hole) == "tensor 'a' starts at data byte 2, expected 0 (overlap or hole)"
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}")
    assert safetensors_problem(tmp_path / "x.safetensors").startswith("the JSON header is unreadable")
    assert safetensors_problem(tmp_path / "none.safetensors") == "missing"


def test_safetensors_written_by_the_library(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    import torch
    path = tmp_path / "m.safetensors"
    st.save_file({"a": torch.ones(3, 5), "b": torch.zeros(7, dtype=torch.int64), "c": torch.ones(2, dtype=torch.bfloat16)},
                 str(path))
    assert safetensors_problem(path) is None
    _truncate(path, path.stat().st_size - 3)
    assert safetensors_problem(path).startswith("truncated: ")


def test_json_and_the_dispatch_by_name(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"a": 1}')
    (tmp_path / "b.json").write_text('{"a": ')
    (tmp_path / "c.json").write_text("")
    assert json_problem(tmp_path / "a.json") is None
    assert json_problem(tmp_path / "b.json").startswith("not valid JSON (")
    assert json_problem(tmp_path / "c.json") == "empty (0 bytes)"
    assert file_problem(tmp_path / "b.json").startswith("not valid JSON")
    assert file_problem(tmp_path / "d.json") == "missing"
    (tmp_path / "notes.txt").write_text("")
    assert file_problem(tmp_path / "notes.txt") is None and file_problem(tmp_path / "other.txt") == "missing"
    (tmp_path / "dir").mkdir()
    assert file_problem(f"{tmp_path / 'dir'}/") is None and file_problem(f"{tmp_path / 'nodir'}/") == "missing"
    (tmp_path / "w.bin").write_bytes(b"PK\x03\x04 truncated")
    assert file_problem(tmp_path / "w.bin").startswith("truncated: the zip directory is unreadable")


@pytest.mark.integration
def test_the_checks_import_no_torch() -> None:
    code = ("import sys; import orchestrator.checkpoints.headers, orchestrator.checkpoints.deepspeed_layout; "
            "bad = [m for m in ('torch', 'deepspeed', 'numpy') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- unit: layouts from headers
def _header(**kw) -> dict:
    h = {"module": {}, "optimizer": None, "param_shapes": [{}], "global_steps": 5, "dp_world_size": 2,
         "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
         "ds_config": {"zero_optimization": {"stage": 1}}, "ds_version": "0.19.8"}
    h.update(kw)
    return h


def test_required_files_per_configuration(tmp_path: Path) -> None:
    cfg3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "true"}}
    lay = layout_from_header(_header(dp_world_size=2, mp_world_size=2, ds_config=cfg3), tmp_path)
    assert (lay.zero_stage, lay.bf16, lay.optimizer_shards, lay.global_steps) == (3, True, True, 5)
    assert required_files(lay) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_model_states.pt", "zero_pp_rank_1_mp_rank_01_model_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    lay = layout_from_header(_header(mp_world_size=2, ds_config={}), tmp_path)
    assert required_files(lay) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    no_optimizer = layout_from_header(_header(param_shapes=None, ds_config={"zero_optimization": {"stage": 2}}), tmp_path)
    assert required_files(no_optimizer) == ["mp_rank_00_model_states.pt"]
    legacy = layout_from_header(_header(ds_config={"zero_optimization": True, "bfloat16": {"enabled": True}}), tmp_path)
    assert legacy.zero_stage == 1 and required_files(legacy)[1] == "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    nvme = layout_from_header(_header(ds_config={"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme"}}}), tmp_path)
    assert required_files(nvme)[-2:] == ["offloaded_tensors/rank00/", "offloaded_tensors/rank01/"]


def test_moe_and_pipeline_layouts_from_headers(tmp_path: Path) -> None:
    optimizer = {"param_groups": [{"name": "p"}, {"name": "ep_size_2", "moe": True}]}
    moe = layout_from_header(_header(ds_config={}, optimizer=optimizer, num_experts=[2, 2]), tmp_path)
    assert moe.moe and moe.expert_parallel_size == 2
    assert required_files(moe) == ["mp_rank_00_model_states.pt"] + [
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in (0, 1)] + [
        "expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"]
    stage0 = _header(module=None, mp_world_size=2, param_shapes=[{"0.weight": (1,), "2.bias": (1,)}],
                     checkpoint_parallel_dimensions={"pp_degree": 2, "tp_degree": 1})
    lay = layout_from_header(stage0, tmp_path)  # mp_rank_01 is absent: only stage 0's layers are known
    assert lay.pipeline and lay.pipeline_layers == ("layer_00-model_states.pt", "layer_02-model_states.pt")
    assert not lay.pipeline_parallel_write and not layout_from_header(_header(), tmp_path).pipeline_parallel_write


def test_pipeline_layer_files_written_in_parallel_name_their_writers(tmp_path: Path) -> None:
    """``checkpoint.parallel_write.pipeline_stage`` spreads a stage's layer files over its data-parallel ranks
    (``PipelineModule.save_state_dict``): a missing one names no single rank."""
    cfg = {"zero_optimization": {"stage": 1}, "checkpoint": {"parallel_write": {"pipeline_stage": True}}}
    header = _header(module=None, dp_world_size=1, mp_world_size=1, param_shapes=[{"0.weight": (1,)}], ds_config=cfg,
                     checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1})
    import torch
    torch.save(header, tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"s": 1}, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    layout, problems = tag_problems(tmp_path)
    assert layout.pipeline and layout.pipeline_parallel_write
    assert problems == ["layer_00-model_states.pt is missing (a pipeline layer's weights, written by one of its "
                        "stage's data-parallel ranks (checkpoint.parallel_write.pipeline_stage))"]


def test_headers_not_written_by_deepspeed(tmp_path: Path) -> None:
    for bad, match in (([1], "not DeepSpeed's dict"), ({"dp_world_size": 2}, "no ds_config"),
                       (_header(dp_world_size="2"), "dp_world_size is '2'"),
                       (_header(ds_config={"zero_optimization": {"stage": "x"}}), "stage 'x'")):
        with pytest.raises(CheckpointError, match=match):
            layout_from_header(bad, tmp_path)
    assert tag_problems(tmp_path / "absent") == (None, [f"{tmp_path / 'absent'} is not a directory"])
    (tmp_path / "t").mkdir()
    layout, problems = tag_problems(tmp_path / "t")
    assert layout is None and problems[0].startswith("neither mp_rank_00_model_states.pt nor zero_pp_rank_0")


def test_read_latest(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    (tmp_path / "latest").write_text("global_step40\n")
    assert read_latest(tmp_path) == "global_step40"
    (tmp_path / "latest").write_text("  ")
    assert read_latest(tmp_path) is None
    (tmp_path / "latest_universal").write_text("step_9_universal")
    assert read_latest(tmp_path, universal=True) == "step_9_universal"


# --------------------------------------------------------------------------- integration: real saves
@pytest.mark.integration
@pytest.mark.parametrize("name", list(SAVES))
def test_required_files_are_exactly_what_deepspeed_wrote(saves: dict[str, Path], name: str) -> None:
    root = saves[name]
    assert read_latest(root) == TAG
    layout, problems = tag_problems(root / TAG)
    assert problems == []
    assert isinstance(layout, DeepSpeedLayout)
    assert (layout.zero_stage, layout.bf16, layout.optimizer_shards, layout.pipeline, layout.moe_experts,
            layout.expert_parallel_size) == EXPECTED[name]
    assert layout.dp_world_size == (1 if layout.pipeline else 2) and layout.ds_version == "0.19.8"
    assert layout.global_steps == (0 if name.startswith("moe") else 1)
    assert sorted(required_files(layout)) == sorted(os.listdir(root / TAG))
    outside = set(os.listdir(root)) - {TAG, "latest"}  # not per tag: the recovery scripts of ZeRO saves
    assert outside <= {"zero_to_fp32.py", "zero_to_torch.py"}


@pytest.mark.integration
def test_headers_read_like_torch_load(saves: dict[str, Path]) -> None:
    import torch
    for name in ("zero0", "zero3", "bf16_zero1"):
        path = next((saves[name] / TAG).glob("*model_states.pt"))
        real = torch.load(path, map_location="cpu", weights_only=False)
        mine = read_torch_pickle(path)
        assert set(mine) == set(real) and mine["ds_config"] == real["ds_config"]
        for key, tensor in real["module"].items():
            assert mine["module"][key].shape == tuple(tensor.shape), (name, key)
            assert mine["module"][key].dtype == str(tensor.dtype).removeprefix("torch."), (name, key)


@pytest.mark.integration
def test_a_truncated_shard_is_named(saves: dict[str, Path], tmp_path: Path) -> None:
    tag = _copy_tag(saves, "zero2", tmp_path)
    shard = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    for size in (shard.stat().st_size // 2, shard.stat().st_size - 1):
        _truncate(shard, size)
        layout, problems = tag_problems(tag)
        assert layout is not None and problems == [
            ("zero_pp_rank_1_mp_rank_00_optim_states.pt: truncated: the zip directory is unreadable "
             "(File is not a zip file)")]


@pytest.mark.integration
def test_a_missing_rank_file_is_named(saves: dict[str, Path], tmp_path: Path) -> None:
    tag = _copy_tag(saves, "zero1", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert tag_problems(tag)[1] == [
        "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing (written by data-parallel rank 1)"]
    tag = _copy_tag(saves, "zero3", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert tag_problems(tag)[1] == [
        "zero_pp_rank_1_mp_rank_00_model_states.pt is missing (written by data-parallel rank 1)"]
    tag = _copy_tag(saves, "bf16_zero2", tmp_path)
    (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert tag_problems(tag)[1] == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt is missing (written by data-parallel rank 0)"]


@pytest.mark.integration
def test_missing_moe_and_pipeline_files_are_named(saves: dict[str, Path], tmp_path: Path) -> None:
    tag = _copy_tag(saves, "moe_zero0", tmp_path)
    (tag / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    (tag / "expp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert tag_problems(tag)[1] == [
        "layer_0_expert_3_mp_rank_00_model_states.pt is missing (expert 3 of MoE layer 0)",
        "expp_rank_1_mp_rank_00_optim_states.pt is missing (written by expert-parallel rank 1)"]
    tag = _copy_tag(saves, "pipe_zero1", tmp_path)
    (tag / "layer_02-model_states.pt").unlink()  # a layer with parameters: named by stage 1's param_shapes
    (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    assert tag_problems(tag)[1] == [
        ("zero_pp_rank_0_mp_rank_01_optim_states.pt is missing (written by data-parallel rank 0 of model-parallel "
         "rank 1)"),
        ("layer_02-model_states.pt is missing (a pipeline layer's weights, written by data-parallel rank 0 of its "
         "stage)")]


@pytest.mark.integration
def test_changed_bytes_in_data_pkl_are_found_and_in_tensor_data_are_not(saves: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    tag = _copy_tag(saves, "zero2", tmp_path)
    shard = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    start, end = _entry_span(shard, "/data.pkl")
    _flip(shard, (start + end) // 2)
    assert tag_problems(tag)[1] == [
        ("zero_pp_rank_1_mp_rank_00_optim_states.pt: data.pkl: CRC mismatch (its bytes changed after torch.save "
         "wrote them)")]
    tag = _copy_tag(saves, "zero1", tmp_path / "2")
    shard = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    start, end = _entry_span(shard, "/data/0")
    _flip(shard, start)
    assert tag_problems(tag)[1] == []  # tensor bytes: only a hash manifest finds this


@pytest.mark.integration
def test_a_damaged_model_states_header_leaves_no_layout(saves: dict[str, Path], tmp_path: Path) -> None:
    tag = _copy_tag(saves, "zero1", tmp_path)
    header = tag / "mp_rank_00_model_states.pt"
    _truncate(header, 100)
    assert tag_problems(tag) == (None, [
        "mp_rank_00_model_states.pt: truncated: the zip directory is unreadable (File is not a zip file)"])
    header.unlink()
    layout, problems = tag_problems(tag)
    assert layout is None and problems[0].startswith("neither mp_rank_00_model_states.pt nor")


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--save":
    _save_main(sys.argv[2], sys.argv[3:])
