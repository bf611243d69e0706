"""The ssh provisioner: each node's agent is started over SSH with paramiko.

For every node of the plan the controller opens one SSH connection (in parallel, at most
``ssh.max_parallel`` at once, each bounded by ``ssh.connect_timeout``), verifies the
node's host key, and runs on it::

    cd <workdir> || cd /; exec env ORCH_AGENT_ATTEMPT_ID=<id> ORCH_AGENT_NODE_RANK=<n> <python> -u -m agents.agent

The agent's stdin/stdout *are* the SSH channel: the controller link (``agents.link``,
JSON lines) runs over it, so nothing is exposed on the network beyond sshd. The node plan,
including every rank's environment, travels inside that stream as JSON: no value from the
spec ever reaches a shell, so values with spaces, quotes, ``$``, backticks, ``;`` or
newlines arrive byte for byte. Only the working directory, the interpreter and the attempt
id appear on the remote command line, each quoted with ``shlex.quote``. The agent's stderr
is copied to ``<run_dir>/agents/node-<n>.log`` on the controller.

Where the spec's ``ssh`` section leaves something unset, the user's ssh config
(``~/.ssh/config``: ``HostName``, ``User``, ``Port``, ``IdentityFile``,
``UserKnownHostsFile``) and then OpenSSH's defaults apply. Host keys are verified against
``known_hosts`` by default; ``host_key_policy: accept-new`` adds unknown keys (a changed
key is always an error), like OpenSSH's ``StrictHostKeyChecking=accept-new``.
"""

from __future__ import annotations

import collections
from collections.abc import Collection
import functools
import getpass
import importlib
import json
import logging
import os
import queue
import shlex
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agents.attach import attach_request
from agents.link import MessageReader, MessageWriter
from agents.linkhub import shared_hub

from ..errors import ProvisionError
from ..planning import JobPlan, NodePlan, ResourcePool
from ..spec import SSHOptions
from .base import AgentHandle, Provisioner

__all__ = ["SSHProvisioner", "SSHAgent", "SSHTarget"]


class _ImportedOnUse:
    """A module, imported when one of its names is first used (then as fast as an attribute lookup can be)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


if TYPE_CHECKING:
    import paramiko
else:  # paramiko's import (with cryptography, nacl and invoke) is ~0.1 s, which orch plan does without
    paramiko = _ImportedOnUse("paramiko")

# paramiko reports dropped connections through logging; without a handler Python would
# print them to stderr. orch reports them itself (as a node lost).
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

_KNOWN_HOSTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class SSHTarget:
    """How one hostfile host is reached.

    Attributes:
        host: the name in the hostfile.
        hostname: what is connected to (ssh config ``HostName``, else ``host``).
        port: sshd's port.
        user: the login user.
        identity_files: private keys to offer (empty: OpenSSH's default keys and the agent).
        known_hosts: the known_hosts file host keys are checked against.
        accept_new: add unknown host keys to ``known_hosts`` instead of refusing them.
        timeout: seconds for connecting and logging in.
    """

    host: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    known_hosts: str
    accept_new: bool
    timeout: float


def _host_key_policy(t: SSHTarget) -> paramiko.MissingHostKeyPolicy:
    """What to do with a host key known_hosts lacks: add it (``accept_new``) or refuse the host."""
    accept_new, reject = _host_key_policies()
    return accept_new(t.known_hosts) if t.accept_new else reject(t)


@functools.cache
def _host_key_policies() -> tuple[type, type]:
    """The two policies' classes, made on first use (they are paramiko's :class:`MissingHostKeyPolicy`)."""
    import paramiko

    class _AcceptNew(paramiko.MissingHostKeyPolicy):
        """Add an unknown host key to known_hosts (a changed key never gets here: paramiko
        raises BadHostKeyException first), appending one line under a lock."""

        def __init__(self, path: str) -> None:
            self.path = path

        def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
            client.get_host_keys().add(hostname, key.get_name(), key)
            with _KNOWN_HOSTS_LOCK:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    class _Reject(paramiko.MissingHostKeyPolicy):
        def __init__(self, target: SSHTarget) -> None:
            self.target = target

        def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
            t = self.target
            reason = (f"its host key is unknown: it is not in {t.known_hosts}. Add it after checking it (e.g. "
                      f"ssh-keyscan -p {t.port} HOST >> {t.known_hosts}), or set ssh.host_key_policy: accept-new "
                      "in the job spec.")
            raise ProvisionError(f"the host key of {t.host} ({hostname}) is unknown: it is not in "
                                 f"{t.known_hosts}. Add it after checking it (e.g. ssh-keyscan -p {t.port} "
                                 f"{t.hostname} >> {t.known_hosts}), or set ssh.host_key_policy: accept-new in the "
                                 "job spec.", reason=reason)

    return _AcceptNew, _Reject


class _ChannelStream:
    """A minimal binary stream over one direction of an SSH channel.

    ``agents.link`` needs ``write``/``flush``/``close`` (the agent's stdin) or ``readline``
    (its stdout or stderr). paramiko's own file objects try to flush again when garbage
    collected after the channel closed, which prints tracebacks at exit; these do not.
    """

    def __init__(self, channel: paramiko.Channel, stderr: bool = False) -> None:
        self.channel = channel
        self._recv = channel.recv_stderr if stderr else channel.recv
        self._buffer = b""

    def write(self, data: bytes) -> int:
        self.channel.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.channel.shutdown_write()  # the agent reads end-of-stream
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def hub_source(self) -> tuple[int, Any]:
        """For :class:`agents.linkhub.LinkHub`: the descriptor paramiko signals the channel's stdout data (and
        its end) on, and a read that never blocks (``BlockingIOError`` while no data has arrived yet)."""
        channel = self.channel

        def read(n: int) -> bytes:
            if not (channel.recv_ready() or channel.eof_received or channel.closed):
                raise BlockingIOError
            return channel.recv(n)

        return channel.fileno(), read

    def readline(self) -> bytes:
        while b"\n" not in self._buffer:
            try:
                chunk = self._recv(65536)
            except (OSError, EOFError, paramiko.SSHException):
                chunk = b""
            if not chunk:
                line, self._buffer = self._buffer, b""
                return line
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"


class SSHAgent(AgentHandle):
    """An agent running at the other end of an SSH channel."""

    def __init__(self, node: NodePlan, target: SSHTarget, client: paramiko.SSHClient, channel: paramiko.Channel,
                 events: "queue.Queue[tuple[int, dict]]", log_path: str, python: str, attempt_id: str) -> None:
        self.node_rank = node.node_rank
        self.host = node.host
        self.target = target
        self.client = client
        self.channel = channel
        self.python = python
        self.attempt_id = attempt_id
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
        self._writer = MessageWriter(_ChannelStream(channel))
        self._reader = MessageReader(_ChannelStream(channel), name=f"agent-{node.node_rank}", sink=events,
                                     tag=node.node_rank, hub=shared_hub())
        self._stderr = threading.Thread(target=self._copy_stderr, args=(log_path,), daemon=True,
                                        name=f"agent-{node.node_rank}-stderr")
        self._stderr.start()

    def _copy_stderr(self, log_path: str) -> None:
        stream = _ChannelStream(self.channel, stderr=True)
        with open(log_path, "ab") as log:
            for line in iter(stream.readline, b""):
                log.write(line)
                log.flush()
                self._stderr_tail.append(line.decode("utf-8", "replace").rstrip())

    def send(self, msg: dict[str, Any]) -> bool:
        return self._writer.send(msg)

    def close(self) -> None:
        self._writer.close()  # the agent reads end-of-stream and stops its ranks

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.channel.exit_status_ready() or self.channel.closed or not self._transport_alive():
                return True
            time.sleep(0.05)
        return self.channel.exit_status_ready() or self.channel.closed or not self._transport_alive()

    def _transport_alive(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    def kill(self) -> None:
        """Kill the agent (and its ranks, marked with the attempt id) with a second command."""
        if self._transport_alive():
            try:
                run_remote(self.client, [self.python, "-m", "agents.sweep", "--agents", "--node-rank",
                                         str(self.node_rank), self.attempt_id], timeout=15)
            except (OSError, ProvisionError, paramiko.SSHException):
                pass
        try:
            self.channel.close()
        except (OSError, paramiko.SSHException):
            pass

    def diagnostics(self) -> str:
        time.sleep(0.05)  # let the stderr copier catch the last lines
        text = "\n".join(self._stderr_tail)
        if self.channel.exit_status_ready():
            text += f"\n(the agent command exited with status {self.channel.recv_exit_status()})"
        return text.strip()


def run_remote(client: paramiko.SSHClient, argv: list[str], timeout: float = 30.0) -> str:
    """Run ``argv`` (quoted for the remote shell) on an open connection; return its stdout.

    Raises:
        ProvisionError: it exited non-zero (with its stderr) or timed out.
    """
    channel = client.get_transport().open_session(timeout=timeout)
    channel.settimeout(timeout)
    channel.exec_command(shlex.join(argv))
    out_stream, err_stream = _ChannelStream(channel), _ChannelStream(channel, stderr=True)
    out = b"".join(iter(out_stream.readline, b""))
    err = b"".join(iter(err_stream.readline, b""))
    status = channel.recv_exit_status()
    channel.close()
    if status != 0:
        raise ProvisionError(f"{shlex.join(argv)} exited with status {status}: "
                             f"{err.decode('utf-8', 'replace').strip()[-500:]}")
    return out.decode("utf-8", "replace")


class SSHProvisioner(Provisioner):
    """Starts each node's agent over SSH; see the module docstring.

    Args:
        options: the spec's ``ssh`` section.
        python: the interpreter the agents run under on the nodes (the spec's ``python``, else
            the controller's own, which must then exist at the same path on every node, as
            DeepSpeed's pdsh launcher also assumes).
    """

    name = "ssh"
    reattaches = True
    warm_capable = True  # an agent's handle holds its connection: another instance can adopt it

    def __init__(self, options: SSHOptions | None = None, python: str | None = None) -> None:
        self.options = options or SSHOptions()
        self.max_parallel = self.options.max_parallel
        self.python = python or sys.executable
        self._config = self._load_config()
        self._clients: dict[int, paramiko.SSHClient] = {}
        self._lock = threading.Lock()

    # -- configuration ------------------------------------------------------------------------

    def _load_config(self) -> paramiko.SSHConfig | None:
        """The ssh config read, or None where there is none (an empty one is made when a host is first looked
        up: ``orch plan --offline`` looks none up, and does without paramiko's import)."""
        path = self.options.config_file or os.path.expanduser("~/.ssh/config")
        if self.options.config_file and not os.path.isfile(path):
            raise ProvisionError(f"ssh.config_file {path} does not exist.")
        if os.path.isfile(path):
            try:
                return paramiko.SSHConfig.from_path(path)
            except (OSError, ValueError, paramiko.SSHException) as err:
                raise ProvisionError(f"Cannot read ssh config {path}: {err}.") from err
        return None

    def target(self, host: str) -> SSHTarget:
        """How ``host`` is reached: the spec's ``ssh`` options over the ssh config over defaults."""
        if self._config is None:
            self._config = paramiko.SSHConfig()
        conf = self._config.lookup(host)
        o = self.options
        identity = (o.identity_file,) if o.identity_file else tuple(
            os.path.expanduser(p) for p in conf.get("identityfile", []) if os.path.isfile(os.path.expanduser(p)))
        known = o.known_hosts or os.path.expanduser(
            (conf.get("userknownhostsfile") or "~/.ssh/known_hosts").split()[0])
        return SSHTarget(host=host, hostname=conf.get("hostname", host), port=int(o.port or conf.get("port", 22)),
                         user=o.user or conf.get("user") or getpass.getuser(), identity_files=identity,
                         known_hosts=known, accept_new=o.host_key_policy == "accept-new", timeout=o.connect_timeout)

    def check(self, pool: ResourcePool) -> None:
        """Refuse bad keys, missing known_hosts and names that do not resolve, before anything starts.

        Raises:
            ProvisionError: listing every problem (per host where it is per host).
        """
        problems: list[str] = []
        targets = [self.target(h) for h in pool.hosts]
        for path in sorted({f for t in targets for f in t.identity_files}):
            problems += _identity_problems(path)
        for path in sorted({t.known_hosts for t in targets if not t.accept_new}):
            if not os.path.isfile(path):
                problems.append(f"known_hosts file {path} does not exist, so no host key can be verified; create "
                                "it (ssh-keyscan) or set ssh.host_key_policy: accept-new")
        for t in targets:
            try:
                socket.getaddrinfo(t.hostname, t.port, type=socket.SOCK_STREAM)
            except socket.gaierror as err:
                what = t.hostname if t.hostname == t.host else f"{t.hostname} (HostName of {t.host})"
                problems.append(f"host {what} does not resolve: {err.strerror}")
        if problems:
            raise ProvisionError("Cannot reach the nodes over SSH as configured:\n  " + "\n  ".join(problems))

    def master_addr(self, host: str) -> str:
        """The IPv4 address of node 0 (ranks rendezvous there), as this machine resolves it."""
        t = self.target(host)
        try:
            infos = socket.getaddrinfo(t.hostname, t.port, socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror as err:
            raise ProvisionError(f"host {t.hostname} does not resolve: {err.strerror}") from err
        return str(infos[0][4][0])

    # -- agents -------------------------------------------------------------------------------

    def _connect(self, t: SSHTarget) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        if os.path.isfile(t.known_hosts):
            try:
                client.load_host_keys(t.known_hosts)
            except (OSError, paramiko.SSHException) as err:
                raise ProvisionError(f"cannot read known_hosts {t.known_hosts}: {err}") from err
        client.set_missing_host_key_policy(_host_key_policy(t))
        try:
            client.connect(t.hostname, port=t.port, username=t.user, key_filename=list(t.identity_files) or None,
                           look_for_keys=not t.identity_files, allow_agent=True, timeout=t.timeout,
                           banner_timeout=t.timeout, auth_timeout=t.timeout, channel_timeout=t.timeout)
        except ProvisionError:
            client.close()
            raise
        except (OSError, paramiko.SSHException, EOFError) as err:
            client.close()
            reason = _connect_failure(t, err)
            raise ProvisionError(f"{t.host} ({t.hostname}:{t.port}): {reason}", reason=reason) from err
        return client

    def start_agent(self, node: NodePlan, plan: JobPlan,
                    events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        """Connect to the node and start its agent; the link is the SSH channel.

        Raises:
            ProvisionError: the node cannot be reached, its host key is unknown or changed,
                the login is refused, or the command cannot be started.
        """
        log_dir = os.path.join(plan.run_dir, "agents")
        os.makedirs(log_dir, exist_ok=True)
        # a missing workdir is the preflight's to report (with the node's other problems): start in / then
        command = (f"cd {shlex.quote(node.workdir)} || cd /; exec env ORCH_AGENT_ATTEMPT_ID={shlex.quote(plan.attempt_id)} "
                   f"ORCH_AGENT_NODE_RANK={node.node_rank} {shlex.quote(self.python)} -u -m agents.agent")
        return self._agent(node, plan, events, command, "start the agent")

    def _agent(self, node: NodePlan, plan: JobPlan, events: "queue.Queue[tuple[int, dict]]", command: str,
               what: str) -> SSHAgent:
        """Connect to the node and run ``command`` (the agent, or the bridge to it) on a channel of its own.

        Raises:
            ProvisionError: the node cannot be reached, or the command cannot be started (``what`` says which).
        """
        t = self.target(node.host)
        client = self._connect(t)
        with self._lock:
            self._clients[node.node_rank] = client
        try:
            channel = client.get_transport().open_session(timeout=t.timeout)
            channel.exec_command(command)
        except (OSError, paramiko.SSHException) as err:
            raise ProvisionError(f"cannot {what} on {t.host}: {err}", reason=f"cannot {what}: {err}") from err
        return SSHAgent(node, t, client, channel, events, os.path.join(plan.run_dir, "agents",
                                                                        f"node-{node.node_rank}.log"),
                        self.python, plan.attempt_id)

    def attach_agent(self, node: NodePlan, plan: JobPlan,
                     events: "queue.Queue[tuple[int, dict]]") -> AgentHandle:
        """Link to the node's running agent: over a new SSH connection, ``python -m agents.attach`` pipes the
        channel to the agent's socket, and the ``attach`` request goes first.

        Raises:
            ProvisionError: the node cannot be reached, or the bridge cannot be started there (a bridge that
                finds no agent exits at once, which the attempt hears as its link closing).
        """
        command = (f"cd / && exec {shlex.quote(self.python)} -u -m agents.attach {shlex.quote(plan.attempt_id)} "
                   f"{node.node_rank}")
        agent = self._agent(node, plan, events, command, "re-attach to the agent")
        agent.send(attach_request(plan.attempt_id, node.node_rank))
        return agent

    def sweep(self, plan: JobPlan, spare: Collection[int] = ()) -> list[int]:
        """On every node still reachable, kill what the attempt left (but the pids in ``spare``: agents kept warm,
        on their nodes) and remove the scratch a killed agent left there (``python -m agents.sweep``)."""
        killed: list[int] = []
        for node in plan.nodes:
            client = self._clients.get(node.node_rank)
            transport = client.get_transport() if client else None
            if transport is None or not transport.is_active():
                continue
            try:
                scratch = [*(["--scratch", node.metrics_dir] if node.metrics_dir else []),
                           *(["--monitor", node.deepspeed_monitor_dir] if node.deepspeed_monitor_dir else [])]
                out = run_remote(client, [self.python, "-m", "agents.sweep", "--agents", "--node-rank",
                                          str(node.node_rank), *scratch,
                                          *[w for pid in spare for w in ("--spare", str(pid))], plan.attempt_id],
                                 timeout=15)
                killed += json.loads(out or "[]")
            except (OSError, ValueError, ProvisionError, paramiko.SSHException):
                continue
        return killed

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            _close_quietly(client)

    def detach(self, node_rank: int) -> None:
        """Let the node's connection go without closing it (its agent stays warm for another instance)."""
        with self._lock:
            self._clients.pop(node_rank, None)

    def adopt(self, node_rank: int, handle: AgentHandle) -> None:
        """Hold the connection of a warm agent another instance started (an :class:`SSHAgent`) as ``node_rank``'s."""
        client = getattr(handle, "client", None)
        if client is not None:
            with self._lock:
                self._clients[node_rank] = client

    def warm_key(self, host: str) -> tuple | None:
        """Where and as whom the agent logs in (address, port, user, keys, host key checks) and its interpreter."""
        t = self.target(host)
        return ("ssh", t.hostname, t.port, t.user, t.identity_files, t.known_hosts, t.accept_new, self.python)

    def forget(self, node_rank: int) -> None:
        with self._lock:
            client = self._clients.pop(node_rank, None)
        if client is not None:
            threading.Thread(target=_close_quietly, args=(client,), daemon=True).start()  # may block: not here


def _connect_failure(t: SSHTarget, err: BaseException) -> str:
    """Why connecting to or logging in on ``t`` failed, in words without the host's name (nodes that
    failed alike are reported together), each with what to do."""
    if isinstance(err, paramiko.BadHostKeyException):
        return (f"its host key has CHANGED: it does not match {t.known_hosts} (someone may be intercepting the "
                f"connection). If the change is expected, remove the old key (ssh-keygen -R HOST -f {t.known_hosts}) "
                "and add the new one.")
    if isinstance(err, paramiko.PasswordRequiredException):
        return "the key is protected by a passphrase; load it into ssh-agent (ssh-add) so orch can use it."
    if isinstance(err, paramiko.AuthenticationException):
        return f"refused the login as {t.user} ({str(err).rstrip('.')}); {_keys_offered(t)}"
    if isinstance(err, paramiko.SSHException) and "No authentication methods available" in str(err):
        return f"no key to log in as {t.user} with: {_keys_offered(t)}"
    if isinstance(err, socket.gaierror):
        return f"the name {t.hostname} does not resolve: {err.strerror}"
    if isinstance(err, (socket.timeout, TimeoutError)):
        return f"no answer from the host within {t.timeout:.0f} s (host down or unreachable?)"
    if isinstance(err, paramiko.ssh_exception.NoValidConnectionsError):  # paramiko wraps refused/unreachable
        errors = list(err.errors.values())
        if errors and all(isinstance(e, ConnectionRefusedError) for e in errors):
            return "refused the connection (is sshd running there?)"
        why = "; ".join(sorted({getattr(e, "strerror", None) or str(e) for e in errors})) or str(err)
        return f"cannot connect: {why}"
    if isinstance(err, ConnectionRefusedError):
        return "refused the connection (is sshd running there?)"
    return f"cannot connect: {getattr(err, 'strerror', None) or err}"


#: The keys paramiko offers when no identity file is given (``SSHClient._auth``, look_for_keys).
DEFAULT_KEYS = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")


def _keys_offered(t: SSHTarget) -> str:
    """Which keys were offered (files and ssh-agent keys) and where the host expects the public half."""
    if t.identity_files:
        files = list(t.identity_files)
        source = "the identity file(s)"
    else:
        files = [p for p in (os.path.expanduser(k) for k in DEFAULT_KEYS) if os.path.isfile(p)]
        source = "the default key(s)"
    agent = 0
    if os.environ.get("SSH_AUTH_SOCK"):
        try:
            keys = paramiko.Agent()
            agent = len(keys.get_keys())
            keys.close()
        except (OSError, paramiko.SSHException):
            agent = 0
    tried = []
    if files:
        tried.append(f"{source} {', '.join(files)}")
    if agent:
        tried.append(f"{agent} key(s) of the ssh agent")
    if not tried:
        looked = "ssh.identity_file is unset and none of " + ", ".join(DEFAULT_KEYS) + " exists"
        agent_words = "no ssh agent holds a key" if os.environ.get("SSH_AUTH_SOCK") else "no ssh agent runs " \
            "(SSH_AUTH_SOCK is unset)"
        return (f"{looked}, and {agent_words}. Give ssh.identity_file (or IdentityFile in ~/.ssh/config), or "
                f"create a key (ssh-keygen -t ed25519); its public half belongs in ~{t.user}/.ssh/authorized_keys "
                "on the host")
    return (f"tried {' and '.join(tried)}; the host accepts a key whose public half is in "
            f"~{t.user}/.ssh/authorized_keys there (or sshd's AuthorizedKeysFile)")


def _close_quietly(client: paramiko.SSHClient) -> None:
    try:
        client.close()
    except (OSError, EOFError, paramiko.SSHException):
        pass


def _identity_problems(path: str) -> list[str]:
    """OpenSSH's rules for a private key file: it exists, is a file, and only its owner may read it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return [f"identity file {path} does not exist"]
    except OSError as err:
        return [f"identity file {path} cannot be read: {err.strerror}"]
    if not stat.S_ISREG(st.st_mode):
        return [f"identity file {path} is not a file"]
    if st.st_mode & 0o077:
        return [f"permissions {stat.S_IMODE(st.st_mode):04o} of identity file {path} are too open: a private key "
                f"must be readable by its owner only (chmod 600 {path})"]
    try:
        paramiko.PKey.from_path(path)
    except paramiko.PasswordRequiredException:
        return []  # the ssh agent may hold it; the login says so if not
    except (OSError, ValueError, paramiko.SSHException) as err:
        return [f"identity file {path} is not a private key paramiko can read: {err}"]
    return []
