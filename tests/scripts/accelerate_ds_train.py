#!/usr/bin/env python
"""An Accelerate training script with DeepSpeed and save_state/load_state checkpoints: a tiny MLP, synthetic data.

An ordinary user script, knowing nothing of any orchestrator; its set-up is Accelerate's:

* DeepSpeed: ``--deepspeed_config FILE`` (``DeepSpeedPlugin(hf_ds_config=FILE)``), or the environment that
  ``accelerate launch --use_deepspeed --deepspeed_config_file FILE`` leaves (``ACCELERATE_USE_DEEPSPEED=true``,
  ``ACCELERATE_DEEPSPEED_CONFIG_FILE``), e.g. tests/scripts/ds_accelerate_zero2.json. The optimizer (AdamW)
  and LR schedule (warm-up) are the script's. Without DeepSpeed: data parallel (CPU: ``ACCELERATE_USE_CPU=true``).
* Without CUDA the process group is gloo (``InitProcessGroupKwargs(backend="gloo")``): otherwise Accelerate 1.15
  finds no backend on a CPU-only machine and brings each DeepSpeed process up alone (num_processes 1).

Data: a fixed synthetic set, shuffled by Accelerate's seedable sampler, sharded over the processes. Every step
each process prints ``step=<n> rank=<r> loss=<repr>``. Every ``--save_every`` steps ``accelerator.save_state()``
(automatic naming: ``<project_dir>/checkpoints/checkpoint_<i>``, replacing one an earlier run left there);
``--resume_from DIR``: ``accelerator.load_state(DIR)``, then on after the saved step (``custom_checkpoint_0.pkl``).

Run, 2 processes on CPU (resume: add ``--resume_from /tmp/acc/checkpoints/checkpoint_1``, saved at step 20)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/scripts/accelerate_ds_train.py \\
        --deepspeed_config tests/scripts/ds_accelerate_zero2.json --project_dir /tmp/acc --steps 40
    ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/scripts/accelerate_ds_train.py \\
        --project_dir /tmp/acc --steps 40    # plain MULTI_CPU data parallel
"""

import argparse
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    set_seed,
)
from torch import nn


def parse_args():
    p = argparse.ArgumentParser(description="Accelerate (+DeepSpeed) tiny MLP with save_state/load_state")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=8, help="per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--num_samples", type=int, default=256)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--project_dir", default="accelerate_run")
    p.add_argument("--save_every", type=int, default=10)
    p.add_argument("--resume_from", default=None, help="a checkpoint_<i> directory from save_state")
    p.add_argument("--deepspeed_config", default=None, help="DeepSpeed JSON for Accelerate's DeepSpeedPlugin")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


class Pairs(torch.utils.data.Dataset):
    """Sample ``i``: a token ``x`` and its target ``(3 * x + 1) % vocab``, from (seed, i) alone."""

    def __init__(self, n, vocab, seed):
        gen = torch.Generator().manual_seed(seed * 1000003 + 17)
        self.x = torch.randint(0, vocab, (n,), generator=gen)
        self.y = (3 * self.x + 1) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class TrainState:
    """What the script itself keeps in a checkpoint (registered: ``custom_checkpoint_0.pkl``)."""

    def __init__(self):
        self.step, self.saves = 0, 0

    def state_dict(self):
        return {"step": self.step, "saves": self.saves}

    def load_state_dict(self, d):
        self.step, self.saves = d["step"], d["saves"]


def save(accelerator, state):
    """``save_state()`` to the next ``checkpoint_<i>``; one left by a run we resumed before is replaced."""
    target = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{accelerator.save_iteration}")
    if accelerator.is_main_process and os.path.exists(target):  # save_state refuses an existing directory
        shutil.rmtree(target)
    accelerator.wait_for_everyone()  # every process, always: it must not decide by a racy look at the disk
    state.saves = accelerator.save_iteration + 1
    accelerator.save_state()


def main():
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed_config) if args.deepspeed_config else None
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(
        deepspeed_plugin=plugin, kwargs_handlers=handlers,
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    rank, world = accelerator.process_index, accelerator.num_processes
    ds = accelerator.state.deepspeed_plugin
    print(f"setup rank={rank} num_processes={world} distributed_type={accelerator.distributed_type.value} "
          f"backend={accelerator.state.backend} zero_stage={ds.zero_stage if ds else None}", flush=True)
    if int(os.environ.get("WORLD_SIZE", "1")) != world:
        print(f"error: WORLD_SIZE={os.environ.get('WORLD_SIZE')} but Accelerate set up {world}", file=sys.stderr)
        return 2

    set_seed(args.seed)
    model = nn.Sequential(nn.Embedding(args.vocab, args.hidden), nn.Linear(args.hidden, args.hidden), nn.GELU(),
                          nn.Linear(args.hidden, args.vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    loader = torch.utils.data.DataLoader(Pairs(args.num_samples, args.vocab, args.seed), batch_size=args.batch_size,
                                         shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        accelerator.project_configuration.iteration = state.saves  # the next save_state: checkpoint_<saves>
        print(f"resumed rank={rank} from={args.resume_from} step={state.step}", flush=True)

    per_epoch = len(loader)
    while state.step < args.steps:
        epoch, skip = divmod(state.step, per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            state.step += 1
            sys.stdout.write(f"step={state.step} rank={rank} loss={loss.item()!r}\n")
            sys.stdout.flush()
            if state.step % args.save_every == 0:
                save(accelerator, state)
            if state.step >= args.steps:
                break
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group: nothing of gloo's may outlive Python
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # all written, the group destroyed: skip the teardown gloo can abort (examples/ds_plain_train.py)
