// The chat playground: /v1/chat/completions streamed (server-sent events read from fetch's
// body stream), the answer shown as its chunks arrive.

import { failure, headers } from "./api.js";
import { h, number } from "./dom.js";

const $ = (id) => document.getElementById(id);

// Each `data:` payload of the SSE stream `body`, parsed, as it arrives.
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

export class Chat {
  constructor() {
    this.messages = [];
    this.controller = null;
    $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.send(); }
    });
    $("chat-stop").addEventListener("click", () => this.controller?.abort());
    $("chat-clear").addEventListener("click", () => {
      this.controller?.abort();
      this.messages = [];
      $("chat-log").replaceChildren();
    });
  }

  // The models a chat may pick (the served ones), keeping the choice made.
  setModels(names) {
    const select = $("chat-model");
    const chosen = select.value;
    if ([...select.options].map((o) => o.value).join("\n") === names.join("\n")) return;
    select.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
    if (names.includes(chosen)) select.value = chosen;
  }

  bubble(role, text) {
    const body = h("div", { class: "text" }, text);
    const stats = h("div", { class: "stats" });
    const el = h("div", { class: `message ${role}` }, h("div", { class: "role" }, role), body, stats);
    $("chat-log").append(el);
    el.scrollIntoView({ block: "end" });
    return { el, body, stats };
  }

  async send() {
    const input = $("chat-input");
    const content = input.value.trim();
    if (!content || this.controller) return;
    input.value = "";
    this.messages.push({ role: "user", content });
    this.bubble("user", content);
    const answer = this.bubble("assistant", "");
    answer.el.classList.add("streaming");
    this.controller = new AbortController();
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    const started = performance.now();
    let text = "";
    let chunks = 0;
    let first = null;
    let usage = null;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", signal: this.controller.signal,
        headers: headers({ "content-type": "application/json" }),
        body: JSON.stringify({
          model: $("chat-model").value, messages: this.messages, stream: true,
          stream_options: { include_usage: true },
          max_tokens: Number($("chat-max").value) || 256,
          temperature: Number($("chat-temp").value),
        }),
      });
      if (!response.ok) throw await failure(response);
      for await (const chunk of events(response.body)) {
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          first ??= performance.now();
          text += delta;
          chunks++;
          answer.body.textContent = text;
          answer.el.scrollIntoView({ block: "end" });
        }
        if (chunk.usage) usage = chunk.usage;
      }
      this.messages.push({ role: "assistant", content: text });
      const seconds = (performance.now() - (first ?? started)) / 1000;
      const tokens = usage?.completion_tokens;
      answer.stats.textContent = [
        tokens != null && `${tokens} tokens`, `${chunks} chunks`,
        first != null && `first token after ${number((first - started) / 1000, 2)} s`,
        tokens > 1 && seconds > 0 && `${number((tokens - 1) / seconds, 1)} tok/s`,
      ].filter(Boolean).join(" · ");
    } catch (e) {
      this.messages.pop();  // a failed turn is not part of the conversation
      answer.el.classList.add("failed");
      answer.stats.textContent = e.name === "AbortError" ? "stopped" : e.message;
    } finally {
      answer.el.classList.remove("streaming");
      this.controller = null;
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
    }
  }
}
