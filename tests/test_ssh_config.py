"""How the ssh provisioner resolves each host: the spec's ssh section, then ~/.ssh/config, then defaults."""

from __future__ import annotations

import getpass
from pathlib import Path

import pytest

from orchestrator.errors import ProvisionError
from orchestrator.planning import ResourcePool
from orchestrator.provisioners.ssh import SSHProvisioner
from orchestrator.spec import SSHOptions


def _pool(*hosts: str) -> ResourcePool:
    return ResourcePool(nodes=tuple((h, (0,)) for h in hosts))


@pytest.fixture()
def key(tmp_path: Path) -> Path:
    """A new ed25519 private key in OpenSSH's format (what ``ssh-keygen -t ed25519 -N ''`` writes), mode 600."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = tmp_path / "id_ed25519"
    path.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _config(tmp_path: Path, key: Path) -> Path:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host gpu-*\n    User trainer\n    Port 2222\n    IdentityFile {key}\n"
                   f"    UserKnownHostsFile {tmp_path / 'kh'}\n"
                   "Host gpu-1\n    HostName 127.0.0.1\n")
    return cfg


def test_ssh_config_fills_what_the_spec_leaves_unset(tmp_path, key) -> None:
    prov = SSHProvisioner(SSHOptions(config_file=str(_config(tmp_path, key))))
    t = prov.target("gpu-1")
    assert (t.hostname, t.user, t.port, t.identity_files) == ("127.0.0.1", "trainer", 2222, (str(key),))
    assert t.known_hosts == str(tmp_path / "kh") and not t.accept_new
    other = prov.target("cpu-9")  # no config entry: OpenSSH's defaults
    assert (other.hostname, other.user, other.port, other.identity_files) == ("cpu-9", getpass.getuser(), 22, ())
    assert other.known_hosts.endswith("/.ssh/known_hosts")


def test_the_spec_wins_over_ssh_config(tmp_path, key) -> None:
    opts = SSHOptions(config_file=str(_config(tmp_path, key)), user="root", port=22, identity_file=str(key),
                      known_hosts=str(tmp_path / "mine"), host_key_policy="accept-new", connect_timeout=3)
    t = SSHProvisioner(opts).target("gpu-1")
    assert (t.hostname, t.user, t.port, t.known_hosts, t.accept_new, t.timeout) == (
        "127.0.0.1", "root", 22, str(tmp_path / "mine"), True, 3)


def test_check_lists_every_problem_before_anything_starts(tmp_path, key) -> None:
    open_key = tmp_path / "open_key"
    open_key.write_bytes(key.read_bytes())
    open_key.chmod(0o644)
    prov = SSHProvisioner(SSHOptions(identity_file=str(open_key), known_hosts=str(tmp_path / "none")))
    with pytest.raises(ProvisionError) as err:
        prov.check(_pool("localhost", "no-such-host.invalid"))
    msg = str(err.value)
    assert f"permissions 0644 of identity file {open_key} are too open" in msg
    assert f"known_hosts file {tmp_path / 'none'} does not exist" in msg
    assert "host no-such-host.invalid does not resolve" in msg and "host localhost" not in msg


@pytest.mark.parametrize("content,needle", [(None, "does not exist"), (b"not a key\n", "not a private key")])
def test_bad_identity_files(tmp_path, content, needle) -> None:
    path = tmp_path / "k"
    if content is not None:
        path.write_bytes(content)
        path.chmod(0o600)
    (tmp_path / "kh").write_text("")
    with pytest.raises(ProvisionError, match=needle):
        SSHProvisioner(SSHOptions(identity_file=str(path), known_hosts=str(tmp_path / "kh"))).check(_pool("localhost"))


def test_accept_new_needs_no_known_hosts_file(tmp_path, key) -> None:
    opts = SSHOptions(identity_file=str(key), known_hosts=str(tmp_path / "new"), host_key_policy="accept-new")
    SSHProvisioner(opts).check(_pool("localhost"))
    assert SSHProvisioner(opts).master_addr("localhost") == "127.0.0.1"


def test_missing_config_file_named_in_the_spec(tmp_path) -> None:
    with pytest.raises(ProvisionError, match="ssh.config_file .* does not exist"):
        SSHProvisioner(SSHOptions(config_file=str(tmp_path / "nope")))
