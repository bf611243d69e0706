"""Shared fixtures: a state directory, the ``orch`` command, specs, and leftover checks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["timing", "zero_runs"]  # tests/timing.py: --times DIR records where the time goes


#: The skip reason of every test in tests/gpu on a machine where torch sees no CUDA device (each module's
#: docstring names its CPU form in the main suite). CI has no GPU; ``pytest tests/gpu`` runs them where one is.
NO_CUDA = "no CUDA device (tests/gpu run only where torch.cuda.is_available())"
GPU_TESTS = ROOT / "tests" / "gpu"


#: fixtures that start real hosts (sshd namespaces, Ray, Slurm, MPI): a test using one is marked ``cluster``
CLUSTER_FIXTURES = frozenset({"net3", "net4", "make_net", "ray4", "make_ray", "lone_ray", "mpi_net",
                              "mpi_hosts", "slurm_cluster"})
#: fixtures that start headless Chromium: a test using one is marked ``browser``
BROWSER_FIXTURES = frozenset({"browser"})


def _worker(config: pytest.Config) -> str:
    """This process's pytest-xdist worker id (``gw0``, ...), or ``main`` without xdist."""
    return config.workerinput["workerid"] if hasattr(config, "workerinput") else "main"


#: the checkout's own Python, compiled to bytecode at the start of a session: the processes the tests start (CLI
#: commands, servers, agents, ranks) import orchestrator/ and agents/, and where PYTHONDONTWRITEBYTECODE=1 is set
#: (as on this project's CI machines) none of them writes the bytecode it compiled, so each compiled the modules
#: it imports again from source: 0.2 CPU seconds more for a process importing the CLI, the controller and the
#: agent (0.70 against 0.51, ten of each with and without ``__pycache__``; docs/testing.md)
BYTECODE_DIRS = ("orchestrator", "agents", "tests", "examples")


def pytest_configure(config: pytest.Config) -> None:
    """Compile :data:`BYTECODE_DIRS` to ``__pycache__`` once, in the session's first process (not in each
    pytest-xdist worker). Python reads bytecode whether or not it may write it; ``compileall`` writes it either way
    and leaves files whose bytecode is current alone."""
    if hasattr(config, "workerinput"):
        return
    import compileall
    for name in BYTECODE_DIRS:
        compileall.compile_dir(str(ROOT / name), quiet=2)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A session with tests marked ``deepspeed`` starts building DeepSpeed's CPU ops (and async_io for ``async_io``
    ones) in the background now, in one process of the session (the first xdist worker): minutes on a fresh op
    cache that the tests needing none run beside; ``helpers_train.prebuild_ops`` waits for it. Under ``--dist
    loadgroup``, a grouped test whose node id lacks xdist's ``@group`` suffix stops the session (UsageError).

    Raises:
        pytest.UsageError: pytest-xdist's grouping did not take effect (pytest-xdist#1386: pytest 9.2 with xdist 3.8).
    """
    if hasattr(session.config, "workerinput") and session.config.getvalue("loadgroup"):
        ungrouped = [item.nodeid for item in session.items
                     if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if ungrouped:  # the clusters and ZeRO runs would start on every worker, the order would be lost
            raise pytest.UsageError(f"pytest-xdist's --dist loadgroup did not group {ungrouped[0]} (no @group in its "
                                    "node id): this pytest and pytest-xdist do not work together "
                                    "(pytest-xdist#1386); install the versions pyproject.toml's test extra names")
    if _worker(session.config) not in ("main", "gw0") or session.config.getoption("collectonly"):
        return
    if any(item.get_closest_marker("deepspeed") for item in session.items):
        import helpers_train
        helpers_train.start_prebuild(async_io=any(item.get_closest_marker("async_io") for item in session.items))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A background build of the ops still running is let finish (stopped midway it would leave its lock)."""
    import helpers_train
    helpers_train.finish_prebuild()


#: fixtures started once per session that tie the modules using them to one pytest-xdist worker: ``{fixture: group}``
SHARED_GROUPS = {"ray4": "ray", "make_ray": "ray", "lone_ray": "ray", "slurm_cluster": "slurm",
                 "mpi_net": "slurm", "mpi_hosts": "slurm", "zero_run": "zero_runs",
                 "site": "ray"}  # (test_provisioners' site: net4 or ray4, asked for by name)
#: per-file seconds of the last measured run (``python tests/timing.py run`` writes it), for the order of the groups
DURATIONS = ROOT / "tests" / "durations.json"


def xdist_groups(items: list[pytest.Item]) -> dict[str, str]:
    """``{test file: group}``: a file whose tests use a fixture of :data:`SHARED_GROUPS` joins that group (so a Ray or
    Slurm cluster, or the trained ZeRO runs, start once), every other file is a group of its own (its module
    fixtures set up once)."""
    groups: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        names = set(getattr(item, "fixturenames", ()))
        shared = sorted({SHARED_GROUPS[n] for n in names if n in SHARED_GROUPS})
        if shared:
            groups[path] = shared[0]
        groups.setdefault(path, path)
    return groups


def _schedule_for_xdist(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``): mark each test with its file's group (``xdist_group``) and put
    the groups in order of their measured seconds (:data:`DURATIONS`), longest first, so the last group to start is
    a short one; within a group the order is the collection's."""
    groups = xdist_groups(items)
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        seconds = {}
    cost: dict[str, float] = {}
    for path, group in groups.items():
        cost[group] = cost.get(group, 0.0) + float(seconds.get(path, 30.0))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(name="g-" + groups[item.nodeid.split("::", 1)[0]].replace("/", ".")))
    order = {item.nodeid: i for i, item in enumerate(items)}
    lone = {item.nodeid.split("::", 1)[0] for item in items if "lone_ray" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: (-cost[groups[item.nodeid.split("::", 1)[0]]], groups[item.nodeid.split("::", 1)[0]],
                                 item.nodeid.split("::", 1)[0] in lone, order[item.nodeid]))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark what a test's fixtures start (``cluster``, ``browser``, both ``integration``); under pytest-xdist, group
    and order the tests (:func:`_schedule_for_xdist`); skip every tests/gpu test, with the one reason
    :data:`NO_CUDA`, where torch sees no CUDA device."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in (("cluster", CLUSTER_FIXTURES), ("browser", BROWSER_FIXTURES)):
            if names & fixtures:
                item.add_marker(marker)
                item.add_marker("integration")
    if hasattr(config, "workerinput"):
        _schedule_for_xdist(items)
    gpu_items = [item for item in items if GPU_TESTS in Path(item.path).parents]
    if not gpu_items:
        return
    import torch
    if torch.cuda.is_available():
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=NO_CUDA))
SCRIPTS = ROOT / "tests" / "scripts"


# --------------------------------------------------------------------------- the fast tier starts no process
# A test not marked ``integration`` is in the fast tier (``pytest -m "not integration"``): while its setup and
# its call run, starting a process (subprocess, fork, spawn, system) fails it, naming the command. Teardown is
# left alone: the last test of a module tears down the module's fixtures, which may be an integration test's.

class ProcessStarted(AssertionError):
    """A fast-tier test started a process."""


@contextlib.contextmanager
def no_processes(nodeid: str):
    """While inside, every way of starting a process raises :class:`ProcessStarted` naming ``nodeid``."""
    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kw: Any) -> Any:
            shown = args[1] if what == "subprocess" and len(args) > 1 else (args[0] if args else "")
            raise ProcessStarted(f"{nodeid} is in the fast tier (not marked integration) and started a process "
                                 f"({what}: {shown!r}); mark it pytest.mark.integration or start nothing")
        return refused
    patches = [(subprocess.Popen, "_execute_child", refuse("subprocess"))]
    # (not os.system: a test pickles it by name, and a stand-in has another name)
    patches += [(os, name, refuse(f"os.{name}")) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp")
                if hasattr(os, name)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def _fast(item: pytest.Item) -> bool:
    return item.get_closest_marker("integration") is None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # noqa: ANN201 - a hook wrapper
    if not _fast(item):
        yield
        return
    with no_processes(item.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):  # noqa: ANN201 - a hook wrapper
    if not _fast(item):
        yield
        return
    with no_processes(item.nodeid):
        yield

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed's JIT op cache of the tests' own: a shared one is rebuilt by every other virtualenv, and a
# build killed midway leaves a lock that hangs every later rank using it
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
# their compiler: tests/bin/c++, the system's without debug information (a third less CPU for a fresh op cache)
if str(ROOT / "tests" / "bin") not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = str(ROOT / "tests" / "bin") + os.pathsep + os.environ.get("PATH", os.defpath)


#: Hugging Face's ZeRO-2 example for the Trainer, in short: what it fills is "auto".
HF_DS = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto"}},
         "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}


def job_processes(job_id: str, running: str | None = None) -> list[psutil.Process]:
    """Every live process of a job: ranks (ORCH_ATTEMPT_ID) and agents (ORCH_AGENT_ATTEMPT_ID); with ``running``,
    only those whose command line contains it (read here, so a process ending meanwhile is left out, not raised)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
            if not any(env.get(key, "").startswith(job_id + ".")
                       for key in ("ORCH_ATTEMPT_ID", "ORCH_AGENT_ATTEMPT_ID")):
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if running is not None and running not in " ".join(proc.cmdline()):  # (only the job's are read)
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        found.append(proc)
    return found


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``cond`` until it returns something truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def assert_no_leftovers(job_id: str, timeout: float = 10.0) -> None:
    """Every process of the job is gone (polled up to ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        left = job_processes(job_id)
        if not left:
            return
        if time.monotonic() > deadline:
            desc = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]
            raise AssertionError(f"processes of job {job_id} left behind: {desc}")
        time.sleep(0.1)


#: commands that start no job and no process (they read the store or files; export writes one file from a
#: checkpoint), never with a follow: :class:`Orch` runs them through the CLI's entry in-process
IN_PROCESS = ("plan", "list", "status", "logs", "export")
#: options of ``orch`` itself that take a value, before the command's name (orchestrator/face/cli/app.py)
TOP_VALUED = ("--state-dir", "--output", "-o", "--server", "--token-file")


def reads_only(args: tuple[str, ...] | list[str]) -> bool:
    """The command starts nothing (:data:`IN_PROCESS`, ``resume --dry-run``) and follows nothing (``--follow``)."""
    rest = list(args)
    while rest and rest[0].startswith("-"):
        rest = rest[2:] if rest[0] in TOP_VALUED else rest[1:]
    if not rest or "--follow" in rest or "-f" in rest:
        return False
    return rest[0] in IN_PROCESS or (rest[0] == "resume" and "--dry-run" in rest)


def cli(*args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``orch ARGS`` through the CLI's entry in this process (:func:`run_cli_in_process`), with ``env``
    (default: this process's) and in ``cwd``. For commands that start nothing (plan, list, a refused drop-in)."""
    return run_cli_in_process([sys.executable, "-m", "orchestrator", *args], args, dict(os.environ if env is None
                                                                                       else env), cwd=cwd)


def _forget_process_caches() -> None:
    """Empty what orch keeps in memory between calls in one process (for its server's dashboard, which polls every
    second): a real ``orch`` command starts without it, so each in-process call does too."""
    from orchestrator.observe import checkpoints, views
    with checkpoints._cache_lock:
        checkpoints._cache.clear()
    views._goodput_cache.clear()


def run_cli_in_process(argv: list[str], args: tuple[str, ...] | list[str], env: dict[str, str],
                       cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``orchestrator.face.cli.main(args)`` in this process with ``env`` as its whole environment (and ``cwd``
    as its directory) and its output captured, as ``subprocess.run(argv, capture_output=True, text=True)``
    would report it: an uncaught exception is a traceback on stderr and status 1, as the interpreter would
    print it. The CLI's consoles print 200 columns here as they do to a pipe (orchestrator/face/cli/output.py)."""
    import io
    import traceback
    from contextlib import redirect_stderr, redirect_stdout

    from orchestrator.face.cli import main
    from orchestrator.face.cli import output
    _forget_process_caches()
    saved, widths = dict(os.environ), (output.console._width, output.err_console._width)
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    try:
        if cwd is not None:
            os.chdir(cwd)
        output.console._width = output.err_console._width = 200
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 - what the interpreter would print and exit 1 with
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
        output.console._width, output.err_console._width = widths
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


class Orch:
    """Runs the ``orch`` command against one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def env(self, extra: dict[str, str] | None = None, replace: bool = False) -> dict[str, str]:
        """The command's environment: ``os.environ`` (only ``extra`` with ``replace``), plus
        ``ORCH_STATE_DIR``, without ``ORCH_SERVER``, with ``extra`` laid over it."""
        env = {} if replace else dict(os.environ)
        env["ORCH_STATE_DIR"] = str(self.state_dir)
        env.pop("ORCH_SERVER", None)
        env.update(extra or {})
        return env

    def cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "orchestrator", *args]

    def token(self) -> str:
        """The token of the servers of this state dir (``orch server`` creates it)."""
        return (self.state_dir / "server.token").read_text().strip()

    def http(self) -> Any:
        """An ``httpx.Client`` sending the server's token (``Authorization: Bearer``)."""
        import httpx
        return httpx.Client(headers={"Authorization": f"Bearer {self.token()}"}, timeout=30)

    def __call__(self, *args: str, timeout: float = 600, env: dict[str, str] | None = None,
                 check: bool | None = None, replace_env: bool = False,
                 subprocess_: bool | None = None) -> subprocess.CompletedProcess:
        """``orch ARGS``: read-only commands (:func:`reads_only`) through the CLI's entry in this process,
        the rest (and any with ``subprocess_=True``, or ``replace_env``) as a real process."""
        in_process = reads_only(args) and not replace_env if subprocess_ is None else not subprocess_
        if in_process:
            r = run_cli_in_process(self.cmd(*args), args, self.env(env))
        else:
            r = subprocess.run(self.cmd(*args), capture_output=True, text=True, timeout=timeout,
                               env=self.env(env, replace=replace_env))
        if check and r.returncode != 0:
            raise AssertionError(f"orch {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def json(self, *args: str, **kw: Any) -> Any:
        r = self(*args, "--output", "json", **kw)
        try:
            return json.loads(r.stdout)
        except ValueError as err:
            raise AssertionError(f"orch {' '.join(args)} printed no JSON ({r.returncode}):\n{r.stdout}\n{r.stderr}") from err

    def events(self, job_id: str, kind: str | None = None) -> list:
        """The job's events from the store (``EventRecord``s, oldest first), only ``kind`` if given."""
        from orchestrator.store import Store
        store = Store(self.state_dir / "orch.db")
        try:
            return [e for e in store.events(job_id) if kind is None or e.kind == kind]
        finally:
            store.close()

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env(env), start_new_session=True)


@pytest.fixture()
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture()
def orch(state_dir: Path) -> Orch:
    return Orch(state_dir)


@pytest.fixture()
def write_spec(tmp_path: Path) -> Callable[..., Path]:
    """Write a job spec (YAML) from keyword fields; returns its path."""
    counter = iter(range(1000))

    def write(**fields: Any) -> Path:
        fields.setdefault("name", "t")
        path = tmp_path / f"job{next(counter)}.yaml"
        path.write_text(yaml.safe_dump(fields, sort_keys=False))
        return path
    return write


@pytest.fixture()
def hostfile(tmp_path: Path) -> Callable[[str], Path]:
    def write(text: str) -> Path:
        p = tmp_path / "hostfile"
        p.write_text(text)
        return p
    return write


# --------------------------------------------------------------------------- namespace test hosts
# Real "nodes" on this machine: network namespaces on a bridge, each with its own sshd
# (tests/nethosts.py). Needs root, openssh-server, openssh-client and iproute2 (.ci/run installs
# them); without them these fixtures FAIL with the reason: tests that need hosts are never skipped.

def start_test_network(n_hosts: int, **kw: Any) -> Any:
    """The common factory: a started ``nethosts.TestNetwork``; the caller closes it."""
    import nethosts
    try:
        nethosts.check_prerequisites()
    except nethosts.NetHostsError as err:
        pytest.fail(f"cannot build {n_hosts} namespace test hosts: {err}", pytrace=False)
    try:
        return nethosts.TestNetwork(n_hosts, **kw).start()
    except nethosts.NetHostsError as err:    # e.g. no CAP_SYS_ADMIN for `ip netns add` in a container
        pytest.fail(f"cannot build {n_hosts} namespace test hosts: {err}", pytrace=False)


# Each cluster is started once per session (per pytest-xdist worker) and handed to every module that asks for
# it; after each module it is reset (links up, every process but its daemons killed, dead daemons restarted),
# so a module finds it as the first one did.

@pytest.fixture(scope="session")
def _net3_session() -> Any:
    net = start_test_network(3)
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="session")
def _net4_session() -> Any:
    net = start_test_network(4)
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def net3(_net3_session: Any) -> Any:
    """3 namespace hosts with sshd, started once per session and reset after each module. A test that
    kills a host or cuts a link should call ``net3.reset()`` when done (links up, strays killed, sshds back)."""
    yield _net3_session
    _net3_session.reset()


@pytest.fixture(scope="module")
def net4(_net4_session: Any) -> Any:
    """4 namespace hosts with sshd, started once per session and reset after each module (see ``net3``)."""
    yield _net4_session
    _net4_session.reset()


@pytest.fixture()
def make_net() -> Any:
    """Factory for networks of this test only: ``make_net(2)``; all closed when the test ends."""
    nets: list[Any] = []

    def make(n_hosts: int, **kw: Any) -> Any:
        net = start_test_network(n_hosts, **kw)
        nets.append(net)
        return net
    yield make
    errors = []
    for net in reversed(nets):
        try:
            net.close()
        except Exception as err:  # noqa: BLE001
            errors.append(str(err))
    if errors:
        raise AssertionError("; ".join(errors))


# --------------------------------------------------------------------------- Ray test clusters
# A real multi-node Ray cluster on namespace hosts (tests/raycluster.py): the head on the
# bridge address, one worker node per host at the host's address. Needs what the namespace
# hosts need plus ray in this environment; without it these fixtures FAIL with the reason.

def start_ray_cluster(net: Any, **kw: Any) -> Any:
    """A started ``raycluster.RayTestCluster`` on ``net``; the caller closes it (and ``net``)."""
    import raycluster
    try:
        raycluster.check_prerequisites()
    except raycluster.RayClusterError as err:
        pytest.fail(f"cannot start a Ray test cluster: {err}", pytrace=False)
    try:
        return raycluster.RayTestCluster(net, **kw).start()
    except raycluster.RayClusterError as err:
        pytest.fail(f"cannot start a Ray test cluster on {net!r}: {err}", pytrace=False)


def _ray_cluster_on_new_network(n_hosts: int, **kw: Any) -> Any:
    """(cluster, net): a fresh network (not shared with the SSH tests' ``net3``/``net4``)."""
    net = start_test_network(n_hosts)
    try:
        return start_ray_cluster(net, **kw), net
    except BaseException:
        net.close()
        raise


def _close_ray_cluster(cluster: Any, net: Any) -> None:
    """Close both; raise if anything of the cluster is left (a leaked raylet fails the run)."""
    errors = []
    try:
        cluster.close()
    except Exception as err:  # noqa: BLE001
        errors.append(str(err))
    left = cluster.leftovers()
    if left:
        errors.append(f"Ray test cluster left {left}")
    try:
        net.close()
    except Exception as err:  # noqa: BLE001
        errors.append(str(err))
    if errors:
        raise AssertionError("; ".join(errors))


class _RayClusters:
    """The session's shared Ray test clusters by size, started on first use; :meth:`close_all` ends them for a
    module that needs to be the only Ray cluster on the machine (``lone_ray``): a later module starts them again."""

    def __init__(self) -> None:
        self.open: dict[int, tuple[Any, Any]] = {}

    def get(self, n_hosts: int) -> Any:
        if n_hosts not in self.open:
            self.open[n_hosts] = _ray_cluster_on_new_network(n_hosts)
        return self.open[n_hosts][0]

    def close_all(self) -> None:
        errors = []
        while self.open:
            _, (cluster, net) = self.open.popitem()
            try:
                _close_ray_cluster(cluster, net)
            except AssertionError as err:
                errors.append(str(err))
        if errors:
            raise AssertionError("; ".join(errors))


@pytest.fixture(scope="session")
def _ray_sessions() -> Any:
    clusters = _RayClusters()
    try:
        yield clusters
    finally:
        clusters.close_all()


@pytest.fixture(scope="module")
def lone_ray(_ray_sessions: Any) -> None:
    """No Ray test cluster of this session runs while the module's tests do (``ray.address: auto`` finds every
    cluster on the machine)."""
    _ray_sessions.close_all()


@pytest.fixture(scope="session")
def _ray4_session(_ray_sessions: Any) -> Any:
    return _ray_sessions


@pytest.fixture(scope="module")
def ray4(_ray4_session: Any) -> Any:
    """A Ray cluster on 4 fresh namespace hosts (2 CPUs each; the head has none), started once per session and
    reset after each module; ``ray4.net`` is its network. A test that kills a node or cuts a link should call
    ``ray4.reset()`` when done (links up, dead nodes restarted)."""
    cluster = _ray4_session.get(4)
    yield cluster
    cluster.reset()


@pytest.fixture()
def make_ray() -> Any:
    """Factory for Ray clusters of this test only, each on a fresh network:
    ``make_ray(2, env=RayTestCluster.FAST_FAILURE_DETECTION)``; all closed when the test ends."""
    made: list[tuple[Any, Any]] = []

    def make(n_hosts: int, **kw: Any) -> Any:
        cluster, net = _ray_cluster_on_new_network(n_hosts, **kw)
        made.append((cluster, net))
        return cluster
    yield make
    errors = []
    for cluster, net in reversed(made):
        try:
            _close_ray_cluster(cluster, net)
        except AssertionError as err:
            errors.append(str(err))
    if errors:
        raise AssertionError("; ".join(errors))


def server_answers(orch: Orch, url: str) -> bool:
    """``orch server`` at ``url`` answers ``/api/health`` (False while it starts: no token yet, not listening)."""
    import httpx
    try:
        return orch.http().get(f"{url}/api/health", timeout=1).status_code == 200
    except (OSError, httpx.HTTPError):
        return False


@contextlib.contextmanager
def running_server(orch: Orch, *args: str):
    """``orch server`` on a free port for ``orch``'s state dir (plus ``args``), up and answering;
    yields ``(process, url)`` and stops it (SIGTERM) on the way out. The process carries ``login_url`` and
    ``startup_lines``: the stderr lines it printed up to its dashboard line."""
    import signal
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = orch.popen("server", "--port", str(port), *args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server_answers(orch, url), 30, "the server to answer")
        proc.startup_lines = []
        while not getattr(proc, "login_url", None):  # printed before it serves; the Popen carries it
            line = proc.stderr.readline()
            assert line, f"orch server printed no login URL: {''.join(proc.startup_lines)}"
            proc.startup_lines.append(line)
            if line.startswith("dashboard: "):
                proc.login_url = line.split(" ", 1)[1].strip()
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="session")
def _browser_session():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} is missing: install Debian's chromium and chromium-driver", pytrace=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def browser(_browser_session):
    """Debian's headless Chromium under Selenium, 1280x900, its console log kept; started once per session,
    and between modules back on a blank page with no cookies, storage or console lines of the last one."""
    driver = _browser_session
    yield driver
    driver.get("about:blank")
    driver.execute_cdp_cmd("Network.clearBrowserCookies", {})  # every site's (delete_all_cookies: the page's only)
    driver.set_window_size(1280, 900)
    driver.get_log("browser")  # (reading the log empties it)


# --------------------------------------------------------------------------- MPI and Slurm test hosts
# (tests/helpers_mpi.py, tests/slurmcluster.py)

@pytest.fixture(scope="session")
def _mpi_net_session():
    net = start_test_network(4, own_hostnames=True)
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def mpi_net(_mpi_net_session):
    """4 namespace hosts with their own hostnames (the 4th a spare the hostfile of ``mpi_hosts`` leaves
    out): mpi_discovery's LOCAL_RANK counts earlier ranks with the same processor name (the hostname).
    Started once per session, reset after each module (the Slurm cluster on it too, ``slurm_cluster``)."""
    yield _mpi_net_session
    _mpi_net_session.reset()


@pytest.fixture(scope="module")
def mpi_hosts(mpi_net, tmp_path_factory):
    """``(net, bin dir with an ssh that uses the test hosts' config, hostfile of hosts 0-2)``."""
    net3 = mpi_net
    tmp = tmp_path_factory.mktemp("mpi")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {net3.ssh_config} "$@"\n')
    ssh.chmod(0o755)
    hostfile = tmp / "hostfile"
    from helpers_mpi import SLOTS
    hostfile.write_text("".join(f"{name} slots={SLOTS}\n" for name in net3.names[:3]))
    return net3, bin_dir, hostfile


@pytest.fixture(scope="session")
def _slurm_session(_mpi_net_session):
    import slurmcluster
    try:
        cluster = slurmcluster.SlurmCluster(_mpi_net_session).start()
    except slurmcluster.SlurmError as err:
        pytest.fail(f"cannot start the Slurm test cluster: {err}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def slurm_cluster(_slurm_session, mpi_net):
    """A real Slurm cluster (tests/slurmcluster.py) with a slurmd on every host of ``mpi_net``, started once per
    session; each module finds every slurmd running, no job left and every node idle
    (:meth:`SlurmCluster.restart_dead`: the last module's ``mpi_net`` reset killed what ran on the hosts)."""
    _slurm_session.restart_dead()
    yield _slurm_session


@pytest.fixture()
def server(orch):
    """``orch server`` for the test's state dir: ``(process, url)`` (:func:`running_server`)."""
    with running_server(orch) as served:
        yield served
