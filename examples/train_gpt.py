#!/usr/bin/env python
"""A small byte-level GPT trained with DeepSpeed ZeRO, following orch's contract.

The training text is the source of the CPython standard library on this machine
(``sysconfig.get_paths()["stdlib"]``, ``*.py`` files in sorted order, capped by
``--corpus-bytes``), read as raw bytes (vocabulary of 256).

Started by DeepSpeed's per-node launcher, e.g. for node ``k`` of two::

    DS_ACCELERATOR=cpu ORCH_CHECKPOINT_DIR=/tmp/ckpt ORCH_DEEPSPEED_CONFIG=examples/ds_zero2.json \\
    python -m deepspeed.launcher.launch --world_info=<base64 json> --node_rank=k \\
        --master_addr=127.0.0.1 --master_port=29500 examples/train_gpt.py --steps 200

Quickstart (2 nodes x 2 ranks on one machine, ZeRO-2; ~2 min on 2 shared cores, loss 5.54 -> ~2.1)::

    python tests/helpers_train.py --nodes 2 --slots 2 --config examples/ds_zero2.json \
        --ckpt /tmp/qs/ckpt -- --steps 300 --checkpoint-interval 100 --eval-interval 100 --eval-batches 8

Model defaults (3 layers, d_model 96, 4 heads, seq_len 128, dropout 0.1; ~0.4M parameters) are the
quickstart's; configs: ``examples/ds_zero{0,1,2,3}.json``, ``examples/ds_zero2_offload.json``.

Everything the orchestrator relies on is documented in ``docs/contract.md``:

* config: ``--deepspeed_config`` or else ``$ORCH_DEEPSPEED_CONFIG`` (ZeRO stage, micro batch,
  gradient accumulation, optimizer and LR schedule all come from it);
* checkpoints: every ``--checkpoint-interval`` steps into ``$ORCH_CHECKPOINT_DIR`` (or
  ``--checkpoint-dir``) with tag ``step_<N>``: ``engine.save_checkpoint``, then one
  ``orch_rank_<global rank>.pt`` per rank (its data generator and RNG states), a barrier,
  and last the completion marker ``orch_checkpoint.json`` written by global rank 0;
* consolidated model: with ``--save-16bit-model`` (default: the config's
  ``zero_optimization.stage3_gather_16bit_weights_on_model_save``) the final tag also gets
  ``pytorch_model.bin`` from ``engine.save_16bit_model``, loadable into ``ByteGPT`` as it is;
* resume: ``$ORCH_RESUME_TAG`` (or ``--resume-tag``) loads that tag and continues at the
  next step; with the same world size the losses of every rank at every later step equal
  those of an uninterrupted run (bit-exact on CPU/fp32).
* resume on another world size: when ``$ORCH_RESUME_UNIVERSAL=1`` (or ``--resume-universal``, or
  the tag directory holds ``orch_universal.json``), the tag is a DeepSpeed *universal* checkpoint
  (``deepspeed.checkpoint.ds_to_universal``, run by orch) and is loaded with
  ``"checkpoint": {"load_universal": true}`` (set here too if the config lacks it).
  Exact after a world-size change: the fp32 weights, Adam's moments and step counts, the LR
  scheduler and ``global_steps`` (training continues at the saved step + 1). Not exact, by
  design: the per-rank files (data position, RNG states) belonged to ranks that no longer
  exist, so the data is re-sharded over the new data-parallel ranks and every rank's sampler
  and RNGs are reseeded from (seed, global rank, step); the batches and dropout masks differ
  from an uninterrupted run, and the global batch is ``micro x grad_accum x new dp size``. The
  loss continues from where it was (statistically, not bit for bit).

Per-step log line on every rank (machine-parseable; floats are ``repr``, i.e. exact)::

    [train] step=12 rank=1 loss=5.123456789012 lr=0.001 samples_per_s=... tokens_per_s=... step_s=...

Only ``[train]`` lines carry ``step=``/``loss=`` tokens (orch reads a rank's progress from the
last such line). Other line kinds: ``[setup]``, ``[ckpt]``, ``[resume]``, ``[eval]`` (``eval_loss=``),
``[summary]`` (rank 0 only, human-readable), ``[done]``; they say ``global_step=`` instead.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import sysconfig
import time
from pathlib import Path

if __name__ == "__main__":
    # Threads: several ranks share the CPU; one intra-op thread per rank unless told otherwise.
    # Set before torch is imported so OpenMP sees it too (main() also calls set_num_threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import warnings

try:  # orch's one-call metrics helper (docs/metrics.md); the script also runs without orch installed
    from agents import report as orch_report
except ImportError:
    orch_report = None

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

RANK_FILE_FMT = "orch_rank_{rank}.pt"
MARKER = "orch_checkpoint.json"
UNIVERSAL_MARKER = "orch_universal.json"  # written by orch after ds_to_universal (orchestrator/checkpoints/tags.py)
RANK_STATE_FORMAT = 1
MARKER_FORMAT = 1
MODEL_16BIT = "pytorch_model.bin"  # engine.save_16bit_model's default name, in the final tag's directory


def out(line: str) -> None:
    """Write one whole line with a single write() so ranks sharing a pipe do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (global_step) to train to")
    p.add_argument("--checkpoint-interval", type=int, default=0,
                   help="save a checkpoint every N steps (0: never, except --save-final)")
    p.add_argument("--save-final", action=argparse.BooleanOptionalAction, default=False,
                   help="also save a checkpoint after the last step")
    p.add_argument("--save-16bit-model", action=argparse.BooleanOptionalAction, default=None,
                   help="after the last step, also save the consolidated model (engine.save_16bit_model) as "
                   f"<checkpoint dir>/step_<N>/{MODEL_16BIT}; implies --save-final. Default: on when the config "
                   "has zero_optimization.stage3_gather_16bit_weights_on_model_save (ZeRO-3 needs it)")
    p.add_argument("--checkpoint-dir", default=None, help="default: $ORCH_CHECKPOINT_DIR")
    p.add_argument("--resume-tag", default=None, help="default: $ORCH_RESUME_TAG")
    p.add_argument("--resume-universal", action="store_true",
                   help="the resume tag is a universal checkpoint (default: $ORCH_RESUME_UNIVERSAL=1, or the tag "
                   f"holds {UNIVERSAL_MARKER})")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="exit (status 0) after this step, as if interrupted; the run is meant to be "
                   "resumed to --steps (LR schedules etc. still see --steps)")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="fail on purpose (an exception on --fail-rank) after this step, on the job's first "
                   "attempt only ($ORCH_ATTEMPT unset or 1), to show failure handling and resume")
    p.add_argument("--fail-rank", type=int, default=0, help="the global rank that fails with --fail-at-step")
    p.add_argument("--hang-at-step", type=int, default=None,
                   help="hang on purpose (sleep forever before the next step's collectives, on --hang-rank) after "
                        "this step, on the job's first attempt only: the other ranks block in their next all-reduce")
    p.add_argument("--hang-rank", type=int, default=0, help="the global rank that hangs with --hang-at-step")
    p.add_argument("--crash-in-save-at-step", type=int, default=None,
                   help="SIGKILL --crash-rank in the middle of saving this step's checkpoint (after DeepSpeed "
                        "wrote its files, before the completion marker), on the job's first attempt only: the "
                        "tag is left incomplete, as by a node lost during a save")
    p.add_argument("--crash-rank", type=int, default=0, help="the global rank killed by --crash-in-save-at-step")
    p.add_argument("--slow-rank", type=int, default=None,
                   help="a straggler on purpose: this global rank sleeps --slow-ms per step, before the step's "
                        "collectives (reported as compute_seconds; orch's straggler detection names it)")
    p.add_argument("--slow-ms", type=float, default=0.0, help="milliseconds --slow-rank sleeps per step")
    p.add_argument("--pace-ms", type=float, default=0.0,
                   help="every rank sleeps this many milliseconds before each step (not in its step_s): a job "
                        "that runs for a while on idle cores, for demos and tests; no rank is a straggler")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=10, help="human summary on rank 0 every N steps")
    p.add_argument("--no-report", action="store_true", help="do not report steps to orch's metrics "
                   "(agents.report); the [train] log lines stay")
    p.add_argument("--eval-interval", type=int, default=0,
                   help="evaluate on held-out text every N steps (0: only at the end if --eval-batches)")
    p.add_argument("--eval-batches", type=int, default=0, help="held-out micro batches per evaluation")
    p.add_argument("--eval-after-resume", action="store_true",
                   help="also evaluate right after loading a checkpoint, before training on (with the same "
                   "held-out windows as every evaluation: shows that the weights came back)")
    # model
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    # data
    p.add_argument("--corpus-bytes", type=int, default=2_000_000,
                   help="cap on the corpus size (bytes of stdlib source read)")
    p.add_argument("--corpus-root", default=None, help="default: sysconfig.get_paths()['stdlib']")
    p.add_argument("--holdout-fraction", type=float, default=0.05,
                   help="tail of the corpus kept out of training, for --eval-batches")
    # runtime
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: $OMP_NUM_THREADS or 1)")
    p.add_argument("--dist-timeout-s", type=float, default=600.0, help="timeout of collectives")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")),
                   help="passed by DeepSpeed's launcher; the LOCAL_RANK variable is used instead")
    # --deepspeed, --deepspeed_config (and their deprecated aliases), as the launcher may pass them
    import deepspeed
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- data


def load_corpus(max_bytes: int, root: str | None = None) -> tuple[torch.Tensor, dict]:
    """Concatenate stdlib ``*.py`` files (sorted relative paths) up to ``max_bytes`` bytes.

    Deterministic for a given Python installation. Third-party directories
    (site-packages, dist-packages) and caches are skipped.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root))
    files.sort()
    chunks, total, used = [], 0, 0
    for rel in files:
        if total >= max_bytes:
            break
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        used += 1
    blob = b"".join(chunks)
    if len(blob) < 10_000:
        raise RuntimeError(f"corpus under {root} too small ({len(blob)} bytes)")
    info = {"root": str(root), "files": used, "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest()[:16]}
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone(), info


class RankSampler:
    """Random windows from this data-parallel rank's own contiguous shard of the corpus.

    Its whole position is the state of its private ``torch.Generator`` plus a counter, so
    saving and restoring those makes the sequence of batches continue exactly.
    """

    def __init__(self, train: torch.Tensor, dp_rank: int, dp_size: int, seq_len: int, seed: int):
        n = train.numel()
        lo, hi = n * dp_rank // dp_size, n * (dp_rank + 1) // dp_size
        if hi - lo < seq_len + 2:
            raise RuntimeError(f"shard of rank {dp_rank} too small: {hi - lo} bytes for seq_len {seq_len}")
        self.shard = train[lo:hi]
        self.bounds = (lo, hi)
        self.seq_len = seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self.samples_drawn = 0
        self._idx = torch.arange(seq_len + 1)

    def next_batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.shard.numel() - self.seq_len - 1, (batch, 1), generator=self.gen)
        win = self.shard[starts + self._idx].long()
        self.samples_drawn += batch
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state(), "samples_drawn": self.samples_drawn,
                "bounds": list(self.bounds)}

    def load_state_dict(self, sd: dict) -> None:
        if list(sd["bounds"]) != list(self.bounds):
            raise RuntimeError(f"data shard changed: saved {sd['bounds']}, now {list(self.bounds)}")
        self.gen.set_state(sd["generator"])
        self.samples_drawn = int(sd["samples_drawn"])


def eval_batches(holdout: torch.Tensor, n: int, batch: int, seq_len: int):
    """Fixed, evenly spaced windows of the held-out text (identical on every rank)."""
    span = holdout.numel() - seq_len - 1
    starts = torch.linspace(0, span - 1, n * batch).long().view(n, batch, 1)
    idx = torch.arange(seq_len + 1)
    for s in starts:
        win = holdout[s + idx].long()
        yield win[:, :-1].contiguous(), win[:, 1:].contiguous()


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):

    def __init__(self, d_model: int, n_head: int, seq_len: int, dropout: float):
        super().__init__()
        assert d_model % n_head == 0, "d_model must be divisible by n_head"
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)).view(1, 1, seq_len, seq_len)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):

    def __init__(self, d_model: int, n_head: int, seq_len: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, seq_len, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """GPT-2 style decoder over bytes; ``forward(idx, targets)`` returns the mean cross-entropy."""

    def __init__(self, n_layer: int, n_head: int, d_model: int, seq_len: int, dropout: float, vocab: int = 256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, seq_len, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)  # not tied: keeps ZeRO-3 partitioning simple
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# --------------------------------------------------------------------------- per-rank state


def seed_rank_rngs(seed: int, global_rank: int, step: int = 0) -> int:
    """Give this rank its own python/numpy/torch RNG streams (dropout uses torch's).

    ``step`` > 0 gives other streams (a universal resume at that step: the saved streams belonged
    to the old ranks). Returns the seed for the rank's data sampler."""
    entropy = [seed, 1 + global_rank] + ([step] if step else [])
    s = [int(x) for x in np.random.SeedSequence(entropy).generate_state(3)]
    random.seed(s[0])
    np.random.seed(s[1])
    torch.manual_seed(s[2])
    return s[2]


def capture_rank_state(sampler: RankSampler, step: int, global_rank: int, meta: dict) -> dict:
    """Everything this rank needs to continue exactly; only tensors, lists, ints, strs (weights_only-safe)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "format": RANK_STATE_FORMAT,
        "global_rank": global_rank,
        "step": step,
        "data": sampler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                      int(np_state[3]), float(np_state[4])],
        "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
        "meta": meta,
    }


def restore_rank_state(sd: dict, sampler: RankSampler, global_rank: int, step: int) -> None:
    if sd.get("format") != RANK_STATE_FORMAT:
        raise RuntimeError(f"unknown per-rank state format {sd.get('format')!r}")
    if sd["global_rank"] != global_rank:
        raise RuntimeError(f"per-rank state belongs to rank {sd['global_rank']}, this is rank {global_rank}")
    if sd["step"] != step:
        raise RuntimeError(f"per-rank state is of step {sd['step']}, DeepSpeed loaded step {step}")
    sampler.load_state_dict(sd["data"])
    torch.set_rng_state(sd["torch_rng"])
    n = sd["numpy_rng"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    p = sd["python_rng"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- main


def hang_forever(step: int, rank: int) -> None:
    """--hang-at-step: block this rank for good (a stuck data loader, a deadlock), as a stack dump shows."""
    print(f"[hang] rank={rank} global_step={step} hanging on purpose (--hang-at-step)", flush=True)
    while True:
        time.sleep(3600)


def main(argv=None) -> int:
    t_start = time.time()
    # DeepSpeed's ZeRO code calls the deprecated all_gather_into_tensor each step: noise on every rank.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather_into_tensor.*")
    args = parse_args(argv)
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(1, threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    import deepspeed
    import deepspeed.comm as dist

    config_path = args.deepspeed_config or os.environ.get("ORCH_DEEPSPEED_CONFIG")
    if not config_path:
        raise SystemExit("no DeepSpeed config: pass --deepspeed_config or set ORCH_DEEPSPEED_CONFIG")
    ckpt_dir = args.checkpoint_dir or os.environ.get("ORCH_CHECKPOINT_DIR")
    resume_tag = args.resume_tag or os.environ.get("ORCH_RESUME_TAG") or None
    if (args.checkpoint_interval > 0 or args.save_final or resume_tag) and not ckpt_dir:
        raise SystemExit("checkpointing needs --checkpoint-dir or ORCH_CHECKPOINT_DIR")

    universal = bool(resume_tag) and (args.resume_universal or os.environ.get("ORCH_RESUME_UNIVERSAL") == "1"
                                      or (Path(ckpt_dir) / resume_tag / UNIVERSAL_MARKER).is_file())
    need = UNIVERSAL_MARKER if universal else MARKER
    if resume_tag and not (Path(ckpt_dir) / resume_tag / need).is_file():  # fail before the slow start-up
        raise SystemExit(f"cannot resume from {Path(ckpt_dir) / resume_tag}: no {need} (incomplete checkpoint)")
    config = config_path
    if universal:  # DeepSpeed reads the zero/ folder of a universal checkpoint only with load_universal
        config = json.loads(Path(config_path).read_text())
        config.setdefault("checkpoint", {})["load_universal"] = True

    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=args.dist_timeout_s))
    global_rank, world_size = dist.get_rank(), dist.get_world_size()

    # Same seed everywhere for the weights (ZeRO-3 partitions each rank's local copy).
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = ByteGPT(args.n_layer, args.n_head, args.d_model, args.seq_len, args.dropout)
    n_params = sum(p.numel() for p in model.parameters())

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    from deepspeed.utils import groups
    dp_rank = groups._get_data_parallel_rank()
    dp_size = groups._get_data_parallel_world_size()
    zero_stage = int(engine.zero_optimization_stage())
    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    node_rank = int(os.environ.get("CROSS_RANK", os.environ.get("GROUP_RANK", "0")))

    corpus, corpus_info = load_corpus(args.corpus_bytes, args.corpus_root)
    n_hold = int(corpus.numel() * args.holdout_fraction) if args.eval_batches > 0 else 0
    train_text = corpus[: corpus.numel() - n_hold]
    holdout = corpus[corpus.numel() - n_hold:]
    rank_seed = seed_rank_rngs(args.seed, global_rank)
    sampler = RankSampler(train_text, dp_rank, dp_size, args.seq_len, rank_seed)

    out(f"[setup] rank={global_rank} local_rank={int(os.environ.get('LOCAL_RANK', '0'))} node_rank={node_rank} "
        f"world_size={world_size} dp_rank={dp_rank} dp_size={dp_size} zero_stage={zero_stage} micro_batch={micro} "
        f"grad_accum={gas} threads={torch.get_num_threads()} params={n_params} "
        f"optimizer={type(engine.optimizer).__name__}/{type(getattr(engine, 'basic_optimizer', None)).__name__} "
        f"corpus_bytes={corpus_info['bytes']} corpus_files={corpus_info['files']} "
        f"corpus_sha256={corpus_info['sha256']} shard={sampler.bounds[0]}:{sampler.bounds[1]} config={config_path}")

    step = 0
    if resume_tag and universal:
        step = resume_universal(engine, ckpt_dir, resume_tag, sampler, global_rank, world_size, dp_size,
                                corpus_info, args.seed, micro * gas)
    elif resume_tag:
        step = resume(engine, ckpt_dir, resume_tag, sampler, global_rank, world_size, dp_size, zero_stage,
                      corpus_info)
    start_step = step
    save16 = wants_16bit_model(engine, args, zero_stage, ckpt_dir)
    args.save_final = args.save_final or save16
    if resume_tag and args.eval_after_resume and args.eval_batches > 0:
        evaluate(engine, holdout, args, micro, step, global_rank)

    def save(tag_step: int) -> None:
        save_checkpoint(engine, ckpt_dir, tag_step, sampler, global_rank, world_size, dp_size, zero_stage,
                        corpus_info, args, dist)

    last = args.steps if args.stop_at_step is None else min(args.steps, args.stop_at_step)
    tokens_per_step = micro * gas * args.seq_len
    window_loss, window_n, window_t0 = 0.0, 0, time.time()
    engine.train()
    while step < last:
        if args.pace_ms > 0:
            time.sleep(args.pace_ms / 1000.0)  # --pace-ms: every rank alike, outside the step's timing
        t0 = time.perf_counter()
        loss_sum, compute_s = 0.0, 0.0
        for _ in range(gas):
            tc = time.perf_counter()
            if global_rank == args.slow_rank and args.slow_ms > 0:
                time.sleep(args.slow_ms / 1000.0)  # --slow-rank: before this micro step's collectives
            x, y = sampler.next_batch(micro)
            loss = engine(x.to(engine.device), y.to(engine.device))  # (the accelerator's device; CPU: no copy)
            compute_s += time.perf_counter() - tc  # this rank's own work, before backward's all-reduce waits
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item()
        step = engine.global_steps
        dt = time.perf_counter() - t0
        loss_val = loss_sum / gas
        lr = engine.get_lr()[0]
        out(f"[train] step={step} rank={global_rank} loss={loss_val!r} lr={lr!r} "
            f"samples_per_s={micro * gas / dt:.3f} tokens_per_s={tokens_per_step / dt:.1f} step_s={dt:.6f}")
        if orch_report is not None and not args.no_report:
            orch_report.step(step, loss=loss_val, samples=micro * gas, tokens=tokens_per_step, lr=lr, step_seconds=dt,
                             total_steps=args.steps, compute_seconds=compute_s)
        window_loss += loss_val
        window_n += 1
        if args.log_interval > 0 and (step % args.log_interval == 0 or step == last):
            t = torch.tensor([window_loss, float(window_n)], dtype=torch.float64)
            dist.all_reduce(t)  # every rank takes part; rank 0 prints
            if global_rank == 0:
                el = time.time() - window_t0
                out(f"[summary] step {step}/{args.steps} | loss {t[0].item() / t[1].item():.4f} (mean of "
                    f"{world_size} ranks, last {window_n} steps) | lr {lr:.2e} | {1000 * el / window_n:.1f} ms/step "
                    f"| {tokens_per_step * window_n / el:,.0f} tok/s/rank | "
                    f"max rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB | "
                    f"elapsed {time.time() - t_start:.1f}s")
            window_loss, window_n, window_t0 = 0.0, 0, time.time()
        if args.eval_batches > 0 and args.eval_interval > 0 and step % args.eval_interval == 0:
            evaluate(engine, holdout, args, micro, step, global_rank)
        if ckpt_dir and args.checkpoint_interval > 0 and step % args.checkpoint_interval == 0:
            save(step)
        if step == args.fail_at_step and global_rank == args.fail_rank and \
                os.environ.get("ORCH_ATTEMPT", "1") == "1":
            raise RuntimeError(f"failing on purpose after step {step} on rank {global_rank} (--fail-at-step)")
        if step == args.hang_at_step and global_rank == args.hang_rank and \
                os.environ.get("ORCH_ATTEMPT", "1") == "1":
            hang_forever(step, global_rank)
    if ckpt_dir and args.save_final and step == args.steps and step > start_step and not (
            args.checkpoint_interval > 0 and step % args.checkpoint_interval == 0):
        save(step)
    if save16 and step == args.steps and step > start_step:
        save_16bit_model(engine, ckpt_dir, step, global_rank)
    if args.eval_batches > 0 and not (args.eval_interval > 0 and step % args.eval_interval == 0):
        evaluate(engine, holdout, args, micro, step, global_rank)
    dist.barrier()
    out(f"[done] rank={global_rank} global_step={step} wall_s={time.time() - t_start:.2f} "
        f"max_rss_mib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}")
    torch.distributed.destroy_process_group()
    return 0


def evaluate(engine, holdout, args, micro, step, global_rank) -> float:
    """Mean loss on fixed held-out windows; every rank runs it (ZeRO-3 gathers weights collectively)."""
    engine.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(holdout, args.eval_batches, micro, args.seq_len):
            total += engine(x.to(engine.device), y.to(engine.device)).item()
            n += 1
    engine.train()
    val = total / max(n, 1)
    out(f"[eval] global_step={step} rank={global_rank} eval_loss={val!r}")
    return val


def universal_client_state(step: int, args, corpus_info: dict) -> dict:
    """What ``deepspeed.checkpoint.ds_to_universal`` needs in the model-states file (ZeRO 1/2).

    It reads ``universal_checkpoint_info`` (refuses to convert without it unless run with
    ``--inject_missing_state``) and ``iteration`` (names the output ``global_step<iteration>``);
    ``args`` is read when present. The parameter shapes and the ZeRO layout (``param_shapes``,
    ``ds_config``, ``ds_version``, per-rank ``*_optim_states.pt``) DeepSpeed writes itself.
    This is the same copy on every rank: nothing rank-specific belongs here.
    """
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )
    model_args = {k: getattr(args, k) for k in ("n_layer", "n_head", "d_model", "seq_len", "dropout", "seed")}
    return {
        UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE},
        "iteration": step,
        "args": model_args,
        "orch": {"step": step, "model": model_args, "corpus": corpus_info},
    }


def save_checkpoint(engine, ckpt_dir, step, sampler, global_rank, world_size, dp_size, zero_stage, corpus_info,
                    args, dist) -> None:
    t0 = time.time()
    tag = f"step_{step}"
    tag_dir = Path(ckpt_dir) / tag
    if global_rank == 0 and tag_dir.exists():
        # Re-saving a tag (e.g. after resuming from an older one): it stops counting as complete
        # before any of its files change, then goes as a whole, so that no file of an earlier
        # save at another world size (a rank that no longer exists) stays beside the new ones
        # (ds_to_universal reads every *_optim_states.pt it finds). save_checkpoint() starts with
        # a barrier, so no rank writes into the tag before this.
        (tag_dir / MARKER).unlink(missing_ok=True)
        shutil.rmtree(tag_dir)
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state=universal_client_state(step, args, corpus_info))
    tag_dir.mkdir(parents=True, exist_ok=True)
    state = capture_rank_state(sampler, step, global_rank,
                               {"world_size": world_size, "dp_size": dp_size, "zero_stage": zero_stage,
                                "corpus_sha256": corpus_info["sha256"], "seed": args.seed})
    atomic_write_bytes(tag_dir / RANK_FILE_FMT.format(rank=global_rank), lambda f: torch.save(state, f))
    if step == args.crash_in_save_at_step and global_rank == args.crash_rank and \
            os.environ.get("ORCH_ATTEMPT", "1") == "1":
        out(f"[ckpt] tag={tag} global_step={step} rank={global_rank} killing itself mid-save (--crash-in-save-at-step)")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # every rank's DeepSpeed files and per-rank file are written
    if global_rank == 0:
        marker = {
            "format": MARKER_FORMAT,
            "tag": tag,
            "step": step,
            "world_size": world_size,
            "dp_world_size": dp_size,
            "zero_stage": zero_stage,
            "ranks": list(range(world_size)),
            "rank_files": [RANK_FILE_FMT.format(rank=r) for r in range(world_size)],
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "grad_accum": engine.gradient_accumulation_steps(),
            "global_samples": int(engine.global_samples),
            "corpus_sha256": corpus_info["sha256"],
            "time": time.time(),
        }
        atomic_write_bytes(tag_dir / MARKER, lambda f: f.write((json.dumps(marker, indent=1) + "\n").encode()))
    dist.barrier()  # nobody runs ahead (or exits) before the marker exists
    out(f"[ckpt] tag={tag} global_step={step} rank={global_rank} dir={ckpt_dir} save_s={time.time() - t0:.3f}")


def wants_16bit_model(engine, args, zero_stage, ckpt_dir) -> bool:
    """Whether to save the consolidated model at the end (``--save-16bit-model``, default: the config's
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save``); exits on a set-up that cannot.

    At ZeRO-3 ``engine.save_16bit_model`` gathers the partitioned weights only with that config flag
    on (without it DeepSpeed saves nothing and returns False); at stages 0-2 it saves the module's
    ``state_dict()`` (``DeepSpeedEngine.save_16bit_model``). The weights are in the dtype training
    holds them in: 16-bit under fp16/bf16, fp32 otherwise.
    """
    gather = bool(engine.zero_gather_16bit_weights_on_model_save())
    wanted = args.save_16bit_model if args.save_16bit_model is not None else gather
    if wanted and not ckpt_dir:
        raise SystemExit("--save-16bit-model needs --checkpoint-dir or ORCH_CHECKPOINT_DIR")
    if wanted and zero_stage == 3 and not gather:
        raise SystemExit("--save-16bit-model at ZeRO-3 needs zero_optimization."
                         "stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config (DeepSpeed "
                         "gathers the partitioned weights only then)")
    return wanted


def save_16bit_model(engine, ckpt_dir, step, global_rank) -> None:
    """Save the consolidated model into the (complete) tag ``step_<step>``: every rank must call it.

    ``engine.save_16bit_model`` is collective at ZeRO-3 (it gathers each layer's partitions to
    rank 0); global rank 0 writes the file, under a temporary name renamed into place, so a
    crash never leaves a partial ``pytorch_model.bin``.
    """
    t0 = time.time()
    tag_dir = Path(ckpt_dir) / f"step_{step}"
    tmp = f".{MODEL_16BIT}.tmp"
    engine.save_16bit_model(str(tag_dir), tmp)
    if global_rank == 0:
        os.replace(tag_dir / tmp, tag_dir / MODEL_16BIT)
        out(f"[ckpt] tag=step_{step} global_step={step} rank=0 model_16bit={tag_dir / MODEL_16BIT} "
            f"bytes={(tag_dir / MODEL_16BIT).stat().st_size} save_s={time.time() - t0:.3f}")


def load_at_step(engine, ckpt_dir, tag, expected_step, what: str, marker_name: str) -> tuple[int, dict | None]:
    """``engine.load_checkpoint`` of ``tag``; returns ``(global_steps, client_state)``.

    Raises SystemExit when DeepSpeed loads nothing (``what`` names the checkpoint) or restores
    another step than ``expected_step``, the one orch's marker (``marker_name``) recorded."""
    load_path, client_state = engine.load_checkpoint(ckpt_dir, tag=tag)
    if load_path is None:
        raise SystemExit(f"DeepSpeed could not load {what}")
    step = int(engine.global_steps)
    if step != expected_step:
        raise SystemExit(f"{tag}: DeepSpeed restored global_steps={step}, {marker_name} says {expected_step}")
    return step, client_state


def resume(engine, ckpt_dir, tag, sampler, global_rank, world_size, dp_size, zero_stage, corpus_info) -> int:
    tag_dir = Path(ckpt_dir) / tag
    marker_path = tag_dir / MARKER
    if not marker_path.is_file():
        raise SystemExit(f"cannot resume from {tag_dir}: no {MARKER} (incomplete checkpoint)")
    marker = json.loads(marker_path.read_text())
    if marker.get("world_size") != world_size or marker.get("dp_world_size") != dp_size:
        raise SystemExit(f"cannot resume {tag}: saved with world_size={marker.get('world_size')} "
                         f"dp={marker.get('dp_world_size')}, now world_size={world_size} dp={dp_size} "
                         "(convert with ds_to_universal and load_universal to change the world size)")
    if marker.get("zero_stage") != zero_stage:
        out(f"[resume] rank={global_rank} warning: checkpoint ZeRO stage {marker.get('zero_stage')}, "
            f"now {zero_stage}")
    step, client_state = load_at_step(engine, ckpt_dir, tag, marker.get("step"), str(tag_dir), "marker")
    rank_file = tag_dir / RANK_FILE_FMT.format(rank=global_rank)
    sd = torch.load(rank_file, map_location="cpu", weights_only=True)
    if sd["meta"].get("corpus_sha256") != corpus_info["sha256"]:
        out(f"[resume] rank={global_rank} warning: corpus differs from the checkpoint's "
            f"({sd['meta'].get('corpus_sha256')} vs {corpus_info['sha256']}); batches will not match")
    restore_rank_state(sd, sampler, global_rank, step)
    out(f"[resume] rank={global_rank} tag={tag} global_step={step} samples_drawn={sampler.samples_drawn} "
        f"rank_file={rank_file.name} client_iteration={(client_state or {}).get('iteration')}")
    return step


def resume_universal(engine, ckpt_dir, tag, sampler, global_rank, world_size, dp_size, corpus_info, seed,
                     samples_per_step) -> int:
    """Resume from a universal checkpoint (any world size; see the module docstring for what is exact).

    DeepSpeed (``"load_universal": true``) reads the weights and optimizer state from
    ``<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`` and partitions them for this world
    (``DeepSpeedEngine._load_zero_checkpoint``). The per-rank files of the source tag do not map
    to these ranks: this rank's sampler keeps its new shard (``dp_rank`` of ``dp_size``) and it
    and the RNGs are reseeded from (seed, global rank, step).

    Returns:
        The step loaded (``global_steps``); raises SystemExit when it disagrees with orch's marker.
    """
    tag_dir = Path(ckpt_dir) / tag
    meta = json.loads((tag_dir / UNIVERSAL_MARKER).read_text())
    source = meta.get("source") or {}
    step, client_state = load_at_step(engine, ckpt_dir, tag, meta.get("step"), f"the universal checkpoint {tag_dir}",
                                      UNIVERSAL_MARKER)
    if source.get("corpus_sha256") not in (None, corpus_info["sha256"]):
        out(f"[resume] rank={global_rank} warning: corpus differs from the checkpoint's "
            f"({source.get('corpus_sha256')} vs {corpus_info['sha256']})")
    sampler.gen.manual_seed(seed_rank_rngs(seed, global_rank, step))
    sampler.samples_drawn = step * samples_per_step
    out(f"[resume] rank={global_rank} tag={tag} universal=1 from_tag={meta.get('source_tag')} global_step={step} "
        f"from_world_size={source.get('world_size')} from_dp={source.get('dp_world_size')} world_size={world_size} "
        f"dp={dp_size} shard={sampler.bounds[0]}:{sampler.bounds[1]} "
        f"client_iteration={(client_state or {}).get('iteration')}")
    return step


if __name__ == "__main__":
    code = main()
    # once the group is destroyed, gloo's worker threads can still abort the interpreter's teardown
    # ("terminate called without an active exception", SIGABRT; a CI run saw it): everything is written,
    # so leave without that teardown, as ds_plain_train.py does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
