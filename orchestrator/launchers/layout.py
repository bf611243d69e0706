"""Where ``deepspeed.launcher.launch`` puts a node's ranks, and how DeepSpeed's runner hands it the pool
(``--world_info``): pure functions of the pool, shared by the launchers (re-exported by :mod:`.deepspeed`)."""

from __future__ import annotations

import base64
import json
from typing import Sequence

__all__ = ["encode_world_info", "rank_layout"]


def encode_world_info(world: Sequence[tuple[str, Sequence[int]]]) -> str:
    """Return ``--world_info``: urlsafe base64 of ``json.dumps({host: [slot, ...]})``.

    Same as runner.py ``encode_world_info`` (``json.dumps`` of the ordered filtered pool with
    default separators, so ``{"a": [0, 1], "b": [0]}``).
    """
    info = {host: list(slots) for host, slots in world}
    return base64.urlsafe_b64encode(json.dumps(info).encode("utf-8")).decode("utf-8")


def rank_layout(world: Sequence[tuple[str, Sequence[int]]], node_rank: int,
                base: int | None = None) -> list[tuple[int, int, int]]:
    """Return ``[(global_rank, local_rank, slot), ...]`` of node ``node_rank``, in spawn order.

    Same as launch.py ``main()``: global ranks are numbered across nodes in order, and
    ``local_rank = global_rank % len(slots)`` (a rotation of ``0..n-1`` when an earlier node has
    a different slot count); ``slot`` is ``slots[local_rank]``, the device a script that uses
    ``cuda:LOCAL_RANK`` under ``CUDA_VISIBLE_DEVICES=<slots>`` ends up on. ``base``: the node's first rank, if known.
    """
    base = sum(len(slots) for _, slots in world[:node_rank]) if base is None else base
    slots = tuple(world[node_rank][1])
    return [(base + i, (base + i) % len(slots), slots[(base + i) % len(slots)]) for i in range(len(slots))]
