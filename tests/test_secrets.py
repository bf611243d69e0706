"""A job with secrets in its ``env`` (``HF_TOKEN``, and ``MY_DB_PASS`` named by ``secret_env``): every rank
gets the real values, and they appear nowhere orch shows them (``orch plan``, every API response, the
dashboard's page, ``/metrics``, events, orch's and the ranks' logs), nor in any file under the state
directory that is not 0600 (every file grepped). docs/security.md."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from pathlib import Path

import pytest
from conftest import running_server, wait_for

pytestmark = pytest.mark.integration

SCRIPT = """import hashlib, os, pathlib
out = pathlib.Path(os.environ["OUT_DIR"]) / f"rank{os.environ['RANK']}"
out.write_text(" ".join(hashlib.sha256(os.environ[k].encode()).hexdigest() for k in ("HF_TOKEN", "MY_DB_PASS")))
print("step=1 loss=1.0", flush=True)
"""


def test_secret_values_reach_the_ranks_and_nothing_else(orch, write_spec, hostfile, tmp_path, browser) -> None:
    token, password = "hf_" + secrets.token_hex(12), "pw-" + secrets.token_hex(12)
    script = tmp_path / "tok.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    spec = write_spec(name="secret", hostfile=str(hostfile("a slots=1\nb slots=1\n")), entrypoint=str(script),
                      launcher="openmpi", env={"HF_TOKEN": token, "MY_DB_PASS": password, "OUT_DIR": str(out)},
                      secret_env=["MY_DB_*"])
    shown: dict[str, str] = {}
    plan = orch("plan", str(spec))
    assert plan.returncode == 0, plan.stderr
    shown["orch plan"] = plan.stdout + plan.stderr
    shown["orch plan -o json"] = orch("plan", str(spec), "-o", "json").stdout
    assert "HF_TOKEN=****" in shown["orch plan"] and "MY_DB_PASS=****" in shown["orch plan"]
    with running_server(orch) as (proc, url):
        job = orch.json("submit", str(spec))["id"]
        wait_for(lambda: orch.json("status", job)["state"] == "SUCCEEDED", 90, "SUCCEEDED")
        http = orch.http()
        for path in ("/api/jobs", f"/api/jobs/{job}", f"/api/jobs/{job}/plan", f"/api/jobs/{job}/events",
                     f"/api/jobs/{job}/logs?rank=0", f"/api/jobs/{job}/logs?rank=1", f"/api/jobs/{job}/progress",
                     "/api/health", "/metrics"):
            r = http.get(url + path)
            assert r.status_code == 200, path
            shown[path] = r.text
        assert json.loads(shown[f"/api/jobs/{job}"])["spec"]["env"]["HF_TOKEN"] == "****"
        browser.get(proc.login_url)
        browser.get(f"{url}/#/jobs/{job}")
        wait_for(lambda: browser.execute_script("const h = document.querySelector('#job-header'); "
                                                "return h && h.dataset.state") == "SUCCEEDED", 15, "the job's page")
        shown["the dashboard"] = browser.page_source
    shown["orch status -o json"] = orch("status", job, "-o", "json").stdout
    shown["events"] = json.dumps([e.to_dict() for e in orch.events(job)])
    detail = json.loads(shown["orch status -o json"])
    run_dir = Path(detail["run_dir"])
    for log in [*run_dir.rglob("*.log"), *run_dir.glob("**/controller.log")]:
        shown[str(log)] = log.read_text(errors="replace")
    leaks = [where for where, text in shown.items() if token in text or password in text]
    assert not leaks, leaks
    # the ranks got the real values
    want = " ".join(hashlib.sha256(v.encode()).hexdigest() for v in (token, password))
    assert [(out / f"rank{r}").read_text() for r in (0, 1)] == [want, want]
    # every file under the state directory holding them is private to its owner
    holding = []
    for top, _, files in os.walk(orch.state_dir):
        for name in files:
            path = Path(top) / name
            data = path.read_bytes()
            if token.encode() in data or password.encode() in data:
                holding.append(path)
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert holding  # the store and the plan keep them (a resume needs them), 0600
    print(f"\n[secrets] values kept only in {sorted(p.name for p in holding)} (0600); masked in {len(shown)} outputs")


def test_env_from_file_is_read_on_the_node_and_never_stored(orch, write_spec, hostfile, tmp_path) -> None:
    value = "wandb-" + secrets.token_hex(16)
    key_file = tmp_path / "wandb.key"
    key_file.write_text(value + "\n")
    key_file.chmod(0o600)
    script = tmp_path / "tok.py"
    script.write_text(SCRIPT.replace('("HF_TOKEN", "MY_DB_PASS")', '("WANDB_API_KEY",)'))
    out = tmp_path / "out"
    out.mkdir()
    spec = write_spec(name="fromfile", hostfile=str(hostfile("a slots=1\nb slots=1\n")), entrypoint=str(script),
                      env={"OUT_DIR": str(out)}, env_from_file={"WANDB_API_KEY": str(key_file)})
    plan = orch("plan", str(spec))
    assert plan.returncode == 0 and f"WANDB_API_KEY from {key_file}" in plan.stdout, plan.stdout + plan.stderr
    r = orch("run", str(spec), "-o", "json")
    assert r.returncode == 0, r.stderr[-2000:]
    want = hashlib.sha256(value.encode()).hexdigest()
    assert [(out / f"rank{n}").read_text() for n in (0, 1)] == [want, want]
    for top, _, files in os.walk(orch.state_dir):  # not even the 0600 store holds it
        for name in files:
            assert value.encode() not in (Path(top) / name).read_bytes(), Path(top) / name
    assert value not in plan.stdout + r.stdout + r.stderr
    # a file the node cannot read: the attempt fails naming the variable and the path, not a traceback
    bad = write_spec(name="nofile", hostfile=str(hostfile("a slots=1\n")), entrypoint=str(script),
                     env={"OUT_DIR": str(out)}, env_from_file={"WANDB_API_KEY": str(tmp_path / "missing.key")})
    r = orch("run", str(bad), "-o", "json")
    cause = json.loads(r.stdout)["cause"]
    assert r.returncode == 1 and cause["kind"] == "spawn_failed", cause
    assert f"env_from_file WANDB_API_KEY: cannot read {tmp_path / 'missing.key'}" in cause["message"], cause
