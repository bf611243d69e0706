"""Provisioners start one agent per node of a plan and carry its message stream.

``get_provisioner(name)`` returns the provisioner a spec names. ``local`` (the embedded
default) runs every node's agent as a subprocess of the controller on this machine;
``ssh`` starts each node's agent over SSH (paramiko); ``ray`` places each node's agent as a
Ray actor pinned to that node; ``slurm`` runs each node's agent as an ``srun`` step of the
allocation orch runs in (from a login node: of the one it asks Slurm for, attempt by attempt).

May import: ``orchestrator.errors``, ``launchers``, ``spec``, ``planning``, and ``agents`` (the agent
process they start, its message link, the marker sweep).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import lazy_names
from ..errors import ProvisionError

if TYPE_CHECKING:
    from ..spec import JobSpec
    from .base import AgentHandle, Provisioner
    from .local import LocalProvisioner

#: Where each class lives; imported on first use (PEP 562): :data:`REATTACHING` alone (``orch list``'s orphan
#: check) needs neither the planner nor the agents' modules.
_WHERE = {"AgentHandle": "base", "Provisioner": "base", "LocalProvisioner": "local"}


__getattr__ = lazy_names(__name__, _WHERE)

__all__ = ["AgentHandle", "Provisioner", "LocalProvisioner", "get_provisioner", "REATTACHING"]

#: The provisioners whose running agents a new controller can take over (``Provisioner.reattaches``).
REATTACHING = frozenset({"local", "ssh"})


def get_provisioner(name: str, spec: "JobSpec | None" = None, look_only: bool = False) -> "Provisioner":
    """Return the provisioner called ``name``, configured from ``spec`` (its ``python``, ``ssh``).

    ``look_only``: for ``orch plan``, which starts nothing (a Ray provisioner then reads the cluster
    without joining it, and starts no Ray).

    Raises:
        ProvisionError: the provisioner is not available in this version.
    """
    if name == "local":
        from .local import LocalProvisioner
        return LocalProvisioner()
    if name == "ssh":
        from .ssh import SSHProvisioner
        return SSHProvisioner(spec.ssh if spec is not None else None, spec.python if spec is not None else None)
    if name == "ray":
        from ..spec import RayOptions
        from .ray import RayProvisioner
        return RayProvisioner(spec.ray if spec is not None else RayOptions(), spec.python if spec is not None else None,
                              look_only=look_only)
    if name == "slurm":
        from .slurm import SlurmProvisioner
        if spec is None:
            return SlurmProvisioner()
        return SlurmProvisioner(tuple(spec.slurm.srun_args), spec.python, sbatch_args=tuple(spec.slurm.sbatch_args),
                                queue_timeout=spec.slurm.queue_timeout)
    raise ProvisionError(f"provisioner '{name}' is not available in this version of orch; "
                         "use provisioner: local")
