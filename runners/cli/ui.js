// vigil's status page: asks /api/state every 2 s and redraws in place. Every value is set
// as text (textContent), never as markup: a host name or a reason cannot become HTML.
"use strict";
const params = new URLSearchParams(location.search);
const token = params.get("token");
if (token !== null) history.replaceState(null, "", location.pathname);  // out of the address bar
const EVERY = 2000;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function age(iso, now) {
  if (!iso) return "";
  let s = Math.max(0, Math.round((Date.parse(now) - Date.parse(iso)) / 1000));
  if (s < 60) return s + "s";
  const m = Math.floor(s / 60); s %= 60;
  if (m < 60) return m + "m" + String(s).padStart(2, "0") + "s";
  const h = Math.floor(m / 60);
  if (h < 48) return h + "h" + String(m % 60).padStart(2, "0") + "m";
  return Math.floor(h / 24) + "d" + String(h % 24).padStart(2, "0") + "h";
}
function clock(iso) { return iso ? iso.replace("T", " ").slice(0, 19) : ""; }
function fill(id, rows) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows);
}
function row(cells) {
  const tr = el("tr");
  for (const c of cells) tr.append(c instanceof Node ? c : el("td", c));
  return tr;
}

function hostRow(cells) {  // what `vigil top` shows of the host, cell for cell, then its buttons
  const tr = row(cells);
  tr.children[1].className = "state-" + cells[1];
  const actions = el("td", null, "actions");
  for (const verb of ACTIONS) {
    const b = el("button", verb);
    b.type = "button";
    b.dataset.action = verb;
    b.dataset.host = cells[0];
    actions.append(b);
  }
  tr.append(actions);
  return tr;
}

// The buttons POST to the HTTP API with its bearer token (docs/reference/http-api.md). The
// token is asked once and kept in sessionStorage: this tab only, never a cookie, never sent
// but as the Authorization header. A token refused is forgotten and asked again.
const ACTIONS = ["restart", "stop", "wake"];
const TOKEN_KEY = "vigil-api-token";
let pending = null;  // the action waiting for the token to be given
function apiToken() { return sessionStorage.getItem(TOKEN_KEY) || token; }
function said(text, bad) {
  const s = document.getElementById("action-said");
  s.textContent = text;
  s.className = bad ? "bad" : "";
}
function askToken(why, action) {
  pending = action;
  document.getElementById("token-why").textContent = why || "";
  document.getElementById("token-form").hidden = false;
  document.getElementById("api-token").focus();
}
async function act(verb, host) {
  const t = apiToken();
  if (!t) { askToken("", [verb, host]); return; }
  if (!confirm(verb + " " + host + "?")) return;
  try {
    const r = await fetch("api/v1/hosts/" + encodeURIComponent(host) + "/" + verb, {
      method: "POST", cache: "no-store", headers: {Authorization: "Bearer " + t}});
    const out = await r.json().catch(() => ({error: "answered " + r.status}));
    if (r.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      askToken("the token was refused", [verb, host]);
    } else if (!r.ok) said(verb + " " + host + ": " + out.error, true);
    else if (out.id === null) said(verb + " " + host + ": nothing to do (" + out.kind + ")");
    else said(verb + " " + host + ": " + out.kind + " #" + out.id + " queued");
  } catch (err) {
    said(verb + " " + host + ": the page's server cannot be reached (" + err + ")", true);
  }
}
document.querySelector("#hosts tbody").addEventListener("click", e => {
  const b = e.target.closest("button[data-action]");
  if (b) act(b.dataset.action, b.dataset.host);
});
document.getElementById("token-form").addEventListener("submit", e => {
  e.preventDefault();
  const input = document.getElementById("api-token");
  if (!input.value.trim()) return;
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  document.getElementById("token-form").hidden = true;
  const next = pending;
  pending = null;
  if (next) act(...next);
});
document.getElementById("token-cancel").addEventListener("click", () => {
  pending = null;
  document.getElementById("token-form").hidden = true;
});

function width(e) {  // the drawing's width as laid out (it spans the window; see ui.css)
  return Math.max(320, Math.round(e.getBoundingClientRect().width || 900));
}
function strip(events, since, now) {
  const s = document.getElementById("timeline-strip");
  const t0 = Date.parse(since), t1 = Date.parse(now), w = width(s), left = 10, right = w - 10;
  const x = iso => left + (right - left) * (Date.parse(iso) - t0) / Math.max(1, t1 - t0);
  const parts = [svg("line", {x1: left, y1: 24, x2: right, y2: 24, stroke: "#bbb"}),
                 svg("text", {x: left, y: 44}, "1 h ago"),
                 svg("text", {x: right, y: 44, "text-anchor": "end"}, "now")];
  for (const e of events) {
    const bad = /halted|revert|held_down|failed/.test(e.kind);
    const c = svg("circle", {cx: x(e.at).toFixed(1), cy: 24, r: bad ? 6 : 4,
                             fill: bad ? "#b00020" : (e.kind.startsWith("rollout") ? "#5b4fc7" : "#0a7d32")});
    c.append(svg("title", {}, clock(e.at) + " " + e.what + (e.host ? " " + e.host : "")));
    parts.push(c);
  }
  s.replaceChildren(...parts);
}

function restartChart(r) {
  const box = document.getElementById("restarts");
  const hosts = Object.keys(r.hosts).sort();
  if (!hosts.length) { box.replaceChildren(el("p", "no restarts in the last hour", "none")); return; }
  // One row a host across the window's width: its name, a bar a bucket, its total.
  const w = width(box), label = 170, total = 60, bw = Math.max(6, (w - label - total) / r.buckets);
  const bars = x => label + x * bw;
  const charts = hosts.map(h => {
    const counts = r.hosts[h], top = Math.max(1, ...counts);
    const g = svg("svg", {width: w, height: 50, role: "img",
                          "aria-label": "restarts of " + h, "data-host": h});
    g.append(svg("text", {x: 0, y: 32}, h.length > 20 ? h.slice(0, 19) + "…" : h));
    counts.forEach((n, i) => {
      const hgt = n ? 8 + 36 * n / top : 1;
      const b = svg("rect", {x: bars(i).toFixed(1), y: 46 - hgt, width: Math.max(2, bw - 2).toFixed(1),
                             height: hgt, fill: n ? "#b00020" : "#ddd"});
      if (n) b.append(svg("title", {}, n + " restart" + (n > 1 ? "s" : "")));
      g.append(b);
    });
    g.append(svg("text", {x: bars(counts.length) + 8, y: 32}, String(counts.reduce((a, b) => a + b, 0))));
    return g;
  });
  const axis = svg("svg", {width: w, height: 20, "aria-hidden": "true"});
  axis.append(svg("text", {x: label, y: 14}, "1 h ago"),
              svg("text", {x: bars(r.buckets), y: 14, "text-anchor": "end"}, "now"));
  box.replaceChildren(...[...charts, axis].map(c => { const d = el("div"); d.append(c); return d; }));
}

function hostList(hosts) {  // a rollout's or a wave's hosts, the first few by name
  if (!hosts || !hosts.length) return "";
  return hosts.slice(0, 4).join(", ") + (hosts.length > 4 ? " +" + (hosts.length - 4) + " more" : "");
}

function draw(st) {
  const a = st.agent || {};
  document.getElementById("box").textContent = a.box ? "— " + a.box : "";
  document.getElementById("agent").textContent = a.running
    ? "agent running, pid " + a.pid + (a.up_since ? ", up " + age(a.up_since, st.now) : "") + (a.last_round ? ", last round " + age(a.last_round, st.now) + " ago" : "")
    : "agent not running" + (a.stopped_at ? " (stopped " + clock(a.stopped_at) + ")" : "");
  const halted = document.getElementById("halted");
  halted.style.display = st.halted ? "block" : "none";
  halted.textContent = st.halted || "";
  document.getElementById("host-count").textContent = st.total;
  document.querySelector("#hosts thead").replaceChildren(row([...st.columns, ""].map(c => el("th", c))));
  fill("hosts", st.hosts.map(hostRow));
  document.getElementById("owed-count").textContent = st.obligations.length;
  fill("obligations", st.obligations.map(o => row([o.kind, o.host || "", o.generation ? "g" + o.generation : "",
                                                   age(o.since, st.now), o.attempts, el("td", o.waiting_for || "", "wide")])));
  strip(st.timeline, st.restarts.since, st.now);
  fill("timeline", st.timeline.slice().reverse().map(e => {
    const what = el("td", e.what, /halted|revert|held_down|failed/.test(e.kind) ? "bad" : "");
    const detail = Object.entries(e.detail).map(([k, v]) => k + " " + v).join(", ");
    return row([clock(e.at), what, e.host || hostList(e.hosts), e.generation ? "g" + e.generation : "", el("td", detail, "wide")]);
  }));
  restartChart(st.restarts);
  fill("events", st.events.slice().reverse().map(e => row([clock(e.at), e.kind, e.host || "", e.generation ? "g" + e.generation : ""])));
  document.getElementById("stale").textContent = "";
  document.body.dataset.drawn = st.now;
}

async function tick() {
  try {
    const r = await fetch("api/state", {headers: token ? {Authorization: "Bearer " + token} : {}, cache: "no-store"});
    if (r.status === 401) { document.getElementById("stale").textContent = "the token was refused: open the page with ?token=…"; }
    else if (!r.ok) { document.getElementById("stale").textContent = "the page's server answered " + r.status; }
    else draw(await r.json());
  } catch (err) {
    document.getElementById("stale").textContent = "the page's server cannot be reached (" + err + "); retrying";
  }
  setTimeout(tick, EVERY);
}
tick();
