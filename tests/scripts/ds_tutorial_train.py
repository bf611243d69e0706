#!/usr/bin/env python
"""A DeepSpeed-tutorial-style training script: a tiny MLP on synthetic tokens, with checkpoints.

Written as DeepSpeed's getting-started tutorial shows, knowing nothing of any orchestrator:
``argparse`` with ``deepspeed.add_config_arguments`` and ``--local_rank``, the config from
``--deepspeed_config`` (ZeRO stage, micro batch, gradient accumulation, optimizer, scheduler
all come from it), ``deepspeed.initialize(args=..., model=..., model_parameters=...)``.

* Data: every micro batch is drawn from a ``torch.Generator`` seeded by (seed, rank, step,
  micro step), so a resumed run sees exactly the batches an uninterrupted one would.
  The task: predict ``(3 * x + 1) % vocab`` from a token ``x`` (the loss falls quickly).
* Each optimizer step prints ``step=<global step> rank=<RANK> loss=<repr of the float>``
  (the rank's mean loss over its micro batches), flushed.
* Every ``--save_interval`` steps (with ``--save_dir``): ``engine.save_checkpoint(save_dir,
  client_state={"step": ...})`` with DeepSpeed's default tag ``global_step<N>`` (it also
  writes ``<save_dir>/latest``).
* ``--fail_at_step N --fail_rank R --fail_once FILE``: rank R raises after step N unless FILE exists
  (it creates FILE first), so a resumed run gets past it.
* ``--load_dir``: ``engine.load_checkpoint(load_dir)`` (the tag named by ``latest``), then go
  on from the client state's step; with no checkpoint there, start from step 0.

Run, 2 processes on CPU::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/scripts/ds_tutorial_train.py \\
        --deepspeed --deepspeed_config tests/scripts/ds_tutorial_zero2.json --steps 40 --save_dir /tmp/ck
    # resume from /tmp/ck/latest:
    ... --steps 40 --save_dir /tmp/ck --load_dir /tmp/ck
"""

import argparse
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn


def parse_args():
    p = argparse.ArgumentParser(description="DeepSpeed tutorial-style tiny MLP")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--save_dir", default=None)
    p.add_argument("--load_dir", default=None)
    p.add_argument("--save_interval", type=int, default=10)
    p.add_argument("--fail_once", default=None, metavar="FILE",
                   help="fault injection: with --fail_at_step, fail there only if FILE does not exist (and create it)")
    p.add_argument("--fail_at_step", type=int, default=None)
    p.add_argument("--fail_rank", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "-1")),
                   help="passed by the launcher")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class TinyMLP(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, vocab)

    def forward(self, x, y):
        logits = self.fc2(F.gelu(self.fc1(self.emb(x))))
        return F.cross_entropy(logits, y)


def batch(args, rank, step, micro_step, size):
    """The micro batch ``micro_step`` of optimizer step ``step`` (1-based) on ``rank``."""
    gen = torch.Generator().manual_seed((args.seed * 1000003 + rank * 7919 + step) * 101 + micro_step)
    x = torch.randint(0, args.vocab, (size,), generator=gen)
    return x, (3 * x + 1) % args.vocab


def main():
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(args.seed)
    model = TinyMLP(args.vocab, args.hidden)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    step = 0
    if args.load_dir:
        path, client_state = engine.load_checkpoint(args.load_dir)
        if path is not None:
            step = client_state["step"]
            print(f"resumed rank={rank} from={path} global_step={step}", flush=True)
        else:
            print(f"no checkpoint in {args.load_dir}; starting from 0 rank={rank}", flush=True)

    while step < args.steps:
        step += 1
        local = 0.0
        for m in range(accum):
            x, y = batch(args, rank, step, m, micro)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            local += loss.item() / accum
        assert engine.global_steps == step, (engine.global_steps, step)
        if step == args.fail_at_step and rank == args.fail_rank and args.fail_once \
                and not os.path.exists(args.fail_once):
            open(args.fail_once, "w").close()
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        sys.stdout.write(f"step={step} rank={rank} loss={local!r}\n")
        sys.stdout.flush()
        if args.save_dir and step % args.save_interval == 0:
            engine.save_checkpoint(args.save_dir, client_state={"step": step, "seed": args.seed})
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads can abort the interpreter's teardown ("terminate called without an active
    # exception", SIGABRT; pytorch/pytorch#190489), as examples/ds_plain_train.py says: everything is
    # written and the group destroyed, so leave without that teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
