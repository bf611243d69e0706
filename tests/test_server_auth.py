"""``orch server`` lets no one else in: the token on every route, the dashboard's login, the Host allowlist,
the binding rules and the audit log, over real HTTP against a real server process (docs/security.md).

The routes are walked from the app itself (every route FastAPI and the static mount serve), not listed by
hand; another Unix user is played by ``runuser -u nobody``.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import Orch, running_server, wait_for

from orchestrator.face.cli.server import SHUTDOWN_S

pytestmark = pytest.mark.integration

NOBODY_POST = """
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1] + "/api/jobs", data=b'{"spec": {"name": "x", "entrypoint": "/bin/id"}}',
                             headers={"Content-Type": "application/json"}, method="POST")
try:
    urllib.request.urlopen(req, timeout=10)
    print("accepted")
except urllib.error.HTTPError as err:
    print(err.code, err.read().decode())
"""


@pytest.fixture()
def open_state(tmp_path):
    """A state dir other users may enter (0755 all the way), so only the files' own modes protect them."""
    root = Path(tempfile.mkdtemp(prefix="orch-auth-", dir="/tmp"))
    root.chmod(0o755)
    state = root / "state"
    state.mkdir(mode=0o755)
    yield Orch(state)
    subprocess.run(["rm", "-rf", str(root)], check=False)


def _routes() -> list[tuple[str, str]]:
    """Every (method, path) the server's app serves, path parameters filled in."""
    from starlette.routing import Mount

    from orchestrator.face.api import create_app
    from orchestrator.supervision import Controller
    controller = Controller(Path(tempfile.mkdtemp(prefix="orch-walk-")))
    try:
        app = create_app(controller, "t", ["127.0.0.1"])
        out = []

        def walk(routes) -> None:
            for route in routes:
                if hasattr(route, "original_router"):  # an included router (no prefix in orch's app)
                    walk(route.original_router.routes)
                elif isinstance(route, Mount):
                    out.append(("GET", f"{route.path}/app.js"))
                else:
                    path = re.sub(r"\{[^}]+\}", "nope", route.path)
                    out.extend((m, path) for m in sorted(route.methods or {"GET"}) if m != "HEAD")
        walk(app.routes)
        return out
    finally:
        controller.close()


def test_every_route_needs_the_token(open_state) -> None:
    orch = open_state
    routes = _routes()
    assert ("POST", "/api/jobs") in routes and ("GET", "/static/app.js") in routes and ("GET", "/docs") in routes
    with running_server(orch) as (proc, url):
        token = orch.token()
        good = {"Authorization": f"Bearer {token}"}
        for method, path in routes:
            bare = httpx.request(method, url + path)
            wrong = httpx.request(method, url + path, headers={"Authorization": "Bearer " + "x" * len(token)})
            cookie = httpx.request(method, url + path, headers={"Cookie": "orch_session=forged"})
            right = httpx.request(method, url + path, headers=good)
            if path == "/metrics":  # open to Prometheus: counts only (docs/security.md)
                assert bare.status_code == 200 and "orch_jobs" in bare.text
                continue
            if path == "/login":
                assert bare.status_code == wrong.status_code == 401
                continue
            for r in (bare, wrong, cookie):
                assert r.status_code == 401 and r.text == "unauthorized\n", (method, path, r.status_code, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
            assert right.status_code != 401, (method, path)
        # the dashboard's login: the printed URL sets an HttpOnly, SameSite=Strict cookie (not the token)
        assert proc.login_url == f"{url}/login?token={token}"
        login = httpx.get(proc.login_url)
        assert login.status_code == 303 and login.headers["location"] == "/"
        set_cookie = login.headers["set-cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie and token not in set_cookie
        session = set_cookie.split(";")[0]
        assert httpx.get(f"{url}/api/jobs", headers={"Cookie": session}).status_code == 200
        assert httpx.get(f"{url}/login?token=wrong").status_code == 401


def test_another_user_can_neither_read_the_token_nor_submit(open_state) -> None:
    orch = open_state
    with running_server(orch) as (_, url):
        token_file = orch.state_dir / "server.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        read = subprocess.run(["runuser", "-u", "nobody", "--", "cat", str(token_file)], capture_output=True, text=True)
        assert read.returncode != 0 and "Permission denied" in read.stderr and orch.token() not in read.stdout
        post = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", NOBODY_POST, url],
                              capture_output=True, text=True, timeout=30)
        assert post.stdout.strip() == "401 unauthorized", post.stdout + post.stderr
        # the CLI, as root, reads the token from the state dir and is let in
        r = orch("list")
        assert r.returncode == 0, r.stderr
        r = orch("list", env={"ORCH_TOKEN": "not-the-token"})
        assert r.returncode == 2 and "refused the token" in r.stderr and "Traceback" not in r.stderr
        assert orch.http().post(f"{url}/api/jobs/nope/cancel").status_code == 404  # let in, and audited
        audit = orch.state_dir / "audit.log"
        assert stat.S_IMODE(audit.stat().st_mode) == 0o600
        entries = [json.loads(line) for line in audit.read_text().splitlines()]
        refused = [e for e in entries if e["user"] == "nobody"]
        assert refused and refused[0]["method"] == "POST" and refused[0]["path"] == "/api/jobs" and \
            refused[0]["status"] == 401 and refused[0]["authorized"] is False, entries
        mine = [e for e in entries if e["path"] == "/api/jobs/nope/cancel"]
        assert mine and mine[0]["user"] == "root" and mine[0]["job"] == "nope" and mine[0]["status"] == 404 \
            and mine[0]["authorized"] is True, entries
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", e["client"]) for e in entries)


def test_a_foreign_host_header_is_refused(orch) -> None:
    with running_server(orch, "--allowed-host", "orch.example.org") as (_, url):
        good = {"Authorization": f"Bearer {orch.token()}"}
        evil = httpx.get(f"{url}/api/jobs", headers={**good, "Host": "evil.example"})
        assert evil.status_code == 400
        posted = httpx.post(f"{url}/api/jobs/x/cancel", headers={"Host": "evil.example"})
        assert posted.status_code == 401  # refused, and audited
        audit = [json.loads(line) for line in (orch.state_dir / "audit.log").read_text().splitlines()]
        assert audit[-1]["path"] == "/api/jobs/x/cancel" and audit[-1]["status"] == 401
        alias = httpx.get(f"{url}/api/jobs", headers={**good, "Host": "orch.example.org"})
        assert alias.status_code == 200
        assert httpx.get(f"{url}/api/jobs", headers=good).status_code == 200  # 127.0.0.1 itself


def test_request_bodies_are_capped_and_submits_audited_with_their_job(orch, write_spec, hostfile) -> None:
    """A body over 8 MiB is 413 whether it gives its length or is chunked, a spec nested past the cap is a
    400 naming it, a body that is not JSON is the API's own error shape; a submit's audit entry names the
    job it made."""
    with running_server(orch) as (proc, url):
        client, good = orch.http(), {"Authorization": f"Bearer {orch.token()}", "Content-Type": "application/json"}
        big = b'{"spec": "' + b"a" * (9 << 20) + b'"}'
        sized = client.post(f"{url}/api/jobs", content=big)
        assert sized.status_code == 413 and "larger than 8 MiB" in sized.json()["error"], sized.text

        def chunks():
            for i in range(0, len(big), 1 << 16):
                yield big[i:i + (1 << 16)]
        chunked = httpx.post(f"{url}/api/jobs", content=chunks(), headers=good, timeout=30)
        assert chunked.status_code == 413 and chunked.json()["kind"] == "RequestTooLarge"
        deep = client.post(f"{url}/api/jobs", content=b'{"spec": {"name": "x", "env": ' + b'{"a": ' * 100 + b'1'
                           + b'}' * 102, headers={"Content-Type": "application/json"})
        assert deep.status_code == 400 and "nests deeper than 64 levels" in deep.json()["error"], deep.text
        junk = client.post(f"{url}/api/jobs", content=b"\x00\xff junk", headers={"Content-Type": "application/json"})
        assert junk.status_code == 400 and set(junk.json()) == {"error", "kind"}, junk.text
        assert proc.poll() is None and client.get(f"{url}/api/health").status_code == 200
        spec = write_spec(name="audited", hostfile=str(hostfile("a slots=1\n")), entrypoint="/bin/true",
                          no_python=True)
        job = orch.json("submit", str(spec))["id"]
        orch("cancel", job, "--wait", "30")
    entries = [json.loads(line) for line in (orch.state_dir / "audit.log").read_text().splitlines()]
    submits = [e for e in entries if e["action"] == "submit" and e["status"] == 200]
    assert [e["job"] for e in submits] == [job], entries
    assert [e["job"] for e in entries if e["action"] == "cancel"] == [job]
    assert [e["status"] for e in entries if e["action"] == "submit"] == [413, 413, 400, 400, 200]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_off_loopback_needs_tls_or_an_explicit_insecure_http(orch, tmp_path) -> None:
    r = orch("server", "--host", "0.0.0.0", "--port", str(_free_port()), timeout=30)
    assert r.returncode == 2 and "--tls-cert FILE --tls-key FILE" in r.stderr and "--insecure-http" in r.stderr
    assert "Traceback" not in r.stderr and not (orch.state_dir / "server.json").exists()
    r = orch("server", "--tls-cert", str(tmp_path / "nope.pem"), timeout=30)
    assert r.returncode == 2 and "go together" in r.stderr
    r = orch("server", "--tls-cert", "/etc/hostname", "--tls-key", "/etc/shadow", "--port", str(_free_port()),
             timeout=30)
    assert r.returncode == 2 and "Cannot serve TLS" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "dashboard:" not in r.stderr and "root:" not in r.stderr
    port = _free_port()
    proc = orch.popen("server", "--host", "0.0.0.0", "--port", str(port), "--insecure-http")
    try:
        line = proc.stderr.readline()
        assert line.startswith("WARNING: serving plain HTTP on 0.0.0.0"), line
        wait_for(lambda: _status(f"http://127.0.0.1:{port}/api/jobs", orch) == 200, 30, "the server")
    finally:
        proc.terminate()
        proc.wait(60)


def _status(url: str, orch: Orch, **kw) -> int:
    try:
        return httpx.get(url, headers={"Authorization": f"Bearer {orch.token()}"}, timeout=2, **kw).status_code
    except (httpx.HTTPError, OSError):
        return 0


def test_tls_serves_https_and_the_cli_verifies_it(orch, tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=orch-test",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = _free_port()
    proc = orch.popen("server", "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        url = f"https://127.0.0.1:{port}"
        trust = ssl.create_default_context(cafile=str(cert))
        wait_for(lambda: _status(f"{url}/api/jobs", orch, verify=trust) == 200, 30, "the HTTPS server")
        with pytest.raises(httpx.ConnectError):  # not trusted without its certificate
            httpx.get(f"{url}/api/health", timeout=5)
        assert orch("list", env={"SSL_CERT_FILE": str(cert)}).returncode == 0
        login = httpx.get(f"{url}/login?token={orch.token()}", verify=trust)
        assert "Secure" in login.headers["set-cookie"]
        assert json.loads((orch.state_dir / "server.json").read_text())["url"] == f"https://127.0.0.1:{port}"
        # a client that keeps its keep-alive connection open (and never answers the TLS close) does not hold the
        # stopping server past its shutdown deadline (asyncio's TLS shutdown alone would wait 30 s)
        idle = httpx.Client(verify=trust, headers={"Authorization": f"Bearer {orch.token()}"})
        assert idle.get(f"{url}/api/jobs").status_code == 200
        t0 = time.monotonic()
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    stop_s = time.monotonic() - t0
    idle.close()
    assert proc.returncode == 0 and stop_s < SHUTDOWN_S + 10, (proc.returncode, stop_s, err[-2000:])
    assert f"dashboard: https://127.0.0.1:{port}/login?token=" in err, err
    assert "Traceback" not in err and "uvicorn" not in err.lower(), err[-3000:]
    # (the test's own client, and any the in-process orch list left for its garbage collection)
    assert re.search(rf"orch server stopping: [1-9]\d* client connection\(s\) still open after {SHUTDOWN_S:g} s "
                     r"are closed", err), err[-3000:]


def test_the_token_file_keeps_its_mode_and_the_cli_takes_another(orch, tmp_path) -> None:
    token_file = orch.state_dir / "server.token"
    token_file.write_text("my-own-token\n")
    token_file.chmod(0o644)  # from before: fixed at start
    with running_server(orch) as (_, url):
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and orch.token() == "my-own-token"
        other = tmp_path / "elsewhere.token"
        other.write_text("my-own-token\n")
        env = {"ORCH_STATE_DIR": str(tmp_path / "empty")}  # no token there: only --token-file has it
        r = orch("--server", url, "--token-file", str(other), "list", env=env)
        assert r.returncode == 0, r.stderr
        r = orch("--server", url, "--token-file", str(tmp_path / "missing"), "list", env=env)
        assert r.returncode == 2 and "Cannot read the token file" in r.stderr
        with open("/etc/shadow") as f:
            shadow = f.read()
        for extra, env2 in ((["--token-file", "/etc/shadow"], env), (["--token-file", "/dev/zero"], env),
                            ([], {**env, "ORCH_TOKEN": "line one\nline two"})):
            r = orch("--server", url, *extra, "list", env=env2, timeout=30)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            assert shadow.split(":")[0] + ":" not in r.stderr and "line two" not in r.stderr, r.stderr
        r = orch("--server", url, "list", env=env)  # no token anywhere
        assert r.returncode == 2 and "needs its token, and none was found" in r.stderr, r.stderr


def test_the_dashboard_logs_in_through_the_printed_url(orch, browser) -> None:
    with running_server(orch) as (proc, url):
        browser.delete_all_cookies()
        browser.get(f"{url}/")
        assert "unauthorized" in browser.page_source and "jobs-table" not in browser.page_source
        browser.get(proc.login_url)
        assert browser.current_url == f"{url}/"
        wait_for(lambda: browser.find_element("id", "updated").text.startswith("updated "), 10, "the first refresh")
        cookie = browser.get_cookie("orch_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and orch.token() not in cookie["value"]
        assert browser.execute_script("return document.cookie") == ""  # not readable by the page's scripts
        browser.delete_cookie("orch_session")  # as when the token is rotated: the page says so
        wait_for(lambda: browser.find_element("id", "logged-out").is_displayed(), 10, "the logged-out notice")
        assert not browser.find_element("id", "conn-lost").is_displayed()
        browser.get(proc.login_url)
        wait_for(lambda: not browser.find_element("id", "logged-out").is_displayed(), 10, "logged in again")


def test_every_file_orch_creates_is_private(open_state, write_spec, hostfile) -> None:
    """A job through ``orch server`` and one through ``orch run``: every file and directory orch writes in
    the state directory (store, plans, configs, agent and rank logs, token, audit log) is 0600/0700, and
    what an older orch left readable is fixed at the server's start; only Prometheus' targets stay
    readable (0644), for a Prometheus running as its own user."""
    from conftest import SCRIPTS
    orch = open_state
    old = orch.state_dir / "jobs" / "from-before" / "attempt-1"
    old.mkdir(parents=True, mode=0o755)
    (old / "plan.json").write_text("{}")
    (old / "plan.json").chmod(0o644)
    spec = write_spec(name="perm", hostfile=str(hostfile("a slots=1\nb slots=1\n")), entrypoint=str(SCRIPTS / "worker.py"),
                      env={"WORKER_STEPS": "3", "WORKER_STEP_S": "0.01"}, deepspeed_config={"train_batch_size": 2})
    with running_server(orch) as (_, url):
        job = orch.json("submit", str(spec))["id"]
        wait_for(lambda: orch.json("status", job)["state"] == "SUCCEEDED", 60, "SUCCEEDED")
        orch.http().post(f"{url}/api/jobs/nope/cancel")  # an audited request
    r = orch("run", str(spec))
    assert r.returncode == 0, r.stderr
    targets = orch.state_dir / "prometheus" / "targets"
    seen, loose = 0, []
    for top, dirs, files in os.walk(orch.state_dir):
        for name in dirs + files:
            path = Path(top) / name
            mode = stat.S_IMODE(path.lstat().st_mode)
            seen += 1
            if path == targets or targets in path.parents:
                assert mode in (0o755, 0o644), (path, oct(mode))
            elif mode & 0o077:
                loose.append(f"{path} {oct(mode)}")
    assert stat.S_IMODE(orch.state_dir.stat().st_mode) == 0o700
    assert not loose, loose
    names = {p.name for p in orch.state_dir.rglob("*")}
    assert {"orch.db", "server.token", "audit.log", "plan.json", "ds_config.json", "rank-0.log",
            "node-0.log"} <= names, sorted(names)
    assert seen > 20
