// The swarm as a web page: the map, the experts, a token's journey and a chat. Plain JavaScript, no library.
// Everything shown comes from this daemon's API (same origin), with the API token, when one is needed, as
// "Authorization: Bearer" (kept in sessionStorage). Text from the swarm (labels, peer ids, answers) is always set as
// text, never parsed as HTML.
"use strict";

const TOKEN_KEY = "swarmd.apiToken";
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

let status = null;       // the latest status document
let liveRun = 0;         // bumped to stop the previous live loop
let traceUrl = null;     // the object URL of the downloadable trace
let traceEvents = null;  // the selected trace's events
let chatAbort = null;
const chat = [];         // the conversation so far: {role, content}

class AuthNeeded extends Error {}

// --- the API ------------------------------------------------------------------------------------------------------

function headers(extra) {
  const out = Object.assign({}, extra || {});
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) out.Authorization = "Bearer " + token;
  return out;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  const response = await fetch(path, opts);
  if (response.status === 401) {
    askToken(sessionStorage.getItem(TOKEN_KEY) ? "The daemon refused this token." : "");
    throw new AuthNeeded();
  }
  return response;
}

async function getJson(path) {
  const response = await api(path);
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + response.status;
}

// Server-sent events from a fetch (EventSource cannot send the Authorization header): calls onData per event.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length && onData(data.join("\n")) === false) {
        reader.cancel();
        return;
      }
    }
  }
}

function askToken(why) {
  liveRun++;
  $("auth").hidden = false;
  $("auth-why").textContent = why;
  $("summary").textContent = "waiting for the API token";
  $("auth-token").focus();
}

// --- formatting -------------------------------------------------------------------------------------------------

const short = (peer) => (peer && peer.length > 6 ? peer.slice(-6) : peer || "-");

function bytes(n) {
  if (n === null || n === undefined) return "-";
  let size = Number(n);
  for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
    if (size < 1024 || unit === "TiB") return size.toFixed(unit === "B" || size >= 100 ? 0 : 1) + " " + unit;
    size /= 1024;
  }
  return "-";
}

// A line of the map cut to what its box holds (the whole of it is in the box's tooltip).
const fit = (text, chars) => (text.length > chars ? text.slice(0, chars - 1) + "…" : text);

const range = (layers) => layers[0] + "–" + (layers[1] - 1);
const ms = (us) => (us / 1000).toFixed(3) + " ms";

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// --- live status --------------------------------------------------------------------------------------------------

async function live() {
  const run = ++liveRun;
  while (run === liveRun) {
    try {
      render(await getJson("api/v0/status"));  // the first view: a plain fetch
      const response = await api("api/v0/status/events");
      if (!response.ok || !response.body) throw new Error(await errorText(response));
      await readEvents(response, (data) => {
        if (run !== liveRun) return false;
        render(JSON.parse(data));
        return true;
      });
    } catch (e) {
      if (e instanceof AuthNeeded) return;
      $("connection").textContent = "this daemon does not answer (" + e.message + "); trying again every second";
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));  // at most once a second when streaming fails
  }
}

function render(doc) {
  status = doc;
  $("connection").textContent = "";
  renderSummary(doc);
  renderMap(doc);
  renderExperts(doc);
}

function renderSummary(doc) {
  const count = (s) => doc.members.filter((m) => m.state === s).length;
  const states = [count("alive") + " alive"];
  if (count("suspect")) states.push(count("suspect") + " suspect");
  if (count("dead")) states.push(count("dead") + " dead");
  const swarm = typeof doc.swarm === "object" ? doc.swarm.name : doc.swarm;
  const me = doc.self;
  $("summary").textContent = "swarm " + swarm + " · model " + me.model.name + " · this daemon " + short(me.peer_id)
    + " · leader " + (doc.leader ? short(doc.leader) : "none") + " · term " + doc.term
    + " · plan epoch " + (doc.plan ? doc.plan.epoch : "-") + " · " + states.join(", ")
    + " · " + doc.requests_in_flight + " request(s) in flight here";
  $("coverage").textContent = (doc.coverage || "") + (doc.plan_error ? " (" + doc.plan_error + ")" : "");
}

// --- the map ------------------------------------------------------------------------------------------------------

const BOX_W = 250, BOX_H = 138, LINE_CHARS = 38, GAP_X = 96, GAP_Y = 56, MARGIN = 16, ENTRY = 90;

function renderMap(doc) {
  const map = $("map");
  const stages = doc.plan ? doc.plan.stages : [];
  const byPeer = new Map(doc.members.map((m) => [m.peer_id, m]));
  const order = [];
  for (const s of stages) if (!order.includes(s.peer_id)) order.push(s.peer_id);
  const rest = doc.members.map((m) => m.peer_id).filter((p) => !order.includes(p)).sort();
  order.push(...rest);
  const groupOf = new Map();
  ((doc.groups && doc.groups.groups) || []).forEach((g, i) => g.forEach((p) => groupOf.set(p, i)));
  const maxLoad = Math.max(4, ...doc.members.map((m) => m.load || 0));

  const cols = Math.max(1, Math.min(order.length, 4));
  const rows = Math.ceil(order.length / cols);
  const left = MARGIN + (stages.length ? ENTRY : 0);
  const width = left + cols * BOX_W + (cols - 1) * GAP_X + MARGIN;
  const height = MARGIN * 2 + rows * BOX_H + (rows - 1) * GAP_Y + 10;
  map.setAttribute("viewBox", "0 0 " + width + " " + height);
  map.replaceChildren(arrowhead());
  const at = new Map(order.map((p, i) => [p, { x: left + (i % cols) * (BOX_W + GAP_X),
                                              y: MARGIN + Math.floor(i / cols) * (BOX_H + GAP_Y) }]));

  stages.forEach((s, i) => {  // the chain, drawn under the boxes
    const to = at.get(s.peer_id);
    const m = byPeer.get(s.peer_id);
    const broken = !m || m.state === "dead";
    const from = i === 0 ? null : at.get(stages[i - 1].peer_id);
    map.appendChild(chainArrow(from, to, i, s.layers, broken));
  });
  for (const peer of order) {
    const m = byPeer.get(peer);
    if (m) map.appendChild(memberBox(m, at.get(peer), doc, stages, groupOf, maxLoad));
  }
}

function arrowhead() {
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7",
                                 markerHeight: "7", orient: "auto-start-reverse" });
  marker.appendChild(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrowhead" }));
  defs.appendChild(marker);
  return defs;
}

function chainArrow(from, to, hop, layers, broken) {
  const g = svg("g", { class: "chain" + (broken ? " broken" : ""), "data-hop": hop, "data-blocks": range(layers) });
  const label = "blocks " + range(layers);
  let x1, y1, x2, y2, d;
  if (!from) {  // into stage 0
    x1 = to.x - ENTRY + 4; y1 = to.y + BOX_H / 2; x2 = to.x; y2 = y1;
  } else if (Math.abs(from.y - to.y) < 1 && to.x > from.x) {
    x1 = from.x + BOX_W; y1 = from.y + BOX_H / 2; x2 = to.x; y2 = y1;
  } else {  // to the next row: down from the box, across, into the next one from the left
    x1 = from.x + BOX_W / 2; y1 = from.y + BOX_H; x2 = to.x; y2 = to.y + BOX_H / 2;
    const midY = from.y + BOX_H + GAP_Y / 2;
    d = "M " + x1 + " " + y1 + " V " + midY + " H " + (to.x - GAP_X / 2) + " V " + y2 + " H " + x2;
  }
  if (d) g.appendChild(svg("path", { d: d, "marker-end": "url(#arrow)" }));
  else g.appendChild(svg("line", { x1: x1, y1: y1, x2: x2, y2: y2, "marker-end": "url(#arrow)" }));
  const tx = d ? to.x - GAP_X / 2 + 4 : (x1 + x2) / 2;
  const ty = d ? y2 - 8 : y1 - 8;
  g.appendChild(svg("text", { x: tx, y: ty, "text-anchor": d ? "start" : "middle" }, label));
  g.appendChild(svg("title", {}, "stage " + hop + ": blocks " + range(layers) + (broken ? " (its holder is gone)" : "")));
  return g;
}

function memberBox(m, pos, doc, stages, groupOf, maxLoad) {
  const me = doc.self.peer_id;
  const hops = stages.map((s, i) => (s.peer_id === m.peer_id ? i : -1)).filter((i) => i >= 0);
  const blocks = hops.map((i) => range(stages[i].layers));
  const leader = m.peer_id === doc.leader;
  const g = svg("g", { class: "member " + m.state + (m.peer_id === me ? " self" : ""), "data-peer": m.peer_id,
                       "data-short": short(m.peer_id), "data-state": m.state, "data-leader": String(leader),
                       "data-blocks": blocks.join(","), transform: "translate(" + pos.x + "," + pos.y + ")" });
  g.appendChild(svg("rect", { class: "box", width: BOX_W, height: BOX_H, rx: 8 }));
  const line = (y, text, cls) => g.appendChild(svg("text", { x: 12, y: y, class: cls || "" }, fit(text, LINE_CHARS)));
  line(22, short(m.peer_id) + (leader ? " ★ leader" : ""), "peer");
  g.appendChild(svg("text", { x: BOX_W - 12, y: 22, "text-anchor": "end", class: "state " + m.state }, m.state));
  line(42, (m.label || m.device_name || m.device || "-") + (m.peer_id === me ? " (this daemon)" : ""));
  const used = m.memory_total && m.memory_free !== null ? m.memory_total - m.memory_free : null;
  line(60, "memory " + (used !== null ? bytes(used) + " used · " : "") + bytes(m.memory_free) + " free", "muted");
  const group = groupOf.has(m.peer_id) ? "group " + String.fromCharCode(65 + (groupOf.get(m.peer_id) % 26)) : "no group";
  const rtt = m.peer_id === me ? "here" : m.rtt_ms === null || m.rtt_ms === undefined ? "rtt -" : "rtt " + m.rtt_ms.toFixed(1) + " ms";
  line(78, group + " · " + rtt, "muted");
  const a = m.assignment || {};
  let what = hops.length ? hops.map((i, k) => "stage " + i + " · blocks " + blocks[k]).join("; ") : "no stage";
  if (a.experts && Object.keys(a.experts).length) {
    what += " · " + Object.values(a.experts).reduce((n, es) => n + es.length, 0) + " experts";
  }
  if (a.state && a.state !== "ready" && a.state !== "idle") what += " (" + a.state + ")";
  line(98, what, "stage");
  const load = m.load || 0;
  line(120, "load " + load + " request" + (load === 1 ? "" : "s"), "muted");
  g.appendChild(svg("rect", { class: "load-track", x: 110, y: 112, width: BOX_W - 122, height: 8, rx: 3 }));
  g.appendChild(svg("rect", { class: "load-bar", x: 110, y: 112, width: Math.max(0, (BOX_W - 122) * Math.min(1, load / maxLoad)),
                              height: 8, rx: 3 }));
  g.appendChild(svg("title", {}, m.peer_id + (m.reason ? " — " + m.reason : "")));
  return g;
}

// --- the experts heatmap --------------------------------------------------------------------------------------------

function renderExperts(doc) {
  const moe = doc.moe;
  const section = $("experts-section");
  if (!moe || !moe.placement || !Object.keys(moe.placement).length) {
    section.hidden = true;
    return;
  }
  section.hidden = false;
  const blocks = Object.keys(moe.placement).sort((a, b) => a - b);
  const nExperts = Math.max(...blocks.map((b) => Math.max(...Object.keys(moe.placement[b]).map(Number)) + 1));
  const here = (moe.computed_here && moe.computed_here.tokens) || {};
  const tokensOf = (b, e) => {
    const routed = moe.routed && moe.routed[b] && moe.routed[b].tokens;
    if (routed && Object.keys(routed).length) return routed[e] || 0;
    return (here[b] && here[b][e]) || 0;
  };
  let most = 1;
  for (const b of blocks) for (let e = 0; e < nExperts; e++) most = Math.max(most, tokensOf(b, String(e)));

  const table = el("table", { class: "heatmap", "aria-label": "experts by block and holder" });
  const head = el("tr", {}, undefined);
  head.appendChild(el("th", { scope: "col" }, "block · holder \\ expert"));
  for (let e = 0; e < nExperts; e++) head.appendChild(el("th", { scope: "col" }, String(e)));
  table.appendChild(el("thead")).appendChild(head);
  const body = table.appendChild(el("tbody"));
  for (const b of blocks) {
    const holders = new Map();
    for (const [e, peers] of Object.entries(moe.placement[b])) {
      for (const p of peers) {
        if (!holders.has(p)) holders.set(p, new Set());
        holders.get(p).add(e);
      }
    }
    for (const [peer, held] of [...holders.entries()].sort((x, y) => short(x[0]).localeCompare(short(y[0])))) {
      const row = el("tr", { "data-block": b, "data-holder": peer });
      row.appendChild(el("th", { scope: "row" }, "block " + b + " · " + short(peer)));
      for (let e = 0; e < nExperts; e++) {
        const key = String(e);
        if (!held.has(key)) {
          row.appendChild(el("td", { class: "empty" }));
          continue;
        }
        const n = tokensOf(b, key);
        const cell = el("td", { class: "held", "data-expert": key, "data-tokens": String(n),
                                title: "block " + b + ", expert " + e + " on " + short(peer) + ": " + n + " tokens routed" },
                        n ? String(n) : "");
        const t = Math.log1p(n) / Math.log1p(most);
        cell.style.background = "rgb(" + Math.round(150 - 120 * t) + "," + Math.round(190 - 120 * t) + "," + Math.round(225 - 60 * t) + ")";
        row.appendChild(cell);
      }
      body.appendChild(row);
    }
  }
  const wrap = el("div", { class: "heatmap-wrap" });
  wrap.appendChild(table);
  $("experts").replaceChildren(wrap);
}

// --- a token's journey ------------------------------------------------------------------------------------------------

async function loadTraces(selectNewest) {
  const select = $("trace-select");
  let list;
  try {
    list = (await getJson("api/v0/traces")).traces;
  } catch (e) {
    if (!(e instanceof AuthNeeded)) $("journey-note").textContent = "traces: " + e.message;
    return;
  }
  const current = select.value;
  select.replaceChildren();
  if (!list.length) select.appendChild(el("option", { value: "" }, "no traced request yet"));
  for (const t of list) {
    const when = new Date(t.finished * 1000).toLocaleTimeString();
    select.appendChild(el("option", { value: t.request_id },
      t.request_id + " · " + t.tokens + " tokens · " + t.nodes.length + " daemons · " + when));
  }
  const keep = !selectNewest && list.some((t) => t.request_id === current);
  select.value = keep ? current : list.length ? list[0].request_id : "";
  if (select.value && (select.value !== current || selectNewest)) await loadTrace(select.value);
}

async function loadTrace(id) {
  let text;
  try {
    const response = await api("api/v0/traces/" + encodeURIComponent(id));
    if (!response.ok) throw new Error(await errorText(response));
    text = await response.text();
  } catch (e) {
    if (!(e instanceof AuthNeeded)) $("journey-note").textContent = "trace " + id + ": " + e.message;
    return;
  }
  traceEvents = JSON.parse(text).traceEvents;
  if (traceUrl) URL.revokeObjectURL(traceUrl);
  traceUrl = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const link = $("trace-download");
  link.href = traceUrl;
  link.download = "swarmd-trace-" + id + ".json";
  link.hidden = false;
  const steps = [...new Set(traceEvents.filter((e) => e.ph === "X" && Number.isInteger((e.args || {}).step))
    .map((e) => e.args.step))].sort((a, b) => a - b);
  const stepSelect = $("trace-step");
  stepSelect.replaceChildren(...steps.map((s) => el("option", { value: s }, s === 0 ? "0 (prefill)" : String(s))));
  const decoded = steps.filter((s) => s >= 1);  // a typical token by default: the middle decode step
  stepSelect.value = String(decoded.length ? decoded[Math.floor(decoded.length / 2)] : steps[0] ?? "");
  $("journey-note").textContent = "Spans of one token (one step of the request) on the head's clock, from the same "
    + "trace that the link opens in Perfetto.";
  renderWaterfall();
}

const KIND = {
  "stage.queue": "queue", "stage.handover": "queue", "hop.admit": "queue", "expert.queue": "queue",
  "head.wait_for_chain": "queue",
  "stage.forward": "compute", "stage.sample": "compute", "stage.output": "compute", "expert.forward": "compute",
  "head.detokenize": "compute", "tokenize": "compute",
  "hop.serialise": "hop", "hop.send": "hop", "hop.deserialise": "hop", "hop.wire": "hop", "moe.send": "hop",
  "moe.call": "hop", "moe.fan_out": "hop", "expert.batch": "hop",
};

function processes(events) {
  const out = new Map();
  for (const e of events) {
    if (e.ph === "M" && e.name === "process_name") {
      const name = String(e.args.name);
      const cut = name.lastIndexOf(" ");
      out.set(e.pid, cut > 0 ? { role: name.slice(0, cut), peer: name.slice(cut + 1) } : { role: name, peer: "" });
    }
  }
  return out;
}

function spanDetail(e) {
  const a = e.args || {};
  const parts = [];
  if (a.msg) parts.push(a.msg);
  if (a.to) parts.push("→ " + short(a.to));
  if (a.sender) parts.push("← " + short(a.sender));
  if (a.bytes !== undefined) parts.push(bytes(a.bytes));
  if (a.batch > 1) parts.push("batch " + a.batch);
  return parts.join(" ");
}

function renderWaterfall() {
  const box = $("waterfall");
  if (!traceEvents) {
    box.replaceChildren();
    return;
  }
  const step = Number($("trace-step").value);
  const procs = processes(traceEvents);
  const spans = traceEvents.filter((e) => e.ph === "X" && (e.args || {}).step === step);
  // The time on the wire of each hop: from the sender's frame ready (hop.send) to the receiver decoding it.
  const sent = new Map(spans.filter((e) => e.name === "hop.send" && e.args.flow !== undefined).map((e) => [e.args.flow, e]));
  for (const e of spans.filter((s) => s.name === "hop.deserialise" && sent.has(s.args.flow))) {
    const from = sent.get(e.args.flow);
    spans.push({ name: "hop.wire", ph: "X", pid: e.pid, ts: from.ts, dur: Math.max(0, e.ts - from.ts),
                 args: { step: step, sender: e.args.sender, bytes: from.args.bytes, msg: e.args.msg } });
  }
  if (!spans.length) {
    box.replaceChildren(el("p", { class: "wf-legend" }, "no spans for this step"));
    return;
  }
  const t0 = Math.min(...spans.map((e) => e.ts));
  const t1 = Math.max(...spans.map((e) => e.ts + e.dur));
  const total = Math.max(t1 - t0, 1);
  const byPid = new Map();
  for (const e of spans) {
    if (!byPid.has(e.pid)) byPid.set(e.pid, []);
    byPid.get(e.pid).push(e);
  }
  const pids = [...byPid.keys()].sort((a, b) => Math.min(...byPid.get(a).map((e) => e.ts)) - Math.min(...byPid.get(b).map((e) => e.ts)));
  const out = [];
  const axis = el("div", { class: "wf-axis" });
  axis.appendChild(el("span", {}, "step " + step + (step === 0 ? " (prefill)" : "") + ": " + ms(total) + " in all"));
  const ticks = el("span");
  for (const f of [0, 0.25, 0.5, 0.75, 1]) ticks.appendChild(el("span", {}, (f * total / 1000).toFixed(2) + " ms"));
  axis.appendChild(ticks);
  out.push(axis);
  for (const pid of pids) {
    const p = procs.get(pid) || { role: "pid " + pid, peer: "" };
    const node = el("div", { class: "wf-node", role: "rowgroup", "data-peer": p.peer, "data-role": p.role });
    node.appendChild(el("div", { class: "wf-node-name", role: "row" }, short(p.peer) + " · " + p.role));
    for (const e of byPid.get(pid).sort((a, b) => a.ts - b.ts)) {
      const kind = KIND[e.name] || "other";
      const label = e.name + " " + spanDetail(e) + " · " + ms(e.dur);
      const row = el("div", { class: "wf-row", role: "row", "data-span": e.name, "data-kind": kind });
      row.appendChild(el("div", { class: "wf-label", role: "cell", title: label }, label));
      const track = el("div", { class: "wf-track", role: "cell" });
      const bar = el("div", { class: "wf-bar " + kind, title: label });
      bar.style.left = ((e.ts - t0) / total * 100).toFixed(3) + "%";
      bar.style.width = (e.dur / total * 100).toFixed(3) + "%";
      track.appendChild(bar);
      row.appendChild(track);
      node.appendChild(row);
    }
    out.push(node);
  }
  const legend = el("div", { class: "wf-legend" });
  for (const [kind, text] of [["queue", "queue"], ["compute", "compute"], ["hop", "hop (bytes on the wire)"]]) {
    legend.appendChild(el("i", { class: kind }));
    legend.appendChild(document.createTextNode(text));
  }
  out.push(legend);
  box.replaceChildren(...out);
}

// --- the chat ---------------------------------------------------------------------------------------------------

function chatMessage(role, text) {
  const node = el("div", { class: "msg " + role, "data-role": role }, text);
  $("chat-log").appendChild(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

async function send(event) {
  event.preventDefault();
  const input = $("chat-input");
  const text = input.value;
  if (!text.trim() || chatAbort) return;
  input.value = "";
  chat.push({ role: "user", content: text });
  chatMessage("user", text);
  const answer = chatMessage("assistant", "");
  answer.dataset.state = "streaming";
  const traced = $("chat-trace").checked;
  const body = { messages: chat.slice(), stream: true, stream_options: { include_usage: true },
                 max_tokens: Number($("chat-max-tokens").value) || 128,
                 temperature: Number($("chat-temperature").value) || 0 };
  if (status) body.model = status.self.model.name;
  chatAbort = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const stats = $("chat-stats");
  const started = performance.now();
  let first = null, last = null, chunks = 0, usage = null, finish = null, failed = null;
  const show = () => {
    const decode = first !== null && last > first && chunks > 1 ? (chunks - 1) / ((last - first) / 1000) : null;
    stats.textContent = (usage ? usage.completion_tokens : chunks) + " tokens"
      + (decode ? " · " + decode.toFixed(1) + " tokens/s" : "")
      + (first !== null ? " · first token after " + ((first - started) / 1000).toFixed(2) + " s" : "")
      + (finish ? " · finished: " + finish : "");
  };
  stats.textContent = "waiting for the swarm…";
  try {
    const response = await api("v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: chatAbort.signal,
      headers: Object.assign({ "Content-Type": "application/json" }, traced ? { "X-Swarmd-Trace": "1" } : {}),
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        failed = chunk.error.message;
        return false;
      }
      if (chunk.usage) usage = chunk.usage;
      const choice = (chunk.choices || [])[0];
      if (choice) {
        const piece = (choice.delta || {}).content;
        if (piece) {
          const now = performance.now();
          if (first === null) first = now;
          last = now;
          chunks++;
          answer.textContent += piece;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      show();
      return true;
    });
  } catch (e) {
    if (e.name === "AbortError") failed = "stopped";
    else if (!(e instanceof AuthNeeded)) failed = e.message;
    else failed = "the API wants a token";
  }
  chatAbort = null;
  $("chat-send").disabled = false;
  $("chat-stop").disabled = true;
  show();
  if (failed) {  // the turn is not part of the conversation that goes on
    chatMessage("error", failed);
    answer.dataset.state = "failed";
    chat.pop();
    return;
  }
  answer.dataset.state = "done";
  chat.push({ role: "assistant", content: answer.textContent });
  if (traced) await loadTraces(true);
}

// --- start --------------------------------------------------------------------------------------------------------

function start() {
  live();
  loadTraces(false);
}

document.addEventListener("DOMContentLoaded", () => {
  $("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("auth-token").value.trim());
    $("auth-token").value = "";
    $("auth").hidden = true;
    start();
  });
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  $("chat-stop").addEventListener("click", () => chatAbort && chatAbort.abort());
  $("chat-new").addEventListener("click", () => {
    chat.length = 0;
    $("chat-log").replaceChildren();
    $("chat-stats").textContent = "";
  });
  $("trace-select").addEventListener("change", () => $("trace-select").value && loadTrace($("trace-select").value));
  $("trace-step").addEventListener("change", renderWaterfall);
  $("trace-refresh").addEventListener("click", () => loadTraces(false));
  start();
});
