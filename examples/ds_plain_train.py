#!/usr/bin/env python
"""A plain DeepSpeed training script: a small byte-level transformer on the CPython standard library.

Written the way DeepSpeed's own examples are, for its launcher (``deepspeed --hostfile ...
ds_plain_train.py --deepspeed --deepspeed_config ds.json``): the arguments come from
``deepspeed.add_config_arguments`` plus ``--local_rank``, the process group from the
launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), and everything else
(ZeRO stage, micro batch, optimizer, LR schedule) from the DeepSpeed config through
``deepspeed.initialize(args=...)``. It knows nothing of orch; under orch, a job spec with
``deepspeed_args: true`` passes ``--deepspeed --deepspeed_config <path>`` as DeepSpeed's
launcher would.

The text is the standard library's ``*.py`` files (sorted paths, capped by
``--corpus-bytes``) as bytes; each data-parallel rank draws random windows from its own
contiguous shard. Every step each rank prints ``step=<n> rank=<r> loss=<its loss>``; at the
end global rank 0 prints ``done steps=<n> first_loss=<mean over ranks> last_loss=<mean over
ranks, last 5 steps>``. ``--save-dir`` saves a DeepSpeed checkpoint (tag ``global_step<n>``)
at the end.
"""

import argparse
import os
import sys
import sysconfig
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--corpus-bytes", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-dir", default=None, help="save a DeepSpeed checkpoint here at the end")
    p.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def stdlib_bytes(max_bytes):
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


class ByteLM(nn.Module):
    """A causal transformer over bytes; ``forward(x, y)`` returns the mean next-byte cross-entropy."""

    def __init__(self, d_model, n_head, n_layer, seq_len):
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x, y):
        t = x.size(1)
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        logits = self.head(self.body(h, mask=self.causal[:t, :t], is_causal=True))
        return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


def main():
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    torch.manual_seed(args.seed)
    model = ByteLM(args.d_model, args.n_head, args.n_layer, args.seq_len)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro = engine.train_micro_batch_size_per_gpu()
    print(f"setup rank={rank} world_size={world} zero_stage={engine.zero_optimization_stage()} "
          f"micro_batch={micro} grad_accum={engine.gradient_accumulation_steps()} config={args.deepspeed_config}",
          flush=True)

    data = stdlib_bytes(args.corpus_bytes)
    shard = data[len(data) * rank // world: len(data) * (rank + 1) // world]
    gen = torch.Generator().manual_seed(args.seed + rank)
    offsets = torch.arange(args.seq_len + 1)

    means = []
    while engine.global_steps < args.steps:
        local = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            starts = torch.randint(0, shard.numel() - args.seq_len - 1, (micro, 1), generator=gen)
            window = shard[starts + offsets].long()
            loss = engine(window[:, :-1], window[:, 1:])
            engine.backward(loss)
            engine.step()
            local += loss.item() / engine.gradient_accumulation_steps()
        mean = torch.tensor([local])
        deepspeed.comm.all_reduce(mean)
        means.append(mean.item() / world)
        print(f"step={engine.global_steps} rank={rank} loss={local:.6f}", flush=True)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if rank == 0:
        tail = means[-5:]
        print(f"done steps={engine.global_steps} first_loss={means[0]:.6f} last_loss={sum(tail) / len(tail):.6f}",
              flush=True)
    deepspeed.comm.barrier()  # no collective may still be in flight when Python exits
    deepspeed.comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads can still abort the interpreter's teardown ("terminate called without an
    # active exception", SIGABRT, about 1 run in 10 at ZeRO-3 here; pytorch/pytorch#190489): everything
    # is written and the group destroyed, so leave without that teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
