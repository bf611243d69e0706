"""Launchers: how each rank of a job is started, exactly as a real launcher would start it.

Supported (``spec.launcher``, case-insensitive like DeepSpeed's ``runner.py``, which lowers
``--launcher``):

* ``pdsh``     — DeepSpeed's default: ``pdsh`` from the controller runs
  ``deepspeed.launcher.launch`` on every node (:mod:`.deepspeed`).
* ``nossh``    — ``deepspeed --no_ssh --node_rank=<n>`` on every node (:mod:`.deepspeed`).
* ``standard`` — ``torchrun`` with a static rendezvous on every node (:mod:`.torchrun`).
* ``openmpi``, ``mpich``, ``impi``, ``mvapich`` — DeepSpeed's MPI runners: the ranks get what
  that MPI's ``mpirun`` and DeepSpeed's discovery give them (:mod:`.mpi`).
* ``slurm`` — DeepSpeed's ``srun`` runner (:mod:`.slurm`).

The MPI launchers and slurm also have ``native_command(ctx, log_dir)``: the real tool's command
for ``launch_mode: native``, run by node 0's agent.

Every launcher object has ``name``, ``ranks(ctx, node_rank)``, ``real_commands(ctx)``,
``agent_store(ctx, node_rank)`` (the :class:`~.base.Launcher` protocol) and
``env_defaults(ctx, node_rank)``: variables the real tool sets on a rank only where its node's
environment lacks them. An agent builds a rank's environment with :func:`compose_rank_env`.

Example::

    launcher = get_launcher(spec.launcher)
    for rank in launcher.ranks(ctx, node_rank):
        env = compose_rank_env(os.environ, launcher.env_defaults(ctx, node_rank), rank.env)

Pure: no processes, files or sockets. May import: ``orchestrator.errors``.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import LaunchError
from .base import LaunchContext, Launcher, RankLaunch, RealCommand
from .deepspeed import NOSSH, PDSH, DeepSpeedLauncher, pdsh_exports
from .mpi import IMPI, MPICH, MVAPICH, OPENMPI, MPILauncher
from .slurm import SLURM, SlurmLauncher
from .torchrun import STANDARD, TorchrunLauncher

__all__ = [
    "LAUNCHERS",
    "UNSUPPORTED_LAUNCHERS",
    "get_launcher",
    "compose_rank_env",
    "LaunchContext",
    "Launcher",
    "RankLaunch",
    "RealCommand",
    "DeepSpeedLauncher",
    "TorchrunLauncher",
    "MPILauncher",
    "SlurmLauncher",
    "pdsh_exports",
]

#: name -> launcher, for every launcher orch can run.
LAUNCHERS: dict[str, Launcher] = {"pdsh": PDSH, "standard": STANDARD, "nossh": NOSSH, "openmpi": OPENMPI,
                                  "mpich": MPICH, "impi": IMPI, "mvapich": MVAPICH, "slurm": SLURM}
#: DeepSpeed launchers (deepspeed/launcher/constants.py) that orch knows but cannot run yet.
UNSUPPORTED_LAUNCHERS: tuple[str, ...] = ()


def get_launcher(name: str) -> Launcher:
    """Return the launcher called ``name`` (case-insensitive).

    Raises:
        LaunchError: ``name`` is not a supported launcher; the message lists the supported ones
            and says when ``name`` is a known DeepSpeed launcher that orch does not support yet.
    """
    key = str(name).strip().lower()
    if key in LAUNCHERS:
        return LAUNCHERS[key]
    supported = ", ".join(LAUNCHERS)
    if key in UNSUPPORTED_LAUNCHERS:
        raise LaunchError(f"launcher {name!r} is a known DeepSpeed launcher but orch does not "
                          f"support it yet; use one of: {supported}")
    raise LaunchError(f"unknown launcher {name!r}; expected one of: {supported}")


def compose_rank_env(node_env: Mapping[str, str], defaults: Mapping[str, str],
                     overlay: Mapping[str, str]) -> dict[str, str]:
    """Return a rank's environment: ``node_env``, ``defaults`` where it lacks them, ``overlay`` on top.

    ``defaults`` is ``launcher.env_defaults(ctx, node_rank)`` and ``overlay`` is ``rank.env``.
    Equal to ``agents.ranks.compose_env(node_env, overlay)`` when ``defaults`` is empty.
    """
    env = dict(node_env)
    for key, value in defaults.items():
        env.setdefault(key, value)
    env.update(overlay)
    return env
