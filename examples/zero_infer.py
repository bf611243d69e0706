#!/usr/bin/env python
"""ZeRO-Inference under orch: greedy generation with a tiny causal LM whose weights ZeRO-3 offloads.

The model is a small byte-level decoder (vocabulary of 256: a prompt is its UTF-8 bytes) built here in
plain torch and randomly initialised from ``--seed``, so every rank builds the same weights and no
download is needed (its text is noise: the example is about running, not about quality).
``deepspeed.initialize`` wraps it with a ZeRO-3 config that has ``offload_param`` and no ``optimizer``:
DeepSpeed then builds no optimizer, only its parameter offload (``DeepSpeedEngine._configure_zero_optimizer``
with a ``DummyOptim``: ``DeepSpeedZeRoOffload``). Each rank keeps 1/world of every weight in CPU memory
(``ds_zero3_infer_cpu.json``) or in files under ``nvme_path`` (``ds_zero3_infer_nvme.json``), and every
module's forward gathers its whole weights from all ranks, then frees them. The configs enable ``bf16``: on a
CPU without fp16 kernels DeepSpeed 0.19.8's ``zero.Init`` takes bfloat16 whatever dtype it is given
(``Init._set_dtype``: ``dtype or torch.float16 if is_fp16_supported() else torch.bfloat16 if
is_bf16_supported else ...``, the method itself, always true), so an fp32 model's NVMe swap buffers are
bf16 and its first forward fails ("expected m1 and m2 to have the same dtype").

The prompts (``--prompts FILE``, one a line, else built-in ones; ``--num-prompts`` of them) are split
across the ranks in contiguous runs, global rank order; each rank generates ``--new-tokens`` tokens for
its own in batches of ``train_micro_batch_size_per_gpu`` (the config's; ``--batch-size`` overrides it).
The gathers are collective, so every rank runs the same number of forward passes: a rank with fewer
batches than another runs copies of its last one (or of the first prompt) and drops their output.

Run by orch (2 nodes x 1 slot on this machine; ``orch logs JOB`` shows the lines below)::

    orch run examples/zero-inference.yaml          # parameters offloaded to CPU memory
    orch run examples/zero-inference-nvme.yaml     # ... to files under /tmp (needs libaio: async_io)

or by DeepSpeed's per-node launcher, node ``k`` of two::

    DS_ACCELERATOR=cpu python -m deepspeed.launcher.launch --world_info=<base64 json> --node_rank=k \\
        --master_addr=127.0.0.1 --master_port=29500 examples/zero_infer.py \\
        --deepspeed_config examples/ds_zero3_infer_cpu.json --out-dir /tmp/zero-infer

The reference without DeepSpeed (one process, plain torch, the same batches each rank of a world of
``--reference N`` runs, one after the other; batch size and dtype from the config). Bit-exact with the job in
fp32; in bf16 some tokens differ, since ZeRO-3 replaces ``F.linear`` by a matmul then an add
(``deepspeed/runtime/zero/linear.py``), which rounds twice::

    python examples/zero_infer.py --reference 2 --deepspeed_config examples/ds_zero3_infer_cpu.json --out-dir /tmp/ref

Contract (docs/contract.md): config from ``--deepspeed_config``, else ``$ORCH_DEEPSPEED_CONFIG``; outputs
in ``--out-dir``, else ``$ORCH_RUN_DIR/outputs`` (the attempt's directory, shared by every node):
``rank-<global rank>.jsonl``, one JSON object a prompt, ``{"index", "prompt", "tokens", "text"}``
(``tokens``: the new token ids; ``text``: their bytes decoded with replacement), written whole at the end
(temporary name, then renamed). Lines on every rank, each one ``write()``::

    [setup] rank=0 world_size=2 zero_stage=3 offload_param=cpu params=... partitions=cpu:25,nvme:4 prompts=0-2 ...
    [gen] step=5 rank=0 batch=1/2 token=5/16 tokens_per_s=...
    [done] rank=0 prompts=3 forwards=32 wall_s=...

``step=`` counts this rank's forward passes (what orch shows as its progress; ``agents.report`` gets the
same, with ``total_steps``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

if __name__ == "__main__":
    # several ranks share the CPU: one intra-op thread per rank unless told otherwise (before torch loads)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

try:  # orch's one-call metrics helper (docs/metrics.md); the script also runs without orch installed
    from agents import report as orch_report
except ImportError:
    orch_report = None

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLM", "PROMPTS", "build_model", "rank_slice", "batches", "generate", "main"]

#: the built-in prompts (``--prompts`` replaces them); lengths differ on purpose: batches are left-padded
PROMPTS = [
    "DeepSpeed ZeRO-Inference keeps",
    "The quick brown fox",
    "Once upon a time, on a cluster of",
    "def main():",
    "Parameters offloaded to NVMe are read back",
    "orch",
    "A rank that has fewer prompts still runs",
    "Hello, world",
]
PRINTABLE = slice(32, 127)  # the bytes greedy decoding chooses from (printable ASCII), so the text reads
PAD = 0  # the token left-padding fills with (masked out: it never changes a prompt's output)


def out(line: str) -> None:
    """Write one whole line with a single write() so ranks sharing a pipe do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm decoder block: masked multi-head self-attention, then a GELU MLP of width ``d_ff``."""

    def __init__(self, d_model: int, n_head: int, d_ff: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(~allowed, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """A byte-level causal LM; ``forward(idx, valid)`` gives the next-token logits of the last position.

    Args of ``forward``: ``idx`` ``[batch, time]`` token ids (int64), left-padded; ``valid`` ``[batch, time]``
    bool, False at padding. Positions count valid tokens only, and a query attends to valid keys at or
    before it (a padding query to itself), so a prompt's output does not depend on its padding.
    Returns ``[batch, vocab]`` float32 logits.
    """

    def __init__(self, n_layer: int, n_head: int, d_model: int, d_ff: int, max_len: int, vocab: int = 256):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"--d-model {d_model} is not a multiple of --n-head {n_head}")
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, d_ff) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=idx.device))
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=idx.device)[None]
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x, allowed[:, None])
        return self.head(self.ln_f(x[:, -1]))


def build_model(args: argparse.Namespace) -> TinyLM:
    """The model of ``args``, weights drawn from ``torch.manual_seed(args.seed)``: equal on every rank."""
    torch.manual_seed(args.seed)
    model = TinyLM(args.n_layer, args.n_head, args.d_model, args.d_ff, args.max_len)
    for name, p in model.named_parameters():  # unit-scale activations, so the greedy choices vary
        if name in ("tok.weight", "pos.weight"):
            nn.init.normal_(p, 0.0, 1.0)
        elif p.dim() == 2:
            nn.init.normal_(p, 0.0, p.shape[1] ** -0.5)
    return model.eval()


# --------------------------------------------------------------------------- prompts and batches


def rank_slice(n: int, rank: int, world: int) -> range:
    """Indices of the prompts global rank ``rank`` of ``world`` generates for: a contiguous run."""
    return range(n * rank // world, n * (rank + 1) // world)


def batches(indices: range, size: int, count: int) -> list[tuple[list[int], bool]]:
    """``count`` batches of at most ``size`` prompt indices, ``[(indices, real)]``.

    The rank's own batches come first (``real``); then, up to ``count``, copies of its last batch (or of
    prompt 0 when it has none) whose output is dropped: ZeRO-3 gathers each module's weights from every
    rank, so all ranks must run the same forward passes.
    """
    own = [list(indices[i:i + size]) for i in range(0, len(indices), size)]
    filler = own[-1] if own else [0]
    return [(b, True) for b in own] + [(filler, False)] * (count - len(own))


def encode(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(idx, valid)`` ``[batch, longest]`` of the prompts' UTF-8 bytes."""
    rows = [list(p.encode()) for p in prompts]
    width = max(len(r) for r in rows)
    idx = torch.tensor([[PAD] * (width - len(r)) + r for r in rows], dtype=torch.long)
    valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return idx, valid


@torch.no_grad()
def generate(forward, prompts: list[str], new_tokens: int, on_token=None) -> list[list[int]]:
    """Greedy decoding over the printable ASCII bytes (:data:`PRINTABLE`): ``new_tokens`` forward passes over
    the whole sequence (no cache); returns each prompt's new token ids.

    ``forward(idx, valid)`` -> ``[batch, vocab]`` logits; ``on_token(k)`` is called after token ``k`` (1-based).
    """
    idx, valid = encode(prompts)
    for k in range(1, new_tokens + 1):
        logits = forward(idx, valid)
        nxt = logits[:, PRINTABLE].argmax(dim=-1, keepdim=True) + PRINTABLE.start
        idx = torch.cat([idx, nxt], dim=1)
        valid = torch.cat([valid, torch.ones_like(nxt, dtype=torch.bool)], dim=1)
        if on_token:
            on_token(k)
    return idx[:, idx.shape[1] - new_tokens:].tolist()


# --------------------------------------------------------------------------- running


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (``--help``); DeepSpeed's ``--deepspeed``/``--deepspeed_config`` included."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", default=None, help="a UTF-8 file, one prompt a line (default: built-in prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts, cycling the list "
                   "when N exceeds it (default: all)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts per forward pass (default: the config's train_micro_batch_size_per_gpu)")
    p.add_argument("--out-dir", default=None, help="default: $ORCH_RUN_DIR/outputs")
    p.add_argument("--token-delay-s", type=float, default=0.0,
                   help="sleep this long before each forward pass (to watch or cancel a run mid-generation)")
    p.add_argument("--reference", type=int, default=None, metavar="WORLD",
                   help="no DeepSpeed: generate in this one process, rank by rank, what each rank of a world of "
                   "WORLD ranks generates, and write every rank's file")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ff", type=int, default=8192, help="MLP width; its weights' partitions (d_model x d_ff / "
                   "world bf16 values) are the ones large enough for DeepSpeed to swap to NVMe (1 MiB or more each: "
                   "swap_tensor's MIN_AIO_BYTES); smaller ones stay in CPU memory")
    p.add_argument("--max-len", type=int, default=128, help="longest prompt + new tokens (position table)")
    p.add_argument("--dist-timeout-s", type=float, default=300.0, help="timeout of collectives")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")),
                   help="passed by DeepSpeed's launcher; the LOCAL_RANK variable is used instead")
    import deepspeed
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    for name in ("new_tokens", "num_prompts", "batch_size", "reference"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def load_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts: ``--prompts`` (blank lines skipped) or :data:`PROMPTS`, cut or cycled to ``--num-prompts``.

    Raises SystemExit naming the file when it cannot be read or has no prompt, or a prompt that does not fit
    ``--max-len`` with ``--new-tokens``.
    """
    prompts = PROMPTS
    if args.prompts:
        try:
            prompts = [line for line in Path(args.prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            raise SystemExit(f"--prompts {args.prompts}: cannot read it ({err})") from err
        if not prompts:
            raise SystemExit(f"--prompts {args.prompts}: no prompt in it (one a line expected)")
    n = args.num_prompts or len(prompts)
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    longest = max(len(p.encode()) for p in prompts)
    if longest + args.new_tokens > args.max_len:
        raise SystemExit(f"the longest prompt ({longest} bytes) + --new-tokens {args.new_tokens} exceed "
                         f"--max-len {args.max_len}; raise --max-len or shorten the prompt")
    return prompts


def out_dir(args: argparse.Namespace) -> Path:
    """``--out-dir``, else ``$ORCH_RUN_DIR/outputs``; SystemExit when neither is given."""
    if args.out_dir:
        return Path(args.out_dir)
    if os.environ.get("ORCH_RUN_DIR"):
        return Path(os.environ["ORCH_RUN_DIR"]) / "outputs"
    raise SystemExit("no output directory: pass --out-dir (orch gives $ORCH_RUN_DIR)")


def write_outputs(directory: Path, rank: int, prompts: list[str], done: dict[int, list[int]]) -> Path:
    """Write ``rank-<rank>.jsonl`` (prompt order) under a temporary name, then rename it; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank}.jsonl"
    tmp = directory / f".rank-{rank}.jsonl.tmp"
    lines = [json.dumps({"index": i, "prompt": prompts[i], "tokens": toks,
                         "text": bytes(toks).decode("utf-8", errors="replace")}) for i, toks in sorted(done.items())]
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
    return path


def run_rank(forward, args, prompts: list[str], rank: int, world: int, batch_size: int) -> tuple[dict, int]:
    """Generate for global rank ``rank``'s prompts: ``({prompt index: new token ids}, forward passes run)``."""
    n_batches = max(len(rank_slice(len(prompts), r, world)) + batch_size - 1 for r in range(world)) // batch_size
    plan = batches(rank_slice(len(prompts), rank, world), batch_size, n_batches)
    total = n_batches * args.new_tokens
    done: dict[int, list[int]] = {}
    state = {"step": 0, "t": time.time()}

    def on_token(b: int, k: int) -> None:
        state["step"] += 1
        now = time.time()
        dt, state["t"] = now - state["t"], now
        n = len(plan[b][0])
        out(f"[gen] step={state['step']} rank={rank} batch={b + 1}/{n_batches} token={k}/{args.new_tokens} "
            f"real={int(plan[b][1])} tokens_per_s={n / max(dt, 1e-9):.1f}")
        if orch_report is not None:
            orch_report.step(state["step"], tokens=n, samples=n, step_seconds=dt, total_steps=total,
                             final=state["step"] == total)

    def paced(idx, valid):
        if args.token_delay_s > 0:
            time.sleep(args.token_delay_s)
        return forward(idx, valid)

    for b, (indices, real) in enumerate(plan):
        new = generate(paced, [prompts[i] for i in indices], args.new_tokens, lambda k, b=b: on_token(b, k))
        if real:
            done.update(zip(indices, new))
    return done, state["step"]


def reference_settings(args: argparse.Namespace) -> tuple[int, torch.dtype]:
    """``(batch size, dtype)`` for ``--reference``: ``--batch-size``, else ``train_micro_batch_size_per_gpu`` of
    ``--deepspeed_config`` (else ``$ORCH_DEEPSPEED_CONFIG``); bfloat16 when that config enables ``bf16``
    (DeepSpeed then casts the model to it), else float32. SystemExit naming the file when it is unreadable
    or lacks the batch size."""
    path = args.deepspeed_config or os.environ.get("ORCH_DEEPSPEED_CONFIG")
    if not path:
        if args.batch_size:
            return args.batch_size, torch.float32
        raise SystemExit("--reference needs --batch-size or a --deepspeed_config to take the batch size from")
    try:
        config = json.loads(Path(path).read_text())
        value = args.batch_size or config.get("train_micro_batch_size_per_gpu")
        bf16 = bool((config.get("bf16") or config.get("bfloat16") or {}).get("enabled"))
    except (OSError, ValueError, AttributeError) as err:
        raise SystemExit(f"{path}: cannot read the DeepSpeed config ({err})") from err
    if not isinstance(value, int) or value < 1:
        raise SystemExit(f"{path}: train_micro_batch_size_per_gpu must be an integer >= 1 for --reference, "
                         f"got {value!r}; or pass --batch-size")
    return value, torch.bfloat16 if bf16 else torch.float32


def reference(args: argparse.Namespace) -> int:
    """``--reference WORLD``: every rank's generation in this process with plain torch; writes every file."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
    prompts = load_prompts(args)
    batch_size, dtype = reference_settings(args)
    model = build_model(args).to(dtype)
    for rank in range(args.reference):
        done, forwards = run_rank(model, args, prompts, rank, args.reference, batch_size)
        path = write_outputs(out_dir(args), rank, prompts, done)
        out(f"[done] rank={rank} reference=1 prompts={len(done)} forwards={forwards} out={path}")
    return 0


def _name(value) -> str:
    """An ``OffloadDeviceEnum`` (DeepSpeed gives members or plain strings), a string, or None as a word."""
    return str(getattr(value, "value", value) or "none")


def partition_places(engine) -> str:
    """Where this rank's weight partitions live, ``device:count,...`` (``nvme`` for those swapped to files)."""
    places: dict[str, int] = {}
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)
        where = "unpartitioned" if t is None else _name(getattr(t, "final_location", None) or t.device.type)
        places[where] = places.get(where, 0) + 1
    return ",".join(f"{k}:{v}" for k, v in sorted(places.items()))


def main(argv=None) -> int:
    """Run one rank (or the ``--reference``); returns the exit status."""
    t_start = time.time()
    # DeepSpeed's ZeRO-3 gathers call the deprecated all_gather_into_tensor: noise on every rank
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_gather_into_tensor.*")
    args = parse_args(argv)
    if args.reference:
        return reference(args)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
    config_path = args.deepspeed_config or os.environ.get("ORCH_DEEPSPEED_CONFIG")
    if not config_path:
        raise SystemExit("no DeepSpeed config: pass --deepspeed_config or set ORCH_DEEPSPEED_CONFIG")
    prompts = load_prompts(args)
    directory = out_dir(args)

    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=args.dist_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=config_path)
    if engine.zero_optimization_stage() != 3:
        raise SystemExit(f"{config_path}: ZeRO-Inference needs zero_optimization.stage 3, "
                         f"got {engine.zero_optimization_stage()}")
    batch_size = args.batch_size or engine.train_micro_batch_size_per_gpu()
    mine = rank_slice(len(prompts), rank, world)
    out(f"[setup] rank={rank} local_rank={int(os.environ.get('LOCAL_RANK', '0'))} world_size={world} "
        f"zero_stage=3 offload_param={_name(getattr(engine.zero_offload_param(), 'device', None))} "
        f"params={n_params} partitions={partition_places(engine)} prompts={mine.start}-{mine.stop - 1} "
        f"batch_size={batch_size} new_tokens={args.new_tokens} threads={torch.get_num_threads()}")
    done, forwards = run_rank(engine, args, prompts, rank, world, batch_size)
    path = write_outputs(directory, rank, prompts, done)
    dist.barrier()
    out(f"[done] rank={rank} prompts={len(done)} forwards={forwards} out={path} wall_s={time.time() - t_start:.2f}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # as train_gpt.py: gloo's threads can abort the interpreter's teardown once the group is gone
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
