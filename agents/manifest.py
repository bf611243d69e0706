"""Checkpoint manifests: every checkpoint file's size, mtime and content hash, taken on the node that
sees it, so that a resume can tell a checkpoint damaged since its save from one left as it was.

The agent of every node watches the job's checkpoint directory (:class:`CheckpointWatch`) while its
ranks run: a file written during the attempt that has kept its size and mtime for one whole poll is
hashed once and sent to the controller (message ``checkpoint_files``), which keeps it in the store; a
file whose size or mtime changes later (a tag saved again) is hashed again. Files already there when
the attempt starts are left as they are: their manifest is the one recorded when they were saved, so a
file damaged between attempts is found, not recorded anew. Each node hashes the files its own ranks wrote
(the rank in the file name: ``zero_pp_rank_3_...``, ``rng_state_3.pth``, ``random_states_3.pkl``) and
node 0 the rest, so node-local disks are covered and shared storage is read once.

Hashes are xxHash's XXH3-128 (the ``xxhash`` package): 14-28 GB/s on one core here, so hashing is
bounded by reading the file (``bench/manifest_cost.py``). ``full`` hashes every byte; ``sampled`` hashes the size and
:data:`SAMPLE_BLOCKS` blocks of :data:`BLOCK` bytes spread evenly over the file (first and last
included), which finds a truncated, extended or rewritten file and most partial overwrites, but not
a change that falls between the blocks; ``auto`` is ``full`` up to a size and ``sampled`` above it.
Nothing here writes to a checkpoint directory.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import xxhash

__all__ = ["FileRecord", "hash_file", "owner_rank", "CheckpointWatch", "BLOCK", "SAMPLE_BLOCKS", "MODES"]

#: The block size read at a time, and the size of each sampled block.
BLOCK = 1 << 20
#: How many blocks ``sampled`` hashes (so at most 16 MiB of any file is read).
SAMPLE_BLOCKS = 16
#: Hash modes as recorded (``auto`` resolves to one of the first two per file).
MODES = ("full", "sampled", "off", "auto")
#: A file's writer rank from its name: DeepSpeed's ``zero_pp_rank_<r>_mp_rank_..`` (data-parallel
#: rank), HF Trainer's ``rng_state_<r>.pth``, Accelerate's ``random_states_<r>.pkl``, orch's
#: ``orch_rank_<r>.pt``. DeepSpeed's ``mp_rank_<m>_model_states.pt`` is written by rank 0 (one
#: model-parallel group here).
RANK_PATTERNS = (re.compile(r"zero_pp_rank_(\d+)_"), re.compile(r"^rng_state_(\d+)\.pth$"),
                 re.compile(r"^random_states_(\d+)\.pkl$"), re.compile(r"^orch_rank_(\d+)\.pt$"))


@dataclass(frozen=True)
class FileRecord:
    """One file as hashed.

    Attributes:
        name: its path relative to the tag directory (``/``-separated).
        size: bytes.
        mtime_ns: its modification time, nanoseconds since the epoch.
        hash: ``"xxh3-128:<hex>"`` or None (mode ``off``).
        mode: ``full``, ``sampled`` or ``off`` (never ``auto``).
    """

    name: str
    size: int
    mtime_ns: int
    hash: str | None
    mode: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the ``checkpoint_files`` message's entries)."""
        return {"name": self.name, "size": self.size, "mtime_ns": self.mtime_ns, "hash": self.hash, "mode": self.mode}


def resolve_mode(mode: str, size: int, sample_above: int) -> str:
    """``auto`` -> ``full`` for files of at most ``sample_above`` bytes, else ``sampled``; others as given."""
    if mode == "auto":
        return "full" if size <= sample_above else "sampled"
    return mode


def _sample_offsets(size: int) -> list[int]:
    if size <= BLOCK * SAMPLE_BLOCKS:
        return list(range(0, size, BLOCK))
    last = size - BLOCK
    return sorted({round(i * last / (SAMPLE_BLOCKS - 1)) for i in range(SAMPLE_BLOCKS)})


def hash_file(path: str, name: str, mode: str = "auto", sample_above: int = 1 << 30) -> FileRecord:
    """Hash one file.

    Args:
        path: the file.
        name: what to call it in the record (relative to its tag directory).
        mode: ``full``, ``sampled``, ``off`` or ``auto`` (see the module docstring).
        sample_above: bytes above which ``auto`` samples.

    Returns:
        The record; its ``mode`` is the one used. The size and mtime are those before reading.

    Raises:
        OSError: the file cannot be read.
    """
    st = os.stat(path)
    used = resolve_mode(mode, st.st_size, sample_above)
    if used == "off":
        return FileRecord(name, st.st_size, st.st_mtime_ns, None, "off")
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        if used == "full":
            buf = bytearray(BLOCK * 8)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
        else:
            h.update(st.st_size.to_bytes(8, "little"))
            for offset in _sample_offsets(st.st_size):
                f.seek(offset)
                h.update(offset.to_bytes(8, "little"))
                h.update(f.read(BLOCK))
    return FileRecord(name, st.st_size, st.st_mtime_ns, f"xxh3-128:{h.hexdigest()}", used)


def owner_rank(name: str) -> int | None:
    """The global rank that wrote a checkpoint file, by its name (:data:`RANK_PATTERNS`), or None
    (a file of rank 0, or of nobody in particular)."""
    base = name.rsplit("/", 1)[-1]
    for pattern in RANK_PATTERNS:
        m = pattern.search(base)
        if m:
            return int(m.group(1))
    return None


def _walk(tag_dir: str) -> Iterable[tuple[str, str]]:
    """``(path, name relative to tag_dir)`` of every regular file under ``tag_dir`` (not a link, a FIFO or a
    device); hidden entries and temporary files (``*.tmp``) left out."""
    for top, dirs, files in os.walk(tag_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(files):
            if f.startswith(".") or f.endswith(".tmp"):
                continue
            path = os.path.join(top, f)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would block the read forever
                    continue
            except OSError:
                continue
            yield path, os.path.relpath(path, tag_dir).replace(os.sep, "/")


class CheckpointWatch:
    """Watches a checkpoint directory on one node and reports the files of its tags, hashed.

    Args:
        watch: the node plan's ``checkpoint_watch``: ``{"dir": str, "tag_pattern": regex a tag
            directory's name matches, "hash": mode, "sample_above": bytes, "interval_s": float,
            "world_size": int}``.
        ranks: the global ranks of this node.
        node_rank: this node's rank (node 0 also hashes files no rank of the world owns).
        send: called with each ``checkpoint_files`` message; returns False once the link is gone.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, watch: dict[str, Any], ranks: Iterable[int], node_rank: int,
                 send: Callable[[dict], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.root = watch["dir"]
        self.tag_re = re.compile(watch.get("tag_pattern") or r"[^.].*")
        self.mode = watch.get("hash", "auto")
        self.sample_above = int(watch.get("sample_above", 1 << 30))
        self.interval = float(watch.get("interval_s", 5.0))
        self.world = int(watch.get("world_size", 0))
        self.ranks = set(ranks)
        self.node_rank = node_rank
        self.send = send
        self.clock = clock
        self._seen: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns) at the last poll
        self._recorded: dict[str, tuple[int, int]] = self._stat_all()  # path -> (size, mtime_ns) when hashed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    def _stat_all(self) -> dict[str, tuple[int, int]]:
        """What is there before the ranks start: files an earlier attempt saved (recorded then) or that
        changed while no attempt ran (damage, to be found at the next resume). Neither is recorded now;
        only what this attempt's ranks write is."""
        out = {}
        for _tag, path, _name in self._candidates():
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_size, st.st_mtime_ns)
        return out

    def mine(self, name: str) -> bool:
        """Whether this node hashes the file ``name``."""
        rank = owner_rank(name)
        if rank is None or not 0 <= rank < max(self.world, 1):
            return self.node_rank == 0
        return rank in self.ranks

    def start(self) -> None:
        """Poll every ``interval_s`` on a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="checkpoint-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def stop(self, final_deadline_s: float = 5.0) -> None:
        """Stop polling, then hash what is left (the ranks have stopped: every file is settled), until
        ``final_deadline_s`` seconds from now (a file begun by then is finished)."""
        start = self.clock()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=final_deadline_s)
            if self._thread.is_alive():  # still hashing a large file: no second poll beside it
                return
        self.poll(settled=True, deadline=start + final_deadline_s)

    def poll(self, settled: bool = False, deadline: float | None = None) -> int:
        """One look: hash files that kept their size and mtime since the last look (every unrecorded file
        when ``settled``), send them. Returns how many were sent."""
        batch: list[dict] = []
        for tag, path, name in self._candidates():
            try:
                st = os.stat(path)
            except OSError:
                continue
            now = (st.st_size, st.st_mtime_ns)
            before, self._seen[path] = self._seen.get(path), now
            if self._recorded.get(path) == now or (not settled and before != now):
                continue
            if deadline is not None and self.clock() > deadline:
                break
            try:
                record = hash_file(path, name, self.mode, self.sample_above)
            except OSError as err:
                self.errors.append(f"{path}: {err.strerror or err}")
                continue
            if (record.size, record.mtime_ns) != now:  # changed while hashed: next time
                continue
            self._recorded[path] = now
            batch.append({"tag": tag, **record.to_dict()})
        for i in range(0, len(batch), 200):
            self.send({"type": "checkpoint_files", "dir": self.root, "node_rank": self.node_rank,
                       "files": batch[i:i + 200]})
        return len(batch)

    def _candidates(self) -> Iterable[tuple[str, str, str]]:
        try:
            tags = sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))
        except OSError:
            return
        for tag in tags:
            if tag.startswith(".") or tag.endswith("_universal") or not self.tag_re.fullmatch(tag):
                continue
            for path, name in _walk(os.path.join(self.root, tag)):
                if self.mine(name):
                    yield tag, path, name
