// The Headroom status page: polls /status (no API key needed) and draws it.
// Plain DOM and SVG, no libraries; every value from the server goes in as text, never HTML.
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
const MEMORY_SERIES = [
  ["active_bytes", "active", "--s1"], ["cache_bytes", "cache", "--s2"],
  ["reserved_bytes", "reserved", "--s3"], ["headroom_bytes", "headroom", "--s4"],
];
const LOAD_SERIES = [["queued", "queued", "--s3"], ["running", "running", "--s1"]];

let history = [];      // samples, oldest first, within the server's window
let lastAt = null;     // the newest sample's time: the next poll asks only for newer ones
let windowS = 300;

function $(id) { return document.getElementById(id); }
function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0, v = Math.abs(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (n < 0 ? "-" : "") + (i ? v.toFixed(v < 10 ? 2 : 1) : v.toFixed(0)) + " " + units[i];
}
function seconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
}
function ago(at, now) {
  const s = Math.max(0, now - at);
  if (s < 90) return s.toFixed(0) + " s ago";
  if (s < 5400) return (s / 60).toFixed(0) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
// "metal · Apple M3 Max", "cuda · NVIDIA H200": the backend, and which device it is.
function deviceLabel(m) {
  if (!m.device) return "–";
  return m.device_name && m.device_name !== m.device ? `${m.device} · ${m.device_name}` : m.device;
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// The next of 1, 2, 5 x 10^k at or above v: round grid lines for counts and rates.
function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 5, 10].map(m => m * p).find(n => n >= v);
}

// A line chart of `series` ([field, label, colour var]) over `rows`; `limitField` is drawn
// dashed. The y axis starts at 0; the x axis is the last `windowS` seconds up to `now`.
function drawChart(target, rows, series, now, opts) {
  const box = target.getBoundingClientRect();
  const w = Math.max(300, Math.round(box.width) || 600), h = Math.max(100, Math.round(box.height) || 200);
  const left = 64, right = 8, top = 8, bottom = 20;
  target.setAttribute("viewBox", `0 0 ${w} ${h}`);
  target.replaceChildren();
  const fields = series.map(s => s[0]).concat(opts.limitField ? [opts.limitField] : []);
  let ymax = 0;
  for (const r of rows) for (const f of fields) if (r[f] > ymax) ymax = r[f];
  ymax = ymax > 0 ? (opts.nice ? niceCeil(ymax) : ymax * 1.05) : 1;
  const x = t => left + (w - left - right) * (1 - (now - t) / windowS);
  const y = v => top + (h - top - bottom) * (1 - v / ymax);
  for (let i = 0; i <= 4; i++) {
    const v = ymax * i / 4, yy = y(v);
    target.appendChild(svg("line", {x1: left, x2: w - right, y1: yy, y2: yy, class: "grid"}));
    const label = svg("text", {x: left - 6, y: yy + 4, "text-anchor": "end"});
    label.textContent = opts.format(v);
    target.appendChild(label);
  }
  for (const [t, anchor] of [[now - windowS, "start"], [now, "end"]]) {
    const label = svg("text", {x: x(t), y: h - 4, "text-anchor": anchor});
    label.textContent = t === now ? "now" : `-${Math.round(windowS / 60)} min`;
    target.appendChild(label);
  }
  // One polyline per unbroken run: no line is drawn across a gap with no report (a restart).
  const draw = (field, colour, cls) => {
    const runs = [[]];
    for (const r of rows) {
      if (now - r.at > windowS) continue;
      if (r[field] === null || r[field] === undefined) { if (runs.at(-1).length) runs.push([]); continue; }
      runs.at(-1).push(`${x(r.at).toFixed(1)},${y(r[field]).toFixed(1)}`);
    }
    for (const pts of runs.filter(run => run.length)) {
      const line = svg("polyline", {points: pts.join(" "), stroke: css(colour), "data-series": field});
      if (cls) line.setAttribute("class", cls);
      target.appendChild(line);
    }
    return runs.reduce((n, run) => n + run.length, 0);
  };
  let points = 0;
  if (opts.limitField) draw(opts.limitField, "--limit", "limit");
  for (const [field, , colour] of series) points = Math.max(points, draw(field, colour));
  target.dataset.points = String(points);
}

function legend(target, series, limit) {
  target.replaceChildren();
  const items = series.map(s => [s[1], css(s[2])]);
  if (limit) items.push(["limit", css("--limit")]);
  for (const [label, colour] of items) {
    const span = el("span");
    const swatch = el("i");
    swatch.style.background = colour;
    span.append(swatch, label);
    target.appendChild(span);
  }
}

function renderHeader(s) {
  $("model").textContent = s.model + " · " + s.version;
  const badge = $("status");
  badge.textContent = s.status;
  badge.className = "badge " + (s.status === "ok" ? "ok" : s.workers.some(w => w.state === "failed") ? "bad" : "warn");
  $("updated").textContent = "updated " + new Date(s.at * 1000).toLocaleTimeString();
  document.title = `Headroom: ${s.status}`;
}

function renderTiles(s) {
  // Every worker's headroom together: with several models or replicas, one worker's
  // figure would hide the others'.
  const mems = s.workers.map(w => w.memory).filter(m => m && m.headroom_bytes !== undefined);
  $("t-headroom").textContent = mems.length ? bytes(mems.reduce((n, m) => n + m.headroom_bytes, 0)) : "–";
  $("t-headroom-label").textContent = mems.length > 1 ? `Headroom (${mems.length} workers)` : "Headroom";
  $("t-queued").textContent = s.queued;
  $("t-running").textContent = s.running;
  $("t-tps").textContent = s.tokens_per_s.toFixed(1);
  $("t-ttft").textContent = s.ttft.count ? `${seconds(s.ttft.p50_s)} / ${seconds(s.ttft.p95_s)}` : "–";
  $("t-restarts").textContent = s.workers.reduce((n, w) => n + w.restarts, 0);
}

function lastExit(exit, now) {
  if (!exit) return "–";
  const how = exit.signal ? exit.signal : `code ${exit.code}`;
  return `${how}: ${exit.reason} (${ago(exit.at, now)})`;
}

function renderWorkers(s) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of s.workers) {
    const m = w.memory || {};
    const row = document.createElement("tr");
    const state = el("td", w.state, "state-" + w.state);
    state.title = w.reason || "";
    const cells = [el("td", w.model || "–"), state, el("td", w.pid ?? "–"), el("td", w.incarnation ?? "–"),
      el("td", w.restarts), el("td", m.max_running_requests ? `${w.running} / ${m.max_running_requests}` : w.running),
      el("td", deviceLabel(m)), el("td", bytes(m.limit_bytes)), el("td", bytes(m.active_bytes)),
      el("td", bytes(m.cache_bytes)), el("td", bytes(m.reserved_bytes)),
      el("td", m.report_age_s === undefined ? "–" : seconds(m.report_age_s)), el("td", lastExit(w.last_exit, s.at))];
    cells[2].dataset.field = "pid";
    row.append(...cells);
    body.appendChild(row);
  }
}

function keepAlive(v) {
  if (v === null || v === undefined || v < 0) return "for ever";
  return v === 0 ? "unload when idle" : seconds(v);
}

function renderModels(s) {
  const models = s.models || [];
  // One model: its state is the header's and its worker's; the table is for several.
  $("models-panel").hidden = models.length < 2;
  const body = $("models").tBodies[0];
  body.replaceChildren();
  for (const m of models) {
    const mem = m.memory || {};
    const row = document.createElement("tr");
    const state = el("td", m.pinned ? `${m.state} (pinned)` : m.state, "state-" + m.state);
    row.append(el("td", m.id), state, el("td", m.workers), el("td", m.queued), el("td", m.running),
               el("td", bytes(mem.weights_bytes)), el("td", bytes(mem.used_bytes)),
               el("td", mem.lease_bytes ? bytes(mem.lease_bytes) : "–"), el("td", keepAlive(m.keep_alive_s)));
    body.appendChild(row);
  }
}

function renderCache(s) {
  const target = $("prompt-cache");
  // Every worker keeps its own cache: one list each, side by side, named when there are several.
  const reporting = s.workers.filter(w => w.prompt_cache);
  if (!reporting.length) { target.textContent = "not reported by this worker"; target.className = "muted"; return; }
  const blocks = reporting.map(w => {
    const list = document.createElement("dl");
    const add = (prefix, obj) => {
      for (const [k, v] of Object.entries(obj)) {
        if (v !== null && typeof v === "object") { add(prefix + k + ".", v); continue; }
        list.append(el("dt", prefix + k), el("dd", k === "bytes" || k.endsWith("_bytes") ? bytes(v) : v));
      }
    };
    add("", w.prompt_cache);
    const block = document.createElement("div");
    if (reporting.length > 1) block.append(el("h3", `${w.model || "–"} · pid ${w.pid ?? "–"}`, "cache-worker"));
    block.append(list);
    return block;
  });
  target.className = "cache-blocks";
  target.replaceChildren(...blocks);
}

function renderRejections(s) {
  const body = $("rejections").tBodies[0];
  body.replaceChildren();
  for (const r of s.rejections) {
    const row = document.createElement("tr");
    const why = r.message ?? (r.param ? `bad ${r.param}` : "");
    row.append(el("td", ago(r.at, s.at)), el("td", r.status), el("td", r.code),
               el("td", r.request_id ?? "–"), el("td", why));
    body.appendChild(row);
  }
  $("no-rejections").hidden = s.rejections.length > 0;
}

function render(s) {
  windowS = s.window_s;
  $("mem-span").textContent = `last ${Math.round(windowS / 60)} min, against the limit`;
  renderHeader(s);
  renderTiles(s);
  renderModels(s);
  renderWorkers(s);
  renderCache(s);
  renderRejections(s);
  drawChart($("mem-chart"), history, MEMORY_SERIES, s.at, {format: bytes, limitField: "limit_bytes"});
  drawChart($("tps-chart"), history, [["tokens_per_s", "tokens/s", "--s4"]], s.at, {format: v => v.toFixed(v % 1 ? 1 : 0), nice: true});
  drawChart($("load-chart"), history, LOAD_SERIES, s.at, {format: v => v.toFixed(v % 1 ? 1 : 0), nice: true});
}

async function poll() {
  try {
    const url = lastAt === null ? "/status" : `/status?since=${lastAt}`;
    const response = await fetch(url, {cache: "no-store"});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const s = await response.json();
    history = history.concat(s.history).filter(r => s.at - r.at <= s.window_s);
    if (history.length) lastAt = history[history.length - 1].at;
    render(s);
    $("offline").hidden = true;
  } catch (err) {
    $("offline").hidden = false;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

legend($("mem-legend"), MEMORY_SERIES, true);
legend($("load-legend"), LOAD_SERIES, false);
poll();
