"""The live view of ``orch run`` (and ``orch status``'s ranks table) fits the terminal: rank, node, step and
loss first, the other columns only where there is room, one line per rank, never wrapped. Rendered from a
real job's detail (4 ranks on 2 nodes with long host names) at 60, 80, 120 and 200 columns through rich's
own console width; the text captures go to ``$ORCH_TEST_ARTIFACTS`` (default ``<repo>/test-artifacts/``)."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from conftest import ROOT, SCRIPTS
from orchestrator.face.cli.render import render_detail
from orchestrator.observe import job_detail
from orchestrator.spec import spec_from_dict
from orchestrator.supervision import Controller

ARTIFACTS = Path(os.environ.get("ORCH_TEST_ARTIFACTS") or ROOT / "test-artifacts")
HOSTS = ["worker-node-0.cluster.example.com", "worker-node-1.cluster.example.com"]


@pytest.fixture(scope="module")
def detail(tmp_path_factory):
    """A finished job's detail with the ranks' step, loss and last output filled in."""
    state = tmp_path_factory.mktemp("live")
    hostfile = state.parent / "live-hosts"
    hostfile.write_text("".join(f"{h} slots=2\n" for h in HOSTS))
    c = Controller(state)
    try:
        job = c.submit(spec_from_dict({"name": "live", "hostfile": str(hostfile), "entrypoint": str(SCRIPTS / "worker.py"),
                                       "env": {"WORKER_STEPS": "12", "WORKER_STEP_S": "0.01"}}, source="test"))
        assert c.wait(job.id, 120).state.value == "SUCCEEDED"
        yield job_detail(c.store, job.id)
    finally:
        c.close()


def _render(detail: dict, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(render_detail(detail))
    return console.export_text()


@pytest.mark.parametrize("width", [60, 80, 120, 200])
@pytest.mark.integration
def test_the_ranks_table_fits_every_width_one_line_per_rank(detail, width) -> None:
    text = _render(detail, width)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"live-view-{width}-columns.txt").write_text(text)
    lines = text.rstrip("\n").splitlines()
    assert all(len(line) <= width for line in lines), [len(line) for line in lines]
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    rows = lines[header + 1:]
    assert len(rows) == 4 and [r.split()[0] for r in rows] == ["0", "1", "2", "3"]  # one line each, none wrapped
    columns = lines[header].split()
    assert columns[:2] == ["rank", "node"] and "step" in columns and "loss" in columns
    for row in rows:
        assert re.search(r"\b12\b", row) and re.search(r"\b\d+\.\d{4}\b", row)  # step 12 and its loss, shown
    if width >= 120:
        assert "last" in columns and all("step=12" in row for row in rows)
    if width <= 80:
        assert "last" not in columns  # what gives way first
    if width == 60:
        assert "tokens/s" not in columns and "local" not in columns


@pytest.mark.integration
def test_at_80_columns_rank_node_step_and_loss_are_all_readable(detail) -> None:
    rows = _render(detail, 80).rstrip("\n").splitlines()
    body = [r for r in rows if r[:1].isdigit()]
    for rank, row in enumerate(body):
        assert row.split()[0] == str(rank) and HOSTS[rank // 2] in row  # the host name whole, at 80
        assert "12" in row.split() and "running" not in row
