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

  /* Filters that only show or hide rows: <input type="checkbox" data-toggle-class="C"
     data-toggle-target="#sel" [data-toggle-inverse]> sets class C on the target while checked
     (inverse: while unchecked). */
  document.addEventListener("change", function (ev) {
    const box = ev.target.closest("input[data-toggle-class]");
    if (!box) return;
    const target = document.querySelector(box.dataset.toggleTarget);
    if (!target) return;
    const on = box.hasAttribute("data-toggle-inverse") ? !box.checked : box.checked;
    target.classList.toggle(box.dataset.toggleClass, on);
  });

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
        if (jobId) {
          const a = document.createElement("a"); a.href = "/jobs/" + jobId + "/"; a.textContent = "job " + jobId.slice(0, 8); stats.append(a);
          // Which nodes and layers served this answer (every attempt, after a failover too).
          htmx.ajax("GET", "/jobs/" + jobId + "/", { target: "#pg-served", swap: "innerHTML" });
        }
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

  /* Charts, drawn with the vendored uPlot. Each <figure class="chart" data-chart-id="ID"
     data-spec='{...}'> carries its first payload in <script type="application/json"
     id="chart-data-ID">. Over the dashboard socket the page sends its specs ({"charts": {ID:
     spec}}) and gets fresh payloads ({"type": "charts"}) whenever the controller writes its
     rollup; a window switch (hour/day) asks again over the same socket. window.raconCharts[ID]
     is {plot, payload}: plot.data is exactly what is drawn. */
  const PALETTE = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#4d7c0f", "#db2777"];
  window.raconCharts = {};
  let liveSocket = null;

  function fmt(v) {
    if (v == null) return "—";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (a >= 100) return v.toFixed(0);
    if (a >= 1 || v === 0) return (Math.round(v * 10) / 10).toString();
    return v.toPrecision(2);
  }

  function chartSpec(fig) { try { return JSON.parse(fig.dataset.spec || "{}"); } catch (e) { return {}; } }

  function drawChart(fig, payload) {
    if (!window.uPlot || !payload) return;
    const id = fig.dataset.chartId;
    const box = fig.querySelector(".chart-plot");
    const lines = payload.lines || [];
    const data = [payload.x || []].concat(lines.map(function (l) { return l.values; }));
    const hasData = lines.some(function (l) { return l.values.some(function (v) { return v != null && v !== 0; }); });
    fig.classList.toggle("no-data", !hasData);
    const shape = lines.map(function (l) { return l.label; }).join("\u0000") + "|" + payload.kind;
    const old = window.raconCharts[id];
    if (old && old.shape === shape) {
      old.plot.setData(data);
      old.payload = payload;
      return;
    }
    if (old) old.plot.destroy();
    const bars = payload.kind === "bars" && window.uPlot.paths && window.uPlot.paths.bars;
    const unit = payload.unit ? " " + payload.unit : "";
    const opts = {
      width: Math.max(240, box.clientWidth || 480),
      height: 170,
      cursor: { drag: { x: false, y: false } },
      scales: {
        // Bars sit on their step: half a step of room at each end, so the first and the last show whole.
        x: { time: true, range: function (u, min, max) { return bars ? [min - payload.step / 2, max + payload.step / 2] : [min, max]; } },
        y: { range: function (u, min, max) { return [0, (max > 0 ? max : (payload.kind === "bars" ? 1 : 0.1)) * 1.15]; } },
      },
      axes: [
        { stroke: "#6b7280", grid: { stroke: "#eef0f3" } },
        { stroke: "#6b7280", grid: { stroke: "#eef0f3" }, size: 48, values: function (u, vals) { return vals.map(fmt); } },
      ],
      series: [{ label: payload.step >= 86400 ? "day" : "time", value: payload.step >= 86400 ? "{YYYY}-{MM}-{DD}" : "{HH}:{mm}" }].concat(lines.map(function (l, i) {
        const colour = PALETTE[i % PALETTE.length];
        return {
          label: l.label,
          stroke: colour,
          width: 2,
          fill: bars ? colour + "55" : colour + "14",
          paths: bars ? window.uPlot.paths.bars({ size: [0.8 / Math.max(1, lines.length), 48], align: 0, gap: 1 }) : undefined,
          spanGaps: false,
          points: { show: false },
          value: function (u, v) { return v == null ? "—" : fmt(v) + unit; },
        };
      })),
    };
    box.innerHTML = "";
    const plot = new window.uPlot(opts, data, box);
    window.raconCharts[id] = { plot: plot, payload: payload, shape: shape };
  }

  function drawAll(root) {
    root.querySelectorAll("figure.chart[data-chart-id]").forEach(function (fig) {
      const src = document.getElementById("chart-data-" + fig.dataset.chartId);
      const old = window.raconCharts[fig.dataset.chartId];
      if (old && fig.contains(old.plot.root)) return;  // drawn already (and maybe updated live)
      if (old) { old.plot.destroy(); delete window.raconCharts[fig.dataset.chartId]; }
      if (src) { try { drawChart(fig, JSON.parse(src.textContent)); } catch (e) { /* drawn on the next push */ } }
    });
  }

  function installCharts() {
    drawAll(document);
    // A filter that re-renders part of the page (the earnings table) brings new charts with it.
    document.body.addEventListener("htmx:afterSettle", function () {
      const fresh = Array.from(document.querySelectorAll("figure.chart[data-chart-id]")).some(function (fig) {
        const old = window.raconCharts[fig.dataset.chartId];
        return !old || !fig.contains(old.plot.root);
      });
      if (fresh) { drawAll(document); askCharts(); }
    });
    let resizeTimer = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(function () {
        Object.keys(window.raconCharts).forEach(function (id) {
          const fig = document.querySelector('figure.chart[data-chart-id="' + id + '"]');
          const box = fig && fig.querySelector(".chart-plot");
          if (box) window.raconCharts[id].plot.setSize({ width: Math.max(240, box.clientWidth), height: 170 });
        });
      }, 150);
    });
    document.addEventListener("change", function (ev) {
      const sel = ev.target.closest("select[data-chart-window]");
      if (!sel) return;
      const group = document.getElementById(sel.dataset.chartWindow);
      if (!group) return;
      group.querySelectorAll("figure.chart[data-chart-id]").forEach(function (fig) {
        const spec = chartSpec(fig); spec.window = sel.value; fig.dataset.spec = JSON.stringify(spec);
      });
      askCharts();
    });
  }

  function askCharts() {
    const specs = {};
    document.querySelectorAll("figure.chart[data-chart-id]").forEach(function (fig) { specs[fig.dataset.chartId] = chartSpec(fig); });
    if (liveSocket && Object.keys(specs).length) liveSocket.send(JSON.stringify({ charts: specs }));
  }

  function installChartSocket() {
    document.body.addEventListener("htmx:wsOpen", function (ev) {
      liveSocket = ev.detail.socketWrapper;
      askCharts();
    });
    document.body.addEventListener("htmx:wsClose", function () { liveSocket = null; });
    document.body.addEventListener("htmx:wsBeforeMessage", function (ev) {
      const text = ev.detail.message;
      if (typeof text !== "string" || text.charAt(0) !== "{") return;  // HTML rows: htmx swaps them
      ev.preventDefault();
      let msg;
      try { msg = JSON.parse(text); } catch (e) { return; }
      if (msg.type !== "charts") return;
      Object.keys(msg.charts || {}).forEach(function (id) {
        const fig = document.querySelector('figure.chart[data-chart-id="' + id + '"]');
        if (fig) drawChart(fig, msg.charts[id]);
      });
      document.body.dataset.chartsUpdated = String(Date.now());
    });
  }

  // Defined now, before htmx processes the page on DOMContentLoaded and opens the socket.
  if (window.htmx) { installLiveExtension(); installChartSocket(); }

  document.addEventListener("DOMContentLoaded", function () {
    const pre = document.getElementById("token-stream");
    if (pre) followJob(pre);
    const form = document.getElementById("pg-form");
    if (form) playground(form);
    installCharts();
  });
})();
