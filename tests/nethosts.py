"""Real test hosts on one machine: network namespaces on a bridge, each running its own sshd.

    with TestNetwork(3) as net:
        net.names            # ['on1234-0-worker-0', ...], resolvable through /etc/hosts
        net.addresses        # ['10.x.y.11', '10.x.y.12', '10.x.y.13']
        net.connect(0)       # paramiko client, host key checked against net.known_hosts
        net.run(1, ["ip", "-4", "addr", "show", "eth0"])
        net.kill_host(2)     # SIGKILL its sshd and every process in its namespace
        net.cut_link(1)      # eth0 down inside the namespace: silence, no reset

    TestNetwork(3, private_mounts={2: ["/tmp/x"]})   # host 2 sees its own empty /tmp/x
    TestNetwork(3, own_hostnames=True)                # `hostname` on host i is its name

Layout of one network (k-th network of process ``pid``; 36-base ``pid36`` keeps link names
within the kernel's 15 characters):

* bridge ``onb-<pid36>-<k36>`` in the root namespace with ``10.a.b.1/24`` (the controller
  side, name ``<prefix>controller``);
* per host i: namespace ``orchnet-<pid>-<k>-<i>``, veth ``onv-<pid36>-<k36>-<i>`` on the
  bridge whose peer inside the namespace is ``eth0`` with ``10.a.b.(11+i)/24``, ``lo`` up;
  name ``<prefix>worker-<i>`` (default prefix ``on<pid>-<k>-``) in /etc/hosts;
* ``sshd -D`` per namespace (started through ``ip netns exec``), keys and configs in a
  0700 temp dir ``orchnet-<pid>-<k>-*``;
* with ``own_hostnames=True``, every sshd runs in a UTS namespace of its own whose hostname is
  the host's name (by default all hosts share this machine's hostname, as namespaces do);
  :meth:`TestNetwork.enter_argv` enters both namespaces of a host;
* with ``private_mounts={i: [dir, ...]}``, host i's sshd runs in a mount namespace of its
  own with an empty tmpfs over each of those (existing) directories: host i and every
  session into it see its own copy of them, no other host sees it, and it vanishes with
  the sshd (a node whose "shared" storage is not shared).

Every /etc/hosts line carries ``# orchnet pid=<pid> net=<k>``. A session holds an exclusive
``flock`` on ``/run/orchnet/<pid>.lock`` for its lifetime, so leftovers of a crashed session
(whose lock is free, or gone) are told apart from those of a running one even when pids are
reused; ``cleanup_stale()`` removes the former and never touches the latter.

Namespaces share the file system and the process table with the root namespace: the same
virtualenv works in every host. Inside a namespace the machine's hostname resolves to
loopback, so code that picks an interface (gloo) should be told ``GLOO_SOCKET_IFNAME=eth0``.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

FAMILY = "orchnet"
SSHD = "/usr/sbin/sshd"
IFACE = "eth0"
HOSTS_FILE = Path("/etc/hosts")
LOCK_DIR = Path("/run") / FAMILY
NETNS_DIR = Path("/run/netns")
FIRST_HOST_OCTET = 11
MAX_HOSTS = 200

_NS_RE = re.compile(rf"^{FAMILY}-(\d+)-(\d+)-(\d+)$")
_LINK_RE = re.compile(r"^on[bv]-([0-9a-z]+)-([0-9a-z]+)(?:-(\d+))?$")
_MARK_RE = re.compile(rf"#\s*{FAMILY} pid=(\d+) net=(\d+)\s*$")
_TMP_RE = re.compile(rf"^{FAMILY}-(\d+)-(\d+)-")

_registry_lock = threading.RLock()
_active: dict[int, TestNetwork] = {}        # k -> open network of this process
_session_fd: int | None = None                 # our flock'ed /run/orchnet/<pid>.lock
_session_pid: int | None = None


class NetHostsError(RuntimeError):
    """The machine cannot provide namespace hosts, or setting them up failed."""


# --------------------------------------------------------------------------- small helpers

def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _sh(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise NetHostsError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _sh(["ip", *args], check=check)


def check_prerequisites() -> None:
    """Raise NetHostsError naming what is missing: root, sshd, ssh-keygen, ip, netns support."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not running as root (namespaces, bridges and /etc/hosts need root)")
    if not os.access(SSHD, os.X_OK):
        problems.append(f"{SSHD} not found: install Debian's openssh-server")
    if shutil.which("ssh-keygen") is None:
        problems.append("ssh-keygen not found: install Debian's openssh-client")
    if shutil.which("ip") is None:
        problems.append("ip not found: install Debian's iproute2")
    if not problems:
        try:
            with open("/etc/shadow") as f:
                for line in f:
                    if line.startswith("root:"):
                        pw = line.split(":")[1]
                        if pw.startswith(("!", "*LK*")):
                            problems.append("root's account is locked in /etc/shadow ('!'): sshd with "
                                            "UsePAM no refuses even key logins (set it to '*')")
        except OSError:
            pass
    if problems:
        raise NetHostsError("namespace test hosts unavailable: " + "; ".join(problems))


# --------------------------------------------------------------------------- locking / liveness

@contextmanager
def _global_lock() -> Iterator[None]:
    """Machine-wide lock (all sessions) around subnet choice, /etc/hosts edits and cleanup."""
    with _registry_lock:       # re-entrant within the process; flock itself is not
        depth = getattr(_global_lock, "depth", 0)
        if depth:
            _global_lock.depth = depth + 1  # type: ignore[attr-defined]
            try:
                yield
            finally:
                _global_lock.depth -= 1  # type: ignore[attr-defined]
            return
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK_DIR / "global.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _global_lock.depth = 1  # type: ignore[attr-defined]
            try:
                yield
            finally:
                _global_lock.depth = 0  # type: ignore[attr-defined]
        finally:
            os.close(fd)       # releases the flock


def _hold_session_lock() -> None:
    """Take (once per process) the exclusive lock that marks this pid's resources as live."""
    global _session_fd, _session_pid
    if _session_fd is not None and _session_pid == os.getpid():
        return
    path = LOCK_DIR / f"{os.getpid()}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # nobody else may hold our pid's lock
    _session_fd, _session_pid = fd, os.getpid()


def _release_session_lock() -> None:
    global _session_fd
    if _session_fd is not None and _session_pid == os.getpid():
        try:
            os.unlink(LOCK_DIR / f"{os.getpid()}.lock")
        except OSError:
            pass
        os.close(_session_fd)
        _session_fd = None


def _owner_alive(pid: int, k: int | None) -> bool:
    """Is (pid, k) a network of a live session? Callers hold the global lock."""
    if pid == os.getpid():
        return k is not None and k in _active
    path = LOCK_DIR / f"{pid}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# --------------------------------------------------------------------------- processes in namespaces

def _ns_inode(ns: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / ns).st_ino
    except OSError:
        return None


def _pids_by_netns(inodes: set[int]) -> dict[int, list[int]]:
    """Live (non-zombie) processes whose network namespace is one of ``inodes``."""
    found: dict[int, list[int]] = {}
    if not inodes:
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ino = os.stat(f"/proc/{entry.name}/ns/net").st_ino
        except OSError:
            continue           # gone, or a zombie (its ns link cannot be followed)
        if ino in inodes:
            found.setdefault(ino, []).append(int(entry.name))
    return found


def _pids_with_cmdline(fragments: Sequence[str]) -> list[int]:
    """sshd processes whose command line contains one of ``fragments`` (``sshd -f <tmpdir>/..``):
    they are found this way even when their namespace's name is already gone."""
    out = []
    if not fragments:
        return out
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "sshd" in cmd and any(frag in cmd for frag in fragments):
            out.append(int(entry.name))
    return out


def _kill_until_gone(find: Any, timeout: float = 10.0, popens: Sequence[subprocess.Popen] = ()) -> list[int]:
    """SIGKILL what ``find()`` returns until it returns nothing; reap ``popens``. Returns survivors."""
    deadline = time.monotonic() + timeout
    pids: list[int] = []
    while True:
        for p in popens:
            p.poll()
        pids = find()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for p in popens:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return pids


def _kill_namespaces(names: Sequence[str], timeout: float = 10.0,
                     popens: Sequence[subprocess.Popen] = ()) -> list[int]:
    inodes = {ino for ino in (_ns_inode(n) for n in names) if ino is not None}

    def find() -> list[int]:
        return [pid for pids in _pids_by_netns(inodes).values() for pid in pids]
    return _kill_until_gone(find, timeout, popens)


# --------------------------------------------------------------------------- /etc/hosts

def _rewrite_hosts(drop: Any = None, add: Sequence[str] = ()) -> list[str]:
    """Drop lines where ``drop(line)`` is true, append ``add``; written in place (the file may be
    a bind mount). Returns the dropped lines. Callers hold the global lock."""
    text = HOSTS_FILE.read_text()
    lines = text.splitlines()
    kept, dropped = [], []
    for line in lines:
        (dropped if drop is not None and drop(line) else kept).append(line)
    if not dropped and not add:
        return []
    kept.extend(add)
    new = "\n".join(kept) + "\n"
    with open(HOSTS_FILE, "r+") as f:
        f.seek(0)
        f.write(new)
        f.truncate()
    return dropped


def _hosts_marker(pid: int, k: int) -> str:
    return f"# {FAMILY} pid={pid} net={k}"


# --------------------------------------------------------------------------- stale clean-up

def cleanup_stale() -> list[str]:
    """Remove namespaces, links, /etc/hosts lines, temp dirs and processes of this family left
    by sessions that are no longer running. Returns what it removed (one line each)."""
    if os.geteuid() != 0:
        return []
    removed: list[str] = []
    with _global_lock():
        # namespaces (and their processes)
        r = _ip("netns", "list", check=False)
        stale_ns = []
        for line in r.stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            m = _NS_RE.match(name)
            if m and not _owner_alive(int(m.group(1)), int(m.group(2))):
                stale_ns.append(name)
        stale_tmp = []
        tmp = Path(tempfile.gettempdir())
        for d in tmp.glob(f"{FAMILY}-*"):
            m = _TMP_RE.match(d.name)
            if m and not _owner_alive(int(m.group(1)), int(m.group(2))):
                stale_tmp.append(d)
        # processes: in stale namespaces, or started from stale temp dirs (e.g. an sshd whose
        # namespace name was already deleted)
        _kill_namespaces(stale_ns, timeout=5)
        frags = [str(d) + "/" for d in stale_tmp]
        survivors = _kill_until_gone(lambda: _pids_with_cmdline(frags), timeout=5)
        if survivors:
            removed.append(f"could not kill {survivors}")
        # links (deleting a veth deletes its peer)
        r = _ip("-o", "link", "show", check=False)
        for line in r.stdout.splitlines():
            parts = line.split(":", 2)
            if len(parts) < 2:
                continue
            name = parts[1].strip().split("@")[0]
            m = _LINK_RE.match(name)
            if (m and not _owner_alive(int(m.group(1), 36), int(m.group(2), 36))
                    and _ip("link", "del", name, check=False).returncode == 0):
                removed.append(f"link {name}")
        for name in stale_ns:
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(f"netns {name}")
        # /etc/hosts
        def stale_line(line: str) -> bool:
            m = _MARK_RE.search(line)
            return bool(m) and not _owner_alive(int(m.group(1)), int(m.group(2)))
        try:
            removed += [f"hosts line {line!r}" for line in _rewrite_hosts(stale_line)]
        except OSError as err:
            removed.append(f"could not edit {HOSTS_FILE}: {err}")
        for d in stale_tmp:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"dir {d}")
        # lock files of dead sessions
        for lock in LOCK_DIR.glob("*.lock"):
            if lock.stem.isdigit() and int(lock.stem) != os.getpid() and not _owner_alive(int(lock.stem), None):
                try:
                    lock.unlink()
                except OSError:
                    pass
    return removed


# --------------------------------------------------------------------------- the network

@dataclass
class Host:
    index: int
    name: str
    addr: str
    ns: str                      # network namespace name (ip netns ...)
    veth: str                    # root-namespace end of the veth pair, on the bridge
    host_key: Path               # private host key file
    host_pubkey: str             # "ssh-ed25519 AAAA..."
    sshd_config: Path
    pidfile: Path
    log: Path                    # sshd's log (-e)
    iface: str = IFACE           # the interface inside the namespace
    sshd: subprocess.Popen | None = field(default=None, repr=False)


class TestNetwork:
    """N namespace hosts with their own sshd; a context manager (``start()`` / ``close()``)."""

    __test__ = False             # not a pytest test class

    def __init__(self, n_hosts: int, prefix: str | None = None, *, port: int = 22,
                 startup_timeout: float = 15.0, sshd_options: Sequence[str] = (),
                 private_mounts: Mapping[int, Sequence[str]] | None = None, own_hostnames: bool = False) -> None:
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be 1..{MAX_HOSTS}, got {n_hosts}")
        self.n_hosts = n_hosts
        self._prefix = prefix
        self.port = port
        self.user = "root"
        self.startup_timeout = startup_timeout
        self.sshd_options = list(sshd_options)
        self.private_mounts = {int(i): [str(d) for d in dirs] for i, dirs in (private_mounts or {}).items()}
        self.own_hostnames = own_hostnames
        self.pid = os.getpid()
        self.k: int | None = None
        self.hosts: list[Host] = []
        self.bridge = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self.controller_addr = ""
        self.controller_name = ""
        self.key_dir: Path | None = None
        self.client_key: Path | None = None
        self.known_hosts: Path | None = None
        self.ssh_config: Path | None = None
        self.marker = ""
        self._created_ns: list[str] = []
        self._created_links: list[str] = []
        self._hosts_written = False
        self._closed = False
        self._started = False
        self.setup_seconds = 0.0
        self.teardown_seconds = 0.0

    # ---------------------------------------------------------------- properties
    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def addresses(self) -> list[str]:
        return [h.addr for h in self.hosts]

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts]

    def host(self, i: int | str) -> Host:
        if isinstance(i, str):
            for h in self.hosts:
                if i in (h.name, h.addr, h.ns):
                    return h
            raise KeyError(i)
        return self.hosts[i]

    def __repr__(self) -> str:
        return f"TestNetwork({self.n_hosts}, bridge={self.bridge!r}, subnet={self.subnet}, names={self.names})"

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> TestNetwork:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except Exception as err:
            if exc_type is None:
                raise
            warnings.warn(f"teardown of {self!r} failed: {err}", RuntimeWarning, stacklevel=2)

    def start(self) -> TestNetwork:
        if self._started:
            raise NetHostsError("a TestNetwork starts once")
        self._started = True
        check_prerequisites()
        t0 = time.monotonic()
        try:
            self._setup()
        except BaseException:
            try:
                self.close()
            except Exception as err:   # noqa: BLE001
                warnings.warn(f"clean-up after a failed setup failed: {err}", RuntimeWarning)
            raise
        self.setup_seconds = time.monotonic() - t0
        return self

    def _setup(self) -> None:
        with _global_lock():
            _hold_session_lock()
            cleanup_stale()            # also leftovers of an earlier process with our pid
            with _registry_lock:
                k = 0
                while k in _active:
                    k += 1
                self.k = k
                _active[k] = self
            pid36, k36 = _b36(self.pid), _b36(k)
            self.bridge = f"onb-{pid36}-{k36}"
            self.marker = _hosts_marker(self.pid, k)
            prefix = self._prefix if self._prefix is not None else f"on{self.pid}-{k}-"
            self.subnet = self._pick_subnet()
            base = self.subnet.network_address
            self.controller_addr = str(base + 1)
            self.controller_name = f"{prefix}controller"
            self.key_dir = Path(tempfile.mkdtemp(prefix=f"{FAMILY}-{self.pid}-{k}-"))
            os.chmod(self.key_dir, 0o700)
            for i in range(self.n_hosts):
                kd = self.key_dir
                self.hosts.append(Host(
                    index=i, name=f"{prefix}worker-{i}", addr=str(base + FIRST_HOST_OCTET + i),
                    ns=f"{FAMILY}-{self.pid}-{k}-{i}", veth=f"onv-{pid36}-{k36}-{i}",
                    host_key=kd / f"host{i}_ed25519", host_pubkey="",
                    sshd_config=kd / f"sshd{i}.conf", pidfile=kd / f"sshd{i}.pid", log=kd / f"sshd{i}.log"))
            self._check_names_free()
            # root-namespace side first (under the lock: the subnet is then taken)
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            self._created_links.append(self.bridge)
            _ip("addr", "add", f"{self.controller_addr}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            self._write_hosts()
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            self._created_ns.append(h.ns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", IFACE, "netns", h.ns)
            self._created_links.append(h.veth)
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/{self.subnet.prefixlen}", "dev", IFACE)
            _ip("-n", h.ns, "link", "set", IFACE, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("link", "set", h.veth, "master", self.bridge, "up")
        self._make_keys()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for h in self.hosts:
            self._write_sshd_config(h)
            self._spawn_sshd(h)
        deadline = time.monotonic() + self.startup_timeout
        for h in self.hosts:
            self._wait_sshd(h, deadline)

    def close(self) -> None:
        """Kill every process of every host, delete namespaces, veths, bridge, /etc/hosts lines
        and temp files. Idempotent (an interrupted close can be called again); does every step
        even when one fails, then raises."""
        if self._closed:
            return
        t0 = time.monotonic()
        errors: list[str] = []
        popens = [h.sshd for h in self.hosts if h.sshd is not None]
        survivors = _kill_namespaces(self._created_ns, timeout=10, popens=popens)
        if survivors:
            errors.append(f"processes survived SIGKILL: {survivors}")
        if self.key_dir is not None:
            frag = str(self.key_dir) + "/"
            left = _kill_until_gone(lambda: _pids_with_cmdline([frag]), timeout=5)
            if left:
                errors.append(f"processes survived SIGKILL: {left}")
        for link in reversed(self._created_links):      # veths first, then the bridge
            r = _ip("link", "del", link, check=False)
            if r.returncode != 0 and _link_exists(link):
                errors.append(f"ip link del {link}: {r.stderr.strip()}")
        for ns in self._created_ns:
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0 and (NETNS_DIR / ns).exists():
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        if self._hosts_written:
            try:
                with _global_lock():
                    _rewrite_hosts(lambda line: line.rstrip().endswith(self.marker))
            except OSError as err:
                errors.append(f"editing {HOSTS_FILE}: {err}")
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)
        with _registry_lock:
            if self.k is not None and _active.get(self.k) is self:
                del _active[self.k]
        self.teardown_seconds = time.monotonic() - t0
        self._closed = True
        if errors:
            raise NetHostsError(f"teardown of {self.bridge}: " + "; ".join(errors))

    # ---------------------------------------------------------------- setup pieces
    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = []
        for args in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
            for tok in _ip(*args, check=False).stdout.split():
                if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", tok):
                    try:
                        used.append(ipaddress.ip_network(tok, strict=False))
                    except ValueError:
                        pass
        span = 150 * 256              # 10.100.0.0 - 10.249.255.0
        start = (self.pid * 7 + (self.k or 0) * 131) % span
        for j in range(span):
            idx = (start + j) % span
            cand = ipaddress.ip_network(f"10.{100 + idx // 256}.{idx % 256}.0/24")
            if not any(cand.overlaps(u) for u in used if u.prefixlen > 0):
                return cand
        raise NetHostsError("no free 10.x.y.0/24 subnet")

    def _check_names_free(self) -> None:
        existing = set()
        for line in HOSTS_FILE.read_text().splitlines():
            existing.update(line.split("#")[0].split()[1:])
        clash = [n for n in [self.controller_name, *self.names] if n in existing]
        if clash:
            raise NetHostsError(f"host names already in {HOSTS_FILE}: {clash} (choose another prefix)")

    def _write_hosts(self) -> None:
        lines = [f"{self.controller_addr}\t{self.controller_name}\t{self.marker}"]
        lines += [f"{h.addr}\t{h.name}\t{self.marker}" for h in self.hosts]
        self._hosts_written = True
        _rewrite_hosts(add=lines)

    def _make_keys(self) -> None:
        assert self.key_dir is not None
        jobs = []
        self.client_key = self.key_dir / "client_ed25519"
        for path in [self.client_key, *(h.host_key for h in self.hosts)]:
            jobs.append(subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", FAMILY,
                                          "-f", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for p in jobs:
            out = p.communicate(timeout=30)[0]
            if p.returncode != 0:
                raise NetHostsError(f"ssh-keygen failed: {out!r}")
        os.chmod(self.client_key, 0o600)
        auth = self.key_dir / "authorized_keys"
        auth.write_text(Path(f"{self.client_key}.pub").read_text())
        os.chmod(auth, 0o600)
        lines = []
        for h in self.hosts:
            kt, kb = Path(f"{h.host_key}.pub").read_text().split()[:2]
            h.host_pubkey = f"{kt} {kb}"
            if self.port == 22:
                names = f"{h.name},{h.addr}"
            else:
                names = f"[{h.name}]:{self.port},[{h.addr}]:{self.port}"
            lines.append(f"{names} {h.host_pubkey}")
        self.known_hosts = self.key_dir / "known_hosts"
        self.known_hosts.write_text("\n".join(lines) + "\n")
        self.ssh_config = self.write_ssh_config(self.key_dir / "ssh_config")

    def _write_sshd_config(self, h: Host) -> None:
        assert self.key_dir is not None
        sftp = "/usr/lib/openssh/sftp-server"
        lines = [
            f"ListenAddress {h.addr}:{self.port}",
            f"PidFile {h.pidfile}",
            f"HostKey {h.host_key}",
            f"AuthorizedKeysFile {self.key_dir / 'authorized_keys'}",
            "AuthorizedPrincipalsFile none",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "HostbasedAuthentication no",
            "UsePAM no",
            "PermitRootLogin prohibit-password",
            "StrictModes no",          # keys live under /tmp (world-writable): see design.md
            "PermitUserEnvironment no",
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            "MaxStartups 200",         # the default 10:30:100 drops concurrent connections
            "MaxSessions 200",
            "LogLevel INFO",
            *([f"Subsystem sftp {sftp}"] if os.path.exists(sftp) else []),
            *self.sshd_options,
        ]                              # no AcceptEnv: sessions accept no client variables
        h.sshd_config.write_text("\n".join(lines) + "\n")

    def _spawn_sshd(self, h: Host) -> None:
        argv = ["ip", "netns", "exec", h.ns]
        if self.own_hostnames:  # its own UTS namespace: `hostname` there is the host's name
            argv += ["unshare", "--uts", "sh", "-c", f'hostname {shlex.quote(h.name)} && exec "$@"', "sh"]
        mounts = self.private_mounts.get(h.index) or []
        if mounts:  # its own mount namespace (slave: the root's mounts still show), tmpfs over each dir
            script = " && ".join(f"mount -t tmpfs {FAMILY}-private {shlex.quote(d)}" for d in mounts)
            argv += ["unshare", "--mount", "--propagation", "slave", "sh", "-c", f'{script} && exec "$@"', "sh"]
        with open(h.log, "ab") as log:
            h.sshd = subprocess.Popen(
                [*argv, SSHD, "-D", "-e", "-f", str(h.sshd_config)],  # every exec keeps the pid: sshd's
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_sshd(self, h: Host, deadline: float) -> None:
        while True:
            if h.sshd is not None and h.sshd.poll() is not None:
                raise NetHostsError(f"sshd of {h.name} exited {h.sshd.returncode}: {self._log_tail(h)}")
            try:
                with socket.create_connection((h.addr, self.port), timeout=0.5) as s:
                    s.settimeout(max(0.5, deadline - time.monotonic()))
                    if s.recv(64).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise NetHostsError(f"sshd of {h.name} ({h.addr}:{self.port}) did not accept connections "
                                    f"within {self.startup_timeout} s: {self._log_tail(h)}")
            time.sleep(0.02)

    @staticmethod
    def _log_tail(h: Host) -> str:
        try:
            return h.log.read_text()[-2000:].strip() or "(empty log)"
        except OSError:
            return "(no log)"

    # ---------------------------------------------------------------- client side
    def client_params(self) -> dict[str, Any]:
        """What an ssh client needs: user, port, identity file, known_hosts, names, addresses."""
        return {
            "user": self.user, "port": self.port, "key_filename": str(self.client_key),
            "known_hosts": str(self.known_hosts), "ssh_config": str(self.ssh_config),
            "hostnames": self.names, "addresses": self.addresses,
            "controller_addr": self.controller_addr, "controller_name": self.controller_name,
            "iface": IFACE,
        }

    def write_ssh_config(self, path: str | os.PathLike | None = None) -> Path:
        """An OpenSSH client config for every host (by name and by address); ``ssh -F it name``."""
        assert self.key_dir is not None
        path = Path(path) if path is not None else self.key_dir / "ssh_config"
        text = (
            f"Host {' '.join([*self.names, *self.addresses])}\n"
            f"    User {self.user}\n"
            f"    Port {self.port}\n"
            f"    IdentityFile {self.client_key}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {self.known_hosts}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 5\n"
            "    LogLevel ERROR\n"
        )
        path.write_text(text)
        return path

    def enter_argv(self, i: int | str) -> list[str]:
        """``nsenter`` prefix that runs a command on host i as a local login there would: in its
        network namespace and, with ``own_hostnames``, its UTS namespace (its own hostname)."""
        h = self.host(i)
        argv = ["nsenter", f"--net={NETNS_DIR / h.ns}"]
        if self.own_hostnames and h.sshd is not None:
            argv.append(f"--uts=/proc/{h.sshd.pid}/ns/uts")
        return argv

    def ssh_argv(self, i: int | str, *command: str) -> list[str]:
        """``ssh`` command line that runs ``command`` on host i (OpenSSH client)."""
        return ["ssh", "-F", str(self.ssh_config), self.host(i).name, *command]

    def connect(self, i: int | str, timeout: float = 5.0, by: str = "name") -> Any:
        """A paramiko SSHClient logged in to host i; host key checked (RejectPolicy)."""
        import paramiko
        h = self.host(i)
        client = paramiko.SSHClient()
        client.load_host_keys(str(self.known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect(h.name if by == "name" else h.addr, port=self.port, username=self.user,
                       key_filename=str(self.client_key), look_for_keys=False, allow_agent=False,
                       timeout=timeout, banner_timeout=timeout, auth_timeout=timeout)
        return client

    # ---------------------------------------------------------------- inside a host
    def run(self, i: int | str, argv: Sequence[str], *, timeout: float = 60, check: bool = False,
            **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in host i's namespace (captured text output)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(["ip", "netns", "exec", self.host(i).ns, *argv], timeout=timeout,
                              check=check, **kw)

    def popen(self, i: int | str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` in host i's namespace (``ip netns exec`` execs it: same pid)."""
        return subprocess.Popen(["ip", "netns", "exec", self.host(i).ns, *argv], **kw)

    def pids(self, i: int | str) -> list[int]:
        """Live processes in host i's namespace (as ``ip netns pids``, without zombies)."""
        ino = _ns_inode(self.host(i).ns)
        if ino is None:
            return []
        return sorted(_pids_by_netns({ino}).get(ino, []))

    # ---------------------------------------------------------------- failure injection
    def kill_host(self, i: int | str, timeout: float = 10.0) -> None:
        """SIGKILL host i's sshd and every process in its namespace; returns when all are gone."""
        h = self.host(i)
        popens = [h.sshd] if h.sshd is not None else []
        left = _kill_namespaces([h.ns], timeout=timeout, popens=popens)
        if left:
            raise NetHostsError(f"processes of {h.name} survived SIGKILL: {left}")

    def start_sshd(self, i: int | str, timeout: float | None = None) -> None:
        """(Re)start host i's sshd, e.g. after kill_host; waits until it accepts connections."""
        h = self.host(i)
        if h.sshd is not None and h.sshd.poll() is None:
            return
        self._spawn_sshd(h)
        self._wait_sshd(h, time.monotonic() + (timeout or self.startup_timeout))

    def set_session_env(self, i: int | str, env: Mapping[str, str]) -> None:
        """Host i's sshd sets ``env`` in every session it opens (sshd's ``SetEnv``; empty: none), as a
        node's login environment would; its sshd is restarted to take it (open sessions are cut)."""
        h = self.host(i)
        lines = [ln for ln in h.sshd_config.read_text().splitlines() if not ln.startswith("SetEnv ")]
        if env:
            lines.append("SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()))
        h.sshd_config.write_text("\n".join(lines) + "\n")
        if h.sshd is not None and h.sshd.poll() is None:
            h.sshd.terminate()
            h.sshd.wait(10)
        self.start_sshd(i)

    def cut_link(self, i: int | str) -> None:
        """Take eth0 down inside host i: its packets are dropped, peers see silence (no reset)."""
        _ip("-n", self.host(i).ns, "link", "set", IFACE, "down")

    def restore_link(self, i: int | str, wait: bool = True, timeout: float = 10.0) -> None:
        """Bring eth0 back up inside host i; with ``wait``, until its live sshd answers again."""
        h = self.host(i)
        _ip("-n", h.ns, "link", "set", IFACE, "up")
        if wait and h.sshd is not None and h.sshd.poll() is None:
            self._wait_sshd(h, time.monotonic() + timeout)

    def link_up(self, i: int | str) -> bool:
        """Is eth0 inside host i administratively up (not cut)?"""
        r = _ip("-n", self.host(i).ns, "-o", "link", "show", IFACE, check=False)
        m = re.search(r"<([^>]*)>", r.stdout)
        return r.returncode == 0 and m is not None and "UP" in m.group(1).split(",")

    def reset(self) -> None:
        """Back to a healthy network: links up, every process but the sshds killed, dead sshds
        restarted. For fixtures shared between tests that inject failures."""
        for h in self.hosts:
            if not self.link_up(h.index):
                self.restore_link(h.index, wait=False)
        keep = {h.sshd.pid for h in self.hosts if h.sshd is not None and h.sshd.poll() is None}
        inodes = {ino for ino in (_ns_inode(ns) for ns in self.namespaces) if ino is not None}
        _kill_until_gone(lambda: [p for ps in _pids_by_netns(inodes).values() for p in ps if p not in keep])
        for h in self.hosts:
            self.start_sshd(h.index)

    # ---------------------------------------------------------------- verification
    def leftovers(self) -> list[str]:
        """After close(): anything of this network that still exists (empty list = clean)."""
        left = []
        ns_list = _ip("netns", "list", check=False).stdout.split()
        left += [f"netns {ns}" for ns in self.namespaces if ns in ns_list or (NETNS_DIR / ns).exists()]
        left += [f"link {link}" for link in [self.bridge, *(h.veth for h in self.hosts)] if link and _link_exists(link)]
        if self.marker:
            left += [f"hosts line {line!r}" for line in HOSTS_FILE.read_text().splitlines()
                     if line.rstrip().endswith(self.marker)]
        if self.key_dir is not None:
            if self.key_dir.exists():
                left.append(f"dir {self.key_dir}")
            left += [f"process {p}" for p in _pids_with_cmdline([str(self.key_dir) + "/"])]
        left += [f"sshd {h.sshd.pid}" for h in self.hosts if h.sshd is not None and h.sshd.poll() is None]
        if self.subnet is not None:
            out = _ip("-4", "-o", "addr", "show", check=False).stdout
            if f" {self.controller_addr}/" in out:
                left.append(f"address {self.controller_addr}")
        return left


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


@atexit.register
def _close_all_at_exit() -> None:
    """Close what a test left open (not in a forked child: the networks are its parent's)."""
    with _registry_lock:
        nets = [net for net in _active.values() if net.pid == os.getpid()]
    for net in nets:
        try:
            net.close()
        except Exception:              # noqa: BLE001
            pass
    _release_session_lock()
