"""agents/cgroups.py on this machine's real cgroup v2 hierarchy: a rank's whole process tree, sessions and
environments notwithstanding, is killed by its attempt's cgroup; the sweep finds it from its record."""

from __future__ import annotations

import os
import sys
import time
import uuid

import psutil
import pytest

from agents.cgroups import AttemptCgroup, own_cgroup, sweep, v2_root
from agents.ranks import RankProcess

# a tree: the rank, a child in a new session with no environment, and that child's own child
TREE = ("import subprocess, sys, time\n"
        "code = 'import subprocess, sys, time; subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(600)\"]);"
        " time.sleep(600)'\n"
        "subprocess.Popen([sys.executable, '-c', code], start_new_session=True, env={})\n"
        "time.sleep(600)\n")


ATTEMPT = f"cgroup-test-{uuid.uuid4().hex[:8]}.1"


@pytest.fixture
def cgroup():
    assert v2_root() is not None, "these tests need a cgroup v2 hierarchy"
    cg, why = AttemptCgroup.create(ATTEMPT, 0)
    assert cg is not None, why
    yield cg
    cg.kill()


def _tree(cg: AttemptCgroup, tmp_path) -> RankProcess:
    rank = RankProcess(0, [sys.executable, "-c", TREE], {"PATH": os.environ["PATH"]}, str(tmp_path),
                       str(tmp_path / "rank.log"), cgroup=cg)
    rank.start()
    deadline = time.monotonic() + 20
    while len(cg.pids()) < 3:
        assert time.monotonic() < deadline, f"the tree did not start: {cg.pids()}"
        time.sleep(0.05)
    return rank


@pytest.mark.integration
def test_kill_ends_the_whole_tree_and_removes_the_cgroup(cgroup, tmp_path) -> None:
    rank = _tree(cgroup, tmp_path)
    pids = cgroup.pids()
    assert rank.pid in pids and len(pids) == 3
    assert any(psutil.Process(p).environ() == {} for p in pids if p != rank.pid)  # no marker on it
    killed = cgroup.kill()
    assert sorted(killed) == sorted(pids)
    rank.wait(5)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert not os.path.exists(cgroup.path)


@pytest.mark.integration
def test_the_sweep_finds_a_cgroup_by_its_record(cgroup, tmp_path) -> None:
    rank = _tree(cgroup, tmp_path)
    assert sweep("some-other-job.1", [0]) == [] and sweep(ATTEMPT, [1]) == []  # nothing recorded for those
    pids = cgroup.pids()
    killed = sweep(ATTEMPT, [0])  # (as python -m agents.sweep does once the agent was SIGKILLed)
    assert sorted(killed) == sorted(pids) and not os.path.exists(cgroup.path)
    assert sweep(ATTEMPT, [0]) == []  # its record went with it
    rank.wait(5)


def test_no_hierarchy_says_why(tmp_path, monkeypatch) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("proc /proc proc rw 0 0\n")
    assert v2_root(str(mounts)) is None
    monkeypatch.setattr("agents.cgroups.v2_root", lambda: None)
    cg, why = AttemptCgroup.create("x.1", 0)
    assert cg is None and why == "this node has no cgroup v2 hierarchy"
    assert own_cgroup(str(tmp_path / "missing")) is None
