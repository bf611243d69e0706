"""The ssh provisioner against real sshd hosts (tests/nethosts.py): environment, the collectives'
interface, per-host errors, bad input, warm agents on a restart, a killed server's job re-attached.
What every multi-host provisioner must do (a rank per host, node loss, a spare, cancel) is in
tests/test_provisioners.py, which runs over these hosts too.

Every "node" is a network namespace on this machine with its own sshd; the hosts share the
file system (the virtualenv, the workdir, the checkpoint directory) and the process table,
so ``assert_no_leftovers`` sees every host's processes, and a process belongs to host i
when ``/proc/<pid>/ns/net`` is host i's namespace. Ranks are examples/train_gpt.py (tiny
model, ZeRO-2) where training matters, tests/scripts/allreduce.py (a gloo all-reduce every
step) where a collective job is enough, else tests/probe.py (starts in about a second and
writes each rank's argv and environment to ``$PROBE_OUT_DIR/rank<RANK>.json``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, SCRIPTS, assert_no_leftovers, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_jobs as hj  # noqa: E402
import helpers_train  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

EXAMPLES = ROOT / "examples"
PROBE = ROOT / "tests" / "probe.py"
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
# Neither GLOO_SOCKET_IFNAME (each agent names the interface that routes to the master) nor PATH
# (orch puts the virtualenv's bin, with the `ninja` prebuild_ops used, first on every rank's PATH):
# a login over SSH gets sshd's default environment, as a user's job does.
BASE_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
# the tests' private DeepSpeed op cache (conftest) reaches the ranks the way a user's variables do
PASSTHROUGH = ["TORCH_EXTENSIONS_DIR"]
GRACE = 5


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    """Build (first time: minutes) or load DeepSpeed's CPU ops once, not in every rank at once."""
    helpers_train.prebuild_ops()


# --------------------------------------------------------------------------- helpers

def _ssh(net: Any, **over: Any) -> dict:
    p = net.client_params()
    return {"user": p["user"], "identity_file": p["key_filename"], "known_hosts": p["known_hosts"], **over}


def _hosts(hostfile, net: Any) -> Path:
    """A hostfile with every host of ``net``, one slot each."""
    return hostfile("".join(f"{n} slots=1\n" for n in net.names))


def _train_spec(write_spec, hostfile, net: Any, tmp_path: Path, *, steps: int, interval: int = 0,
                launcher: str = "pdsh", name: str = "ssh", **extra: Any) -> Path:
    config = json.loads((EXAMPLES / "ds_zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    fields = dict(
        name=name, hostfile=str(_hosts(hostfile, net)), provisioner="ssh", launcher=launcher,
        workdir=str(EXAMPLES), entrypoint="train_gpt.py",
        args=["--steps", str(steps), "--checkpoint-interval", str(interval), *TINY],
        deepspeed_config=config, checkpoint_dir=str(tmp_path / f"ckpt-{name}"), ssh=_ssh(net), env=dict(BASE_ENV),
        env_passthrough=PASSTHROUGH, stop_grace_seconds=GRACE)
    fields.update(extra)
    return write_spec(**fields)


def _probe_spec(write_spec, hostfile, net: Any, out_dir: Path, *, name: str = "probe", workdir: Path | None = None,
                env: dict | None = None, hostfile_text: str | None = None, **extra: Any) -> Path:
    hosts_path = hostfile(hostfile_text) if hostfile_text is not None else _hosts(hostfile, net)
    fields = dict(
        name=name, hostfile=str(hosts_path), provisioner="ssh", launcher="pdsh",
        entrypoint=str(PROBE), ssh=_ssh(net),
        env={**BASE_ENV, "PROBE_OUT_DIR": str(out_dir), **(env or {})}, env_passthrough=PASSTHROUGH,
        stop_grace_seconds=GRACE)
    if workdir is not None:
        fields["workdir"] = str(workdir)
    fields.update(extra)
    return write_spec(**fields)


def _assert_hosts_clean(net: Any, timeout: float = 10.0) -> None:
    hj.assert_hosts_clean(net, timeout)


# --------------------------------------------------------------------------- 2. environment

@pytest.mark.parametrize("launcher", ["pdsh", "nossh"])
def test_env_values_reach_every_rank_byte_for_byte_and_no_shell_runs_them(orch, write_spec, hostfile, net3,
                                                                           tmp_path, launcher) -> None:
    traps = [tmp_path / f"ran-{i}" for i in range(6)]
    env = {
        "V_SPACES": "  two  spaces and a trailing one ",
        "V_SINGLE": "it's 'quoted'",
        "V_DOUBLE": 'say "hi" \\"there\\"',
        "V_HOME": "$HOME and ${HOME} and ~",
        "V_BACKTICK": f"`touch {traps[0]}`",
        "V_SEMICOLON": f"a; touch {traps[1]}; echo b",
        "V_SUBST": f"$(touch {traps[2]})",
        "V_NEWLINES": f"line 1\nline 2\n$(touch {traps[3]})\n",
        "V_MIXED": "'\"`;$|&<>*?[]{}()!#%\\ \t ü",
        "V_EMPTY": "",
    }
    workdir = tmp_path / "wd"
    workdir.mkdir()
    # .deepspeed_env, read as DeepSpeed's runner reads it: `key, val = line.split('=', 1)`, then
    # add_export strips both; exported by pdsh only (the nossh path ignores the file)
    (workdir / ".deepspeed_env").write_text(
        "DSENV_PLAIN=hello world   \n"
        f"  DSENV_TRICKY =  $(touch {traps[4]}) `touch {traps[5]}` 'q' \"dq\" ; $HOME \n"
        "DSENV_EQUALS=a=b==c\n"
        "V_SPACES=from the file\n")  # the spec's env is laid over the pdsh exports
    dsenv = {"DSENV_PLAIN": "hello world",
             "DSENV_TRICKY": f"$(touch {traps[4]}) `touch {traps[5]}` 'q' \"dq\" ; $HOME",
             "DSENV_EQUALS": "a=b==c"}
    out_dir = tmp_path / "probe"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, workdir=workdir, env=env, launcher=launcher)
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 0, hj.out(r)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}
    assert sorted(reports) == [0, 1, 2]
    for rank, report in reports.items():
        got = report["env"]
        for key, value in env.items():
            assert got.get(key) == value, (rank, key, got.get(key), value)
        for key, value in dsenv.items():
            if launcher == "pdsh":
                assert got.get(key) == value, (rank, key, got.get(key), value)
            else:
                assert key not in got, (rank, key)
        assert got["SSH_CONNECTION"].split()[2] == net3.addresses[rank]  # rank i came in over SSH to host i
        assert got["ORCH_NODE"] == net3.names[rank] and got["RANK"] == str(rank)
        assert report["cwd"] == str(workdir)
    assert [str(t) for t in traps if t.exists()] == []  # nothing in a value was run by a shell
    (job,) = orch.json("list")
    assert_no_leftovers(job["id"], timeout=1)
    _assert_hosts_clean(net3)


def test_the_collectives_interface_is_the_one_that_reaches_the_master(orch, write_spec, hostfile, net3,
                                                                       tmp_path) -> None:
    # every namespace host's hostname resolves to loopback, so gloo left to itself would listen there
    # (remote=[127.0.0.1]); nothing in the spec or the environment names the interface
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "NCCL_SOCKET_IFNAME" not in os.environ
    out_dir = tmp_path / "chosen"
    r = orch("run", str(_probe_spec(write_spec, hostfile, net3, out_dir)), timeout=120)
    assert r.returncode == 0, hj.out(r)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out_dir.glob("rank*.json")}
    assert sorted(reports) == [0, 1, 2]
    for rank, report in reports.items():
        assert report["env"]["GLOO_SOCKET_IFNAME"] == "eth0" and report["env"]["NCCL_SOCKET_IFNAME"] == "eth0", rank
        assert report["env"]["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)  # the venv's bin first
        # a variable of this shell reaches the ranks over SSH because the spec names it in env_passthrough
        assert report["env"]["TORCH_EXTENSIONS_DIR"] == os.environ["TORCH_EXTENSIONS_DIR"]
    (job,) = orch.json("list")
    started = {e.data["node_rank"]: e.data["network"] for e in hj.store(orch).events(job["id"]) if e.kind == "ranks_started"}
    for i in range(3):
        assert started[i]["detail"] == (f"eth0 ({net3.addresses[i]}) routes to the master {net3.addresses[0]}: "
                                        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to eth0"), started[i]

    # the job's own value wins (an NCCL exclusion list, which names no one interface); gloo's is still chosen
    out_dir = tmp_path / "own"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, name="own", env={"NCCL_SOCKET_IFNAME": "^docker,lo"})
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 0, hj.out(r)
    for p in out_dir.glob("rank*.json"):
        env = json.loads(p.read_text())["env"]
        assert env["NCCL_SOCKET_IFNAME"] == "^docker,lo" and env["GLOO_SOCKET_IFNAME"] == "eth0", p.name


@pytest.mark.parametrize("case", ["loopback master", "loopback interface", "no route"])
def test_a_network_that_cannot_work_fails_the_preflight_naming_it(orch, write_spec, hostfile, net3, tmp_path,
                                                                  case) -> None:
    out_dir = tmp_path / "probe"
    if case == "loopback master":  # every node would rendezvous with itself
        spec = _probe_spec(write_spec, hostfile, net3, out_dir, master_addr="127.0.0.1")
        why = ["the master address 127.0.0.1 (127.0.0.1) is a loopback address on this node, and the job spans "
               "hosts: the other nodes cannot reach it; set master_addr to node 0's address"]
    elif case == "loopback interface":  # the job's own choice is checked too
        spec = _probe_spec(write_spec, hostfile, net3, out_dir, env={"GLOO_SOCKET_IFNAME": "lo"})
        why = ["GLOO_SOCKET_IFNAME=lo is a loopback interface, and the job spans hosts"]
    else:  # the hosts have no route there
        spec = _probe_spec(write_spec, hostfile, net3, out_dir, master_addr="203.0.113.7")
        why = ["no interface reaches the master address 203.0.113.7: Network is unreachable"]
        if _resolves_to_loopback(socket.gethostname()):  # namespaces share the machine's /etc/hosts and name
            why.append("resolves to 127.")
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 1, hj.out(r)
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    cause = detail["cause"]
    assert cause["kind"] == "preflight_failed" and cause["nodes"] == net3.names, cause
    assert {(f["node"], f["check"]) for f in cause["failures"]} == {(h, "network") for h in net3.names}, cause
    for f in cause["failures"]:
        assert all(w in f["message"] for w in why), (why, f["message"])
    shown = " ".join(r.stdout.split())
    assert "next: fix the spec (network failed on every node) and run it again as a new job" in shown, shown
    assert "orch resume" not in shown, shown
    assert not out_dir.exists() or list(out_dir.iterdir()) == []  # no rank started
    assert_no_leftovers(job["id"], timeout=1)
    _assert_hosts_clean(net3)


def _resolves_to_loopback(name: str) -> bool:
    try:
        return socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False


# --------------------------------------------------------------------------- 3. per-host errors

def _unauthorized_key(tmp_path: Path) -> Path:
    """A valid private key (mode 600, in a 0700 directory) whose public key no host authorizes."""
    d = tmp_path / "otherkey"
    d.mkdir(mode=0o700)
    key = d / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    os.chmod(key, 0o600)
    return key


def _assert_provision_failed(orch, r: subprocess.CompletedProcess, out_dir: Path, failed: dict[str, list[str]],
                             net: Any) -> dict:
    """The run failed with provision_failed naming exactly the hosts of ``failed`` (host -> words
    of its reason), no rank started anywhere, and nothing is left."""
    assert r.returncode == 1, hj.out(r)
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    cause = detail["cause"]
    assert detail["state"] == "FAILED" and cause["kind"] == "provision_failed", cause
    assert [n["node"] for n in cause["nodes"]] == list(failed), cause
    assert cause["node"] == next(iter(failed))
    for node in cause["nodes"]:
        for needle in failed[node["node"]]:
            assert needle in node["reason"], (needle, node)
            assert needle in cause["message"], (needle, cause["message"])
    for host in net.names:
        assert (host in cause["message"]) == (host in failed), (host, cause["message"])
    shown = " ".join(r.stdout.split())  # what `orch run` printed names every such host
    assert "FAILED" in shown and all(f"{h} (node {net.names.index(h)})" in shown for h in failed), hj.out(r)
    # no rank started anywhere
    assert not out_dir.exists() or list(out_dir.iterdir()) == []
    assert [e for e in hj.store(orch).events(job["id"]) if e.kind in ("ranks_started", "rank_exit")] == []
    logs = Path(detail["run_dir"]) / "logs"
    assert [p.name for p in logs.glob("rank-*.log") if p.stat().st_size] == []
    assert all(x["state"] == "not started" and x["pid"] is None for x in detail["ranks"]), detail["ranks"]
    assert detail["attempts"][0]["stopped_at"] is not None
    assert_no_leftovers(job["id"], timeout=1)
    _assert_hosts_clean(net)
    return detail


@pytest.mark.parametrize("down", ["killed", "unreachable"])
def test_host_down_fails_provisioning_naming_it(orch, write_spec, hostfile, net3, tmp_path, down) -> None:
    out_dir = tmp_path / "probe"
    if down == "killed":  # nothing listens there any more: the connection is refused
        spec = _probe_spec(write_spec, hostfile, net3, out_dir)
        why = ["refused the connection", "is sshd running there?"]
    else:  # its link is cut: no answer at all
        spec = _probe_spec(write_spec, hostfile, net3, out_dir, ssh=_ssh(net3, connect_timeout=2))
        why = ["no answer from", "within 2 s", "host down or unreachable?"]
    try:
        if down == "killed":
            net3.kill_host(1)
        else:
            net3.cut_link(1)
        r = orch("run", str(spec), timeout=120)
        _assert_provision_failed(orch, r, out_dir, {net3.names[1]: why}, net3)
    finally:
        net3.reset()
    net3.connect(1).close()  # back for the next test


def test_refused_key_fails_provisioning_naming_the_host(orch, write_spec, hostfile, net3, tmp_path) -> None:
    # only host 1 is given the unauthorized key (through an ssh config file); the others the right one
    bad = _unauthorized_key(tmp_path)
    p = net3.client_params()
    config = tmp_path / "ssh_config"
    config.write_text(f"Host {net3.names[1]}\n    IdentityFile {bad}\n"  # IdentityFile accumulates: exclude
                      f"Host * !{net3.names[1]}\n    IdentityFile {p['key_filename']}\n"
                      f"Host *\n    User root\n    UserKnownHostsFile {p['known_hosts']}\n")
    out_dir = tmp_path / "probe"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, ssh={"config_file": str(config)})
    r = orch("run", str(spec), timeout=120)
    _assert_provision_failed(orch, r, out_dir, {net3.names[1]: ["refused the login as root", str(bad)]}, net3)


def test_refused_key_on_every_host_names_every_host(orch, write_spec, hostfile, net3, tmp_path) -> None:
    bad = _unauthorized_key(tmp_path)
    out_dir = tmp_path / "probe"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, ssh=_ssh(net3, identity_file=str(bad)))
    r = orch("run", str(spec), timeout=120)
    detail = _assert_provision_failed(orch, r, out_dir, {h: ["refused the login as root", str(bad)]
                                                         for h in net3.names}, net3)
    # one finding, one line naming every host it is true of: which key was tried, where its public half goes
    (line,) = detail["cause"]["lines"]
    hosts = ", ".join(f"{h} (node {i})" for i, h in enumerate(net3.names))
    assert line == (f"{hosts}: refused the login as root (Authentication failed); tried the identity file(s) {bad}; "
                    "the host accepts a key whose public half is in ~root/.ssh/authorized_keys there (or sshd's "
                    "AuthorizedKeysFile)"), line
    shown = " ".join(r.stdout.split())
    assert " ".join(line.split()) in shown, shown
    assert "next: fix the node(s) first" in shown and f"orch resume {detail['id']} --exclude {','.join(net3.names)}" \
        in shown, shown


def test_no_key_at_all_says_which_keys_were_looked_for(orch, write_spec, hostfile, net3, tmp_path) -> None:
    # no identity file, no ~/.ssh key, no ssh agent: paramiko's own words are "No authentication methods
    # available"; orch says what it looked for and where the key is expected
    home = tmp_path / "home"
    home.mkdir()
    out_dir = tmp_path / "probe"
    p = net3.client_params()
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, ssh={"user": p["user"], "known_hosts": p["known_hosts"]})
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["HOME"] = str(home)
    r = orch("run", str(spec), timeout=120, env=env, replace_env=True)
    why = ["no key to log in as root with: ssh.identity_file is unset and none of ~/.ssh/id_rsa, ~/.ssh/id_ecdsa, "
           "~/.ssh/id_ed25519 exists, and no ssh agent runs (SSH_AUTH_SOCK is unset). Give ssh.identity_file (or "
           "IdentityFile in ~/.ssh/config), or create a key (ssh-keygen -t ed25519); its public half belongs in "
           "~root/.ssh/authorized_keys on the host"]
    detail = _assert_provision_failed(orch, r, out_dir, {h: why for h in net3.names}, net3)
    assert len(detail["cause"]["lines"]) == 1, detail["cause"]["lines"]
    assert "No authentication methods available" not in r.stdout + r.stderr


def test_python_missing_on_the_nodes_fails_provisioning(orch, write_spec, hostfile, net3, tmp_path) -> None:
    out_dir = tmp_path / "probe"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, python="/nonexistent/python3")
    r = orch("run", str(spec), timeout=120)
    _assert_provision_failed(orch, r, out_dir, {h: ["agent ended before it started", "/nonexistent/python3"]
                                                for h in net3.names}, net3)


def test_unknown_host_key_fails_provisioning_naming_the_host(orch, write_spec, hostfile, net3, tmp_path) -> None:
    # a known_hosts file that lacks host 1's key only
    known = tmp_path / "known_hosts"
    known.write_text("".join(line + "\n" for line in Path(net3.known_hosts).read_text().splitlines()
                             if not line.startswith(net3.names[1] + ",")))
    out_dir = tmp_path / "probe"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, ssh=_ssh(net3, known_hosts=str(known)))
    r = orch("run", str(spec), timeout=120)
    _assert_provision_failed(orch, r, out_dir, {net3.names[1]: ["host key", "unknown", str(known), "accept-new"]},
                             net3)


def test_empty_known_hosts_fails_then_accept_new_adds_the_keys(orch, write_spec, hostfile, net3, tmp_path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("")
    out_dir = tmp_path / "probe"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, ssh=_ssh(net3, known_hosts=str(known)))
    r = orch("run", str(spec), timeout=120)
    _assert_provision_failed(orch, r, out_dir, {h: ["host key", "unknown", str(known)] for h in net3.names}, net3)
    assert known.read_text() == ""  # verify never writes

    spec = _probe_spec(write_spec, hostfile, net3, out_dir, name="accept",
                       ssh=_ssh(net3, known_hosts=str(known), host_key_policy="accept-new"))
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 0, hj.out(r)
    assert sorted(p.name for p in out_dir.glob("rank*.json")) == ["rank0.json", "rank1.json", "rank2.json"]
    lines = known.read_text().splitlines()
    assert sorted(lines) == sorted(f"{h.name} {h.host_pubkey}" for h in net3.hosts), lines
    # the keys it added are the hosts' real keys: verifying against the file now succeeds
    for p in out_dir.iterdir():
        p.unlink()
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, name="verify", ssh=_ssh(net3, known_hosts=str(known)))
    r = orch("run", str(spec), timeout=120)
    assert r.returncode == 0, hj.out(r)
    assert len(list(out_dir.glob("rank*.json"))) == 3
    assert known.read_text().splitlines() == lines  # nothing added twice
    for job in orch.json("list"):
        assert_no_leftovers(job["id"], timeout=1)


# --------------------------------------------------------------------------- 4. bad input

@pytest.mark.parametrize("case", ["identity_missing", "identity_0644", "host_unresolvable", "port_not_int",
                                  "unknown_option"])
def test_bad_ssh_input_is_one_clear_message_and_starts_nothing(orch, write_spec, hostfile, net3, tmp_path,
                                                               case) -> None:
    out_dir = tmp_path / "probe"
    if case == "identity_missing":
        missing = tmp_path / "no-such-key"
        ssh, needles = _ssh(net3, identity_file=str(missing)), [f"identity file {missing} does not exist"]
    elif case == "identity_0644":
        key = tmp_path / "open" / "id"
        key.parent.mkdir(mode=0o700)
        key.write_bytes(Path(net3.client_params()["key_filename"]).read_bytes())
        os.chmod(key, 0o644)
        ssh, needles = _ssh(net3, identity_file=str(key)), ["permissions 0644", str(key), "too open", "chmod 600"]
    elif case == "host_unresolvable":
        ssh, needles = _ssh(net3), ["host no-such-host.invalid does not resolve"]
    elif case == "port_not_int":
        ssh, needles = _ssh(net3, port="x"), ["ssh.port", "integer", "'x'"]
    else:
        ssh, needles = _ssh(net3, bogus=1), ["ssh.bogus", "unknown field"]
    text = None
    if case == "host_unresolvable":
        text = f"{net3.names[0]} slots=1\nno-such-host.invalid slots=1\n{net3.names[2]} slots=1\n"
    spec = _probe_spec(write_spec, hostfile, net3, out_dir, ssh=ssh, hostfile_text=text)
    for command in ("plan", "run"):
        r = orch(command, str(spec), timeout=60)
        assert r.returncode == 2, (command, hj.out(r))
        assert "Traceback" not in r.stderr + r.stdout
        assert r.stderr.startswith("error:") and r.stderr.count("error:") == 1, r.stderr
        err = " ".join(r.stderr.split())
        for needle in needles:
            assert needle in err, (needle, r.stderr)
        if case == "host_unresolvable":
            assert net3.names[0] not in err and net3.names[2] not in err  # only the bad one is named
    assert orch.json("list") == []
    assert not out_dir.exists()
    assert hj.foreign_processes(net3) == []


# --------------------------------------------------------------------------- 5. warm agents

def test_a_crashed_rank_restarts_on_the_agents_kept_on_every_host(orch, write_spec, hostfile, net3, tmp_path) -> None:
    """Warm agents over SSH (issue 18 item 2): rank 1 raises at step 8 of attempt 1; the restart runs on the same
    three agents (no new SSH session, no hello), their ranks forked from the templates kept, and resumes from the
    last checkpoint; every host is clean at the end."""
    steps, interval = 12, 4
    spec = _train_spec(write_spec, hostfile, net3, tmp_path, steps=steps, interval=interval, name="warm",
                       restart={"max_restarts": 1, "backoff_seconds": 0}, fast_start="auto")
    fields = yaml.safe_load(spec.read_text())
    fields["args"] += ["--fail-at-step", "8", "--fail-rank", "1"]
    spec.write_text(yaml.safe_dump(fields))
    r = orch("run", str(spec), timeout=600)
    assert r.returncode == 0, hj.out(r)
    job_id = orch.json("list")[0]["id"]
    done = orch.json("status", job_id)
    assert [a["state"] for a in done["attempts"]] == ["FAILED", "SUCCEEDED"]
    assert done["attempts"][1]["resume_tag"] == "step_8"
    store = hj.store(orch)
    events = store.events(job_id)
    first = {e.data["host"]: e.data["pid"] for e in events if e.kind == "agent_up"}
    kept = {e.data["host"]: e.data["pid"] for e in events if e.kind == "agent_kept"}
    assert sorted(first) == sorted(net3.names) and kept == first  # every attempt-2 node on its attempt-1 agent
    assert [e for e in events if e.kind == "agent_up" and e.attempt == 2] == []
    started = [e.data["fast_start"] for e in events if e.kind == "ranks_started" and e.attempt == 2]
    assert len(started) == 3 and all(f["forked"] and f["kept"] for f in started), started
    resumed = hj.losses(Path(done["run_dir"]))
    assert sorted(resumed) == [(rank, s) for rank in range(3) for s in range(9, steps + 1)]
    assert_no_leftovers(job_id, timeout=1)
    _assert_hosts_clean(net3)


# --------------------------------------------------------------------------- re-attach over SSH

def test_a_killed_server_s_job_over_ssh_goes_on_under_the_next_server(orch, write_spec, hostfile, net3,
                                                                      tmp_path) -> None:
    """kill -9 of orch server mid-run on 3 hosts; the next server re-attaches over SSH (python -m agents.attach
    on each host pipes the channel to the agent's socket): the same rank processes (a gloo all-reduce every step,
    tests/scripts/allreduce.py) go on, every step is logged once, one attempt, nothing left on any host."""
    from conftest import running_server
    steps = 300
    spec = write_spec(name="reattach", hostfile=str(_hosts(hostfile, net3)), provisioner="ssh", launcher="pdsh",
                      entrypoint=str(SCRIPTS / "allreduce.py"), fast_start="off", ssh=_ssh(net3),
                      env={**BASE_ENV, "ALLREDUCE_STEPS": str(steps), "ALLREDUCE_STEP_S": "0.03"},
                      env_passthrough=PASSTHROUGH, stop_grace_seconds=GRACE)
    with running_server(orch) as (server, _url):
        job_id = orch.json("submit", str(spec))["id"]
        run_dir = hj.wait_training(orch, job_id, 3, past=5)
        pids = hj.started_pids(hj.store(orch), job_id)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        killed = time.monotonic()
        at_kill = min(hj.last_steps(run_dir, 3))
    time.sleep(2)
    assert all(hj.alive(p) for p in pids.values()), "a rank stopped while no controller ran"
    with running_server(orch):
        wait_for(lambda: any(e.kind == "reattached" for e in hj.store(orch).events(job_id)), 60, "the re-attach")
        reattached = time.monotonic() - killed
        assert all(hj.alive(p) for p in pids.values())
        wait_for(lambda: orch.json("status", job_id)["state"] == "SUCCEEDED", 300, "the job to succeed")
    detail = orch.json("status", job_id)
    assert len(detail["attempts"]) == 1 and at_kill < steps - 10
    seen = hj.losses(run_dir)
    assert sorted(seen) == [(r, s) for r in range(3) for s in range(1, steps + 1)]  # each step once, none lost
    kinds = [e.kind for e in hj.store(orch).events(job_id)]
    assert kinds.count("agent_reattached") == 3 and "restart_scheduled" not in kinds
    print(f"\n[ssh reattach] the next server re-attached to 3 hosts {reattached:.1f} s after kill -9 (2 s with no "
          f"server); the ranks went on from step {at_kill}, {steps} of {steps} steps once")
    assert_no_leftovers(job_id)
    _assert_hosts_clean(net3)
