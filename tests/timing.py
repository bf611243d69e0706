"""Where the suite's time goes: a pytest plugin that records it, and the command that tables it.

The plugin (loaded by tests/conftest.py) keeps, for every test, the seconds of its setup, call and
teardown phases and its markers, and for every fixture set up, its scope and the seconds its own
setup took (its dependencies are set up first and counted under their own names). With
``--times DIR`` it writes them to ``DIR/times-<worker>.json`` at the end of the session (one file per
pytest-xdist worker, ``main`` without xdist); without it, it writes nothing.

The command reads such a directory and writes the tables of docs/testing.md (per file, per fixture,
the slowest tests), between its ``<!-- times:begin -->`` and ``<!-- times:end -->`` lines, and each file's
seconds into tests/durations.json (the order in which pytest-xdist's workers take the groups, tests/conftest.py)::

    .venv/bin/python tests/timing.py run                  # the README's suite with --times, then the tables
    .venv/bin/python tests/timing.py run -- -m "not integration"   # pytest arguments after --
    .venv/bin/python tests/timing.py report DIR           # tables of an earlier run, printed
    .venv/bin/python tests/timing.py report DIR --write docs/testing.md

``report`` also reads a JUnit XML file (``pytest --junitxml``) in place of a directory: per-test
seconds only (JUnit has no fixtures), which is how the table of the suite before issue 35 was made.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pytest

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- times:begin -->", "<!-- times:end -->"
PHASES = ("setup", "call", "teardown")
DURATIONS = ROOT / "tests" / "durations.json"
#: what pytest-xdist's ``--dist loadgroup`` appends to a node id: ``@<group>`` (tests/conftest.py names them g-*)
_GROUP_SUFFIX = re.compile(r"@g-[^@]*$")


def _plain(nodeid: str) -> str:
    return _GROUP_SUFFIX.sub("", nodeid)


# --------------------------------------------------------------------------- the plugin

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--times", metavar="DIR", default=None,
                     help="write every test's phase seconds and every fixture's setup seconds to "
                          "DIR/times-<worker>.json (tables: python tests/timing.py report DIR)")


def _new_record() -> dict[str, Any]:
    return {"setup": 0.0, "call": 0.0, "teardown": 0.0, "outcome": "passed", "markers": []}


class _Recorder:
    """The session's records: ``tests`` by node id, ``fixtures`` as (name, scope, node id, seconds)."""

    def __init__(self) -> None:
        self.tests: dict[str, dict[str, Any]] = {}
        self.fixtures: list[tuple[str, str, str, float]] = []
        self.started = time.time()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any):  # noqa: ANN201 - a hook wrapper
        t0 = time.perf_counter()
        yield
        self.fixtures.append((fixturedef.argname, fixturedef.scope, _plain(request.node.nodeid),
                              time.perf_counter() - t0))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self.tests.setdefault(_plain(report.nodeid), _new_record())
        rec[report.when] = report.duration
        if report.failed or (report.skipped and report.when != "teardown"):
            rec["outcome"] = report.outcome

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        rec = self.tests.setdefault(_plain(item.nodeid), _new_record())
        rec["markers"] = sorted({m.name for m in item.iter_markers()} - {"parametrize", "usefixtures"})

    def dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"started": self.started, "ended": time.time(), "tests": self.tests,
                                    "fixtures": self.fixtures}))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--times"):
        config.pluginmanager.register(_Recorder(), "orch-timing-recorder")


def pytest_unconfigure(config: pytest.Config) -> None:
    recorder = config.pluginmanager.get_plugin("orch-timing-recorder")
    if recorder is not None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        if worker == "main" and hasattr(config, "workerinput"):
            worker = config.workerinput["workerid"]
        if worker == "main" and getattr(config.option, "numprocesses", None):
            return  # the xdist controller runs no test; each worker writes its own file
        recorder.dump(Path(config.getoption("--times")) / f"times-{worker}.json")


# --------------------------------------------------------------------------- the tables

@dataclass
class Times:
    """Every test's phases (``tests``: node id -> {setup, call, teardown, outcome}), fixture setups, wall."""

    tests: dict[str, dict[str, Any]] = field(default_factory=dict)
    fixtures: list[tuple[str, str, str, float]] = field(default_factory=list)
    wall: float = 0.0
    workers: int = 0


def load(source: Path) -> Times:
    """The records under ``source``: a ``--times`` directory, or a JUnit XML file (tests only).

    Raises:
        SystemExit: nothing readable there (the message names the path).
    """
    times = Times()
    if source.is_file():
        root = ET.parse(source).getroot()
        for suite in root.iter("testsuite"):
            times.wall += float(suite.get("time") or 0)
        for case in root.iter("testcase"):
            parts = (case.get("classname") or "").split(".")  # tests.test_x[.TestClass]
            cut = next((i + 1 for i, p in enumerate(parts) if p.startswith("test_")), len(parts))
            nodeid = "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], case.get("name") or ""])
            outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
                "skipped" if case.find("skipped") is not None else "passed")
            times.tests[nodeid] = {"setup": 0.0, "call": float(case.get("time") or 0), "teardown": 0.0,
                                   "outcome": outcome, "markers": []}
        times.workers = 1
        return times
    files = sorted(source.glob("times-*.json"))
    if not files:
        raise SystemExit(f"{source}: no times-*.json here (run pytest with --times={source})")
    starts, ends = [], []
    for f in files:
        data = json.loads(f.read_text())
        times.tests.update(data["tests"])
        times.fixtures.extend(tuple(x) for x in data["fixtures"])
        starts.append(data["started"])
        ends.append(data["ended"])
    times.wall = max(ends) - min(starts)
    times.workers = len(files)
    return times


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _total(rec: dict[str, Any]) -> float:
    return sum(rec[p] for p in PHASES)


def tables(times: Times, top: int = 20) -> str:
    """Markdown: the per-file table (every file, slowest first), the fixtures that cost over a second
    in all, and the ``top`` slowest tests."""
    by_file: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for nodeid, rec in times.tests.items():
        by_file[_file_of(nodeid)].append((nodeid, rec))
    total = sum(_total(r) for r in times.tests.values())
    lines = [f"{len(times.tests)} tests, {total:.0f} s of test time in all ({total / 60:.1f} min), "
             f"{times.wall:.0f} s wall over {times.workers} process(es).", "",
             "| file | tests | seconds | share | setup s | call s | slowest test (s) |",
             "|---|---|---|---|---|---|---|"]
    rows = sorted(by_file.items(), key=lambda kv: -sum(_total(r) for _, r in kv[1]))
    for name, recs in rows:
        secs = sum(_total(r) for _, r in recs)
        setup = sum(r["setup"] + r["teardown"] for _, r in recs)
        slow_id, slow = max(recs, key=lambda nr: _total(nr[1]))
        lines.append(f"| {name} | {len(recs)} | {secs:.1f} | {100 * secs / max(total, 1e-9):.1f}% | {setup:.1f} | "
                     f"{sum(r['call'] for _, r in recs):.1f} | {slow_id.split('::', 1)[1]} ({_total(slow):.1f}) |")
    if times.fixtures:
        per: dict[tuple[str, str], list[float]] = defaultdict(list)
        for name, scope, _, secs in times.fixtures:
            per[(name, scope)].append(secs)
        costly = sorted(((k, v) for k, v in per.items() if sum(v) >= 1.0), key=lambda kv: -sum(kv[1]))
        lines += ["", "| fixture | scope | setups | seconds in all | longest setup s |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {s} | {len(v)} | {sum(v):.1f} | {max(v):.1f} |" for (n, s), v in costly]
    lines += ["", f"The {top} slowest tests (setup + call + teardown):", "", "| test | seconds |", "|---|---|"]
    slowest = sorted(times.tests.items(), key=lambda kv: -_total(kv[1]))[:top]
    lines += [f"| {nodeid} | {_total(rec):.1f} |" for nodeid, rec in slowest]
    return "\n".join(lines) + "\n"


def write_durations(times: Times, path: Path = DURATIONS) -> None:
    """``{test file: seconds}`` of ``times`` into ``path`` (tests/conftest.py orders pytest-xdist's groups by it)."""
    per: dict[str, float] = defaultdict(float)
    for nodeid, rec in times.tests.items():
        per[_file_of(nodeid)] += _total(rec)
    path.write_text(json.dumps({k: round(v, 1) for k, v in sorted(per.items())}, indent=1) + "\n")


#: the README's test command's two pytest runs (tests/timing.py run without arguments runs both)
FULL_RUN_PARALLEL = ["-n", "2", "-m", "not timing"]
FULL_RUN_TIMING = ["-m", "timing"]

def write_into(doc: Path, text: str, command: str) -> None:
    """Replace what stands between ``BEGIN`` and ``END`` in ``doc`` with ``text`` under a line naming
    ``command`` and the date.

    Raises:
        SystemExit: ``doc`` lacks the two marker lines.
    """
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} lines to write the tables between")
    head, rest = body.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    stamp = time.strftime("%Y-%m-%d")
    doc.write_text(f"{head}{BEGIN}\nMeasured {stamp} with `{command}`: {text}{END}{tail}")  # one paragraph


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/timing.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the suite with --times (by default as the README's test command does: "
                                     "-n 2 -m 'not timing', then -m timing), then write the tables into "
                                     "docs/testing.md")
    run.add_argument("--doc", type=Path, default=ROOT / "docs" / "testing.md")
    run.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    rep = sub.add_parser("report", help="print (or --write) the tables of a --times directory or a JUnit file")
    rep.add_argument("source", type=Path)
    rep.add_argument("--write", type=Path, metavar="DOC", help="write them into DOC between its marker lines")
    rep.add_argument("--top", type=int, default=20)
    rep.add_argument("--durations", action="store_true",
                     help=f"with --write, also write the per-file seconds into {DURATIONS.relative_to(ROOT)}")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.command == "run":
        out = Path(tempfile.mkdtemp(prefix="orch-times-"))
        code = 0  # without arguments: the README's two commands (the parallel part, then the timing tier)
        for part in ([args.pytest_args] if args.pytest_args else [FULL_RUN_PARALLEL, FULL_RUN_TIMING]):
            cmd = [sys.executable, "-m", "pytest", f"--times={out}", *part]
            print("+", " ".join(cmd), flush=True)
            code = subprocess.call(cmd, cwd=ROOT) or code
        shown = "python tests/timing.py run" + (" -- " + " ".join(args.pytest_args) if args.pytest_args else "")
        times = load(out)
        write_into(args.doc, tables(times), shown)
        write_durations(times)
        print(f"tables written into {args.doc}, per-file seconds into {DURATIONS} (records in {out})")
        return code
    times = load(args.source)
    text = tables(times, top=args.top)
    if args.write:
        write_into(args.write, text, f"python tests/timing.py report {args.source}")
        if args.durations:
            write_durations(times)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
