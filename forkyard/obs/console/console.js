// forkyard web console: plain JS, no dependencies. Talks to the E2B-compatible REST API
// of the server that serves it, with the API key from sessionStorage in X-API-Key.
// Every value from the API is put on the page with textContent (never as HTML).
"use strict";

const KEY = "forkyard.apiKey";
const PARENT = "forkyard.parentSandboxID";
const SNAPSHOT = "forkyard.snapshotID";
const REFRESH_MS = 3000;
const MAX_METRICS = 30; // sandboxes whose CPU/memory is fetched per refresh

const $ = (id) => document.getElementById(id);
let timer = null;
let busy = false;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else if (k === "onclick") e.addEventListener("click", v);
    else e[k] = v;
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

async function api(method, path, body) {
  const headers = { "X-API-Key": sessionStorage.getItem(KEY) || "" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  // Reads give up after 15 s (a hung call must not stall every later refresh); actions
  // (fork, pause, …) may take minutes on a busy host.
  const ms = method === "GET" ? 15000 : 600000;
  const r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body),
                                signal: AbortSignal.timeout(ms) });
  if (r.status === 401) {
    signOut("The API key was refused.");
    throw new Error("unauthorized");
  }
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = text; }
  if (!r.ok) throw new Error((data && data.message) || `${method} ${path}: ${r.status}`);
  return data;
}

function status(msg, error) {
  const s = $("status");
  s.textContent = msg || "";
  s.className = error ? "error" : "";
}

function age(iso) {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 90) return `${Math.round(s)}s`;
  if (s < 5400) return `${Math.round(s / 60)}m`;
  return `${(s / 3600).toFixed(1)}h`;
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

// ---- sign in / out ---------------------------------------------------------------------

async function signIn(ev) {
  ev.preventDefault();
  const key = $("api-key").value.trim();
  $("signin-error").textContent = "";
  let r;
  try {
    r = await fetch("/v2/sandboxes?limit=1", { headers: { "X-API-Key": key }, signal: AbortSignal.timeout(15000) });
  } catch (e) {
    $("signin-error").textContent = `The server did not answer (${e.message}); try again.`;
    return;
  }
  if (r.status === 401) { $("signin-error").textContent = "That API key was refused."; return; }
  sessionStorage.setItem(KEY, key);
  $("api-key").value = "";
  show();
}

function signOut(msg) {
  sessionStorage.removeItem(KEY);
  if (timer) clearInterval(timer);
  timer = null;
  $("main-view").hidden = true;
  $("sign-out").hidden = true;
  $("signin-view").hidden = false;
  $("signin-error").textContent = msg || "";
}

function show() {
  $("signin-view").hidden = true;
  $("main-view").hidden = false;
  $("sign-out").hidden = false;
  $("where").textContent = location.host;
  refresh();
  if (!timer) timer = setInterval(refresh, REFRESH_MS);
}

// ---- data ----------------------------------------------------------------------------------

async function refresh() {
  if (busy) return;
  busy = true;
  try {
    const [node, sandboxes, snapshots, templates] = await Promise.all([
      api("GET", "/metrics/node"),
      api("GET", "/v2/sandboxes?state=running,paused&limit=100"),
      api("GET", "/metrics/snapshots").catch(() => []),
      api("GET", "/templates").catch(() => []),
    ]);
    const usage = await sandboxMetrics(sandboxes);
    renderNodes(node);
    renderTree(sandboxes, snapshots, usage);
    renderSnapshots(snapshots);
    renderTemplates(templates);
    status(`updated ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    if (e.message !== "unauthorized") status(e.message, true);
  } finally {
    busy = false;
  }
}

async function sandboxMetrics(sandboxes) {
  const running = sandboxes.filter((s) => s.state === "running").slice(0, MAX_METRICS);
  const out = {};
  await Promise.all(running.map(async (s) => {
    try {
      const m = await api("GET", `/sandboxes/${encodeURIComponent(s.sandboxID)}/metrics`);
      if (m && m.length) out[s.sandboxID] = m[m.length - 1];
    } catch (_) { /* gone meanwhile */ }
  }));
  return out;
}

// ---- rendering -----------------------------------------------------------------------------

function fillTable(id, rows) {
  const body = $(id).tBodies[0];
  body.replaceChildren(...rows);
}

function renderNodes(node) {
  if (Array.isArray(node.nodes)) { // gateway: the cluster's nodes
    fillTable("nodes", node.nodes.map((n) => {
      const r = n.report || {};
      return el("tr", { "data-node-id": n.nodeID },
        el("td", {}, n.nodeID), el("td", { class: `state-${n.status}` }, n.status),
        el("td", {}, r.running ?? ""), el("td", {}, r.paused ?? ""),
        el("td", {}, `${r.running ?? 0} / ${r.max_sandboxes ?? "?"}`),
        el("td", {}, `${r.vcpus_reserved ?? 0} / ${r.vcpus ?? "?"}`),
        el("td", {}, (r.load1 ?? 0).toFixed(2)), el("td", {}, `${(n.heartbeatAge ?? 0).toFixed(1)}s ago`));
    }));
  } else { // a single node
    const c = node.sandboxes || {};
    fillTable("nodes", [el("tr", { "data-node-id": "this node" },
      el("td", {}, location.host), el("td", { class: "state-up" }, "up"),
      el("td", {}, c.running ?? 0), el("td", {}, c.paused ?? 0),
      el("td", {}, `${(node.spareSlots || []).length} spare slots`), el("td", {}, ""),
      el("td", {}, `${node.pausesInFlight ?? 0} pauses committing`), el("td", {}, "-"))]);
  }
}

function lineage(sandboxes, snapshots) {
  // parent of each sandbox: the fork parent, else the source of the snapshot it started from
  const bySnap = Object.fromEntries((snapshots || []).map((s) => [s.snapshotID, s]));
  const parent = {};
  for (const s of sandboxes) {
    const md = s.metadata || {};
    if (md[PARENT]) parent[s.sandboxID] = { id: md[PARENT], via: "fork", snapshot: md[SNAPSHOT] };
    else if (bySnap[s.templateID]) parent[s.sandboxID] = { id: bySnap[s.templateID].sandboxID, via: "snapshot", snapshot: s.templateID };
  }
  return parent;
}

function renderTree(sandboxes, snapshots, usage) {
  $("sandbox-count").textContent = `(${sandboxes.length})`;
  const ids = new Set(sandboxes.map((s) => s.sandboxID));
  const parent = lineage(sandboxes, snapshots);
  const kids = {};
  const roots = [];
  const ghosts = {};
  for (const s of sandboxes) {
    const p = parent[s.sandboxID];
    if (p && ids.has(p.id)) (kids[p.id] = kids[p.id] || []).push(s);
    else if (p) (ghosts[p.id] = ghosts[p.id] || []).push(s);
    else roots.push(s);
  }
  const byStart = (a, b) => Date.parse(a.startedAt) - Date.parse(b.startedAt);
  const item = (s) => {
    const li = el("li", { "data-sandbox-id": s.sandboxID, class: "sandbox" }, card(s, parent[s.sandboxID], usage[s.sandboxID]));
    const children = (kids[s.sandboxID] || []).sort(byStart);
    if (children.length) li.append(el("ul", {}, ...children.map(item)));
    return li;
  };
  const top = roots.sort(byStart).map(item);
  for (const [gone, children] of Object.entries(ghosts)) {
    top.push(el("li", { class: "ghost", "data-ghost-id": gone },
      el("div", { class: "card ghost" }, `${gone} (no longer running)`),
      el("ul", {}, ...children.sort(byStart).map(item))));
  }
  const tree = $("tree");
  if (!top.length) tree.replaceChildren(el("p", { class: "hint" }, "No sandboxes yet: create one with the SDK or `forkyard start`."));
  else tree.replaceChildren(el("ul", { class: "tree" }, ...top));
}

function card(s, p, m) {
  const md = Object.entries(s.metadata || {}).filter(([k]) => !k.startsWith("forkyard."));
  const usage = m ? `cpu ${Number(m.cpuUsedPct || 0).toFixed(1)}% of ${m.cpuCount} · mem ${bytes(m.memUsed)} / ${bytes(m.memTotal)}`
                  : `${s.cpuCount} vCPU · ${s.memoryMB} MiB`;
  const actions = el("span", { class: "actions" });
  const act = (label, fn) => actions.append(el("button", { class: `act-${label.toLowerCase()}`, onclick: fn }, label));
  if (s.state === "running") {
    act("Fork", () => action(`Fork ${s.sandboxID} (1 child)?`, "POST", `/sandboxes/${s.sandboxID}/fork`, { count: 1, timeout: 300 }));
    act("Snapshot", () => action(`Snapshot ${s.sandboxID}? It keeps running.`, "POST", `/sandboxes/${s.sandboxID}/snapshots`, {}));
    act("Pause", () => action(`Pause ${s.sandboxID}?`, "POST", `/sandboxes/${s.sandboxID}/pause`));
  } else {
    act("Resume", () => action(`Resume ${s.sandboxID}?`, "POST", `/sandboxes/${s.sandboxID}/resume`, { timeout: 300 }));
  }
  act("Kill", () => action(`Kill ${s.sandboxID}? This cannot be undone.`, "DELETE", `/sandboxes/${s.sandboxID}`));
  return el("div", { class: "card" },
    el("span", { class: "sid" }, s.sandboxID),
    el("span", { class: `badge state-${s.state}` }, s.state),
    el("span", { class: "tpl" }, s.templateID),
    el("span", { class: "age", title: s.startedAt }, `age ${age(s.startedAt)}`),
    el("span", { class: "usage" }, usage),
    p ? el("span", { class: "from" }, p.via === "fork" ? `forked (image ${p.snapshot || "?"})` : `from snapshot ${p.snapshot}`) : null,
    md.length ? el("span", { class: "md" }, md.map(([k, v]) => `${k}=${v}`).join(" ")) : null,
    actions);
}

async function action(question, method, path, body) {
  if (!window.confirm(question)) return;
  status(`${method} ${path} …`);
  try {
    await api(method, path, body);
    status(`${method} ${path}: done`);
  } catch (e) {
    status(e.message, true);
  }
  await refresh();
}

function renderSnapshots(snaps) {
  fillTable("snapshots", (snaps || []).map((s) => el("tr", { "data-snapshot-id": s.snapshotID },
    el("td", {}, [s.snapshotID, ...(s.names || [])].join(" ")), el("td", {}, s.kind),
    el("td", {}, s.sandboxID), el("td", {}, s.templateID), el("td", {}, bytes(s.sizeBytes)),
    el("td", {}, s.chunks), el("td", {}, s.sharedChunks), el("td", {}, age(s.createdAt) + " ago"))));
}

function renderTemplates(templates) {
  fillTable("templates", (templates || []).map((t) => el("tr", { "data-template-id": t.templateID },
    el("td", {}, t.templateID), el("td", {}, (t.aliases || []).join(", ")), el("td", {}, t.buildID),
    el("td", {}, t.buildStatus), el("td", {}, `${t.cpuCount} / ${t.memoryMB} MiB`),
    el("td", {}, el("button", { class: "act-logs", onclick: () => buildLog(t) }, "Build log")))));
}

async function buildLog(t) {
  const pre = $("build-log");
  pre.hidden = false;
  try {
    const st = await api("GET", `/templates/${encodeURIComponent(t.templateID)}/builds/${encodeURIComponent(t.buildID)}/status?limit=100`);
    pre.textContent = `${t.templateID} build ${t.buildID}: ${st.status}\n` + (st.logs || []).join("\n");
  } catch (e) {
    pre.textContent = `${t.templateID}: no build log (${e.message})`;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut(""));
  if (sessionStorage.getItem(KEY)) show();
  document.body.dataset.ready = "1"; // handlers attached (tests wait for this)
});
