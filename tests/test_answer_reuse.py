"""A re-sent answer is given to the model as the ids it generated (prefix_tokens.py's answer
entries), not as a re-tokenization of its text: the request path without processes, through the
chat and Messages APIs, against a head worker whose prefix cache holds every token it ran
(tests/helpers/fake_replica.py). The answers are spelled with other ids than the tokenizer
gives their text (a word letter by letter), as a model may write them."""

from __future__ import annotations

import asyncio
import json
import re
from functools import partial
from pathlib import Path

import httpx
import pytest

from omlx_coordinator.frontdoor.usage import Usage
from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.request.generation import GatewaySettings
from omlx_coordinator.text.tokenizer import ChatPrompt, ChatTokenizer
from tests.helpers.fake_replica import CachingWorker, fake_manager, serve, shared_start
from tests.tiny_models import tiny_qwen

SYSTEM = "You are a coding agent. Use the tools you have. " * 6
ASK, THEN = "Where is the parser?", "Now fix it."


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("models") / "tiny-qwen-answers"
    return tiny_qwen(dest, seed=3, num_layers=1, hidden_size=32, context=4096)


def spelled(tok: ChatTokenizer, text: str, letters: tuple[str, ...]) -> list[int]:
    """`text`'s ids with the (ASCII) words in `letters` spelled a byte-level piece a letter."""
    ids, at = [], 0
    for m in re.finditer("|".join(letters), text):
        ids += tok.encode_text(text[at:m.start()], "t") if m.start() > at else []
        ids += tok.tokenizer.convert_tokens_to_ids(list(m.group()))
        at = m.end()
    ids += tok.encode_text(text[at:], "t") if at < len(text) else []
    assert tok.decode(ids) == text and ids != tok.encode_text(text, "t")
    return ids


class Gateway:
    """The gateway app on `worker`; `post` one request through it (ASGI)."""

    def __init__(self, model: Path, worker: CachingWorker, tmp: Path):
        self.manager = fake_manager(model)
        serve(self.manager.main, worker)
        self.worker, self.tok = worker, self.manager.models[0].tokenizer
        self.app = create_app(self.manager, GatewaySettings(keepalive_seconds=0.05),
                              start_cluster=False, usage=Usage(tmp / "usage.json"))
        self.texts: dict[tuple[int, ...], str] = {}  # the text each prompt's ids were given for
        encode_chat = self.tok.encode_chat

        def recorded(*args, **kw) -> ChatPrompt:
            prompt = encode_chat(*args, **kw)
            self.texts[tuple(prompt)] = prompt.text
            return prompt
        self.tok.encode_chat = recorded

    def post(self, path: str, body: dict) -> httpx.Response:
        async def run() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                         base_url="http://gw") as http:
                return await http.post(path, json={"model": "fake", **body},
                                       headers={"anthropic-version": "2023-06-01"})
        r = asyncio.run(run())
        assert r.status_code == 200, r.text
        return r

    def whole(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The rendered chat tokenized whole: what the prompt was before answers were kept."""
        text = self.tok.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        return self.tok.encode_text(text, "t")


def chat(gw: Gateway, messages: list[dict], stream: bool, **kw) -> tuple[list[str], int]:
    """(each choice's content, the cached tokens reported)."""
    body = {"messages": messages, "max_tokens": 64, "temperature": 0, "stream": stream, **kw}
    if not stream:
        out = gw.post("/v1/chat/completions", body).json()
        return ([c["message"]["content"] for c in out["choices"]],
                out["usage"]["prompt_tokens_details"]["cached_tokens"])
    body["stream_options"] = {"include_usage": True}
    texts: dict[int, str] = {}
    usage = {}
    for line in gw.post("/v1/chat/completions", body).text.splitlines():
        if not line.startswith("data: {"):
            continue
        obj = json.loads(line[6:])
        for c in obj["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        usage = obj.get("usage") or usage
    return [texts[i] for i in sorted(texts)], usage["prompt_tokens_details"]["cached_tokens"]


def assert_answer_reused(gw: Gateway, p1: list[int], answer: list[int], p2: list[int],
                         whole2: list[int], cached: int) -> None:
    """Turn 2's prompt is turn 1's prompt, the answer's own ids, then the rest tokenized as
    tokenizing it whole gives it; the cache covers all it re-sent."""
    resent = len(p1) + len(answer)
    assert p2[:resent] == p1 + answer
    assert shared_start(whole2, p1 + answer) < resent  # re-tokenized, the answer differs
    tail = len(p2) - resent
    assert p2[resent:] == whole2[-tail:] and whole2[-tail] == gw.tok.cut_tokens["<|im_end|>"]
    assert cached == resent
    assert gw.tok.prefix_tokenizer.enabled  # the first reuse was checked, and passed


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_the_chat_apis_next_turn_reuses_the_answers_own_ids(model, tmp_path, stream, finish):
    """An answer ended by the model (its end-of-turn token, which the template writes again) or
    by max_tokens: the next turn holds its ids either way, the answer ending at a special token
    of the rendered chat."""
    probe = ChatTokenizer(model)
    answer = spelled(probe, " The parser is in parse.py, near the capital letters.",
                     ("parser", "capital"))
    gw = Gateway(model, CachingWorker(answer, [5, 6, 7], finish=finish), tmp_path)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    (text,), cached = chat(gw, first, stream)
    assert text == probe.decode(answer) and cached == 0
    second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": THEN}]
    _, cached = chat(gw, second, stream)
    p1, p2 = (list(r.prompt_tokens) for r in gw.worker.requests)
    assert_answer_reused(gw, p1, answer, p2, gw.whole(second), cached)


def rendered(gw: Gateway, prompt: list[int]) -> list[int]:
    """`prompt`'s text (byte-level BPE decodes exactly) tokenized whole."""
    return gw.tok.encode_text(gw.tok.tokenizer.decode(prompt, skip_special_tokens=False), "t")


def test_each_of_n_choices_is_kept_and_a_stop_string_keeps_none(model, tmp_path):
    """n=2: whichever choice the next turn goes on with, its own ids are reused. An answer cut
    at a stop string is not kept (its tokens spell more than its text), so the turn after it is
    tokenized as before."""
    probe = ChatTokenizer(model)
    answers = [spelled(probe, " The capital of France is Paris.", ("capital",)),
               spelled(probe, " The capital of Italy is Rome.", ("capital", "Italy"))]
    gw = Gateway(model, CachingWorker(*answers, [5], [6], [7]), tmp_path)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    texts, _ = chat(gw, first, stream=True, n=2)
    assert sorted(texts) == sorted(probe.decode(a) for a in answers)
    p1 = list(gw.worker.requests[0].prompt_tokens)
    for text in texts:
        second = first + [{"role": "assistant", "content": text},
                          {"role": "user", "content": THEN}]
        _, cached = chat(gw, second, stream=False)
        p2 = list(gw.worker.requests[-1].prompt_tokens)
        answer = answers[[probe.decode(a) for a in answers].index(text)]
        assert_answer_reused(gw, p1, answer, p2, gw.whole(second), cached)

    stopped = Gateway(model, CachingWorker(answers[0], [5]), tmp_path)
    (text,), _ = chat(stopped, first, stream=False, stop=["Paris"])
    assert text == " The capital of France is "
    second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": THEN}]
    chat(stopped, second, stream=False)
    assert list(stopped.worker.requests[1].prompt_tokens) == stopped.whole(second)


def assert_reused_to_where_it_differs(gw: Gateway, p1: list[int], answer: list[int],
                                      p2: list[int], cached: int) -> int:
    """Turn 2's prompt is turn 1's prompt, the answer's own ids up to the last one whose text
    turn 2 still holds after it, then the rest of turn 2's text tokenized alone: ids that spell
    turn 2's text, where tokenizing it whole spells the answer otherwise; the cache covers all
    of the answer's ids reused. Returns how many they are."""
    text1, text2 = gw.texts[tuple(p1)], gw.texts[tuple(p2)]
    decode = partial(gw.tok.tokenizer.decode, skip_special_tokens=False)  # exact: byte-level
    n = max(k for k in range(len(answer) + 1) if text2.startswith(decode(answer[:k]), len(text1)))
    resent = len(p1) + n
    assert p2[:resent] == p1 + answer[:n] and decode(p2) == text2
    assert p2[resent:] == gw.tok.encode_text(text2[len(text1) + len(decode(answer[:n])):], "t")
    assert shared_start(gw.tok.encode_text(text2, "t"), p1 + answer) < resent
    assert cached == resent and gw.tok.prefix_tokenizer.enabled
    return n


READ = {"name": "Read", "description": "Reads a file.",
        "input_schema": {"type": "object", "required": ["path"],
                         "properties": {"path": {"type": "string"}}}}


SPACED = '<tool_call>\n{"name": "Read", "arguments": {"path": "parse.py"}}\n</tool_call>'


COMPACT = '<tool_call>\n{"name": "Read", "arguments":{"path":"parse.py"}}\n</tool_call>'
TEXT = " I will read it.\n"  # the model's newline before its call stays in the text block


@pytest.mark.parametrize("answer_text, letters", [
    (SPACED, ("parse",)),
    (COMPACT, ("arguments",)),
    (TEXT + SPACED, ("read", "parse"))])
def test_a_messages_api_tool_use_answer_is_reused_up_to_where_the_template_writes_otherwise(
        model, tmp_path, answer_text, letters):
    """Anthropic's Messages API: the answer comes back as tool_use (and text) blocks, which the
    template renders again. A call written as the template writes one (json.dumps' spacing) is
    the model's own ids, whole; one written otherwise (compact JSON) up to its first missing
    space, and
    text before a call up to the newline it ends with (the template writes one more before the
    call): the rest of the turn is tokenized from there."""
    probe = ChatTokenizer(model)
    answer = spelled(probe, answer_text, letters)
    gw = Gateway(model, CachingWorker(answer, [5]), tmp_path)
    ask = [{"role": "user", "content": ASK}]
    out = gw.post("/v1/messages", {"system": SYSTEM, "max_tokens": 64, "tools": [READ],
                                   "messages": ask}).json()
    call = out["content"][-1]
    assert call["type"] == "tool_use" and call["input"] == {"path": "parse.py"}
    result = {"type": "tool_result", "tool_use_id": call["id"], "content": "ok"}
    again = gw.post("/v1/messages", {"system": SYSTEM, "max_tokens": 64, "tools": [READ],
                                     "messages": ask + [
                                         {"role": "assistant", "content": out["content"]},
                                         {"role": "user", "content": [result]}]}).json()
    p1, p2 = (list(r.prompt_tokens) for r in gw.worker.requests)
    n = assert_reused_to_where_it_differs(gw, p1, answer, p2,
                                          again["usage"]["cache_read_input_tokens"])
    reused = probe.decode(answer[:n])
    assert reused == {SPACED: SPACED, COMPACT: COMPACT[:COMPACT.index(":{") + 1],
                      TEXT + SPACED: TEXT}[answer_text]


def test_the_chat_apis_tool_call_after_text_is_reused_up_to_the_text(model, tmp_path):
    """The chat API: text, then a call (`content` keeps the newline before it, and the template
    writes one more): the next turn, which re-sends the message with its `tool_calls` and the
    tool's result, holds the answer's ids through the text."""
    probe = ChatTokenizer(model)
    answer = spelled(probe, TEXT + SPACED, ("read", "parse"))
    gw = Gateway(model, CachingWorker(answer, [5]), tmp_path)
    tools = [{"type": "function", "function": {
        "name": "Read", "description": READ["description"], "parameters": READ["input_schema"]}}]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    body = {"max_tokens": 64, "temperature": 0, "tools": tools}
    (choice,) = gw.post("/v1/chat/completions", {**body, "messages": first}).json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == TEXT
    (call,) = message["tool_calls"]
    second = first + [message, {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    out = gw.post("/v1/chat/completions", {**body, "messages": second}).json()
    p1, p2 = (list(r.prompt_tokens) for r in gw.worker.requests)
    n = assert_reused_to_where_it_differs(gw, p1, answer, p2,
                                          out["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert probe.decode(answer[:n]) == TEXT
