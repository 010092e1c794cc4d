"""Embedding and Whisper models whose folders only the coordinator holds, served by a node that
joined over the network (real processes on loopback): the node receives the model's files
(the pooling config of sentence-transformers' module folder included) and answers as the
libraries do on the coordinator's copy."""

from __future__ import annotations

import httpx
import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import free_port
from tests.helpers.processes import launch, status, stop_all
from tests.helpers.waiting import wait_for
from tests.tiny_encoders import (
    build_encoder,
    build_whisper,
    mlx_audio_transcript,
    mlx_embeddings_reference,
    tone_wav,
)

pytestmark = pytest.mark.slow

TIMEOUT = 180.0
TEXTS = ["The capital of France is Paris.", "hello there"]


def test_a_joined_node_serves_models_only_the_coordinator_holds(tmp_path):
    models = tmp_path / "coordinator-models"
    # cls pooling is said only in 1_Pooling/config.json: a node without it would mean-pool.
    emb = build_encoder(models / "emb", "xlm-roberta", pooling="cls")
    whisper = build_whisper(models / "whisper")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [launch(["coordinator", "--port", str(port), "--no-discovery", "--os-reserve",
                     "1GiB", "--model", f"emb={emb}", "--model", f"whisper={whisper}"],
                    tmp_path / "home-coordinator", tmp_path / "coordinator.log"),
             launch(["join", "--name", "a", "--port", str(free_port()), "--no-announce",
                     "--coordinator", f"127.0.0.1:{port}", "--speed", "1"],
                    tmp_path / "home-a", tmp_path / "a.log")]
    try:
        wait_for(lambda: status(url).get("nodes"), 120, "node a to join")
        r = httpx.post(f"{url}/v1/embeddings", timeout=TIMEOUT,
                       json={"model": "emb", "input": TEXTS})
        assert r.status_code == 200, r.text
        for d, text in zip(r.json()["data"], TEXTS):
            np.testing.assert_allclose(d["embedding"], mlx_embeddings_reference(emb, text, "cls"),
                                       atol=1e-5)
        audio = tone_wav()
        r = httpx.post(f"{url}/v1/audio/transcriptions", timeout=TIMEOUT,
                       files={"file": ("tone.wav", audio, "audio/wav")},
                       data={"model": "whisper", "language": "en", "temperature": "0"})
        assert r.status_code == 200, r.text
        want = mlx_audio_transcript(whisper, audio).text
        assert want and r.json()["text"] == want
    finally:
        stop_all(procs)
    received = {p.name.split("@")[0]: p for p in (tmp_path / "home-a" / "models").iterdir()}
    assert set(received) == {"emb", "whisper"}  # what the node loaded, it received
    pooling = received["emb"] / "1_Pooling" / "config.json"
    assert pooling.read_bytes() == (emb / "1_Pooling" / "config.json").read_bytes()
    for name, source in (("emb", emb), ("whisper", whisper)):  # every tensor, as it is
        got, sent = (mx.load(str(f / "model.safetensors")) for f in (received[name], source))
        assert got.keys() == sent.keys()
        assert all(mx.array_equal(got[k], sent[k]).item() for k in got)
