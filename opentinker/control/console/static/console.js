// The OpenTinker console's one script: live jobs list, live job page (curves, logs).
// Data from the server is written with textContent only, never as HTML.
"use strict";
(function () {
  const page = document.body.dataset.page;
  const enc = encodeURIComponent;

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }
  function num(v) { return v === null || v === undefined ? "-" : (Number.isInteger(v) ? String(v) : Number(v).toPrecision(3)); }
  function pct(v) { return v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%"; }
  function when(s) { return s ? s.slice(0, 19).replace("T", " ") : ""; }
  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}});
    if (r.status === 401) { window.location.assign("/console/signin"); throw new Error("signed out"); }
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  }

  // --- the jobs list ---------------------------------------------------------------------
  function jobsPage() {
    const body = document.getElementById("job-rows");
    const operator = document.body.dataset.operator === "1";
    const params = new URLSearchParams(window.location.search);
    const query = new URLSearchParams();
    for (const k of ["state", "kind", "q", "page"]) if (params.get(k)) query.set(k, params.get(k));
    async function refresh() {
      let data;
      try { data = await getJSON("/console/api/jobs?" + query.toString()); } catch (e) { return; }
      for (const [state, n] of Object.entries(data.counts)) {
        const b = document.querySelector('[data-count="' + state + '"]');
        if (b) b.textContent = String(n);
      }
      const rows = [];
      for (const j of data.jobs) {
        const tr = el("tr");
        tr.dataset.job = j.job_id;
        if (operator) tr.append(el("td", j.tenant || "-"));
        const a = el("a", j.job_id);
        a.href = "/console/jobs/" + enc(j.job_id);
        const id = el("td"); id.append(a); tr.append(id);
        tr.append(el("td", j.kind), el("td", j.state, "st-" + j.state.toLowerCase()),
                  el("td", num(j.step) + "/" + num(j.total_steps)), el("td", num(j.reward)), el("td", pct(j.accuracy)),
                  el("td", when(j.started)), el("td", j.reason || "", "reason"));
        rows.push(tr);
      }
      if (!rows.length) { const tr = el("tr", null, "empty"); const td = el("td", "No jobs."); td.colSpan = 9; tr.append(td); rows.push(tr); }
      body.replaceChildren(...rows);
      document.getElementById("live").dataset.refreshed = String(Date.now());
    }
    setInterval(refresh, 3000);
  }

  // --- a job: state, curves, logs ------------------------------------------------------------
  function jobPage() {
    const job = document.body.dataset.job;
    const charts = {};
    function draw(holder, series) {
      let box = holder.querySelector('[data-curve="' + CSS.escape(series.title) + '"]');
      if (!box) {
        box = el("div", null, "chart");
        box.dataset.curve = series.title;
        box.append(el("div", series.title + " (" + series.key + ")", "chart-title"));
        holder.append(box);
      }
      const xs = series.points.map(p => p[0]), ys = series.points.map(p => p[1]);
      box.dataset.points = String(xs.length);
      const id = holder.id + ":" + series.title;
      if (typeof uPlot === "undefined") return;
      if (!charts[id]) {
        charts[id] = new uPlot({width: 420, height: 180, legend: {show: false}, scales: {x: {time: false}},
                                series: [{label: "step"}, {label: series.title, stroke: "#2a6fdb", width: 2, points: {size: 5}}],
                                axes: [{label: "step"}, {}]}, [xs, ys], box);
      } else {
        charts[id].setData([xs, ys]);
      }
    }
    async function refresh() {
      let data;
      try { data = await getJSON("/console/api/jobs/" + enc(job)); } catch (e) { return; }
      const j = data.job;
      const state = document.getElementById("job-state");
      state.textContent = j.state;
      state.className = "state st-" + j.state.toLowerCase();
      document.getElementById("job-reason").textContent = j.reason || j.failure || "";
      document.getElementById("job-step").textContent = num(j.step) + "/" + num(j.total_steps);
      document.getElementById("job-reward").textContent = num(j.reward);
      document.getElementById("job-accuracy").textContent = pct(j.accuracy);
      document.getElementById("job-ended").textContent = when(j.ended) || "-";
      document.getElementById("job-started").textContent = when(j.started) || "-";
      if (data.curves.length) { const none = document.getElementById("no-curves"); if (none) none.remove(); }
      for (const c of data.curves) draw(document.getElementById("charts"), c);
      for (const c of data.times) draw(document.getElementById("times"), c);
      const cancel = document.getElementById("cancel");
      if (cancel && !["QUEUED", "RUNNING"].includes(j.state)) cancel.disabled = true;
      document.body.dataset.refreshed = String(Date.now());
    }
    let offset = 0, complete = false;
    const logs = document.getElementById("logs");
    async function follow() {
      if (complete) return;
      let data;
      try { data = await getJSON("/console/api/jobs/" + enc(job) + "/logs?offset=" + offset); } catch (e) { return; }
      for (const line of data.lines) {
        logs.append(el("span", when(line.time) + " " + line.level + (line.task ? " [" + line.task + "]" : "") + " " + line.message + "\n"));
      }
      offset = data.next_offset;
      if (data.complete && data.lines.length < 200) complete = true;
      if (document.getElementById("follow").checked && data.lines.length) logs.scrollTop = logs.scrollHeight;
      if (data.lines.length >= 200) setTimeout(follow, 0);
    }
    refresh(); follow();
    setInterval(refresh, 2000);
    setInterval(follow, 3000);
  }

  if (page === "jobs") jobsPage();
  if (page === "job") jobPage();
})();
