// diprl web: learning curves that follow a run, the game viewer, and the play form's helpers.
"use strict";
const $ = (id) => document.getElementById(id);
function esc(s) { const d = document.createElement("div"); d.textContent = String(s); return d.innerHTML; }
const COLOURS = ["#2563a8", "#c2410c", "#15803d", "#7e22ce", "#a16207", "#0e7490", "#be123c", "#4b5563",
  "#65a30d", "#db2777", "#0891b2", "#92400e"];  // twelve: a league's ratings chart has a series per member

// ---------------------------------------------------------------- charts (runs page)
function chartSvg(chart) {
  const pts = chart.series.flatMap((s) => s.points);
  if (!pts.length) return '<p class="muted">no data yet</p>';
  const W = 380, H = 170, L = 44, R = 8, T = 8, B = 20;
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = Math.min(...pts.map((p) => (p.length > 2 ? p[2] : p[1])));
  let y1 = Math.max(...pts.map((p) => (p.length > 3 ? p[3] : p[1])));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  let out = `<svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">`;
  out += `<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#999"/>`;
  for (const y of [y0, (y0 + y1) / 2, y1]) out += `<text x="${L - 4}" y="${sy(y) + 4}" font-size="10" text-anchor="end">${+y.toPrecision(3)}</text>`;
  for (const x of [x0, x1]) out += `<text x="${sx(x)}" y="${H - 6}" font-size="10" text-anchor="middle">${+x.toPrecision(4)}</text>`;
  chart.series.forEach((s, i) => {
    const c = COLOURS[i % COLOURS.length];
    const band = s.points.filter((p) => p.length > 3);
    for (const p of band) out += `<line x1="${sx(p[0])}" x2="${sx(p[0])}" y1="${sy(p[2])}" y2="${sy(p[3])}" stroke="${c}" opacity="0.4" stroke-width="3"/>`;
    out += `<polyline fill="none" stroke="${c}" stroke-width="1.6" points="${s.points.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" ")}"/>`;
    for (const p of s.points) out += `<circle cx="${sx(p[0])}" cy="${sy(p[1])}" r="2" fill="${c}"/>`;
  });
  return out + "</svg>";
}

function legendHtml(chart) {
  return chart.series.map((s, i) => `<span style="color:${COLOURS[i % COLOURS.length]}">■ ${esc(s.label)}</span>`).join("");
}

function drawCharts(box, payload) {
  box.innerHTML = payload.charts.map((chart) =>
    `<div class="chart" data-title="${esc(chart.title)}"><h4>${esc(chart.title)}</h4>${chartSvg(chart)}<div class="legend">${legendHtml(chart)}</div></div>`
  ).join("");
  const status = $("run-status");
  if (status) { status.textContent = payload.status; status.className = `status ${payload.status}`; }
  if ($("run-steps")) $("run-steps").textContent = payload.steps;
  if ($("run-updated")) $("run-updated").textContent = new Date(payload.updated * 1000).toLocaleString();
  box.dataset.records = payload.records;
}

function followRun(box) {
  const poll = 1000 * (+box.dataset.poll || 5);
  const tick = async () => {
    try {
      const r = await fetch(`/api/curves?run=${encodeURIComponent(box.dataset.run)}`, { credentials: "same-origin" });
      const payload = await r.json();
      if (!r.ok) { box.innerHTML = `<div class="error">${esc(payload.error || r.status)}</div>`; return; }
      drawCharts(box, payload);
      if (payload.status === "running") setTimeout(tick, poll);
    } catch (e) { setTimeout(tick, poll * 2); }
  };
  tick();
}

// A chart the server wrote into the page (the league page's health figures): drawn once, where it stands.
function drawPlot(el) {
  const chart = JSON.parse(el.dataset.chart);
  el.innerHTML = `${chartSvg(chart)}<div class="legend">${legendHtml(chart)}</div>`;
}

// ---------------------------------------------------------------- game viewer (games page)
function viewer(data) {
  let fork = 0, i = 0;
  const phases = () => data.forks[fork].phases;
  const slider = $("slider");
  function forkInfo(f) {
    const info = f.info || {};
    if (!Object.keys(info).length) return "";
    let h = "";
    if (info.return !== null && info.return !== undefined) h += `<div><b>return</b> ${(+info.return).toFixed(3)}</div>`;
    const comps = Object.entries(info.components || {});
    if (comps.length) h += `<div class="muted">${comps.map(([k, v]) => `${esc(k)} ${(+v).toFixed(3)}`).join(" · ")}</div>`;
    for (const [k, v] of Object.entries(info.extra || {})) h += `<div><b>${esc(k)}</b> ${esc(typeof v === "string" ? v : JSON.stringify(v))}</div>`;
    if (info.completion) h += `<details><summary>the hero's completion</summary><pre class="completion">${esc(info.completion)}</pre></details>`;
    return h;
  }
  function show(k) {
    i = Math.max(0, Math.min(phases().length - 1, k));
    const p = phases()[i], f = data.forks[fork];
    $("map").src = `${data.svg}&fork=${f.index}&phase=${i}`;
    $("phase").textContent = i === phases().length - 1 ? `${p.name} (end)` : p.name;
    slider.max = phases().length - 1; slider.value = i;
    $("count").textContent = `phase ${i + 1} / ${phases().length}`;
    let rows = "<tr><th>power</th><th>seat</th><th>centres</th></tr>";
    for (const [pw, n] of Object.entries(p.centres)) {
      rows += `<tr class="${pw === data.hero ? "hero" : ""}"><td>${esc(pw)}</td><td>${esc(data.seats[pw] || "")}${pw === data.hero ? " (hero)" : ""}</td><td>${n}</td></tr>`;
    }
    $("centres").innerHTML = rows;
    $("forkinfo").innerHTML = forkInfo(f);
    const rewards = (f.info && f.info.order_rewards) || {};
    const decision = data.info && data.info.decision_phase;
    let h = "";
    for (const [pw, os] of Object.entries(p.orders)) {
      if (!os.length) continue;
      h += `<div class="power ${pw === data.hero ? "hero" : ""}">${esc(pw)}</div>`;
      for (const o of os) {
        const unit = o.split(" ").slice(0, 2).join(" ");
        const r = p.results[unit];
        const rw = pw === data.hero && p.name === decision && o in rewards ? ` <span class="reward">reward ${(+rewards[o]).toFixed(3)}</span>` : "";
        h += `<div class="ord">${esc(o)}${r && r.length ? ` <span class="res">(${esc(r.join(", "))})</span>` : ""}${rw}</div>`;
      }
    }
    $("orders").innerHTML = h || '<p class="muted">no orders (the final board)</p>';
  }
  $("first").onclick = () => show(0); $("last").onclick = () => show(phases().length - 1);
  $("prev").onclick = () => show(i - 1); $("next").onclick = () => show(i + 1);
  slider.oninput = (e) => show(+e.target.value);
  if ($("fork")) $("fork").onchange = (e) => { fork = +e.target.value; show(Math.min(i, phases().length - 1)); };
  document.addEventListener("keydown", (e) => {
    if (e.key === "ArrowRight") show(i + 1); else if (e.key === "ArrowLeft") show(i - 1);
  });
  const decision = data.info && data.info.decision_phase;
  const start = decision ? phases().findIndex((p) => p.name === decision) : 0;
  show(start > 0 ? start : 0);
}

// ---------------------------------------------------------------- play
function playForm() {
  const human = $("human"), everyone = $("everyone");
  const sync = () => document.querySelectorAll("label.seat").forEach((l) => {
    const mine = l.dataset.power === human.value;
    l.style.display = mine ? "none" : "";
    l.querySelector("select").disabled = mine;
  });
  human.onchange = sync; sync();
  everyone.onchange = () => {
    if (!everyone.value) return;
    document.querySelectorAll("label.seat select").forEach((s) => { s.value = everyone.value; });
  };
}

document.addEventListener("DOMContentLoaded", () => {
  // No inline handlers (the content security policy allows this file's scripts only).
  const pick = $("runpick");
  if (pick) pick.onchange = () => pick.form.submit();
  const back = $("back");
  if (back && history.length > 1) back.onclick = (e) => { e.preventDefault(); history.back(); };
  if ($("charts")) followRun($("charts"));
  document.querySelectorAll(".plot[data-chart]").forEach(drawPlot);
  if ($("game-data")) viewer(JSON.parse($("game-data").textContent));
  if ($("newgame")) playForm();
  const last = $("show-last");
  if (last) last.onchange = () => { const b = $("board"); b.src = last.checked ? b.dataset.last : b.dataset.current; };
});
