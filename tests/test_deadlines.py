"""The deadlines of a running attempt (orchestrator.supervision.watches.ProgressWatch) over an injected
clock, and what a rank's stacks say it is doing (agents.stacks.summarize, over real py-spy dumps of
real processes). The deadlines on real jobs: tests/test_hang.py and tests/test_faults.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from agents.stacks import dump_all, process_state, summarize
from conftest import wait_for
from orchestrator.supervision.watches import ProgressWatch


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _watch(hang="auto", startup=None, floor=30.0, stall_gap=1e9):
    """A watch over 2 ranks; the clock jumps between looks here, so the controller-stall allowance is off
    unless ``stall_gap`` is given."""
    clock = Clock()
    w = ProgressWatch(hang, "/run", startup_timeout=startup, floor_s=floor, clock=clock)
    w.STALL_GAP_S = stall_gap
    w.watch([0, 1])
    return w, clock


def _steps(w, clock, upto, gap, ranks=(0, 1), start=1):
    for step in range(start, upto + 1):
        clock.t += gap
        w.record([(r, {"step": step}) for r in ranks])


def _passes_at(w, clock, seconds, exited=frozenset()):
    """Nothing passed 1 s before ``seconds`` from now; the cause 1 s after (None if still nothing)."""
    clock.t += seconds - 1
    assert w.stalled(set(exited)) is None
    clock.t += 2
    return w.stalled(set(exited))


def _dumped(w, summaries):
    w.dumped(0, {"files": {}, "summaries": summaries})
    return w.due()


def test_startup_deadline_passes_only_before_any_step() -> None:
    w, clock = _watch(startup=60)
    cause = _passes_at(w, clock, 60)
    assert cause["kind"] == "startup_timeout" and cause["ranks"] == [0, 1]
    assert "no rank reported a first step within 60 s (startup_timeout)" in cause["message"]
    w2, clock2 = _watch(startup=60)
    clock2.t += 30
    w2.record([(0, {"step": 0})])  # DeepSpeed's rank 0 says step=0 at initialize
    assert _passes_at(w2, clock2, 60)["kind"] == "no_progress"  # until a gap is seen, auto waits start-up's 60 s
    w3, clock3 = _watch(startup=None)
    clock3.t += 10 ** 6
    assert w3.stalled(set()) is None


def test_auto_timeout_is_ten_times_the_longest_gap_never_under_the_floor() -> None:
    w, clock = _watch(floor=30.0)
    _steps(w, clock, 5, gap=1.0)
    assert w.timeout() == 30.0
    _steps(w, clock, 8, gap=5.0, start=6)
    assert w.timeout() == 50.0
    cause = _passes_at(w, clock, 50)
    assert cause["kind"] == "no_progress" and cause["ranks"] == [0, 1]
    assert "no rank passed step 8 for 50 s (hang_timeout auto)" in cause["message"]


def test_auto_watches_only_ranks_that_stepped() -> None:
    """A DeepSpeed script that prints step= on rank 0 only: rank 1 never reports, and is not a hang."""
    w, clock = _watch(floor=10.0)
    _steps(w, clock, 20, gap=0.5, ranks=(0,))
    clock.t += 9
    assert w.stalled(set()) is None
    explicit, clock2 = _watch(hang=10.0)
    _steps(explicit, clock2, 20, gap=0.5, ranks=(0,))
    clock2.t += 11
    assert explicit.stalled(set())["ranks"] == [1]  # a number watches every rank once any stepped


def test_a_rank_that_exited_zero_or_said_final_is_not_a_hang() -> None:
    w, clock = _watch(hang=2.0)
    _steps(w, clock, 60, gap=0.1)
    w.ended(0, 0)
    clock.t += 100
    assert w.stalled({0}) is None
    w2, clock2 = _watch(hang=2.0)
    _steps(w2, clock2, 59, gap=0.1)
    clock2.t += 0.1
    w2.record([(0, {"step": 60, "final": 1.0}), (1, {"step": 60, "final": 1.0})])
    clock2.t += 100
    assert w2.stalled(set()) is None


def test_a_rank_is_finished_once_it_reported_its_final_step_or_its_total() -> None:
    """What an exit after the last step is told by (supervision/messages.py: 'after its last step')."""
    w, clock = _watch(hang=2.0)
    assert w.finished_at(0) is None  # nothing reported
    w.record([(0, {"step": 4, "total_steps": 5.0}), (1, {"step": 5, "total_steps": 5.0})])
    assert w.finished_at(0) is None and w.finished_at(1) == (5, 5)  # (the agent passes numbers on as floats)
    w.record([(0, {"step": 7, "final": True})])  # final says so whatever the total
    assert w.finished_at(0) == (7, 5)
    w2, _ = _watch(hang=2.0)
    w2.record([(0, {"step": 9}), (1, {"step": 3, "total_steps": True})])  # no total, or not a number
    assert w2.finished_at(0) is None and w2.finished_at(1) is None


def test_ranks_still_running_long_after_one_finished_are_named() -> None:
    w, clock = _watch(hang=2.0)
    _steps(w, clock, 10, gap=0.1)
    w.ended(0, 0)
    cause = _passes_at(w, clock, ProgressWatch.GRACE_S, exited={0})
    assert cause["kind"] == "no_progress" and cause["ranks"] == [1] and cause["finishing"]
    assert "rank(s) 1 still running 300 s after rank 0 exited 0" in cause["message"]
    w.await_stacks(cause, [0])
    verdict, data = _dumped(w, {"1": {"kind": "saving", "doing": "saving a checkpoint", "where": "save (s.py:1)"}})
    assert verdict == "dismissed"  # a final save on the last rank gets its time
    clock.t += ProgressWatch.GRACE_S + 1
    cause = w.stalled({0})
    w.await_stacks(cause, [0])
    verdict, cause = _dumped(w, {"1": {"kind": "exiting", "doing": "exiting", "where": "barrier (x.py:1)"}})
    assert verdict == "fail" and "rank 1: exiting, at barrier (x.py:1)" in cause["message"]
    off, clock2 = _watch(hang=None)
    _steps(off, clock2, 10, gap=0.1)
    off.ended(0, 0)
    clock2.t += 10 ** 6
    assert off.stalled({0}) is None  # hang_timeout null: never


def test_a_rank_found_exiting_gets_more_time_once_then_fails() -> None:
    w, clock = _watch(hang=2.0)
    _steps(w, clock, 10, gap=0.1)
    clock.t += 3
    cause = w.stalled(set())
    w.await_stacks(cause, [0])
    exiting = {"kind": "exiting", "doing": "exiting", "where": "upload (train.py:3)"}
    verdict, data = _dumped(w, {"0": exiting, "1": exiting})
    assert verdict == "dismissed" and data["more_seconds"] == ProgressWatch.GRACE_S
    cause = _passes_at(w, clock, ProgressWatch.GRACE_S)
    w.await_stacks(cause, [0])
    verdict, cause = _dumped(w, {"0": exiting, "1": exiting})
    assert verdict == "fail" and "rank 0: exiting, at upload (train.py:3)" in cause["message"]


def test_a_stuck_rank_is_named_with_what_it_is_stuck_in() -> None:
    w, clock = _watch(hang=2.0)
    _steps(w, clock, 30, gap=0.1)
    clock.t += 3
    cause = w.stalled(set())
    w.await_stacks(cause, [0, 1])
    w.dumped(0, {"files": {"0": "/run/logs/rank-0.stacks.txt"},
                 "summaries": {"0": {"kind": "stuck", "doing": "in a collective (waiting for the other ranks)",
                                     "where": "all_reduce (distributed_c10d.py:2501)"}}})
    assert w.due() is None  # node 1 has not answered
    w.dumped(1, {"files": {"1": "/run/logs/rank-1.stacks.txt"},
                 "summaries": {"1": {"kind": None, "doing": None, "where": "hang_forever (train_gpt.py:88)"}}})
    verdict, cause = w.due()
    assert verdict == "fail" and cause["stacks"] == {"0": "/run/logs/rank-0.stacks.txt", "1": "/run/logs/rank-1.stacks.txt"}
    assert ("(rank 0: in a collective (waiting for the other ranks), at all_reduce (distributed_c10d.py:2501); "
            "rank 1: in hang_forever (train_gpt.py:88)); stacks of every rank in /run/logs") in cause["message"]


def test_the_controllers_own_stall_is_not_a_hang() -> None:
    w, clock = _watch(hang=2.0, stall_gap=ProgressWatch.STALL_GAP_S)
    _steps(w, clock, 5, gap=0.1)
    assert w.stalled(set()) is None
    clock.t += 20  # the controller was SIGSTOPped: no look, no message, for 20 s
    assert w.stalled(set()) is None
    clock.t += 1.5
    assert w.stalled(set()) is None
    clock.t += 1
    assert w.stalled(set())["kind"] == "no_progress"  # 2 s of silence after the stall


def test_the_stacks_wait_is_bounded() -> None:
    w, clock = _watch(hang=2.0)
    _steps(w, clock, 3, gap=0.1)
    clock.t += 3
    w.await_stacks(w.stalled(set()), [0, 1])
    assert w.due() is None
    clock.t += ProgressWatch.STACKS_WAIT_S + 1
    verdict, cause = w.due()
    assert verdict == "fail" and "stacks unknown" in cause["message"]


SCRIPT = textwrap.dedent("""
    import atexit, sys, time
    def save_checkpoint():
        time.sleep(60)
    def upload():
        time.sleep(60)
    def hang_forever():
        time.sleep(60)
    what = sys.argv[1]
    if what == "exit":
        atexit.register(upload)
        print("ready", flush=True)
        sys.exit(0)
    print("ready", flush=True)
    {"save": save_checkpoint, "hang": hang_forever}[what]()
""")


class _Proc:
    def __init__(self, global_rank, pid):
        self.global_rank, self.pid = global_rank, pid


@pytest.mark.parametrize("what,kind,where", [("save", "saving", "save_checkpoint"), ("exit", "exiting", "upload"),
                                             ("hang", None, "hang_forever"), ("stop", "stuck", None)])
@pytest.mark.integration
def test_real_dumps_say_what_the_main_thread_does(tmp_path, what, kind, where) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), "hang" if what == "stop" else what],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        if what == "stop":
            proc.send_signal(19)  # SIGSTOP
            wait_for(lambda: process_state(proc.pid) == "T", 10, "the rank stopped")
        out = dump_all([_Proc(3, proc.pid)], str(tmp_path))["3"]
    finally:
        proc.send_signal(18)
        proc.kill()
        proc.wait()
    assert out["kind"] == kind, out
    assert (out["where"] or "").startswith(where or ""), out
    assert (tmp_path / "rank-3.stacks.txt").read_text().startswith(f"stacks of rank 3 (pid {proc.pid})")
    if what == "stop":
        assert "stopped by a signal" in out["doing"]


def test_summaries_of_known_places() -> None:
    def dump(*frames: str) -> str:
        return 'Thread 1 (idle): "MainThread"\n' + "".join(f"    {f}\n" for f in frames) + \
            'Thread 2 (idle): "Thread-1"\n    run (threading.py:1)\n'
    lock = summarize(dump("FileBaton.wait (file_baton.py:42)", "_jit_compile (cpp_extension.py:2100)",
                          "load (builder.py:500)", "<module> (train.py:10)"))
    assert lock["kind"] == "stuck" and "build lock" in lock["doing"] and lock["where"] == "FileBaton.wait (file_baton.py:42)"
    rdv = summarize(dump("TCPStore.__init__ (x.py:1)", "init_process_group (distributed_c10d.py:1)",
                         "main (train.py:5)", "<module> (train.py:9)"))
    assert "rendezvous" in rdv["doing"]
    shut = summarize(dump("_shutdown (threading.py:1590)"))
    assert shut["kind"] == "exiting"
    assert summarize("(py-spy failed: no such process)") == {"frames": [], "where": None, "doing": None, "kind": None}
    module = summarize(dump("step (optim.py:3)", "_run_code (<frozen runpy>:88)", "_run_module_as_main (<frozen runpy>:198)"))
    assert module["kind"] is None and module["where"] == "step (optim.py:3)"
