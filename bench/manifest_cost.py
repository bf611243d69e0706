"""What the checkpoint manifest costs per GiB of checkpoint, per hash mode, against a plain read.

A checkpoint-like tag directory of real ``torch.save`` files (``--size-gib`` in all, files of
``--file-mib`` of float32 tensors, 8 tensors a file) is written under ``--dir`` and deleted at the end.
Each of these passes over every file of it is timed, ``--runs`` times, in rotating order:

* ``read``: a plain sequential read into one preallocated 8 MiB buffer (``cat``-like: the
  disk / page-cache limit, the baseline every ratio is against);
* ``full``, ``sampled``, ``off``: ``agents.manifest.hash_file`` in that mode (what an agent pays
  when it records a file and what the controller pays again in ``integrity.verify`` before a resume);
* ``crc``: ``orchestrator.checkpoints.integrity.crc_problems`` (every zip entry's CRC-32, the check
  of a tag with no manifest);
* ``torch.load``: ``torch.load(map_location="cpu", weights_only=True)`` of each file (what the
  resumed ranks pay anyway).

Twice: ``warm`` (every page of the files in the page cache, checked with mincore(2)) and ``cold``
(before each pass every file is fsync'ed and dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``;
the residency after the drop is checked with mincore(2), and the cold read is compared with the warm
one: a cold read no slower than a warm one means the drop did not reach the disk, and the table says
so). Median seconds per GiB of checkpoint, and each as a ratio to ``read`` in the same state.

Then one ``--single-gib`` file (1 GiB by default, the default ``resume.sample_above_mib``): seconds for
``hash_file(..., "full")`` vs ``"sampled"`` on it, warm and cold.

    .venv/bin/python bench/manifest_cost.py                     # 2 GiB in 4 files of 512 MiB, 3 runs
    .venv/bin/python bench/manifest_cost.py --size-gib 4 --file-mib 512 --output json

Measured 2026-12-01 (2 cores AMD EPYC, 24 GiB RAM, ext4 on a virtio disk; Python 3.11, xxhash 4.1.0,
torch 2.13 CPU), ``.venv/bin/python bench/manifest_cost.py --size-gib 4 --runs 5`` (8 files x 512 MiB),
medians, seconds per GiB of checkpoint and x the plain read in the same state:

    | method     | warm s/GiB | warm x read | cold s/GiB | cold x read |
    |------------|------------|-------------|------------|-------------|
    | read       | 0.0374     | 1.00        | 0.495      | 1.00        |
    | full       | 0.0495     | 1.32        | 0.537      | 1.09        |
    | sampled    | 0.0017     | 0.05        | 0.049      | 0.10        |
    | off        | 0.00001    | 0.00        | 0.00001    | 0.00        |
    | crc        | 0.205      | 5.48        | 0.810      | 1.64        |
    | torch.load | 0.551      | 14.7        | 1.072      | 2.17        |

    checksums alone, in memory: XXH3-128 29.9 GiB/s, CRC-32 6.24 GiB/s (14.1 and 3.06 on a busier run)
    cold: cold read 13.2x the warm read; 0.0 % of pages resident after each drop (the drop works here)
    one 1 GiB file: warm read 0.035 s, full 0.056 s, sampled 0.9 ms; cold read 0.50 s, full 0.41 s,
    sampled 22 ms

Warm runs agree within ~10 %; cold runs of one method differ by up to 2x (the virtio disk), so read the
cold ratios as +-30 %. A full hash costs 1.3 warm reads (``hash_file`` reads into one reused 8 MiB
buffer; with a fresh ``bytes`` per read it was 1.9x) and about one cold read; it is 0.09x what
``torch.load`` of the same files costs warm and 0.5x cold. ``crc`` is slower than a full hash (CRC-32
is slower than XXH3, and ``zipfile`` reads 1 MiB at a time). ``sampled`` reads 16 MiB a file: its s/GiB
falls with the file size (a 64 MiB file is a quarter read).

Why ``sample_above_mib`` is 1024. A full hash costs the same per GiB whatever the file size (it is a
read, see ``full`` above), so the threshold does not bound the total cost of a checkpoint (a tag of
many files of up to 1 GiB is hashed in full, at ``full`` s/GiB, by its agents and again by the
controller before a resume); it bounds the time of one file, and that is what has a deadline. When an
attempt ends the agent hashes what its ranks left for at most 2 s (``agents.agent._stop_watch``), and a
file begun by then is finished; the controller drops a stopping agent ``STOP_SLACK_S`` = 5 s after the
grace period (``orchestrator.supervision.teardown``). So one full hash must fit in the ~3 s between, on
cold storage. Here a 1 GiB file takes 0.42 s cold (7x margin); on shared storage at 0.5 GB/s per
stream (a network file system, a busy disk) it takes ~2.1 s, still inside; a 2 GiB file there
(~4.3 s) would not. 1 GiB is the largest power of two that fits 3 s at 0.5 GB/s. Above it, ``sampled``
costs ~20 ms a file cold (1.2 ms warm) whatever its size.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

from agents.manifest import hash_file
from orchestrator.checkpoints.integrity import crc_problems
from orchestrator.checkpoints.tags import CheckpointInfo

GIB = 1 << 30
MIB = 1 << 20
READ_BUF = 8 * MIB  # the size of hash_file's own reads in mode full
METHODS = ("read", "full", "sampled", "off", "crc", "torch.load")
TENSORS_PER_FILE = 8


# -- the files ---------------------------------------------------------------------------------------

def write_checkpoint(tag_dir: Path, total: int, file_size: int) -> list[Path]:
    """``torch.save`` files of float32 tensors adding up to about ``total`` bytes; fsync'ed (so that a
    cache drop can drop them: only clean pages go)."""
    tag_dir.mkdir(parents=True)
    paths = []
    gen = torch.Generator().manual_seed(0)
    n_files = max(1, round(total / file_size))
    for i in range(n_files):
        paths.append(save_file(tag_dir / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt", file_size, gen))
    return paths


def save_file(path: Path, size: int, gen: torch.Generator) -> Path:
    numel = size // 4 // TENSORS_PER_FILE
    state = {f"t{k}": torch.empty(numel, dtype=torch.float32).uniform_(generator=gen) for k in range(TENSORS_PER_FILE)}
    torch.save(state, path)
    del state
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


# -- the page cache ----------------------------------------------------------------------------------

try:  # mincore(2) through libc, to check what is in the page cache (Linux; None elsewhere)
    _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
except (OSError, AttributeError, TypeError):
    _libc = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident(paths: list[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (mincore(2)), or None where it cannot be asked."""
    page = mmap.PAGESIZE
    total = present = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            if _libc is None:
                return None
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                return None
            try:
                pages = (size + page - 1) // page
                vec = ctypes.create_string_buffer(pages)
                if _libc.mincore(addr, size, vec) != 0:
                    return None
                present += sum(b & 1 for b in vec.raw)
                total += pages
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return present / total if total else None


def drop(paths: list[Path]) -> None:
    """fsync each file, then ask the kernel to drop its pages (``POSIX_FADV_DONTNEED``)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the passes --------------------------------------------------------------------------------------

def plain_read(paths: list[Path]) -> None:
    buf = bytearray(READ_BUF)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def hashing(mode: str) -> Callable[[list[Path]], None]:
    def run(paths: list[Path]) -> None:
        for path in paths:
            hash_file(str(path), path.name, mode)
    return run


def crc(paths: list[Path]) -> None:
    tag_dir = paths[0].parent
    problems = crc_problems(CheckpointInfo(tag=tag_dir.name, path=str(tag_dir)))
    if problems:
        raise SystemExit(f"crc_problems found damage in a fresh checkpoint: {problems}")


def load(paths: list[Path]) -> None:
    for path in paths:
        state = torch.load(path, map_location="cpu", weights_only=True)
        del state


PASSES: dict[str, Callable[[list[Path]], None]] = {
    "read": plain_read, "full": hashing("full"), "sampled": hashing("sampled"), "off": hashing("off"),
    "crc": crc, "torch.load": load,
}


def measure(paths: list[Path], methods: tuple[str, ...], runs: int, cold: bool) -> dict:
    """``{method: [seconds of each run]}`` plus residency figures, methods in rotating order per run."""
    times: dict[str, list[float]] = {m: [] for m in methods}
    after_drop: list[float] = []
    if not cold:
        plain_read(paths)  # warm every page
    for r in range(runs):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            if cold:
                drop(paths)
                frac = resident(paths)
                if frac is not None:
                    after_drop.append(frac)
            t0 = time.perf_counter()
            PASSES[m](paths)
            times[m].append(time.perf_counter() - t0)
    out = {"times": times, "resident_before": resident(paths) if not cold else None}
    if cold:
        out["resident_after_drop_max"] = max(after_drop) if after_drop else None
    return out


def compute_rates(reps: int = 8) -> dict[str, float]:
    """GiB/s of the checksums alone on a 64 MiB buffer in memory (no file): XXH3-128 (``full``) and zlib's
    CRC-32 (what ``zipfile`` checks); the part of each pass that is not reading."""
    import zlib

    import xxhash
    buf = os.urandom(64 * MIB)
    out = {}
    for name, fn in (("xxh3_128", lambda: xxhash.xxh3_128(buf).digest()), ("crc32", lambda: zlib.crc32(buf))):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = reps * len(buf) / GIB / (time.perf_counter() - t0)
    return out


def summarize(times: dict[str, list[float]], nbytes: int) -> dict[str, dict[str, float]]:
    gib = nbytes / GIB
    med = {m: statistics.median(t) for m, t in times.items()}
    base = med.get("read")
    return {m: {"seconds": med[m], "s_per_gib": med[m] / gib,
                "gib_per_s": (gib / med[m]) if med[m] > 0 else float("inf"),
                "x_read": (med[m] / base) if base else float("nan"),
                "runs": times[m]} for m in times}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size in all (default 2)")
    p.add_argument("--file-mib", type=float, default=512.0, help="size of each file (default 512)")
    p.add_argument("--single-gib", type=float, default=1.0, help="size of the one file hashed full vs sampled "
                   "(default 1, the default resume.sample_above_mib); 0 leaves it out")
    p.add_argument("--runs", type=int, default=3, help="runs per method and state; medians (default 3)")
    p.add_argument("--dir", default="/tmp", help="where the temporary checkpoint is written (default /tmp)")
    p.add_argument("--no-cold", action="store_true", help="warm page cache only")
    p.add_argument("--output", choices=("table", "json"), default="table")
    args = p.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.output == "json" else \
        (lambda *a: print(*a, flush=True))

    work = Path(tempfile.mkdtemp(prefix="orch-bench-manifest-", dir=args.dir))
    result: dict = {"date": time.strftime("%Y-%m-%d"), "dir": str(work), "runs": args.runs,
                    "torch": torch.__version__, "cpus": os.cpu_count()}
    try:
        result["compute_gib_per_s"] = compute_rates()
        t0 = time.perf_counter()
        paths = write_checkpoint(work / "global_step100", int(args.size_gib * GIB), int(args.file_mib * MIB))
        nbytes = sum(os.path.getsize(x) for x in paths)
        result["checkpoint"] = {"files": len(paths), "bytes": nbytes, "gib": nbytes / GIB,
                                "file_bytes": os.path.getsize(paths[0])}
        say(f"wrote {len(paths)} files, {nbytes / GIB:.2f} GiB under {work} in {time.perf_counter() - t0:.1f} s")
        can_drop = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
        if not can_drop and not args.no_cold:
            say("no posix_fadvise here: warm page cache only")
        states = ("warm",) if args.no_cold or not can_drop else ("warm", "cold")
        for state in states:
            say(f"{state}: {args.runs} runs of {', '.join(METHODS)} ...")
            got = measure(paths, METHODS, args.runs, cold=state == "cold")
            result[state] = {"methods": summarize(got["times"], nbytes),
                             "resident_before": got["resident_before"],
                             "resident_after_drop_max": got.get("resident_after_drop_max")}
        if "cold" in result:
            w, c = result["warm"]["methods"]["read"]["s_per_gib"], result["cold"]["methods"]["read"]["s_per_gib"]
            frac = result["cold"]["resident_after_drop_max"]
            effective = c > 1.3 * w and (frac is None or frac < 0.05)
            result["cold"]["drop_effective"] = effective
            result["cold"]["note"] = (
                f"cold read {c / w:.2f}x the warm read; at most {100 * frac:.1f} % of pages resident after a drop"
                if frac is not None else f"cold read {c / w:.2f}x the warm read (mincore unavailable)")
            if not effective:
                result["cold"]["note"] += ": the drop had no (clear) effect, cold figures are not disk figures"
        if args.single_gib > 0:
            (work / "single").mkdir()
            single = save_file(work / "single" / "mp_rank_00_model_states.pt", int(args.single_gib * GIB),
                               torch.Generator().manual_seed(1))
            size = os.path.getsize(single)
            say(f"one file of {size / GIB:.2f} GiB: full vs sampled ...")
            one: dict = {"bytes": size}
            for state in states:
                got = measure([single], ("read", "full", "sampled"), args.runs, cold=state == "cold")
                one[state] = {m: statistics.median(t) for m, t in got["times"].items()}
                one[state]["runs"] = got["times"]
            result["single_file"] = one
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if args.output == "json":
        print(json.dumps(result, indent=2))
        return 0
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    ck = result["checkpoint"]
    print(f"\n{ck['files']} torch.save files x {ck['file_bytes'] / MIB:.0f} MiB = {ck['gib']:.2f} GiB, "
          f"median of {result['runs']} runs")
    states = [s for s in ("warm", "cold") if s in result]
    head = "| method | " + " | ".join(f"{s} s/GiB | {s} GiB/s | {s} x read" for s in states) + " |"
    print(head)
    print("|" + "---|" * (1 + 3 * len(states)))
    for m in METHODS:
        cells = []
        for s in states:
            r = result[s]["methods"][m]
            cells += [f"{r['s_per_gib']:.4f}", f"{r['gib_per_s']:.2f}" if r['gib_per_s'] < 1e4 else "-",
                      f"{r['x_read']:.3f}"]
        print(f"| {m} | " + " | ".join(cells) + " |")
    rates = result["compute_gib_per_s"]
    print(f"checksums alone, in memory: XXH3-128 {rates['xxh3_128']:.1f} GiB/s, CRC-32 {rates['crc32']:.2f} GiB/s")
    if "warm" in result:
        print(f"warm: {100 * (result['warm']['resident_before'] or 0):.1f} % of pages resident")
    if "cold" in result:
        print(f"cold: {result['cold']['note']}")
    one = result.get("single_file")
    if one:
        print(f"\none file of {one['bytes'] / GIB:.2f} GiB, seconds (median):")
        for s in states:
            d = one[s]
            print(f"  {s}: read {d['read']:.3f} s, hash_file full {d['full']:.3f} s, "
                  f"sampled {d['sampled'] * 1000:.2f} ms (full / sampled = {d['full'] / d['sampled']:.0f}x)")


if __name__ == "__main__":
    sys.exit(main())
