"""The ``standard`` launcher: ``torchrun`` on every node with a static rendezvous (torch 2.13).

Accelerate calls running ``torch.distributed.run`` on every machine with
``--nnodes/--node_rank/--master_addr/--master_port`` its ``standard`` launcher. Node ``k`` runs::

    torchrun --nnodes=N --node_rank=k --nproc_per_node=S_k --rdzv_backend=static
        --rdzv_id=<run_id> --max_restarts=<max_restarts> --master_addr=A --master_port=P
        [--module | --no_python] <script> <args>

with ``CUDA_VISIBLE_DEVICES=<that node's slots>`` in its environment (what Accelerate's
``--gpu_ids`` does), and its elastic agent starts ``S_k`` workers. :meth:`TorchrunLauncher.ranks`
gives every worker what torchrun gives it, found by running torch 2.13's torchrun with a probe
(tests/test_launchers_real.py) and read in its source:

==============================  ==================================================================
variable                        value (source)
==============================  ==================================================================
RANK                            ranks on nodes before k + local rank (agent/server/api.py
                                ``_assign_worker_ranks``: cumulative ``local_world_size`` in
                                group-rank order, so uneven slot counts are fine)
LOCAL_RANK                      0..S_k-1 (local_elastic_agent.py ``_set_local_rank_env``)
GROUP_RANK                      k (the node rank)
ROLE_RANK                       = RANK (one role)
ROLE_NAME                       ``default`` (``--role``)
LOCAL_WORLD_SIZE                S_k
WORLD_SIZE, ROLE_WORLD_SIZE     total ranks
GROUP_WORLD_SIZE                N
MASTER_ADDR, MASTER_PORT        the static rendezvous endpoint (``bootstrap_store_info``)
TORCHELASTIC_RESTART_COUNT      ``ctx.restart_count`` (torchrun: its own restarts so far)
TORCHELASTIC_MAX_RESTARTS       ``ctx.max_restarts``
TORCHELASTIC_RUN_ID             ``ctx.run_id`` (``--rdzv_id``, default ``none``)
TORCHELASTIC_USE_AGENT_STORE    ``True`` (static rendezvous ``use_agent_store``)
TORCHELASTIC_SIGNALS_TO_HANDLE  ``SIGTERM,SIGINT,SIGHUP,SIGQUIT`` (launcher/api.py
                                ``launch_agent`` puts it in os.environ, workers inherit it)
TORCH_NCCL_ASYNC_ERROR_HANDLING ``1`` if the node's environment lacks it (default)
OMP_NUM_THREADS                 ``1`` if the node's environment lacks it and S_k > 1 (run.py
                                ``config_from_args``; default)
CUDA_VISIBLE_DEVICES            passed through (set here to the node's slots, see above)
TORCHELASTIC_ERROR_FILE         torchrun: ``<tmp>/torchelastic_*/<run_id>_*/attempt_<r>/<local
                                rank>/error.json`` (multiprocessing/api.py ``DefaultLogsSpecs``);
                                NOT set by :meth:`ranks` — the agent may set a per-rank path in
                                the attempt's directory so ``@record`` writes its error report there
==============================  ==================================================================

The two "default" variables are returned by :meth:`TorchrunLauncher.env_defaults`, not in
``RankLaunch.env``: the agent must set them only where its node environment lacks them
(``orchestrator.launchers.compose_rank_env``); ``ctx.exports`` (part of torchrun's own
environment) override both.

argv (run.py ``config_from_args``; no ``--local-rank`` is passed, as ``use_env`` is True)::

    [python, "-u", ("-m",) script, *args]      or     [script, *args]    (--no_python)

where torchrun's ``python`` is ``$PYTHON_EXEC`` or its own ``sys.executable``; give ``ctx.python``
as that interpreter. ``ctx.no_local_rank`` has no effect here.

The store (static rendezvous, elastic/rendezvous/static_tcp_rendezvous.py): node 0's torchrun
agent hosts ``TCPStore(master_addr, master_port, world_size=N, is_master=True, timeout=600s,
multi_tenant=True)``; the other agents join it as clients. Workers see
``TORCHELASTIC_USE_AGENT_STORE=True``, so ``init_process_group`` (``env://``) makes a *client*
``TCPStore(MASTER_ADDR, MASTER_PORT, world_size=WORLD_SIZE, is_master=False)``
(torch/distributed/rendezvous.py ``_create_c10d_store``) and never listens: some process on node
0 must host the store, which is why :meth:`TorchrunLauncher.agent_store` asks orch's agent on
node 0 to. Key prefix: in torch 2.13 workers use the client store **without** a prefix (older
torch wrapped it in ``PrefixStore(f"/worker/attempt_{TORCHELASTIC_RESTART_COUNT}")``; 2.13 says
"we create a new TCPStore for every retry"); ``init_process_group`` then adds
``PrefixStore("default_pg")``. torchrun's agents keep their own keys under
``PrefixStore(run_id)`` (``torchelastic/role_info/<k>``, ``torchelastic/assigned_ranks/<k>``).

Things in a node's environment that change what real torchrun does and are *not* modelled
(keep them out of the agents' environment): ``PET_*`` (defaults of torchrun's options; the
command above names every option that matters), ``PYTHON_EXEC``,
``TORCH_ELASTIC_WORKER_IDENTICAL=1`` (wrong ranks with uneven slots),
``TORCHELASTIC_ENABLE_FILE_TIMER``/``TORCHELASTIC_TIMER_FILE`` (watchdog),
``TORCHELASTIC_HEALTH_CHECK_PORT``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LaunchError
from .base import LaunchContext, RankLaunch, RealCommand, check_context

__all__ = ["TorchrunLauncher", "STANDARD", "SIGNALS_TO_HANDLE", "ROLE_NAME"]

#: run.py ``--signals-to-handle`` default, exported by launcher/api.py ``launch_agent``.
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: run.py ``--role`` default.
ROLE_NAME = "default"


@dataclass(frozen=True)
class TorchrunLauncher:
    """``torchrun`` per node with ``--rdzv_backend=static`` (Accelerate's ``standard``).

    Attributes:
        name: ``"standard"``.
        visible_devices_env: variable set to the node's slots in torchrun's environment
            (Accelerate's ``--gpu_ids``), or ``None`` to leave the node's own value.
    """

    name: str = "standard"
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"

    def _check(self, ctx: LaunchContext, node_rank: int | None = None) -> None:
        check_context(self.name, ctx, "torchrun refuses '--no-python' with '--module'")
        if node_rank is not None and not 0 <= node_rank < len(ctx.world):
            raise LaunchError(f"{self.name}: node rank {node_rank} is not in 0..{len(ctx.world) - 1}")

    def ranks(self, ctx: LaunchContext, node_rank: int) -> list[RankLaunch]:
        """Return node ``node_rank``'s workers with torchrun's argv and variables (see module doc).

        ``env`` = ``ctx.exports``, then ``CUDA_VISIBLE_DEVICES`` and the agent's worker
        variables, which win over exports of the same name (as torchrun's ``worker_env``
        updates ``os.environ.copy()``). ``slot`` is ``slots[LOCAL_RANK]``.

        Raises:
            LaunchError: ``node_rank`` out of range, an empty pool or host, or ``no_python``
                with ``module``.
        """
        self._check(ctx, node_rank)
        slots = ctx.world[node_rank][1]
        base = ctx.rank_offsets[node_rank]
        common = dict(ctx.exports)
        if self.visible_devices_env:
            common[self.visible_devices_env] = ",".join(map(str, slots))
        common.update({
            "GROUP_RANK": str(node_rank),
            "ROLE_NAME": ROLE_NAME,
            "LOCAL_WORLD_SIZE": str(len(slots)),
            "WORLD_SIZE": str(ctx.world_size),
            "GROUP_WORLD_SIZE": str(len(ctx.world)),
            "ROLE_WORLD_SIZE": str(ctx.world_size),
            "MASTER_ADDR": ctx.master_addr,
            "MASTER_PORT": str(ctx.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(ctx.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(ctx.max_restarts),
            "TORCHELASTIC_RUN_ID": ctx.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,
        })
        argv: list[str] = []
        if not ctx.no_python:
            argv += [ctx.python, "-u"] + (["-m"] if ctx.module else [])
        argv += [ctx.entrypoint, *ctx.args]
        out = []
        for local_rank, slot in enumerate(slots):
            env = dict(common)
            env["RANK"] = str(base + local_rank)
            env["ROLE_RANK"] = str(base + local_rank)
            env["LOCAL_RANK"] = str(local_rank)
            out.append(RankLaunch(global_rank=base + local_rank, local_rank=local_rank, slot=slot,
                                  argv=tuple(argv), env=env))
        return out

    def env_defaults(self, ctx: LaunchContext, node_rank: int) -> dict[str, str]:
        """Variables torchrun sets on workers only where its own environment lacks them.

        ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (local_elastic_agent.py ``os.getenv(..., "1")``)
        and, when the node runs more than one worker, ``OMP_NUM_THREADS=1`` (run.py
        ``config_from_args``); each only if ``ctx.exports`` does not set it.
        """
        self._check(ctx, node_rank)
        out = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
        if len(ctx.world[node_rank][1]) > 1:
            out["OMP_NUM_THREADS"] = "1"
        return {k: v for k, v in out.items() if k not in ctx.exports}

    def warnings(self, ctx: LaunchContext) -> list[str]:
        """Nothing: torchrun passes arguments and environment without a shell."""
        return []

    def agent_store(self, ctx: LaunchContext, node_rank: int) -> tuple[str, int] | None:
        """``(master_addr, master_port)`` on node 0, else None.

        Node 0's agent must host a c10d TCPStore there before its workers start and keep it
        until they end, e.g. ``TCPStore(addr, port, is_master=True, wait_for_workers=False,
        multi_tenant=True)`` (torchrun passes ``world_size=N`` because its other agents join;
        orch's do not, so it must not wait for them). Workers store keys without a prefix (see
        the module docstring), so host a fresh store for every attempt to leave no stale keys.
        """
        self._check(ctx, node_rank)
        return (ctx.master_addr, ctx.master_port) if node_rank == 0 else None

    def real_commands(self, ctx: LaunchContext) -> list[RealCommand]:
        """One ``torchrun`` per node (``where=host``), in node order; ``env`` holds what the
        command's environment needs: ``ctx.exports`` and ``CUDA_VISIBLE_DEVICES=<slots>``.

        ``--rdzv_backend``, ``--rdzv_id`` and ``--max_restarts`` are always named so ``PET_*``
        variables on a node cannot change them. ``torchrun`` must run under ``ctx.python``
        (its workers run under torchrun's ``sys.executable``).
        """
        self._check(ctx)
        out = []
        for node_rank, (host, slots) in enumerate(ctx.world):
            argv = ["torchrun", f"--nnodes={len(ctx.world)}", f"--node_rank={node_rank}",
                    f"--nproc_per_node={len(slots)}", "--rdzv_backend=static",
                    f"--rdzv_id={ctx.run_id}", f"--max_restarts={ctx.max_restarts}",
                    f"--master_addr={ctx.master_addr}", f"--master_port={ctx.master_port}"]
            if ctx.module:
                argv.append("--module")
            if ctx.no_python:
                argv.append("--no_python")
            argv += [ctx.entrypoint, *ctx.args]
            env = dict(ctx.exports)
            if self.visible_devices_env:
                env[self.visible_devices_env] = ",".join(map(str, slots))
            out.append(RealCommand(where=host, argv=tuple(argv), env=env))
        return out


#: ``torchrun`` with a static rendezvous on every node.
STANDARD = TorchrunLauncher()
