// orch dashboard: polls the orch server's JSON API once a second and renders jobs, a job's
// attempts, nodes, ranks, training charts (inline SVG) and log tails. No dependencies.
"use strict";

(() => {
  const POLL_MS = 1000;
  const FETCH_TIMEOUT_MS = 5000;
  const LOG_LINES = 50;
  const LOG_BYTES = 16384;
  const PROGRESS_PAGE = 20000;
  const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
  const {color, drawChart} = window.OrchCharts;   // charts.js
  const {el, fmtTime, fmtDur, fmtAgo, num, fmtLoss, fmtRate, fmtSteps, fmtEta, stepCell, fmtClock} =
    window.OrchFormat;                             // format.js

  const S = {
    jobId: null,          // the open job (from the hash), or null for the list
    detail: null,
    keys: {},             // last rendered input of each section, to skip identical re-renders
    chartAttempt: null,   // attempt shown by charts and logs
    attemptPinned: false, // the user picked one (else: follow the current attempt)
    progs: new Map(),     // attempt number -> {job, attempt, lastId, byRank: Map<rank, point[]>, done, version}
    logRank: null,
    logPinned: false,
    logDone: null,        // key of a log read to its end after its attempt stopped
    timer: null,
    busy: false,
    again: false,
  };

  const $ = (sel) => document.querySelector(sel);

  // ------------------------------------------------------------------ helpers

  function badge(state, prefix, extra) {
    const cls = prefix === "state" ? `state-${state}` : `st-${String(state).replace(/\s+/g, "-")}`;
    return el("span", {class: `badge ${cls} ${extra || ""}`.trim(), "data-state": state, text: state});
  }

  function causeTail(cause) {
    if (!cause) return null;
    if (cause.log_tail && cause.log_tail.length) return {rank: cause.global_rank, lines: cause.log_tail};
    const first = cause.first_symptom;
    if (first && first.log_tail && first.log_tail.length) return {rank: first.global_rank, lines: first.log_tail};
    return null;
  }

  function causeRank(cause) {
    if (!cause) return null;
    if (Number.isInteger(cause.global_rank)) return cause.global_rank;
    if (cause.first_symptom && Number.isInteger(cause.first_symptom.global_rank)) return cause.first_symptom.global_rank;
    return null;
  }

  function changed(section, value) {
    const key = JSON.stringify(value);
    if (S.keys[section] === key) return false;
    S.keys[section] = key;
    return true;
  }

  class HttpError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function getJSON(path) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch(path, {cache: "no-store", signal: ctl.signal, headers: {Accept: "application/json"}});
      let body = null;
      try { body = await r.json(); } catch (_e) { body = null; }
      if (!r.ok) throw new HttpError(r.status, (body && body.error) || `HTTP ${r.status}`);
      return body;
    } finally {
      clearTimeout(timer);
    }
  }

  // ------------------------------------------------------------------ routing

  function route() {
    const m = location.hash.match(/^#\/jobs\/([^/?]+)/);
    const jobId = m ? decodeURIComponent(m[1]) : null;
    if (jobId !== S.jobId) {
      S.jobId = jobId;
      S.detail = null;
      S.chartAttempt = null;
      S.attemptPinned = false;
      S.progs = new Map();
      S.logRank = null;
      S.logPinned = false;
      S.logDone = null;
      S.keys = {};
      $("#log-tail").textContent = "";
      $("#job-body").hidden = true;
      $("#job-missing").hidden = true;
      for (const sel of ["#job-header", "#attempts-table tbody", "#ranks-table tbody", "#checkpoints-table tbody",
                         "#nodes", "#loss-chart", "#goodput-bar", "#goodput-legend",
                         "#rate-chart", "#chart-attempt", "#log-rank"]) {
        $(sel).replaceChildren();
      }
      for (const sel of ["#chart-info", "#goodput-ratio", "#log-info", "#nodes-attempt", "#ranks-attempt"]) {
        $(sel).textContent = "";
      }
    }
    $("#jobs-view").hidden = jobId !== null;
    $("#job-view").hidden = jobId === null;
    document.title = jobId ? `${jobId} · orch` : "orch";
    schedule(0);
  }

  // ------------------------------------------------------------------ polling

  function schedule(delay) {
    clearTimeout(S.timer);
    S.timer = setTimeout(tick, delay);
  }

  async function tick() {
    if (S.busy) { S.again = true; return; }
    S.busy = true;
    let reachable = true, refused = false;
    const guard = async (fn) => {
      try { await fn(); } catch (err) {
        if (err instanceof HttpError && err.status === 401) refused = true;   // logged out: the token changed
        else if (err instanceof HttpError) console.warn(err.message);   // the server answered
        else { reachable = false; console.warn("poll failed:", err); }
      }
    };
    await guard(refreshJobs);
    if (S.jobId && reachable && !refused) await guard(refreshJob);
    setConnection(reachable);
    $("#logged-out").hidden = !refused;
    S.busy = false;
    schedule(S.again ? 0 : POLL_MS);
    S.again = false;
  }

  function setConnection(ok) {
    $("#conn-lost").hidden = ok;
    document.body.classList.toggle("offline", !ok);
    if (ok) $("#updated").textContent = `updated ${fmtClock(new Date())}`;
  }

  // ------------------------------------------------------------------ jobs list

  async function refreshJobs() {
    const jobs = await getJSON("/api/jobs");
    const running = jobs.filter((j) => j.state === "RUNNING").length;
    $("#summary").textContent = `${jobs.length} job${jobs.length === 1 ? "" : "s"} · ${running} running`;
    if (!changed("jobs", jobs)) return;
    $("#jobs-empty").hidden = jobs.length > 0;
    const rows = jobs.map((j) => {
      const href = `#/jobs/${encodeURIComponent(j.id)}`;
      const cause = j.cause_message || "";
      return el("tr", {class: "job-row", "data-job-id": j.id, "data-state": j.state,
                       onclick: () => { location.hash = href; }},
        el("td", {class: "job-id mono"}, el("a", {href, text: j.id})),
        el("td", {class: "job-name", text: j.name}),
        el("td", {class: "job-state"}, badge(j.state, "state")),
        el("td", {class: "num", text: j.attempt}),
        el("td", {class: "num", text: j.restarts}),
        el("td", {class: "job-nodes", text: (j.nodes || []).join(", ") || "–"}),
        el("td", {class: "num", text: j.world_size ?? "–"}),
        stepCell(j),
        el("td", {class: "num job-loss", title: j.loss_step !== null && j.loss_step !== undefined ?
                  `at step ${j.loss_step}` : "", text: fmtLoss(j.loss)}),
        el("td", {class: "num job-rate", text: fmtSteps(j.steps_per_second)}),
        el("td", {class: "num job-eta", text: fmtEta(j.eta_seconds)}),
        el("td", {class: "job-updated", title: new Date(j.updated_at * 1000).toString(), text: fmtTime(j.updated_at)}),
        el("td", {class: `cause-cell${cause && j.state !== "FAILED" ? " muted" : ""}`, title: cause, text: cause}));
    });
    $("#jobs-table tbody").replaceChildren(...rows);
  }

  // ------------------------------------------------------------------ one job

  async function refreshJob() {
    const jobId = S.jobId;
    let detail;
    try {
      detail = await getJSON(`/api/jobs/${encodeURIComponent(jobId)}`);
    } catch (err) {
      if (err instanceof HttpError && err.status === 404) {
        const box = $("#job-missing");
        box.hidden = false;
        box.textContent = err.message;
        $("#job-body").hidden = true;
        if (S.keys.header !== "missing") {   // built once: a link rebuilt every poll loses clicks
          $("#job-header").replaceChildren(el("a", {href: "#/", text: "← all jobs"}));
          $("#job-header").removeAttribute("data-state");
          S.keys.header = "missing";
        }
        return;
      }
      throw err;
    }
    if (jobId !== S.jobId) return;          // navigated away meanwhile
    $("#job-missing").hidden = true;
    $("#job-body").hidden = false;
    S.detail = detail;
    const attempts = detail.attempts || [];
    if (!S.attemptPinned || !attempts.some((a) => a.number === S.chartAttempt)) {
      S.chartAttempt = detail.attempt;
      S.attemptPinned = false;
    }
    renderHeader(detail);
    renderGoodput(detail.goodput);
    renderAttempts(detail);
    renderNodes(detail);
    renderRanks(detail);
    renderCheckpoints(detail);
    renderAttemptSelect(detail);
    await refreshProgress(detail);
    await refreshLog(detail);
  }

  function renderHeader(d) {
    const cur = (d.attempts || []).find((a) => a.number === d.attempt);
    const since = cur && (cur.running_at || cur.created_at);
    const end = cur && (cur.ended_at || null);
    const value = [d.id, d.name, d.state, d.attempt, d.restarts, d.world_size, d.master_addr, d.master_port,
                   d.run_dir, d.cause, d.next_steps, d.updated_at, since, end, end ? 0 : Math.floor(Date.now() / 1000),
                   d.allocation];
    if (!changed("header", value)) return;
    const meta = (label, v) => el("span", {class: "meta"}, `${label} `, el("b", {text: v ?? "–"}));
    const parts = [
      el("a", {href: "#/", class: "back", title: "all jobs", text: "← jobs"}),
      el("span", {class: "title", text: d.name}),
      el("span", {class: "mono muted", text: d.id}),
      badge(d.state, "state", "big"),
      meta("attempt", d.attempt),
      meta("restarts", d.restarts),
      meta("world size", d.world_size),
      meta("master", d.master_addr ? `${d.master_addr}:${d.master_port}` : null),
      meta(end ? "ran" : "running for", since ? fmtDur((end || Date.now() / 1000) - since) : null),
      meta("state since", fmtTime(d.updated_at)),
      el("span", {class: "meta mono small", title: "run directory", text: d.run_dir || ""}),
    ];
    const header = $("#job-header");
    header.replaceChildren(...parts);
    header.setAttribute("data-state", d.state);
    if (d.cause && d.cause.message) {
      const cls = d.state === "FAILED" ? "cause" : "cause note";
      header.append(el("div", {id: "job-cause", class: cls, style: "flex-basis: 100%"},
        el("b", {text: d.state === "FAILED" ? "failed: " : "stopped: "}), d.cause.message,
        d.cause.kind ? el("span", {class: "kind", text: `(${d.cause.kind})`}) : null));
    }
    const alloc = d.allocation;
    if (d.state === "PENDING" && alloc && alloc.state !== "RUNNING") {  // in a scheduler's queue (slurm, login node)
      header.append(el("div", {id: "job-waiting", class: "cause note", style: "flex-basis: 100%"},
        el("b", {text: "waiting for Slurm: "}), alloc.message || ""));
    }
    for (const step of d.next_steps || []) {  // what to do now: the command that continues the job
      header.append(el("div", {class: "next-step", style: "flex-basis: 100%"}, el("b", {text: "next: "}), step));
    }
  }

  // what each goodput category means, for the legend's and the segments' titles (docs/goodput.md)
  const GOODPUT_MEANS = {
    queued: "submitted, waiting for its first attempt",
    startup: "provisioning, preflight, rank start to the first step",
    productive: "training steps that were kept",
    checkpoint: "checkpoint saves as orch sees them",
    lost_work: "steps done, then thrown away by a resume from an earlier step",
    failure_detection: "a failed attempt's last step to its end",
    wind_down: "an ended attempt's last step to its end (final saves, shutdown)",
    since_last_step: "a running attempt's newest step to now",
    restart_gap: "an attempt's end to the next attempt's start",
  };

  function renderGoodput(g) {
    // one bar, stacked by category (each segment's width its share of the wall time), a legend and the ratio
    if (!changed("goodput", g || null)) return;
    $("#goodput-panel").hidden = !g;
    if (!g) return;
    const wall = g.wall_seconds || 0;
    const cats = Object.keys(g.seconds || {});
    const secs = (c) => g.seconds[c] || 0;
    const pct = (c) => (g.percent && g.percent[c] !== undefined ? g.percent[c] : wall > 0 ? 100 * secs(c) / wall : 0);
    const tip = (c) => `${c}: ${secs(c).toFixed(1)} s (${pct(c).toFixed(1)}%) · ${GOODPUT_MEANS[c] || ""}`;
    $("#goodput-bar").replaceChildren(...cats.filter((c) => secs(c) > 0).map((c) =>
      el("div", {class: `gp-seg gp-${c}`, "data-category": c, "data-seconds": secs(c).toFixed(3),
                 style: `width:${pct(c).toFixed(3)}%`, title: tip(c)})));
    $("#goodput-legend").replaceChildren(...cats.map((c) =>
      el("span", {class: `gp-item${secs(c) > 0 ? "" : " muted"}`, "data-category": c, title: tip(c)},
        el("span", {class: `gp-swatch gp-${c}`}),
        `${c.replace(/_/g, " ")} ${secs(c) < 60 ? `${secs(c).toFixed(1)}s` : fmtDur(secs(c))} (${pct(c).toFixed(1)}%)`)));
    const ratio = 100 * (g.effective_ratio || 0);
    $("#goodput-ratio").textContent = `effective ${ratio.toFixed(1)}% of ${fmtDur(wall)} wall` +
      (g.lost_steps ? ` · ${g.lost_steps} lost step${g.lost_steps === 1 ? "" : "s"}` : "") +
      (g.running ? " · so far" : "");
    $("#goodput-ratio").setAttribute("data-ratio", g.effective_ratio);
  }

  function renderAttempts(d) {
    const attempts = d.attempts || [];
    if (!changed("attempts", [attempts, attempts.some((a) => !a.ended_at) ? Math.floor(Date.now() / 1000) : 0])) return;
    const rows = [];
    for (const a of [...attempts].reverse()) {
      const started = a.running_at || a.created_at;
      const cause = a.cause;
      const failed = a.state === "FAILED";
      let causeCell = el("span", {class: "muted", text: "–"});
      if (cause && cause.message) {
        causeCell = el("div", {class: failed ? "cause" : "cause-note muted"},
          el("span", {class: "cause-message", text: cause.message}),
          cause.kind ? el("span", {class: "kind", text: `(${cause.kind})`}) : null);
      }
      rows.push(el("tr", {class: "attempt", "data-attempt": a.number, "data-state": a.state},
        el("td", {class: "num", text: a.number}),
        el("td", {}, badge(a.state, "state")),
        el("td", {class: "wrap", text: (a.nodes || []).join(", ")}),
        el("td", {class: "mono resume-tag", text: a.resume_tag || "fresh start"}),
        el("td", {text: fmtTime(started)}),
        el("td", {text: started ? fmtDur((a.ended_at || Date.now() / 1000) - started) : "–"}),
        el("td", {class: "cause-td"}, causeCell)));
      const tail = cause && causeTail(cause);
      if (tail) {
        rows.push(el("tr", {class: "attempt-tail", "data-attempt": a.number},
          el("td", {colspan: 7},
            el("div", {class: failed ? "cause tail-box" : "cause-note muted tail-box"},
              el("div", {class: "small", text: `last lines of rank ${tail.rank ?? "?"}'s log (attempt ${a.number}):`}),
              el("pre", {class: "log-tail-lines", text: tail.lines.slice(-20).join("\n")})))));
      }
    }
    $("#attempts-table tbody").replaceChildren(...rows);
    for (const pre of document.querySelectorAll("#attempts-table pre.log-tail-lines")) pre.scrollTop = pre.scrollHeight;
  }

  function renderNodes(d) {
    const nodes = d.node_states || [];
    $("#nodes-attempt").textContent = `attempt ${d.attempt}`;
    if (!changed("nodes", nodes)) return;
    $("#nodes").replaceChildren(...nodes.map((n) => el("div", {class: "node", "data-node-rank": n.node_rank,
                                                                 "data-state": n.state},
      el("div", {}, el("span", {class: "host", text: n.host}), badge(n.state, "st")),
      el("div", {class: "sub", text: `node ${n.node_rank} · ranks ${n.ranks.join(", ")}` +
                                      (n.metrics_port ? ` · metrics :${n.metrics_port}` : "")}))));
    if (!nodes.length) $("#nodes").append(el("span", {class: "muted", text: "no nodes planned yet"}));
  }

  function renderRanks(d) {
    const ranks = d.ranks || [];
    $("#ranks-attempt").textContent = `attempt ${d.attempt}`;
    if (!changed("ranks", [ranks, Math.floor(Date.now() / 1000)])) return;
    $("#ranks-table tbody").replaceChildren(...ranks.map((r) => {
      const stepTime = num(r.step_seconds);
      const state = r.state;
      const slow = r.straggler;  // flagged by orch's straggler detection (the spec's straggler section)
      return el("tr", {class: slow ? "rank-row straggler" : "rank-row", "data-rank": r.global_rank,
                       "data-state": r.state, title: slow ? slow.message || "straggler" : null},
        el("td", {class: "num"}, el("span", {style: `color:${color(r.global_rank)}`, text: "● "}), r.global_rank),
        el("td", {text: `${r.host} (${r.node_rank})`}),
        el("td", {class: "num", text: r.local_rank}),
        el("td", {class: "num mono", text: r.pid ?? "–"}),
        el("td", {class: "rank-state", title: r.how || ""}, badge(state, "st"),
           r.how && r.state !== "exited" ? el("span", {class: "muted small", text: ` ${r.how}`}) : null,
           slow ? el("span", {class: "straggler-badge", text: ` straggler ×${slow.ratio ?? "?"}`}) : null),
        el("td", {class: "num rank-step", text: r.step ?? "–"}),
        el("td", {class: "num rank-loss", text: fmtLoss(r.loss)}),
        el("td", {class: "num rank-tps", text: fmtRate(r.tokens_per_second)}),
        el("td", {class: "num", text: stepTime === null ? "–" : `${(stepTime * 1000).toFixed(1)} ms`}),
        el("td", {class: "muted", title: r.progress_source || "", text: r.reported_at ? fmtAgo(r.reported_at) : "–"}),
        el("td", {class: "last-line mono", title: r.last_line || "", text: r.last_line || ""}));
    }));
  }

  function renderCheckpoints(d) {
    // every checkpoint found (orch status's view): which is complete, which skipped and why, the next resume's
    const v = d.checkpoints;
    if (!changed("checkpoints", v)) return;
    const info = $("#checkpoints-info");
    if (!v) {
      info.textContent = "";
      $("#checkpoints-table tbody").replaceChildren();
      return;
    }
    info.textContent = `${v.dir} · ${v.format || "?"} format (${v.format_reason || ""})` +
      (v.next_resume ? ` · next resume: ${v.next_resume}` : " · no checkpoint to resume from");
    const rows = (v.checkpoints || []).map((c) => {
      const next = c.tag === v.next_resume;
      const state = next ? "next resume" : c.complete ? "complete" : "skipped";
      return el("tr", {class: "checkpoint-row", "data-tag": c.tag, "data-state": state},
        el("td", {class: "mono", text: c.tag}),
        el("td", {class: "num", text: c.step >= 0 ? c.step : "?"}),
        el("td", {class: c.complete ? "" : "cause"}, el("b", {text: state}),
           c.complete ? null : el("span", {class: "small", text: `: ${(c.problems || []).join("; ")}`})),
        el("td", {class: "muted small", text: c.checked || ""}),
        el("td", {class: "num", text: c.recorded_files ?? 0}));
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 5, class: "muted", text: "none found"})));
    $("#checkpoints-table tbody").replaceChildren(...rows);
  }

  function renderAttemptSelect(d) {
    const sel = $("#chart-attempt");
    const numbers = (d.attempts || []).map((a) => a.number).reverse();
    if (changed("attempt-options", [numbers, d.attempt])) {
      sel.replaceChildren(...numbers.map((n) => el("option", {value: n,
        text: n === d.attempt ? `${n} (current)` : String(n)})));
    }
    if (S.chartAttempt !== null) sel.value = String(S.chartAttempt);
  }

  // ------------------------------------------------------------------ progress and charts

  async function refreshProgress(d) {
    // every attempt's reported points (read once after it stopped, then kept): the loss chart shows them all,
    // the rate chart the chosen attempt's
    const attempts = d.attempts || [];
    for (const rec of attempts) {
      let prog = S.progs.get(rec.number);
      if (!prog || prog.job !== d.id) {
        prog = {job: d.id, attempt: rec.number, lastId: 0, byRank: new Map(), done: false, version: 0};
        S.progs.set(rec.number, prog);
      }
      if (prog.done) continue;
      const stopped = !!rec.stopped_at;
      for (let page = 0; page < 20; page++) {
        const res = await getJSON(`/api/jobs/${encodeURIComponent(d.id)}/progress?attempt=${rec.number}` +
                                  `&since=${prog.lastId}&limit=${PROGRESS_PAGE}`);
        if (S.progs.get(rec.number) !== prog || S.jobId !== d.id) return;   // switched job meanwhile
        for (const p of res.points) {
          if (!prog.byRank.has(p.rank)) prog.byRank.set(p.rank, []);
          prog.byRank.get(p.rank).push(p);
        }
        if (res.points.length) prog.version++;
        prog.lastId = res.last_id;
        if (res.points.length < PROGRESS_PAGE) break;
      }
      if (stopped) prog.done = true;        // one full read after the attempt stopped
    }
    const rec = attempts.find((a) => a.number === S.chartAttempt);
    const t0 = rec ? (rec.running_at || rec.created_at) : null;
    const markers = resumeMarkers(d);
    const versions = attempts.map((a) => (S.progs.get(a.number) || {}).version);
    if (changed("charts", [d.id, S.chartAttempt, versions, t0, markers])) renderCharts(d, t0, markers);
  }

  function resumeMarkers(d) {
    // one per attempt after the first, at the step it resumed from: goodput's resume_step (docs/goodput.md),
    // else the number the tag ends with, else 0 (a fresh start)
    const known = new Map(((d.goodput || {}).attempts || []).map((a) => [a.number, a.resume_step]));
    return (d.attempts || []).filter((a) => a.number > 1).map((a) => {
      const m = /(\d+)$/.exec(a.resume_tag || "");
      const step = known.has(a.number) && known.get(a.number) !== null ? known.get(a.number) :
        m ? Number(m[1]) : 0;
      return {x: step, attempt: a.number, label: `attempt ${a.number} from ${a.resume_tag || "a fresh start"}`};
    });
  }

  function lossPoints(pts) {
    const loss = [];
    let nonFinite = 0;
    for (const p of pts) {
      const y = num(p.loss);
      if (y === null) continue;
      if (!isFinite(y)) { nonFinite++; continue; }
      loss.push([p.step, y]);
    }
    return {loss, nonFinite};
  }

  function renderCharts(d, t0, markers) {
    const numbers = (d.attempts || []).map((a) => a.number).filter((n) => S.progs.has(n));
    const several = numbers.length > 1;   // then: a colour per attempt (else per rank)
    const lossSeries = [];
    let nonFinite = 0;
    for (const n of numbers) {
      const prog = S.progs.get(n);
      for (const rank of [...prog.byRank.keys()].sort((a, b) => a - b)) {
        const got = lossPoints(prog.byRank.get(rank));
        nonFinite += n === S.chartAttempt ? got.nonFinite : 0;
        lossSeries.push({rank, attempt: n, pts: got.loss, color: several ? color(n - 1) : undefined,
                         title: `attempt ${n} · rank ${rank}`});
      }
    }
    const prog = S.progs.get(S.chartAttempt);
    const ranks = prog ? [...prog.byRank.keys()].sort((a, b) => a - b) : [];
    const rateSeries = [];
    let total = 0;
    for (const rank of ranks) {
      const pts = prog.byRank.get(rank);
      total += pts.length;
      const rate = [];
      const base = t0 || (pts.length ? pts[0].at : 0);
      for (let i = 1; i < pts.length; i++) {
        const dt = pts[i].at - pts[i - 1].at;
        const ds = pts[i].step - pts[i - 1].step;
        if (dt > 0 && ds >= 0) rate.push([pts[i].at - base, ds / dt]);
      }
      rateSeries.push({rank, pts: rate});
    }
    const last = ranks.map((r) => { const p = prog.byRank.get(r); return p[p.length - 1].step; });
    $("#chart-info").textContent = total
      ? `${total} reported points · step ${Math.min(...last)}–${Math.max(...last)}` +
        (nonFinite ? ` · ${nonFinite} non-finite losses not drawn` : "")
      : "no reported steps yet";
    $("#loss-caption").textContent = several
      ? "loss vs step, every attempt (a colour each; dashed: where an attempt resumed from)"
      : "loss per rank vs step";
    drawChart($("#loss-chart"), lossSeries, {
      xLabel: "step", yLabel: "loss", xInteger: true,
      empty: "waiting for reported steps…", markers,
      legend: several ? numbers.map((n) => ({label: `attempt ${n}`, color: color(n - 1),
                                             attrs: {"data-attempt": n}})) : undefined,
    });
    drawChart($("#rate-chart"), rateSeries, {
      xLabel: "time (s)", yLabel: "steps/s", yZero: true, xTime: true,
      empty: "needs two reports of a rank…",
    });
  }

  // ------------------------------------------------------------------ log tail

  async function refreshLog(d) {
    const attempt = S.chartAttempt;
    const rec = (d.attempts || []).find((a) => a.number === attempt);
    if (!rec) return;
    const world = rec.world_size || (attempt === d.attempt ? (d.ranks || []).length : 0);
    const sel = $("#log-rank");
    const hosts = new Map((attempt === d.attempt ? d.ranks || [] : []).map((r) => [r.global_rank, r.host]));
    if (changed("log-options", [attempt, world, [...hosts]])) {
      const opts = [];
      for (let r = 0; r < world; r++) {
        opts.push(el("option", {value: r, text: hosts.has(r) ? `${r} (${hosts.get(r)})` : String(r)}));
      }
      sel.replaceChildren(...opts);
    }
    if (!S.logPinned || S.logRank === null || S.logRank >= world) {
      const failed = causeRank(rec.cause);
      S.logRank = failed !== null && failed < world ? failed : 0;
      S.logPinned = false;
    }
    if (!world) return;
    sel.value = String(S.logRank);
    const key = `${d.id}/${attempt}/${S.logRank}`;
    if (S.logDone === key) return;
    const res = await getJSON(`/api/jobs/${encodeURIComponent(d.id)}/logs?rank=${S.logRank}&attempt=${attempt}` +
                              `&offset=-1&limit=${LOG_BYTES}`);
    if (`${S.jobId}/${S.chartAttempt}/${S.logRank}` !== key) return;
    let lines = res.data.split("\n");
    if (res.offset - new Blob([res.data]).size > 0) lines = lines.slice(1);   // a partial first line
    if (lines.length && lines[lines.length - 1] === "") lines.pop();
    lines = lines.slice(-LOG_LINES);
    const pre = $("#log-tail");
    const text = lines.join("\n");
    $("#log-info").textContent = `last ${lines.length} lines of ${res.path}` + (res.eof ? " · ended" : " · live");
    pre.setAttribute("data-rank", S.logRank);
    pre.setAttribute("data-attempt", attempt);
    if (pre.textContent !== text) {
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4 || !pre.textContent;
      pre.textContent = text || "(empty)";
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    }
    if (res.eof) S.logDone = key;
  }

  // ------------------------------------------------------------------ start

  $("#chart-attempt").addEventListener("change", (e) => {
    S.chartAttempt = Number(e.target.value);
    S.attemptPinned = S.detail ? S.chartAttempt !== S.detail.attempt : true;
    S.logPinned = false;
    S.logDone = null;
    schedule(0);
  });
  $("#log-rank").addEventListener("change", (e) => {
    S.logRank = Number(e.target.value);
    S.logPinned = true;
    S.logDone = null;
    schedule(0);
  });
  window.addEventListener("hashchange", route);
  route();
})();
