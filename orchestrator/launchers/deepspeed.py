"""DeepSpeed's ``pdsh`` and ``nossh`` launchers, as pure functions (DeepSpeed 0.19.8).

Both end in the same per-node program, ``python -u -m deepspeed.launcher.launch
--world_info=<base64> --node_rank=<n> --master_addr=<a> --master_port=<p> ...`` (launch.py
``main()``), which copies its own ``os.environ`` and starts one process per slot of its node.
:meth:`DeepSpeedLauncher.ranks` gives each of those processes exactly the argv and the variables
``launch.py`` gives it; the agent lays them over its node's environment (``compose_env``),
which is what ``launch.py`` does with ``os.environ.copy()``. Verified against DeepSpeed's own
code in tests/test_launchers.py (``launch.main()``, ``PDSHRunner.get_cmd``, ``runner.main()``
as oracles) and against the real processes in tests/test_launchers_real.py.

What ``launch.py`` sets on every rank of node ``n`` (``slots`` = ``world[n]``'s slots, ``N`` =
number of nodes, ``W`` = total ranks; source: launch.py ``main()``)::

    CUDA_VISIBLE_DEVICES = ",".join(slots)     # accelerator.set_visible_devices_envs()
    MASTER_ADDR, MASTER_PORT                   # --master_addr / --master_port
    WORLD_SIZE = W
    CROSS_RANK = n                             # deepspeed.constants.CROSS_RANK
    CROSS_SIZE = N
    LOCAL_SIZE = len(slots)
    RANK       = (ranks on nodes before n) + i            # i = 0..len(slots)-1
    LOCAL_RANK = RANK % len(slots)                        # NOT i: see the quirk below

and ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` *only if the node's environment lacks it*
(``deepspeed/__init__.py`` does ``os.environ.setdefault`` when ``launch.py`` imports deepspeed;
see :meth:`DeepSpeedLauncher.env_defaults`).

argv (launch.py ``main()``)::

    [python, "-u", ("-m",) entrypoint, ("--local_rank=<LOCAL_RANK>",) *args]
    [entrypoint, ("--local_rank=<LOCAL_RANK>",) *args]          # --no_python

``python`` is ``launch.py``'s ``sys.executable``: the interpreter that runs the launcher, which
the real tools resolve to an absolute path; give ``ctx.python`` as that absolute path.

Quirk (LOCAL_RANK with uneven slot counts): ``launch.py`` computes
``local_rank = dist_rank % num_local_procs``, so on a node whose slot count does not divide the
number of ranks on the nodes before it, LOCAL_RANK is a *rotation* of ``0..n-1``: with
``world = (("a", (0, 1)), ("b", (0, 1, 2)))`` node ``b`` runs RANK 2, 3, 4 with LOCAL_RANK
2, 0, 1 (and ``--local_rank=2, 0, 1``). It is still a permutation, so no two ranks of a node
share a device; a script that picks ``cuda:LOCAL_RANK`` uses slot ``slots[LOCAL_RANK]``, which is
what :attr:`RankLaunch.slot` reports. ``RankLaunch``s are returned in spawn order
(``i = 0..``), i.e. by global rank.

pdsh vs nossh — what reaches the ranks' environment besides ``launch.py``'s variables:

* ``pdsh`` (runner.py ``main()`` + multinode_runner.py ``PDSHRunner.get_cmd``): the runner runs
  ``pdsh -S -f 1024 -w <hosts> export K=V; ... cd <cwd>; <python> -u -m
  deepspeed.launcher.launch ...``, so each node's ``launch.py`` starts in a fresh remote shell
  with these exports: every variable of the *runner's* environment whose name starts with
  ``PYTHON``, ``MLFLOW``, ``MV2``, ``UCX`` or an accelerator prefix (``NCCL`` on CUDA; none on
  CPU), ``PYTHONPATH`` prefixed with the runner's cwd, then each ``KEY=VALUE`` line of
  ``~/.deepspeed_env`` and ``./.deepspeed_env`` (file name from ``DS_ENV_FILE``). The planner
  computes them with :func:`pdsh_exports` and puts them in ``ctx.exports``. Under the real
  pdsh, values pass through DeepSpeed's ``add_export`` quoting and a remote shell, and so do
  the script's arguments, the interpreter and the working directory; orch starts ranks
  without any shell and passes all of them byte for byte. Where the real tool would have
  changed something (see :func:`pdsh_export_value` and :func:`pdsh_word_ok`),
  :meth:`DeepSpeedLauncher.warnings` says so, and ``orch plan`` shows the warning.
  With a *single* node DeepSpeed does not use pdsh at all (runner.py runs ``launch.py``
  locally, exporting nothing; see :meth:`DeepSpeedLauncher.uses_pdsh`): the planner must then
  not add :func:`pdsh_exports`, and no remote-shell restriction applies.
* ``nossh`` (``deepspeed --no_ssh --node_rank=<n>`` typed on every node; runner.py ``main()``
  takes its local path): the runner execs ``launch.py`` with ``os.environ.copy()`` — it exports
  nothing, does not touch PYTHONPATH and ignores ``.deepspeed_env``. ``ctx.exports`` (the spec's
  ``env``) is orch's own addition there; a user reproducing it sets those variables in the
  environment of the ``deepspeed`` command (see :meth:`DeepSpeedLauncher.real_commands`).

Neither hosts a store: ``launch.py``'s rank 0 creates the c10d TCPStore at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE`` unset), so ``master_port`` must be free on node 0 at start.

``bind_cores: auto`` is ``--bind_cores_to_rank`` in the real command where the runner passes it: to the
local ``launch.py`` (nossh, one node), not through pdsh (``PDSHRunner.get_cmd`` drops it: the real tool's
remote ranks are not pinned; :meth:`DeepSpeedLauncher.warnings` says so; orch's agents pin them).
Not expressed (no ``LaunchContext`` field): ``--bind_core_list``, ``--save_pid``, ``--enable_each_rank_log``,
``--venv_script``.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ..errors import LaunchError
from .base import LaunchContext, NodeRanks, RankLaunch, RealCommand, check_context
from .layout import encode_world_info, rank_layout

__all__ = [
    "DeepSpeedLauncher",
    "PDSH",
    "NOSSH",
    "encode_world_info",
    "rank_layout",
    "pdsh_exports",
    "deepspeed_env_exports",
    "pdsh_export_value",
    "render_pdsh_export",
    "pdsh_word_ok",
    "pdsh_quote_user_arg",
    "deepspeed_env_files",
    "RUNNER_EXPORT_PREFIXES",
    "ACCELERATOR_EXPORT_PREFIXES",
    "PDSH_MAX_FAN_OUT",
]

#: runner.py ``EXPORT_ENVS``: prefixes of the runner's variables exported to every node (pdsh).
RUNNER_EXPORT_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX")
#: ``get_accelerator().export_envs()`` of DeepSpeed 0.19.8's accelerators (added to the above).
ACCELERATOR_EXPORT_PREFIXES: dict[str, tuple[str, ...]] = {
    "cuda": ("NCCL",),
    "cpu": (),
    "mps": (),
    "hpu": (),
    "xpu": (),
    "npu": ("ASCEND", "HCCL", "LD_LIBRARY", "PATH"),
    "mlu": ("NEUWARE_HOME", "CNCL", "LD_LIBRARY", "PATH"),
    "sdaa": ("NCCL", "LD_LIBRARY", "PATH"),
    "supa": ("BCCL", "BIREN", "SUPA", "LD_LIBRARY", "PATH"),
}
#: runner.py ``EXCLUDE_ENVS``: when the runner's environment has the key, those variables are
#: not exported (AISC compute sets them per node).
RUNNER_EXCLUDE_ENVS = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
#: launcher/constants.py ``PDSH_MAX_FAN_OUT`` (pdsh ``-f``).
PDSH_MAX_FAN_OUT = 1024
#: what ``deepspeed/__init__.py`` setdefaults in ``launch.py``'s environment at import.
DEEPSPEED_IMPORT_DEFAULTS = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}

# multinode_runner.py MultiNodeRunner.add_export: values with any other character get "..."
_ADD_EXPORT_NEEDS_QUOTES = re.compile(r"[^\w@%+=:,./-]")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Characters a POSIX shell leaves alone in an unquoted word (plus any non-ASCII letter/digit).
_SAFE_UNQUOTED = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@%+=:,./-")
# pdsh rewrites %<letter> sequences in the remote command (DeepSpeed relies on %n -> node
# rank); orch refuses every "%<letter>" / "%%" rather than guess which ones pdsh touches.
_PDSH_PERCENT = re.compile(r"%[A-Za-z%]")


# --------------------------------------------------------------------------- pdsh helpers


def render_pdsh_export(value: str) -> str:
    """Return ``value`` as DeepSpeed writes it after ``export K=`` (``add_export``).

    Same as multinode_runner.py ``MultiNodeRunner.add_export``: strip surrounding whitespace;
    if any character is outside ``[\\w@%+=:,./-]``, wrap the whole value in double quotes
    (nothing inside is escaped).
    """
    value = value.strip()
    if _ADD_EXPORT_NEEDS_QUOTES.search(value):
        value = f'"{value}"'
    return value


def pdsh_export_value(raw: str, *, name: str = "value") -> str:
    """Return what a rank sees for a variable DeepSpeed's pdsh runner exports with value ``raw``.

    The runner strips ``raw`` and maybe double-quotes it (:func:`render_pdsh_export`); the
    remote POSIX shell then evaluates ``export K=<rendered>``. Inside double quotes a backslash
    escapes only ``$ ` " \\`` and newline and is kept otherwise.

    Raises:
        LaunchError: the result would depend on the remote shell (an unescaped ``$`` or
            backquote), would break DeepSpeed's command (an unescaped ``"``), or contains a
            ``%<letter>`` that pdsh may rewrite.
    """
    rendered = render_pdsh_export(raw)
    if _PDSH_PERCENT.search(rendered):
        raise LaunchError(f"{name} {raw!r} contains '%' followed by a letter, which pdsh may "
                          "rewrite in the remote command; it cannot be exported under pdsh")
    if not _ADD_EXPORT_NEEDS_QUOTES.search(raw.strip()):
        return rendered  # unquoted: only characters the shell leaves alone
    inner, out, i = rendered[1:-1], [], 0
    while i < len(inner):
        c = inner[i]
        if c == "\\" and i + 1 == len(inner):
            raise LaunchError(f"{name} {raw!r} ends with a backslash, which escapes DeepSpeed's "
                              "closing double quote and breaks the remote command")
        if c == "\\" and i + 1 < len(inner) and inner[i + 1] in '$`"\\\n':
            if inner[i + 1] != "\n":
                out.append(inner[i + 1])
            i += 2
            continue
        if c in "$`":
            raise LaunchError(f"{name} {raw!r} contains {c!r}: under pdsh DeepSpeed exports it "
                              "inside double quotes, so the remote shell would expand it; give "
                              "the expanded value instead")
        if c == '"':
            raise LaunchError(f"{name} {raw!r} contains a double quote: DeepSpeed exports it "
                              "inside double quotes without escaping, which breaks the remote "
                              "command; it cannot be exported under pdsh")
        out.append(c)
        i += 1
    return "".join(out)


def pdsh_word_ok(word: str) -> bool:
    """True when the remote shell turns the unquoted ``word`` into exactly itself.

    Used for the interpreter, the working directory (``cd <cwd>;``), the script and every
    script argument DeepSpeed does not quote. Allowed: letters, digits and ``_@%+=:,./-``
    (no ``%<letter>``); the word must not be empty (an empty word vanishes).
    """
    return (bool(word) and all(c in _SAFE_UNQUOTED or (ord(c) > 127 and c.isalnum()) for c in word)
            and not _PDSH_PERCENT.search(word))


def pdsh_quote_user_arg(arg: str) -> str:
    """Return a script argument as DeepSpeed puts it in the pdsh command.

    Same as multinode_runner.py ``PDSHRunner.parse_user_args``: an argument containing a space
    becomes ``"<arg with " escaped as \\">"``; others are passed unchanged (unquoted).
    """
    if " " in arg:
        return '"{}"'.format(arg.replace('"', '\\"'))
    return arg


def _pdsh_user_arg_ok(arg: str) -> bool:
    if " " in arg:  # inside "...": only $ ` \ are special (DeepSpeed escapes ")
        return not any(c in arg for c in "$`\\") and not _PDSH_PERCENT.search(arg)
    return pdsh_word_ok(arg)


def pdsh_exports(runner_env: Mapping[str, str], cwd: str,
                 deepspeed_env_lines: Iterable[str] = (), *,
                 accelerator_exports: Sequence[str] = ACCELERATOR_EXPORT_PREFIXES["cuda"]) -> dict[str, str]:
    """Return the variables DeepSpeed's pdsh runner exports to every node, as the ranks see them.

    Same as runner.py ``main()`` (multi-node branch, i.e. only when the pool has more than one
    node; with one node nothing is exported), in the same order:

    1. ``PYTHONPATH`` in the runner's environment becomes ``<cwd>:<PYTHONPATH>`` (or ``<cwd>``);
    2. every variable whose name starts with one of :data:`RUNNER_EXPORT_PREFIXES` or
       ``accelerator_exports`` is exported (environment order; a new ``PYTHONPATH`` comes last),
       except ``NCCL_IB_HCA``/``UCX_NET_DEVICES`` when ``AISC_JOB_NAME`` is set;
    3. each line ``KEY=VALUE`` of the ``.deepspeed_env`` files (see
       :func:`deepspeed_env_files`), concatenated in that order, is exported (a later one wins,
       keeping the first one's position).

    Keys and values are stripped as ``add_export`` strips them and otherwise passed byte for
    byte (orch runs no shell; :meth:`DeepSpeedLauncher.warnings` names values DeepSpeed's
    remote shell would have changed).

    Args:
        runner_env: the environment ``deepspeed`` runs with on the controller.
        cwd: the runner's (absolute) working directory, i.e. the ranks' ``workdir``.
        deepspeed_env_lines: the lines of the existing ``.deepspeed_env`` files, in order.
        accelerator_exports: the controller's ``get_accelerator().export_envs()``
            (see :data:`ACCELERATOR_EXPORT_PREFIXES`; ``("NCCL",)`` for CUDA).

    Raises:
        LaunchError: a ``.deepspeed_env`` line has no ``=`` (DeepSpeed itself fails with
            ``ValueError``) or a key is not an environment variable name.
    """
    if not posixpath.isabs(cwd):
        raise LaunchError(f"pdsh_exports needs the runner's absolute working directory, got {cwd!r}")
    cwd = posixpath.normpath(cwd)
    env = dict(runner_env)
    env["PYTHONPATH"] = f"{cwd}:{env['PYTHONPATH']}" if "PYTHONPATH" in env else cwd
    excluded: list[str] = []
    for key, names in RUNNER_EXCLUDE_ENVS.items():
        if key in env:
            excluded += names
    prefixes = tuple(RUNNER_EXPORT_PREFIXES) + tuple(accelerator_exports)
    raw: dict[str, str] = {}
    for var, val in env.items():
        if any(var.startswith(p) for p in prefixes) and var not in excluded:
            raw[var.strip()] = val
    out = _evaluate_exports(raw)
    out.update(deepspeed_env_exports(deepspeed_env_lines))
    return out


def deepspeed_env_exports(deepspeed_env_lines: Iterable[str]) -> dict[str, str]:
    """Return the variables the ``.deepspeed_env`` lines export under pdsh, as the ranks see them.

    Same as runner.py ``main()``: every line is ``key, val = line.split('=', maxsplit=1)``
    (no comments, no blank lines), then ``add_export`` (stripped); a later line wins. Only for
    the multi-node pdsh path. Values are passed byte for byte (no shell).

    Raises:
        LaunchError: a line has no ``=`` (DeepSpeed itself fails with ``ValueError``) or a key
            is not an environment variable name.
    """
    raw: dict[str, str] = {}
    for line_no, line in enumerate(deepspeed_env_lines, 1):
        if "=" not in line:
            raise LaunchError(f".deepspeed_env line {line_no} {line.rstrip()!r} is not KEY=VALUE "
                              "(DeepSpeed's runner fails on it)")
        key, val = line.split("=", 1)
        raw[key.strip()] = val
    return _evaluate_exports(raw)


def _evaluate_exports(raw: Mapping[str, str]) -> dict[str, str]:
    """The exported values as orch passes them: stripped (as ``add_export`` strips them), and
    otherwise byte for byte. orch's agents start ranks without a shell, so nothing in a value
    is ever expanded or run; where DeepSpeed's remote shell would have changed a value,
    :meth:`DeepSpeedLauncher.warnings` says so (via :func:`pdsh_export_value`)."""
    out: dict[str, str] = {}
    for key, val in raw.items():
        if not key or "=" in key or "\0" in key:
            raise LaunchError(f"cannot export {key!r}: not an environment variable name")
        out[key] = val.strip()
    return out


def deepspeed_env_files(runner_env: Mapping[str, str], home: str, cwd: str) -> list[str]:
    """Return the ``.deepspeed_env`` paths DeepSpeed's pdsh runner reads, in order (if they exist).

    Same as runner.py ``DEEPSPEED_ENVIRONMENT_PATHS``/``DEEPSPEED_ENVIRONMENT_NAME``: the file
    named by ``DS_ENV_FILE`` (default ``.deepspeed_env``) in ``home`` and then in ``cwd``. Both
    are read when both exist (the same file twice when ``home == cwd``). The nossh path reads none.
    """
    name = runner_env.get("DS_ENV_FILE", ".deepspeed_env")
    return [os.path.join(home, name), os.path.join(cwd, name)]


# --------------------------------------------------------------------------- the launcher


@dataclass(frozen=True)
class DeepSpeedLauncher:
    """DeepSpeed's ``pdsh`` (``ssh=True``) or ``nossh`` (``ssh=False``) launcher.

    Attributes:
        name: ``"pdsh"`` or ``"nossh"``.
        ssh: whether the job is started through pdsh from one machine.
        visible_devices_envs: the nodes' ``get_accelerator().visible_devices_envs()``:
            ``("CUDA_VISIBLE_DEVICES",)`` for cuda, cpu, mps and hpu; ``("ZE_AFFINITY_MASK",)``
            for xpu, ``("ASCEND_RT_VISIBLE_DEVICES",)`` for npu.
    """

    name: str
    ssh: bool
    visible_devices_envs: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)

    # ---------------------------------------------------------------- checks

    def _check(self, ctx: LaunchContext) -> None:
        check_context(self.name, ctx, "deepspeed.launcher.launch refuses '--no_python' with '--module'",
                      "pdsh" if self.ssh else None)

    def uses_pdsh(self, ctx: LaunchContext) -> bool:
        """True when DeepSpeed really goes through pdsh: the pdsh launcher and more than one node.

        runner.py ``main()``: ``multi_node_exec = (args.force_multi or len(active_resources) > 1)
        and not args.no_ssh``; with a single node it runs ``launch.py`` locally instead, without
        pdsh, exports, PYTHONPATH or ``.deepspeed_env``, unless ``--force_multi`` (``ctx.force_multi``).
        """
        return self.ssh and ctx.multi_node

    def warnings(self, ctx: LaunchContext) -> list[str]:
        """What DeepSpeed's real pdsh launcher would have changed, and orch passes exactly.

        DeepSpeed's pdsh path sends the interpreter, working directory, entrypoint and
        master address unquoted through a remote shell, quotes script arguments only when
        they contain a space, and exports values as ``export K="V"``. orch's agents start
        ranks without a shell, so every value reaches the rank byte for byte; these
        warnings say where the real tool would have differed. Empty for nossh and for
        pdsh with one node (no remote shell then).
        """
        if not self.uses_pdsh(ctx):
            return []
        out = []
        if ctx.bind_cores == "auto":
            out.append("bind_cores auto: DeepSpeed's pdsh runner does not pass --bind_cores_to_rank to the nodes' "
                       "launch.py (multinode_runner.py PDSHRunner.get_cmd), so under the real tool the ranks would not "
                       "be pinned; orch's agents pin them")
        words = [("interpreter", ctx.python), ("working directory", posixpath.normpath(ctx.workdir)),
                 ("entrypoint", ctx.entrypoint), ("master address", ctx.master_addr)]
        for what, word in words:
            if not pdsh_word_ok(word):
                out.append(f"the {what} {word!r} would be changed by DeepSpeed's pdsh launcher (it passes "
                           "it unquoted through a remote shell); orch passes it exactly")
        for arg in ctx.args:
            if not _pdsh_user_arg_ok(arg):
                out.append(f"script argument {arg!r} would be changed by DeepSpeed's pdsh launcher (it "
                           "quotes only arguments with spaces, with \"...\"); orch passes it exactly")
        for key, value in ctx.exports.items():
            if not _ENV_KEY.match(key):
                out.append(f"{key!r} is not a shell variable name: DeepSpeed's pdsh launcher could not "
                           "export it; orch passes it exactly")
                continue
            if value != value.strip():
                out.append(f"exported {key}={value!r} has surrounding whitespace, which DeepSpeed's "
                           "runner strips; orch passes it exactly")
                continue
            try:
                seen = pdsh_export_value(value, name=f"exported {key}=")
            except LaunchError as err:
                out.append(f"{err}; orch passes it exactly")
                continue
            if seen != value:
                out.append(f"exported {key}={value!r} would reach the ranks as {seen.strip()!r} under "
                           "DeepSpeed's pdsh launcher; orch passes it exactly")
        return out

    # ---------------------------------------------------------------- Launcher

    def ranks(self, ctx: LaunchContext, node_rank: int) -> list[RankLaunch]:
        """Return node ``node_rank``'s ranks, each with launch.py's argv and variables: :meth:`node_ranks`, each
        rank's ``env`` made whole (``{**common, **own}``).

        Raises:
            LaunchError: as :meth:`node_ranks`.
        """
        return self.node_ranks(ctx, node_rank).launches()

    def node_ranks(self, ctx: LaunchContext, node_rank: int) -> NodeRanks:
        """Node ``node_rank``'s ranks, with launch.py's argv, and its variables as what every rank of the node
        shares (``ctx.exports`` then launch.py's variables, which win over an export of the same name, as
        launch.py overwrites its copy of its environment) and each rank's own ``RANK`` and ``LOCAL_RANK``.

        Raises:
            LaunchError: ``node_rank`` out of range, an empty pool or host, or ``no_python``
                with ``module``. (What the real pdsh's remote shell would change is not an
                error: see :meth:`warnings`.)
        """
        self._check(ctx)
        if not 0 <= node_rank < len(ctx.world):
            raise LaunchError(f"{self.name}: node rank {node_rank} is not in 0..{len(ctx.world) - 1}")
        slots = ctx.world[node_rank][1]
        # made once per pool: WORLD_SIZE, CROSS_SIZE, the rank offsets, local rank -> (argv, LOCAL_RANK)
        size, nodes, offsets, per_local = ctx.once("launch.py node parts", lambda: (
            str(ctx.world_size), str(len(ctx.world)), ctx.rank_offsets, {}))
        for local in range(len(slots)):  # a node's local ranks are 0..len(slots)-1, in some order
            if local not in per_local:
                per_local[local] = (tuple(self._rank_argv(ctx, local)), str(local))
        common = dict(ctx.exports)
        devices = ",".join(map(str, slots))
        for var in self.visible_devices_envs:
            common[var] = devices
        common.update({"MASTER_ADDR": ctx.master_addr, "MASTER_PORT": str(ctx.master_port), "WORLD_SIZE": size,
                       "CROSS_RANK": str(node_rank), "CROSS_SIZE": nodes, "LOCAL_SIZE": str(len(slots))})
        out = [(g, local, slot, argv, {"RANK": str(g), "LOCAL_RANK": name})
               for g, local, slot in rank_layout(ctx.world, node_rank, offsets[node_rank])
               for argv, name in (per_local[local],)]
        return NodeRanks(common, ("RANK", "LOCAL_RANK"), out)

    @staticmethod
    def _rank_argv(ctx: LaunchContext, local_rank: int) -> list[str]:
        # launch.py main(): the spawn loop
        cmd: list[str] = []
        if not ctx.no_python:
            cmd += [ctx.python, "-u"]
            if ctx.module:
                cmd.append("-m")
        cmd.append(ctx.entrypoint)
        if not ctx.no_local_rank:
            cmd.append(f"--local_rank={local_rank}")
        cmd += list(ctx.args)
        return cmd

    def env_defaults(self, ctx: LaunchContext, node_rank: int) -> dict[str, str]:
        """Variables set on the ranks only where the node's own environment lacks them.

        ``{"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}`` (``deepspeed/__init__.py``
        ``os.environ.setdefault``, run when launch.py imports deepspeed), unless an export sets it.
        """
        return {k: v for k, v in DEEPSPEED_IMPORT_DEFAULTS.items() if k not in ctx.exports}

    def agent_store(self, ctx: LaunchContext, node_rank: int) -> tuple[str, int] | None:
        """None: launch.py's rank 0 hosts the c10d store itself."""
        return None

    def launch_argv(self, ctx: LaunchContext, node_rank: int | str) -> list[str]:
        """Return the ``deepspeed.launcher.launch`` command the real tool runs on a node.

        pdsh, more than one node (multinode_runner.py ``PDSHRunner.get_cmd``; ``node_rank`` is
        ``"%n"`` there)::

            python -u -m deepspeed.launcher.launch --world_info=B --node_rank=%n
                --master_addr=A --master_port=P [--no_python] [--module] [--no_local_rank]
                --enable_each_rank_log=None

        nossh, or pdsh with one node (runner.py ``main()``, local branch; ``--node_rank`` only
        with ``--no_ssh``)::

            python -u -m deepspeed.launcher.launch --world_info=B --master_addr=A --master_port=P
                [--node_rank=n] [--no_python] [--module] [--no_local_rank]
                --enable_each_rank_log=None [--bind_cores_to_rank] --log_level=info

        (``--enable_each_rank_log=None`` appears because the runner tests the string ``"None"``
        for truth.) The script and its arguments follow (not included here).
        """
        world_info = encode_world_info(ctx.world)
        flags = []
        if ctx.no_python:
            flags.append("--no_python")
        if ctx.module:
            flags.append("--module")
        if ctx.no_local_rank:
            flags.append("--no_local_rank")
        head = [ctx.python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}"]
        if self.uses_pdsh(ctx):
            return head + [f"--node_rank={node_rank}", f"--master_addr={ctx.master_addr}",
                           f"--master_port={ctx.master_port}"] + flags + ["--enable_each_rank_log=None"]
        head += [f"--master_addr={ctx.master_addr}", f"--master_port={ctx.master_port}"]
        if not self.ssh:
            head.append(f"--node_rank={node_rank}")
        bind = ["--bind_cores_to_rank"] if ctx.bind_cores == "auto" else []  # runner.py main(), local branch
        return head + flags + ["--enable_each_rank_log=None", *bind, "--log_level=info"]

    def real_commands(self, ctx: LaunchContext) -> list[RealCommand]:
        """Return what the real tool runs.

        pdsh with more than one node: one command, run on the controller (``where=None``),
        exactly ``PDSHRunner.get_cmd``'s (with ``ctx.exports`` as the runner's exports)::

            pdsh -S -f 1024 -w h1,h2 "export K=V; ... " "cd <workdir>;" <launch_argv>
                <script> <args quoted as PDSHRunner.parse_user_args does>

        (``ctx.launcher_args`` after the hosts, as get_cmd puts ``--launcher_args``), with
        ``env={"PDSH_RCMD_TYPE": "ssh"}``, ``PYTHONPATH`` when exported (runner.py sets it in its
        own environment too) and ``PDSH_SSH_ARGS_APPEND``: the runner's (``ctx.pdsh_ssh_args_append``)
        with `` -p <ssh_port>`` appended as get_cmd does.

        pdsh with one node: runner.py runs ``launch.py`` itself, on the controller
        (``where=None``; see :meth:`launch_argv`; ``env=ctx.exports``, which must then be in
        the ``deepspeed`` command's environment).

        nossh: two commands per node, in node order: the one a user types on that node
        (``where=host``; ``env=ctx.exports``, which the user must set for the ranks to get them)::

            deepspeed --hostfile=H --no_ssh --node_rank=n --master_addr=A --master_port=P
                [--include=..|--exclude=..] [--num_nodes=..] [--num_gpus=..]
                [--module] [--no_python] [--no_local_rank] <script> <args>

        then what it execs (``where=host``, see :meth:`launch_argv`). ``deepspeed`` runs the
        ranks under its own interpreter, which must be ``ctx.python``.
        """
        self._check(ctx)
        if self.ssh and not self.uses_pdsh(ctx):
            argv = self.launch_argv(ctx, 0) + [ctx.entrypoint, *ctx.args]
            return [RealCommand(where=None, argv=tuple(argv), env=dict(ctx.exports))]
        if self.ssh:
            pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(ctx.hosts), *ctx.launcher_args]
            exports = "".join(f"export {k}={render_pdsh_export(v)}; " for k, v in ctx.exports.items())
            argv = (pdsh + [exports, f"cd {posixpath.normpath(ctx.workdir)};"]
                    + self.launch_argv(ctx, "%n") + [ctx.entrypoint]
                    + [pdsh_quote_user_arg(a) for a in ctx.args])
            env = {"PDSH_RCMD_TYPE": "ssh"}
            if "PYTHONPATH" in ctx.exports:  # runner.py main() sets it in its own env too
                env["PYTHONPATH"] = ctx.exports["PYTHONPATH"]
            old = ctx.pdsh_ssh_args_append
            if ctx.ssh_port is not None:
                # get_cmd: f"{old} \<newline><12 spaces>-p {port}": " " + 12 spaces (a line continuation)
                env["PDSH_SSH_ARGS_APPEND"] = f"{old or ''} {' ' * 12}-p {ctx.ssh_port}"
            elif old is not None:  # the runner's own environment, which pdsh reads
                env["PDSH_SSH_ARGS_APPEND"] = old
            return [RealCommand(where=None, argv=tuple(argv), env=env)]
        out = []
        for node_rank, host in enumerate(ctx.hosts):
            user = ["deepspeed"]
            if ctx.hostfile is not None:
                user.append(f"--hostfile={ctx.hostfile}")
            user += ["--no_ssh", f"--node_rank={node_rank}", f"--master_addr={ctx.master_addr}",
                     f"--master_port={ctx.master_port}"]
            if ctx.include:
                user.append(f"--include={ctx.include}")
            if ctx.exclude:
                user.append(f"--exclude={ctx.exclude}")
            if ctx.num_nodes != -1:
                user.append(f"--num_nodes={ctx.num_nodes}")
            if ctx.num_gpus != -1:
                user.append(f"--num_gpus={ctx.num_gpus}")
            if ctx.module:
                user.append("--module")
            if ctx.no_python:
                user.append("--no_python")
            if ctx.no_local_rank:
                user.append("--no_local_rank")
            if ctx.bind_cores == "auto":
                user.append("--bind_cores_to_rank")
            user += [ctx.entrypoint, *ctx.args]
            out.append(RealCommand(where=host, argv=tuple(user), env=dict(ctx.exports)))
            out.append(RealCommand(where=host, argv=tuple(self.launch_argv(ctx, node_rank)
                                                          + [ctx.entrypoint, *ctx.args])))
        return out


#: DeepSpeed's default multinode launcher: pdsh from the controller to every node.
PDSH = DeepSpeedLauncher(name="pdsh", ssh=True)
#: ``deepspeed --no_ssh --node_rank=<n>`` run on every node.
NOSSH = DeepSpeedLauncher(name="nossh", ssh=False)
