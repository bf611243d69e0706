"""The ``deepspeed`` command line as a job spec: the arguments of DeepSpeed 0.19.8's runner
(``deepspeed/launcher/runner.py`` ``parse_args``) and what each becomes under ``orch deepspeed`` (pure).

``orch deepspeed [runner arguments] script.py [script arguments]`` takes every argument the
``deepspeed`` command takes, parsed the same way (same option strings, types, defaults and choices,
abbreviations allowed, the script and everything after it left to the script;
``tests/test_dropin_deepspeed.py`` holds :data:`RUNNER_OPTIONS` to the installed runner's parser).
:func:`runner_job` turns the parsed arguments into job spec fields, so the job is an ordinary one
(``orch status``, ``orch resume``, the dashboard). Each argument is either

* ``spec``: the spec field of the same meaning (``--hostfile`` -> ``hostfile``, ``--no_ssh`` ->
  ``launcher: nossh``, ``--ssh_port`` -> ``ssh.port``, ...);
* ``note``: it has no effect under orch, and ``orch deepspeed`` says why when it is given
  (``--node_rank``: orch starts every node's ranks itself; ``--save_pid``: the job has an id); or
* ``refused``: orch cannot do what it asks yet, and says so rather than run a different job
  (``--autotuning``; ``--bind_core_list`` with ``--bind_cores_to_rank``).

Where orch departs from the runner on purpose, :func:`runner_job` adds a note: ``--master_port``
unset is a free port orch picks (the runner takes 29500 whether or not it is free); a ``--hostfile``
given but missing is an error (the runner warns and runs on this machine alone).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import SpecError

__all__ = ["RUNNER_LAUNCHERS", "script_flag", "checkpoint_dir_from_script_args", "RunnerOption", "GivenAction", "add_options", "RUNNER_OPTIONS", "RUNNER_HOSTFILE", "RUNNER_MASTER_PORT", "add_runner_arguments",
           "RunnerJob", "runner_job", "script_job_name", "config_from_script_args"]

#: runner.py ``DLTS_HOSTFILE``: the hostfile read when ``--hostfile`` is not given.
RUNNER_HOSTFILE = "/job/hostfile"
#: runner.py ``LAUNCHER_CLASSES``: the launchers the runner knows by name (lower case).
RUNNER_LAUNCHERS = ("pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm")
#: ``TORCH_DISTRIBUTED_DEFAULT_PORT``: the runner's ``--master_port`` default.
RUNNER_MASTER_PORT = 29500


@dataclass(frozen=True)
class RunnerOption:
    """One argument of DeepSpeed's runner and what orch does with it.

    Attributes:
        flags: its option strings, as the runner declares them.
        dest: the attribute it sets.
        kind: ``"store"`` (takes a value) or ``"store_true"`` (a switch).
        type: the value's type (``str``, ``int``), for ``"store"``.
        default: the runner's default.
        choices: the values the runner accepts, or None for any.
        handling: ``"spec"``, ``"note"`` or ``"refused"`` (module docstring).
        meaning: what it does under orch, one line (``orch deepspeed --help``).
    """

    flags: tuple[str, ...]
    dest: str
    kind: str
    type: type | None
    default: Any
    handling: str
    meaning: str
    choices: tuple[str, ...] | None = None


def _o(flags: str, dest: str, kind: str, type_: type | None, default: Any, handling: str, meaning: str,
       choices: tuple[str, ...] | None = None) -> RunnerOption:
    return RunnerOption(tuple(flags.split()), dest, kind, type_, default, handling, meaning, choices)


_CORE_LIST = ("refused with --bind_cores_to_rank: launch.py splits the list among each node's local ranks, and "
              "orch's bind_cores takes a CPU list per slot instead; write the job with --print-spec FILE and set "
              "bind_cores: {slot: CPU list} there")

#: Every argument of DeepSpeed 0.19.8's runner, in its order (the two positionals, ``user_script``
#: and ``user_args``, are added by :func:`add_runner_arguments`).
RUNNER_OPTIONS: tuple[RunnerOption, ...] = (
    _o("-H --hostfile", "hostfile", "store", str, RUNNER_HOSTFILE, "spec",
       "hostfile: the DeepSpeed hostfile (missing at the default path: this machine only)"),
    _o("-i --include", "include", "store", str, "", "spec", "include: the resources to use, NODE[:SLOT,...]@..."),
    _o("-e --exclude", "exclude", "store", str, "", "spec", "exclude: the resources not to use"),
    _o("--num_nodes", "num_nodes", "store", int, -1, "spec", "num_nodes: the first N hosts of the hostfile"),
    _o("--num_gpus --num_accelerators", "num_gpus", "store", int, -1, "spec", "num_gpus: slots 0..N-1 of each host"),
    _o("--master_port", "master_port", "store", int, RUNNER_MASTER_PORT, "spec",
       "master_port (unset: a free port orch picks, where the runner takes 29500)"),
    _o("--master_addr", "master_addr", "store", str, "", "spec", "master_addr (unset: node 0's address)"),
    _o("--node_rank", "node_rank", "store", int, -1, "note", "not used: orch starts every node's ranks itself"),
    _o("--launcher", "launcher", "store", str, "pdsh", "spec",
       "launcher: pdsh, openmpi, mvapich, mpich, impi or slurm (orch plans the ranks as that launcher would)"),
    _o("--launcher_args", "launcher_args", "store", str, "", "spec", "launcher_args: the launcher's own arguments"),
    _o("--module", "module", "store_true", None, False, "spec", "module: run the script as python -m"),
    _o("--no_python", "no_python", "store_true", None, False, "spec", "no_python: run the script itself"),
    _o("--no_local_rank", "no_local_rank", "store_true", None, False, "spec",
       "no_local_rank: do not pass --local_rank=N"),
    _o("--no_ssh", "no_ssh", "store_true", None, False, "spec",
       "launcher: nossh (orch starts every node; no --node_rank needed)"),
    _o("--no_ssh_check", "no_ssh_check", "store_true", None, False, "note",
       "not used: orch's preflight reaches every node itself"),
    _o("--force_multi", "force_multi", "store_true", None, False, "spec",
       "force_multi: the launcher's multi-node path even for one node"),
    _o("--save_pid", "save_pid", "store_true", None, False, "note", "not used: the job has an id (orch status)"),
    _o("--enable_each_rank_log", "enable_each_rank_log", "store", str, "None", "note",
       "not used: orch keeps every rank's output in its own log (orch logs JOB --rank N)"),
    _o("--autotuning", "autotuning", "store", str, "", "refused",
       "refused: orch does not run DeepSpeed's autotuner; run it with deepspeed, then this job with its result",
       ("tune", "run")),
    _o("--bind_cores_to_rank", "bind_cores_to_rank", "store_true", None, False, "spec",
       "bind_cores: auto (each rank pinned to its share of the node's cores, OMP_NUM_THREADS set; on GPU nodes "
       "the cores of its GPU's NUMA node)"),
    _o("--bind_core_list", "bind_core_list", "store", str, None, "refused", _CORE_LIST),
    _o("--ssh_port", "ssh_port", "store", int, None, "spec", "ssh.port: the nodes' sshd port"),
    _o("--venv_script", "venv_script", "store", str, None, "spec",
       "python: the ranks run under the Python beside this activation script"),
    _o("--log_level", "log_level", "store", str, "info", "note", "not used: the runner's own logging",
       ("debug", "info", "warning", "error", "critical")),
    _o("-q --quiet", "quiet", "store_true", None, False, "note", "not used: the runner's own logging"),
)


class GivenAction(argparse.Action):
    """Store the value (as ``store`` / ``store_true`` do) and record that it was given on the command line."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        given = set(getattr(namespace, "runner_given", ()) or ())
        namespace.runner_given = given | {self.dest}


def add_options(group: Any, options: Sequence[RunnerOption]) -> None:
    """Add ``options`` to an argparse parser or group, each with :class:`GivenAction` (so the namespace's
    ``runner_given`` names those given), its type, default and choices as the real tool declares them."""
    for o in options:
        kw: dict[str, Any] = {"dest": o.dest, "default": o.default, "action": GivenAction, "help": o.meaning}
        if o.kind == "store_true":
            kw["nargs"] = 0
        else:
            kw["type"] = o.type
            if o.choices:
                kw["choices"] = list(o.choices)
        group.add_argument(*o.flags, **kw)


def add_runner_arguments(parser: argparse.ArgumentParser, title: str = "deepspeed's arguments") -> None:
    """Add every runner argument (:data:`RUNNER_OPTIONS`) and its two positionals, ``user_script`` and
    ``user_args`` (everything after the script, as the runner's ``argparse.REMAINDER``), to ``parser``.

    The parsed namespace also holds ``runner_given``: the dests given on the command line.
    """
    group = parser.add_argument_group(title, "the deepspeed command's own arguments, parsed as it parses them; "
                                      "after each, what it is under orch")
    add_options(group, RUNNER_OPTIONS)
    parser.add_argument("user_script", type=str, help="the training script (a module with --module, a program with "
                        "--no_python), then its arguments")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's arguments")


@dataclass(frozen=True)
class RunnerJob:
    """A ``deepspeed`` command line as job spec fields.

    Attributes:
        fields: job spec fields (``docs/jobspec.md``), paths absolute.
        notes: one sentence per argument given that does nothing under orch, or where orch departs
            from the runner, for the user to read before the job starts.
    """

    fields: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def script_job_name(script: str) -> str:
    """A job name from a script's path or module name: ``train.py`` -> ``train`` (letters, digits, ``.``,
    ``_``, ``-``; at most 63 characters; ``job`` if nothing is left)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(script).stem).lstrip("._-")[:63]
    return stem or "job"


def script_flag(args: Sequence[str], names: Sequence[str]) -> tuple[str, str] | None:
    """The value a script's arguments give one of ``names`` (``--flag VALUE`` or ``--flag=VALUE``), as
    argparse reads it: the last one given wins. Returns ``(flag as given, value)``, or None."""
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names and (eq or i + 1 < len(args)):
            found = (name, value if eq else args[i + 1])
    return found


def config_from_script_args(args: Sequence[str]) -> str | None:
    """The DeepSpeed config a script is given on its command line, as DeepSpeed's
    ``deepspeed.add_config_arguments`` reads it: ``--deepspeed_config FILE`` (or
    ``--deepspeed_config=FILE``; the deprecated ``--deepscale_config`` too). None when there is none."""
    found = script_flag(args, ("--deepspeed_config", "--deepscale_config"))
    return found[1] if found else None


#: The script arguments that name where a training script writes its checkpoints, by the names the usual
#: scripts give them (DeepSpeed's examples: ``--save_dir``; the HF Trainer's ``TrainingArguments``:
#: ``--output_dir``; others: ``--checkpoint_dir``, ``--ckpt_dir``), with ``-`` or ``_``.
CHECKPOINT_ARGS = ("--save_dir", "--output_dir", "--checkpoint_dir", "--ckpt_dir")


def checkpoint_dir_from_script_args(args: Sequence[str]) -> tuple[str, str] | None:
    """Where a script writes its checkpoints, read from its arguments: ``(flag, directory)`` of the last
    of :data:`CHECKPOINT_ARGS` given (``--save_dir DIR`` or ``--save_dir=DIR``, dashes or underscores), or None."""
    return script_flag(args, [n for flag in CHECKPOINT_ARGS for n in (flag, "--" + flag[2:].replace("_", "-"))])


def runner_job(ns: argparse.Namespace, cwd: str, *, hostfile_found: bool) -> RunnerJob:
    """Job spec fields from a parsed ``deepspeed`` command line (see :func:`add_runner_arguments`).

    Rules (runner.py ``main()``, DeepSpeed 0.19.8): ``--no_ssh`` makes the launcher ``nossh`` whatever
    ``--launcher`` says, which is lower-cased; ``--launcher_args`` is one string the spec splits as a
    shell would; a ``--deepspeed_config FILE`` among the script's arguments becomes the spec's
    ``deepspeed_config`` too (so ``orch plan`` checks it), while the script's arguments stay as given.

    Args:
        ns: the parsed namespace.
        cwd: the directory the command runs in (absolute): the job's ``workdir``; relative paths
            are taken from it.
        hostfile_found: whether ``--hostfile`` (or the runner's default, ``/job/hostfile``) names a
            file; the caller looks.

    Returns:
        The :class:`RunnerJob`.

    Raises:
        SpecError: an argument orch refuses, or ``--hostfile`` given and missing (every one named).
    """
    given = set(getattr(ns, "runner_given", ()) or ())
    problems = [f"--{o.dest} is not supported: {o.meaning.removeprefix('refused: ')}"
                for o in RUNNER_OPTIONS if o.handling == "refused" and o.dest in given and o.dest != "bind_core_list"]
    notes: list[str] = []
    if ns.bind_cores_to_rank and ns.bind_core_list is not None:
        problems.append(f"--bind_core_list is not supported: {_CORE_LIST.removeprefix('refused with --bind_cores_to_rank: ')}")
    elif ns.bind_core_list is not None:
        notes.append("--bind_core_list is not used: DeepSpeed's launch.py reads it only with --bind_cores_to_rank")
    script = ns.user_script.rsplit(".", 1)[-1] if ns.module else ns.user_script
    fields: dict[str, Any] = {"name": script_job_name(script), "workdir": cwd,
                              "entrypoint": ns.user_script, "args": list(ns.user_args)}
    if ns.bind_cores_to_rank:
        fields["bind_cores"] = "auto"
    hostfile = os.path.join(cwd, ns.hostfile)
    if hostfile_found:
        fields["hostfile"] = hostfile
    elif "hostfile" in given:
        problems.append(f"--hostfile {ns.hostfile!r}: not a file ({hostfile}); DeepSpeed's runner would warn and "
                        "run on this machine only, orch refuses so that a mistyped path does not start another job")
    for key in ("include", "exclude"):
        if getattr(ns, key):
            fields[key] = getattr(ns, key)
    for key in ("num_nodes", "num_gpus"):
        if getattr(ns, key) != -1:
            fields[key] = getattr(ns, key)
    if "master_port" in given:
        fields["master_port"] = ns.master_port
    else:
        notes.append(f"master port: a free one orch picks (DeepSpeed's runner takes {RUNNER_MASTER_PORT} whether or "
                     f"not it is free; --master_port {RUNNER_MASTER_PORT} for that)")
    if ns.master_addr:
        fields["master_addr"] = ns.master_addr
    launcher = str(ns.launcher).lower()
    if not ns.no_ssh and launcher not in RUNNER_LAUNCHERS:
        problems.append(f"--launcher {ns.launcher!r} is not one of the runner's launchers ({', '.join(RUNNER_LAUNCHERS)}; "
                        "--no_ssh for nossh). With one node the runner ignores the name and runs launch.py here, "
                        "as --launcher pdsh does; orch's own standard launcher (torchrun on every node) is "
                        "launcher: standard in a job spec (--print-spec FILE writes one)")
    fields["launcher"] = "nossh" if ns.no_ssh else launcher
    if ns.launcher_args:
        fields["launcher_args"] = ns.launcher_args
    for key in ("module", "no_python", "no_local_rank", "force_multi"):
        if getattr(ns, key):
            fields[key] = True
    if ns.ssh_port is not None:
        fields["ssh"] = {"port": ns.ssh_port}
    if ns.venv_script:
        script = os.path.join(cwd, os.path.expanduser(ns.venv_script))
        fields["python"] = os.path.join(os.path.dirname(script), "python")
        notes.append(f"--venv_script: the ranks run under {fields['python']} (orch does not source {ns.venv_script}; "
                     "set other variables it sets in the spec's env)")
    config = config_from_script_args(ns.user_args)
    if config is not None:
        fields["deepspeed_config"] = os.path.join(cwd, os.path.expanduser(config))
    notes += [f"--{o.dest} is {o.meaning}" for o in RUNNER_OPTIONS
              if o.handling == "note" and o.dest in given and getattr(ns, o.dest) != o.default]
    if problems:
        raise SpecError("The deepspeed command line has arguments orch cannot run:\n  " + "\n  ".join(problems))
    return RunnerJob(fields, notes)
