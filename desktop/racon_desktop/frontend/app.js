// The window of racon-desktop: it asks the app's own Python commands (no path, no URL, no shell).
"use strict";
const invoke = (name, args) => window.__TAURI__.pytauri.pyInvoke(name, args || {});
const $ = (id) => document.getElementById(id);
const GiB = 1024 ** 3;
const gb = (b) => (b / GiB).toFixed(1) + " GB";

let chart = null;

async function refresh() {
  let s;
  try { s = await invoke("snapshot"); } catch (e) { $("error").hidden = false; $("error").textContent = String(e); return; }
  const st = $("node-state");
  st.textContent = s.state;
  st.dataset.state = s.state;
  document.title = "RACoN: " + (s.node ? s.node.name : "this machine") + " (" + s.state + ")";
  $("error").hidden = !s.error;
  $("error").textContent = s.error ? s.error + (s.retry_in ? " (retrying in " + s.retry_in + " s)" : "") : "";
  if (s.joined === false) { window.location.href = "join.html"; return; }
  if (s.message) $("message").textContent = s.message;
  $("blocked").hidden = !(s.blocked && s.blocked.length);
  $("blocked").textContent = s.blocked && s.blocked.length
    ? "Blocked: this window loads only its own pages, not " + s.blocked[s.blocked.length - 1] : "";
  $("notified").replaceChildren(...(s.notified || []).slice(-5).map((n) => {
    const li = document.createElement("li"); li.dataset.kind = n.kind;
    li.textContent = n.title + ": " + n.body; return li;
  }));
  $("pause").disabled = s.state === "DRAINING" || s.state === "PAUSED";
  $("resume").disabled = !s.local_paused;
  if (s.node) {
    const n = s.node;
    $("node-name").textContent = n.name;
    $("lends-threads").textContent = n.lends.threads;
    $("lends-ram").textContent = gb(n.lends.ram_bytes);
    $("lends-gpus").textContent = n.lends.gpus.length
      ? n.lends.gpus.map((g) => g.name + " (" + gb(g.vram_bytes) + " VRAM)").join(", ") : "none";
    $("jobs-today").textContent = n.jobs_today;
    $("jobs-running").textContent = n.jobs_running;
  }
  if (s.focus === "lending") $("lending").scrollIntoView();
}

async function drawEarnings() {
  const e = await invoke("earnings");
  if (e.error) { $("earnings-total").textContent = e.error; return; }
  const body = $("earnings-table").tBodies[0];
  body.replaceChildren(...e.rows.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.day = r.day; tr.dataset.credits = r.credits; tr.dataset.jobs = r.jobs;
    tr.textContent = r.day + " " + r.credits + " " + r.jobs;
    return tr;
  }));
  const total = e.credits.reduce((a, b) => a + b, 0);
  $("earnings-total").textContent = (total / 1e6).toFixed(6) + " credits and " +
    e.jobs.reduce((a, b) => a + b, 0) + " jobs in 30 days";
  const xs = e.days.map((d) => Date.parse(d + "T00:00:00Z") / 1000);
  const ys = e.credits.map((c) => c / 1e6);
  const data = [xs, ys];
  window.raconEarnings = e;
  window.raconChartData = data; // what uPlot draws: [day timestamps, credits]
  if (chart) { chart.setData(data); return; }
  // The iife build may lack uPlot.paths (the web UI guards it too): a line then.
  const bars = window.uPlot.paths && window.uPlot.paths.bars;
  chart = new uPlot({
    width: Math.min(900, document.body.clientWidth - 20), height: 220,
    series: [{}, { label: "credits", stroke: "#2ea043", fill: "rgba(46,160,67,0.15)", paths: bars ? bars({ size: [0.7] }) : undefined }],
    axes: [{}, { label: "credits" }],
    scales: { x: { time: true } },
  }, data, $("chart"));
}

async function loadLending() {
  const l = await invoke("lending_get");
  if (l.error) { showLendingError(l.error); return; }
  const f = $("lending-form");
  for (const [k, v] of Object.entries(l.form || {})) if (f.elements[k]) f.elements[k].value = v;
}

function showLendingError(err) {
  const f = $("lending-form");
  for (const el of f.elements) el.classList.remove("invalid");
  $("lending-error").hidden = !err;
  $("lending-error").textContent = err ? err.message : "";
  if (err && f.elements[err.field]) f.elements[err.field].classList.add("invalid");
}

$("lending-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target;
  const body = {};
  for (const k of ["timezone", "windows", "handoff", "idle_minutes", "cpu_below", "ram_gb", "vram_gb", "threads"]) body[k] = f.elements[k].value;
  const r = await invoke("lending_set", body);
  showLendingError(r.error || null);
  $("lending-saved").textContent = r.error ? "" : "saved";
});
$("pause").addEventListener("click", async () => { $("message").textContent = (await invoke("pause")).message; refresh(); });
$("resume").addEventListener("click", async () => { $("message").textContent = (await invoke("resume")).message; refresh(); });

async function loadNotify() {
  const n = await invoke("notify_get");
  const f = $("notify-form");
  for (const [k, v] of Object.entries(n.switches)) if (f.elements[k]) f.elements[k].checked = v;
}
$("notify-form").addEventListener("change", async () => {
  const f = $("notify-form");
  const body = {};
  for (const k of ["offline", "challenge", "paused", "earnings"]) body[k] = f.elements[k].checked;
  await invoke("notify_set", body);
});

const said = (id) => (e) => { $(id).textContent = String(e); };
loadNotify().catch(said("message"));
refresh(); drawEarnings().catch(said("earnings-total")); loadLending().catch(said("lending-error"));
setInterval(refresh, 2000);
setInterval(() => drawEarnings().catch(said("earnings-total")), 30000);
