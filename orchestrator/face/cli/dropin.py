"""The drop-in commands: ``orch deepspeed ...`` runs what ``deepspeed ...`` would, under orch, and
``orch accelerate-launch ...`` what ``accelerate launch ...`` would.

The command line is parsed as the real tool parses it (``orchestrator.spec.deepspeed_cmd``), made
into an ordinary job spec, shown (``--print-spec FILE`` writes it), and then run in the foreground
as ``orch run`` runs a spec (``--submit``: handed to the running ``orch server``; ``--plan``: shown
as ``orch plan`` shows it, nothing started), so ``orch status``, ``orch resume``, ``orch logs``,
the dashboard and the API see an ordinary job.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any, Callable

import yaml

from .output import Parser, UsageError, err_console

__all__ = ["DROPINS", "run_dropin", "dropin_help"]


def _orch_options(parser: argparse.ArgumentParser, tool: str) -> None:
    """orch's own options of a drop-in command (none of them is a ``tool`` argument)."""
    from .options import common_options, env_patterns
    common_options(parser, top=True)
    g = parser.add_argument_group("orch's options", f"what {tool} does not have; give them before the script")
    g.add_argument("--name", default=None, help="the job's name (default: the script's name)")
    g.add_argument("--provisioner", choices=["auto", "local", "ssh", "ray", "slurm"], default="auto",
                   help="how each node's agent is started (default auto: local when every host is this machine, "
                        "else ssh)")
    g.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="where the script writes its checkpoints, which orch watches and resumes from (default: "
                        "the script's own --save_dir, --output_dir, --checkpoint_dir or --ckpt_dir, if it has one)")
    g.add_argument("--env-passthrough", type=env_patterns, action="extend", metavar="NAME[,PATTERN...]", default=None,
                   help="with --submit, copy these variables (names or shell patterns) from this shell to every rank "
                        "(run here, the ranks of local nodes inherit this shell's environment as under the real tool)")
    g.add_argument("--print-spec", metavar="FILE", default=None,
                   help="write the equivalent job spec (YAML) to FILE ('-': standard output, and start nothing)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="show the plan, as orch plan does, and start nothing")
    mode.add_argument("--submit", action="store_true",
                      help="hand the job to the running orch server and return (default: run it here, in the "
                           "foreground, as orch run does)")


def deepspeed_parser() -> Parser:
    """``orch deepspeed``'s parser: orch's options, then every argument of DeepSpeed's runner."""
    from ...spec.deepspeed_cmd import add_runner_arguments
    p = Parser(prog="orch deepspeed", usage="orch deepspeed [orch options] [deepspeed options] script.py [args ...]",
               description="Run a deepspeed command line under orch: the same arguments, parsed as DeepSpeed "
               "0.19.8's runner parses them, the same ranks with the same environment and argv, with orch's "
               "supervision, logs, metrics and resume. Change `deepspeed` to `orch deepspeed`.",
               epilog="Example: orch deepspeed --hostfile hostfile --include 'worker-0:0,1@worker-1' train.py "
               "--deepspeed --deepspeed_config ds.json")
    _orch_options(p, "deepspeed")
    add_runner_arguments(p)
    return p


def accelerate_parser() -> Parser:
    """``orch accelerate-launch``'s parser: orch's options, then ``accelerate launch``'s (DeepSpeed's launch)."""
    from ...spec.accelerate_cmd import add_launch_arguments
    p = Parser(prog="orch accelerate-launch", allow_abbrev=False,
               usage="orch accelerate-launch [orch options] [accelerate launch options] script.py [args ...]",
               description="Run an accelerate launch command line (Accelerate's DeepSpeed launch) under orch: "
               "the same config file and flags with the same precedence, the same ranks with the same "
               "environment and argv, with orch's supervision, logs, metrics and resume. The micro batch is "
               "left to the script's Accelerate, as accelerate launch leaves it (docs/accelerate.md).",
               epilog="Example: orch accelerate-launch --config_file accel.yaml train.py --lr 1e-4")
    _orch_options(p, "accelerate launch")
    add_launch_arguments(p)
    return p


def _is_here(host: str, here: set[str]) -> bool:
    return host in here or host.startswith("127.") or host == "::1"


def _provisioner(choice: str, hostfile: str | None) -> str:
    """``auto``: ``local`` without a hostfile or when every host in it is this machine, else ``ssh``."""
    if choice != "auto":
        return choice
    if not hostfile:
        return "local"
    from ...planning.hostfile import load_hostfile
    from agents.network import this_machine_names
    here = this_machine_names()
    return "local" if all(_is_here(h, here) for h in load_hostfile(hostfile)) else "ssh"


def _local_slots() -> tuple[int, str]:
    """How many ranks DeepSpeed's runner starts on this machine without a hostfile, and why: its
    accelerator's ``device_count()`` (GPUs, as NVML counts them; on the CPU accelerator one per NUMA
    node), with ``CUDA_VISIBLE_DEVICES`` counted instead where it is set (runner.py ``main()``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible:
        return len([d for d in visible.split(",") if d.strip()]), f"CUDA_VISIBLE_DEVICES={visible}"
    if os.environ.get("DS_ACCELERATOR", "") != "cpu":
        try:
            import pynvml
            pynvml.nvmlInit()
            try:
                count = pynvml.nvmlDeviceGetCount()
            finally:
                pynvml.nvmlShutdown()
            if count:
                return count, f"{count} GPU(s)"
        except Exception:  # noqa: BLE001 - no NVML (no GPU, no driver): the CPU accelerator's count
            pass
    numa = len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1
    return numa, f"the CPU accelerator: {numa} NUMA node(s)"


def _deepspeed_fields(ns: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from ...spec.deepspeed_cmd import runner_job
    cwd = os.getcwd()
    job = runner_job(ns, cwd, hostfile_found=os.path.isfile(os.path.join(cwd, ns.hostfile)))
    fields, notes = dict(job.fields), list(job.notes)
    if "hostfile" not in fields and not any(k in fields for k in ("num_gpus", "include", "exclude")):
        count, why = _local_slots()
        fields["num_gpus"] = count
        notes.append(f"no hostfile: this machine, {count} rank(s) ({why}), as DeepSpeed's runner counts them")
    return fields, notes


def _spec_text(fields: dict[str, Any]) -> str:
    return yaml.safe_dump(fields, sort_keys=False, allow_unicode=True, width=1000)


def _checkpoints(ns: argparse.Namespace, fields: dict[str, Any], notes: list[str]) -> None:
    """The job's ``checkpoint_dir``: ``--checkpoint-dir``, else the directory the script's own arguments
    name (:func:`~orchestrator.spec.deepspeed_cmd.checkpoint_dir_from_script_args`), so ``orch resume``
    finds what the script saved; else orch's own directory of the job (``ORCH_CHECKPOINT_DIR``)."""
    from ...spec.deepspeed_cmd import checkpoint_dir_from_script_args
    found = checkpoint_dir_from_script_args(fields.get("args", []))
    if ns.checkpoint_dir:
        fields["checkpoint_dir"] = os.path.abspath(os.path.expanduser(ns.checkpoint_dir))
    elif found:
        fields["checkpoint_dir"] = os.path.abspath(os.path.expanduser(found[1]))
        notes.append(f"checkpoints: orch watches {fields['checkpoint_dir']} (the script's {found[0]}) and resumes "
                     "from its last complete checkpoint (--checkpoint-dir DIR names another)")
    else:
        notes.append("checkpoints: the script names no --save_dir/--output_dir/--checkpoint_dir, so orch looks in its "
                     "own ORCH_CHECKPOINT_DIR; give --checkpoint-dir DIR where the script saves, for orch resume")


def _run_job(ns: argparse.Namespace, fields: dict[str, Any], notes: list[str], tool: str) -> int:
    """Make the spec, show it, and run, plan or submit it as ``orch run``/``plan``/``submit`` would."""
    from ...spec import spec_from_dict
    from .jobs import cmd_plan, cmd_run, cmd_submit
    if ns.output not in ("table", "json"):
        raise UsageError(f"--output {ns.output!r}: expected table or json.")
    if ns.name:
        fields["name"] = ns.name
    _checkpoints(ns, fields, notes)
    fields["provisioner"] = _provisioner(ns.provisioner, fields.get("hostfile"))
    spec = spec_from_dict(fields, os.getcwd(), source=f"(the {tool} command line)")
    text = _spec_text(fields)
    if ns.print_spec == "-":
        print(text, end="")
        return 0
    if ns.print_spec:
        try:
            with open(ns.print_spec, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as err:
            raise UsageError(f"--print-spec {ns.print_spec}: cannot write it ({err.strerror}).") from err
    if ns.output != "json":
        for note in notes:
            err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        where = f"written to {ns.print_spec}" if ns.print_spec else "--print-spec FILE writes it"
        err_console.print(f"The job spec of this command ({where}; orch run FILE runs it again):", markup=False,
                          highlight=False)
        err_console.print("  " + text.rstrip("\n").replace("\n", "\n  "), markup=False, highlight=False,
                          soft_wrap=True)
    ns.prepared_spec, ns.spec, ns.script_args = spec, f"(orch {tool})", []
    ns.command = "plan" if ns.plan else "submit" if ns.submit else "run"
    ns.offline, ns.idempotency_key, ns.rank_exit_status = False, None, True
    if ns.submit and not ns.env_passthrough and ns.output != "json":
        err_console.print("note: the ranks get the orch server's environment, not this shell's; --env-passthrough "
                          "NAME[,PATTERN...] copies variables from here", markup=False, highlight=False, soft_wrap=True)
    return (cmd_plan if ns.plan else cmd_submit if ns.submit else cmd_run)(ns)


def _deepspeed(argv: list[str], top: argparse.Namespace) -> int:
    ns = deepspeed_parser().parse_args(argv, namespace=top)
    fields, notes = _deepspeed_fields(ns)
    return _run_job(ns, fields, notes, "deepspeed")


def _accelerate(argv: list[str], top: argparse.Namespace) -> int:
    from ...spec.accelerate_cmd import accelerate_job
    ns, unknown = accelerate_parser().parse_known_args(argv, namespace=top)
    ns.unknown = unknown
    job = accelerate_job(ns, os.getcwd(), os.environ, local_slots=_local_slots()[0])
    return _run_job(ns, dict(job.fields), list(job.notes), "accelerate launch")


#: ``orch <name>``: (what it runs, one line for ``orch --help``).
DROPINS: dict[str, tuple[Callable[[list[str], argparse.Namespace], int], str]] = {
    "deepspeed": (_deepspeed, "Run a deepspeed command line (the same arguments) as an orch "
                  "job: orch deepspeed --hostfile H --include ... train.py --deepspeed --deepspeed_config ds.json"),
    "accelerate-launch": (_accelerate, "Run an accelerate launch command line (the same config "
                          "file and flags) as an orch job: orch accelerate-launch --config_file accel.yaml train.py"),
}


def run_dropin(name: str, argv: list[str], top: argparse.Namespace) -> int:
    """Run ``orch <name> <argv>`` (a key of :data:`DROPINS`); ``top`` holds the options given before
    ``name`` (``--state-dir``, ``--output``, ...). Returns the exit status; raises OrchError for bad input."""
    from ...errors import ConfigError, SpecError
    try:
        return DROPINS[name][0](argv, top)
    except (SpecError, ConfigError) as err:  # fixes it names may be spec fields: say how to get at them
        err.args = (f"{err}\n(orch {name}: to set what the command line cannot, write the job spec with "
                    f"--print-spec FILE, edit it, and run it with orch run FILE)",)
        raise


def dropin_help(name: str) -> str:
    """The one-line help of ``orch <name>`` for ``orch --help``."""
    return DROPINS[name][1]
