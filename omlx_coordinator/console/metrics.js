// The charts' numbers: the gateway's Prometheus text parsed here, and the last 15 minutes of
// it kept by this tab (the gateway keeps no history; a reload keeps the tab's).

const SAMPLE = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;
export const WINDOW_MS = 15 * 60 * 1000;
const STORE = "omlx.console.history";

// [{name, labels, value}] of the exposition `text`.
export function parse(text) {
  const out = [];
  for (const line of text.split("\n")) {
    const m = line.startsWith("#") ? null : SAMPLE.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] ?? "").matchAll(LABEL)) labels[k] = v;
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

function sum(samples, name) {
  return samples.reduce((total, s) => (s.name === name ? total + s.value : total), 0);
}

// The totals one scrape gives, over every model (and every key, for the cache).
function totals(samples, t) {
  return {
    t,
    tokens: sum(samples, "omlx_tokens_predicted_total"),
    ttftSum: sum(samples, "omlx_time_to_first_token_seconds_sum"),
    ttftCount: sum(samples, "omlx_time_to_first_token_seconds_count"),
    prompt: sum(samples, "omlx_key_prompt_tokens_total"),
    cached: sum(samples, "omlx_key_cached_tokens_total"),
    waiting: sum(samples, "omlx_requests_deferred"),
    running: sum(samples, "omlx_requests_processing"),
  };
}

// A point per scrape after the first: rates and means over the time since the previous one.
export class History {
  constructor() {
    this.last = null;
    try { this.points = JSON.parse(sessionStorage.getItem(STORE)) ?? []; } catch { this.points = []; }
  }

  add(text, t = Date.now()) {
    const now = totals(parse(text), t);
    const prev = this.last;
    this.last = now;
    // The first scrape, or counters that went back (the gateway restarted): nothing to compare.
    if (!prev || now.tokens < prev.tokens || now.prompt < prev.prompt || now.t <= prev.t) return;
    const seconds = (now.t - prev.t) / 1000;
    const firsts = now.ttftCount - prev.ttftCount;
    const prompt = now.prompt - prev.prompt;
    this.points.push({
      t,
      tokps: (now.tokens - prev.tokens) / seconds,
      ttft: firsts > 0 ? (now.ttftSum - prev.ttftSum) / firsts : null,
      waiting: now.waiting,
      running: now.running,
      kv: prompt > 0 ? (100 * (now.cached - prev.cached)) / prompt : null,
    });
    while (this.points.length && this.points[0].t < t - WINDOW_MS) this.points.shift();
    sessionStorage.setItem(STORE, JSON.stringify(this.points));
  }
}

export const CHARTS = [
  { title: "Tokens per second", unit: "tok/s", lines: [{ key: "tokps", label: "generated" }] },
  { title: "Time to first token", unit: "s", digits: 3,
    lines: [{ key: "ttft", label: "mean" }] },
  { title: "Queue depth (requests)", unit: "",
    lines: [{ key: "waiting", label: "waiting" }, { key: "running", label: "generating" }] },
  { title: "KV-cache hit rate", unit: "%", max: 100,
    lines: [{ key: "kv", label: "prompt tokens from the cache" }] },
];
