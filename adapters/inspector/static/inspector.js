// ContextRender inspector: reads list_sessions, inspect_session and export_graph and draws them.
// Plain script, no build step, nothing fetched from elsewhere. Every figure shown comes from the
// endpoints' answers (the store's render log, explain's decisions, the graph's edges); the page
// only formats them. Text from the conversation goes in with textContent, never as HTML.
"use strict";

const MODE = document.querySelector('meta[name="contextrender-mode"]').content;
// On the server: its own walker endpoints, as the logged-in user; on the proxy: its inspector routes.
const BASE = MODE === "server" ? "/walker/" : "/contextrender/walker/";
const TOKEN_KEY = "contextrender.token";
const USER_KEY = "contextrender.user";
const view = document.getElementById("view");

class NeedLogin extends Error {}

function token() { return sessionStorage.getItem(TOKEN_KEY); }

async function call(name, fields) {
  const headers = { "content-type": "application/json" };
  if (MODE === "server") {
    if (!token()) throw new NeedLogin("log in first");
    headers.authorization = "Bearer " + token();
  }
  const response = await fetch(BASE + name, { method: "POST", headers, body: JSON.stringify(fields || {}) });
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (response.status === 401 && MODE === "server") {
    sessionStorage.removeItem(TOKEN_KEY);
    throw new NeedLogin("your login has expired: log in again");
  }
  if (!response.ok || !body || body.ok === false) {
    const message = body && body.error ? body.error.message : (body && body.detail ? JSON.stringify(body.detail) : response.statusText);
    throw new Error(`${name}: HTTP ${response.status}: ${message}`);
  }
  const reports = (body.data || {}).reports || [];
  return reports.length ? reports[0] : null;
}

// ---------------------------------------------------------------- small DOM helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const fmt = (n) => (n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US"));
const pct = (x) => (x === null || x === undefined ? "—" : (100 * x).toFixed(1) + "%");
const num = (x, digits = 3) => (x === null || x === undefined ? "—" : Number(x).toFixed(digits));
const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "—");
const usd = (x) => "$" + Number(x).toFixed(6);

function table(id, columns, rows, options = {}) {
  const head = el("tr", {}, columns.map((c) => el("th", { class: c.num ? "num" : "", title: c.title || null, text: c.label })));
  const body = rows.map((row, i) => {
    const tr = el("tr", options.rowAttrs ? options.rowAttrs(row) : {},
      columns.map((c) => {
        const value = c.cell(row, i);
        return el("td", { class: c.num ? "num" : c.cls || "" }, value);
      }));
    if (options.onclick) { tr.classList.add("clickable"); tr.addEventListener("click", () => options.onclick(row)); }
    return tr;
  });
  return el("table", { id }, el("thead", {}, head), el("tbody", {}, body));
}

function badge(status) {
  return el("span", { class: "badge status-" + status.replace(/ /g, "-"), text: status });
}

function card(label, value, id) {
  return el("div", { class: "card", id }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }));
}

function crumbs(parts) {
  const nav = document.getElementById("crumbs");
  nav.replaceChildren(...parts.flatMap((p, i) => [i ? " / " : "", p.href ? el("a", { href: p.href, text: p.text }) : p.text]));
}

function show(...nodes) { view.replaceChildren(...nodes); }

function problem(err) {
  return el("p", { class: "error", role: "alert", id: "error", text: err.message });
}

// ---------------------------------------------------------------- login (server)

function loginView(message) {
  crumbs([{ text: "log in" }]);
  const user = el("input", { name: "username", id: "username", autocomplete: "username", required: true, placeholder: "username" });
  const password = el("input", { name: "password", id: "password", type: "password", autocomplete: "current-password", required: true, placeholder: "password" });
  const status = el("p", { class: "note", id: "login-status", text: message || "Log in as a ContextRender user: the inspector shows your own sessions." });
  const form = el("form", { class: "login", id: "login" },
    el("label", { for: "username", text: "Username" }), user,
    el("label", { for: "password", text: "Password" }), password,
    el("button", { type: "submit", id: "login-button", text: "Log in" }), status);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    status.textContent = "Logging in…";
    const response = await fetch("/user/login", {
      method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ identity: { type: "username", value: user.value }, credential: { type: "password", password: password.value } }),
    });
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    const got = body && body.data && body.data.token;
    if (!response.ok || !got) {
      status.textContent = "Login refused: " + ((body && body.error && body.error.message) || response.statusText);
      status.className = "error";
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, got);
    sessionStorage.setItem(USER_KEY, user.value);
    route();
  });
  show(el("h1", { text: "Log in" }), form);
  document.body.dataset.ready = "1";
}

// ---------------------------------------------------------------- views

async function sessionsView() {
  crumbs([{ text: "sessions" }]);
  const sessions = await call("list_sessions", {});
  const rows = [...sessions].reverse();  // newest first
  show(
    el("h1", { text: `Sessions (${sessions.length})` }),
    rows.length ? table("sessions", [
      { label: "session", cell: (s) => el("a", { href: `#/session/${encodeURIComponent(s.session_id)}`, text: s.session_id }) },
      // The name the agent sent, where the key is a digest of it (the proxy's long or odd headers).
      { label: "name", cell: (s) => s.name || "" },
      { label: "created", cell: (s) => when(s.created_at) },
      { label: "events", num: true, cell: (s) => fmt(s.events) },
      { label: "branch", num: true, cell: (s) => fmt(s.branch) },
    ], rows, { rowAttrs: (s) => ({ "data-session": s.session_id }) })
      : el("p", { class: "note", text: "No sessions yet: they appear once an agent's calls go through ContextRender." }),
  );
}

function tabs(id, on) {
  const base = `#/session/${encodeURIComponent(id)}`;
  return el("div", { class: "tabs" },
    el("a", { href: base, class: on === "renders" ? "on" : "", id: "tab-renders", text: "Renders and results" }),
    el("a", { href: base + "/graph", class: on === "graph" ? "on" : "", id: "tab-graph", text: "Graph" }));
}

function historyBar(r) {
  const bar = el("span", { class: "bar", title: `history ${r.history_tokens} of B = ${r.budget}; whole history ${r.full_history_tokens}` });
  const fill = el("span", { class: "fill" });
  fill.style.width = Math.min(100, (100 * r.history_tokens) / r.budget) + "%";
  bar.append(fill);
  if (r.cache_known && r.cached_tokens) {
    const cached = el("span", { class: "cached" });
    cached.style.width = Math.min(100, (100 * r.cached_tokens) / r.budget) + "%";
    bar.append(cached);
  }
  if (r.full_history_tokens <= r.budget) {
    const full = el("span", { class: "full" });
    full.style.left = (100 * r.full_history_tokens) / r.budget + "%";
    bar.append(full);
  }
  return bar;
}

function timeline(id, data, chosen) {
  return table("timeline", [
    { label: "#", num: true, cell: (r) => String(r.n) },
    { label: "time", cell: (r) => when(r.at).slice(11) },
    { label: "turn", num: true, cell: (r) => fmt(r.turn) },
    { label: "mode", cell: (r) => el("span", { class: "mode mode-" + r.mode, title: r.reason, text: r.mode }) },
    { label: "history vs B", title: "tokens of the rendered history against the budget B (dark: the prefix cached from the previous request)",
      cell: (r) => el("span", {}, historyBar(r), `${fmt(r.history_tokens)} / ${fmt(r.budget)}`) },
    { label: "whole history", num: true, cell: (r) => fmt(r.full_history_tokens) },
    { label: "kept", num: true, cell: (r) => fmt(r.kept) },
    { label: "stubbed", num: true, cell: (r) => fmt(r.stubbed) },
    { label: "folded", num: true, title: "results folded behind the marker", cell: (r) => fmt(r.folded) },
    { label: "dropped", num: true, cell: (r) => fmt(r.dropped) },
    { label: "compacted", num: true, cell: (r) => fmt(r.compacted) },
    { label: "folded msgs", num: true, cell: (r) => fmt(r.folded_messages) },
    { label: "cache share", num: true, title: "history tokens repeated as a prefix of the previous request (unknown after a restart)", cell: (r) => pct(r.cache_share) },
    { label: "cost vs everything", num: true, title: "the history's cost at equation 3's prices (cached tokens at the cached price) against sending the whole history",
      cell: (r) => `${usd(r.cost)} vs ${usd(r.full_cost)} (${pct(r.cost_ratio)})` },
  ], data.renders, {
    rowAttrs: (r) => ({ "data-render": r.n, "data-mode": r.mode, class: chosen && r.n === chosen.n ? "chosen" : "" }),
    onclick: (r) => { location.hash = `#/session/${encodeURIComponent(id)}/render/${r.n}`; },
  });
}

function reuseList(row) {
  if (!row.reused_by.length) return "—";
  return el("ul", { class: "edges" }, row.reused_by.map((e) =>
    el("li", {}, `${e.label}: `, el("span", { class: "values", text: e.values.join(", ") }), ` (w=${num(e.weight, 2)})`)));
}

function resultsTable(data) {
  const scored = data.results.some((r) => r.decision);
  const d = (row, key, digits) => (row.decision ? num(row.decision[key], digits) : "—");
  return table("results", [
    { label: "handle", cell: (r) => el("code", { text: r.handle }) },
    { label: "tool", cell: (r) => r.tool_name },
    { label: "#", num: true, title: "position on the chain", cell: (r) => String(r.position) },
    { label: "turn", num: true, cell: (r) => String(r.turn) },
    { label: "tokens", num: true, cell: (r) => fmt(r.tokens) },
    { label: "status", cell: (r) => badge(r.status) },
    { label: "recency", num: true, cell: (r) => d(r, "recency") },
    { label: "reuse", num: true, cell: (r) => d(r, "reuse") },
    { label: "relevance", num: true, cell: (r) => d(r, "relevance") },
    { label: "U", num: true, title: "usefulness", cell: (r) => d(r, "usefulness") },
    { label: "c_t", num: true, title: "reuse count (restores included where they count)", cell: (r) => d(r, "reuse_count", 2) },
    { label: "reuse edges", cell: reuseList },
    { label: "restores", num: true, cell: (r) => String(r.restores.length) },
    { label: "reason", cls: "reason", cell: (r) => r.reason || (r.decision ? r.decision.reason : (scored ? "" : "—")) },
  ], data.results, { rowAttrs: (r) => ({ "data-handle": r.handle, "data-status": r.status }) });
}

// The last render's messages as sent: each with its role, what it is (a result by its status,
// the fold marker, its index) and its text.
function receivedTable(received) {
  return table("received", [
    { label: "#", num: true, cell: (m, i) => String(i) },
    { label: "role", cell: (m) => m.role },
    { label: "what", cell: (m) => (m.handle ? el("span", {}, badge(m.kind), " ", el("code", { text: m.handle })) : m.kind) },
    { label: "text", cls: "received-text", cell: (m) => el("pre", { text: [m.text, ...(m.calls || [])].filter(Boolean).join("\n") }) },
  ], received, { rowAttrs: (m) => ({ "data-kind": m.kind, "data-handle": m.handle || "" }) });
}

// A session's heading: its name when it has one, with its key.
function titled(id, name) {
  return name && name !== id ? `Session ${name} (${id})` : `Session ${id}`;
}

async function sessionView(id, renderNumber) {
  const data = await call("inspect_session", { session_id: id, render: renderNumber || 0 });
  const s = data.session;
  const chosen = data.render;
  const last = data.renders.length ? data.renders[data.renders.length - 1] : null;
  crumbs([{ text: "sessions", href: "#/" }, { text: id }]);
  const parts = [
    el("h1", { text: titled(id, s.name) }), tabs(id, "renders"),
    el("div", { class: "cards", id: "summary" },
      card("events", fmt(s.events), "card-events"), card("tool results", fmt(s.tool_results), "card-results"),
      card("model calls", fmt(s.invocations), "card-invocations"), card("history tokens", fmt(s.history_tokens), "card-tokens"),
      card("restores", fmt(s.restores), "card-restores"), card("renders kept", fmt(data.renders.length), "card-renders"),
      s.usage && s.usage.reported_input_tokens ? card("provider input tokens", fmt(s.usage.reported_input_tokens), "card-usage") : null),
    el("h2", { text: "Renders" }),
  ];
  if (!data.renders.length) {
    parts.push(el("p", { class: "note", text: "Not rendered yet." }));
  } else {
    parts.push(el("p", { class: "note", text: "One row per render (the latest kept). Click a render to see its results. Bar: history tokens against B; dark part: cached prefix; black tick: the whole history when it fits." }));
    parts.push(timeline(id, data, chosen));
  }
  if (chosen) {
    const isLast = last && chosen.n === last.n;
    parts.push(el("h2", { id: "render-title", text: `Render #${chosen.n}: ${chosen.mode}, ${fmt(chosen.history_tokens)} of B = ${fmt(chosen.budget)} tokens` }));
    parts.push(el("p", { class: "note", id: "render-reason", text: chosen.reason }));
    parts.push(el("div", { class: "cards", id: "render-counts" },
      card("kept", fmt(chosen.kept), "count-kept"), card("stubbed", fmt(chosen.stubbed), "count-stubbed"),
      card("folded results", fmt(chosen.folded), "count-folded-results"), card("dropped", fmt(chosen.dropped), "count-dropped"),
      card("compacted", fmt(chosen.compacted), "count-compacted"), card("folded messages", fmt(chosen.folded_messages), "count-folded"),
      card("cache share", pct(chosen.cache_share), "count-cache"), card("cost vs everything", pct(chosen.cost_ratio), "count-cost")));
    if (!isLast) {
      parts.push(el("p", { class: "note", id: "older-note", text: "An earlier render: statuses come from the render log; score terms and reasons are kept for the last render only." }));
    }
  }
  parts.push(el("h2", { text: `Tool results (${data.results.length})` }));
  parts.push(data.results.length ? resultsTable(data) : el("p", { class: "note", text: "No tool results yet." }));
  if (data.received && data.received.length) {
    parts.push(el("h2", { id: "received-title", text: `What the model received (render #${last.n})` }));
    parts.push(receivedTable(data.received));
  }
  parts.push(el("h2", { text: `Restores asked (${data.restores.length})` }));
  parts.push(data.restores.length ? table("restores", [
    { label: "handle", cell: (r) => el("code", { text: r.handle }) },
    { label: "tool", cell: (r) => r.tool_name },
    { label: "asked at turn", num: true, cell: (r) => String(r.turn) },
    { label: "after event #", num: true, cell: (r) => String(r.position) },
    { label: "when", cell: (r) => when(r.at) },
  ], data.restores, { rowAttrs: (r) => ({ "data-handle": r.handle }) }) : el("p", { class: "note", text: "The model has asked for no result back." }));
  show(...parts);
}

async function graphView(id) {
  crumbs([{ text: "sessions", href: "#/" }, { text: id, href: `#/session/${encodeURIComponent(id)}` }, { text: "graph" }]);
  const box = el("div", { id: "graph" });
  show(el("h1", { text: `Session ${id}` }), tabs(id, "graph"),
    el("p", { class: "note", text: "The session's chain: messages by role, results coloured by their status in the last render, reuse (blue) and restore (red) edges with their values." }), box);
  try {
    const answer = await call("export_graph", { session_id: id, format: "svg", limit: 400 });
    const svg = new DOMParser().parseFromString(answer.svg, "image/svg+xml").documentElement;
    box.replaceChildren(document.importNode(svg, true));
  } catch (err) {
    if (err instanceof NeedLogin) throw err;
    const answer = await call("export_graph", { session_id: id, format: "dot", limit: 400 });
    box.replaceChildren(problem(err), el("p", { class: "note", text: "The same picture as Graphviz DOT:" }), el("pre", { class: "dot", text: answer.dot }));
  }
}

// ---------------------------------------------------------------- routing

async function route() {
  const logout = document.getElementById("logout");
  logout.hidden = !(MODE === "server" && token());
  document.getElementById("who").textContent = MODE === "server" ? (token() ? sessionStorage.getItem(USER_KEY) || "" : "") : "proxy (this machine only)";
  const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  try {
    if (MODE === "server" && !token()) return loginView();
    if (parts[0] === "session" && parts[1]) {
      if (parts[2] === "graph") await graphView(parts[1]);
      else await sessionView(parts[1], parts[2] === "render" ? Number(parts[3]) : 0);
    } else {
      await sessionsView();
    }
    document.body.dataset.ready = "1";
  } catch (err) {
    if (err instanceof NeedLogin) return loginView(err.message);
    show(problem(err), el("p", {}, el("a", { href: "#/", text: "back to the sessions" })));
    document.body.dataset.ready = "1";
  }
}

document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  sessionStorage.removeItem(USER_KEY);
  location.hash = "#/";
  route();
});
window.addEventListener("hashchange", () => { delete document.body.dataset.ready; route(); });
route();
