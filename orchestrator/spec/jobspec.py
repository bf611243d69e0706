"""The job spec: a YAML file describing one training job, validated on load.

Every field, its type, default and meaning is documented in ``docs/jobspec.md``. A spec
is validated as a whole: :func:`load_spec` reports *every* problem at once, each with
its field path (``env.FOO``, ``args[2]``) and, where the spec came from a file, the
line it is on. Relative paths are resolved against the spec file's directory and
stored absolute, so a stored spec means the same thing wherever it is read.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import OrchError, SpecError
from ..launchers import get_launcher
from .accelerate_settings import AccelerateSettings
from .options import (_ENV_KEY_RE, BindCores, PreflightOptions, RayOptions, SSHOptions, _scalar_to_str,
                      bind_cores_value, node_env_problem)
from .slurm import SlurmOptions
from .files import line_of, read_deepspeed_config, read_yaml
from .restart import RestartPolicy
from .resume import ResumeOptions
from .retention import CheckpointRetention
from .straggler import StragglerOptions

__all__ = ["JobSpec", "SSHOptions", "RayOptions", "load_spec", "spec_from_dict", "load_deepspeed_config", "PROVISIONERS",
           "KNOWN_LAUNCHERS", "PreflightOptions", "pass_through", "env_pattern_problem"]

#: Provisioners a spec may name (each is implemented in ``orchestrator.provisioners``).
PROVISIONERS = ("local", "ssh", "ray", "slurm")
#: DeepSpeed's multinode launchers (deepspeed.launcher.constants + Accelerate's ``standard``
#: and ``nossh``); which of them orch can run is decided by ``orchestrator.launchers``.
KNOWN_LAUNCHERS = ("pdsh", "standard", "nossh", "openmpi", "mvapich", "mpich", "impi", "slurm")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_PATTERN_RE = re.compile(r"^[A-Za-z0-9_*?\[\]!-]+$")


class JobSpec(BaseModel):
    """A validated, frozen job spec. See ``docs/jobspec.md`` for every field.

    Example::

        spec = load_spec("examples/quickstart.yaml")
        spec.launcher            # 'pdsh'
        spec.to_dict()           # JSON-able, paths absolute

    Build one with :func:`load_spec` (from a file) or :func:`spec_from_dict`; both raise
    :class:`~orchestrator.errors.SpecError` listing every problem.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Job name: letters, digits, '.', '_', '-'; at most 63 characters.")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile path; absent: localhost with num_gpus (or 1) slots.")
    include: str = Field("", description="DeepSpeed --include filter, e.g. 'worker-0:0,1@worker-1'.")
    exclude: str = Field("", description="DeepSpeed --exclude filter.")
    num_nodes: int = Field(-1, ge=-1, description="Use the first N hosts; -1: all.")
    num_gpus: int = Field(-1, ge=-1, description="Use slots 0..N-1 on each host; -1: all.")
    provisioner: Literal["local", "ssh", "ray", "slurm"] = "local"
    launcher: Literal["pdsh", "standard", "nossh", "openmpi", "mvapich", "mpich", "impi", "slurm"] = "pdsh"
    launcher_args: list[str] = Field(default_factory=list, description="The launcher's own arguments "
                                     "(DeepSpeed's --launcher_args): a string, split as a shell would "
                                     "(shlex), or a list; in the real command orch plan shows and runs.")
    launch_mode: Literal["emulated", "native"] = Field(
        "emulated", description="emulated: orch's agents start the ranks with the environment the launcher's "
        "real tool gives them (any provisioner); native: orch runs the real tool (mpirun, mpiexec) on the "
        "first node and supervises the ranks it starts (the MPI launchers).")
    native_start_timeout: float = Field(120.0, gt=0, le=3600, description="launch_mode native: seconds "
                                        "the real tool has to start every rank before the attempt fails, "
                                        "and to exit once the first node's ranks ended.")
    fast_start: Literal["auto", "on", "off"] = Field("auto", description="Fork ranks from a template that imported "
                                                     "torch+DeepSpeed (docs/fast_start.md); auto: else exec, saying why.")
    master_addr: str | None = None
    master_port: int | Literal["auto"] = "auto"
    env: dict[str, str] = Field(default_factory=dict)
    env_from_file: dict[str, str] = Field(default_factory=dict, description="Variables read from a file on each "
                                          "node when its ranks start (NAME: path; ~ and paths relative to workdir "
                                          "taken there), for secrets: orch stores and shows only the path.")
    node_env: dict[str, dict[str, str]] = Field(default_factory=dict, description="Variables by host class: "
                                               "{pattern: {NAME: value}}, a shell pattern on the hostfile's host "
                                               "names (gpu-a100-*); every matching entry applies, in the order "
                                               "written, over env.")
    bind_cores: BindCores = Field("off", description="Pin each rank to CPU cores (DeepSpeed's --bind_cores_to_rank), "
                                  "OMP_NUM_THREADS set to their number: auto: on GPU nodes the physical cores of "
                                  "its GPU's NUMA node, shared among that node's ranks; elsewhere the node's "
                                  "physical cores split among its ranks; a map slot -> CPU list ({0: \"0-11\"}); "
                                  "CPUs the agent may not use are dropped; off: no pinning.")
    workdir: str = "."
    python: str | None = None
    entrypoint: str
    args: list[str] = Field(default_factory=list)
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    force_multi: bool = Field(False, description="DeepSpeed's --force_multi: its runner's multi-node path (pdsh, "
                              "mpirun, srun and their exports) even for one node.")
    deepspeed_config: str | dict[str, Any] | None = None
    deepspeed_config_filled_by: Literal["auto", "orch", "script"] = Field(
        "auto", description="Who fills the DeepSpeed config's \"auto\" values: orch; the script (the HF Trainer "
        "or Accelerate: orch then leaves what the script fills); auto: the script where the entrypoint "
        "uses transformers' Trainer/TrainingArguments or accelerate's Accelerator, else orch.")
    deepspeed_args: bool = False
    accelerate_config: str | dict[str, Any] | None = Field(None, description="An Accelerate config file "
                                                           "(`accelerate config`'s YAML), or its keys inline.")
    accelerate: AccelerateSettings = Field(default_factory=AccelerateSettings, description="accelerate launch's "
                                           "DeepSpeed flags; they win over accelerate_config's keys.")
    micro_batch_size: int | None = Field(None, ge=1, description="Samples per rank per micro step: fills the "
                                         "DeepSpeed config's \"auto\" batch sizes.")
    hidden_size: int | None = Field(None, ge=1, description="The model's hidden size: fills the three \"auto\" "
                                    "bucket sizes of the DeepSpeed config.")
    model_config_path: str | None = Field(None, alias="model_config", description="A Hugging Face model "
                                          "config.json (or its folder) to read the hidden size from.")
    checkpoint_dir: str | None = None
    resume: ResumeOptions = Field(default_factory=ResumeOptions, description="Where the checkpoints are, their "
                                  "format, and how a resumed script is told which one to load.")
    metrics_port: Annotated[int, Field(ge=1, le=65535)] | Literal["auto"] | None = "auto"
    metrics_addr: str = Field("auto", description="The address every node's metrics exporter listens on: auto, "
                              "the one the controller reaches the node at (127.0.0.1 for local agents); an IP "
                              "address; 0.0.0.0 (or ::) for every interface.")
    stop_grace_seconds: float = Field(10.0, gt=0, le=3600)
    hang_timeout: float | str | None = Field(
        "auto", description="Seconds without a new step on a rank (reported, or a step= log line) after which "
        "the attempt fails with 'no progress', every rank's stacks dumped first. auto: each rank from its own "
        "first step, 10x the longest step gap seen in the attempt, at least 300 s; a number: every rank once "
        "any stepped; null: never.")
    startup_timeout: float | None = Field(900.0, gt=0, le=7 * 86400, description="Seconds from the ranks' start "
                                          "to the attempt's first step on any rank (imports, the rendezvous, "
                                          "building ops), after which the attempt fails with 'start-up', every "
                                          "rank's stacks dumped first; null: never (a script that reports no "
                                          "step at all needs it).")
    ssh: SSHOptions = Field(default_factory=SSHOptions)
    ray: RayOptions = Field(default_factory=RayOptions)
    slurm: SlurmOptions = Field(default_factory=SlurmOptions)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    straggler: StragglerOptions = Field(default_factory=StragglerOptions)
    checkpoints: CheckpointRetention = Field(default_factory=CheckpointRetention, description="Checkpoint retention.")
    preflight: PreflightOptions = Field(default_factory=PreflightOptions)
    exclude_hosts: list[str] = Field(default_factory=list, description="Hosts never to use (e.g. lost "
                                     "nodes, added by `orch resume --exclude`); removed from the hostfile "
                                     "before the filters and num_nodes/num_gpus apply.")
    secret_env: list[str] = Field(default_factory=list, description="More names or shell patterns of variables "
                                  "whose values orch masks (****) wherever it shows or logs them, besides the names "
                                  "that look secret (*TOKEN*, *KEY*, *SECRET*, *PASSWORD*, *CREDENTIAL*).")
    env_passthrough: list[str] = Field(default_factory=list, description="Names or shell patterns "
                                       "(WANDB_*) of variables the `orch` command copies from the shell it runs "
                                       "in into env when it submits the job; env's own values win.")
    prepend_python_bin: bool = Field(True, description="Put the directory of the ranks' Python (a "
                                     "virtualenv's bin) first on every rank's PATH, unless PATH already has it.")

    @field_validator("hang_timeout", "startup_timeout", mode="before")
    @classmethod
    def _deadline(cls, v: Any, info: Any) -> Any:
        most = 86400 if info.field_name == "hang_timeout" else 7 * 86400
        words = f"seconds > 0 (at most {most}){', auto' if info.field_name == 'hang_timeout' else ''} or null"
        if v is None or (v == "auto" and info.field_name == "hang_timeout"):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= most:  # (NaN fails too)
            raise ValueError(f"expected {words}; got {v!r}")
        return float(v)

    @field_validator("num_nodes", "num_gpus", mode="before")
    @classmethod
    def _count(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML's true is not a count
            raise ValueError(f"expected a whole number (-1: all); got {v!r}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"expected 1-63 letters, digits, '.', '_' or '-' starting with a letter or digit; got {v!r}")
        return v

    @field_validator("master_port")
    @classmethod
    def _port(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 65535:
            raise ValueError(f"expected a TCP port 1..65535 or 'auto'; got {v}")
        return v

    @field_validator("env_from_file")
    @classmethod
    def _env_from_file(cls, v: dict[str, str]) -> dict[str, str]:
        for key, path in v.items():
            if not _ENV_KEY_RE.match(key):
                raise ValueError(f"variable name {key!r} is not a valid environment variable name (letters, "
                                 "digits and '_', not starting with a digit)")
            if not path.strip():
                raise ValueError(f"{key}: expected the path of the file holding its value")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, Mapping):
            return v
        out = {}
        for key, value in v.items():
            if not isinstance(key, str) or not _ENV_KEY_RE.match(key):
                raise ValueError(f"variable name {key!r} is not a valid environment variable name "
                                 "(letters, digits and '_', not starting with a digit)")
            out[key] = _scalar_to_str(value)
        return out

    @field_validator("node_env", mode="before")
    @classmethod
    def _node_env(cls, v: Any) -> Any:
        if not isinstance(v, Mapping):
            return v
        for pattern, variables in v.items():
            problem = node_env_problem(pattern, variables)
            if problem:
                raise ValueError(problem)
        return {p: {k: _scalar_to_str(x) for k, x in vs.items()} for p, vs in v.items()}

    @field_validator("bind_cores", mode="before")
    @classmethod
    def _bind_cores(cls, v: Any) -> Any:
        return bind_cores_value(v)

    @field_validator("env_passthrough")
    @classmethod
    def _env_passthrough(cls, v: list[str]) -> list[str]:
        for pattern in v:
            problem = env_pattern_problem(pattern)
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("metrics_addr")
    @classmethod
    def _metrics_addr(cls, v: str) -> str:
        import ipaddress
        if v != "auto":
            try:
                ipaddress.ip_address(v)
            except ValueError:
                raise ValueError(f"{v!r} is not an IP address; expected auto, an address of the nodes (e.g. "
                                 "10.0.0.5), or 0.0.0.0 for every interface") from None
        return v

    @field_validator("launcher_args", mode="before")
    @classmethod
    def _launcher_args(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return shlex.split(v)
            except ValueError as err:  # shlex: "No closing quotation", "No escaped character"
                raise ValueError(f"cannot split {v!r} as a shell would ({err}); check its quotes, or give "
                                 "a list of arguments") from None
        if isinstance(v, (list, tuple)):
            return [_scalar_to_str(x) for x in v]
        return v

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [_scalar_to_str(x) for x in v]
        if isinstance(v, str):
            raise ValueError("expected a list of strings, e.g. [--steps, \"300\"]; got a single string")
        return v

    def cross_field_problems(self) -> list[tuple[str, str]]:
        """Rules between fields, as ``(field path, message)`` pairs (empty: none broken)."""
        problems = []
        if self.include and self.exclude:
            problems.append(("exclude", "include and exclude are mutually exclusive (same as DeepSpeed's "
                                        "--include/--exclude); keep one of them"))
        if self.include or self.exclude:
            for name in ("num_nodes", "num_gpus"):
                if getattr(self, name) >= 0:
                    problems.append((name, f"{name} cannot be combined with include/exclude (same as "
                                           "DeepSpeed's runner); use only the filter or only the counts"))
        if self.module and self.no_python:
            problems.append(("no_python", "module and no_python cannot both be true (same as DeepSpeed's "
                                          "launcher)"))
        if self.accelerate.given() and self.accelerate_config is None:
            problems.append(("accelerate", "sets accelerate launch's flags, which need accelerate_config (the "
                                           "Accelerate config file they override); add accelerate_config"))
        both = sorted(set(self.env) & set(self.env_from_file))
        if both:
            problems.append(("env_from_file", f"{', '.join(both)} also in env: give each variable one source"))
        return problems

    def to_dict(self) -> dict:
        """The spec as a JSON-able dict (what the store keeps)."""
        return self.model_dump(mode="json", by_alias=True)


def _loc_to_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(spec)"


def _section_model(loc: tuple) -> type[BaseModel]:
    """The pydantic model of the spec section at ``loc`` (``("restart",)`` -> RestartPolicy);
    JobSpec itself for the top level or anything that is not a section."""
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            field = next((f for f in model.model_fields.values() if f.alias == part), None)
        inner = getattr(field, "annotation", None)
        found = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else next(
            (a for a in getattr(inner, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if found is None:
            return JobSpec
        model = found
    return model


def _problems_from(err: ValidationError, tree: yaml.Node | None) -> list[tuple[str, str, int | None]]:
    problems = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p in ("int", "str", "dict[str,any]", "literal['auto']")))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            section = _section_model(loc[:-1])
            names = [f.alias or n for n, f in section.model_fields.items()]
            close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.75)
            valid = ", ".join(names)
            msg = (f"unknown field; did you mean {close[0]}? " if close else "unknown field; ") + \
                f"valid fields{' of ' + loc[-2] if len(loc) > 1 else ''} are: {valid}"
        elif e["type"] in ("model_type", "model_attributes_type", "dict_type"):
            short = " or true/false" if loc and loc[-1] == "preflight" else ""
            section = _section_model(loc) if loc else JobSpec
            names = "" if section is JobSpec else \
                " with the fields " + ", ".join(f.alias or n for n, f in section.model_fields.items())
            msg = f"expected a mapping{names}{short}; got {e.get('input')!r}"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif loc and loc[0] == "deepspeed_config":
            msg = ("expected the path of a DeepSpeed config (JSON) file or the config as a mapping; "
                   f"got {type(e.get('input')).__name__} {e.get('input')!r}")
        elif e["type"] == "string_type" and isinstance(e.get("input"), bool):
            msg = (f"expected a string; got the YAML boolean {e['input']!r}: write it in quotes (e.g. "
                   f"\"{str(e['input']).lower()}\") so it stays text")
        elif "input" in e and e["type"] not in ("value_error",) and not isinstance(e["input"], (dict, list)):
            msg = f"{msg}; got {e['input']!r}"
        problems.append((_loc_to_path(loc), msg, line_of(tree, loc)))
    # union types report one error per member; keep the first per path
    seen, unique = set(), []
    for p in problems:
        if p[0] not in seen:
            seen.add(p[0])
            unique.append(p)
    return unique


def _nul_problems(data: Any, path: str = "") -> list[tuple[str, str]]:
    """Every string of the spec (keys too) holding a NUL byte, by field path: no path, argument or
    environment value can carry one to a process (exec refuses it), so it is refused here, not at run time."""
    out: list[tuple[str, str]] = []
    stack = [(path, data)]
    while stack and len(out) < 20:
        where, value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                out.append((where or "(spec)", "contains a NUL byte (\\x00); no path, argument or environment "
                                              "value can hold one"))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                key = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and "\x00" in k:
                    out.append((key.replace("\x00", "\\x00"), "this name contains a NUL byte (\\x00)"))
                stack.append((key, v))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
    return sorted(out)


def _raise(problems: list[tuple[str, str, int | None]], source: str) -> None:
    problems = sorted(problems, key=lambda p: (p[2] is None, p[2] or 0))
    lines = [f"  {path}{f' (line {line})' if line else ''}: {msg}" for path, msg, line in problems]
    noun = "problem" if len(problems) == 1 else "problems"
    raise SpecError(f"Job spec {source} has {len(problems)} {noun}:\n" + "\n".join(lines),
                    path=source, problems=[(p, m) for p, m, _ in problems])


def _resolve(base: Path, value: str | None) -> str | None:
    if value is None:
        return None
    p = Path(os.path.expanduser(value))
    return str(p if p.is_absolute() else (base / p).resolve())


def spec_from_dict(data: Any, base_dir: str | Path = ".", source: str = "<spec>",
                   _tree: yaml.Node | None = None, check_files: bool = True) -> JobSpec:
    """Validate ``data`` as a job spec and resolve its paths against ``base_dir``.

    Args:
        data: the parsed YAML (a mapping).
        base_dir: directory relative paths are resolved against (the spec file's).
        source: how to name the spec in messages (its path).
        check_files: also check that the files the spec names exist (hostfile,
            workdir, entrypoint, DeepSpeed config file) and that the config is valid JSON.

    An ``accelerate_config`` is read first and its keys fill the fields ``data`` does not set
    (``orchestrator.spec.accelerate.AccelerateConfig.spec_fields``); its problems (by key path
    and line of that file, Accelerate's ambiguity rule included) are listed with the spec's.

    Returns:
        The frozen JobSpec, with ``hostfile``, ``workdir``, ``entrypoint`` (a script
        path, unless ``module``/``no_python``), ``deepspeed_config`` (a path),
        ``accelerate_config`` (a path), ``model_config``, ``checkpoint_dir`` and ``resume.dir`` absolute.

    Raises:
        SpecError: listing every problem by field path (and line, for files).
    """
    if not isinstance(data, Mapping):
        _raise([("(spec)", f"expected a mapping of fields (name: ..., entrypoint: ...); got {type(data).__name__}", None)], source)
    accelerate_problems: list[tuple[str, str]] = []
    if data.get("accelerate_config") is not None:  # its keys become the spec's where the spec is silent (and
        from .accelerate import read_for_spec  # Accelerate's rules are imported: a spec without one does without)
        data, accelerate_problems = read_for_spec(dict(data), base_dir)
    accelerate_lines = [(p, m, line_of(_tree, ("accelerate_config",))) for p, m in accelerate_problems]
    nul = _nul_problems(data)
    if nul:
        _raise([(p, m, line_of(_tree, tuple(p.replace("]", "").replace("[", ".").split(".")))) for p, m in nul],
               source)
    try:
        spec = JobSpec.model_validate(dict(data))
    except ValidationError as err:
        _raise(_problems_from(err, _tree) + accelerate_lines, source)
    base = Path(base_dir).resolve()
    workdir = _resolve(base, spec.workdir)
    updates: dict[str, Any] = {"workdir": workdir, "hostfile": _resolve(base, spec.hostfile),
                               "checkpoint_dir": _resolve(base, spec.checkpoint_dir)}
    if spec.resume.dir is not None:
        updates["resume"] = spec.resume.model_copy(update={"dir": _resolve(base, spec.resume.dir)})
    if isinstance(spec.deepspeed_config, str):
        updates["deepspeed_config"] = _resolve(base, spec.deepspeed_config)
    if isinstance(spec.accelerate_config, str):
        updates["accelerate_config"] = _resolve(base, spec.accelerate_config)
    updates["model_config_path"] = _resolve(base, spec.model_config_path)
    if not (spec.module or spec.no_python):
        updates["entrypoint"] = _resolve(Path(workdir), spec.entrypoint)
    ssh_paths = {k: _resolve(base, getattr(spec.ssh, k)) for k in ("identity_file", "known_hosts", "config_file")}
    updates["ssh"] = spec.ssh.model_copy(update=ssh_paths)
    spec = spec.model_copy(update=updates)
    problems = spec.cross_field_problems() + _support_problems(spec)
    if check_files:
        problems += _file_problems(spec)
    if problems or accelerate_lines:
        _raise([(p, m, line_of(_tree, (p,))) for p, m in problems] + accelerate_lines, source)
    return spec


def _support_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """What this version of orch cannot run, as problems of the spec."""
    try:
        get_launcher(spec.launcher)
    except OrchError as err:
        return [("launcher", str(err))]
    return []


def _file_problems(spec: JobSpec) -> list[tuple[str, str]]:
    problems = []
    if spec.hostfile is not None and not os.path.isfile(spec.hostfile):
        what = ("is a directory, not a file" if os.path.isdir(spec.hostfile) else
                "is not a regular file (a pipe, socket or device)" if os.path.exists(spec.hostfile) else "no such file")
        problems.append(("hostfile", f"{what}: {spec.hostfile}"))
    if not os.path.isdir(spec.workdir):
        problems.append(("workdir", f"no such directory: {spec.workdir}"))
    if spec.no_python:  # run as given: a bare name is looked up on PATH, a path from workdir
        if "/" in spec.entrypoint:
            path = os.path.join(spec.workdir, spec.entrypoint)
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                problems.append(("entrypoint", f"no executable file {path}"))
        elif not shutil.which(spec.entrypoint):
            hint = (f" (there is a file of that name in {spec.workdir}: write ./{spec.entrypoint})"
                    if os.path.exists(os.path.join(spec.workdir, spec.entrypoint)) else "")
            problems.append(("entrypoint", f"no executable {spec.entrypoint!r} on PATH{hint}"))
    elif not spec.module and not os.path.isfile(spec.entrypoint):
        what = "is a directory, not a file" if os.path.isdir(spec.entrypoint) else "no such file"
        problems.append(("entrypoint", f"{what}: {spec.entrypoint} (relative paths are taken "
                                       f"from workdir {spec.workdir})"))
    if isinstance(spec.deepspeed_config, str):
        try:
            load_deepspeed_config(spec)
        except SpecError as err:
            problems.append(("deepspeed_config", str(err)))
    if spec.model_config_path is not None:
        from .dsconfig import hidden_size_from_model_config
        try:
            hidden_size_from_model_config(spec.model_config_path)
        except SpecError as err:
            problems.append(("model_config", str(err)))
    return problems


def env_pattern_problem(pattern: str) -> str | None:
    """What is wrong with an ``env_passthrough`` entry, or None: a variable name or a shell pattern of
    names (letters, digits and ``_``, with ``*``, ``?`` or ``[...]``)."""
    if _PATTERN_RE.match(pattern):
        return None
    return (f"expected variable names or shell patterns of them (letters, digits, '_', with '*', '?' or [...]), "
            f"e.g. WANDB_*; got {pattern!r}")


def pass_through(spec: JobSpec, environ: Mapping[str, str]) -> tuple[JobSpec, list[str], list[str]]:
    """Copy the variables ``spec.env_passthrough`` names from ``environ`` (the submitting shell's) into
    ``env``; a variable ``env`` sets keeps its value there. Patterns are shell patterns
    (:func:`fnmatch.fnmatchcase`: ``*``, ``?``, ``[...]``), matched against whole names, case-sensitive.

    Returns:
        ``(the spec with env amended, the names copied (sorted), the patterns that matched nothing)``.
    """
    copied: dict[str, str] = {}
    unmatched = []
    for pattern in spec.env_passthrough:
        names = [k for k in environ if fnmatch.fnmatchcase(k, pattern) and _ENV_KEY_RE.match(k)]
        if not names:
            unmatched.append(pattern)
        copied.update({k: environ[k] for k in names if k not in spec.env})
    if not copied:
        return spec, [], unmatched
    return spec.model_copy(update={"env": {**spec.env, **dict(sorted(copied.items()))}}), sorted(copied), unmatched


def load_deepspeed_config(spec: JobSpec) -> dict:
    """Return the spec's DeepSpeed config as a dict ({} when the spec has none).

    Raises:
        SpecError: the file is missing, unreadable, not JSON (line and column named), or
            not a JSON object.
    """
    return read_deepspeed_config(spec.deepspeed_config)


def load_spec(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None,
              check_files: bool = True) -> JobSpec:
    """Read, validate and resolve a YAML job spec file.

    Args:
        path: the spec file.
        overrides: fields to set on top of the file's (e.g. from CLI flags).
        check_files: see :func:`spec_from_dict`.

    Raises:
        SpecError: the file is missing, is not YAML (line and column named), or has
            problems (every one listed by field path and line).
    """
    p = Path(path)
    tree, data = read_yaml(p, "job spec", SpecError)
    if overrides and isinstance(data, dict):  # a section (e.g. accelerate) is amended, not replaced
        data = {**data, **{k: {**data[k], **v} if isinstance(v, Mapping) and isinstance(data.get(k), Mapping) else v
                           for k, v in overrides.items()}}
    return spec_from_dict(data, p.parent, str(p), tree, check_files)
