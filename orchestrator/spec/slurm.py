"""The spec's ``slurm`` section: the agents' srun steps, and from a login node the sbatch request (pure)."""

from __future__ import annotations

import shlex
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["SlurmOptions"]


class SlurmOptions(BaseModel):
    """How the ``slurm`` provisioner starts the agents inside the job's allocation, and how it asks for one
    from a login node (the spec's ``slurm``; see docs/launchers.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    srun_args: list[str] = Field(default_factory=list, description="More arguments of every agent's srun step "
                                 "(e.g. [--mpi=none]); orch sets --nodes, --ntasks, --nodelist, --overlap itself.")
    sbatch_args: list[str] = Field(default_factory=list, description="From a login node: more arguments of the "
                                   "sbatch that asks for each attempt's allocation (a string is split as a shell "
                                   "would), e.g. '--partition=gpu --time=4:00:00 --gpus-per-node=8'; orch sets "
                                   "--nodes, --ntasks-per-node, --job-name (and --nodelist from a hostfile, --exclude "
                                   "for lost nodes) itself; --output defaults to the attempt's run directory.")
    queue_timeout: float = Field(86400.0, gt=0, le=30 * 86400, description="From a login node: seconds an attempt "
                                 "waits for Slurm to grant its allocation (PENDING) before it fails and the request "
                                 "is cancelled.")

    @field_validator("sbatch_args", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("sbatch_args")
    @classmethod
    def _not_set_by_orch(cls, v: list[str]) -> list[str]:
        for arg in v:
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--") and len(flag) > 2:  # -N4: a short option with its value attached
                flag = flag[:2]
            why = _SBATCH_REFUSED.get(flag)
            if why:
                raise ValueError(f"{arg!r}: {why}")
        return v


_NODES = "orch sets it (nodes from num_nodes or the hostfile, ranks per node from num_gpus or the hostfile's slots)"
#: sbatch options ``slurm.sbatch_args`` may not carry, and why (the options sbatch documents, ``sbatch --help``)
_SBATCH_REFUSED = {
    **dict.fromkeys(("-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "-w", "--nodelist"), _NODES),
    **dict.fromkeys(("-x", "--exclude"), "list the hosts to leave out in the spec's exclude_hosts (orch adds the "
                                          "nodes a restart loses to them)"),
    **dict.fromkeys(("-J", "--job-name"), "orch names the job orch-<job id>-<attempt> (squeue shows it)"),
    "--parsable": "orch sets it (it reads the job id)",
    **dict.fromkeys(("--wrap", "-W", "--wait"), "orch gives sbatch its own script, which holds the allocation"),
    **dict.fromkeys(("-a", "--array"), "one attempt is one allocation: a job array would be several"),
    **dict.fromkeys(("--test-only",), "it would submit nothing: the attempt would wait for nodes never asked for"),
}
