"""What a node's ranks get that depends on the node, not on the job: the accelerator's exports and ``node_env``.

DeepSpeed's runner decides which of its environment's variables reach remote ranks by the *head node's*
accelerator (``runner.py``: ``exports = EXPORT_ENVS + get_accelerator().export_envs()``), so a runner on a
CPU-only login node exports no ``NCCL_*`` at all, and one on a GPU node exports its own ``NCCL_*`` over
what each node sets. orch decides per node instead:

- :func:`accelerator_layers`: for each DeepSpeed accelerator that exports prefixes of its own
  (``cuda``: ``NCCL``; :data:`~orchestrator.launchers.deepspeed.ACCELERATOR_EXPORT_PREFIXES`), the
  controller's variables DeepSpeed's runner would export on a head node of that accelerator. The plan
  carries them on every node (``NodePlan.accelerator_env``); the node's agent applies the layer of *its*
  accelerator (``agents.nodeenv.node_accelerator``, reported in its hello), and only where the node's own
  environment lacks the variable: a node that sets ``NCCL_SOCKET_IFNAME`` keeps it.
- :func:`node_env_layer`: the spec's ``node_env`` entries whose host pattern matches the node, laid over
  the spec's ``env`` and the runner's exports; the launcher's own variables and orch's still win, and a
  pattern naming one of them is an error (it would silently do nothing).

Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping

from ..errors import PlanError
from ..launchers.deepspeed import ACCELERATOR_EXPORT_PREFIXES, pdsh_exports

__all__ = ["accelerator_layers", "node_env_layer", "unmatched_patterns", "with_node_env"]


def accelerator_layers(controller_env: Mapping[str, str], cwd: str, exports: Mapping[str, str],
                       spec_env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Accelerator name -> the controller's variables DeepSpeed's runner exports for that accelerator only.

    Same selection as ``runner.py main()`` with ``get_accelerator().export_envs()`` of that accelerator
    (:func:`~orchestrator.launchers.deepspeed.pdsh_exports`, ``EXCLUDE_ENVS`` honoured), less what is
    exported anyway (``exports``: the runner's own prefixes and ``.deepspeed_env``) and what the spec's
    ``env`` sets. Accelerators with no prefix of their own, or whose layer is empty, are left out.

    Args:
        controller_env: the environment the runner (orch's controller) runs with.
        cwd: the runner's absolute working directory (for the exported ``PYTHONPATH``).
        exports: what the runner exports whatever the accelerator (``pdsh_exports`` with none).
        spec_env: the spec's ``env``.

    Returns:
        e.g. ``{"cuda": {"NCCL_DEBUG": "INFO"}, "sdaa": {"NCCL_DEBUG": "INFO"}}``.
    """
    out: dict[str, dict[str, str]] = {}
    for accelerator, prefixes in ACCELERATOR_EXPORT_PREFIXES.items():
        if not prefixes:
            continue
        layer = {k: v for k, v in pdsh_exports(controller_env, cwd, accelerator_exports=prefixes).items()
                 if k not in exports and k not in spec_env}
        if layer:
            out[accelerator] = layer
    return out


def node_env_layer(node_env: Mapping[str, Mapping[str, str]], host: str) -> dict[str, str]:
    """The spec's ``node_env`` for ``host``: every entry whose pattern matches the host name
    (``fnmatch.fnmatchcase``: shell patterns, case-sensitive), merged in the order written (a later
    entry wins)."""
    out: dict[str, str] = {}
    for pattern, variables in node_env.items():
        if fnmatch.fnmatchcase(host, pattern):
            out.update(variables)
    return out


def unmatched_patterns(node_env: Mapping[str, Mapping[str, str]], hosts: list[str] | tuple[str, ...]) -> list[str]:
    """The plan's warnings for ``node_env`` patterns that match none of ``hosts`` (a typo, or hosts the
    filters left out)."""
    distinct = list(dict.fromkeys(hosts))
    return [f"node_env: pattern {pattern!r} matches no node of this plan (hosts: {', '.join(distinct[:5])}"
            f"{', ...' if len(distinct) > 5 else ''})"
            for pattern in node_env if not any(fnmatch.fnmatchcase(h, pattern) for h in distinct)]


def with_node_env(ranks: tuple, layer: Mapping[str, str], host: str, spec_env: Mapping[str, str],
                  exports: Mapping[str, str], later: Mapping[str, str], launcher: str) -> tuple:
    """Node ``host``'s ranks (``RankPlan``) with its ``node_env`` layer laid over their environment.

    The layer wins over the spec's ``env`` and the runner's ``exports``, as a more specific ``env`` would.

    Args:
        ranks: the node's ``RankPlan`` s, planned without the layer.
        layer: :func:`node_env_layer` for the node (empty: ``ranks`` returned as they are).
        spec_env, exports: the spec's ``env`` and the runner's exports (what the layer may override).
        later: the layers orch lays over the launcher's (Accelerate's and ``ORCH_*``).
        launcher: the launcher's name (for the error).

    Raises:
        PlanError: the layer names a variable the launcher or orch sets on the ranks (``RANK``,
            ``MASTER_ADDR``, ``ORCH_*``...), which ``node_env`` cannot change.
    """
    if not layer or not ranks:
        return ranks
    first = ranks[0].env
    owned = sorted(k for k in layer if k in later or (k in first and k not in spec_env and k not in exports))
    if owned:
        raise PlanError(f"node_env for {host}: {', '.join(owned)} set by the {launcher} launcher or orch on every "
                        "rank; node_env cannot change it (remove it from node_env)")
    cls = type(ranks[0])
    return tuple(cls(r.global_rank, r.local_rank, r.slot, r.argv, {**r.env, **layer}) for r in ranks)
