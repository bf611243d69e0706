"""Bad input refused at plan time with a clear error (exit 2, never a traceback), where DeepSpeed's runner
would warn and fail later on a node, or hang: num_gpus over a host's slots, num_nodes (or Accelerate's
num_machines) over the hosts, an unresolvable master_addr, NUL bytes, absurd slot counts; and what a
user's own text does to orch's output (markup in host names, terminal escapes in rank logs), and
``orch list`` paging. Real ``orch`` processes on real files."""

from __future__ import annotations

import json
import time

import pytest
from conftest import SCRIPTS, wait_for

from orchestrator.face.cli.output import printable

WORKER = str(SCRIPTS / "worker.py")


def _plan(orch, spec):
    r = orch("plan", str(spec))
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_num_gpus_over_a_hosts_slots_is_refused_naming_the_line(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("a slots=4\nb slots=2\n")), entrypoint=WORKER, num_gpus=4)
    r = _plan(orch, spec)
    assert r.returncode == 2 and "num_gpus=4 is more than the slots" in r.stderr and "b slots=2 (line 2)" in r.stderr
    assert "a slots=4" not in r.stderr
    ok = write_spec(hostfile=str(hostfile("a slots=4\nb slots=2\n")), entrypoint=WORKER, num_gpus=2)
    assert _plan(orch, ok).returncode == 0


def test_num_nodes_over_the_hosts_is_refused(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("a slots=1\nb slots=1\n")), entrypoint=WORKER, num_nodes=3)
    r = _plan(orch, spec)
    assert r.returncode == 2 and "num_nodes=3 is more than the 2 host(s) (a, b)" in r.stderr, r.stderr


def test_accelerate_machines_that_do_not_fit_are_refused(orch, write_spec, hostfile, tmp_path) -> None:
    acc = tmp_path / "acc.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 3\n"
                   "num_processes: 6\nmachine_rank: 0\nmain_process_ip: 127.0.0.1\nmain_process_port: 29500\n"
                   "deepspeed_config:\n  zero_stage: 2\n  deepspeed_multinode_launcher: pdsh\n")
    spec = write_spec(hostfile=str(hostfile("a slots=2\nb slots=2\n")), entrypoint=WORKER,
                      accelerate_config=str(acc))
    r = _plan(orch, spec)
    assert r.returncode == 2 and "num_nodes=3 (from accelerate_config's num_machines/num_processes)" in r.stderr, \
        r.stderr


def test_an_unresolvable_master_addr_is_refused_at_once(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER, master_addr="no-such-host.invalid")
    t0 = time.monotonic()
    r = _plan(orch, spec)
    assert r.returncode == 2 and "master_addr 'no-such-host.invalid' does not resolve on this machine" in r.stderr
    assert time.monotonic() - t0 < 15
    literal = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER, master_addr="127.0.0.1")
    assert _plan(orch, literal).returncode == 0  # an address is not looked up


def test_nul_bytes_are_refused_by_field(orch, tmp_path, hostfile) -> None:
    spec = tmp_path / "nul.yaml"
    spec.write_text(f'name: t\nhostfile: {hostfile("a slots=1")}\nentrypoint: {WORKER}\nargs: ["--x", "a\\0b"]\n'
                    'env: {GOOD: "1", BAD: "y\\0"}\n')
    r = _plan(orch, spec)
    assert r.returncode == 2 and "args[1] (line 4): contains a NUL byte" in r.stderr and \
        "env.BAD (line 5): contains a NUL byte" in r.stderr, r.stderr


def test_deadlines_and_counts_say_what_they_take_in_one_line(orch, write_spec, hostfile) -> None:
    for value in (0, -1, "abc", True, float("nan")):
        spec = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER, hang_timeout=value)
        r = _plan(orch, spec)
        assert r.returncode == 2 and r.stderr.count("\n  ") == 1, r.stderr
        assert "hang_timeout (line" in r.stderr and "expected seconds > 0 (at most 86400), auto or null" in r.stderr
    spec = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER, num_nodes=True, startup_timeout=0)
    r = _plan(orch, spec)
    assert r.returncode == 2 and "num_nodes (line" in r.stderr and "got True" in r.stderr
    assert "startup_timeout (line" in r.stderr and "expected seconds > 0 (at most 604800) or null" in r.stderr


@pytest.mark.integration
def test_a_bad_idempotency_key_is_refused_before_anything_is_sent(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER)
    for key in ("é", "a\nb", "", "k" * 201):
        r = orch("submit", "--idempotency-key", key, str(spec))
        assert r.returncode == 2 and "expected 1 to 200 printable ASCII characters" in r.stderr, (key, r.stderr)
        assert "Traceback" not in r.stderr


def test_slot_counts_past_any_machine_are_refused_quickly(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("a slots=1000000\n")), entrypoint=WORKER)
    t0 = time.monotonic()
    r = _plan(orch, spec)
    assert r.returncode == 2 and "more than the 4096 slots orch allows on one host" in r.stderr
    assert time.monotonic() - t0 < 15


def test_a_big_plan_prints_a_page_and_says_how_to_see_all(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("a slots=300\n")), entrypoint=WORKER)
    r = _plan(orch, spec)
    assert r.returncode == 0 and "... and 236 more ranks (orch plan --output json lists all 300)" in r.stdout
    assert " 0-299 " in r.stdout  # the node's slots and ranks, as ranges
    assert len(orch.json("plan", str(spec))["nodes"][0]["ranks"]) == 300


@pytest.mark.integration
def test_markup_in_a_host_name_is_text(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("node[/x]-0 slots=1\n[bold]n1 slots=1\n")), entrypoint=WORKER,
                      env={"WORKER_STEPS": "1", "WORKER_STEP_S": "0.01"})
    r = _plan(orch, spec)
    assert r.returncode == 0 and "node[/x]-0" in r.stdout and "[bold]n1" in r.stdout, r.stdout + r.stderr
    run = orch("run", str(spec))
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    listed = orch("list")
    assert listed.returncode == 0 and "node[/x]-0,[bold]n1" in listed.stdout, listed.stdout + listed.stderr


@pytest.mark.integration
def test_terminal_escapes_from_a_rank_never_reach_the_terminal(orch, write_spec, hostfile) -> None:
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b]52;c;ZXZpbA==\x07visible\x1b[31m red\x1b[0m"
    spec = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER,
                      env={"WORKER_STEPS": "3", "WORKER_STEP_S": "0.01", "WORKER_SAY": evil, "WORKER_FAIL_RANK": "0",
                           "WORKER_FAIL_AT": "2"})
    run = orch("run", str(spec))
    assert run.returncode == 1
    job = orch.json("list")[0]["id"]
    logs = orch("logs", job, "--rank", "0")
    for out in (logs.stdout, run.stdout, run.stderr):
        assert "\x1b" not in out and "\x07" not in out
    assert "visible red" in logs.stdout
    raw = json.loads(orch("status", job, "--output", "json").stdout)["cause"]["log_tail"]
    assert any(evil in line for line in raw)  # the stored text keeps the bytes; JSON escapes them


def test_printable_keeps_text_and_drops_control() -> None:
    assert printable("a\tb é 中 \x1b[1;31mX\x1b[0m\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\x08\x7f\r") == "a\tb é 中 Xlink"


@pytest.mark.integration
def test_list_pages_and_says_when_it_cut(orch, write_spec, hostfile) -> None:
    spec = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER,
                      env={"WORKER_STEPS": "1", "WORKER_STEP_S": "0.01"})
    for _ in range(4):
        assert orch("run", str(spec)).returncode == 0
    r = orch("list", "--limit", "3")
    assert r.returncode == 0 and "(the newest 3 jobs; there are more: --limit N or --all)" in r.stdout
    assert len(orch.json("list", "--limit", "3")) == 3 and len(orch.json("list", "--all")) == 4
    assert "there are more" not in orch("list").stdout


@pytest.mark.integration
def test_a_retried_submit_makes_one_job(orch, server, write_spec, hostfile) -> None:
    proc, url = server
    spec = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER,
                      env={"WORKER_STEPS": "1", "WORKER_STEP_S": "0.01"})
    first = orch.json("submit", "--idempotency-key", "k-1", str(spec))
    again = orch.json("submit", "--idempotency-key", "k-1", str(spec))
    assert "id" in first and "id" in again, (first, again)
    assert first["id"] == again["id"] and len(orch.json("list")) == 1
    after = orch.json("submit", str(spec), "--idempotency-key", "k-1")  # an option after the spec works too
    assert after.get("id") == first["id"], after
    other = write_spec(hostfile=str(hostfile("a slots=1\n")), entrypoint=WORKER, env={"WORKER_STEPS": "2"})
    r = orch("submit", "--idempotency-key", "k-1", str(other))
    assert r.returncode == 2 and "was used for job" in r.stderr and "another spec" in r.stderr
    assert orch.json("submit", str(spec))["id"] != first["id"]  # a new invocation: a new key, a new job
    wait_for(lambda: all(j["state"] == "SUCCEEDED" for j in orch.json("list")), 60, "both jobs done")
    huge = orch.http().get(f"{url}/api/jobs/{first['id']}/logs", params={"limit": 10 ** 30})
    assert huge.status_code == 200 and "data" in huge.json()
