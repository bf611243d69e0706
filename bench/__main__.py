"""Every benchmark in one run, written to docs/benchmarks.md: ``python -m bench``.

Each section runs one script of bench/ (its own rounds interleave the systems it compares: A B A B ...) and
puts what it printed (markdown tables: min / median / max, ratios against the baseline run beside it) under
a heading with the exact command. The page also says when and where it ran: the date, the commit, the
machine (cores, CPU, memory) and its load, sampled every 5 s for the whole run (min / median / max of the
1-minute load average), since a busy machine skews every figure.

    sudo .venv/bin/python -m bench                     # every section, full rounds (about 30-40 minutes here)
    sudo .venv/bin/python -m bench --quick --out /tmp/b.md   # a smoke run of every section (CI: it must work)
    .venv/bin/python -m bench --only controller_scale plan_scale

``--quick`` runs each script with its own ``--quick``: one round at its smallest size, every system it compares
once, no warm-up run that only steadies the figures, so that every code path runs end to end in a few minutes;
its figures are not measurements. Its sections' ranks use the tests' op cache (``.torch_extensions`` in the checkout, as
tests/conftest.py does) where ``TORCH_EXTENSIONS_DIR`` is not set, so that they load the ops a test run built
instead of building them in torch's default cache.

Sections that need root (network namespaces for ssh hosts) are reported as not run without it. A section
that fails is written down with its exit status and output tail, and the command exits non-zero at the end.
No timing is asserted here: this measures.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Section:
    """One benchmark script: its arguments for a full run and for ``--quick``, what it measures."""

    name: str
    title: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    root: bool = False  # needs root (namespace hosts)
    what: str = ""


SECTIONS = (
    Section("launch_ssh", "Submit to step 1 on every rank, 3 ssh hosts", ("--rounds", "5"), ("--quick",), True,
            "orch vs `deepspeed --launcher pdsh` (real pdsh and OpenSSH) vs torchrun on each node vs one bare process."),
    Section("fast_start", "Forked ranks vs exec'd ranks", ("--rounds", "5"), ("--quick",),
            what="orch with fast_start on vs off, the same job on local nodes."),
    Section("metrics_overhead", "Steady-state throughput and scrape time", ("--rounds", "9", "--steps", "300"),
            ("--quick",),
            what="orch with metrics on vs off vs DeepSpeed's bare launcher (throughput paired per round); one scrape."),
    Section("failure_detection", "A fault in real training, 3 ssh hosts", ("--rounds", "3"), ("--quick",), True,
            what="orch vs `deepspeed --launcher pdsh` (real pdsh and OpenSSH): a node killed, a link cut, a rank "
                 "stopped; how long until the run ends, and the processes left."),
    Section("recovery_timeline", "Fault to the next attempt's first step", ("--rounds", "5"), ("--quick",),
            what="a rank crash, with the restart policy."),
    Section("universal_where", "Where the universal conversion is cheapest", ("--rounds", "5"), ("--quick",),
            what="ds_to_universal in a fresh Python (the controller) vs forked from a warm one (a node agent)."),
    Section("fault_matrix", "Detection and recovery per fault, ssh hosts", ("--rounds", "1"), ("--quick",), True,
            what="the fault matrix of docs/recovery.md."),
    Section("plan_scale", "Planning and listing at scale", (), ("--quick",),
            what="make_plan and `orch plan` at 64/512/4,096 nodes x 8 slots; `orch list` at 1k/10k/100k jobs."),
    Section("controller_scale", "The controller's CPU with 100 and 1,000 agents", ("--rounds", "3"), ("--quick",),
            what="fake agents over the real link protocol, 2 heartbeats/s each."),
)


class LoadSampler:
    """The 1-minute load average every ``every`` seconds on a daemon thread, for the page's header."""

    def __init__(self, every: float = 5.0) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> str:
        self._stop.set()
        s = self.samples
        return f"{min(s):.2f} / {statistics.median(s):.2f} / {max(s):.2f} ({len(s)} samples)"


def _machine() -> str:
    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({model or platform.processor()}), {mem:.0f} GiB, {platform.platform()}"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def label_output(body: str, command: str) -> str:
    """A section's output with each of its blocks (blank-line separated) headed by ``From `command`:``.

    Every paragraph of the page that states a figure names the command that measured it
    (tests/test_doc_claims.py). ``command`` is e.g. ``python bench/launch_ssh.py --rounds 5``.
    """
    blocks = [b.strip("\n") for b in body.split("\n\n") if b.strip()]
    return "\n\n".join(f"From `{command}`:\n{b}" for b in blocks)


def run_section(section: Section, quick: bool, timeout: float) -> tuple[str, bool]:
    """Run one section; returns (its markdown, whether it ran to the end)."""
    args = section.quick if quick else section.full
    command = ["python", f"bench/{section.name}.py", *args]
    head = [f"## {section.title}", "", section.what, "", "```sh", ("sudo " if section.root else "") + ".venv/bin/"
            + " ".join(command), "```", ""]
    if section.root and os.geteuid() != 0:
        return "\n".join(head + ["Not run: it needs root (network namespaces for the ssh hosts).", ""]), True
    script = ROOT / "bench" / f"{section.name}.py"
    if not script.exists():
        return "\n".join(head + [f"Not run: {script.name} is not in this checkout.", ""]), False
    env = dict(os.environ)
    if quick:  # the ops the test run built (tests/conftest.py's cache), not builds in torch's default cache
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        out, code = proc.stdout, proc.returncode
        err = proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, code = f"timed out after {timeout:.0f} s", -1
    took = time.monotonic() - t0
    body = out.rstrip()
    if code != 0:
        tail = "\n".join((err or "").strip().splitlines()[-15:])
        return "\n".join(head + [f"**Failed** (exit {code}, after {took:.0f} s):", "", "```", body[-3000:], tail,
                                 "```", ""]), False
    run = " ".join(command)
    return "\n".join(head + [label_output(body, run), "", f"(`{run}` took {took:.0f} s)", ""]), True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: each script's --quick (one round, smallest size, every system once; its "
                         "figures are not measurements)")
    ap.add_argument("--only", nargs="+", metavar="SECTION", choices=[s.name for s in SECTIONS],
                    help="run only these sections: " + ", ".join(s.name for s in SECTIONS))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="where the page goes (default docs/benchmarks.md)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one section may take (default 3600)")
    args = ap.parse_args(argv)
    sections = [s for s in SECTIONS if not args.only or s.name in args.only]
    load = LoadSampler()
    started = datetime.datetime.now(datetime.timezone.utc)
    parts, ok = [], True
    for s in sections:
        print(f"[bench] {s.name} ...", flush=True)
        text, good = run_section(s, args.quick, args.timeout)
        ok &= good
        print(text, flush=True)
        parts.append(text)
    command = "python -m bench" + (" --quick" if args.quick else "") + (f" --only {' '.join(args.only)}" if args.only else "")
    header = ["# Benchmarks", "",
              f"Written by `{command}` on {started:%Y-%m-%d %H:%M} UTC, commit {_commit()}, in "
              f"{(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60:.0f} minutes.", "",
              f"Machine: {_machine()}.", "",
              f"Load (1-minute average, min / median / max over the run): {load.stop()}.", "",
              "Every section runs its systems side by side in alternating rounds; what each figure means and its "
              "earlier values are in [bench/README.md](../bench/README.md).", ""]
    if args.quick:
        header += ["A smoke run (`--quick`: each script's smallest job, one round, every system once): the figures "
                   "below show that every benchmark runs, not what it measures.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(header + parts))
    print(f"[bench] wrote {args.out}" + ("" if ok else " (some sections failed)"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
