"""The live web dashboard of ``orch server``, end to end in a real headless browser.

A real ``orch server`` on a free port, real DeepSpeed training jobs (examples/train_gpt.py on
2 local "nodes", submitted with ``orch submit``) and Debian's Chromium driven by Selenium. The
page is opened once and never reloaded while jobs come, train, succeed and fail. The last test has its own
server: a job that fails once and is resumed, its goodput bar and its loss chart across both attempts.

Screenshots go to ``$ORCH_TEST_ARTIFACTS`` (default ``<repo>/test-artifacts/``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import running_server, ROOT, Orch, assert_no_leftovers, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train

pytestmark = pytest.mark.integration

EXAMPLES = ROOT / "examples"
#: seconds a page is given to show what was already there to show: Chromium renders on the cores the other xdist
#: worker's ranks load (10 s was seen to be too few there)
UI_WAIT_S = 30
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
# 40-60 steps/s here once started at full speed; the followed job sleeps 10 ms a step (--pace-ms): 25-40 s of
# training after a 10-40 s DeepSpeed start-up, on half the CPU
STEPS = 1500
ARTIFACTS = Path(os.environ.get("ORCH_TEST_ARTIFACTS") or ROOT / "test-artifacts")

# read the page in one script each, so a re-render between two WebDriver calls cannot interfere
RANKS_JS = """return [...document.querySelectorAll('#ranks-table tr.rank-row')].map(tr => ({
  rank: +tr.dataset.rank, state: tr.dataset.state,
  step: tr.querySelector('td.rank-step').textContent.trim()}));"""
SERIES_JS = """return Object.fromEntries([...document.querySelectorAll(arguments[0] + ' polyline.series')]
  .map(p => [p.dataset.rank, +p.dataset.points]));"""
JOB_STATE_JS = "const h = document.querySelector('#job-header'); return h && h.dataset.state;"
JOBS_JS = """return [...document.querySelectorAll('#jobs-table tr.job-row')].map(tr => ({
  id: tr.dataset.jobId, state: tr.dataset.state,
  step: tr.querySelector('td.job-step').textContent.trim(), loss: tr.querySelector('td.job-loss').textContent.trim(),
  rate: tr.querySelector('td.job-rate').textContent.trim(), eta: tr.querySelector('td.job-eta').textContent.trim(),
  bar: (tr.querySelector('td.job-step .step-bar > div') || {style: {}}).style.width || null}));"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def ds_ops() -> None:
    """Build or load DeepSpeed's CPU ops once, not in every rank at once."""
    helpers_train.prebuild_ops()


@pytest.fixture(scope="module")
def orch_m(tmp_path_factory) -> Orch:
    state = tmp_path_factory.mktemp("web") / "state"
    state.mkdir()
    return Orch(state)


@pytest.fixture(scope="module")
def server(orch_m):
    with running_server(orch_m) as served:
        yield served


def _spec(write_spec, hostfile, name: str, extra: list[str] = ()) -> Path:
    return write_spec(
        name=name, hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")), launcher="pdsh",
        workdir=str(EXAMPLES), entrypoint="train_gpt.py", args=TINY + ["--steps", str(STEPS), *extra],
        deepspeed_config=str(EXAMPLES / "ds_zero2.json"), stop_grace_seconds=5,
        env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


def _js(driver, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def _screenshot(driver, name: str) -> Path:
    """A screenshot of the whole page (the window grown to the page's height), at 1280 wide."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    height = _js(driver, "return Math.max(document.documentElement.scrollHeight, document.body.scrollHeight)")
    driver.set_window_size(1280, min(max(900, height + 140), 4000))
    time.sleep(0.3)
    try:
        assert driver.save_screenshot(str(path)), f"could not save {path}"
    finally:
        driver.set_window_size(1280, 900)
    print(f"\nscreenshot: {path}")
    return path


def _severe_console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _is_red(css_color: str) -> bool:
    r, g, b = (int(x) for x in re.findall(r"\d+", css_color)[:3])
    return r >= 150 and g <= 110 and b <= 110


def test_page_and_static_files_are_served(server, orch_m) -> None:
    _, url = server
    httpx = orch_m.http()  # with the server's token
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/app.js"></script>' in page.text and "/static/style.css" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    js = httpx.get(f"{url}/static/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert "/api/jobs" in js.text
    charts = httpx.get(f"{url}/static/charts.js")  # the charts' code, loaded before app.js
    assert charts.status_code == 200 and "OrchCharts" in charts.text
    assert page.text.index("/static/charts.js") < page.text.index("/static/app.js")
    helpers = httpx.get(f"{url}/static/format.js")  # the formatting helpers, loaded first
    assert helpers.status_code == 200 and "OrchFormat" in helpers.text
    assert page.text.index("/static/format.js") < page.text.index("/static/charts.js")
    css = httpx.get(f"{url}/static/style.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert httpx.get(f"{url}/static/nope.js").status_code == 404
    assert httpx.get(f"{url}/api/health").json()["ok"] is True  # the API is still there


def test_a_training_job_is_followed_live(server, browser, orch_m, write_spec, hostfile) -> None:
    proc, url = server
    driver = browser
    driver.get(proc.login_url)  # the URL orch server printed: its cookie, then the dashboard
    assert driver.current_url == f"{url}/" and "token" not in driver.current_url
    wait_for(lambda: re.fullmatch(r"updated \d\d:\d\d:\d\d", driver.find_element("id", "updated").text), UI_WAIT_S,
             "the first refresh")
    _js(driver, "window.__not_reloaded = true;")

    t0 = time.monotonic()
    job_id = orch_m.json("submit", str(_spec(write_spec, hostfile, "web-train", ["--pace-ms", "10"])),
                         check=True)["id"]
    # the job appears in the list without a reload
    row = wait_for(lambda: driver.find_elements("css selector", f'tr.job-row[data-job-id="{job_id}"]'), UI_WAIT_S,
                   "the job in the list")[0]
    assert _js(driver, "return window.__not_reloaded === true")
    assert row.find_element("css selector", "td.job-name").text == "web-train"
    row.click()
    wait_for(lambda: driver.current_url.endswith(f"#/jobs/{job_id}"), UI_WAIT_S, "the job's URL")
    wait_for(lambda: driver.find_element("id", "job-body").is_displayed(), UI_WAIT_S, "the job's page")
    assert not driver.find_element("id", "jobs-view").is_displayed()

    # its ranks run: both listed as running, on two nodes
    wait_for(lambda: [r["state"] for r in _js(driver, RANKS_JS)] == ["running", "running"], 120,
             "both ranks running on the page")
    print(f"\nranks running {time.monotonic() - t0:.1f} s after submit")
    nodes = _js(driver, "return [...document.querySelectorAll('#nodes .node')].map(n => n.dataset.state)")
    assert nodes == ["running", "running"]

    # the loss chart gets points of both ranks, and more as training goes on
    def loss_points(more_than: dict[str, int]) -> dict[str, int] | None:
        series = _js(driver, SERIES_JS, "svg#loss-chart")
        return series if all(series.get(k, 0) > more_than[k] for k in ("0", "1")) else None

    first = wait_for(lambda: loss_points({"0": 0, "1": 0}), 120, "loss points of both ranks")
    t_points = time.monotonic()
    print(f"first loss points {t_points - t0:.1f} s after submit: {first}")
    steps_before = {r["rank"]: int(r["step"]) for r in _js(driver, RANKS_JS) if r["step"].isdigit()}
    grown = wait_for(lambda: loss_points(first), 30, "more loss points")
    # the step values shown increase
    wait_for(lambda: all(r["step"].isdigit() and int(r["step"]) > steps_before.get(r["rank"], 0)
                         for r in _js(driver, RANKS_JS)), 30, "the steps shown to increase")
    assert [r["state"] for r in _js(driver, RANKS_JS)] == ["running", "running"], "the job ended too early"
    wait_for(lambda: all(v >= 1 for v in _js(driver, SERIES_JS, "svg#rate-chart").values())
             and len(_js(driver, SERIES_JS, "svg#rate-chart")) == 2, 30, "step rates of both ranks")
    legend = _js(driver, "return [...document.querySelectorAll('svg#loss-chart .legend-item')]"
                         ".map(g => g.textContent)")
    assert legend == ["rank 0", "rank 1"]
    ticks = _js(driver, "return document.querySelectorAll('svg#loss-chart text.tick').length")
    assert ticks >= 4
    assert driver.find_element("id", "chart-attempt").get_attribute("value") == "1"
    # the log tail of rank 0 (the default) refreshes with its training lines
    wait_for(lambda: "[train] step=" in driver.find_element("id", "log-tail").text, UI_WAIT_S, "rank 0's log lines")
    assert driver.find_element("id", "log-tail").get_attribute("data-rank") == "0"
    assert _js(driver, "return window.__not_reloaded === true")
    print(f"loss points per rank grew from {first} to {grown}")
    wait_for(lambda: loss_points({"0": 5, "1": 5}), 30, "6 loss points per rank (for the screenshot)")
    _screenshot(driver, f"dashboard-running-{job_id}.png")

    # the job list, while it trains: its step of the total (train_gpt.py reports total_steps), rank 0's loss,
    # the recent steps/s and an ETA; the same as the API's
    _js(driver, "location.hash = '#/';")
    listed = wait_for(lambda: _job_row(driver, job_id, lambda r: re.fullmatch(r"\d+ / 1500", r["step"])
                                       and r["rate"] != "–" and r["eta"] != "–"), 20, "progress in the job list")
    assert listed["state"] == "RUNNING" and 0 < int(listed["step"].split(" / ")[0]) < STEPS, listed
    assert re.fullmatch(r"\d+\.\d{4}", listed["loss"]) and float(listed["loss"]) > 0, listed
    assert re.fullmatch(r"\d+(\.\d+)?", listed["rate"]) and float(listed["rate"]) > 0, listed
    assert re.fullmatch(r"\d+s|\d+m\d\ds", listed["eta"]), listed
    assert listed["bar"] and 0 < float(listed["bar"].rstrip("%")) < 100, listed
    api_row = next(j for j in orch_m.http().get(f"{url}/api/jobs").json() if j["id"] == job_id)
    assert api_row["total_steps"] == STEPS and api_row["steps_per_second"] > 0 and api_row["eta_seconds"] > 0
    print(f"job list while running: {listed}")
    _screenshot(driver, f"dashboard-list-running-{job_id}.png")
    _js(driver, f"location.hash = '#/jobs/{job_id}';")
    wait_for(lambda: driver.find_element("id", "job-body").is_displayed(), UI_WAIT_S, "the job's page again")

    # it ends: the page follows to SUCCEEDED with every step shown, still without a reload
    wait_for(lambda: _js(driver, JOB_STATE_JS) == "SUCCEEDED", 240, "SUCCEEDED on the page", interval=0.5)
    print(f"trained {time.monotonic() - t_points:.1f} s after the first points; "
          f"SUCCEEDED {time.monotonic() - t0:.1f} s after submit")
    wait_for(lambda: [(r["state"], r["step"]) for r in _js(driver, RANKS_JS)] ==
             [("exited", str(STEPS)), ("exited", str(STEPS))], UI_WAIT_S, "both ranks exited at the last step")
    api = orch_m.http().get(f"{url}/api/jobs/{job_id}/progress").json()
    wait_for(lambda: sum(_js(driver, SERIES_JS, "svg#loss-chart").values()) == len(api["points"]), UI_WAIT_S,
             "every reported point on the chart")
    points = _js(driver, SERIES_JS, "svg#loss-chart")
    print(f"loss points per rank at the end: {points}")
    assert _js(driver, "return window.__not_reloaded === true")
    # the page reads only from its own server
    foreign = _js(driver, "return performance.getEntriesByType('resource').map(e => e.name)"
                          ".filter(n => !n.startsWith(location.origin))")
    assert foreign == []
    assert _severe_console_errors(driver) == []
    # back in the list, the finished job shows its last step and rank 0's final loss, no rate or ETA
    _js(driver, "location.hash = '#/';")
    done = wait_for(lambda: _job_row(driver, job_id, lambda r: r["state"] == "SUCCEEDED"), UI_WAIT_S,
                    "SUCCEEDED in the list")
    final_step, final_loss = _last_reported(orch_m, url, job_id)
    assert final_step == STEPS and done["step"] == f"{STEPS} / {STEPS}" and done["bar"] == "100%", done
    assert done["loss"] == f"{final_loss:.4f}" and done["rate"] == "–" and done["eta"] == "–", (done, final_loss)
    assert_no_leftovers(job_id)


def _last_reported(orch_m: Orch, url: str, job_id: str) -> tuple[int, float]:
    """The step every rank had reported (the least of the ranks' last) and rank 0's last loss, from the job's
    recorded points (``GET /api/jobs/{id}/progress``)."""
    points = orch_m.http().get(f"{url}/api/jobs/{job_id}/progress").json()["points"]
    last = {p["rank"]: p for p in points}  # (oldest first: the last one of each rank stays)
    return min(p["step"] for p in last.values()), last[0]["loss"]


def _job_row(driver, job_id: str, ok: Any) -> dict | None:
    """The job list's row of ``job_id`` as the page shows it, once ``ok(row)``; else None."""
    row = next((r for r in _js(driver, JOBS_JS) if r["id"] == job_id), None)
    return row if row is not None and ok(row) else None


def test_a_failed_job_shows_its_cause_and_the_failed_ranks_log(server, browser, orch_m, write_spec,
                                                              hostfile) -> None:
    _, url = server
    driver = browser
    spec = _spec(write_spec, hostfile, "web-fail", ["--fail-at-step", "30", "--fail-rank", "1",
                                                    "--checkpoint-interval", "10"])
    t0 = time.monotonic()
    job_id = orch_m.json("submit", str(spec), check=True)["id"]
    driver.get(f"{url}/#/jobs/{job_id}")  # a shared link opens the job directly
    wait_for(lambda: _js(driver, JOB_STATE_JS) in ("PROVISIONING", "RUNNING"), 30, "the job's page")
    wait_for(lambda: _js(driver, JOB_STATE_JS) == "FAILED", 180, "FAILED on the page", interval=0.5)
    print(f"\nFAILED on the page {time.monotonic() - t0:.1f} s after submit")
    # teardown still changes the job (the attempt's stopped_at, its owner): the page redraws
    # what changed, so read it once it has drawn the last change (no element goes stale)
    wait_for(lambda: (d := orch_m.json("status", job_id))["attempts"][0]["stopped_at"] and d["owner"] is None,
             30, "the attempt to have stopped")
    time.sleep(2.5)  # two refreshes of the page

    badge = driver.find_element("css selector", "#job-header .badge")
    assert badge.text == "FAILED" and _is_red(badge.value_of_css_property("background-color"))
    (step,) = driver.find_elements("css selector", "#job-header .next-step")
    assert step.text.startswith(f"next: resume from the last complete checkpoint: orch resume {job_id}"), step.text
    cause = wait_for(lambda: driver.find_elements("css selector",
                                                  '#attempts-table tr.attempt[data-attempt="1"] .cause'), UI_WAIT_S,
                     "the attempt's cause")[0]
    message = cause.find_element("css selector", ".cause-message").text
    assert re.search(r"rank 1 \(local rank 0\) on node-1 \(node 1\) exited with exit code 1", message), message
    assert cause.is_displayed() and _is_red(cause.value_of_css_property("color")), \
        cause.value_of_css_property("color")
    tail = driver.find_element("css selector", '#attempts-table tr.attempt-tail[data-attempt="1"] pre')
    assert "failing on purpose after step 30 on rank 1" in tail.get_attribute("textContent")
    # the ranks: rank 1 failed, rank 0 was stopped by orch
    wait_for(lambda: [r["state"] for r in _js(driver, RANKS_JS)] == ["stopped", "failed"], UI_WAIT_S,
             "rank states after the failure")
    # the log panel shows the failed rank's log (chosen by default)
    wait_for(lambda: driver.find_element("id", "log-tail").get_attribute("data-rank") == "1"
             and "failing on purpose" in driver.find_element("id", "log-tail").text, UI_WAIT_S, "rank 1's log tail")
    log = driver.find_element("id", "log-tail").text
    assert re.search(r"^\[train\] step=\d+ rank=1 ", log, re.MULTILINE) and not re.search(r"\brank=0 ", log), log
    assert driver.find_element("id", "log-rank").get_attribute("value") == "1"
    # its checkpoints: every tag saved, newest first, the newest complete one marked as the next resume's
    rows = wait_for(lambda: _js(driver, "return [...document.querySelectorAll('#checkpoints-table tr.checkpoint-row')]"
                                        ".map(r => [r.dataset.tag, r.dataset.state])"), UI_WAIT_S,
                    "the checkpoints panel")
    api = orch_m.json("status", job_id)["checkpoints"]
    assert rows == [[c["tag"], "next resume" if c["tag"] == api["next_resume"] else "complete" if c["complete"]
                     else "skipped"] for c in api["checkpoints"]]
    assert api["format"] == "orch" and api["next_resume"] in ("step_30", "step_20") and rows[-1][0] == "step_10"
    info = driver.find_element("id", "checkpoints-info").text
    assert "orch format" in info and f"next resume: {api['next_resume']}" in info, info
    _screenshot(driver, f"dashboard-failed-{job_id}.png")

    # back to the list: both jobs, the failed one with its cause
    driver.find_element("id", "home").click()
    wait_for(lambda: len(driver.find_elements("css selector", "tr.job-row")) == 2, UI_WAIT_S, "both jobs listed")
    states = _js(driver, "return [...document.querySelectorAll('tr.job-row')].map(r => r.dataset.state)")
    assert states == ["FAILED", "SUCCEEDED"]  # newest first
    # the failed job's row: the step it had reached (the slower rank's; rank 1 failed after step 30), rank 0's loss
    failed = _job_row(driver, job_id, lambda r: True)
    step, loss = _last_reported(orch_m, url, job_id)
    assert 20 <= step <= 31 and failed["step"] == f"{step} / {STEPS}", (failed, step)
    assert failed["loss"] == f"{loss:.4f}" and failed["rate"] == "–" and failed["eta"] == "–", (failed, loss)
    _screenshot(driver, "dashboard-list-finished.png")
    assert "exited with exit code 1" in _js(
        driver, f"return document.querySelector('tr.job-row[data-job-id=\"{job_id}\"] td.cause-cell').textContent")
    assert _severe_console_errors(driver) == []
    assert_no_leftovers(job_id)


def test_an_unknown_job_and_a_stopped_server_are_reported(server, browser) -> None:
    proc, url = server
    driver = browser
    driver.get(f"{url}/#/jobs/no-such-job")
    wait_for(lambda: any(e.is_displayed() for e in driver.find_elements("id", "job-missing")), UI_WAIT_S,
             "the unknown-job notice")
    assert "No job 'no-such-job'" in driver.find_element("id", "job-missing").text
    assert not driver.find_element("id", "job-body").is_displayed()
    driver.find_element("css selector", "#job-header a[href='#/']").click()
    wait_for(lambda: len(driver.find_elements("css selector", "tr.job-row")) == 2, UI_WAIT_S, "the list again")
    assert not driver.find_element("id", "conn-lost").is_displayed()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    wait_for(lambda: any(e.is_displayed() for e in driver.find_elements("id", "conn-lost")), UI_WAIT_S,
             "the connection-lost notice")
    assert "connection lost" in driver.find_element("id", "conn-lost").text
    assert len(driver.find_elements("css selector", "tr.job-row")) == 2  # what was shown stays


GOODPUT_JS = """const bar = document.querySelector('#goodput-bar');
return {shown: bar.offsetParent !== null, width: bar.getBoundingClientRect().width,
  ratio: document.querySelector('#goodput-ratio').textContent,
  segments: [...bar.querySelectorAll('.gp-seg')].map(s => ({category: s.dataset.category, title: s.title,
    width: s.getBoundingClientRect().width})),
  legend: [...document.querySelectorAll('#goodput-legend .gp-item')].map(i => i.dataset.category)};"""
LOSS_JS = """const svg = document.querySelector('svg#loss-chart');
return {attempts: [...new Set([...svg.querySelectorAll('polyline.series')].map(p => p.dataset.attempt))],
  points: [...svg.querySelectorAll('polyline.series')].map(p => [p.dataset.attempt, +p.dataset.points]),
  legend: [...svg.querySelectorAll('.legend-item')].map(g => g.textContent),
  markers: [...svg.querySelectorAll('.resume-marker')].map(m => ({attempt: m.dataset.attempt, step: +m.dataset.step,
    label: m.querySelector('text').textContent}))};"""


def test_a_resumed_job_shows_its_goodput_bar_and_its_loss_across_attempts(browser, write_spec, hostfile,
                                                                          tmp_path) -> None:
    # its own server and state (the module's server is stopped by the test before, and its job list counted)
    (tmp_path / "state").mkdir()
    orch = Orch(tmp_path / "state")
    spec = write_spec(name="web-resume", hostfile=str(hostfile("node-0 slots=1\nnode-1 slots=1\n")),
                      launcher="pdsh", workdir=str(EXAMPLES), entrypoint="train_gpt.py",
                      deepspeed_config=str(EXAMPLES / "ds_zero2.json"),
                      args=TINY + ["--steps", "60", "--checkpoint-interval", "10", "--fail-at-step", "25",
                                   "--fail-rank", "1"],
                      restart={"max_restarts": 1, "backoff_seconds": 0}, stop_grace_seconds=5,
                      env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    with running_server(orch) as (proc, url):
        driver = browser
        driver.get(proc.login_url)
        _severe_console_errors(driver)  # (drained: the module's stopped server's refused requests)
        job_id = orch.json("submit", str(spec), check=True)["id"]
        driver.get(f"{url}/#/jobs/{job_id}")
        wait_for(lambda: _js(driver, JOB_STATE_JS) == "SUCCEEDED", 600, "SUCCEEDED on the page", interval=0.5)
        wait_for(lambda: (d := orch.json("status", job_id))["attempts"][-1]["stopped_at"] and d["owner"] is None,
                 30, "the last attempt to have stopped")
        detail = orch.json("status", job_id)
        assert [a["state"] for a in detail["attempts"]] == ["FAILED", "SUCCEEDED"], detail["attempts"]
        tag = detail["attempts"][1]["resume_tag"]
        resumed = next(a["resume_step"] for a in detail["goodput"]["attempts"] if a["number"] == 2)
        assert tag and resumed == int(tag.rsplit("_", 1)[1]) and 0 < resumed <= 25, (tag, resumed)

        # the goodput bar: a segment per category with time, productive the widest part, the ratio as text
        g = orch.http().get(f"{url}/api/jobs/{job_id}/goodput").json()
        shown = wait_for(lambda: (v := _js(driver, GOODPUT_JS))["ratio"]
                         and _near(v["ratio"], r"effective ([\d.]+)% of ", 100 * g["effective_ratio"]) and v,
                         10, "the final goodput on the page")
        assert shown["shown"] and shown["width"] > 0, shown
        assert shown["legend"] == list(g["seconds"]), shown["legend"]
        segments = {s["category"]: s for s in shown["segments"]}
        assert set(segments) == {c for c, v in g["seconds"].items() if v > 0}, (segments, g["seconds"])
        for category in ("startup", "productive", "failure_detection", "restart_gap"):
            assert category in segments, (category, g["seconds"])
        assert segments["productive"]["width"] > 0
        title = segments["productive"]["title"]  # its seconds and share of the wall, on hover
        assert _near(title, r"^productive: ([\d.]+) s \(", g["seconds"]["productive"]), title
        assert _near(title, r" s \(([\d.]+)%\) · ", g["percent"]["productive"]), title
        assert f"{g['lost_steps']} lost step" in shown["ratio"] and g["lost_steps"] > 0, (shown["ratio"], g)

        # the loss chart: both attempts on one step axis, a colour each, one resume marker at the resumed step
        api = {n: orch.http().get(f"{url}/api/jobs/{job_id}/progress?attempt={n}").json()["points"] for n in (1, 2)}
        loss = wait_for(lambda: (v := _js(driver, LOSS_JS))["attempts"] == ["1", "2"] and v, UI_WAIT_S,
                        "both attempts on the loss chart")
        for n in (1, 2):  # every reported loss of each attempt is drawn (a point with no loss is not)
            with_loss = [p for p in api[n] if p.get("loss") is not None]
            assert sum(p for a, p in loss["points"] if a == str(n)) == len(with_loss) > 0, (n, loss["points"])
        assert loss["legend"] == ["attempt 1", "attempt 2"]
        assert loss["markers"] == [{"attempt": "2", "step": resumed, "label": f"attempt 2 from {tag}"}]
        colors = _js(driver, "return [...new Set([...document.querySelectorAll('svg#loss-chart polyline.series')]"
                             ".map(p => p.dataset.attempt + ' ' + p.getAttribute('stroke')))]")
        assert len(colors) == 2 and len({c.split()[1] for c in colors}) == 2, colors
        for sel in ("#goodput-bar", "#goodput-ratio", "svg#loss-chart", "svg#loss-chart .resume-marker text"):
            assert driver.find_element("css selector", sel).is_displayed(), sel

        # a screenshot of the page: a PNG, kept with the other screenshots too
        path = tmp_path / f"dashboard-resumed-{job_id}.png"
        height = _js(driver, "return Math.max(document.documentElement.scrollHeight, document.body.scrollHeight)")
        driver.set_window_size(1280, min(max(900, height + 140), 4000))
        try:
            assert driver.save_screenshot(str(path))
        finally:
            driver.set_window_size(1280, 900)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, len(data)
        width, page_height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 1000 and page_height >= 800, (width, page_height)
        _screenshot(driver, f"dashboard-resumed-{job_id}.png")
        assert _severe_console_errors(driver) == []
    assert_no_leftovers(job_id)


def _near(text: str, pattern: str, value: float) -> bool:
    """``pattern``'s number in ``text`` is ``value`` as shown with one decimal."""
    m = re.search(pattern, text)
    return m is not None and abs(float(m.group(1)) - value) <= 0.051
