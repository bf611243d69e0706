"""Hypothesis over what a user or a client can hand orch: no input gives a traceback.

* The HTTP API, in process (Starlette's TestClient raises any exception a route lets out): random specs
  submitted (host names with rich markup and terminal escapes, NUL bytes in paths, args and env, slots
  and counts of any size or type, nesting, idempotency keys of any text), and random job ids and query
  values for every read route. Every answer is JSON with ``error`` when it is a refusal, never a 500.
* The CLI, in process (``orchestrator.face.cli.main``: an exception it lets out fails the test): ``orch
  plan`` of random spec files and hostfiles, ``orch list --limit``, ``orch status``, ``orch logs`` with
  random ids, ranks, attempts, offsets and limits, against a state directory holding a real job whose
  rank printed terminal control sequences. Exit 0, 1 or 2, no ``Traceback`` on either stream, and no
  escape sequence from rank output reaches the terminal.

The one seam: the API's controller gets a provisioner that refuses to start agents, so a random spec
that happens to be valid is planned, stored and failed instead of run (its planning is what is tested).
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st
from starlette.testclient import TestClient

from conftest import SCRIPTS
from orchestrator.errors import ProvisionError
from orchestrator.face.api import create_app
from orchestrator.face.cli.app import main as orch_main
from orchestrator.provisioners import LocalProvisioner
from orchestrator.supervision import Controller

NASTY = ["node[/x]-0", "[bold red]x[/]", "[link=file:///etc]y", "\x1b[2J\x1b[H", "\x1b]0;title\x07", "\x9b31m",
         "a\x00b", "\x00", "", " ", "-", "--help", "../../etc/passwd", "é" * 3, "\ud800".encode("utf-8", "surrogatepass")
         .decode("utf-8", "replace"), "x" * 300, "\ud800x", "\udcff", "\U0001f600", "$(touch /tmp/pwned)", "`id`", "a;b", "%s%n", "{}", "[]", "null"]
text = st.one_of(st.sampled_from(NASTY), st.text(max_size=40),
                 st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x9f), max_size=20))
number = st.one_of(st.integers(-10, 10), st.integers(-(2 ** 70), 2 ** 70), st.booleans(), st.floats(allow_nan=True),
                   text, st.none())
host = st.one_of(st.sampled_from(["node-0", "node-1", "localhost", "node[/x]-0", "[b]n[/b]", "n\x1b[31m", "h" * 70]),
                 st.text(alphabet=string.ascii_letters + string.digits + "-._[]/:@", min_size=1, max_size=20))


def hostfile_text() -> st.SearchStrategy[str]:
    """Mostly hostfiles DeepSpeed would take (any host names, small and huge slot counts), some junk."""
    good = st.builds(lambda h, n: f"{h} slots={n}", host, st.one_of(st.integers(1, 4), st.integers(5, 10 ** 7)))
    return st.one_of(st.lists(good, min_size=1, max_size=4), st.lists(st.one_of(good, host, text), min_size=1,
                                                                      max_size=5)).map("\n".join)


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def either(*good: object, bad: st.SearchStrategy = text) -> st.SearchStrategy:
    """A value a spec would take, or (as often) one it may not."""
    return st.one_of(st.sampled_from(good), bad)


#: The fields a mutation changes: each a good value or a bad one.
FIELDS = {
    "name": either("job", "node[/x]-0", "[bold]x", "é"),
    "entrypoint": either("train.py", "./train.py"),
    "args": st.lists(text.filter(lambda t: "\x00" not in t), max_size=4) | st.lists(text, max_size=3),
    "env": st.dictionaries(st.sampled_from(["A", "B_2", "PATH"]), text, max_size=3) | st.dictionaries(text, text, max_size=2),
    "num_nodes": either(1, 2, bad=number), "num_gpus": either(1, 2, bad=number),
    "master_addr": either(None, "127.0.0.1", "localhost"), "master_port": either("auto", 29600, bad=number),
    "hang_timeout": either("auto", 60, None, bad=number), "startup_timeout": either(900, None, bad=number),
    "include": either(None, "node-0", "node-0:0", "node[/x]-0"), "exclude": either(None, "node-1"),
    "launcher": either("pdsh", "standard", "openmpi", "mpich", "slurm", "nossh"),
    "deepspeed_config": either(None, {"train_batch_size": 4}, {"zero_optimization": {"stage": 2}},
                               bad=st.one_of(st.just(nested(450)), st.dictionaries(text, number, max_size=3))),
    "restart": either(None, {"max_restarts": 1}, bad=st.dictionaries(st.sampled_from(
        ["max_restarts", "backoff_seconds", "retry_on"]), number, max_size=3)),
}


def spec_strategy(hostfile: str) -> st.SearchStrategy[dict]:
    """A spec that would run, with 0-3 of its fields changed (:data:`FIELDS`): most are refused, many plan."""
    @st.composite
    def build(draw):  # noqa: ANN001, ANN202 - hypothesis' draw
        spec = {"name": "fuzz", "hostfile": hostfile, "entrypoint": "train.py", "workdir": os.path.dirname(hostfile)}
        for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
            spec[key] = draw(FIELDS[key])
        return {k: v for k, v in spec.items() if v is not None}
    return build()


class RefusingProvisioner(LocalProvisioner):
    """Plans like the local provisioner, starts nothing (the test's one seam)."""

    def start_agent(self, node, plan, events):  # noqa: ANN001 - the base's signature
        raise ProvisionError("this test starts no agent", reason="test")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    state = tmp_path_factory.mktemp("fuzz-api")
    work = tmp_path_factory.mktemp("fuzz-work")
    (work / "train.py").write_text("print('hi')\n")
    (work / "hosts").write_text("node-0 slots=2\nnode-1 slots=2\n")
    controller = Controller(state, provisioner_factory=lambda name, spec: RefusingProvisioner())
    client = TestClient(create_app(controller, "tok", ["testserver"]), raise_server_exceptions=True)
    client.headers["Authorization"] = "Bearer tok"
    yield client, str(work / "hosts")
    controller.close(timeout=10)


def _refusal_or_answer(r) -> None:
    assert r.status_code < 500 or r.status_code == 507, (r.status_code, r.text[:500])
    body = r.json()
    if r.status_code >= 400:
        assert isinstance(body, dict) and body.get("error"), body


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_random_submissions_are_answered_never_a_500(api, data) -> None:
    client, hostfile = api
    spec = data.draw(spec_strategy(hostfile))
    key = data.draw(st.one_of(st.none(), text))
    headers = {}
    if key is not None and key == key.strip() and all(c == "\t" or 0x20 <= ord(c) <= 0xff and ord(c) != 0x7f
                                                      for c in key):
        headers["Idempotency-Key"] = key.encode("latin-1")  # (what HTTP can carry at all; the rest is never sent)
    body = json.dumps({"spec": spec})  # (NaN and Infinity as Python writes them: the server must cope)
    r = client.post("/api/jobs", content=body, headers={**headers, "Content-Type": "application/json"})
    event(f"status {r.status_code}")
    _refusal_or_answer(r)


def _sendable(t: str) -> bool:
    """Whether a URL can carry ``t`` at all (percent-encoded UTF-8: not a lone surrogate)."""
    try:
        t.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["", "/{id}", "/{id}/events", "/{id}/plan", "/{id}/logs", "/{id}/progress",
                              "/{id}/resume-preview"]),
       job=st.one_of(st.sampled_from(["x", "0", "..", "%00", "%2F", "node[/x]"]), text.filter(bool).filter(_sendable)),
       query=st.dictionaries(st.sampled_from(["limit", "rank", "attempt", "offset", "since", "exclude"]),
                             st.one_of(st.integers(-(2 ** 70), 2 ** 70).map(str), text.filter(_sendable)), max_size=4))
def test_random_reads_are_answered_never_a_500(api, route, job, query) -> None:
    client, _ = api
    r = client.get("/api/jobs" + route.replace("{id}", quote(job, safe="")), params=query)  # (as any client sends it)
    _refusal_or_answer(r)


# --------------------------------------------------------------------------- the CLI

ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x9b31m"


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """A state dir with one real, finished job whose rank printed terminal control sequences."""
    state = tmp_path_factory.mktemp("fuzz-cli")
    hosts = state.parent / "fuzz-cli-hosts"
    hosts.write_text("node-0 slots=1\nnode-1 slots=1\n")
    controller = Controller(state)
    from orchestrator.spec import spec_from_dict
    job = controller.submit(spec_from_dict({"name": "esc", "hostfile": str(hosts), "entrypoint": str(SCRIPTS / "worker.py"),
                                            "env": {"WORKER_STEPS": "2", "WORKER_SAY": ESCAPES}}, source="test"))
    assert controller.wait(job.id, 120).state.value == "SUCCEEDED"
    controller.close()
    return state, job.id


def _cli(capsys, state_dir: Path, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = orch_main(["--state-dir", str(state_dir), *argv])
    except SystemExit as exit_:  # argparse's refusal of the command line
        code = exit_.code if isinstance(exit_.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def _clean(code: int, out: str, err: str) -> None:
    assert code in (0, 1, 2), (code, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, err[-3000:]
    assert "\x1b" not in out + err and "\x9b" not in out + err and "\x07" not in out + err, (out + err)[-2000:]


@pytest.mark.integration
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_orch_plan_of_random_specs_and_hostfiles_never_tracebacks(capsys, tmp_path_factory, state, data) -> None:
    work = tmp_path_factory.mktemp("plan")
    (work / "train.py").write_text("print('hi')\n")
    hosts = work / "hosts"
    hosts.write_text(data.draw(hostfile_text()), encoding="utf-8", errors="surrogatepass")
    spec = data.draw(spec_strategy(str(hosts)))
    form = data.draw(st.sampled_from(["yaml", "json"]))
    path = work / f"job.{form}"
    try:
        path.write_text(yaml.safe_dump(spec) if form == "yaml" else json.dumps(spec), encoding="utf-8",
                        errors="surrogatepass")
    except RecursionError:
        return  # (the dumper itself cannot write it)
    output = data.draw(st.sampled_from([[], ["--output", "json"]]))
    code, out, err = _cli(capsys, state[0], "plan", str(path), *output)
    event(f"exit {code}")
    _clean(code, out, err)


@pytest.mark.integration
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(["list", "status", "logs"]),
       job=st.one_of(st.just("REAL"), text.filter(lambda t: "\x00" not in t)),
       options=st.lists(st.tuples(st.sampled_from(["--limit", "--rank", "--attempt", "--offset", "--output"]),
                                  st.one_of(st.integers(-(2 ** 40), 2 ** 40).map(str), st.sampled_from(["json", "table"]),
                                            text.filter(lambda t: "\x00" not in t))), max_size=3))
def test_read_commands_with_random_arguments_never_traceback(capsys, state, command, job, options) -> None:
    state_dir, job_id = state
    argv = [command] + ([] if command == "list" else [job_id if job == "REAL" else job])
    for flag, value in options:
        if command == "list" and flag not in ("--limit", "--output"):
            continue
        if command == "status" and flag not in ("--output",):
            continue
        argv += [flag, value]
    _clean(*_cli(capsys, state_dir, *argv))


@pytest.mark.integration
def test_the_rank_s_escapes_are_in_its_log_file_and_not_on_the_terminal(capsys, state) -> None:
    state_dir, job_id = state
    code, out, err = _cli(capsys, state_dir, "logs", job_id, "--rank", "0")
    _clean(code, out, err)
    assert code == 0 and "worker rank 0" in out
    logs = list(Path(state_dir).rglob("rank-0.log"))
    assert logs and ESCAPES in logs[0].read_text()  # the file keeps the raw bytes
