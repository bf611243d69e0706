"""orchestrator.observe.hints: the ``next:`` lines after a job stopped short, for each cause. Each is
also checked as the user sees it: test_e2e_local.py (cancel), test_ssh.py (a lost node, a refused
key on every host, a network that cannot work), test_preflight.py (every failing check)."""

from __future__ import annotations

from orchestrator.observe import next_steps


def _detail(state: str, cause: dict | None, nodes: tuple[str, ...] = ("w0", "w1", "w2")) -> dict:
    return {"id": "job-1", "state": state, "cause": cause, "attempts": [{"nodes": list(nodes)}]}


def test_nothing_to_do_for_a_job_that_runs_or_succeeded() -> None:
    assert next_steps(_detail("RUNNING", None)) == []
    assert next_steps(_detail("SUCCEEDED", None)) == []


def test_a_lost_node_is_left_out_of_the_resume() -> None:
    (step,) = next_steps(_detail("FAILED", {"kind": "node_lost", "node": "w1"}))
    assert step.startswith("resume without the lost node: orch resume job-1 --exclude w1 (a spare host")
    # a root cause found at teardown names every node that fell silent
    (step,) = next_steps(_detail("FAILED", {"kind": "node_lost", "node": "w1", "nodes": ["w1", "w2"]}))
    assert "orch resume job-1 --exclude w1,w2 " in step


def test_nodes_that_could_not_be_set_up_are_fixed_or_left_out_first() -> None:
    cause = {"kind": "provision_failed", "nodes": [{"node": "w0"}, {"node": "w2"}]}
    fix, leave = next_steps(_detail("FAILED", cause))
    assert fix.startswith("fix the node(s) first") and fix.endswith("then: orch resume job-1")
    assert leave == "or leave them out: orch resume job-1 --exclude w0,w2"


def _preflight(*failures: tuple[str, str]) -> dict:
    return _detail("FAILED", {"kind": "preflight_failed",
                              "failures": [{"node": n, "check": c} for n, c in failures]})


def test_a_spec_that_is_wrong_on_every_node_gets_no_resume_hint() -> None:
    steps = next_steps(_preflight(("w0", "entrypoint"), ("w1", "entrypoint"), ("w2", "entrypoint")))
    assert steps == ["fix the spec (entrypoint failed on every node) and run it again as a new job: orch run SPEC; "
                     "a resume would run the job's stored spec and fail the same way"]


def test_a_spec_check_failing_on_some_nodes_is_those_nodes_problem() -> None:
    (step,) = next_steps(_preflight(("w1", "workdir")))
    assert step == "fix workdir on the nodes named above, then: orch resume job-1"


def test_both_at_once_say_both_and_no_resume() -> None:
    steps = next_steps(_preflight(*[(n, "python") for n in ("w0", "w1", "w2")], ("w2", "deepspeed")))
    assert steps[0].startswith("fix the spec (python failed on every node)")
    assert steps[1] == "and fix deepspeed on the nodes named above"
    assert not any("orch resume" in s for s in steps)


def test_a_start_up_deadline_says_what_to_free_and_when_to_turn_it_off() -> None:
    (step,) = next_steps(_detail("FAILED", {"kind": "startup_timeout"}))
    assert "then: orch resume job-1" in step and "startup_timeout: null" in step
    (step,) = next_steps(_detail("FAILED", {"kind": "store_full"}))
    assert step == "free space on the state directory's disk (the cause names it), then: orch resume job-1"


def test_other_failures_and_cancels_resume_from_the_last_checkpoint() -> None:
    for kind in ("rank_exit", "no_progress", "agent_stopped", "controller_stalled", "controller_lost", "internal_error"):
        (step,) = next_steps(_detail("FAILED", {"kind": kind}))
        assert step.startswith("resume from the last complete checkpoint: orch resume job-1"), kind
    (step,) = next_steps(_detail("CANCELLED", {"kind": "cancelled"}))
    assert step == "resume it from its last complete checkpoint: orch resume job-1"


def test_a_gpu_fault_leaves_its_node_out_of_the_resume_and_says_to_check_it() -> None:
    (step,) = next_steps(_detail("FAILED", {"kind": "gpu_fault", "node": "w2", "gpu": "0000:17:00.0", "xid": 79}))
    assert step.startswith("resume without the node whose GPU failed: orch resume job-1 --exclude w2 ")
    assert "orch doctor SPEC before using w2 again" in step
