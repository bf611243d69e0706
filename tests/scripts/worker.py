"""A stand-in rank for orchestration tests: steps, prints progress, fails on demand.

Configured by environment (so launchers' argv handling is untouched):

* ``WORKER_STEPS`` (default 5) steps of ``WORKER_STEP_S`` seconds (default 0.1) each,
  printing ``step=<n> loss=<x> rank=<r>``.
* ``WORKER_FAIL_RANK`` / ``WORKER_FAIL_AT``: that global rank, at that step, does
  ``WORKER_FAIL_MODE``: ``exit:<code>`` (default ``exit:3``), ``raise`` (an exception),
  ``kill`` (SIGKILL itself).
* ``WORKER_IGNORE_TERM=1``: ignore SIGTERM (so only SIGKILL stops it).
* ``WORKER_ESCAPEE=1``: start a child in a new session that sleeps for an hour (a process
  that leaves the rank's process group, as a careless data loader might); its pid goes to
  ``<WORKER_READY_DIR>/escapee<r>.pid``.
* ``WORKER_ESCAPEE=clean``: the same child, started with an empty environment (no ``ORCH_*``
  marker: only the attempt's cgroup still holds it).
* ``WORKER_READY_DIR``: touch ``<dir>/rank<r>.ready`` once running.
* ``WORKER_SAY``: a line printed as it is at the start (terminal escapes, for one).
* ``WORKER_EXIT_S``: seconds an ``atexit`` handler spends after the last step (as an upload at exit does).
* ``WORKER_REPORT=1``: also report each step with ``agents.report.step`` (its loss, ``total_steps=WORKER_STEPS``).
* ``WORKER_ABORT_AT_EXIT=1``: after the last step, print what gloo's exit-time abort prints and abort (SIGABRT), as
  a rank whose interpreter teardown crashes does.
"""

import os
import signal
import subprocess
import sys
import time

rank = int(os.environ.get("RANK", "0"))
steps = int(os.environ.get("WORKER_STEPS", "5"))
step_s = float(os.environ.get("WORKER_STEP_S", "0.1"))
fail_rank = int(os.environ.get("WORKER_FAIL_RANK", "-1"))
fail_at = int(os.environ.get("WORKER_FAIL_AT", "0"))
mode = os.environ.get("WORKER_FAIL_MODE", "exit:3")

if os.environ.get("WORKER_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
ready = os.environ.get("WORKER_READY_DIR")
if ready:
    os.makedirs(ready, exist_ok=True)
if os.environ.get("WORKER_ESCAPEE") in ("1", "clean"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True,
                             env={} if os.environ["WORKER_ESCAPEE"] == "clean" else None)
    if ready:
        with open(os.path.join(ready, f"escapee{rank}.pid"), "w") as f:
            f.write(str(child.pid))
if ready:
    open(os.path.join(ready, f"rank{rank}.ready"), "w").close()

print(f"worker rank {rank} argv={sys.argv[1:]}", flush=True)
if os.environ.get("WORKER_SAY"):
    print(os.environ["WORKER_SAY"], flush=True)
if os.environ.get("WORKER_EXIT_S"):
    import atexit

    def _upload_at_exit() -> None:
        time.sleep(float(os.environ["WORKER_EXIT_S"]))
    atexit.register(_upload_at_exit)
for step in range(1, steps + 1):
    if rank == fail_rank and step == fail_at:
        print(f"rank {rank} failing at step {step} ({mode})", flush=True)
        if mode == "raise":
            raise RuntimeError(f"deliberate failure on rank {rank}")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(mode.split(":")[1]))
    time.sleep(step_s)
    print(f"step={step} loss={10.0 / step:.6f} rank={rank}", flush=True)
    if os.environ.get("WORKER_REPORT") == "1":
        from agents import report
        report.step(step, loss=10.0 / step, total_steps=steps)
if os.environ.get("WORKER_ABORT_AT_EXIT") == "1":
    sys.stdout.flush()
    sys.stderr.write("terminate called without an active exception\n")
    sys.stderr.flush()
    os.abort()
