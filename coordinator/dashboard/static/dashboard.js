// dropfl dashboard: polls /api/runs, fetches a run's panels when its `version` changed, redraws.
// Charts: uPlot (vendored, static/uPlot.LICENSE); the participation raster: a canvas drawn here.
// Every drawn chart carries data-points (its number of rounds) so a test can check it holds the run's rows.
// What a person reads: rounds numbered from 1 (metrics.jsonl's `round` + 1, as the round loop's progress lines
// and `dropfl sim`'s final line), accuracy in %.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const STATUS = { P: ["participated", "#2a9d47"], D: ["dropped", "#d62728"], N: ["not selected", "#9ecae1"],
                 U: ["unavailable", "#bbbbbb"], "-": ["no row", "#ffffff"] };
const REASON_COLORS = { battery: "#f28e2b", charging: "#edc948", offline: "#555555", slow_link: "#b07aa1",
                        model_draw: "#bbbbbb", declined: "#9c755f", thermal: "#e15759" };
const ROUND_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];
const state = { runs: [], versions: {}, data: {}, charts: {}, poll: 1000, updates: 0 };

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const color = (i) => COLORS[i % COLORS.length];
const fmt = (v, d = 3) => (v === null || v === undefined || Number.isNaN(v)) ? "—" : (+v).toPrecision(d);
const rate = (v) => v == null ? "—" : v >= 1e6 ? (v / 1e6).toFixed(1) + " MB/s" : (v / 1e3).toFixed(1) + " kB/s";

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

async function poll() {
  try {
    const { runs, poll_s } = await getJSON("api/runs");
    state.poll = 1000 * poll_s;
    state.runs = runs;
    const changed = runs.filter((r) => JSON.stringify(r.version) !== state.versions[r.id]);
    await Promise.all(changed.map(async (r) => {
      const panels = ["metrics", "participation", "dropout", "timing", "devices", "log"];
      const got = await Promise.all(panels.map((p) => getJSON(`api/runs/${r.id}/${p}`)));
      state.data[r.id] = Object.fromEntries(panels.map((p, k) => [p, got[k]]));
      state.versions[r.id] = JSON.stringify(r.version);
    }));
    drawHeader();
    if (changed.length) redraw();
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("status").className = "";
  } catch (e) {
    // every run finished at the last answer: the server stopped with its run (sim --dashboard); the page is final
    const over = state.runs.length > 0 && state.runs.every((r) => r.finished);
    $("status").textContent = over
      ? "every run has finished and the dashboard server has stopped: what is shown is final"
      : `no answer from the dashboard server (${e.message}); retrying`;
    $("status").className = over ? "over" : "down";
    setTimeout(poll, over ? 10 * state.poll : state.poll);  // slower, yet back if a server is started again
    return;
  }
  setTimeout(poll, state.poll);
}

function drawHeader() {
  $("runs").innerHTML = state.runs.map((r) => `<span class="run" style="--c:${color(r.id)}" data-run="${r.id}">
    <b>${esc(r.name)}</b> ${esc(r.kind)} · ${esc(r.algo ?? "?")} · ${esc(r.progress)}
    <span class="${r.finished ? "done" : "live"}">
    ${r.finished ? "finished" : "running"}</span></span>`).join("");
  const problems = state.runs.flatMap((r) => r.problems.map((p) => `${r.name}: ${p}`));
  $("problems").hidden = !problems.length;
  $("problems").textContent = problems.length ? "Lines that could not be read:\n" + problems.join("\n") : "";
}

// x: the union of the runs' rounds, numbered from 1; one y array per (run, key), null where the run has no value
function aligned(rowsByRun, keys) {
  const xs = [...new Set(rowsByRun.flatMap(([, rows]) => rows.map((r) => r.round)))].sort((a, b) => a - b);
  const at = new Map(xs.map((x, k) => [x, k]));
  const ys = [];
  for (const [, rows] of rowsByRun) for (const key of keys) {
    const y = new Array(xs.length).fill(null);
    for (const r of rows) if (r[key] !== undefined && r[key] !== null) y[at.get(r.round)] = r[key];
    ys.push(y);
  }
  return [xs.map((x) => x + 1), ...ys];
}

function lineChart(id, data, series, yLabel) {
  const el = $(id);
  el.dataset.points = data[0].length;
  el.dataset.series = series.length;
  const key = JSON.stringify(series.map((s) => s.label));
  const old = state.charts[id];
  if (old && old.key === key) { old.plot.setData(data); return; }
  if (old) old.plot.destroy();
  const opts = { width: Math.max(300, el.clientWidth - 8), height: 250, scales: { x: { time: false } },
    axes: [{ label: "round", incrs: ROUND_STEPS }, { label: yLabel, size: 60 }],
    series: [{ label: "round" }, ...series.map((s) => ({ spanGaps: true, width: 2, points: { size: 5 }, ...s }))] };
  state.charts[id] = { key, plot: new uPlot(opts, data, el) };
}

function runsWith(panel) {
  return state.runs.filter((r) => state.data[r.id]).map((r) => [r, state.data[r.id][panel]]);
}

function redraw() {
  $("panel-dropout").hidden = !state.runs.some((r) => r.panels.includes("dropout"));  // FedDD's only
  const metrics = runsWith("metrics").map(([r, m]) => [r, m.rows]);
  const pct = metrics.map(([r, rows]) => [r, rows.map((x) => ({ round: x.round,
    accuracy: x.accuracy == null ? null : 100 * x.accuracy }))]);
  lineChart("chart-accuracy", aligned(pct, ["accuracy"]),
            metrics.map(([r]) => ({ label: r.label, stroke: color(r.id) })), "accuracy (%)");
  lineChart("chart-loss", aligned(metrics, ["loss", "train_loss"]), metrics.flatMap(([r]) => [
    { label: `${r.label} test`, stroke: color(r.id) },
    { label: `${r.label} train`, stroke: color(r.id), dash: [6, 4], width: 1.5 }]), "loss");
  const dropout = runsWith("dropout").filter(([, d]) => d.rounds.length);
  const drows = dropout.map(([r, d]) => [r, d.rounds.map((t, k) => ({ round: t, min: d.min[k], mean: d.mean[k], max: d.max[k] }))]);
  lineChart("chart-dropout", aligned(drows, ["min", "mean", "max"]), drows.flatMap(([r]) => [
    { label: `${r.label} min`, stroke: color(r.id), dash: [2, 3], width: 1 },
    { label: `${r.label} mean`, stroke: color(r.id) },
    { label: `${r.label} max`, stroke: color(r.id), dash: [2, 3], width: 1 }]), "dropout rate");
  $("dropout-note").textContent = dropout.length ? "" : "No dropout rates yet (reports.jsonl tasks).";
  const timing = runsWith("timing").map(([r, t]) => [r, t.rounds.map((x, k) => {
    const f = t.field.rounds.indexOf(x);
    return { round: x, seconds: t.seconds[k], slowest: f < 0 ? null : t.field.slowest_participant_s[f],
             overhead: f < 0 ? null : t.field.overhead_s[f] };
  })]);
  const fieldRuns = new Set(runsWith("timing").filter(([, t]) => t.field.rounds.length).map(([r]) => r.id));
  const tkeys = ["seconds", "slowest", "overhead"];
  const tdata = aligned(timing, tkeys);
  const tseries = [], tcols = [0];
  timing.forEach(([r], i) => tkeys.forEach((k, j) => {
    if (j && !fieldRuns.has(r.id)) return;
    tcols.push(1 + i * tkeys.length + j);
    tseries.push({ label: `${r.label} ${k === "seconds" ? "round" : k}`, stroke: color(r.id), dash: j ? [4, 3] : undefined });
  }));
  lineChart("chart-timing", tcols.map((c) => tdata[c]), tseries, "seconds");
  drawRasters();
  drawDevices();
  drawLogs();
  state.updates += 1;
  document.body.dataset.updates = state.updates;
}

function cellColor(code, reason) {
  if (code === "U" && reason) return REASON_COLORS[reason] || STATUS.U[1];
  return (STATUS[code] || STATUS["-"])[1];
}

function drawRasters() {
  const box = $("rasters");
  const runs = runsWith("participation");
  box.innerHTML = runs.map(([r, p]) => `<figure class="raster" id="raster-${r.id}" data-run="${r.id}"
      data-rounds="${p.rounds.length}" data-clients="${p.clients}">
    <figcaption><b style="color:${color(r.id)}">${esc(r.name)}</b> <span class="sub">${p.rounds.length} rounds,
      ${p.clients} clients${p.shown < p.clients ? `, rows of clients 0..${p.shown - 1} shown (counts below: all)` : ""}</span>
    </figcaption><canvas></canvas><div class="legend"></div></figure>`).join("") || '<p class="note">No participation yet.</p>';
  for (const [r, p] of runs) {
    const fig = $(`raster-${r.id}`), canvas = fig.querySelector("canvas");
    const cw = Math.max(2, Math.min(24, Math.floor((box.clientWidth - 20) / Math.max(1, p.rounds.length))));
    const ch = Math.max(1, Math.min(14, Math.floor(360 / Math.max(1, p.shown))));
    canvas.width = Math.max(1, cw * p.rounds.length);
    canvas.height = Math.max(1, ch * p.shown);
    const ctx = canvas.getContext("2d");
    const reasonTotals = {};
    p.rounds.forEach((t, k) => {
      const row = p.status[k], reasons = p.reasons[k];
      for (let c = 0; c < row.length; c++) {
        ctx.fillStyle = cellColor(row[c], reasons[c]);
        ctx.fillRect(k * cw, c * ch, cw, ch);
      }
      for (const [c, why] of Object.entries(reasons)) {
        const key = `${STATUS[row[c]] ? STATUS[row[c]][0] : "?"}: ${why}`;
        reasonTotals[key] = [(reasonTotals[key] || [0])[0] + 1, cellColor(row[c], why)];
      }
    });
    const total = (s) => p.counts[s].reduce((a, b) => a + b, 0);
    fig.querySelector(".legend").innerHTML = [["participated", "P"], ["dropped", "D"], ["not_selected", "N"], ["unavailable", "U"]]
      .map(([s, code]) => `<span><i style="background:${STATUS[code][1]}"></i>${STATUS[code][0]} ${total(s)}</span>`).join("") +
      Object.entries(reasonTotals).sort().map(([key, [n, col]]) => `<span><i style="background:${col}"></i>${esc(key)} ${n}</span>`).join("");
    canvas.onmousemove = (e) => {
      const b = canvas.getBoundingClientRect();
      const k = Math.floor((e.clientX - b.left) * canvas.width / b.width / cw);
      const c = Math.floor((e.clientY - b.top) * canvas.height / b.height / ch);
      if (k < 0 || k >= p.rounds.length || c < 0 || c >= p.shown) return hideTip();
      const code = p.status[k][c], why = p.reasons[k][c];
      showTip(e, `round ${p.rounds[k] + 1}, client ${c}: ${STATUS[code][0]}${why ? " (" + why + ")" : ""}`);
    };
    canvas.onmouseleave = hideTip;
  }
}

function showTip(e, text) {
  const t = $("tooltip");
  t.textContent = text; t.hidden = false;
  t.style.left = `${e.clientX + 12}px`; t.style.top = `${e.clientY + 12}px`;
}
function hideTip() { $("tooltip").hidden = true; }

function ago(now, t) {
  if (t == null) return "—";
  const s = Math.max(0, now - t);
  return s < 120 ? `${s.toFixed(0)} s ago` : s < 7200 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`;
}

function drawDevices() {
  const runs = runsWith("devices");
  $("devices").innerHTML = runs.map(([r, d]) => {
    const field = r.kind !== "sim";
    const rows = d.rows.map((x) => `<tr data-client="${x.client}"><td>${x.client}</td><td class="l">${esc(x.device ?? "—")}</td>
      <td class="l state-${esc(x.connection)}">${esc(x.connection ?? "—")}</td>
      <td>${x.battery_pct == null ? "—" : x.battery_pct.toFixed(1) + " %"}</td>
      <td>${x.charging == null ? "—" : x.charging ? "yes" : "no"}</td>
      <td>${rate(x.uplink_Bps)}</td><td>${rate(x.downlink_Bps)}</td><td>${ago(d.now, x.last_seen)}</td>
      <td>${x.rounds_trained}</td><td>${x.train_s == null ? "—" : fmt(x.train_s) + " s"}</td>
      <td>${x.temp_c == null ? "—" : x.temp_c.toFixed(1) + " °C"}</td><td>${x.cpu_pct == null ? "—" : x.cpu_pct.toFixed(0) + " %"}</td>
      <td>${x.energy_j == null ? "—" : fmt(x.energy_j) + " J" + (x.energy_source === "modelled" ? " (modelled)" : "")}</td>
      <td class="l state-${esc(x.last_status)}">${x.last_status == null ? "—" : esc(x.last_status) +
        (x.last_reason ? " (" + esc(x.last_reason) + ")" : "") + " in round " + (x.last_round + 1)}</td>
      <td class="l sub">${esc(x.sources.join(", "))}</td></tr>`).join("");
    return `<details class="devices-run" id="devices-${r.id}" data-rows="${d.rows.length}" ${field ? "open" : ""}>
      <summary><b style="color:${color(r.id)}">${esc(r.name)}</b> <span class="sub">${d.clients} clients${
        d.shown < d.clients ? `, clients 0..${d.shown - 1} shown` : ""}${field ? "" : " (simulated: no battery or link readings)"}</span></summary>
      <table><thead><tr><th>client</th><th class="l">device</th><th class="l">connection</th><th>battery</th><th>charging</th>
      <th>uplink</th><th>downlink</th><th>last seen</th><th>rounds trained</th><th>last train</th><th>temp.</th><th>CPU</th><th>energy</th>
      <th class="l">state</th><th class="l">from</th></tr></thead><tbody>${rows}</tbody></table></details>`;
  }).join("");
}

function drawLogs() {
  $("logs").innerHTML = runsWith("log").map(([r, l]) => `<details ${r.id === 0 ? "open" : ""}><summary>
    <b style="color:${color(r.id)}">${esc(r.name)}</b> <span class="sub">last ${l.records.length} of ${l.total} records at info and up (${l.debug} debug records: log.txt)</span></summary>
    <div class="logs">${l.records.slice().reverse().map((x) => `<div class="lvl-${esc(x.level)}">${
      esc(new Date(1000 * x.time).toLocaleTimeString())} ${esc(x.level)} ${esc(x.logger)}: ${esc(x.message)}</div>`).join("")}</div>
    </details>`).join("");
}

window.addEventListener("resize", () => {
  for (const [id, c] of Object.entries(state.charts)) c.plot.setSize({ width: Math.max(300, $(id).clientWidth - 8), height: 250 });
});
poll();
