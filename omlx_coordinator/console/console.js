// The console: asks for a key once (kept for the tab), then polls the gateway every few
// seconds. An admin key sees /cluster/status and the model buttons; a user key, whose admin
// calls answer 403, gets the view its routes allow: the models, its own usage and the chat.

import { APIError, call, key } from "./api.js";
import { chart } from "./chart.js";
import { Chat } from "./chat.js";
import { bytes, h, number } from "./dom.js";
import { CHARTS, History } from "./metrics.js";

const POLL_MS = 3000;
const $ = (id) => document.getElementById(id);
const state = { admin: false, timer: null, polling: false, again: false, message: "",
                history: new History(), busy: {}, shown: {} };
const chat = new Chat();

// ---- the key ------------------------------------------------------------------------------

async function open(value) {
  key.set(value);
  try {
    await call("/v1/models");
  } catch (e) {
    if (e.status === 401) key.clear();
    throw e;
  }
  let admin = true;
  try {
    await call("/cluster/status");
  } catch (e) {
    if (e.status !== 403) throw e;
    admin = false;
  }
  $("login").hidden = true;
  $("app").hidden = false;
  showRole(admin);
  poll();
}

function logout(reason = "") {
  clearTimeout(state.timer);
  key.clear();
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = reason;
  $("key").value = "";
  $("key").focus();
}

$("login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  clearTimeout(state.timer);
  $("login-error").textContent = "";
  try {
    await open($("key").value.trim());
  } catch (err) {
    $("login-error").textContent = err.status === 401 ? "This key was refused: " + err.message
                                                       : err.message;
  }
});
$("logout").addEventListener("click", () => logout());

for (const tab of document.querySelectorAll("#tabs button")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll("#tabs button")) {
      t.setAttribute("aria-selected", String(t === tab));
      $(`view-${t.dataset.view}`).hidden = t !== tab;
    }
  });
}
$("since").addEventListener("change", () => poll());

// ---- polling ------------------------------------------------------------------------------

// Each part refreshed on its own: one failing call leaves the others showing. One poll at a
// time; one asked for meanwhile (after a button) runs as soon as it ends.
async function poll() {
  if (state.polling) { state.again = true; return; }
  state.polling = true;
  clearTimeout(state.timer);
  let failed;
  try {
    const results = await Promise.allSettled([refreshModels(), refreshUsage(), refreshCharts()]);
    failed = results.filter((r) => r.status === "rejected").map((r) => r.reason);
  } finally {
    state.polling = false;
  }
  if ($("app").hidden) return;
  if (failed.some((e) => e instanceof APIError && e.status === 401)) {
    logout("The gateway no longer takes this key.");
    return;
  }
  const notes = [state.message, ...failed.map((e) => e.message)].filter(Boolean);
  $("notice").hidden = !notes.length;
  $("notice").textContent = notes.join(" · ");
  $("live").textContent = `updated ${new Date().toLocaleTimeString()}`;
  $("live").classList.toggle("stale", failed.length > 0);
  state.timer = setTimeout(poll, state.again ? 0 : POLL_MS);
  state.again = false;
}

// Replaces `id`'s children only when what they show changed, so a button is not swapped
// under the pointer on every poll.
function show(id, data, render) {
  const signature = JSON.stringify(data);
  if (state.shown[id] === signature) return;
  state.shown[id] = signature;
  $(id).replaceChildren(...render(data).filter(Boolean));
}

// The role shown: an admin key the keys file turns into a user key (read again without a
// restart) gets the user's view at the next poll, not a page of 403s.
function showRole(admin) {
  state.admin = admin;
  $("who").textContent = admin ? "admin" : "user";
  $("nodes-part").hidden = !admin;
  state.shown = {};
}

async function refreshModels() {
  if (state.admin) {
    let status;
    try {
      status = await call("/cluster/status");
    } catch (e) {
      if (e.status !== 403) throw e;
      showRole(false);
      return refreshModels();
    }
    const models = status.models.map(({ idle_seconds, ...m }) => m);  // idle time: every poll
    show("summary", summaryOf(status), renderSummary);
    show("nodes", status.nodes.map(nodeOf), (nodes) => nodes.map(renderNode));
    show("models", { models, busy: state.busy }, ({ models }) => models.map(renderModel));
    chat.setModels(status.models.map((m) => m.id));
  } else {
    const { data } = await call("/v1/models");
    const models = data.map(({ idle_seconds, ...m }) => m);
    show("summary", { models: models.length }, () => [
      h("span", {}, "Models served: ", h("b", {}, models.length)),
      h("span", { class: "hint" }, "A user key sees the models, its own usage and the chat."),
    ]);
    show("models", models, (ms) => ms.map(renderServed));
    chat.setModels(data.map((m) => m.id));
  }
}

async function refreshUsage() {
  const since = $("since").value === "today" ? new Date().toISOString().slice(0, 10) : "";
  const usage = await call("/cluster/usage" + (since ? `?since=${since}` : ""));
  show("usage", usage.keys, renderUsage);
}

async function refreshCharts() {
  let text;
  try {
    text = await call("/metrics");
  } catch (e) {
    if (e.status === 401 || e.status === 403) {
      show("charts", "closed", () => [h("p", { class: "hint" }, "/metrics is not open to this key.")]);
      return;
    }
    throw e;
  }
  state.history.add(text);
  $("charts").replaceChildren(...CHARTS.map((spec) => chart(spec, state.history.points)));
}

// ---- what is shown ------------------------------------------------------------------------

function badge(text, kind = text) {
  return h("span", { class: `badge ${kind}` }, text);
}

function summaryOf(s) {
  return { model: s.model, status: s.status, epoch: s.epoch, backend: s.backend,
           nodes: s.nodes.length, alive: s.nodes.filter((n) => n.alive).length,
           loaded: s.models.filter((m) => m.loaded).length, models: s.models.length,
           recovery: s.last_recovery };
}

function renderSummary(s) {
  return [
    h("span", {}, "Main model ", h("b", {}, s.model), " ", badge(s.status, s.status === "ready" ? "ok" : "warn")),
    h("span", {}, "Nodes ", h("b", {}, `${s.alive} of ${s.nodes}`), " alive"),
    h("span", {}, "Models loaded ", h("b", {}, `${s.loaded} of ${s.models}`)),
    h("span", {}, "Data plane ", h("b", {}, s.backend?.name ?? "–"),
      s.backend?.reason ? h("span", { class: "hint" }, ` (${s.backend.reason})`) : null),
    s.recovery ? h("span", {}, "Last recovery ", h("b", {}, JSON.stringify(s.recovery))) : null,
  ];
}

function nodeOf(n) {
  // Memory moves by kilobytes every poll: shown in tenths of a GiB, compared the same way.
  const used = n.memory_total != null && n.memory_available != null
    ? Math.round((n.memory_total - n.memory_available) / 2 ** 27) * 2 ** 27 : null;
  const { memory_available, checks, ...rest } = n;
  return { ...rest, used, problems: (checks ?? []).filter((c) => c.status === "warn" || c.status === "fail") };
}

function meter(used, total, label) {
  const fill = h("span", { class: "fill" });
  fill.style.width = `${total ? Math.min(100, (100 * used) / total) : 0}%`;
  return h("div", { class: "meter", title: label }, fill);
}

function renderNode(n) {
  const health = !n.alive ? badge("lost", "bad") : n.healthy ? badge("healthy", "ok") : badge("unhealthy", "warn");
  return h("article", { class: "card node", "data-node": n.id },
    h("header", {}, h("h3", {}, n.id), health,
      n.memory_pressure && n.memory_pressure !== "normal" ? badge(`pressure ${n.memory_pressure}`, "warn") : null),
    h("p", { class: "hint" }, [n.chip, n.address, n.version && `v${n.version}`].filter(Boolean).join(" · ")),
    h("p", {}, "Memory in use ", h("b", {}, bytes(n.used)), ` of ${bytes(n.memory_total)}`,
      h("span", { class: "hint" }, ` · budget for layers ${bytes(n.memory_budget)}`)),
    meter(n.used, n.memory_total, "memory in use"),
    h("ul", { class: "stages" }, (n.workers ?? []).map((w) => h("li", {},
      h("b", {}, w.model), " ",
      w.layers ? `layers ${w.layers[0]}–${w.layers[1] - 1}` : "", w.rank != null ? ` · rank ${w.rank}` : "",
      ` · ${bytes(w.footprint_bytes)}`, w.ready ? "" : [" ", badge("starting", "warn")]))),
    n.measured_speed_gbps ? h("p", { class: "hint" }, `weights streamed at ${number(n.measured_speed_gbps, 2)} GB/s`
      + (n.ms_per_layer ? `, ${number(n.ms_per_layer, 2)} ms a layer` : "")) : null,
    n.rdma_devices?.length ? h("p", { class: "hint" }, `RDMA: ${n.rdma_devices.join(", ")}`) : null,
    n.weights_error ? h("p", { class: "error" }, n.weights_error) : null,
    n.problems.map((c) => h("p", { class: `check ${c.status}` }, `${c.name}: ${c.detail}`)));
}

// An admin's button: the model's buttons wait while it runs; its refusal (a 409 for a model
// with requests in flight, say) stays shown until the next action.
async function act(model, action) {
  state.busy[model] = action;
  state.message = "";
  state.shown.models = null;
  poll();
  try {
    await call(`/cluster/models/${encodeURIComponent(model)}/${action}`, { method: "POST", timeout: 600000 });
  } catch (e) {
    state.message = `${action} ${model}: ${e.message}`;
  } finally {
    delete state.busy[model];
    state.shown.models = null;
    poll();
  }
}

function button(model, action, label) {
  const busy = state.busy[model];
  return h("button", { type: "button", disabled: busy != null,
                       onclick: () => act(model, action) },
    busy === action ? `${label}ing…` : label);
}

function stateBadge(m) {
  const kind = { loaded: "ok", pinned: "ok", loading: "warn", unloaded: "idle" }[m.state] ?? "bad";
  return badge(m.state, kind);
}

function renderModel(m) {
  const actions = [
    m.loaded || m.state === "loading" ? button(m.id, "unload", "Unload") : button(m.id, "load", "Load"),
    m.pinned ? button(m.id, "unpin", "Unpin") : button(m.id, "pin", "Pin"),
  ];
  return h("article", { class: "card model", "data-model": m.id },
    h("header", {}, h("h3", {}, m.id), h("span", { class: "state" }, stateBadge(m)),
      m.pinned && m.state !== "pinned" ? badge("pinned", "ok") : null),
    m.aliases.length ? h("p", { class: "hint" }, `also ${m.aliases.join(", ")}`) : null,
    h("p", { class: "hint" }, [`${m.replicas.length} replica${m.replicas.length === 1 ? "" : "s"}`,
      `${m.leases} in flight`, `${m.loads} loads`, m.load_seconds ? `last load ${number(m.load_seconds, 1)} s` : null,
      m.ttl_seconds ? `unloads after ${m.ttl_seconds} s idle` : null].filter(Boolean).join(" · ")),
    m.replicas.map((r) => h("div", { class: "replica" },
      h("div", { class: "hint" }, `replica ${r.replica} · ${r.status} · ${r.inflight} generating · ${r.requests} served`),
      h("div", { class: "placement" }, r.stages.map((s) => {
        const seg = h("span", { class: "stage", title: `${s.node}: planned ${bytes(s.planned_bytes)}` },
          h("b", {}, s.node), ` ${s.layers[0]}–${s.layers[1] - 1}`,
          h("small", {}, ` ${bytes(s.footprint_bytes ?? s.planned_bytes)}`));
        seg.style.flexGrow = String(Math.max(1, s.layers[1] - s.layers[0]));
        return seg;
      })))),
    m.error ? h("p", { class: "error" }, m.error) : null,
    h("div", { class: "actions" }, actions));
}

function renderServed(m) {
  return h("article", { class: "card model", "data-model": m.id },
    h("header", {}, h("h3", {}, m.id), h("span", { class: "state" }, stateBadge(m))),
    h("p", { class: "hint" }, [`${m.replicas} replica${m.replicas === 1 ? "" : "s"}`,
      m.context_length ? `context ${number(m.context_length)} tokens` : null,
      m.aliases?.length ? `also ${m.aliases.join(", ")}` : null].filter(Boolean).join(" · ")));
}

const COLUMNS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors"];

function renderUsage(keys) {
  const head = h("tr", {}, h("th", {}, "key"), h("th", {}, "model"),
    COLUMNS.map((c) => h("th", { class: "num" }, c.replace("_tokens", ""))), h("th", {}, "share of tokens"));
  const all = keys.flatMap((k) => k.models.map((m) => ({ key: k.key, ...m })));
  const tokens = (m) => m.prompt_tokens + m.completion_tokens;
  const total = Object.fromEntries(COLUMNS.map((c) => [c, all.reduce((t, m) => t + m[c], 0)]));
  const rows = all.map((m) => h("tr", { "data-key": m.key },
    h("td", {}, m.key), h("td", {}, m.model), COLUMNS.map((c) => h("td", { class: "num" }, number(m[c]))),
    h("td", { class: "share" }, meter(tokens(m), tokens(total), "share of all tokens"))));
  if (!rows.length) rows.push(h("tr", {}, h("td", { colspan: 8, class: "hint" }, "No requests yet.")));
  const foot = all.length > 1 ? h("tfoot", {}, h("tr", {}, h("th", {}, "all"), h("th", {}),
    COLUMNS.map((c) => h("th", { class: "num" }, number(total[c]))), h("th", {}))) : null;
  return [h("thead", {}, head), h("tbody", {}, rows), foot];
}

// ---- start --------------------------------------------------------------------------------

// A reload with the tab's key (a wall screen's, say) opens again; while the gateway is down
// or restarting it keeps the key and tries again.
async function resume() {
  try {
    await open(key.get());
  } catch (e) {
    if (e.status === 401) return logout(e.message);
    $("login").hidden = false;
    $("login-error").textContent = `${e.message}; trying again`;
    state.timer = setTimeout(resume, POLL_MS);
  }
}

if (key.get() !== null) resume();
else logout();
