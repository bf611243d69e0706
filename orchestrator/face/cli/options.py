"""Command-line options shared by the commands: the common ones, argument types with bounds, and the
options that build or amend a job (an Accelerate config, ``accelerate launch``'s DeepSpeed flags)."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from .output import Parser, UsageError, err_console


def host_list(text: str) -> list[str]:
    hosts = [h.strip() for h in text.split(",")]
    if not all(hosts) or any(":" in h or "@" in h for h in hosts):
        raise argparse.ArgumentTypeError(f"expected host names separated by commas (no slots), got {text!r}")
    return hosts


def bounded(kind: Callable[[str], float], low: float, high: float | None, what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` within ``low..high``, else a message saying ``what`` was expected."""
    def parse(text: str) -> Any:
        value = kind(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


positive_int = bounded(int, 1, None, "a whole number of at least 1")


tcp_port = bounded(int, 1, 65535, "a TCP port 1..65535")


seconds_arg = bounded(float, 0, None, "a number of seconds >= 0")


#: accelerate launch's DeepSpeed flags: (name, type, help); each sets the spec's accelerate.<name>.
ACCELERATE_FLAGS = (
    ("mixed_precision", str, "no | fp16 | bf16 | fp8"),
    ("zero_stage", int, "ZeRO stage 0-3"),
    ("gradient_accumulation_steps", int, "micro batches per optimizer step"),
    ("gradient_clipping", float, "max gradient norm"),
    ("offload_optimizer_device", str, "none | cpu | nvme"),
    ("offload_param_device", str, "none | cpu | nvme"),
    ("offload_optimizer_nvme_path", str, "NVMe directory for optimizer states"),
    ("offload_param_nvme_path", str, "NVMe directory for parameters"),
    ("zero3_init_flag", str, "true | false: deepspeed.zero.Init at stage 3"),
    ("zero3_save_16bit_model", str, "true | false: save 16-bit weights at stage 3"),
)


def job_options(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Options that build or amend the job: an Accelerate config, accelerate launch's DeepSpeed
    flags, the values that fill a DeepSpeed config's "auto" (docs/accelerate.md)."""
    default = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("job from an Accelerate config (see docs/accelerate.md)")
    g.add_argument("--accelerate-config", metavar="FILE", default=default,
                   help="an Accelerate config file (accelerate config's YAML); then the positional may be the "
                   "training script, followed by its arguments, as with accelerate launch")
    g.add_argument("--name", default=default, help="job name (without a job spec; default: the script's name)")
    g.add_argument("--micro-batch-size", type=positive_int, metavar="N", default=default,
                   help="samples per rank per micro step: fills \"auto\" batch sizes of the DeepSpeed config")
    g.add_argument("--hidden-size", type=positive_int, metavar="N", default=default,
                   help="the model's hidden size: fills the three \"auto\" bucket sizes")
    g.add_argument("--model-config", metavar="PATH", default=default,
                   help="a Hugging Face config.json (or its folder) to read the hidden size from")
    for name, kind, help_ in ACCELERATE_FLAGS:
        g.add_argument(f"--{name.replace('_', '-')}", f"--{name}", dest=f"acc_{name}", type=kind,
                       metavar=kind.__name__.upper(), default=default, help=f"{help_} (accelerate launch --{name})")
    e = parser.add_argument_group("the job's environment")
    e.add_argument("--env-passthrough", type=env_patterns, action="extend", metavar="NAME[,PATTERN...]",
                   default=default, help="copy these variables (names or shell patterns, e.g. WANDB_*) from this "
                   "shell to every rank, after the spec's env_passthrough; the spec's env wins; may be repeated")


def env_patterns(text: str) -> list[str]:
    """An argparse type: comma-separated ``env_passthrough`` entries."""
    from ...spec import env_pattern_problem
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    for pattern in patterns or [text]:
        problem = env_pattern_problem(pattern)
        if problem:
            raise argparse.ArgumentTypeError(problem)
    return patterns


def job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job a command plans, runs or submits: a spec (amended by the options after it), or an Accelerate
    config and a script. The usage line names the two forms, not every option (``--help`` groups them)."""
    name = parser.prog
    parser.usage = (f"{name} [options] job.yaml [job options]\n       {name} [options] --accelerate-config FILE "
                    "[Accelerate options] script.py [args ...]\n       (or the deepspeed or accelerate launch command "
                    "line itself: orch deepspeed ..., orch accelerate-launch ...)")
    parser.add_argument("spec", metavar="SPEC|SCRIPT", nargs="?", help="job spec (YAML); with --accelerate-config, "
                        "a training script instead (then every later word is the script's argument)")
    parser.add_argument("script_args", metavar="...", nargs=argparse.REMAINDER,
                        help="with --accelerate-config: the script's arguments")
    job_options(parser)


def _job_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Spec fields from the command line (paths absolute: they are the caller's, not the spec's)."""
    out: dict[str, Any] = {}
    for key in ("accelerate_config", "model_config"):
        if getattr(args, key, None) is not None:
            out[key] = os.path.abspath(os.path.expanduser(getattr(args, key)))
    for key in ("micro_batch_size", "hidden_size"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    flags = {name: getattr(args, f"acc_{name}") for name, _, _ in ACCELERATE_FLAGS
             if getattr(args, f"acc_{name}", None) is not None}
    if flags:
        out["accelerate"] = flags
    return out


def load_job(args: argparse.Namespace) -> Any:
    """The command's job: a spec file (amended by the options), or, with ``--accelerate-config`` and
    a non-YAML positional, a job made of that script and its arguments.

    Raises:
        UsageError: words after a job spec that are not options.
        SpecError: the spec (or the Accelerate config) has problems.
    """
    from ...spec import load_spec, spec_from_dict
    if getattr(args, "prepared_spec", None) is not None:  # a drop-in command made it (orch deepspeed ...)
        return _with_shell_env(args, args.prepared_spec, getattr(args, "env_passthrough", None) or [])
    if not args.spec:
        raise UsageError(f"Name the job: orch {args.command} job.yaml, or orch {args.command} --accelerate-config "
                         "accel.yaml train.py [script arguments].")
    rest = list(getattr(args, "script_args", None) or [])
    script_mode = getattr(args, "accelerate_config", None) is not None and \
        not str(args.spec).endswith((".yaml", ".yml"))
    if not script_mode and rest:  # options after the spec: parse them as options
        p = Parser(prog=f"orch {args.command} SPEC", add_help=False)
        common_options(p, top=False)
        job_options(p, suppress=True)
        if getattr(args, "command", None) == "submit":
            p.add_argument("--idempotency-key", default=argparse.SUPPRESS)
        if getattr(args, "command", None) == "plan":
            p.add_argument("--offline", action="store_true", default=argparse.SUPPRESS)
        extra, unknown = p.parse_known_args(rest, namespace=args)
        if unknown:
            raise UsageError(f"Unexpected arguments after the job spec {args.spec}: {' '.join(unknown)}. Put the "
                             "script's arguments in the spec's args (or give --accelerate-config and the script).")
        script_mode = getattr(args, "accelerate_config", None) is not None and \
            not str(args.spec).endswith((".yaml", ".yml"))
        rest = []
    overrides = _job_overrides(args)
    if not script_mode:
        if getattr(args, "name", None):
            overrides["name"] = args.name
        spec = load_spec(args.spec, overrides=overrides or None)
    else:
        from ...spec.deepspeed_cmd import script_job_name
        data = {"name": getattr(args, "name", None) or script_job_name(args.spec), "entrypoint": args.spec,
                "args": rest, "workdir": os.getcwd(), **overrides}
        spec = spec_from_dict(data, os.getcwd(), source=f"(from --accelerate-config {args.accelerate_config})")
    return _with_shell_env(args, spec, getattr(args, "env_passthrough", None) or [])


def _with_shell_env(args: argparse.Namespace, spec: Any, patterns: list[str]) -> Any:
    """The spec with what its ``env_passthrough`` (and ``--env-passthrough``) names copied from this shell;
    what was copied, and which patterns matched nothing, is kept for :func:`report_shell_env`."""
    from ...spec import pass_through
    if patterns:
        spec = spec.model_copy(update={"env_passthrough": list(dict.fromkeys([*spec.env_passthrough, *patterns]))})
    spec, args.env_copied, args.env_unmatched = pass_through(spec, os.environ)
    return spec


def report_shell_env(args: argparse.Namespace) -> None:
    """Say on stderr what ``env_passthrough`` copied from this shell and which patterns matched nothing
    (once the job was planned or submitted: an error comes alone)."""
    for pattern in getattr(args, "env_unmatched", None) or []:
        err_console.print(f"warning: env_passthrough {pattern!r} matches no variable of this shell", markup=False,
                          highlight=False)
    copied = getattr(args, "env_copied", None) or []
    if copied:
        err_console.print(f"env_passthrough: every rank gets {', '.join(copied)} from this shell", markup=False,
                          highlight=False)


def common_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """The options every command takes, before or after the command's name.

    On the commands they default to SUPPRESS, so a value given before the command name
    (``orch -o json list``) is not overwritten by the command's default.
    """
    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS
    parser.add_argument("--state-dir", default=default(None),
                        help="where jobs, logs and checkpoints are kept (default: $ORCH_STATE_DIR or ~/.orch)")
    parser.add_argument("--output", "-o", metavar="{table,json}", default=default("table"),
                        help="output format: human tables (default) or JSON for scripts (orch export also takes "
                        "the file to write here)")
    parser.add_argument("--server", default=default(os.environ.get("ORCH_SERVER")),
                        help="URL of an orch server (default: $ORCH_SERVER, else the one running for the state dir)")
    parser.add_argument("--token-file", metavar="FILE", default=default(None),
                        help="file holding the server's token (default: $ORCH_TOKEN, else <state dir>/server.token)")
