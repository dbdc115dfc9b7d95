// The lanegate status page: polls /status.json and draws each lane as small SVG charts.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = { a: "#1565c0", b: "#8e24aa", red: "#c62828", budget: "#ef6c00" };
const W = 520, H = 150, PAD_L = 78, PAD_B = 8, PAD_T = 22;

function el(tag, attrs = {}, text = "") {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
                                      : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function fmtMs(v) {
  if (v === null || v === undefined) return "n/a";
  return v >= 1000 ? (v / 1000).toFixed(2) + " s" : Math.round(v) + " ms";
}

function fmtValue(v, unit) {
  if (v === null || v === undefined) return "n/a";
  if (unit === "ms") return fmtMs(v);
  if (unit === "%") return Math.round(v * 100) + " %";
  if (unit === "s") return v.toFixed(1) + " s";
  return String(Math.round(v * 10) / 10);
}

// series: [{name, color, values: [[t, v|null], ...]}]; lines: [{value, color, label}]
function lineChart(title, series, unit, lines = []) {
  const box = el("div", { class: "chart" });
  box.appendChild(el("div", { class: "title" }, title));
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, "data-chart": title });
  const points = series.flatMap(s => s.values.filter(p => p[1] !== null));
  const ts = points.map(p => p[0]);
  const t0 = Math.min(...ts), t1 = Math.max(...ts);
  let top = Math.max(0, ...points.map(p => p[1]), ...lines.map(l => l.value * 1.1));
  if (unit === "%") top = Math.max(top, 0.1);
  if (top <= 0) top = 1;
  const x = t => PAD_L + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (W - PAD_L - 4);
  const y = v => PAD_T + (1 - v / top) * (H - PAD_T - PAD_B);
  svg.appendChild(el("svg:line", { x1: PAD_L, y1: y(0), x2: W - 4, y2: y(0), stroke: "#d9dee4" }));
  svg.appendChild(el("svg:text", { x: 2, y: y(top) + 16 }, fmtValue(top, unit)));
  svg.appendChild(el("svg:text", { x: 2, y: y(0) }, fmtValue(0, unit)));
  for (const line of lines) {
    svg.appendChild(el("svg:line", { x1: PAD_L, y1: y(line.value), x2: W - 4, y2: y(line.value),
                                     stroke: line.color, "stroke-dasharray": "4 3" }));
    svg.appendChild(el("svg:text", { x: W - 4, y: y(line.value) - 4, "text-anchor": "end",
                                     style: `fill:${line.color}` }, line.label));
  }
  for (const s of series) {
    const d = [];
    let pen = "M";
    for (const [t, v] of s.values) {
      if (v === null) { pen = "M"; continue; }
      d.push(`${pen}${x(t).toFixed(1)},${y(v).toFixed(1)}`);
      pen = "L";
    }
    if (d.length) {
      svg.appendChild(el("svg:path", { d: d.join(" "), fill: "none", stroke: s.color,
                                       "stroke-width": 1.5, "data-series": s.name }));
    }
  }
  if (!points.length) {
    svg.appendChild(el("svg:text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
  }
  box.appendChild(svg);
  const legend = el("div", { class: "legend" });
  for (const s of series) {
    const last = [...s.values].reverse().find(p => p[1] !== null);
    legend.appendChild(el("span", { style: `color:${s.color}` },
                          `${s.name} ${fmtValue(last ? last[1] : null, unit)}`));
  }
  box.appendChild(legend);
  return box;
}

function seriesOf(history, lane, field) {
  return history.map(p => [p.t, p.lanes[lane] ? p.lanes[lane][field] ?? null : null]);
}

function figure(label, value) {
  const f = el("div", { class: "figure" });
  f.appendChild(el("b", {}, value));
  f.appendChild(el("span", { class: "muted" }, label));
  return f;
}

function laneCard(name, lane, status) {
  const h = status.history;
  const card = el("section", { class: "lane", "data-lane": name });
  card.appendChild(el("h2", {}, `${name} lane`));
  const figs = el("div", { class: "figures" });
  figs.appendChild(figure("workers", String(lane.workers)));
  if (name !== "batch") {
    figs.appendChild(figure("active sessions", String(lane.active_sessions)));
    figs.appendChild(figure("free slots", `${lane.free_slots} / ${lane.slots}`));
    figs.appendChild(figure("partial p50 / p99", `${fmtMs(lane.partial_latency_ms.p50)} / ` +
                            fmtMs(lane.partial_latency_ms.p99)));
  }
  figs.appendChild(figure("step p50 / p99", `${fmtMs(lane.step_duration_ms.p50)} / ` +
                          fmtMs(lane.step_duration_ms.p99)));
  card.appendChild(figs);
  const charts = el("div", { class: "charts" });
  const red = { value: status.red_line_ms, color: COLORS.red, label: `${status.red_line_ms} ms` };
  const budget = { value: status.step_budget_ms, color: COLORS.budget,
                   label: `${status.step_budget_ms} ms budget` };
  if (name !== "batch") {
    charts.appendChild(lineChart("partial latency", [
      { name: "p50", color: COLORS.a, values: seriesOf(h, name, "partial_p50_ms") },
      { name: "p99", color: COLORS.b, values: seriesOf(h, name, "partial_p99_ms") }],
      "ms", [red]));
    charts.appendChild(lineChart("step duration", [
      { name: "p50", color: COLORS.a, values: seriesOf(h, name, "step_p50_ms") },
      { name: "p99", color: COLORS.b, values: seriesOf(h, name, "step_p99_ms") }],
      "ms", name === "realtime" ? [budget] : []));
    charts.appendChild(lineChart("sessions and free slots", [
      { name: "active", color: COLORS.a, values: seriesOf(h, name, "active_sessions") },
      { name: "free", color: COLORS.b, values: seriesOf(h, name, "free_slots") }], ""));
    charts.appendChild(lineChart("live stall behind long prefills", [
      { name: "stall p99", color: COLORS.b, values: seriesOf(h, name, "stall_p99_ms") }],
      "ms", [red]));
    charts.appendChild(lineChart("share of wall time in long prefills", [
      { name: "share", color: COLORS.a, values: seriesOf(h, name, "long_prefill_share") }],
      "%"));
  } else {
    charts.appendChild(lineChart("step duration", [
      { name: "p50", color: COLORS.a, values: seriesOf(h, name, "step_p50_ms") },
      { name: "p99", color: COLORS.b, values: seriesOf(h, name, "step_p99_ms") }], "ms"));
  }
  card.appendChild(charts);
  return card;
}

function queueCard(status) {
  const h = status.history;
  const card = el("section", { class: "lane", "data-lane": "queue" });
  const consumer = status.design === "mixed" ? "the mixed worker" : "the batch lane";
  card.appendChild(el("h2", {}, `job queue (consumed by ${consumer})`));
  const figs = el("div", { class: "figures" });
  figs.appendChild(figure("queued or running jobs", String(status.queue.depth ?? "n/a")));
  figs.appendChild(figure("oldest job", fmtValue(status.queue.oldest_age_s, "s")));
  card.appendChild(figs);
  const charts = el("div", { class: "charts" });
  charts.appendChild(lineChart("queue depth", [
    { name: "jobs", color: COLORS.a, values: h.map(p => [p.t, p.queue_depth]) }], ""));
  charts.appendChild(lineChart("oldest queued job", [
    { name: "age", color: COLORS.b, values: h.map(p => [p.t, p.oldest_job_age_s]) }], "s"));
  card.appendChild(charts);
  return card;
}

function render(status) {
  const verdict = document.getElementById("verdict");
  verdict.textContent = status.split.sentence;
  verdict.setAttribute("data-gain", String(status.split.gain));
  document.getElementById("design").textContent =
    `lanes=${status.design}, engine=${status.engine}, window ${status.window_s} s`;
  document.getElementById("updated").textContent =
    "updated " + new Date(status.time * 1000).toLocaleTimeString();
  const problems = [];
  if (status.redis_error) problems.push(status.redis_error);
  if (status.silent_workers.length) problems.push("no /metrics from " + status.silent_workers.join(", "));
  document.getElementById("error").textContent = problems.join("; ");
  const lanes = document.getElementById("lanes");
  lanes.replaceChildren();
  const order = ["realtime", "mixed", "batch"];
  const names = Object.keys(status.lanes).sort((a, b) => order.indexOf(a) - order.indexOf(b));
  for (const name of names) lanes.appendChild(laneCard(name, status.lanes[name], status));
  if (!names.length) lanes.appendChild(el("p", { class: "muted" }, "No worker is registered."));
  lanes.appendChild(queueCard(status));
  document.body.setAttribute("data-updated", String(status.time));
}

// A request that gets no answer in this long is dropped and tried again: one lost
// response (a restarting gateway, a proxy that drops the connection) must not stop
// the page for good.
const FETCH_TIMEOUT_MS = 10000;

async function poll() {
  let delay = 2;
  try {
    const resp = await fetch("/status.json", { cache: "no-store",
                                               signal: AbortSignal.timeout(FETCH_TIMEOUT_MS) });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const status = await resp.json();
    delay = status.poll_s;
    render(status);
  } catch (err) {
    document.getElementById("error").textContent = "cannot read /status.json: " + err.message;
  }
  setTimeout(poll, delay * 1000);
}

poll();
