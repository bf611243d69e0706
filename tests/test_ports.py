"""Master port reservation: two jobs never get the same port; a busy port is a clear error."""

from __future__ import annotations

import socket
import stat
import subprocess
import sys

import pytest

from orchestrator.errors import PlanError
from orchestrator.supervision.ports import reserve_port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_explicit_port_held_by_another_job_is_an_error(tmp_path) -> None:
    port = _free_port()
    first = reserve_port(tmp_path, port)
    with pytest.raises(PlanError, match=f"master_port {port} is already reserved"):
        reserve_port(tmp_path, port)
    first.release()
    reserve_port(tmp_path, port).release()


def test_explicit_port_in_use_by_another_process(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PlanError, match=f"master_port {port} is in use on 127.0.0.1"):
            reserve_port(tmp_path, port)


def test_auto_gives_two_jobs_different_ports(tmp_path) -> None:
    a = reserve_port(tmp_path, "auto")
    b = reserve_port(tmp_path, "auto")
    assert a.port != b.port and 29500 <= a.port < 31500 and 29500 <= b.port < 31500
    a.release()
    b.release()


@pytest.mark.integration
def test_reservation_is_seen_by_another_process_and_dies_with_it(tmp_path) -> None:
    port = _free_port()
    code = ("import sys,time; from orchestrator.supervision.ports import reserve_port;"
            f"l = reserve_port({str(tmp_path)!r}, {port}); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(PlanError, match="already reserved"):
            reserve_port(tmp_path, port)
        other = reserve_port(tmp_path, "auto")
        assert other.port != port or port < 29500
        other.release()
    finally:
        proc.kill()
        proc.wait()
    reserve_port(tmp_path, port).release()  # the kernel dropped the dead process's lock


def test_plan_only_lookup_does_not_hold(tmp_path) -> None:
    port = _free_port()
    reserve_port(tmp_path, port, hold=False)
    reserve_port(tmp_path, port).release()


def test_a_missing_lock_dir_is_created_shared_like_tmp(tmp_path) -> None:
    """The first reservation on a machine creates the lock directory (parents too) world-writable and sticky
    (mode 1777, as /tmp: every user's jobs reserve ports there), whatever the umask; the port is reserved in it."""
    lock_dir = tmp_path / "fresh" / "orch-ports"
    port = _free_port()
    lease = reserve_port(lock_dir, port)
    assert lock_dir.is_dir() and stat.S_IMODE(lock_dir.stat().st_mode) == 0o1777
    with pytest.raises(PlanError, match="already reserved"):
        reserve_port(lock_dir, port)
    lease.release()
