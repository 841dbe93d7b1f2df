// First run (racon-desktop with no agent): the join line is parsed by the app (never run by a
// shell), what it installs is shown, then the join script's progress until the node is READY.
"use strict";
const invoke = (name, args) => window.__TAURI__.pytauri.pyInvoke(name, args || {});
const $ = (id) => document.getElementById(id);

function showError(text) {
  $("join-error").hidden = !text;
  $("join-error").textContent = text || "";
  $("join-line").classList.toggle("invalid", !!text);
}

async function check() {
  $("join-preview").hidden = true;
  showError("");
  const p = await invoke("join_check", { line: $("join-line").value });
  if (p.error) { showError(p.error); return; }
  $("join-controller").textContent = p.controller;
  $("join-pinned").textContent = p.pinned ? "(certificate pinned)" : "";
  $("join-installs").replaceChildren(...p.installs.map((t) => {
    const li = document.createElement("li"); li.textContent = t; return li;
  }));
  $("join-note").textContent = p.note || "";
  $("join-preview").hidden = false;
}

let timer = null;
async function progress() {
  const p = await invoke("join_progress");
  $("join-steps").replaceChildren(...p.steps.map((t) => {
    const li = document.createElement("li"); li.textContent = t; return li;
  }));
  $("join-failed").hidden = !p.error;
  $("join-failed").textContent = p.error || "";
  if (p.error) { clearInterval(timer); $("join-start").disabled = false; }
  if (p.done && p.joined) { clearInterval(timer); window.location.href = "index.html"; }
}

async function start() {
  showError("");
  $("join-start").disabled = true;
  const r = await invoke("join_start", { line: $("join-line").value });
  if (r.error) { showError(r.error); $("join-start").disabled = false; return; }
  $("join-progress").hidden = false;
  timer = setInterval(() => progress().catch((e) => showError(String(e))), 1000);
}

$("join-check").addEventListener("click", () => check().catch((e) => showError(String(e))));
$("join-start").addEventListener("click", () => start().catch((e) => showError(String(e))));
invoke("join_info").then((i) => {
  if (i.joined) { window.location.href = "index.html"; return; }
  if (i.progress) { $("join-progress").hidden = false; timer = setInterval(progress, 1000); }
});
