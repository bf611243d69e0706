"""Sections and value types of the job spec that stand on their own (``ssh``, ``ray``, ``preflight``,
``node_env``, ``bind_cores``); :mod:`.jobspec` assembles them. Every field is documented in docs/jobspec.md."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SSHOptions", "RayOptions", "PreflightOptions", "BindCores", "bind_cores_value", "parse_cpu_list",
           "node_env_problem"]

_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _scalar_to_str(value: Any) -> Any:
    """YAML turns ``1`` into an int: accept numbers as strings. Booleans and the rest are left
    for validation to refuse (``true`` is ambiguous: "true"? "1"? "True"?)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


class SSHOptions(BaseModel):
    """How the ``ssh`` provisioner reaches the nodes (the spec's ``ssh`` section).

    Every field left unset falls back to the user's ``~/.ssh/config`` (``User``, ``Port``,
    ``IdentityFile``, ``UserKnownHostsFile``, ``HostName``) and then to OpenSSH's
    defaults (the current user, port 22, the default keys and an ssh agent, ``~/.ssh/known_hosts``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    user: str | None = Field(None, min_length=1, description="Login user on every node.")
    port: int | None = Field(None, ge=1, le=65535, description="sshd port on every node.")
    identity_file: str | None = Field(None, description="Private key file (must be readable by the user only).")
    known_hosts: str | None = Field(None, description="known_hosts file the nodes' host keys are checked against.")
    host_key_policy: Literal["verify", "accept-new"] = Field(
        "verify", description="verify: an unknown or changed host key is an error; accept-new: unknown keys "
        "are added to known_hosts (changed keys are still an error), like OpenSSH's StrictHostKeyChecking=accept-new.")
    connect_timeout: float = Field(10.0, gt=0, le=600, description="Seconds to connect and log in to one node.")
    max_parallel: int = Field(32, ge=1, le=4096, description="Nodes connected to at once.")
    config_file: str | None = Field(None, description="ssh client config to read (default ~/.ssh/config).")


class RayOptions(BaseModel):
    """Which Ray cluster the ``ray`` provisioner uses (the spec's ``ray`` section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field("local", min_length=1, description="local: start Ray on this machine; auto: the "
                         "cluster `ray start` made here (or $RAY_ADDRESS); host:port: that cluster's GCS; "
                         "ray://host:port: through Ray Client.")
    connect_timeout: float = Field(30.0, gt=0, le=600, description="Seconds to reach the cluster.")


class PreflightOptions(BaseModel):
    """What every node checks before the first rank starts (the spec's ``preflight`` section;
    ``preflight: false`` is short for ``{enabled: false}``). See docs/jobspec.md."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Run the preflight checks; false: ranks start right after every "
                          "node's agent is up.")
    shared_checkpoint_dir: bool = Field(True, description="Check that every node sees the same checkpoint_dir "
                                        "(shared storage); false for node-local checkpoint directories.")
    import_deepspeed: bool = Field(False, description="Import deepspeed under the spec's Python (seconds per "
                                   "node) instead of only finding deepspeed and torch (milliseconds).")
    nvme_min_free_gb: float = Field(1.0, ge=0, description="GiB each nvme_path of an NVMe-offload job must have "
                                    "free on every node (check nvme); 0: no minimum.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value




#: ``bind_cores``: ``off`` (default: ranks inherit the agent's CPUs), ``auto`` (each rank pinned to the cores
#: of its GPU's NUMA node, shared evenly among the node's ranks on that NUMA node), or a map slot -> CPU list
#: (``{0: "0-11", 1: "12-23"}``, Linux cpulist syntax as in ``/sys/devices/system/node/node0/cpulist``).
BindCores = Literal["off", "auto"] | dict[int, str]


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs of a Linux cpulist (``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``), sorted, no duplicates.

    The format is the kernel's (``Documentation/admin-guide/cputopology.rst``; ``numactl --physcpubind``
    takes the same); an optional ``:stride`` is not accepted.

    Raises:
        ValueError: empty, or a part is not ``N`` or ``N-M`` with ``N <= M`` (the message names the part).
    """
    cpus: set[int] = set()
    if not str(text).strip():
        raise ValueError("expected a CPU list such as 0-11 or 0-5,12-17; got nothing")
    for part in str(text).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"{part.strip()!r} in CPU list {text!r} is not N or N-M (N <= M), e.g. 0-11,24-35")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return sorted(cpus)


def bind_cores_value(value: Any) -> Any:
    """``bind_cores`` as written -> :data:`BindCores`: ``auto``/``off`` (``false`` is short for off), or a
    map slot -> CPU list whose lists parse (:func:`parse_cpu_list`); YAML's ints become strings.

    Raises:
        ValueError: anything else (the message says what was expected).
    """
    if value is False:
        return "off"
    if isinstance(value, str) or value is None:
        if value in ("auto", "off"):
            return value
        raise ValueError(f"expected auto, off, or a map slot -> CPU list ({{0: \"0-11\"}}); got {value!r}")
    if not isinstance(value, dict) or not value:
        raise ValueError(f"expected auto, off, or a map slot -> CPU list ({{0: \"0-11\"}}); got {value!r}")
    out = {}
    for slot, cpus in value.items():
        if isinstance(slot, bool) or not (isinstance(slot, int) or (isinstance(slot, str) and slot.isdigit())):
            raise ValueError(f"key {slot!r}: expected a slot number (the hostfile's GPU index, 0, 1, ...)")
        text = str(cpus) if isinstance(cpus, int) and not isinstance(cpus, bool) else cpus
        if not isinstance(text, str):
            raise ValueError(f"slot {slot}: expected a CPU list such as \"0-11\"; got {cpus!r}")
        parse_cpu_list(text)
        out[int(slot)] = text.strip()
    return out


def node_env_problem(pattern: Any, variables: Any) -> str | None:
    """What is wrong with one ``node_env`` entry (``pattern: {NAME: value}``), or None.

    ``pattern`` is a shell pattern (``fnmatch``, case-sensitive) matched against the hostfile's host names;
    ``variables`` a map of environment variable names to strings (numbers are taken as strings)."""
    if not isinstance(pattern, str) or not pattern.strip():
        return f"key {pattern!r}: expected a host name or shell pattern (gpu-a100-*)"
    if not isinstance(variables, dict):
        return f"{pattern}: expected a map of variables (NCCL_SOCKET_IFNAME: ib0); got {variables!r}"
    for key, value in variables.items():
        if not isinstance(key, str) or not _ENV_KEY_RE.match(key):
            return (f"{pattern}: variable name {key!r} is not a valid environment variable name (letters, digits "
                    "and '_', not starting with a digit)")
        if not isinstance(_scalar_to_str(value), str):
            return f"{pattern}.{key}: expected a string value; got {value!r}"
    return None
