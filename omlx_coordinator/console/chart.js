// A line chart of the last 15 minutes in SVG, drawn here (no chart library to ship). Until
// the tab has 15 minutes of points, the chart spans the time it has.

import { h, number } from "./dom.js";
import { WINDOW_MS } from "./metrics.js";

const NS = "http://www.w3.org/2000/svg";
const W = 600;
const H = 160;

function svg(tag, attrs) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

// A round top for the y axis: 1, 2 or 5 times a power of ten.
function ceiling(value) {
  if (!(value > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * p).find((c) => c >= value);
}

// The path of one line; a gap where the value is unknown (no request started then).
function path(points, key, start, span, top) {
  let d = "";
  let open = false;
  for (const p of points) {
    const v = p[key];
    if (v == null) { open = false; continue; }
    const x = (W * (p.t - start)) / span;
    const y = H - (H * Math.min(v, top)) / top;
    d += `${open ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
    open = true;
  }
  return d;
}

export function chart(spec, points, now = Date.now()) {
  const values = points.flatMap((p) => spec.lines.map((l) => p[l.key])).filter((v) => v != null);
  const top = spec.max ?? ceiling(Math.max(...values, 0));
  const start = Math.max(now - WINDOW_MS, points[0]?.t ?? now);
  const span = Math.max(now - start, 1000);
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
                            role: "img", "aria-label": spec.title });
  for (const f of [0.25, 0.5, 0.75]) {
    plot.append(svg("line", { x1: 0, x2: W, y1: H * f, y2: H * f, class: "grid" }));
  }
  spec.lines.forEach((l, i) => {
    plot.append(svg("path", { d: path(points, l.key, start, span, top), class: `line line${i}` }));
  });
  const last = points.at(-1);
  return h("figure", { class: "chart" },
    h("figcaption", {},
      h("span", { class: "chart-title" }, spec.title),
      spec.lines.map((l, i) => h("span", { class: `legend line${i}` },
        `${l.label}: `, h("b", {}, number(last?.[l.key], spec.digits ?? 1)), ` ${spec.unit}`))),
    h("div", { class: "plot" }, h("span", { class: "top" }, `${number(top, spec.digits ?? 1)}`),
      plot),
    h("div", { class: "axis" }, h("span", {}, span >= 60000 ? `−${Math.round(span / 60000)} min` : `−${Math.round(span / 1000)} s`), h("span", {}, "now")));
}
