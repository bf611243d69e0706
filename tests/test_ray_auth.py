"""A Ray cluster with token authentication on (Ray 2.60's ``RAY_AUTH_MODE=token``), as ``ray start
--head`` makes one by itself once ``~/.ray/auth_token`` exists: ``ray.address: auto`` finds it the
way ``ray status`` does (its nodes run with ``--temp-dir`` of their own, so Ray's default temp dir
does not name it), orch joins it with the token it finds, and without the token says that the
cluster wants one, at once, instead of Ray's 20 s of ``InvalidAuthToken`` and "Failed to connect".

Its own module: ``auto`` finds every cluster running on this machine, so no other test cluster
(``ray4`` of test_ray.py) may run beside this one: ``lone_ray`` ends the session's shared ones first.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, assert_no_leftovers
from test_ray_local import _ray_processes, _sessions

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("lone_ray")]  # the only Ray cluster here

WORKER = str(SCRIPTS / "worker.py")


def _env(home: Path) -> dict[str, str]:
    """The user's shell: no RAY_* variable (no address, no auth mode), the given HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({"HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"})
    return env


def test_auto_finds_a_token_cluster_and_joins_it_with_the_token(orch, write_spec, make_ray, tmp_path) -> None:
    token = secrets.token_hex(32)
    cluster = make_ray(1, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(token)  # where `ray get-auth-token --generate` puts it
    spec = write_spec(name="auth", provisioner="ray", ray={"address": "auto"}, entrypoint=WORKER,
                      stop_grace_seconds=2, env={"WORKER_STEPS": "2", "WORKER_STEP_S": "0.05"})
    before, sessions = _ray_processes(), _sessions()
    plan = orch.json("plan", str(spec), env=_env(home), replace_env=True)
    assert [n["host"] for n in plan["nodes"]] == [cluster.node_ip(0)], plan["nodes"]  # the head has no CPUs
    assert {pid for pid in _ray_processes() if pid not in before} == set()  # read, not joined
    assert _sessions() == sessions

    r = orch("run", str(spec), env=_env(home), replace_env=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "InvalidAuthToken" not in r.stderr
    (job,) = orch.json("list")
    detail = orch.json("status", job["id"])
    assert detail["state"] == "SUCCEEDED" and detail["nodes"] == [cluster.node_ip(0)]
    assert_no_leftovers(job["id"], timeout=5)

    # without the token: one clear error that names authentication and where a token is looked for
    t0 = time.monotonic()
    r = orch("run", str(spec), env=_env(tmp_path / "nobody"), replace_env=True, timeout=120)
    took = time.monotonic() - t0
    words = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"error: the Ray cluster at {cluster.address} requires token authentication, and orch has no token: " \
           "$RAY_AUTH_TOKEN and $RAY_AUTH_TOKEN_PATH are unset and ~/.ray/auth_token does not exist" in words, words
    assert "Traceback" not in r.stderr and r.stderr.count("InvalidAuthToken") <= 1, r.stderr
    print(f"\n[ray auth] a token cluster without the token: refused in {took:.2f} s, "
          f"{r.stderr.count('InvalidAuthToken')} line(s) of Ray's own")
    assert took < 15, f"the refusal took {took:.1f} s"
    assert [j["id"] for j in orch.json("list")] == [job["id"]]  # nothing was submitted

    # a token that is not the cluster's is named as such
    r = orch("plan", str(spec), env={**_env(tmp_path / "nobody"), "RAY_AUTH_TOKEN": "0" * 64}, replace_env=True)
    assert r.returncode == 2 and "refused the token orch sent (a token is in $RAY_AUTH_TOKEN)" in \
        " ".join(r.stderr.split()), r.stderr
