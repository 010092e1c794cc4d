"""Streams through a served cluster while one of its processes is SIGKILLed mid-stream: the
references undisturbed, then the same requests streamed concurrently across the kill. The
served model is named "tiny-fo" (a model folder of that name)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

STREAMS = 8
MAX_TOKENS = 300


def body(i: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    # logprobs 0: each event lists its tokens, which `progress` counts. An event carries every
    # token made since the last one (a node's stream interval, a client that reads behind), so
    # counting events says little of how far the node is: this model's streams end in a
    # dozen events.
    return {"model": "tiny-fo", "prompt": [5 + i, 6, 7 + i, 8, 9, 10 + 2 * i],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 0}


def stream_text(url: str, i: int, progress: list[int], max_tokens: int = MAX_TOKENS) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body(i, True, max_tokens),
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                assert "error" not in d, d
                if d.get("choices"):
                    text += d["choices"][0]["text"]
                    progress[i] += len((d["choices"][0].get("logprobs") or {}).get("tokens", []))
    return text


def run_and_kill(server, pid_of, max_tokens: int = MAX_TOKENS
                 ) -> tuple[list[str], list[str], dict]:
    """References first (undisturbed), then STREAMS concurrent streams of `max_tokens`; kills
    `pid_of(health)` once every stream has its first tokens. Returns (references, outputs,
    /cluster/status after)."""
    refs: list = [None] * STREAMS

    def ref(i: int) -> None:
        refs[i] = httpx.post(server.url + "/v1/completions", json=body(i, False, max_tokens),
                             timeout=120).json()["choices"][0]["text"]

    workers = [threading.Thread(target=ref, args=(i,)) for i in range(STREAMS)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    victim = pid_of(httpx.get(server.url + "/health", timeout=5).json())
    progress = [0] * STREAMS  # tokens each stream has received
    outs: list = [None] * STREAMS

    def one(i: int) -> None:
        outs[i] = stream_text(server.url, i, progress, max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(progress) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert min(progress) >= 10, "streams did not start"
    os.kill(victim, signal.SIGKILL)
    at_kill = list(progress)
    assert max(at_kill) < max_tokens * 3 // 4, f"the streams were nearly done before the kill: " \
        f"{at_kill} of {max_tokens} tokens"
    for t in threads:
        t.join(120)
    status = httpx.get(server.url + "/cluster/status", timeout=5).json()
    return refs, outs, status
