/* kvindex dashboard: fed by server-sent events from /v1/dashboard/stream. No build step. */
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const TREND_POINTS = 120;

  const state = {
    interval: 1,
    historySeconds: 900,
    history: [],
    trends: {},
    snapshot: null,
    sharing: null,
    lastMessage: 0,
    prompts: [],
    chosen: null,
  };

  // -- formatting ----------------------------------------------------------------------

  const intFmt = new Intl.NumberFormat("en-US");
  const compactFmt = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });

  function fmtInt(n) {
    return n === null || n === undefined ? "–" : intFmt.format(Math.round(n));
  }
  function fmtCompact(n) {
    return n >= 10000 ? compactFmt.format(n) : intFmt.format(n);
  }
  function fmtRate(n) {
    if (n === null || n === undefined) return "–";
    if (n === 0) return "0";
    return n < 10 ? n.toFixed(1) : intFmt.format(Math.round(n));
  }
  function fmtLag(seconds) {
    if (seconds === null || seconds === undefined) return { value: "–", unit: "" };
    if (seconds < 1) return { value: Math.max(0, seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0), unit: "ms" };
    return { value: seconds.toFixed(1), unit: "s" };
  }
  // Tiers: one vocabulary for every engine (vLLM's and SGLang's medium names map to these).
  const TIERS = ["gpu", "cpu", "disk", "external"];
  function tierColor(t) {
    return t === "gpu" ? "var(--gpu)" : t === "cpu" ? "var(--cpu)" : "var(--muted)";
  }
  function lowerTiers(tiers) {
    const parts = TIERS.slice(1).filter((t) => tiers[t] !== undefined);
    return { parts, total: parts.reduce((n, t) => n + tiers[t], 0) };
  }
  function fmtTime(t, span) {
    const opts = { hour: "2-digit", minute: "2-digit", hourCycle: "h23" };
    if (span < 180) opts.second = "2-digit";
    return new Date(t * 1000).toLocaleTimeString([], opts);
  }
  function esc(text) {
    return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  // -- the stream ------------------------------------------------------------------------

  // A service started with --token: open the page once as /?token=SECRET. The server
  // answers with its session cookie (HttpOnly, for /v1/dashboard/ only) and the page
  // again, without the token in the address bar: the page's requests all go there.

  function connect() {
    const source = new EventSource("/v1/dashboard/stream");
    source.addEventListener("init", (e) => onInit(JSON.parse(e.data)));
    source.onmessage = (e) => onSnapshot(JSON.parse(e.data));
    source.onopen = () => setConnection("live", "live");
    source.onerror = () => {
      // EventSource reconnects by itself (and resumes from its last event): only say so
      // if that takes a while.
      const seen = state.lastMessage;
      setTimeout(() => {
        if (state.lastMessage === seen) setConnection("error", "reconnecting…");
      }, 3000);
    };
  }

  function setConnection(kind, text) {
    $("conn").dataset.state = kind;
    $("conn-text").textContent = text;
  }

  function onInit(msg) {
    state.interval = msg.interval;
    state.historySeconds = msg.history_seconds;
    if (msg.resumed && state.history.length) {
      const last = state.history[state.history.length - 1].t;
      state.history.push(...(msg.history || []).filter((p) => p.t > last));
    } else {
      state.history = msg.history || [];
    }
    state.trends = msg.trends || {};
    state.sharing = msg.sharing;
    onSnapshot(msg.snapshot, true);
    renderSharing();
  }

  function onSnapshot(snap, fromInit) {
    if (!snap) return;
    state.snapshot = snap;
    state.lastMessage = Date.now();
    if (!fromInit) {
      state.history.push(snap.point);
      const horizon = snap.t - state.historySeconds;
      while (state.history.length && state.history[0].t < horizon) state.history.shift();
      for (const row of snap.instances) {
        const trend = (state.trends[row.name] = state.trends[row.name] || []);
        trend.push(row.blocks);
        if (trend.length > TREND_POINTS) trend.splice(0, trend.length - TREND_POINTS);
      }
      if (snap.sharing) {
        state.sharing = snap.sharing;
        renderSharing();
      }
    }
    setConnection("live", "live");
    renderHeader(snap);
    renderInstances(snap.instances);
    renderCharts();
    $("updated").textContent = "updated " + new Date(snap.t * 1000).toLocaleTimeString();
  }

  setInterval(() => {
    if (state.lastMessage && Date.now() - state.lastMessage > 5000) {
      setConnection("stale", "no data for " + Math.round((Date.now() - state.lastMessage) / 1000) + " s");
    }
  }, 1000);

  // -- header ----------------------------------------------------------------------------

  function renderHeader(snap) {
    const f = snap.fleet;
    const st = f.statuses || {};
    const live = st.live || 0;
    $("kpi-instances").innerHTML = `${live}<small>/ ${f.instances} live</small>`;
    const parts = [];
    for (const [name, cls] of [["replaying", "replaying"], ["connecting", "connecting"], ["incomplete", "incomplete"], ["down", "down"]]) {
      if (st[name]) parts.push(`<span><span class="pill ${cls}">${st[name]} ${name}</span></span>`);
    }
    $("kpi-statuses").innerHTML = parts.length
      ? parts.join("")
      : `<span title="Every instance is live: followed with no batch lost, so its blocks are exactly the engine's">all live · state exact</span>`;

    $("kpi-blocks").textContent = fmtInt(f.blocks);
    $("kpi-blocks").dataset.value = f.blocks;
    const tiers = f.blocks_by_tier || {};
    const held = TIERS.filter((t) => tiers[t] !== undefined);
    $("kpi-media").innerHTML = held.length
      ? held.map((t) => `<span><span class="swatch" style="background:${tierColor(t)}"></span>${esc(t)} <b>${fmtInt(tiers[t])}</b></span>`).join("")
      : "<span>nothing cached yet</span>";

    $("kpi-events").textContent = fmtRate(f.events_per_s);
    $("kpi-events").dataset.value = f.events_per_s;
    $("kpi-split").innerHTML = `<span><span class="swatch" style="background:var(--store)"></span>stores <b>${fmtRate(f.stores_per_s)}</b></span><span><span class="swatch" style="background:var(--remove)"></span>removes <b>${fmtRate(f.removes_per_s)}</b></span>`;

    const lag = fmtLag(f.ingest_lag_s);
    $("kpi-lag").innerHTML = `${lag.value}<small>${lag.unit}</small>`;
    $("kpi-recovery").innerHTML = `<span>backlog <b>${fmtInt(f.backlog)}</b></span><span>replayed <b>${fmtInt(f.replayed_batches)}</b></span><span>lost <b>${fmtInt(f.lost_batches)}</b></span>`;
  }

  // -- instances -------------------------------------------------------------------------

  function sparkline(values) {
    const w = 150, h = 28, pad = 2;
    if (!values || values.length < 2) return `<svg class="spark" viewBox="0 0 ${w} ${h}"></svg>`;
    const max = Math.max(...values, 1);
    const min = Math.min(...values);
    // Fill the width from the first point (a new page has few), up to two minutes' worth.
    const step = (w - pad * 2) / (Math.min(Math.max(values.length, 30), TREND_POINTS) - 1);
    const x0 = w - pad - step * (values.length - 1);
    const pts = values.map((v, i) => [x0 + i * step, h - pad - (v / max) * (h - pad * 2)]);
    const line = pts.map((p, i) => (i ? "L" : "M") + p[0].toFixed(1) + " " + p[1].toFixed(1)).join("");
    const area = line + `L${pts[pts.length - 1][0].toFixed(1)} ${h}L${pts[0][0].toFixed(1)} ${h}Z`;
    // Drawn from 0 to the highest count; the range is written beside it (no axis).
    const range = min === max ? fmtCompact(max) : `${fmtCompact(min)}–${fmtCompact(max)}`;
    return `<span class="spark-wrap" title="blocks held over the last 2 min: ${fmtInt(min)} to ${fmtInt(max)}"><svg class="spark" viewBox="0 0 ${w} ${h}" preserveAspectRatio="none"><path class="area" d="${area}"/><path class="line" d="${line}"/></svg><span class="spark-range" data-testid="spark-range">${range}</span></span>`;
  }

  function counterCell(value, warnAbove) {
    const cls = value === 0 ? "num zero" : value > warnAbove ? "num warn" : "num";
    return `<td class="${cls}">${fmtInt(value)}</td>`;
  }

  // An engine's load stream (SGLang): requests running / waiting over its ranks and the
  // fullest rank's KV usage; each rank on hover. "–" for an engine that sends none.
  function loadCell(load) {
    if (!load) return `<td class="num zero" data-col="load">–</td>`;
    const pct = (u) => (u === null || u === undefined ? "?" : `${Math.round(u * 100)}%`);
    const title = load.ranks.map((k) => `rank ${k.rank}: ${k.running} running, ${k.waiting} waiting, KV ${pct(k.kv_usage)}`).join(" · ");
    return `<td class="num" data-col="load" title="${esc(title)}">${fmtInt(load.running)} · ${fmtInt(load.waiting)} · ${pct(load.kv_usage)}</td>`;
  }

  function renderInstances(rows) {
    // The engine's own /metrics: KV-cache usage, prefix-cache hit rate, GPU pool (blocks).
    const pct = (x) => (x === null || x === undefined ? "–" : `${Math.round(x * 100)}%`);
    const engineCell = (e) =>
      e
        ? `<td class="engine" data-col="engine" title="${esc(`waiting ${fmtInt(e.waiting)} · running ${fmtInt(e.running)}`)}">KV ${pct(e.kv_usage)} · hit ${pct(e.hit_rate)} · pool ${e.pool_blocks === null ? "–" : fmtInt(e.pool_blocks)}</td>`
        : `<td class="zero" data-col="engine">–</td>`;
    const body = $("instances-body");
    const html = rows.map((r) => {
      const tiers = r.blocks_by_tier || {};
      const lower = lowerTiers(tiers);
      const cpu = lower.parts.length
        ? `<td class="num" data-col="lower" title="${esc(lower.parts.map((t) => `${t} ${fmtInt(tiers[t])}`).join(" · "))}">${fmtInt(lower.total)}</td>`
        : `<td class="num zero" data-col="lower">–</td>`;
      const dp = r.dp > 1 ? `<span class="dp">dp ${r.dp}</span>` : "";
      const approx = r.approximate
        ? `<span class="dp" title="${esc(`no KV events (events=none): ${fmtInt(r.approximate_blocks || 0)} blocks routed there, within its pool and TTL`)}">approximate</span>`
        : "";
      const load = loadCell(r.load);
      return `<tr data-instance="${esc(r.name)}" data-blocks="${r.blocks}" data-last-seq="${r.last_seq === null ? "" : r.last_seq}">
        <td class="name">${esc(r.name)}${dp}${approx}</td>
        <td><span class="pill ${esc(r.status)}">${esc(r.status)}</span></td>
        <td class="num" data-col="gpu">${fmtInt(r.approximate ? r.approximate_blocks || 0 : tiers.gpu || 0)}</td>${cpu}
        <td>${sparkline(state.trends[r.name])}</td>
        <td class="num">${fmtRate(r.stores_per_s)}</td>
        <td class="num">${fmtRate(r.removes_per_s)}</td>
        ${load}
        ${counterCell(r.gaps, Infinity)}${counterCell(r.replayed_batches, Infinity)}${counterCell(r.lost_batches, 0)}${counterCell(r.publisher_restarts, Infinity)}
        ${engineCell(r.engine)}
      </tr>`;
    });
    body.innerHTML = html.join("") || `<tr><td colspan="12" class="empty">No instances followed yet: add some with kvindex serve --instance or POST /v1/instances.</td></tr>`;
    const total = rows.reduce((n, r) => n + (r.dp || 1), 0);
    $("instances-hint").textContent = `${rows.length} instance${rows.length === 1 ? "" : "s"} · ${total} publisher${total === 1 ? "" : "s"}`;
  }

  // -- charts ----------------------------------------------------------------------------

  const charts = { rates: null, blocks: null };

  function axis() {
    const grid = cssVar("--border");
    const text = cssVar("--muted");
    return { stroke: text, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, font: "11px " + cssVar("--sans") };
  }

  const smooth = uPlot.paths && uPlot.paths.spline ? uPlot.paths.spline() : undefined;

  function series(label, color, fill) {
    return { label, stroke: color, width: 1.8, fill: fill ? color + "22" : undefined, paths: smooth, points: { show: false }, value: (u, v) => (v === null ? "–" : fmtRate(v)) };
  }

  function makeChart(el, seriesList, yLabelFmt) {
    const width = el.clientWidth || 600;
    const opts = {
      width,
      height: 200,
      cursor: { points: { size: 6 }, drag: { x: false, y: false } },
      legend: { live: false },
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
      axes: [
        { ...axis(), space: 80, values: (u, ticks) => ticks.map((t) => fmtTime(t, u.scales.x.max - u.scales.x.min)) },
        { ...axis(), size: 56, values: (u, ticks) => ticks.map(yLabelFmt) },
      ],
      series: [{ value: (u, v) => (v === null ? "" : new Date(v * 1000).toLocaleTimeString()) }, ...seriesList],
    };
    return new uPlot(opts, [[]].concat(seriesList.map(() => [])), el);
  }

  function buildCharts() {
    for (const key of Object.keys(charts)) {
      if (charts[key]) charts[key].destroy();
    }
    charts.rates = makeChart($("chart-rates"), [series("stores/s", cssVar("--store"), true), series("removes/s", cssVar("--remove"), false)], fmtCompact);
    const blockSeries = [series("gpu", cssVar("--gpu"), true), series("lower tiers", cssVar("--cpu"), true)];
    blockSeries.forEach((s) => (s.value = (u, v) => (v === null ? "–" : fmtInt(v))));
    charts.blocks = makeChart($("chart-blocks"), blockSeries, fmtCompact);
    renderCharts();
  }

  function renderCharts() {
    if (!charts.rates) return;
    const h = state.history;
    const t = h.map((p) => p.t);
    charts.rates.setData([t, h.map((p) => p.stores), h.map((p) => p.removes)]);
    // A point's blocks are per tier (gpu, cpu, disk, external); the lower ones drawn as one.
    const lower = h.map((p) => lowerTiers(p.blocks || {}));
    const hasLower = lower.some((l) => l.parts.length);
    charts.blocks.setData([t, h.map((p) => (p.blocks && p.blocks.gpu) || 0), lower.map((l) => (hasLower ? l.total : null))]);
  }

  const resize = new ResizeObserver(() => {
    for (const [key, id] of [["rates", "chart-rates"], ["blocks", "chart-blocks"]]) {
      const chart = charts[key];
      const el = $(id);
      if (chart && el.clientWidth && Math.abs(chart.width - el.clientWidth) > 2) chart.setSize({ width: el.clientWidth, height: 200 });
    }
  });
  resize.observe($("chart-rates"));
  resize.observe($("chart-blocks"));

  // -- prefix sharing --------------------------------------------------------------------

  function renderSharing() {
    const s = state.sharing;
    if (!s) return;
    renderMatrix(s);
    renderPrefixes(s.prefixes || []);
  }

  function renderMatrix(s) {
    const names = s.instances;
    if (!names.length) {
      $("matrix").innerHTML = `<p class="empty">No instances yet.</p>`;
      return;
    }
    let max = 0;
    s.overlap.forEach((row, i) => row.forEach((v, j) => { if (i !== j) max = Math.max(max, v); }));
    const accent = cssVar("--gpu");
    const head = `<tr><th></th>${names.map((n) => `<th class="col">${esc(n)}</th>`).join("")}</tr>`;
    const rows = s.overlap.map((row, i) => {
      const cells = row.map((v, j) => {
        if (i === j) return `<td class="diag" title="${esc(names[i])} holds ${fmtInt(v)} blocks findable by tokens">${fmtCompact(v)}</td>`;
        const a = max ? 0.08 + 0.72 * (v / max) : 0;
        const strong = max && v / max > 0.55;
        const style = v ? `background:${hexAlpha(accent, a)};${strong ? "color:#fff" : ""}` : "";
        return `<td style="${style}" title="${esc(names[i])} ∩ ${esc(names[j])}: ${fmtInt(v)} blocks">${v ? fmtCompact(v) : "·"}</td>`;
      });
      return `<tr><th class="row">${esc(names[i])}</th>${cells.join("")}</tr>`;
    });
    const every = Math.round(s.every || 5);
    const note = (s.complete
      ? `Blocks compared by content (same tokens under the same parents), so instances hashing with different seeds still match. The diagonal is what each instance holds that a lookup by tokens can find.`
      : `Sampled the first ${fmtInt(s.nodes)} blocks of the prefix tree.`) +
      ` Recomputed every ${every} s while a page is open; the instances table above is updated every second, so the two can differ in between.`;
    if (s.t) $("sharing-hint").textContent = `blocks two instances both hold · every ${every} s · as of ${new Date(s.t * 1000).toLocaleTimeString()}`;
    const pct = (n) => (s.nodes ? Math.round((100 * n) / s.nodes) + "%" : "–");
    const stats = `<div class="spread">
      <div><span class="big">${fmtInt(s.nodes)}</span><span class="hint">distinct cached blocks</span></div>
      <div><span class="big">${fmtInt(s.shared)}</span><span class="hint">on 2+ instances · ${pct(s.shared)}</span></div>
      <div><span class="big">${fmtInt(s.everywhere)}</span><span class="hint">on every instance · ${pct(s.everywhere)}</span></div>
    </div>`;
    $("matrix").innerHTML = `<table class="matrix"><thead>${head}</thead><tbody>${rows.join("")}</tbody></table>${stats}<p class="matrix-note">${note}</p>`;
  }

  function hexAlpha(color, alpha) {
    const m = /^#([0-9a-f]{6})$/i.exec(color);
    if (!m) return color;
    const n = parseInt(m[1], 16);
    return `rgba(${(n >> 16) & 255}, ${(n >> 8) & 255}, ${n & 255}, ${alpha.toFixed(3)})`;
  }

  function renderPrefixes(prefixes) {
    const list = $("prefixes");
    if (!prefixes.length) {
      list.innerHTML = `<li class="empty">No prefix is held by two instances yet.</li>`;
      return;
    }
    const top = prefixes[0].score || 1;
    list.innerHTML = prefixes.slice(0, 6).map((p, i) => {
      const chips = p.instances.map((n) => `<span class="chip">${esc(n)}</span>`).join("");
      const lora = p.lora_name ? `<span class="chip lora">LoRA ${esc(p.lora_name)}</span>` : "";
      const preview = p.token_ids.slice(0, 24).join(" ") + (p.token_ids.length > 24 ? " …" : "");
      return `<li class="item" data-index="${i}" title="Look this prefix up">
        <span class="rank">${i + 1}</span>
        <span class="what"><span class="blocks">${fmtInt(p.blocks)} blocks</span><span class="hint">on</span>${chips}${lora}</span>
        <span class="score" title="${fmtInt(p.blocks)} blocks × ${p.instances.length} instances">${fmtInt(p.score)} <small>blocks × instances</small></span>
        <span class="bar"><span style="width:${((100 * p.score) / top).toFixed(1)}%"></span></span>
        <span class="tokens">${esc(preview)}</span>
      </li>`;
    }).join("");
    list.querySelectorAll("li.item").forEach((li) => {
      li.addEventListener("click", () => {
        const p = state.sharing.prefixes[Number(li.dataset.index)];
        $("tokens").value = p.token_ids.join(", ");
        $("lora").value = p.lora_name || "";
        $("recent").value = "";
        state.chosen = null;
        runLookup();
        $("lookup-form").scrollIntoView({ behavior: "smooth", block: "start" });
      });
    });
  }

  // -- doctor -----------------------------------------------------------------------------

  async function loadDoctor() {
    let body;
    try {
      const res = await fetch("/v1/doctor");
      if (!res.ok) return;
      body = await res.json();
    } catch (e) {
      return;
    }
    const problems = body.findings.filter((f) => f.verdict === "problem");
    const list = $("doctor");
    list.dataset.problems = String(problems.length);
    if (!problems.length) {
      const checked = body.findings.filter((f) => f.verdict === "ok").length;
      list.innerHTML = `<li class="ok">No problem found (${fmtInt(checked)} checks passed).</li>`;
      return;
    }
    list.innerHTML = problems.map((f) => `<li class="problem">
      <span class="check">${esc(f.check)}${f.engine ? " · " + esc(f.engine) : ""}</span>
      <span class="what">${esc(f.message)}</span>
      ${f.fix ? `<span class="fix">→ ${esc(f.fix)}</span>` : ""}</li>`).join("");
  }

  // -- lookup ----------------------------------------------------------------------------

  async function loadPrompts() {
    try {
      const res = await fetch("/v1/dashboard/prompts");
      if (!res.ok) return;
      const body = await res.json();
      state.prompts = body.prompts || [];
    } catch (e) {
      return;
    }
    const select = $("recent");
    // Keep the prompt on show in the list, wherever newer ones push it.
    const chosen = state.chosen;
    if (chosen && !state.prompts.some((p) => promptKey(p) === promptKey(chosen))) state.prompts.unshift(chosen);
    select.hidden = state.prompts.length === 0;
    select.innerHTML = `<option value="">Recent prompts (${state.prompts.length})…</option>` + state.prompts.map((p, i) => {
      const bits = [p.instance, fmtInt(p.token_ids.length) + " tokens"];
      if (p.lora_name) bits.push("LoRA " + p.lora_name);
      if (p.cache_salt) bits.push("salted");
      if (p.kind && p.kind !== "chat") bits.push(p.kind === "pair" ? "batch pair" : p.kind);
      return `<option value="${i}">${esc(bits.join(" · "))}</option>`;
    }).join("");
    if (chosen) select.value = String(state.prompts.findIndex((p) => promptKey(p) === promptKey(chosen)));
  }

  function promptKey(p) {
    return p.instance + "|" + p.token_ids.length + "|" + p.token_ids.slice(0, 16).join(",") + "|" + p.token_ids.slice(-16).join(",");
  }

  function parseTokens(text) {
    const found = text.match(/\d+/g);
    return found ? found.map(Number) : [];
  }

  async function runLookup() {
    const out = $("lookup-result");
    const tokens = parseTokens($("tokens").value);
    if (!tokens.length) {
      out.innerHTML = `<p class="summary error">Paste some token ids (or pick a recent prompt) first.</p>`;
      return;
    }
    const body = { token_ids: tokens };
    const lora = $("lora").value.trim();
    if (lora) body.lora_name = lora;
    // A salted prompt (SGLang's cache_salt) matches only under its salt.
    if (state.chosen && state.chosen.cache_salt) body.cache_salt = state.chosen.cache_salt;
    out.dataset.state = "running";
    try {
      const res = await fetch("/v1/dashboard/lookup", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
      const answer = await res.json();
      if (!res.ok) throw new Error(answer.error || res.statusText);
      renderLookup(tokens, answer);
      out.dataset.state = "done";
    } catch (e) {
      out.innerHTML = `<p class="summary error">Lookup failed: ${esc(e.message)}</p>`;
      out.dataset.state = "error";
    }
  }

  // The row to highlight: the API's best, except that among instances tied with it the one
  // the prompt came from wins (it is where the prompt's own blocks are; the API can't know).
  function pickRow(rows, best, origin) {
    const top = rows.find((r) => r.name === best);
    if (!top) return { pick: null, tied: [] };
    const tied = rows.filter((r) => r.matched_blocks === top.matched_blocks && r.status !== "down");
    const own = tied.find((r) => r.name === origin);
    return { pick: own || top, tied };
  }
  window.kvindexPickRow = pickRow;  // for the browser test

  function renderLookup(tokens, answer) {
    const rows = answer.instances;
    const size = rows.map((r) => r.block_size).find((s) => s) || guessBlockSize();
    const full = size ? Math.floor(tokens.length / size) : 0;
    const most = Math.max(1, full, ...rows.map((r) => r.matched_blocks));
    const origin = state.chosen ? state.chosen.instance : null;
    const { pick: best, tied } = pickRow(rows, answer.best, origin);
    const others = tied.filter((r) => r !== best).map((r) => esc(r.name));
    const tie = others.length
      ? ` Tied with ${others.join(", ")}${best.name === origin ? ": the prompt came from " + esc(origin) : ""}.`
      : "";
    const summary = best
      ? `Prompt of <b>${fmtInt(tokens.length)}</b> tokens (${fmtInt(full)} full blocks). Router pick: <b>${esc(best.name)}</b>, ${fmtInt(best.matched_blocks)} blocks (${fmtInt(best.matched_tokens)} tokens) already cached.${tie}`
      : `Prompt of <b>${fmtInt(tokens.length)}</b> tokens: no instance holds its first block, so any instance will do.`;
    const html = rows.map((r) => {
      const pick = best !== null && r.name === best.name;
      const ranks = r.ranks.length > 1 ? ` <span class="hint">(rank ${r.best_rank} of ${r.ranks.length})</span>` : "";
      return `<tr class="${pick ? "pick" : ""}" data-instance="${esc(r.name)}" data-matched="${r.matched_blocks}">
        <td class="name">${esc(r.name)}${pick ? '<span class="badge">router pick</span>' : ""}</td>
        <td><span class="pill ${esc(r.status)}">${esc(r.status)}</span></td>
        <td class="bar-cell"><div class="meter"><span style="width:${((100 * r.matched_blocks) / most).toFixed(1)}%"></span></div></td>
        <td class="num"><b>${fmtInt(r.matched_blocks)}</b> / ${fmtInt(full)} blocks${ranks}</td>
        <td class="num">${r.matched_tokens === null ? "–" : fmtInt(r.matched_tokens)} tokens</td>
      </tr>`;
    });
    $("lookup-result").innerHTML = `<p class="summary">${summary}</p><table class="matches"><tbody>${html.join("")}</tbody></table>`;
  }

  function guessBlockSize() {
    const i = $("recent").value;
    return i !== "" && state.prompts[Number(i)] ? state.prompts[Number(i)].block_size : 16;
  }

  $("lookup-form").addEventListener("submit", (e) => {
    e.preventDefault();
    runLookup();
  });
  $("recent").addEventListener("change", () => {
    const p = state.prompts[Number($("recent").value)];
    state.chosen = p || null;
    if (!p) return;
    $("tokens").value = p.token_ids.join(", ");
    $("lora").value = p.lora_name || "";
    runLookup();
  });
  $("recent").addEventListener("focus", loadPrompts);

  // -- theme -----------------------------------------------------------------------------

  $("theme").addEventListener("click", () => {
    const dark = getComputedStyle(document.documentElement).colorScheme.includes("dark");
    const next = dark ? "light" : "dark";
    document.documentElement.dataset.theme = next;
    try {
      localStorage.setItem("kvindex-theme", next);
    } catch (e) {}
    buildCharts();
    renderSharing();
  });
  window.matchMedia("(prefers-color-scheme: light)").addEventListener("change", (e) => {
    let saved = null;
    try {
      saved = localStorage.getItem("kvindex-theme");
    } catch (err) {}
    if (!saved) document.documentElement.dataset.theme = e.matches ? "light" : "dark";
    buildCharts();
    renderSharing();
  });

  buildCharts();
  loadPrompts();
  setInterval(loadPrompts, 10000);
  loadDoctor();
  setInterval(loadDoctor, 15000);
  connect();
})();
