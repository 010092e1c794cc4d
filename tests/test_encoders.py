"""Embedding and reranking models in process: the kind a folder is detected as, the node's
batched forward passes against the libraries' one-input-at-a-time computation, and the
gateway's refusals that need no node."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from transformers import AutoTokenizer

from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.request.generation import GatewaySettings
from omlx_node import encoders
from omlx_node.encoders import Encoder, _passes
from omlx_shared.model_kinds import CHAT, EMBED, RERANK, ModelKind, detect_kind
from tests.in_process_gateway import ask
from tests.tiny_encoders import MAX_POSITIONS, build_decoder, build_encoder, write_pooling
from tests.tiny_models import CORPUS, build_model, serving


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("encoders")


def texts(n: int) -> list[str]:
    """`n` texts of many lengths (1 to ~60 tokens, within the tiny encoders' 64)."""
    words = " ".join(CORPUS).split()
    return [" ".join(words[i % 7: i % 7 + 1 + (i * 5) % 22]) for i in range(n)]


def test_kinds_from_folders(root):
    assert detect_kind(build_encoder(root / "bert", "bert")) == ModelKind(EMBED, encoder=True)
    assert detect_kind(build_encoder(root / "ce", "xlm-roberta", classifier=True)).kind == RERANK
    cls = detect_kind(build_encoder(root / "bge", "xlm-roberta", pooling="cls"))
    assert (cls.kind, cls.pooling, cls.normalize) == (EMBED, "cls", True)
    assert detect_kind(build_decoder(root, "embed")) == ModelKind(EMBED, pooling="last")
    assert detect_kind(build_decoder(root, "rerank")).kind == RERANK
    chat = build_model(root / "chat", "qwen3", num_layers=1)
    assert detect_kind(chat).kind == CHAT
    write_pooling(chat, "mean", normalize=False)  # sentence-transformers files: an embedder
    assert detect_kind(chat) == ModelKind(EMBED, pooling="mean", normalize=False)


def test_passes_bucket_by_length_within_the_bounds(monkeypatch):
    monkeypatch.setattr(encoders, "PASS_TOKENS", 64)
    lengths = [3, 40, 17, 1, 16, 33, 2]
    passes = _passes(lengths, max_rows=3)
    assert sorted(i for rows, _ in passes for i in rows) == list(range(len(lengths)))
    for rows, width in passes:
        assert len(rows) <= 3 and len(rows) * width <= 64 or len(rows) == 1
        assert width == max(lengths[i] for i in rows)  # padded to its longest, no more
    assert [rows for rows, _ in passes] == [[3, 6, 0], [4, 2], [5], [1]]  # shortest first


@pytest.mark.parametrize("model_type,pooling", [("bert", "mean"), ("xlm-roberta", "cls")])
def test_batched_encoder_equals_one_at_a_time(root, model_type, pooling, monkeypatch):
    from mlx_embeddings.models.base import normalize_embeddings
    from mlx_embeddings.utils import load_model

    folder = build_encoder(root / f"{model_type}-{pooling}", model_type, pooling=pooling)
    monkeypatch.setattr(encoders, "PASS_TOKENS", 256)  # several passes of several widths
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = [tok(t)["input_ids"] for t in texts(40)]
    got = Encoder(folder).run(ids)
    model = load_model(folder, path_to_repo=str(folder))
    for i, x in enumerate(ids):
        out = model(mx.array([x]))
        want = (out.text_embeds[0] if pooling == "mean"
                else normalize_embeddings(out.last_hidden_state[:, 0])[0])
        np.testing.assert_allclose(got[i], np.array(want), atol=1e-5)


def test_batched_decoder_equals_mlx_lm(root, monkeypatch):
    from mlx_lm.utils import load_model

    monkeypatch.setattr(encoders, "PASS_TOKENS", 256)
    for kind in ("embed", "rerank"):
        folder = build_decoder(root, kind)
        tok = AutoTokenizer.from_pretrained(str(folder))
        ids = [tok(t)["input_ids"] for t in texts(24)]
        enc = Encoder(folder)
        got = enc.run(ids)
        model, _ = load_model(folder)
        yes, no = tok.convert_tokens_to_ids(["yes", "no"])
        for i, x in enumerate(ids):
            if kind == "embed":
                h = model.model(mx.array([x]))[0, -1]
                want = h / mx.linalg.norm(h)
            else:
                logits = model(mx.array([x]))[0, -1]
                want = mx.softmax(mx.stack([logits[yes], logits[no]]))[:1]
            np.testing.assert_allclose(got[i], np.array(want), atol=1e-5)


def test_encoder_refuses_an_input_past_its_positions(root):
    enc = Encoder(build_encoder(root / "limit", "xlm-roberta"))
    assert enc.max_tokens == MAX_POSITIONS
    with pytest.raises(ValueError, match=f"at most {MAX_POSITIONS}"):
        enc.run([[5] * (MAX_POSITIONS + 1)])


def test_gateway_refusals_without_a_node(root):
    folder = build_encoder(root / "gw", "bert")
    manager = serving(folder, "emb", ClusterOptions(nodes=0, os_reserve_bytes=0))
    app = create_app(manager, GatewaySettings(), start_cluster=False)
    card = ask(app, "GET", "/v1/models").json()["data"][0]
    assert card["kind"] == "embed" and card["endpoints"][0] == "/v1/embeddings"
    assert card["context_length"] == MAX_POSITIONS
    shown = ask(app, "POST", "/api/show", json={"model": "emb"})
    assert shown.status_code == 200 and shown.json()["capabilities"] == ["embedding"]
    r = ask(app, "POST", "/v1/chat/completions",
            json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"]
    assert "/v1/embeddings" in r.json()["error"]["message"]
    r = ask(app, "POST", "/api/chat", json={"model": "emb", "messages": []})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]
    r = ask(app, "POST", "/v1/rerank", json={"model": "emb", "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"]
    for body, field in (({"model": "emb", "input": "x", "encoding_format": "int8"},
                         "encoding_format"),
                        ({"model": "emb", "input": "x", "dimensions": 0}, "dimensions"),
                        ({"model": "emb", "input": "x", "truncate": True}, "truncate"),
                        ({"model": "emb", "input": [1, "a"]}, "input")):
        r = ask(app, "POST", "/v1/embeddings", json=body)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_transcription_refusals_without_a_node(root):
    from tests.in_process_gateway import app_for

    app = app_for(build_model(root / "chat-only", "llama", num_layers=1))
    r = ask(app, "POST", "/v1/audio/transcriptions", data={"model": "m"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = ask(app, "POST", "/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")},
            data={"model": "m"})
    assert r.status_code == 400 and "is a chat model" in r.json()["error"]["message"]
    r = ask(app, "POST", "/v1/embeddings", json={"model": "m", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"


def test_a_config_names_the_kind_a_folder_does_not_say(root, tmp_path):
    from omlx_coordinator.models.model_config import ModelConfigError, from_file
    from omlx_coordinator.models.served_model import ServedModel
    from omlx_shared.model_kinds import kind_of

    folder = build_decoder(root, "rerank").rename(root / "renamed")  # its name no longer says
    assert detect_kind(folder).kind == CHAT
    config = tmp_path / "models.toml"
    config.write_text(f'[[model]]\nname = "rr"\npath = "{folder}"\nkind = "rerank"\n')
    served = ServedModel(from_file(config)[0], folder)
    assert served.kind == kind_of(folder, "rerank") == ModelKind(RERANK, pooling="last")
    tok = AutoTokenizer.from_pretrained(str(folder))
    scores = Encoder(folder, served.kind).run([tok("yes")["input_ids"], tok("no")["input_ids"]])
    assert scores.shape == (2, 1) and ((scores > 0) & (scores < 1)).all()
    config.write_text(f'[[model]]\npath = "{folder}"\nkind = "vision"\n')
    with pytest.raises(ModelConfigError, match="kind must be one of"):
        from_file(config)


def test_concurrent_calls_share_forward_passes(root):
    """Encode calls queued together run as one batch through real gRPC: each call's rows equal
    its inputs computed alone, a refused call fails alone, and the model ran fewer passes than
    there were calls."""
    import threading

    import grpc

    from omlx_node.encoder_worker import EncoderService, start_server
    from proto import omlx_pb2 as pb
    from proto import omlx_pb2_grpc as pb_grpc
    from tests.helpers.waiting import wait_for

    folder = build_encoder(root / "batched", "xlm-roberta")
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = [tok(t)["input_ids"] for t in texts(16)]
    calls = [ids[i:i + 1 + i % 2] for i in range(0, 16, 2)]  # calls of one or two inputs
    calls.append([[5] * (MAX_POSITIONS + 1)])  # too long: refused, the others unharmed
    alone = Encoder(folder)
    want = [np.stack([alone.run([x])[0] for x in call]) for call in calls[:-1]]
    encoder = Encoder(folder)
    service = EncoderService(encoder, "emb")
    server, port = start_server(service, "127.0.0.1")
    stub = pb_grpc.ShardWorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    got: dict[int, object] = {}

    def call(i: int) -> None:
        try:
            reply = stub.Encode(pb.EncodeRequest(request_id=str(i), inputs=[
                pb.EncodeInput(tokens=x) for x in calls[i]]), timeout=60)
            got[i] = np.array(reply.values).reshape(len(calls[i]), reply.dim)
        except grpc.RpcError as e:
            got[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    try:
        # Every call queued before the worker takes one: they all find it busy (as calls that
        # arrive during a pass do).
        wait_for(lambda: service.jobs.qsize() == len(calls), 30, "every call queued", 0.01)

        def stop_when_answered() -> None:
            for t in threads:
                t.join(60)
            service.stop()

        threading.Thread(target=stop_when_answered).start()
        service.serve()  # on this thread, as the worker's main thread runs it
    finally:
        server.stop(0)
    for i, rows in enumerate(want):
        np.testing.assert_allclose(got[i], rows, atol=1e-5)
    refused = got[len(calls) - 1]
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_POSITIONS}" in refused.details()
    assert encoder.passes == 1 < len(calls)
