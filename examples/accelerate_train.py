#!/usr/bin/env python
"""A small byte-level transformer trained with Hugging Face Accelerate (DeepSpeed ZeRO on GPUs).

An ordinary Accelerate script: ``Accelerator()`` takes its whole set-up from the environment,
as ``accelerate launch`` leaves it, so orch (or any launcher) runs it unchanged:

* the process group: torchrun's variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT`` (orch's ``standard`` launcher gives them to every rank);
* DeepSpeed: ``ACCELERATE_USE_DEEPSPEED=true`` and ``ACCELERATE_DEEPSPEED_CONFIG_FILE=<json>``
  (what ``accelerate launch --use_deepspeed --deepspeed_config_file <json>`` sets), e.g.
  ``examples/ds_accelerate_zero2.json``. Accelerate 1.15 runs DeepSpeed only on a device
  such as CUDA: without one, each process comes up alone (``num_processes`` 1), which this
  script refuses (below);
* CPU only: ``ACCELERATE_USE_CPU=true`` (what ``accelerate launch --cpu`` sets): data
  parallel over gloo (``MULTI_CPU``); Accelerate then leaves DeepSpeed out even when
  ``ACCELERATE_USE_DEEPSPEED`` is set.

The text is the CPython standard library's ``*.py`` source (sorted paths, capped by
``--corpus-bytes``), read as bytes, cut into windows of ``--seq-len + 1`` bytes; Accelerate's
prepared ``DataLoader`` gives each process its own share of them.

Output: ``[setup] rank=.. distributed_type=.. num_processes=.. ...`` on every process, then
every step ``[train] step=<n> rank=<rank> loss=<this process's loss> mean_loss=<mean over
processes>``, and last on the main process ``[done] steps=.. first_loss=.. last_loss=..``
(mean losses: the first step's and the mean of the last 5 steps). Exit status 0 when done; 2
when ``WORLD_SIZE`` > 1 but Accelerate did not join the processes into one group (each would
train alone on the whole data set).

Example, 2 processes on this machine (CPU)::

    ACCELERATE_USE_CPU=true torchrun --nproc-per-node 2 examples/accelerate_train.py --steps 100
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # several processes share the cores

import torch
import torch.nn.functional as F
from torch import nn


def parse_args(argv=None) -> argparse.Namespace:
    """The script's options (model sizes, steps, data); ``--local_rank`` is accepted and ignored."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="windows per process per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--corpus-bytes", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """The standard library's ``*.py`` files (sorted relative paths, no site-packages) as one uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts))
    chunks, total = [], 0
    for path in paths:
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: (input, next-byte target), both (seq_len,) int64."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, i: int):
        w = self.data[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return w[:-1], w[1:]


class ByteLM(nn.Module):
    """A causal transformer over bytes from torch.nn's building blocks; ``forward(x)`` gives (B, T, 256) logits."""

    def __init__(self, d_model: int, n_head: int, n_layer: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        return self.head(self.body(h, mask=self.causal[:t, :t], is_causal=True))


def main(argv=None) -> int:
    args = parse_args(argv)
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator()
    state = accelerator.state
    world = int(os.environ.get("WORLD_SIZE", "1"))
    stage = state.deepspeed_plugin.zero_stage if state.deepspeed_plugin is not None else None
    print(f"[setup] rank={accelerator.process_index} distributed_type={state.distributed_type.value} "
          f"num_processes={accelerator.num_processes} backend={state.backend} device={accelerator.device} "
          f"deepspeed_zero_stage={stage} WORLD_SIZE={world}", flush=True)
    if world > 1 and accelerator.num_processes != world:
        print(f"error: WORLD_SIZE is {world} but Accelerate set up {accelerator.num_processes} process(es) "
              f"({state.distributed_type.value}): each would train alone. Without a GPU set "
              "ACCELERATE_USE_CPU=true (multi-CPU over gloo; Accelerate does not run DeepSpeed on the CPU).",
              file=sys.stderr, flush=True)
        return 2

    set_seed(args.seed)
    data = Windows(stdlib_bytes(args.corpus_bytes), args.seq_len)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    model = ByteLM(args.d_model, args.n_head, args.n_layer, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)

    means: list[float] = []
    batches = iter(loader)
    model.train()
    for step in range(1, args.steps + 1):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean").item()
        means.append(mean)
        print(f"[train] step={step} rank={accelerator.process_index} loss={loss.item()!r} mean_loss={mean!r}",
              flush=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tail = means[-5:]
        print(f"[done] steps={args.steps} first_loss={means[0]!r} last_loss={sum(tail) / len(tail)!r} "
              f"num_processes={accelerator.num_processes} distributed_type={state.distributed_type.value}", flush=True)
    accelerator.wait_for_everyone()  # no collective may still be in flight when Python exits
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads can still abort the interpreter's teardown ("terminate called without an
    # active exception", SIGABRT, seen here about 1 run in 40; pytorch/pytorch#190489): everything is
    # written and the group destroyed, so leave without that teardown (as examples/ds_plain_train.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
