"""End-to-end tests of the OpenAI-compatible gateway against a live `omlx-cluster serve`.

Written as a demanding client would: the official `openai` client and raw HTTP (httpx), greedy
outputs checked token for token against mlx-lm's own generation, concurrency, stop strings,
limits, seeds, cancellation, SSE keep-alives and the Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import Server, parse_metrics, start_server
from tests.tiny_models import build_model
from tests.helpers.reference import _decode_after, mlx_lm_greedy
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

REF_TOKENS = 24  # tokens generated per reference prompt
TEXT_PROMPTS = [
    "The capital of France is",
    "Hello world! How are",
    "def add(a, b):",
    "Numbers: 0 1 2",
    "A pipeline splits the",
    "Large language models predict the next",
    "Émile café",
    "I am fine, thank",
]
LONG_PROMPT = "The capital of France is Paris. The capital of Italy is Rome. " * 45


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    # No retries: a retried request would hide a failure (and double-count metrics).
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path, tok) -> dict[tuple[int, ...], list[int]]:
    """prompt token ids -> mlx-lm's greedy REF_TOKENS tokens, for every prompt the tests use."""
    prompts = [tok(t)["input_ids"] for t in TEXT_PROMPTS + [LONG_PROMPT]]
    prompts.append(_chat_ids(tok, [{"role": "user", "content": "Hello world! How are you?"}]))
    prompts.append([(i * 37 + 11) % 300 + 3 for i in range(40)])  # arbitrary ids, no specials
    outs = mlx_lm_greedy(tiny_model_path, prompts, REF_TOKENS)
    return {tuple(p): o for p, o in zip(prompts, outs)}


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _idle(server: Server) -> bool:
    m = server.metrics()
    n = server.node_metrics()
    return (m["omlx_requests_processing"] == 0 and m["omlx_requests_deferred"] == 0
            and n["omlx_node_requests_processing"] == 0 and n["omlx_node_requests_deferred"] == 0)


def _sse_events(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


# ---- basics --------------------------------------------------------------------------------------


def test_health_and_models(server: Server, client: openai.OpenAI) -> None:
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert (body["status"], body["model"]) == ("ok", server.model_id)

    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_id]
    raw = httpx.get(server.base_url + "/models", timeout=10).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"


def test_chat_non_streaming(client: openai.OpenAI, server: Server, tok) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello world! How are you today?"}]
    r = client.chat.completions.create(model=server.model_id, messages=messages, temperature=0,
                                       max_tokens=16, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == server.model_id
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(_chat_ids(tok, messages))
    assert r.usage.completion_tokens == 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16

    # Without ignore_eos the model may stop early, never past the limit.
    r = client.chat.completions.create(model=server.model_id, messages=messages, temperature=0,
                                       max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 16
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 16


def test_completion_non_streaming(client: openai.OpenAI, server: Server, tok) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=server.model_id, prompt=prompt, temperature=0,
                                  max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12

    echoed = client.completions.create(model=server.model_id, prompt=prompt, temperature=0,
                                       max_tokens=12, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt + r.choices[0].text


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_streaming_chat_equals_non_streaming(client: openai.OpenAI, server: Server,
                                             ignore_eos: bool) -> None:
    kwargs = dict(model=server.model_id, temperature=0, max_tokens=40,
                  messages=[{"role": "user", "content": "Large language models predict"}],
                  extra_body={"ignore_eos": ignore_eos})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-2].choices[0].finish_reason  # the finish chunk comes last, before usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == full.choices[0].message.content
    # Equal but for the cache: the streamed request may find the first one's prompt there.
    streamed, whole = usage_chunk.usage.model_dump(), full.usage.model_dump()
    cached = [u.pop("prompt_tokens_details")["cached_tokens"] for u in (streamed, whole)]
    assert streamed == whole and cached[0] >= cached[1], (streamed, whole, cached)


def test_streaming_completion_equals_non_streaming(client: openai.OpenAI, server: Server) -> None:
    kwargs = dict(model=server.model_id, prompt="Hello world! How are", temperature=0,
                  max_tokens=30, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    # Without include_usage there is no usage chunk.
    plain = list(client.completions.create(**kwargs, stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].text for c in plain) == full.choices[0].text


# ---- exactness against mlx-lm --------------------------------------------------------------------


def test_greedy_token_ids_match_mlx_lm(client: openai.OpenAI, server: Server, tok,
                                       reference: dict) -> None:
    """/v1/completions with a token-id prompt returns exactly mlx-lm's greedy continuation."""
    for prompt, gen in reference.items():
        prompt = list(prompt)
        r = client.completions.create(model=server.model_id, prompt=prompt, temperature=0,
                                      max_tokens=REF_TOKENS, extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == REF_TOKENS == len(gen)
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text == _decode_after(tok, prompt, gen), (
            f"prompt {prompt[:8]}... ({len(prompt)} tokens): mlx-lm generated {gen}")
        # Token for token: every shorter limit gives a prefix of the same continuation.
    prompt, gen = next(iter(reference.items()))
    for k in (1, 2, 5, 11):
        r = client.completions.create(model=server.model_id, prompt=list(prompt), temperature=0,
                                      max_tokens=k, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == k
        assert r.choices[0].text == _decode_after(tok, list(prompt), gen[:k])


def test_greedy_streaming_matches_mlx_lm(client: openai.OpenAI, server: Server, tok,
                                         reference: dict) -> None:
    prompt = tok(LONG_PROMPT)["input_ids"]  # > prefill chunk (512): prefilled in two chunks
    assert len(prompt) > 512
    gen = reference[tuple(prompt)]
    chunks = list(client.completions.create(
        model=server.model_id, prompt=prompt, temperature=0, max_tokens=REF_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == REF_TOKENS
    assert "".join(c.choices[0].text for c in chunks[:-1]) == _decode_after(tok, prompt, gen)


def test_text_prompt_round_trips_exactly(client: openai.OpenAI, server: Server, tok,
                                         reference: dict) -> None:
    """decode(prompt ids + completion ids) == prompt + completion text: no space dropped."""
    leading_space = 0
    for text in TEXT_PROMPTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        gen = reference[tuple(ids)]
        r = client.completions.create(model=server.model_id, prompt=text, temperature=0,
                                      max_tokens=REF_TOKENS, extra_body={"ignore_eos": True})
        completion = r.choices[0].text
        assert tok.decode(ids + gen, skip_special_tokens=True) == text + completion
        leading_space += completion.startswith(" ")
    # The tiny model continues at least one prompt with a space-led token (mlx_lm.server would
    # drop that space); this makes the check above meaningful.
    assert leading_space >= 1


# ---- concurrency ---------------------------------------------------------------------------------


def _concurrent_specs(model_id: str) -> list[dict]:
    specs = []
    for i in range(16):
        common = dict(model=model_id, temperature=0, max_tokens=8 + 2 * i,
                      extra_body={"ignore_eos": i % 3 != 0})
        if i % 2:
            specs.append(dict(kind="chat", messages=[
                {"role": "user", "content": f"Request {i}: {TEXT_PROMPTS[i % 8]}"}], **common))
        else:
            specs.append(dict(kind="completion", prompt=f"{i}. {TEXT_PROMPTS[i % 8]}", **common))
    # A long prompt, prefilled in chunks while the others decode.
    specs[5] = dict(kind="completion", prompt=f"5. {LONG_PROMPT}", model=model_id, temperature=0,
                    max_tokens=20, extra_body={"ignore_eos": True})
    return specs


async def _stream_one(aclient: openai.AsyncOpenAI, spec: dict) -> tuple[str, str, int]:
    spec = dict(spec)
    kind = spec.pop("kind")
    create = aclient.chat.completions.create if kind == "chat" else aclient.completions.create
    stream = await create(**spec, stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    async for c in stream:
        if c.usage is not None:
            usage = c.usage.completion_tokens
        for ch in c.choices:
            parts.append((ch.delta.content or "") if kind == "chat" else ch.text)
            finish = ch.finish_reason or finish
    return "".join(parts), finish, usage


def test_sixteen_concurrent_streams_equal_solo_runs(server: Server) -> None:
    specs = _concurrent_specs(server.model_id)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                     timeout=120)
        solo = [await asyncio.wait_for(_stream_one(aclient, s), 60) for s in specs]
        peak = 0
        done = asyncio.Event()

        async def watch():  # how many ran at once, seen from the gateway's gauges
            nonlocal peak
            async with httpx.AsyncClient(timeout=10) as h:
                while not done.is_set():
                    m = parse_metrics((await h.get(server.url + "/metrics")).text)
                    peak = max(peak, m["omlx_requests_processing"] + m["omlx_requests_deferred"])
                    await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            async def staggered(i: int, spec: dict):  # later ones join a running batch
                await asyncio.sleep(0.01 * (i % 4))
                return await _stream_one(aclient, spec)

            together = await asyncio.wait_for(
                asyncio.gather(*(staggered(i, s) for i, s in enumerate(specs))), 120)
        finally:
            done.set()
            await asyncio.wait_for(watcher, 15)
            await aclient.close()
        return solo, together, peak

    solo, together, peak = asyncio.run(main())
    assert peak >= 4, f"the requests did not overlap (peak {peak})"
    for i, (a, b) in enumerate(zip(solo, together)):
        assert a == b, f"request {i}: alone {a!r} != concurrent {b!r}"
        assert a[2] is not None and a[2] <= specs[i]["max_tokens"]


# ---- stop strings, limits, seeds -----------------------------------------------------------------


def test_stop_strings(client: openai.OpenAI, server: Server) -> None:
    base = dict(model=server.model_id, prompt="Hello world! How are", temperature=0,
                max_tokens=30, extra_body={"ignore_eos": True})
    full = client.completions.create(**base)
    text, n_full = full.choices[0].text, full.usage.completion_tokens
    # Stop strings that first occur in the middle of the text.
    cuts = [i for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i]
    assert len(cuts) >= 2, text
    early, late = cuts[0], cuts[-1]
    stop_early, stop_late = text[early:early + 2], text[late:late + 2]

    r = client.completions.create(**base, stop=stop_late)
    assert r.choices[0].text == text[:late] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= n_full

    r = client.completions.create(**base, stop=[stop_late, stop_early])
    assert r.choices[0].text == text[:early] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < n_full

    chunks = list(client.completions.create(**base, stop=[stop_early], stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:early]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens < n_full

    r = client.completions.create(**base, stop=["\x00never there\x00"])
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"

    # Chat too, with the stop string chosen from its own greedy output.
    chat = dict(model=server.model_id, temperature=0, max_tokens=30,
                messages=[{"role": "user", "content": "Numbers: 0 1 2"}],
                extra_body={"ignore_eos": True})
    ctext = client.chat.completions.create(**chat).choices[0].message.content
    ccuts = [i for i in range(1, len(ctext) - 1) if ctext.find(ctext[i:i + 2]) == i]
    if ccuts:
        i = ccuts[len(ccuts) // 2]
        r = client.chat.completions.create(**chat, stop=ctext[i:i + 2])
        assert r.choices[0].message.content == ctext[:i]
        assert r.choices[0].finish_reason == "stop"


def test_token_limits(client: openai.OpenAI, server: Server) -> None:
    eos = dict(extra_body={"ignore_eos": True}, temperature=0)
    r = client.completions.create(model=server.model_id, prompt="Numbers:", max_tokens=5, **eos)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "length")

    msgs = [{"role": "user", "content": "Count to a hundred."}]
    r = client.chat.completions.create(model=server.model_id, messages=msgs,
                                       max_completion_tokens=7, **eos)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (7, "length")
    r = client.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=6, **eos)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (6, "length")
    # max_completion_tokens supersedes the deprecated max_tokens.
    r = client.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=3,
                                       max_completion_tokens=9, **eos)
    assert r.usage.completion_tokens == 9
    stream = list(client.chat.completions.create(
        model=server.model_id, messages=msgs, max_completion_tokens=4, stream=True,
        stream_options={"include_usage": True}, **eos))
    assert stream[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, server: Server) -> None:
    kwargs = dict(model=server.model_id, prompt="The capital of France is", temperature=1.0,
                  max_tokens=20, extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    c = client.completions.create(**kwargs, seed=4321).choices[0].text
    assert a == b
    assert a != c, "a different seed gave the same 20 sampled tokens"
    greedy = client.completions.create(**{**kwargs, "temperature": 0}).choices[0].text
    assert a != greedy

    # The same seed while other sequences share the batch: still the same text.
    results: dict[int, str] = {}

    def noise(i: int) -> None:
        results[i] = client.completions.create(
            model=server.model_id, prompt=f"{i} Hello world", temperature=0.7, max_tokens=40,
            extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=noise, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        d = client.completions.create(**kwargs, seed=1234).choices[0].text
    finally:
        for t in threads:
            t.join(60)
    assert d == a
    assert len(results) == 3


# ---- cancellation --------------------------------------------------------------------------------


def _cancel_counters(server: Server, endpoint: str) -> tuple[float, float, float]:
    m, n = server.metrics(), server.node_metrics()
    return (m.get(f'omlx_requests_total{{endpoint="{endpoint}",outcome="disconnected"}}', 0.0),
            n.get('omlx_node_requests_finished_total{reason="cancelled"}', 0.0),
            n["omlx_node_tokens_predicted_total"])


def _assert_generation_stopped(server: Server, endpoint: str, before: tuple, limit: int) -> None:
    """The gateway counted a disconnect, the node cancelled the sequence and went idle, well
    before it could have generated `limit` tokens, and generates nothing more."""
    disc0, canc0, tok0 = before
    wait_for(lambda: _cancel_counters(server, endpoint)[0] >= disc0 + 1, 15,
              f"omlx_requests_total{{endpoint={endpoint},outcome=disconnected}} to move")
    wait_for(lambda: _cancel_counters(server, endpoint)[1] >= canc0 + 1, 15,
              "the node to cancel the sequence")
    wait_for(lambda: _idle(server), 15, "the gateway and the node to become idle")
    _, _, tok1 = _cancel_counters(server, endpoint)
    assert tok1 - tok0 < limit, "the node generated the whole completion anyway"
    time.sleep(0.5)
    assert _cancel_counters(server, endpoint)[2] == tok1, "the node is still generating"


def _quick_request_works(client: openai.OpenAI, server: Server) -> None:
    t0 = time.monotonic()
    r = client.completions.create(model=server.model_id, prompt="Hello", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8
    assert time.monotonic() - t0 < 5, "the server is slow after a cancelled request"


def test_client_closing_a_stream_cancels_generation(server: Server,
                                                    client: openai.OpenAI) -> None:
    wait_for(lambda: _idle(server), 15, "an idle server")
    before = _cancel_counters(server, "completions")
    limit = 1900
    body = {"model": server.model_id, "prompt": "Hello world! How are", "max_tokens": limit,
            "temperature": 0, "ignore_eos": True, "stream": True}
    received = 0
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.base_url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 10:
                    break  # leaving the block closes the connection mid-stream
    assert received == 10
    _assert_generation_stopped(server, "completions", before, limit)
    _quick_request_works(client, server)


def test_chat_stream_closed_by_openai_client(server: Server, client: openai.OpenAI) -> None:
    wait_for(lambda: _idle(server), 15, "an idle server")
    before = _cancel_counters(server, "chat")
    limit = 1900
    stream = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "Tell me everything."}],
        max_tokens=limit, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i >= 5:
            break
    stream.close()
    _assert_generation_stopped(server, "chat", before, limit)
    _quick_request_works(client, server)


def test_non_streaming_client_timeout_cancels_generation(server: Server,
                                                         client: openai.OpenAI) -> None:
    wait_for(lambda: _idle(server), 15, "an idle server")
    before = _cancel_counters(server, "completions")
    limit = 1900
    # A penalised row never drafts: speculation must not finish the whole completion before
    # the gateway sees the client go (a random model's greedy output loops, and drafts stand).
    body = {"model": server.model_id, "prompt": "Hello world! How are", "max_tokens": limit,
            "temperature": 0, "ignore_eos": True, "presence_penalty": 0.01}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=1.0)
    _assert_generation_stopped(server, "completions", before, limit)
    _quick_request_works(client, server)

    # The openai client's own timeout, likewise.
    wait_for(lambda: _idle(server), 15, "an idle server")
    before = _cancel_counters(server, "completions")
    short = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        short.completions.create(model=server.model_id, prompt="Hello world! How are",
                                 max_tokens=limit, temperature=0, presence_penalty=0.01,
                                 extra_body={"ignore_eos": True})
    _assert_generation_stopped(server, "completions", before, limit)
    _quick_request_works(client, server)
    # A client that goes away is routine: no traceback in the server's log.
    assert "Traceback" not in server.log_path.read_text(errors="replace"), server.log_tail()


# ---- keep-alive ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pausable_server(tmp_path_factory):
    """A server of its own: the keep-alive test pauses its head worker."""
    path = build_model(tmp_path_factory.mktemp("models") / "pause-llama", "llama", num_layers=2,
                       hidden_size=64, seed=1)
    with start_server(path, home=tmp_path_factory.mktemp("home"), keepalive=0.5) as s:
        yield s


def test_keepalive_comments_while_the_node_has_not_answered(pausable_server: Server) -> None:
    """The head worker is paused (SIGSTOP) from before the request until two keep-alives have
    come: the wait is the test's, on a machine of any speed."""
    server = pausable_server
    worker = httpx.get(server.url + "/health", timeout=10).json()["nodes"][0]["worker_pid"]
    prompt = "The capital of France is Paris. The capital of Italy is Rome. " * 50
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    lines, first_data_at = [], None
    os.kill(worker, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", server.base_url + "/completions", json=body) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                for line in resp.iter_lines():
                    if line.startswith("data: ") and first_data_at is None:
                        first_data_at = time.monotonic() - t0
                    lines.append(line)
                    if lines.count(": keep-alive") == 2:
                        os.kill(worker, signal.SIGCONT)
    finally:
        os.kill(worker, signal.SIGCONT)
    first = next(i for i, x in enumerate(lines) if x.startswith("data: "))
    keepalives = [x for x in lines[:first] if x == ": keep-alive"]
    assert len(keepalives) >= 2, lines[:first + 1]
    assert len(keepalives) <= first_data_at / 0.5 + 1  # one per interval, not a flood
    assert all(x == "" or x == ": keep-alive" for x in lines[:first])
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""]
    events = _sse_events(lines)
    assert events[-1]["usage"]["completion_tokens"] == 4

    # The openai client skips the comments and gets the same text as the raw stream.
    oc = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    chunks = list(oc.completions.create(model=server.model_id, prompt=prompt, max_tokens=4,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}))
    raw_text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert "".join(c.choices[0].text for c in chunks) == raw_text


# ---- metrics -------------------------------------------------------------------------------------


def test_an_idle_client_connection_outlives_the_clients_own_keep_alive(server: Server) -> None:
    """A client keeps an idle connection 5 s (httpx, the OpenAI SDK) and reuses it until then:
    the server must not close it first, or the next request on it is lost in the race."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for pause in (6, 0):  # past uvicorn's default keep-alive (5 s), then none
            conn.request("GET", "/health")
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 200
            time.sleep(pause)
    finally:
        conn.close()


def test_metrics_names_and_counters(server: Server, client: openai.OpenAI, tok) -> None:
    wait_for(lambda: _idle(server), 15, "an idle server")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("omlx_prompt_tokens_total", "omlx_tokens_predicted_total",
                 "omlx_time_to_first_token_seconds_bucket",
                 "omlx_inter_token_latency_seconds_bucket",
                 "omlx_requests_processing", "omlx_requests_deferred",
                 "omlx_request_duration_seconds_count"):
        assert name in text, name
    assert "# TYPE omlx_time_to_first_token_seconds histogram" in text
    assert "# TYPE omlx_requests_processing gauge" in text

    before = server.metrics()
    r = client.chat.completions.create(model=server.model_id, temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": "Hi there"}],
                                       extra_body={"ignore_eos": True})
    list(client.completions.create(model=server.model_id, prompt="Hello", max_tokens=5,
                                   temperature=0, stream=True, extra_body={"ignore_eos": True}))
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    hello = len(tok("Hello")["input_ids"])
    assert delta("omlx_prompt_tokens_total") == r.usage.prompt_tokens + hello
    assert delta("omlx_tokens_predicted_total") == 12 + 5
    assert delta("omlx_time_to_first_token_seconds_count") == 2
    assert delta("omlx_inter_token_latency_seconds_count") >= 1
    assert delta("omlx_request_duration_seconds_count") == 2
    assert delta('omlx_requests_total{endpoint="chat",outcome="ok"}') == 1
    assert delta('omlx_requests_total{endpoint="completions",outcome="ok"}') == 1
    assert after["omlx_requests_processing"] == 0 and after["omlx_requests_deferred"] == 0
    assert after['omlx_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        after["omlx_time_to_first_token_seconds_count"]
