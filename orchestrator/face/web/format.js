// orch dashboard's formatting helpers: building elements, and numbers, times and durations as the pages show
// them. Loaded before charts.js and app.js; defines window.OrchFormat. No dependencies.
"use strict";

window.OrchFormat = (() => {
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  const pad2 = (n) => String(n).padStart(2, "0");

  function fmtClock(date) {
    return `${pad2(date.getHours())}:${pad2(date.getMinutes())}:${pad2(date.getSeconds())}`;
  }

  function fmtTime(epoch) {
    if (epoch === null || epoch === undefined) return "–";
    const d = new Date(epoch * 1000);
    const now = new Date();
    if (d.toDateString() === now.toDateString()) return fmtClock(d);
    return `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
  }

  function fmtDur(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m${pad2(s % 60)}s`;
    return `${Math.floor(s / 3600)}h${pad2(Math.floor((s % 3600) / 60))}m`;
  }

  function fmtAgo(epoch) {
    if (!epoch) return "–";
    return `${fmtDur(Date.now() / 1000 - epoch)} ago`;
  }

  function num(v) {
    if (v === null || v === undefined || v === "") return null;
    const x = typeof v === "number" ? v : parseFloat(v);  // "nan"/"inf" -> NaN/Infinity
    return Number.isNaN(x) && String(v).toLowerCase() !== "nan" ? null : x;
  }

  function fmtLoss(v) {
    const x = num(v);
    if (x === null) return "–";
    if (!isFinite(x)) return String(x).toLowerCase().replace("infinity", "inf");
    return Math.abs(x) >= 1000 ? x.toExponential(3) : x.toFixed(4);
  }

  function fmtRate(v) {
    const x = num(v);
    if (x === null || !isFinite(x)) return "–";
    if (x >= 1e6) return `${(x / 1e6).toFixed(2)}M`;
    if (x >= 1e4) return `${(x / 1e3).toFixed(1)}k`;
    return x.toFixed(0);
  }

  function fmtSteps(v) {  // steps/s: about 3 significant digits
    const x = num(v);
    if (x === null || !isFinite(x)) return "–";
    return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2);
  }

  function fmtEta(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const s = Math.max(0, Math.round(seconds));
    return s < 86400 ? fmtDur(s) : `${Math.floor(s / 86400)}d${pad2(Math.floor((s % 86400) / 3600))}h`;
  }

  function stepCell(j) {
    // the slowest rank's step, of the total with a bar when the script reported one
    if (j.step === null || j.step === undefined) return el("td", {class: "num job-step", text: "–"});
    if (!j.total_steps) return el("td", {class: "num job-step", text: j.step});
    const pct = Math.min(100, (100 * j.step) / j.total_steps);
    return el("td", {class: "num job-step", title: `${pct.toFixed(1)}% of ${j.total_steps} steps`},
      el("span", {class: "step-text", text: `${j.step} / ${j.total_steps}`}),
      el("div", {class: "step-bar"}, el("div", {style: `width:${pct.toFixed(1)}%`})));
  }

  return {el, fmtClock, fmtTime, fmtDur, fmtAgo, num, fmtLoss, fmtRate, fmtSteps, fmtEta, stepCell};
})();
