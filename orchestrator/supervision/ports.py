"""Master port reservation, so two jobs on one machine never rendezvous on the same port.

A job that asks for a port (``master_port: 29500``) gets it or a clear error; a job that
says ``auto`` (the default) gets the first port from 29500 (DeepSpeed's and torch's
default, ``TORCH_DISTRIBUTED_DEFAULT_PORT``) that no other orch job holds and that can be
bound on the master address now. A reservation is an exclusive ``flock`` on
``<lock dir>/<port>.lock`` held by the controller for the attempt's lifetime; the kernel
drops it if the controller dies, so a crash never leaks a port. The lock directory is
machine-wide (``$ORCH_PORT_LOCK_DIR``, default ``/tmp/orch-ports``), so controllers with
different state directories, and different users, see each other's reservations.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import PlanError

__all__ = ["DEFAULT_PORT", "PortLease", "reserve_port", "port_is_free", "default_lock_dir"]

#: DeepSpeed's and torch.distributed's default master port.
DEFAULT_PORT = 29500
_AUTO_RANGE = 2000


def default_lock_dir() -> Path:
    """``$ORCH_PORT_LOCK_DIR``, else ``/tmp/orch-ports`` (shared by every user of the machine)."""
    return Path(os.environ.get("ORCH_PORT_LOCK_DIR") or "/tmp/orch-ports")


def port_is_free(port: int, addr: str = "127.0.0.1") -> bool:
    """True if a listening socket could be bound to ``addr:port`` now (SO_REUSEADDR, like c10d)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


@dataclass
class PortLease:
    """A reserved master port; :meth:`release` (or process exit) frees it."""

    port: int
    path: Path | None = None
    fd: int | None = None

    def release(self) -> None:
        """Drop the reservation (idempotent)."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)  # flock needs no write access
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def reserve_port(lock_dir: str | Path, requested: int | str, addr: str = "127.0.0.1",
                 check_bind: bool = True, hold: bool = True) -> PortLease:
    """Reserve a master port.

    Args:
        lock_dir: the directory of port locks (:func:`default_lock_dir` in production).
        requested: a port number, or ``"auto"``.
        addr: the master address the port is checked on (only meaningful when the
            master runs on this machine; pass ``check_bind=False`` otherwise).
        check_bind: also require that the port can be bound now.
        hold: keep the lock (False: only look, as ``orch plan`` does).

    Returns:
        The lease.

    Raises:
        PlanError: the requested port is held by another orch job or in use; or, for
            ``auto``, no free port in 29500..31499.
    """
    lock_dir = Path(lock_dir)
    if not lock_dir.is_dir():
        lock_dir.mkdir(parents=True, exist_ok=True)
        try:
            lock_dir.chmod(0o1777)  # every user reserves ports here, like /tmp
        except OSError:
            pass
    candidates = [int(requested)] if requested != "auto" else range(DEFAULT_PORT, DEFAULT_PORT + _AUTO_RANGE)
    for port in candidates:
        path = lock_dir / f"{port}.lock"
        fd = _try_lock(path)
        if fd is None:
            if requested != "auto":
                raise PlanError(f"master_port {port} is already reserved by another orch job on this "
                                "machine; choose another port or set master_port: auto.")
            continue
        if check_bind and not port_is_free(port, addr):
            os.close(fd)
            if requested != "auto":
                raise PlanError(f"master_port {port} is in use on {addr} by another process; choose "
                                "another port or set master_port: auto.")
            continue
        if not hold:
            os.close(fd)
            fd = None
        return PortLease(port, path, fd)
    raise PlanError(f"No free master port in {DEFAULT_PORT}..{DEFAULT_PORT + _AUTO_RANGE - 1} on {addr}; "
                    "set master_port to a free port.")
