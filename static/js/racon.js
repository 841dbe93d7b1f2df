/* RACoN web UI: the small bits htmx does not do by itself. No framework, no build step. */
(function () {
  "use strict";

  function csrfToken() {
    const m = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    if (m) return decodeURIComponent(m[1]);
    try { return JSON.parse(document.body.getAttribute("hx-headers") || "{}")["X-CSRFToken"] || ""; } catch (e) { return ""; }
  }

  /* Live rows over /ws/dashboard/. The server sends every element a page might show (the node's
     row, badge, actions, the per-state counts) marked hx-swap-oob. This extension keeps the ones
     this page has, inserts a row the page does not have yet (a node that just enrolled) into its
     table, and drops the rest, so htmx never reports a missing target. */
  function installLiveExtension() {
    htmx.defineExtension("racon-live", {
      transformResponse: function (text) {
        const tpl = document.createElement("template");
        tpl.innerHTML = text;
        const keep = [];
        Array.from(tpl.content.children).forEach(function (el) {
          if (el.id && document.getElementById(el.id)) { keep.push(el.outerHTML); return; }
          const into = el.getAttribute("data-append-to") || el.getAttribute("data-prepend-to");
          const box = into && document.getElementById(into);
          if (!box) return;
          el.removeAttribute("hx-swap-oob");
          box.querySelectorAll("tr.empty").forEach(function (e) { e.remove(); });
          if (el.hasAttribute("data-prepend-to")) box.prepend(el); else box.append(el);
          htmx.process(el);
        });
        return keep.join("");
      },
    });
    document.body.addEventListener("htmx:wsOpen", function () { setLive(true); });
    document.body.addEventListener("htmx:wsClose", function () { setLive(false); });
  }

  function setLive(on) {
    const dot = document.getElementById("live-dot");
    if (dot) { dot.classList.toggle("on", on); dot.title = on ? "live updates on" : "live updates off (reconnecting)"; }
  }

  /* Copy buttons: data-copy="#selector". */
  document.addEventListener("click", function (ev) {
    const btn = ev.target.closest("[data-copy]");
    if (!btn) return;
    const src = document.querySelector(btn.getAttribute("data-copy"));
    if (!src) return;
    const text = src.textContent.trim();
    const done = function () { btn.textContent = "Copied"; setTimeout(function () { btn.textContent = "Copy"; }, 1500); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () {});
    } else {
      const range = document.createRange(); range.selectNodeContents(src);
      const sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(range);
      try { document.execCommand("copy"); done(); } catch (e) { /* selected; the user can copy by hand */ }
    }
  });

  /* Job detail: follow ws/jobs/<id>/ (it replays the stream from the start, then follows it). */
  function followJob(pre) {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(proto + "//" + location.host + "/ws/jobs/" + pre.dataset.jobId + "/");
    const note = document.getElementById("stream-note");
    const badge = document.getElementById("stream-state");
    let got = false;
    ws.onmessage = function (ev) {
      const msg = JSON.parse(ev.data);
      if (msg.text) { pre.append(document.createTextNode(msg.text)); got = true; }
      if (msg.type === "done" || msg.type === "error") {
        if (badge) { badge.textContent = msg.type === "done" ? "finished" : "error"; badge.className = "badge " + (msg.type === "done" ? "ok" : "bad"); }
        if (msg.type === "error" && note) note.textContent = "Stream ended with an error: " + (msg.text || msg.finish_reason || "");
      }
    };
    ws.onclose = function () {
      if (!got && note && !pre.textContent) note.textContent = "No output recorded for this job (streams are kept for an hour).";
    };
  }

  /* Playground: POST the OpenAI chat body (stream: true) with the session, read the SSE stream. */
  function playground(form) {
    const log = document.getElementById("pg-log");
    const input = document.getElementById("pg-input");
    const stats = document.getElementById("pg-stats");
    const send = document.getElementById("pg-send");
    let history = [];

    function bubble(role, text) {
      const hint = log.querySelector(".hint"); if (hint) hint.remove();
      const div = document.createElement("div");
      div.className = "msg-bubble " + role;
      const who = document.createElement("span"); who.className = "who"; who.textContent = role === "user" ? "You" : "Assistant";
      const body = document.createElement("div"); body.className = "body"; body.textContent = text;
      div.append(who, body); log.append(div); log.scrollTop = log.scrollHeight;
      return body;
    }

    document.getElementById("pg-clear").addEventListener("click", function () {
      history = []; log.innerHTML = '<p class="muted hint">New conversation.</p>'; stats.textContent = "";
    });
    input.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); form.requestSubmit(); }
    });

    form.addEventListener("submit", async function (ev) {
      ev.preventDefault();
      const text = input.value.trim();
      if (!text || send.disabled) return;
      input.value = "";
      bubble("user", text);
      history.push({ role: "user", content: text });
      const out = bubble("assistant", "");
      out.classList.add("typing");
      send.disabled = true;
      const system = document.getElementById("pg-system").value.trim();
      const body = {
        model: document.getElementById("pg-model").value,
        messages: (system ? [{ role: "system", content: system }] : []).concat(history),
        max_tokens: parseInt(document.getElementById("pg-max-tokens").value || "128", 10),
        temperature: parseFloat(document.getElementById("pg-temperature").value || "0.7"),
        stream: true,
        stream_options: { include_usage: true },
      };
      const t0 = performance.now();
      let first = 0, tokens = 0, answer = "";
      try {
        const resp = await fetch(form.dataset.endpoint, {
          method: "POST", credentials: "same-origin",
          headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
          body: JSON.stringify(body),
        });
        const jobId = resp.headers.get("X-Racon-Job-Id");
        if (!resp.ok || !resp.body) {
          let msg = resp.status + " " + resp.statusText;
          try { msg = (await resp.json()).error.message; } catch (e) { /* keep the status line */ }
          throw new Error(msg);
        }
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
            const data = event.split("\n").filter(function (l) { return l.startsWith("data:"); }).map(function (l) { return l.slice(5).trim(); }).join("");
            if (!data || data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message || "stream error");
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) {
              if (!first) first = performance.now();
              tokens += 1; answer += delta.content; out.textContent = answer; log.scrollTop = log.scrollHeight;
            }
            if (chunk.usage) tokens = chunk.usage.completion_tokens || tokens;
          }
        }
        history.push({ role: "assistant", content: answer });
        const secs = (performance.now() - (first || t0)) / 1000;
        stats.innerHTML = "";
        const line = document.createTextNode(tokens + " tokens · " + (first ? Math.round(first - t0) : "—") + " ms to first token · " + (secs > 0 ? (tokens / secs).toFixed(1) : "—") + " tok/s ");
        stats.append(line);
        if (jobId) { const a = document.createElement("a"); a.href = "/jobs/" + jobId + "/"; a.textContent = "job " + jobId.slice(0, 8); stats.append(a); }
      } catch (err) {
        out.textContent = answer + (answer ? "\n" : "") + "⚠ " + err.message;
        out.classList.add("error");
        history.pop();
      } finally {
        out.classList.remove("typing");
        send.disabled = false;
        input.focus();
      }
    });
  }

  // Defined now, before htmx processes the page on DOMContentLoaded and opens the socket.
  if (window.htmx) installLiveExtension();

  document.addEventListener("DOMContentLoaded", function () {
    const pre = document.getElementById("token-stream");
    if (pre) followJob(pre);
    const form = document.getElementById("pg-form");
    if (form) playground(form);
  });
})();
