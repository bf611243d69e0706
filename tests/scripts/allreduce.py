"""A cheap collective rank: a gloo all-reduce every step, so a dead or silent peer stops the others as in training.

For the tests of what a provisioner does (detection, cleanup on every host, an agent on a spare, warm agents)
where DeepSpeed adds nothing: it starts in about the time of ``import torch``, joins the job's process group
from the launcher's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; gloo, on the interface
``GLOO_SOCKET_IFNAME`` names as a DeepSpeed rank would), and each step all-reduces one tensor: a killed peer
breaks the collective at once (connection reset), a cut or stopped one blocks it, as in real training.

Each step prints the line examples/train_gpt.py prints (tests/helpers_train.py ``TRAIN_RE`` reads it; orch
shows the rank's step and loss from it)::

    [train] step=<n> rank=<global rank> loss=<x> lr=0.0

with ``loss`` the same on every rank (it is computed from the reduced sum). Configured by environment:
``ALLREDUCE_STEPS`` (default 10; 0: until stopped), ``ALLREDUCE_STEP_S`` (default 0.05 s between steps),
``ALLREDUCE_TIMEOUT_S`` (default 600: the process group's timeout).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
steps = int(os.environ.get("ALLREDUCE_STEPS", "10"))
step_s = float(os.environ.get("ALLREDUCE_STEP_S", "0.05"))
timeout = datetime.timedelta(seconds=float(os.environ.get("ALLREDUCE_TIMEOUT_S", "600")))

dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
print(f"[setup] rank={rank} world_size={world} node_rank={os.environ.get('ORCH_NODE_RANK', '?')} "
      f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
step = 0
while steps == 0 or step < steps:
    step += 1
    value = torch.tensor([float(rank + step)])
    dist.all_reduce(value)  # the sum over ranks of (rank + step): world * step + world * (world - 1) / 2
    loss = 10.0 / (value.item() / world)
    sys.stdout.write(f"[train] step={step} rank={rank} loss={loss!r} lr=0.0\n")
    sys.stdout.flush()
    time.sleep(step_s)
dist.barrier()
dist.destroy_process_group()
print(f"[done] rank={rank} global_step={step}", flush=True)
sys.stderr.flush()
os._exit(0)  # not the interpreter's teardown, where gloo's threads can abort it (examples/ds_plain_train.py)
