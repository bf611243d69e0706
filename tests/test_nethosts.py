"""The namespace test hosts themselves (tests/nethosts.py): ssh with verified host keys,
isolation, reachability, failure injection, and teardown that leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nethosts
import paramiko
import psutil
import pytest
from conftest import wait_for
from nethosts import TestNetwork

pytestmark = pytest.mark.integration

PY = sys.executable


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _exec(client: paramiko.SSHClient, cmd: str, timeout: float = 10) -> str:
    _, out, err = client.exec_command(cmd, timeout=timeout)
    text = out.read().decode()
    assert out.channel.recv_exit_status() == 0, f"{cmd!r} failed: {err.read().decode()}"
    return text


def _system_state() -> dict[str, str]:
    return {
        "netns": subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout,
        "links": subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout,
        "hosts": Path("/etc/hosts").read_text(),
    }


def _assert_all_gone(net: TestNetwork, pids: list[int]) -> None:
    assert net.leftovers() == []
    state = _system_state()
    for h in net.hosts:
        assert h.ns not in state["netns"]
        assert h.veth not in state["links"]
        assert h.name not in state["hosts"] and h.addr not in state["hosts"]
        assert not (Path("/run/netns") / h.ns).exists()
    assert net.bridge not in state["links"]
    assert net.marker not in state["hosts"]
    assert net.key_dir is not None and not net.key_dir.exists()
    left = [p for p in pids if not _gone(p)]
    assert not left, f"processes of the network survived teardown: {left}"


def test_ssh_by_name_lands_in_each_hosts_own_namespace(net3: TestNetwork) -> None:
    assert len(set(net3.addresses)) == 3 and len(set(net3.names)) == 3
    for h in net3.hosts:
        assert socket.gethostbyname(h.name) == h.addr           # /etc/hosts, from the root namespace
        client = net3.connect(h.index)                          # by name; RejectPolicy + known_hosts
        try:
            out = _exec(client, "id -un; stat -L -c %i /proc/self/ns/net; ip -4 -o addr show eth0")
            user, ino, addr = out.split("\n", 2)
            assert user == "root"
            assert f"inet {h.addr}/24" in addr
            assert all(other not in addr for other in net3.addresses if other != h.addr)
            assert int(ino) == os.stat(f"/run/netns/{h.ns}").st_ino  # the session runs in h's namespace
        finally:
            client.close()
    # by address too (known_hosts lists both), and with OpenSSH's client through the config
    client = net3.connect(2, by="addr")
    client.close()
    r = subprocess.run(net3.ssh_argv(1, "ip -4 -o addr show eth0"), capture_output=True, text=True, timeout=20)
    assert r.returncode == 0 and f"inet {net3.addresses[1]}/24" in r.stdout, r.stderr
    p = net3.client_params()
    assert p["user"] == "root" and p["port"] == 22 and p["hostnames"] == net3.names
    assert oct(os.stat(p["key_filename"]).st_mode & 0o777) == "0o600"


def test_host_keys_are_verified(net3: TestNetwork, tmp_path: Path) -> None:
    # a known_hosts that gives host 0's name host 1's key: the connection must be refused
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{net3.names[0]} {net3.hosts[1].host_pubkey}\n")
    client = paramiko.SSHClient()
    client.load_host_keys(str(wrong))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    with pytest.raises(paramiko.BadHostKeyException):
        client.connect(net3.names[0], username="root", key_filename=str(net3.client_key),
                       look_for_keys=False, allow_agent=False, timeout=5)
    client.close()
    # an unknown host is rejected too
    (tmp_path / "empty").write_text("")
    client = paramiko.SSHClient()
    client.load_host_keys(str(tmp_path / "empty"))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    with pytest.raises(paramiko.SSHException):
        client.connect(net3.names[0], username="root", key_filename=str(net3.client_key),
                       look_for_keys=False, allow_agent=False, timeout=5)
    client.close()


def test_hosts_reach_each_other_and_the_controller(net3: TestNetwork) -> None:
    probe = textwrap.dedent("""
        import socket, sys
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
            s.settimeout(5)
            print(s.recv(64).decode().strip())
    """)
    r = net3.run(1, [PY, "-c", probe, net3.names[0], "22"], timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("SSH-2.0-"), r.stderr
    # a listener on the controller's side (root namespace, bridge address) is reachable by name
    srv = socket.create_server((net3.controller_addr, 0))
    try:
        port = srv.getsockname()[1]
        srv.settimeout(10)
        client = net3.connect(2)
        try:
            cmd = (f"{PY} -c 'import socket; s=socket.create_connection((\"{net3.controller_name}\", {port}), 5);"
                   "s.sendall(b\"hi\"); s.close()'")
            _exec(client, cmd)
        finally:
            client.close()
        conn, peer = srv.accept()
        with conn:
            assert peer[0] == net3.addresses[2]           # it came from host 2's own address
            assert conn.recv(2) == b"hi"
    finally:
        srv.close()
    # the run() helper is inside the namespace as well; pids() lists the namespace's sshd
    assert net3.hosts[0].sshd is not None and net3.hosts[0].sshd.pid in net3.pids(0)
    assert net3.hosts[0].sshd.pid not in net3.pids(1)


def test_kill_host_refuses_connections_and_kills_everything_inside(make_net) -> None:
    net = make_net(2)
    client = net.connect(1)
    pid = int(_exec(client, "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!"))
    client.close()
    sshd_pid = net.hosts[1].sshd.pid
    assert pid in net.pids(1) and sshd_pid in net.pids(1)
    net.kill_host(1)
    assert net.pids(1) == []
    assert _gone(pid) and _gone(sshd_pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((net.addresses[1], 22), timeout=2).close()
    with pytest.raises((paramiko.SSHException, OSError)):
        net.connect(1, timeout=2)
    net.connect(0).close()                                 # the other host is untouched
    net.start_sshd(1)                                      # and a killed host can come back
    net.connect(1).close()


def test_cut_link_times_out_silently_and_restore_heals(make_net) -> None:
    net = make_net(2)
    client = net.connect(1)
    chan = client.get_transport().open_session()
    chan.exec_command("cat")                               # an echo over an established session
    chan.settimeout(5)
    chan.sendall(b"a")
    assert chan.recv(1) == b"a"
    net.cut_link(1)
    assert not net.link_up(1)
    t0 = time.monotonic()
    with pytest.raises((socket.timeout, TimeoutError)):   # no reset, no refusal: silence
        socket.create_connection((net.addresses[1], 22), timeout=1).close()
    assert time.monotonic() - t0 >= 0.9
    chan.settimeout(1)
    chan.sendall(b"b")
    with pytest.raises(socket.timeout):                    # the established session hears nothing
        chan.recv(1)
    net.connect(0).close()                                 # host 0 is unaffected
    net.restore_link(1)
    chan.settimeout(15)
    assert chan.recv(1) == b"b"                            # the same TCP connection survived the cut
    chan.close()
    client.close()
    # reset() brings a network back to health after kills and cuts
    net.cut_link(0)
    net.kill_host(1)
    net.reset()
    assert net.link_up(0) and net.link_up(1)
    net.connect(0).close()
    net.connect(1).close()


@pytest.mark.parametrize("exc", [None, RuntimeError, KeyboardInterrupt])
def test_teardown_leaves_nothing(exc) -> None:
    pids: list[int] = []
    net = TestNetwork(2)
    strays: list[subprocess.Popen] = []

    with pytest.raises(exc) if exc else contextlib.nullcontext():
        with net:
            pids += [h.sshd.pid for h in net.hosts]
            client = net.connect(0)                        # an open session: sshd children
            pids += net.pids(0)
            pids.append(int(_exec(client, "setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!")))
            strays.append(net.popen(1, ["sleep", "1000"], start_new_session=True))
            pids.append(strays[-1].pid)
            assert len(set(pids)) >= 5
            if exc:
                raise exc("body failed")
    client.close()
    _assert_all_gone(net, pids)
    assert strays[0].wait(timeout=5) == -9
    net.close()                                            # idempotent
    _assert_all_gone(net, pids)


def test_two_networks_coexist(net3: TestNetwork, net4: TestNetwork) -> None:
    assert net3.subnet != net4.subnet and net3.bridge != net4.bridge
    assert not set(net3.names) & set(net4.names)
    for h in net4.hosts:
        assert socket.gethostbyname(h.name) == h.addr
        net4.connect(h.index).close()


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from nethosts import TestNetwork
    net = TestNetwork(1).start()
    print(net.hosts[0].ns, net.bridge, net.hosts[0].name, net.key_dir, net.hosts[0].sshd.pid, flush=True)
    if sys.argv[1] == "crash":
        os.kill(os.getpid(), signal.SIGSTOP)               # the test SIGKILLs it: no teardown at all
    sys.stdin.read()                                        # stay alive until told
    net.close()
""")


def test_cleanup_stale_removes_dead_sessions_only(net3: TestNetwork, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(Path(__file__).parent)))
    # a live session first (the crashing one's start-up clean-up must leave it alone), then
    # one that dies without teardown
    alive = subprocess.Popen([PY, str(script), "live"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        a_ns, a_bridge, a_name, a_dir, a_sshd = alive.stdout.readline().split()
        crashed = subprocess.Popen([PY, str(script), "crash"], stdout=subprocess.PIPE, text=True)
        c_ns, c_bridge, c_name, c_dir, c_sshd = crashed.stdout.readline().split()
        # under the machine-wide lock, so that no other session's start-up cleans it first
        with nethosts._global_lock():
            crashed.kill()
            assert crashed.wait(timeout=10) == -9
            before = _system_state()
            assert c_ns in before["netns"] and c_bridge in before["links"] and c_name in before["hosts"]
            assert not _gone(int(c_sshd))                  # the crashed session's sshd lingers
            removed = nethosts.cleanup_stale()
        assert any(c_ns in r for r in removed), removed
        after = _system_state()
        assert c_ns not in after["netns"] and c_bridge not in after["links"] and c_name not in after["hosts"]
        assert not Path(c_dir).exists()
        wait_for(lambda: _gone(int(c_sshd)), 5, "the crashed session's sshd to die")
        # the live session and our own network are untouched
        assert a_ns in after["netns"] and a_bridge in after["links"] and a_name in after["hosts"]
        assert Path(a_dir).exists() and not _gone(int(a_sshd))
        for h in net3.hosts:
            assert h.ns in after["netns"] and h.name in after["hosts"]
        net3.connect(0).close()
    finally:
        alive.stdin.close()
        assert alive.wait(timeout=30) == 0
    after = _system_state()
    assert a_ns not in after["netns"] and a_name not in after["hosts"]


def test_missing_prerequisites_fail_clearly(monkeypatch) -> None:
    monkeypatch.setattr(nethosts, "SSHD", "/nonexistent/sshd")
    with pytest.raises(nethosts.NetHostsError, match="openssh-server"):
        nethosts.check_prerequisites()


def test_failed_setup_cleans_up_and_says_why() -> None:
    net = TestNetwork(2, sshd_options=["NoSuchSshdOption yes"])
    with pytest.raises(nethosts.NetHostsError, match="NoSuchSshdOption"):
        net.start()
    assert net.leftovers() == []
