"""Embedding and reranking models through a real `serve`, beside a chat model: /v1/embeddings
through the official `openai` SDK and /v1/rerank, each equal to the libraries' own computation
(mlx-embeddings for encoders, plain mlx-lm for decoders) within 1e-5; the kinds /v1/models
shows, and the 400s of requests sent to the wrong kind, too long or empty."""

from __future__ import annotations

from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from transformers import AutoTokenizer

from omlx_node.encoders import Encoder
from tests.conftest import start_server
from tests.tiny_encoders import (
    MAX_POSITIONS,
    build_decoder,
    build_encoder,
    mlx_embeddings_reference,
)
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

# Generous: a request to a model not loaded yet waits for its load.
TIMEOUT = 120.0
TEXTS = ["The capital of France is Paris.", "hello", "A pipeline splits the layers of a model "
         "across several machines. " * 2]


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, timeout=TIMEOUT, **kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    return {"chat": build_model(root / "chat", "llama", num_layers=2),
            "bert": build_encoder(root / "bert", "bert", pooling="cls"),
            "xlmr": build_encoder(root / "xlmr", "xlm-roberta"),
            "ce": build_encoder(root / "ce", "xlm-roberta", classifier=True),
            "qemb": build_decoder(root, "embed"),
            "qrerank": build_decoder(root, "rerank")}


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    flags = [f for name in ("bert", "xlmr", "ce", "qemb", "qrerank")
             for f in ("--model", f"{name}={folders[name]}")]
    with start_server(folders["chat"], *flags, home=tmp_path_factory.mktemp("home")) as s:
        yield s


def mlx_lm_last_token(folder: Path, text: str) -> np.ndarray:
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    ids = AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    h = model.model(mx.array([ids]))[0, -1]
    return np.array(h / mx.linalg.norm(h))


def test_models_list_kinds_and_endpoints(server):
    cards = {m["id"]: m for m in httpx.get(server.base_url + "/models", timeout=30).json()["data"]}
    assert cards["bert"]["kind"] == "embed" and "/v1/embeddings" in cards["bert"]["endpoints"]
    assert cards["ce"]["kind"] == "rerank" and cards["ce"]["endpoints"] == ["/v1/rerank"]
    assert cards["qrerank"]["kind"] == "rerank" and cards["qemb"]["kind"] == "embed"
    assert cards[server.model_id]["kind"] == "chat"


def test_openai_sdk_embeddings_equal_the_libraries(server, folders):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none", timeout=TIMEOUT)
    for name, ref in (("bert", lambda t: mlx_embeddings_reference(folders["bert"], t, "cls")),
                      ("xlmr", lambda t: mlx_embeddings_reference(folders["xlmr"], t, "mean")),
                      ("qemb", lambda t: mlx_lm_last_token(folders["qemb"], t))):
        reply = client.embeddings.create(model=name, input=TEXTS)  # base64, the SDK's default
        assert [d.index for d in reply.data] == [0, 1, 2]
        for d, text in zip(reply.data, TEXTS):
            np.testing.assert_allclose(d.embedding, ref(text), atol=1e-5)
        assert reply.usage.prompt_tokens > len(TEXTS)
        floats = client.embeddings.create(model=name, input=TEXTS[0], encoding_format="float")
        np.testing.assert_allclose(floats.data[0].embedding, reply.data[0].embedding, atol=1e-6)


def test_concurrent_requests_equal_each_alone(server, folders):
    """Clients at once (the worker merges what queues into shared passes): each answer is its
    input's own embedding or score."""
    from concurrent.futures import ThreadPoolExecutor

    tok = AutoTokenizer.from_pretrained(str(folders["ce"]))
    words = " ".join(TEXTS).split()
    texts = [" ".join(words[i % 5: i % 5 + 1 + i]) for i in range(12)]

    def embed(text: str) -> list[float]:
        r = post(server.base_url + "/embeddings", json={"model": "xlmr", "input": text})
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    def score(text: str) -> float:
        r = post(server.base_url + "/rerank", json={"model": "ce", "query": "q",
                                                    "documents": [text]})
        assert r.status_code == 200, r.text
        return r.json()["results"][0]["relevance_score"]

    with ThreadPoolExecutor(len(texts) * 2) as pool:
        embeddings = list(pool.map(embed, texts))
        scores = list(pool.map(score, texts))
    ce = Encoder(folders["ce"])
    for text, e, s in zip(texts, embeddings, scores):
        np.testing.assert_allclose(e, mlx_embeddings_reference(folders["xlmr"], text, "mean"),
                                   atol=1e-5)
        assert s == pytest.approx(float(ce.run([tok("q", text)["input_ids"]])[0, 0]), abs=1e-5)


def test_token_ids_and_dimensions(server, folders):
    tok = AutoTokenizer.from_pretrained(str(folders["xlmr"]))
    ids = tok(TEXTS[0])["input_ids"]
    by_ids = post(server.base_url + "/embeddings",
                        json={"model": "xlmr", "input": ids}).json()["data"][0]["embedding"]
    by_text = post(server.base_url + "/embeddings",
                         json={"model": "xlmr", "input": TEXTS[0]}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    cut = post(server.base_url + "/embeddings", json={
        "model": "xlmr", "input": [ids], "dimensions": 16}).json()["data"][0]["embedding"]
    want = np.array(by_text[:16]) / np.linalg.norm(by_text[:16])
    np.testing.assert_allclose(cut, want, atol=1e-6)


def test_rerank_scores_equal_the_reference(server, folders):
    query, docs = "What is the capital of France?", ["Paris is the capital.", "hello", "Rome"]
    for name in ("ce", "qrerank"):
        reply = post(server.base_url + "/rerank", json={
            "model": name, "query": query, "documents": docs, "top_n": 2}).json()
        assert "results" in reply, reply
        results = reply["results"]
        assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
        # The reference: the model run alone on each pair, unbatched.
        enc = Encoder(folders[name])
        tok = AutoTokenizer.from_pretrained(str(folders[name]))
        for r in results:
            doc = docs[r["index"]]
            assert r["document"] == {"text": doc}
            if name == "ce":
                ids = tok(query, doc)["input_ids"]
                want = float(enc.run([ids])[0, 0])
            else:
                from mlx_lm.utils import load_model

                from omlx_coordinator.api.embeddings import (
                    RERANK_INSTRUCTION,
                    RERANK_SUFFIX,
                    RERANK_SYSTEM,
                )
                text = (f"{RERANK_SYSTEM}<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n"
                        f"<Document>: {doc}{RERANK_SUFFIX}")
                model, _ = load_model(folders[name])
                logits = model(mx.array([tok(text)["input_ids"]]))[0, -1]
                yes, no = tok.convert_tokens_to_ids(["yes", "no"])
                want = float(mx.softmax(mx.stack([logits[yes], logits[no]]))[0])
            assert r["relevance_score"] == pytest.approx(want, abs=1e-5)


def test_wrong_kind_long_and_empty_inputs_are_400s(server):
    chat = post(server.base_url + "/chat/completions", json={
        "model": "bert", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]
    embed_chat = post(server.base_url + "/embeddings",
                            json={"model": server.model_id, "input": "hi"})
    assert embed_chat.status_code == 400
    assert "/v1/chat/completions" in embed_chat.json()["error"]["message"]
    long = post(server.base_url + "/embeddings",
                      json={"model": "bert", "input": [1] * (MAX_POSITIONS + 1)})
    assert long.status_code == 400 and f"at most {MAX_POSITIONS}" in long.json()["error"]["message"]
    huge = post(server.base_url + "/embeddings",
                      json={"model": "bert", "input": "word " * 100_000})
    assert huge.status_code == 400 and str(MAX_POSITIONS) in huge.json()["error"]["message"]
    for body in ({"model": "bert", "input": []}, {"model": "ce", "query": "q", "documents": []}):
        path = "/embeddings" if "input" in body else "/rerank"
        r = post(server.base_url + path, json=body)
        assert r.status_code == 400 and "empty" in r.json()["error"]["message"], r.text


def test_ollama_client_embed(server, folders):
    import ollama

    client = ollama.Client(host=server.url, timeout=TIMEOUT)
    reply = client.embed(model="xlmr", input=TEXTS)
    assert len(reply.embeddings) == len(TEXTS) and reply.prompt_eval_count > len(TEXTS)
    for e, text in zip(reply.embeddings, TEXTS):
        np.testing.assert_allclose(e, mlx_embeddings_reference(folders["xlmr"], text, "mean"),
                                   atol=1e-5)
    legacy = client.embeddings(model="xlmr", prompt=TEXTS[0])
    np.testing.assert_allclose(legacy.embedding, reply.embeddings[0], atol=1e-6)
    # truncate (Ollama's default) cuts a long input to the model's limit; false refuses it.
    long = "word " * 400
    cut = client.embed(model="bert", input=long)
    assert cut.prompt_eval_count == MAX_POSITIONS
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="bert", input=long, truncate=False)
    assert refused.value.status_code == 400 and f"at most {MAX_POSITIONS}" in refused.value.error


def test_a_budget_for_two_evicts_the_least_recently_used_kind(folders, tmp_path):
    """A chat, an embedding and a reranking model under a --node-memory that holds two: each
    request for the one unloaded evicts the least recently used idle one, and every request
    answers."""
    from omlx_coordinator.models import placement
    from omlx_coordinator.models.model_config import ModelConfig
    from omlx_coordinator.models.served_model import ServedModel
    from omlx_coordinator.planning.planner import NodeSpec, make_plan
    from tests.helpers.serving import CACHE_FLAGS

    names = {"chat": folders["chat"], "xlmr": folders["xlmr"], "ce": folders["ce"]}
    sizes = {}
    for name, path in names.items():
        layout = ServedModel(ModelConfig(name, str(path)), path).layout
        plan = make_plan(layout, [NodeSpec("n", 1 << 40, cache_bytes=32 << 20)],
                         os_reserve_bytes=0)
        sizes[name] = sum(placement.plan_bytes(plan).values())
    two = sum(sorted(sizes.values())[1:])
    assert two * 1.05 < sum(sizes.values())
    budget = f"{two * 1.05 / 2**20:.0f}MiB"
    with start_server(folders["chat"], "--model", f"xlmr={folders['xlmr']}", "--model",
                      f"ce={folders['ce']}", "--node-memory", budget, *CACHE_FLAGS,
                      home=tmp_path / "home") as s:
        def state() -> dict[str, str]:
            data = httpx.get(s.base_url + "/models", timeout=30).json()["data"]
            return {m["id"]: m["state"] for m in data}

        def chat() -> None:
            r = post(s.base_url + "/completions", json={
                "model": "chat", "prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200, r.text

        def embed() -> None:
            r = post(s.base_url + "/embeddings", json={"model": "xlmr", "input": TEXTS})
            assert r.status_code == 200 and len(r.json()["data"]) == 3, r.text

        def rerank() -> None:
            r = post(s.base_url + "/rerank", json={"model": "ce", "query": "q",
                                                    "documents": TEXTS})
            assert r.status_code == 200 and len(r.json()["results"]) == 3, r.text

        assert state() == {"chat": "loaded", "xlmr": "loaded", "ce": "unloaded"}
        chat()
        embed()
        rerank()  # chat was used before xlmr: it goes
        assert state() == {"chat": "unloaded", "xlmr": "loaded", "ce": "loaded"}
        chat()  # xlmr is now the least recently used
        assert state() == {"chat": "loaded", "xlmr": "unloaded", "ce": "loaded"}
        workers = httpx.get(s.url + "/health", timeout=10).json()["nodes"][0]["workers"]
        assert sorted(w["model"] for w in workers) == ["ce", "chat"]
