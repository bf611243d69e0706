"""Provisioners start one agent per node of a plan and carry its message stream.

``get_provisioner(name)`` returns the provisioner a spec names. ``local`` (the embedded
default) runs every node's agent as a subprocess of the controller on this machine;
``ssh`` and ``ray`` are named in the spec schema and come in later versions.
"""

from __future__ import annotations

from ..errors import ProvisionError
from .base import AgentHandle, Provisioner
from .local import LocalProvisioner

__all__ = ["AgentHandle", "Provisioner", "LocalProvisioner", "get_provisioner"]


def get_provisioner(name: str) -> Provisioner:
    """Return the provisioner called ``name``.

    Raises:
        ProvisionError: the provisioner is not available in this version.
    """
    if name == "local":
        return LocalProvisioner()
    raise ProvisionError(f"provisioner '{name}' is not available in this version of orch; "
                         "use provisioner: local")
