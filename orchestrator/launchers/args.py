"""What a launcher's own arguments (the spec's ``launcher_args``) do that orch must know of.

Two things: options that *place* ranks, which the hostfile and the include/exclude/num_nodes/
num_gpus filters decide (refused, with the options named), and options that *set variables* on
the ranks, which emulated ranks must get too (Open MPI's ``-x NAME=VALUE``, Hydra's ``-genv`` and
``-env``). The option spellings follow each tool's parser: Open MPI takes ``-np`` and ``--np``
alike; Hydra (MPICH, Intel MPI, MVAPICH2) strips any number of leading dashes (``--ppn`` is
``-ppn``); srun (getopt_long) takes ``-n8`` for ``-n 8`` and any unambiguous prefix of a long
option (``--nodel`` for ``--nodelist``).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["placing", "env_from_args", "PLACING"]

#: Per launcher family, the options that place ranks: (exact spellings, long options srun abbreviates,
#: short options that may carry their value attached).
PLACING: dict[str, tuple[frozenset[str], tuple[str, ...], frozenset[str]]] = {
    "openmpi": (frozenset({"-n", "-np", "--np", "-c", "-H", "-host", "--host", "-hostfile", "--hostfile",
                           "-machinefile", "--machinefile", "-default-hostfile", "--default-hostfile", "-N",
                           "-npernode", "--npernode", "-npersocket", "--npersocket", "-pernode", "--pernode",
                           "-map-by", "--map-by", "-rank-by", "--rank-by", "-rf", "--rankfile", "-app", "--app",
                           "-bynode", "--bynode", "-byslot", "--byslot", "-ppr", "--ppr"}), (), frozenset()),
    "hydra": (frozenset({"n", "np", "ppn", "perhost", "hosts", "host", "f", "hostfile", "machinefile", "machine",
                         "machines", "configfile", "rr", "grr"}), (), frozenset()),
    "slurm": (frozenset({"-n", "-N", "-w", "-x", "-m", "-r", "-F"}),
              ("--ntasks", "--nodes", "--nodelist", "--ntasks-per-node", "--ntasks-per-socket", "--ntasks-per-core",
               "--ntasks-per-gpu", "--exclude", "--distribution", "--relative", "--multi-prog", "--nodefile",
               "--spread-job"), frozenset({"-n", "-N", "-w", "-x", "-m", "-r", "-F"})),
    "pdsh": (frozenset({"-w", "-x", "-g", "-X", "-a"}), (), frozenset({"-w", "-x", "-g", "-X"})),
}


def _placing_one(arg: str, family: str) -> bool:
    exact, longs, attached = PLACING[family]
    if family == "hydra":
        return arg.startswith("-") and arg.lstrip("-").split("=", 1)[0] in exact
    name = arg.split("=", 1)[0]
    if name in exact:
        return True
    if longs and name.startswith("--") and len(name) > 3:
        return any(opt.startswith(name) for opt in longs)
    return len(arg) > 2 and not arg.startswith("--") and arg[:2] in attached


def placing(args: Sequence[str], family: str) -> list[str]:
    """The options of ``args`` that place ranks for ``family`` (``openmpi``, ``hydra``, ``slurm``,
    ``pdsh``); values are not options (the word after an option taking one is skipped only by
    not starting with ``-``)."""
    return [a for a in args if a.startswith("-") and _placing_one(a, family)]


def env_from_args(args: Sequence[str], family: str) -> tuple[dict[str, str], list[str]]:
    """The variables ``args`` set on every rank, and warnings for those orch cannot know.

    Open MPI: ``-x NAME=VALUE`` (``-x NAME`` forwards mpirun's own value: a warning). Hydra:
    ``-genv NAME VALUE``, ``-genv NAME=VALUE``, ``-env ...`` (one argument set: all ranks here);
    ``-genvlist``/``-envlist`` and ``-genvnone``/``-envnone`` only warn. Dashes as the tool reads them.
    """
    env: dict[str, str] = {}
    notes: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.lstrip("-") if family == "hydra" else arg
        if family == "openmpi" and arg in ("-x", "--x") and i + 1 < len(args):
            key, eq, value = args[i + 1].partition("=")
            if eq:
                env[key] = value
            else:
                notes.append(f"launcher_args -x {key} forwards {key} from mpirun's own environment; orch's agents "
                             f"give the ranks their node's environment: set {key} in the spec's env to send it")
            i += 2
            continue
        if family == "hydra" and name in ("genv", "env") and i + 1 < len(args):
            key, eq, value = args[i + 1].partition("=")
            if eq:
                env[key] = value
                i += 2
            elif i + 2 < len(args):
                env[key] = args[i + 2]
                i += 3
            else:
                i += 2
            continue
        if family == "hydra" and name in ("genvlist", "envlist", "genvnone", "envnone", "genvall", "envall"):
            notes.append(f"launcher_args {arg} changes which of mpiexec's variables the ranks get; orch's agents "
                         "give the ranks their node's environment and the spec's env")
        i += 1
    return env, notes
