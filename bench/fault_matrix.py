"""The fault matrix: inject each fault into a real training job and measure the recovery.

One ``orch server`` runs a 2-node ZeRO-2 job of examples/train_gpt.py (tiny model, a
checkpoint every 10 steps) over SSH on real sshd hosts in network namespaces (tests/nethosts.py:
3 hosts, the third a spare), with the restart policy ``max_restarts: 1, backoff_seconds: 0,
exclude_failed_nodes: true`` and ``hang_timeout: 5``. Once every rank is past step 25 (or at
the fault's own step) one fault is injected:

==================  ===========================================================================
rank_crash          SIGKILL of global rank 1's process
node_killed         SIGKILL of every process of host 1 (its sshd, agent and rank)
network_cut         ``ip link set eth0 down`` in host 1's namespace (silence, no reset)
hang                rank 1 sleeps forever before step 26's collectives (``--hang-at-step 25``)
rank_stopped        SIGSTOP of global rank 1's process (it runs nothing, and ignores SIGTERM until SIGCONT)
controller_killed   SIGKILL of ``orch server``, then a new ``orch server`` is started at once (it re-attaches)
controller_stopped  SIGSTOP of ``orch server`` for 20 s (past the agents' 15 s lease), then SIGCONT
agents_killed       SIGKILL of every node's agent at once (their ranks must not outlive them)
save_crash          rank 1 SIGKILLs itself while step 30's checkpoint is written (``--crash-in-save-at-step``)
==================  ===========================================================================

and we measure, from the moment of the fault (wall clock):

* **detected**: until the attempt is FAILED in the store (its state event);
* **first step**: until the new attempt's first training step (the first progress point);
  for ``controller_killed``, whose attempt is not failed but re-attached by the next server, until the
  first step after the fault (``detected`` is then "-": nothing failed; ``reattached_s`` in the JSON:
  until the next server had re-attached);
* **steps lost**: the last step attempt 1 reached minus the step attempt 2 resumed from (re-attached:
  the steps logged twice or never, counted from every rank's log);
* **leftovers**: processes of the job (any attempt, any host) alive once the job SUCCEEDED
  and attempt 1's last process is gone (must be 0), plus when that was (a cut host's agent
  stops its rank only when the controller's lease, 15 s, runs out), the job's final state and
  attempt 2's start checkpoint.

    sudo .venv/bin/python bench/fault_matrix.py                  # every fault once
    sudo .venv/bin/python bench/fault_matrix.py --faults hang,save_crash --rounds 2 --output json
    sudo .venv/bin/python bench/fault_matrix.py --quick          # rank_crash once, a smoke run

Before the trials the ops the ranks load are built (``helpers_train.prebuild_ops``), so that no trial's timings
include a build. ``--quick`` is a smoke run (``python -m bench --quick``), not a measurement: ``rank_crash`` only
(unless ``--faults`` says otherwise), once, without that step (the job's own preflight builds what is missing).

Needs root, openssh-server/-client and iproute2 (as the ssh tests). Prints a markdown table. A trial whose job
does not end SUCCEEDED keeps its directory (the server's state dir and log, every attempt's logs): its path and
the job's cause are printed (and are in ``--output json`` as ``kept`` and ``final_cause``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import helpers_train  # noqa: E402
import nethosts  # noqa: E402
from faultmatrix import FAULTS, run_fault  # noqa: E402


def _trial(fault: str, net) -> dict:
    """One trial of ``fault``. Its directory (the server's state dir: the store, every attempt's logs; the server's
    log) is removed when the job SUCCEEDED; otherwise it is kept, and its path and the job's cause are printed."""
    tmp = Path(tempfile.mkdtemp(prefix=f"orch-fault-{fault}-"))
    try:
        res = run_fault(fault, net, tmp)
    except BaseException as err:
        print(f"{fault}: the trial did not finish ({type(err).__name__}: {err}); its state dir and logs are kept "
              f"in {tmp}", file=sys.stderr, flush=True)
        raise
    print(json.dumps(res), file=sys.stderr, flush=True)
    if res.get("final_state") == "SUCCEEDED":
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        res["kept"] = str(tmp)
        print(f"{fault}: the job ended {res.get('final_state')}: {res.get('final_cause') or 'no cause recorded'}; "
              f"its state dir and logs are kept in {tmp}", file=sys.stderr, flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", help=f"comma-separated, of {', '.join(FAULTS)} (default: all; --quick: rank_crash)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--output", choices=["table", "json"], default="table")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run, not a measurement: rank_crash once, the ops not built beforehand")
    args = ap.parse_args()
    if args.faults is None:
        args.faults = "rank_crash" if args.quick else ",".join(FAULTS)
    if args.quick:
        args.rounds = 1
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; choose from {FAULTS}")
    nethosts.check_prerequisites()
    if not args.quick:
        helpers_train.prebuild_ops()
    results = []
    with nethosts.TestNetwork(3) as net:
        for _ in range(args.rounds):
            for fault in faults:
                results.append(_trial(fault, net))
    if args.output == "json":
        print(json.dumps(results, indent=1))
        return 0
    print("| fault | detected (s) | fault to first step of attempt 2 (s) | steps lost | leftover processes | "
          "attempt 1 all gone (s) | cause | resumed from | final |")

    def med(rows: list[dict], key: str, digits: int) -> str:
        values = [r[key] for r in rows if r[key] is not None]
        return f"{statistics.median(values):.{digits}f}" if values else "-"
    print("|---|---|---|---|---|---|---|---|---|")
    for fault in faults:
        rows = [r for r in results if r["fault"] == fault]
        print(f"| {fault} | {med(rows, 'detected_s', 2)} | {med(rows, 'first_step_s', 1)} | "
              f"{'/'.join(str(r['steps_lost']) for r in rows)} | {max(r['leftovers'] for r in rows)} | "
              f"{med(rows, 'attempt1_gone_s', 1)} | "
              f"{rows[0]['cause']} | {rows[0]['resumed_from']} | {rows[0]['final_state']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
