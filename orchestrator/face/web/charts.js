// orch dashboard's charts: line charts in inline SVG (loss per step, step rate over time), with vertical
// markers (resumes). Loaded before app.js; defines window.OrchCharts. No dependencies.
"use strict";

window.OrchCharts = (() => {
  const SVGNS = "http://www.w3.org/2000/svg";
  const MAX_DRAWN = 2500;            // points drawn per series (all are counted)
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf"];

  function color(i) { return COLORS[i % COLORS.length]; }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") node.textContent = v;
      else node.setAttribute(k, String(v));
    }
    for (const c of children.flat()) if (c) node.append(c);
    return node;
  }

  function fmtTick(v, step) {
    if (Math.abs(v) >= 1e5) return v.toExponential(1);
    let digits = 0;   // as many decimals as the tick step needs (0.25 -> 2)
    while (digits < 6 && Math.abs(Math.round(step * 10 ** digits) - step * 10 ** digits) > 1e-6) digits++;
    return v.toFixed(digits);
  }

  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400];

  function niceScale(lo, hi, count, opts) {
    if (!isFinite(lo) || !isFinite(hi)) { lo = 0; hi = 1; }
    if (hi - lo < 1e-12) {
      const pad = Math.abs(hi) > 1e-9 ? Math.abs(hi) * 0.1 : 1;
      lo -= pad; hi += pad;
      if (opts.zero && lo < 0 && hi > 0 && lo + pad >= 0) lo = 0;
    }
    const raw = (hi - lo) / count;
    let step;
    if (opts.time) {
      step = TIME_STEPS.find((s) => s >= raw) || Math.ceil(raw / 86400) * 86400;
    } else {
      const mag = Math.pow(10, Math.floor(Math.log10(raw)));
      const norm = raw / mag;
      step = (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 2.5 ? 2.5 : norm <= 5 ? 5 : 10) * mag;
      if (opts.integer && !Number.isInteger(step)) step = step < 1 ? 1 : step < 2 ? 2 : 5;
    }
    const min = Math.floor(lo / step + 1e-9) * step;
    const max = Math.ceil(hi / step - 1e-9) * step;
    const ticks = [];
    for (let v = min; v <= max + step * 1e-6; v += step) ticks.push(Math.round(v / step) * step);
    return {min, max: max > min ? max : min + step, step, ticks};
  }

  function fmtSeconds(v) {
    if (v < 60) return `${Math.round(v)}`;
    const s = Math.round(v);
    if (s < 3600) return `${Math.floor(s / 60)}:${pad2(s % 60)}`;
    return `${Math.floor(s / 3600)}:${pad2(Math.floor((s % 3600) / 60))}:${pad2(s % 60)}`;
  }

  /**
   * Draw a line chart into the <svg> `node` (viewBox 600x260).
   * series: [{rank, pts: [[x, y], ...], color?, attempt?, title?}]: one polyline each (colour: `color`, else
   *   the rank's); `attempt` and `title` become its data-attempt and <title>.
   * opts: {xLabel, yLabel, empty (text with no points), xInteger, xTime (x in seconds), yZero (y from 0),
   *   legend: [{label, color, attrs}] (default: one "rank N" item per series),
   *   markers: [{x, label, attempt}]: a dashed vertical line at x, labelled (a resume's step)}.
   */
  function drawChart(node, series, opts) {
    const W = 600, H = 260, L = 56, R = 14, B = 36;
    const ITEM = 64;
    const items = opts.legend || series.map((s) => ({label: `rank ${s.rank}`, color: s.color || color(s.rank),
                                                      attrs: {"data-rank": s.rank}}));
    const widths = items.map((it) => Math.max(ITEM, 22 + 6.5 * it.label.length));
    const perRow = Math.max(1, Math.floor((W - L - R) / Math.max(...widths, ITEM)));
    const legendRows = Math.ceil(items.length / perRow);
    const T = 10 + Math.max(1, legendRows) * 14;
    const pw = W - L - R, ph = H - T - B;
    const all = series.flatMap((s) => s.pts);
    const markers = opts.markers || [];
    const parts = [];
    if (!all.length) {
      parts.push(svg("rect", {class: "frame", x: L, y: T, width: pw, height: ph, fill: "none", stroke: "currentColor",
                              "stroke-opacity": 0.15}));
      parts.push(svg("text", {class: "empty", x: L + pw / 2, y: T + ph / 2, "text-anchor": "middle", text: opts.empty}));
    } else {
      let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
      for (const [x, y] of all) {
        if (x < x0) x0 = x; if (x > x1) x1 = x;
        if (y < y0) y0 = y; if (y > y1) y1 = y;
      }
      for (const m of markers) { if (m.x < x0) x0 = m.x; if (m.x > x1) x1 = m.x; }
      if (opts.yZero) y0 = Math.min(0, y0);
      const xs = niceScale(x0, x1, 6, {integer: opts.xInteger, time: opts.xTime});
      const ys = niceScale(y0, y1, 5, {zero: opts.yZero});
      const px = (x) => L + ((x - xs.min) / (xs.max - xs.min)) * pw;
      const py = (y) => T + ph - ((y - ys.min) / (ys.max - ys.min)) * ph;
      const grid = svg("g", {class: "grid"});
      for (const v of ys.ticks) {
        grid.append(svg("line", {class: "gridline", x1: L, x2: L + pw, y1: py(v), y2: py(v)}));
        grid.append(svg("text", {class: "tick y-tick", x: L - 6, y: py(v) + 4, "text-anchor": "end",
                                 text: fmtTick(v, ys.step)}));
      }
      for (const v of xs.ticks) {
        grid.append(svg("line", {class: "gridline", x1: px(v), x2: px(v), y1: T, y2: T + ph}));
        grid.append(svg("text", {class: "tick x-tick", x: px(v), y: T + ph + 15, "text-anchor": "middle",
                                 text: opts.xTime ? fmtSeconds(v) : fmtTick(v, xs.step)}));
      }
      parts.push(grid);
      parts.push(svg("line", {class: "axis x-axis", x1: L, x2: L + pw, y1: T + ph, y2: T + ph}));
      parts.push(svg("line", {class: "axis y-axis", x1: L, x2: L, y1: T, y2: T + ph}));
      parts.push(drawSeries(series, px, py));
      if (markers.length) parts.push(drawMarkers(markers, px, T, ph));
    }
    parts.push(svg("text", {class: "axis-label", x: L + pw / 2, y: H - 4, "text-anchor": "middle", text: opts.xLabel}));
    parts.push(svg("text", {class: "axis-label", x: 12, y: T + ph / 2, "text-anchor": "middle",
                            transform: `rotate(-90 12 ${T + ph / 2})`, text: opts.yLabel}));
    // legend: above the plot, right-aligned, wrapping into rows
    const legend = svg("g", {class: "legend"});
    const item = Math.max(...widths, ITEM);
    items.forEach((it, i) => {
      const row = Math.floor(i / perRow);
      const inRow = Math.min(perRow, items.length - row * perRow);
      const x = L + pw - inRow * item + (i % perRow) * item, y = 4 + row * 14;
      legend.append(svg("g", {class: "legend-item", ...(it.attrs || {})},
        svg("rect", {x, y: y + 4, width: 14, height: 3, fill: it.color}),
        svg("text", {x: x + 18, y: y + 9, text: it.label})));
    });
    parts.push(legend);
    node.replaceChildren(...parts);
    node.setAttribute("data-series", series.length);
  }

  function drawSeries(series, px, py) {
    const lines = svg("g", {class: "series-group"});
    for (const s of series) {
      const stride = Math.max(1, Math.ceil(s.pts.length / MAX_DRAWN));
      const drawn = s.pts.filter((_p, i) => i % stride === 0 || i === s.pts.length - 1);
      const coords = drawn.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" ");
      const last = s.pts[s.pts.length - 1];
      const stroke = s.color || color(s.rank);
      lines.append(svg("polyline", {class: "series", "data-rank": s.rank, "data-attempt": s.attempt,
                                    "data-points": s.pts.length, "data-last-x": last ? last[0] : "",
                                    points: coords, stroke}, s.title ? svg("title", {text: s.title}) : null));
      if (last) {
        lines.append(svg("circle", {class: "last-point", "data-rank": s.rank, "data-attempt": s.attempt,
                                    cx: px(last[0]).toFixed(1), cy: py(last[1]).toFixed(1), r: 2.5, fill: stroke}));
      }
    }
    return lines;
  }

  function drawMarkers(markers, px, T, ph) {
    // a dashed vertical line per marker, its label written down along it, inside the plot
    const g = svg("g", {class: "markers"});
    for (const m of markers) {
      const x = px(m.x);
      g.append(svg("g", {class: "resume-marker", "data-attempt": m.attempt, "data-step": m.x},
        svg("title", {text: m.label}),
        svg("line", {x1: x, x2: x, y1: T, y2: T + ph}),
        svg("text", {class: "marker-label", x: x + 3, y: T + 4, transform: `rotate(90 ${x + 3} ${T + 4})`,
                     text: m.label})));
    }
    return g;
  }

  return {color, drawChart};
})();
