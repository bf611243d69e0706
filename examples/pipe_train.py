#!/usr/bin/env python
"""Pipeline-parallel training with DeepSpeed's ``PipelineModule``: a small MLP in 2 stages.

Written the way DeepSpeed's pipeline tutorial writes a script, knowing nothing of orch but the
checkpoint directory: the model is a list of layers (``LayerSpec``) with a ``loss_fn``, split over
``--stages`` pipeline stages (default 2: one rank per stage, data parallel 1 on 2 ranks); every
step is one ``engine.train_batch(data_iter)``, which pulls ``gradient_accumulation_steps`` micro
batches of ``(inputs, labels)`` from the iterator (only the first stage reads the inputs and only
the last the labels; ``deepspeed/runtime/pipe/engine.py``, ``PipelineEngine.train_batch``), so
the config's ``train_batch_size`` must be ``micro batch x gradient accumulation x data-parallel
size`` (asserted by ``PipelineEngine.__init__``).

* ZeRO: stage 0 or 1 only. DeepSpeed 0.19.8 refuses stages 2 and 3 with pipeline parallelism
  (``PipelineEngine.__init__``: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism").
  ``examples/ds_pipe.json`` is ZeRO-1: each stage's optimizer state is one partition per
  data-parallel rank.
* Data: every micro batch is drawn from a ``torch.Generator`` seeded by (seed, data-parallel
  rank, step, micro batch), the same on every stage, so a resumed run sees exactly the batches an uninterrupted one
  would. The task: predict ``(3 * x + 1) % vocab`` from a token ``x``.
* Log: every step each rank prints ``step=<global step> rank=<RANK> loss=<repr of the float>``:
  ``train_batch`` returns the last stage's loss (mean over the micro batches) on every stage.
* Checkpoints: every ``--checkpoint-interval`` steps, ``engine.save_checkpoint(dir,
  tag="global_step<N>")`` into ``--checkpoint-dir`` (default ``$ORCH_CHECKPOINT_DIR``).
  DeepSpeed writes per tag ``mp_rank_<stage>_model_states.pt`` (one per stage: the
  engine's state, the module itself left out), ``layer_<idx>-model_states.pt`` per layer that
  is a module (written by its stage; the GELUs' are empty state dicts), the ZeRO-1 partitions
  ``zero_pp_rank_0_mp_rank_<stage>_optim_states.pt``, and ``latest`` beside the tags.
* Resume: with ``--resume`` or when orch sets ``$ORCH_RESUME_TAG``, ``engine.load_checkpoint(dir,
  tag)`` (tag: ``$ORCH_RESUME_TAG``, else what DeepSpeed's ``latest`` names; orch points
  ``latest`` at the tag it chose too) restores every layer, the optimizer, the LR schedule and
  ``global_steps``; training continues at the saved step + 1 with the losses of an uninterrupted
  run (bit-exact on the CPU with the same world).

Under orch (2 nodes x 1 slot on this machine)::

    orch run examples/pipeline.yaml
    orch resume <job>            # after a failure: from the newest complete global_step<N>

Without orch, 2 processes on the CPU::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/pipe_train.py \\
        --deepspeed_config examples/ds_pipe.json --checkpoint-dir /tmp/pipe --steps 40
"""

import argparse
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see the module docstring."""
    p = argparse.ArgumentParser(description="pipeline-parallel training of a small MLP")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (train_batch calls) in all")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (the world size must be a multiple)")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--checkpoint-interval", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--checkpoint-dir", default=os.environ.get("ORCH_CHECKPOINT_DIR"),
                   help="default: $ORCH_CHECKPOINT_DIR")
    p.add_argument("--resume", action="store_true",
                   help="load the checkpoint DeepSpeed's latest names (implied by $ORCH_RESUME_TAG)")
    p.add_argument("--deepspeed_config", default=os.environ.get("ORCH_DEEPSPEED_CONFIG"),
                   help="default: $ORCH_DEEPSPEED_CONFIG")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "-1")),
                   help="passed by DeepSpeed's launcher")
    args = p.parse_args(argv)
    if not args.deepspeed_config:
        p.error("no DeepSpeed config: give --deepspeed_config or set ORCH_DEEPSPEED_CONFIG")
    if args.checkpoint_interval and not args.checkpoint_dir:
        p.error("--checkpoint-interval needs --checkpoint-dir or ORCH_CHECKPOINT_DIR")
    return args


def build_model(args: argparse.Namespace) -> PipelineModule:
    """Embedding, three hidden layers and the output layer, partitioned by parameter count."""
    h = args.hidden
    layers = [LayerSpec(nn.Embedding, args.vocab, h),
              LayerSpec(nn.Linear, h, h), nn.GELU(),
              LayerSpec(nn.Linear, h, h), nn.GELU(),
              LayerSpec(nn.Linear, h, h), nn.GELU(),
              LayerSpec(nn.Linear, h, args.vocab)]
    return PipelineModule(layers=layers, num_stages=args.stages, loss_fn=F.cross_entropy,
                          partition_method="parameters")


def micro_batches(args: argparse.Namespace, dp_rank: int, step: int, count: int, size: int):
    """The ``count`` micro batches ``(tokens, labels)`` of optimizer step ``step`` (1-based) for
    data-parallel rank ``dp_rank``, each of ``size`` tokens; the same on every stage, whatever the attempt."""
    for micro in range(count):
        gen = torch.Generator().manual_seed(((args.seed * 1000003 + dp_rank * 7919 + step) * 101) + micro)
        x = torch.randint(0, args.vocab, (size,), generator=gen)
        yield x, (3 * x + 1) % args.vocab


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)  # the same initial weights on every rank and every fresh start
    model = build_model(args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=args.deepspeed_config)
    rank = int(os.environ.get("RANK", "0"))
    resume_tag = os.environ.get("ORCH_RESUME_TAG") or None
    if args.resume or resume_tag:
        load_path, _ = engine.load_checkpoint(args.checkpoint_dir, tag=resume_tag)
        if load_path is None:
            print(f"[resume] rank={rank} nothing to load in {args.checkpoint_dir}", flush=True)
        else:
            print(f"[resume] rank={rank} loaded {load_path} global_step={engine.global_steps}", flush=True)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        loss = engine.train_batch(iter(micro_batches(args, engine.grid.data_parallel_id, step, gas, micro)))
        print(f"step={engine.global_steps} rank={rank} loss={loss.item()!r}", flush=True)
        if args.checkpoint_interval and engine.global_steps % args.checkpoint_interval == 0:
            engine.save_checkpoint(args.checkpoint_dir, tag=f"global_step{engine.global_steps}")
    print(f"[done] rank={rank} global_step={engine.global_steps}", flush=True)
    deepspeed.comm.barrier()  # no collective may still be in flight when the process leaves
    deepspeed.comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # all written, the group destroyed: skip the teardown gloo can abort (ds_plain_train.py)
