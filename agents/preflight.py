"""Per-node preflight: what a node's agent checks before any rank of the attempt starts.

The controller decides which checks apply (``orchestrator.supervision.preflight``); the agent runs
them and answers with each check's result. Two phases, each a ``preflight`` message
answered by a ``preflight_result`` (see :mod:`agents.link`):

``check``
    * ``workdir``: the ranks' working directory exists;
    * ``entrypoint``: the script is a file there; with ``module``, the spec's Python finds
      the module from the workdir; with ``no_python``, the executable is found as the rank
      would run it (a path from the workdir, else the ranks' ``PATH``);
    * ``python``: the spec's Python runs (its version is reported);
    * ``deepspeed``: that Python finds ``deepspeed`` and ``torch`` (or, asked to, imports
      ``deepspeed``);
    * ``checkpoint_dir``: the checkpoint directory exists or can be created, and a file can
      be written into it and removed;
    * ``master_port``: (node 0) nothing listens on the master port;
    * ``network``: an interface reaches the master address, and the one the ranks' collectives
      will use exists (the job's ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, else the one
      :mod:`agents.network` chooses); a loopback master of a job that spans hosts fails;
    * ``build_locks``: (a DeepSpeed job) no stale torch extension build lock where the ranks build
      ops (:mod:`agents.buildlocks`);
    * ``zero_pp``, ``nvme``: (a config with ZeRO++ quantisation, NVMe offload) the accelerator has DeepSpeed's
      quantizer kernels; libaio, and each ``nvme_path`` writable with space (:mod:`agents.preflight_features`);
    * ``ops``: (a DeepSpeed job, once the three checks above passed) the DeepSpeed ops its config needs are
      built, or found built, where the ranks load them (:mod:`agents.opbuild`): once per node, before any
      rank starts;
    * and, for the shared-storage check, the node writes a token file
      ``<checkpoint dir>/.orch-preflight-<attempt id>/node-<node rank>.json`` holding the
      attempt's nonce.

``list``
    The node opens the token of every node the controller names and answers which of them
    it sees (with the right nonce). Tokens are opened by name, not listed: an NFS client
    revalidates a name it has never looked up, while a directory listing may come from its
    attribute cache.

Each check's result is ``{"name", "status": "passed" | "failed" | "skipped", "detail",
"seconds"}``; ``detail`` is one sentence naming what was found. The token is removed (and
its directory, by whichever node removes the last token) by :meth:`NodePreflight.cleanup`,
which the agent calls when it leaves the wait for ``start``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Callable, Mapping

from . import buildlocks, network, opbuild
from . import preflight_features as features
from .ranks import _die_with_parent

__all__ = ["NodePreflight", "run_in_thread", "PASSED", "FAILED", "SKIPPED", "TOKEN_PREFIX"]

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
#: Name prefix of the shared-storage token directory inside the checkpoint directory.
TOKEN_PREFIX = ".orch-preflight-"
_MARK = "@@orch-preflight@@"

# Run by the spec's Python with argv [deepspeed mode ("find" | "import" | ""), module or ""].
# Plain %-formatting and no f-strings: it must at least report on an old Python 3.
_PROBE = r"""
import json, sys
out = {"executable": sys.executable, "version": "%d.%d.%d" % tuple(sys.version_info[:3])}
mode, module = sys.argv[1], sys.argv[2]
def find(name):
    import importlib.util
    try:
        spec = importlib.util.find_spec(name)
    except BaseException as e:
        return [None, "%s: %s" % (type(e).__name__, e)]
    if spec is None:
        return [None, "No module named %r" % name]
    return [spec.origin or "(namespace package)", None]
def version(dist, origin):
    # the installed distribution's dist-info beside the package (cheap), else importlib.metadata
    import os
    try:
        site = os.path.dirname(os.path.dirname(origin))
        for name in os.listdir(site):
            if name.lower().startswith(dist + "-") and name.endswith(".dist-info"):
                return name[len(dist) + 1:-len(".dist-info")]
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None
def found(name):
    where = find(name)
    return where + [version(name, where[0]) if where[0] else None]
if module:
    out["module"] = find(module)
if mode == "find":
    out["deepspeed"] = found("deepspeed")
    out["torch"] = found("torch")
elif mode == "import":
    try:
        import deepspeed
        out["deepspeed"] = [deepspeed.__file__, None, getattr(deepspeed, "__version__", None)]
    except BaseException as e:
        out["deepspeed"] = [None, "%s: %s" % (type(e).__name__, e), None]
sys.stdout.flush()
sys.stdout.write("\n" + "@@MARK@@" + json.dumps(out) + "\n")
""".replace("@@MARK@@", _MARK)


def _result(name: str, status: str, detail: str, started: float) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "seconds": round(time.monotonic() - started, 4)}


def _why(err: OSError) -> str:
    return err.strerror or str(err)


class NodePreflight:
    """Runs one node's preflight phases (one at a time) and cleans up after them.

    Example::

        pf = NodePreflight(node_rank=0, env=rank_env)
        result = pf.run(msg)          # msg: a ``preflight`` message; result: the answer
        pf.cleanup()                  # remove this node's shared-storage token

    Args:
        node_rank: this node's rank in the plan.
        env: the environment of the node's first rank (the spec's Python and a
            ``no_python`` executable are looked up and run with it).
        host: this node's name in the plan (written into the token).
    """

    def __init__(self, node_rank: int, env: Mapping[str, str], host: str = "") -> None:
        self.node_rank = node_rank
        self.env = dict(env)
        self.host = host
        self.current: str | None = None  # the check running now (the agent's heartbeats carry it)
        self._token: str | None = None
        self._probe: subprocess.Popen[bytes] | None = None
        self._builds: list[subprocess.Popen[bytes]] = []  # the ops check's build (agents.opbuild), while it runs
        self._lock = threading.Lock()
        self._aborted = False

    # -- phases -------------------------------------------------------------------------------

    def run(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one ``preflight`` message: ``{"type": "preflight_result", "phase", ...}``.

        Args:
            msg: ``{"phase": "check", ...}`` (see ``orchestrator.supervision.preflight.PreflightRound.requests``)
                or ``{"phase": "list", "shared": {"dir", "nonce"}, "expect": [node ranks]}``.

        Returns:
            For ``check``: ``{"checks": [result, ...], "token": bool, "seconds"}``; for
            ``list``: ``{"seen": [node ranks], "problems": [str], "seconds"}``. Never raises
            for a failing check: a failure is a result.
        """
        started = time.monotonic()
        phase = msg.get("phase")
        if phase == "list":
            seen, problems = self._list(msg.get("shared") or {}, [int(n) for n in msg.get("expect") or []])
            body: dict[str, Any] = {"seen": seen, "problems": problems}
        else:
            checks = self._check(msg)
            body = {"checks": checks, "token": self._token is not None}
        self.current = None
        return {"type": "preflight_result", "phase": phase, **body,
                "seconds": round(time.monotonic() - started, 4)}

    def _check(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        skip: dict[str, str] = dict(msg.get("skip") or {})
        workdir = str(msg.get("workdir") or "/")
        mode = msg.get("mode", "script")
        results = [self._workdir(workdir)]
        workdir_ok = results[0]["status"] == PASSED
        probe_started = time.monotonic()
        probe = None
        if "python" not in skip:  # started first: it takes longest, the rest runs meanwhile
            deepspeed = "" if "deepspeed" in skip else str(msg.get("deepspeed") or "find")
            module = str(msg.get("entrypoint")) if mode == "module" and workdir_ok else ""
            probe = self._start_probe(str(msg.get("python")), deepspeed, module, workdir if workdir_ok else "/")
        if mode != "module":
            results.append(self._entrypoint_file(str(msg.get("entrypoint")), mode, workdir, workdir_ok))
        results.append(self._checkpoint_dir(str(msg.get("checkpoint_dir")), msg.get("shared")))
        master = msg.get("master_port")
        if master:
            results.append(self._master_port(str(master["addr"]), int(master["port"])))
        else:
            results.append(_result("master_port", SKIPPED, skip.get("master_port", "only node 0 hosts the "
                                                                         "rendezvous"), time.monotonic()))
        results.append(self._network((msg.get("node") or {}).get("master")))
        if "build_locks" in skip:
            results.append(_result("build_locks", SKIPPED, skip["build_locks"], time.monotonic()))
        else:
            results.append(self._build_locks())
        libaio = self._start_libaio(msg, skip, workdir if workdir_ok else "/")
        results += self._finish_probe(probe, probe_started, msg, skip, mode, workdir_ok,
                                      float(msg.get("timeout_s") or 60.0))
        results += self._features(msg, skip, results, libaio)
        results.append(self._ops(msg, skip, results, workdir if workdir_ok else "/"))
        order = ("python", "deepspeed", "workdir", "entrypoint", "checkpoint_dir", "master_port", "network",
                 "build_locks", "zero_pp", "nvme", "ops")
        return sorted(results, key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))

    # -- what the DeepSpeed config's features need (agents.preflight_features) ------------------

    def _start_libaio(self, msg: dict[str, Any], skip: Mapping[str, str], cwd: str) -> Any:
        """Start DeepSpeed's libaio test for an NVMe-offload job beside the Python probe (None if not asked)."""
        if "nvme" in skip or not (msg.get("nvme") or {}).get("paths") or "deepspeed" in skip:
            return None
        with self._lock:
            if self._aborted:
                return None
            probe = features.start_libaio_probe(str(msg.get("python")), self.env, cwd)
            if not isinstance(probe, OSError):
                self._builds.append(probe)  # abort() kills it
        return probe

    def _features(self, msg: dict[str, Any], skip: Mapping[str, str], results: list[dict[str, Any]],
                  libaio: Any) -> list[dict[str, Any]]:
        """The ``zero_pp`` and ``nvme`` checks (:mod:`agents.preflight_features`), or their skipped results."""
        now = time.monotonic()
        zero_pp = [str(k) for k in msg.get("zero_pp") or []]
        out = [_result("zero_pp", SKIPPED, skip.get("zero_pp", "no ZeRO++ quantisation"), now) if "zero_pp" in skip
               or not zero_pp else features.zero_pp(self.env, zero_pp)]
        nvme = msg.get("nvme") or {}
        if "nvme" in skip or not nvme.get("paths"):
            return out + [_result("nvme", SKIPPED, skip.get("nvme", "no NVMe offload"), now)]
        self.current = "nvme"
        if libaio is not None and any(r["name"] in ("python", "deepspeed") and r["status"] != PASSED for r in results):
            if not isinstance(libaio, OSError):
                opbuild.kill_group(libaio)
                libaio.communicate()
            libaio = None
        return out + [features.nvme(nvme["paths"], float(nvme.get("min_free_gb") or 0.0), libaio, self.env,
                                    float(msg.get("timeout_s") or 60.0), str(msg.get("workdir") or "/"))]

    # -- file system checks --------------------------------------------------------------------

    def _workdir(self, workdir: str) -> dict[str, Any]:
        t = time.monotonic()
        self.current = "workdir"
        if os.path.isdir(workdir):
            if not os.access(workdir, os.X_OK):
                return _result("workdir", FAILED, f"workdir {workdir} cannot be entered: Permission denied", t)
            return _result("workdir", PASSED, f"workdir {workdir} exists", t)
        what = "is not a directory" if os.path.exists(workdir) else "does not exist"
        return _result("workdir", FAILED, f"workdir {workdir} {what}", t)

    def _entrypoint_file(self, entrypoint: str, mode: str, workdir: str, workdir_ok: bool) -> dict[str, Any]:
        t = time.monotonic()
        self.current = "entrypoint"
        if mode == "no_python" and "/" not in entrypoint:  # a bare name: PATH, as the rank's exec finds it
            found = shutil.which(entrypoint, path=self.env.get("PATH", os.defpath))
            if found:
                return _result("entrypoint", PASSED, f"executable {entrypoint} is {found}", t)
            return _result("entrypoint", FAILED, f"executable {entrypoint!r} is not on the ranks' PATH "
                           f"({self.env.get('PATH', os.defpath)})", t)
        if not workdir_ok and not os.path.isabs(entrypoint):
            return _result("entrypoint", SKIPPED, "cannot look for it: the workdir is missing", t)
        path = os.path.join(workdir, entrypoint)
        noun = "executable" if mode == "no_python" else "script"
        if not os.path.exists(path):
            return _result("entrypoint", FAILED, f"{noun} {path} does not exist", t)
        if not os.path.isfile(path):
            return _result("entrypoint", FAILED, f"{noun} {path} is not a file", t)
        if mode == "no_python" and not os.access(path, os.X_OK):
            return _result("entrypoint", FAILED, f"{noun} {path} is not executable", t)
        if not os.access(path, os.R_OK):
            return _result("entrypoint", FAILED, f"{noun} {path} cannot be read: Permission denied", t)
        return _result("entrypoint", PASSED, f"{noun} {path} exists", t)

    def _checkpoint_dir(self, directory: str, shared: Mapping[str, Any] | None) -> dict[str, Any]:
        t = time.monotonic()
        self.current = "checkpoint_dir"
        why = features.unwritable(directory, "checkpoint dir", f"{TOKEN_PREFIX}probe-{self.node_rank}-{os.getpid()}")
        if why:
            return _result("checkpoint_dir", FAILED, why, t)
        if shared:
            try:
                self._write_token(str(shared["dir"]), str(shared["nonce"]))
            except OSError as err:
                return _result("checkpoint_dir", FAILED, f"checkpoint dir {directory} is not writable: cannot "
                               f"write the preflight file in {shared['dir']}: {_why(err)}", t)
        return _result("checkpoint_dir", PASSED, f"checkpoint dir {directory} is writable", t)

    def _write_token(self, directory: str, nonce: str) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"node-{self.node_rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"node_rank": self.node_rank, "host": self.host, "nonce": nonce}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._token = path

    def _list(self, shared: Mapping[str, Any], expect: list[int]) -> tuple[list[int], list[str]]:
        self.current = "shared_checkpoint_dir"
        directory, nonce = str(shared.get("dir")), str(shared.get("nonce"))
        seen, problems = [], []
        for node_rank in expect:
            path = os.path.join(directory, f"node-{node_rank}.json")
            try:
                with open(path) as f:
                    token = json.load(f)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as err:
                problems.append(f"cannot read {path}: {getattr(err, 'strerror', None) or err}")
                continue
            if isinstance(token, dict) and token.get("nonce") == nonce and token.get("node_rank") == node_rank:
                seen.append(node_rank)
        return seen, problems

    def _build_locks(self) -> dict[str, Any]:
        """No stale torch extension build lock where the ranks build DeepSpeed's ops (:mod:`agents.buildlocks`)."""
        t = time.monotonic()
        self.current = "build_locks"
        stale = buildlocks.stale_locks(self.env)
        where = buildlocks.extensions_dir(self.env)
        if not stale:
            return _result("build_locks", PASSED, f"no stale build lock in {where}", t)
        named = ", ".join(f"{path} ({age / 60:.0f} min old)" for path, age in stale[:3])
        return _result("build_locks", FAILED, f"stale torch extension build lock(s): {named}, with no build running "
                       "there: a killed build left them, and every rank that builds that op would wait on them "
                       "forever; delete them", t)

    def _ops(self, msg: dict[str, Any], skip: Mapping[str, str], results: list[dict[str, Any]],
             cwd: str) -> dict[str, Any]:
        """Build (or find built) the DeepSpeed ops the job's config needs, with the first rank's environment
        (:func:`agents.opbuild.build`), once the checks it depends on passed. The result carries ``ops`` (each
        op's outcome) and ``dir`` (the ranks' ``TORCH_EXTENSIONS_DIR``)."""
        t = time.monotonic()
        ops = [op for op in msg.get("ops") or [] if isinstance(op, dict) and op.get("builder") and op.get("name")]
        nvme = next((r for r in results if r["name"] == "nvme"), {})
        why = "libaio is missing" if nvme.get("libaio") is False else "NVMe offload cannot run"
        left_out = [op["name"] for op in ops if nvme.get("status") == FAILED and op["builder"] == "AsyncIOBuilder"]
        ops = [op for op in ops if op["name"] not in left_out]  # minutes of build for ranks that will not start
        if "ops" in skip or not ops:
            return _result("ops", SKIPPED, skip.get("ops", "no DeepSpeed op to build"), t)
        blocked = [r["name"] for r in results if r["name"] in ("python", "deepspeed", "build_locks")
                   and r["status"] != PASSED]
        if blocked:
            return _result("ops", SKIPPED, f"cannot build: the {blocked[0]} check did not pass", t)
        self.current = "ops"
        with self._lock:
            if self._aborted:
                return _result("ops", SKIPPED, "the preflight was called off", t)
        outcome = opbuild.build(str(msg.get("python")), self.env, ops, cwd, float(msg.get("ops_timeout_s") or 900.0),
                                self._builds)
        where = self.env.get("TORCH_EXTENSIONS_DIR") or buildlocks.extensions_dir(self.env)
        words = {opbuild.BUILT: "built in {s:.1f} s", opbuild.CACHED: "loaded from cache",
                 opbuild.NOT_NEEDED: "not needed ({d})", opbuild.FAILED: "failed to build: {d}"}
        detail = "; ".join(f"{o['name']} " + words.get(o["status"], o["status"]).format(
            s=float(o.get("seconds") or 0.0), d=o.get("detail", "")) for o in outcome) + f" (in {where})" + \
            "".join(f"; {name} not built: {why} (the nvme check)" for name in left_out)
        status = FAILED if any(o["status"] == opbuild.FAILED for o in outcome) else PASSED
        return {**_result("ops", status, detail, t), "ops": outcome, "dir": where}

    # -- the master port -----------------------------------------------------------------------

    def _master_port(self, addr: str, port: int) -> dict[str, Any]:
        """Bind the port on every address, as rank 0's c10d store will (SO_REUSEADDR, like c10d:
        a socket left in TIME_WAIT is no obstacle, a listener anywhere on the port is). orch's
        own reservation of the port (``orchestrator.supervision.ports``) is a lock file, not a socket."""
        t = time.monotonic()
        self.current = "master_port"
        family, wildcard = (socket.AF_INET6, "::") if ":" in addr else (socket.AF_INET, "0.0.0.0")
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((wildcard, port))
        except OSError as err:
            return _result("master_port", FAILED, f"master port {port} (master {addr}) is in use by another "
                           f"process: {_why(err)}", t)
        return _result("master_port", PASSED, f"master port {port} is free", t)

    # -- the network ---------------------------------------------------------------------------

    def _network(self, master: Mapping[str, Any] | None) -> dict[str, Any]:
        """The interface of the ranks' collectives (:func:`agents.network.choose`, with the first rank's
        environment): failed when the ranks' collectives could not work."""
        t = time.monotonic()
        self.current = "network"
        choice = network.choose(self.env, master)
        return _result("network", FAILED if choice.problem else PASSED, choice.detail, t)

    # -- the spec's Python ---------------------------------------------------------------------

    def _start_probe(self, python: str, deepspeed: str, module: str, cwd: str) -> Any:
        """Start the spec's Python on the probe; returns the process or the OSError that stopped it."""
        self.current = "python"
        try:
            with self._lock:
                if self._aborted:
                    return OSError("the preflight was called off")
                self._probe = subprocess.Popen([python, "-c", _PROBE, deepspeed, module], cwd=cwd, env=self.env,
                                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, start_new_session=True,
                                               preexec_fn=_die_with_parent)
                return self._probe
        except OSError as err:
            return err

    def _finish_probe(self, probe: Any, started: float, msg: dict[str, Any], skip: dict[str, str], mode: str,
                      workdir_ok: bool, timeout: float) -> list[dict[str, Any]]:
        python = str(msg.get("python"))
        now = time.monotonic()
        if probe is None:
            out = [_result("python", SKIPPED, skip["python"], now),
                   _result("deepspeed", SKIPPED, skip.get("deepspeed", skip["python"]), now)]
            return out + ([_result("entrypoint", SKIPPED, skip["python"], now)] if mode == "module" else [])
        self.current = "python"
        found, failure = self._probe_output(probe, python, timeout)
        python_result = _result("python", FAILED, failure, started) if failure else _result(
            "python", PASSED, f"{python} runs (Python {found.get('version')})", started)
        results = [python_result]
        because = "cannot check: the python check failed"
        if "deepspeed" in skip:
            results.append(_result("deepspeed", SKIPPED, skip["deepspeed"], now))
        elif failure:
            results.append(_result("deepspeed", SKIPPED, because, now))
        else:
            results.append(self._deepspeed(found, python, str(msg.get("deepspeed") or "find"), started))
        if mode == "module":
            module = str(msg.get("entrypoint"))
            if not workdir_ok:
                results.append(_result("entrypoint", SKIPPED, "cannot look for it: the workdir is missing", now))
            elif failure:
                results.append(_result("entrypoint", SKIPPED, because, now))
            else:
                origin, why = (found.get("module") or [None, "no answer"])[:2]
                results.append(_result("entrypoint", PASSED, f"module {module} is {origin}", started) if origin
                               else _result("entrypoint", FAILED, f"module {module} is not found by {python} "
                                            f"from workdir {msg.get('workdir')}: {why}", started))
        return results

    def _probe_output(self, probe: Any, python: str, timeout: float) -> tuple[dict[str, Any], str | None]:
        """``(what the probe found, None)``, or ``({}, why the Python did not run)``."""
        if isinstance(probe, OSError):
            return {}, f"python {python} cannot be run: {_why(probe)}"
        try:
            out, err = probe.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.abort()
            probe.communicate()
            return {}, f"python {python} did not answer within {timeout:.0f} s"
        finally:
            with self._lock:
                self._probe = None
        text = out.decode("utf-8", "replace")
        for line in reversed(text.splitlines()):
            if line.startswith(_MARK):
                try:
                    return json.loads(line[len(_MARK):]), None
                except ValueError:
                    break
        tail = " ".join(err.decode("utf-8", "replace").strip().splitlines()[-3:])[-400:]
        how = f"exited with status {probe.returncode}" if probe.returncode >= 0 else \
            f"was killed by {signal.Signals(-probe.returncode).name}"
        return {}, f"python {python} {how}{': ' + tail if tail else ''}"

    @staticmethod
    def _deepspeed(found: dict[str, Any], python: str, mode: str, started: float) -> dict[str, Any]:
        origin, why, version = (found.get("deepspeed") or [None, "no answer", None])[:3]
        if not origin:
            verb = "cannot import" if mode == "import" else "does not find"
            return _result("deepspeed", FAILED, f"{python} {verb} deepspeed: {why}", started)
        if mode == "find":
            torch = found.get("torch") or [None, "no answer", None]
            if not torch[0]:
                return _result("deepspeed", FAILED, f"{python} finds deepspeed but not torch, which deepspeed "
                               f"needs: {torch[1]}", started)
            return _result("deepspeed", PASSED, f"deepspeed {version or '(version unknown)'} and torch "
                           f"{torch[2] or '(version unknown)'} are installed for {python}", started)
        return _result("deepspeed", PASSED, f"{python} imports deepspeed {version or '(version unknown)'}", started)

    # -- ending --------------------------------------------------------------------------------

    def abort(self) -> None:
        """Kill the probe if one runs (the preflight was called off); later phases do nothing."""
        with self._lock:
            self._aborted = True
            procs = [self._probe, *self._builds]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                opbuild.kill_group(proc)

    def cleanup(self) -> None:
        """Remove this node's token, and the token directory if no other node's is left."""
        if self._token is None:
            return
        path, self._token = self._token, None
        try:
            os.unlink(path)
        except OSError:
            pass
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # another node's token is still there: that node removes the directory


def run_in_thread(pf: NodePreflight, msg: dict[str, Any], send: Callable[[dict[str, Any]], Any]) -> threading.Thread:
    """Run ``pf.run(msg)`` on a thread of its own and ``send`` its answer; returns the thread."""
    def work() -> None:
        send(pf.run(msg))
    thread = threading.Thread(target=work, name=f"preflight-{msg.get('phase')}", daemon=True)
    thread.start()
    return thread
