"""An agent's next turn computes only what is new: the prefix cache keeps a turn's whole prompt
and the model's own answer, whole blocks and the tail after them, so the re-sent conversation is
reused to its last token whose KV was computed (all but the answer's last token, which was
sampled, never run), through token ids, the chat API and the Messages API with Qwen's
template; through the chat API even where the answer's text tokenizes to other ids than the
model generated (the gateway gives the model its own ids back)."""

from __future__ import annotations

from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from tests.conftest import start_server
from omlx_coordinator.text.tokenizer import ChatTokenizer
from tests.helpers.fake_replica import shared_start
from tests.tiny_models import tiny_qwen

BLOCK = 16
ANSWER = 12
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("models") / "tiny-qwen-turns"
    return tiny_qwen(dest, seed=6, context=4096)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with start_server(model, "--cache-block-size", str(BLOCK), "--api-key", "k",
                      home=tmp_path_factory.mktemp("home"), keepalive=None) as s:
        yield s


@pytest.fixture(scope="module")
def pipeline_server(model, tmp_path_factory):
    with start_server(model, "--cache-block-size", str(BLOCK), "--api-key", "k", "--nodes", "2",
                      home=tmp_path_factory.mktemp("home"), keepalive=None) as s:
        yield s


def greedy(model_path: Path, ids: list[int], n: int = ANSWER) -> list[int]:
    """mlx-lm's greedy continuation of `ids`: what the node must answer too."""
    ref, _ = load(str(model_path))
    out = [int(t) for t, _ in generate_step(mx.array(ids), ref, max_tokens=n)]
    mx.synchronize()
    return out


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120,
                   headers={"authorization": "Bearer k", "x-api-key": "k",
                            "anthropic-version": "2023-06-01"})
    r.raise_for_status()
    return r.json()


@slow
@pytest.mark.parametrize("serving", ["server", "pipeline_server"])
def test_a_turns_answer_is_reused_by_the_next_turn(serving, model, request) -> None:
    """Token ids: turn 2 re-sends turn 1's prompt and answer token for token; all of them are
    reused but the answer's last token (in a pipeline, by every stage), and the outputs stay
    mlx-lm's."""
    server = request.getfixturevalue(serving)
    _, tok = load(str(model))
    p1 = tok.encode("Read the file and tell me what it does. " * 5)
    g1 = greedy(model, p1)
    first = post(server, "/v1/completions", {"model": server.model_id, "prompt": p1,
                                             "max_tokens": ANSWER, "temperature": 0,
                                             "ignore_eos": True})
    assert first["choices"][0]["text"] == tok.decode(g1)
    p2 = p1 + g1 + tok.encode(" Now fix it.")
    second = post(server, "/v1/completions", {"model": server.model_id, "prompt": p2,
                                              "max_tokens": ANSWER, "temperature": 0,
                                              "ignore_eos": True})
    assert second["choices"][0]["text"] == tok.decode(greedy(model, p2))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (len(p1) + len(g1)) % BLOCK  # a tail: the answer ends inside a block
    # The answer's last token is held too where a step took it as input before the end.
    assert len(p1) + len(g1) - 1 <= cached <= len(p1) + len(g1)


def conversation(tok, system: str, turns: list[tuple[str, str]]) -> list[int]:
    """The rendered chat's ids: the system prompt, then (user, assistant) pairs; a last pair
    with no answer ends in the generation prompt."""
    messages = [{"role": "system", "content": system}]
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        if answer:
            messages.append({"role": "assistant", "content": answer})
    return tok.apply_chat_template(messages, add_generation_prompt=not turns[-1][1])


@slow
@pytest.mark.parametrize("api", ["chat", "anthropic"])
def test_the_re_sent_conversation_is_reused_through_the_apis(server, model, api) -> None:
    """Turn 2 through the chat or Messages API: its cached tokens cover the whole prefix it
    re-sent token for token (turn 1's prompt and the answer as the template renders it again),
    the last partial block included, up to the answer's last token (its KV was never
    computed)."""
    _, tok = load(str(model))
    system = f"You are a coding agent ({api}). " + "Use the tools you have. " * 8
    ask, then = "Where is the parser?", "Now explain it."
    p1 = conversation(tok, system, [(ask, "")])
    answer = tok.decode(greedy(model, p1))
    resent = shared_start(conversation(tok, system, [(ask, answer), (then, "")]),
                    p1 + greedy(model, p1))
    assert resent > len(p1)  # the template gives the answer back token for token, at least part

    def turn(history: list[dict]) -> int:
        if api == "chat":
            body = {"model": server.model_id, "temperature": 0, "max_tokens": ANSWER,
                    "ignore_eos": True,
                    "messages": [{"role": "system", "content": system}, *history]}
            out = post(server, "/v1/chat/completions", body)
            return out["usage"]["prompt_tokens_details"]["cached_tokens"]
        body = {"model": server.model_id, "temperature": 0, "max_tokens": ANSWER,
                "system": system, "messages": history}
        return post(server, "/v1/messages", body)["usage"]["cache_read_input_tokens"]

    turn([{"role": "user", "content": ask}])
    cached = turn([{"role": "user", "content": ask}, {"role": "assistant", "content": answer},
                   {"role": "user", "content": then}])
    assert resent % BLOCK > 1 and resent - 1 <= cached <= resent  # (whole blocks: less)


WORDS = {"type": "json_schema", "json_schema": {"name": "words", "schema": {
    "type": "string", "pattern": "^[a-z ]{8,40}$"}}}


@slow
def test_an_answer_the_tokenizer_spells_otherwise_is_reused_whole(server, model) -> None:
    """A sampled answer of random tokens (held to lowercase words by a schema, so that its text
    is whole characters), which its text's tokenization spells otherwise: turn 2 through the
    chat API gets the answer's own ids back (the gateway kept them), so its cached tokens cover
    the whole prefix it re-sent, where a re-tokenization lost the answer from its first
    differing token on."""
    chat = ChatTokenizer(model)
    by_bytes = {chat.token_bytes(i): i for i in range(len(chat.tokenizer))
                if i not in chat.tokenizer.all_special_ids}
    system = "You are a coding agent. " + "Read the files you are asked about. " * 8
    ask, then = "Where is the parser?", "Now explain it."
    for seed in range(8):  # a sample whose text re-tokenizes otherwise before its last token
        history = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
        body = {"model": server.model_id, "temperature": 1.0, "seed": seed, "logprobs": True,
                "max_tokens": 2 * ANSWER, "messages": history, "response_format": WORDS}
        out = post(server, "/v1/chat/completions", body)
        answer = out["choices"][0]["message"]["content"]
        generated = [by_bytes.get(bytes(t["bytes"]))
                     for t in out["choices"][0]["logprobs"]["content"]]
        p1 = chat.encode_chat(history)
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": then}]
        retokenized = chat.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        if None not in generated and shared_start(retokenized, p1 + generated) < (
                len(p1) + len(generated) - 1):
            break
    else:
        pytest.fail("no sampled answer re-tokenized otherwise")
    assert len(p1) == out["usage"]["prompt_tokens"] and chat.decode(generated) == answer
    body = {"model": server.model_id, "temperature": 0, "max_tokens": 1, "messages": history}
    cached = post(server, "/v1/chat/completions", body)["usage"]["prompt_tokens_details"][
        "cached_tokens"]
    assert len(p1) + len(generated) - 1 <= cached <= len(p1) + len(generated)
