"""Speech to text through a real `serve`: a tiny random Whisper (mlx-audio's classes, a Whisper
tokenizer) beside a chat model; /v1/audio/transcriptions through the official `openai` SDK on a
WAV synthesised here, equal to mlx-audio's own `generate` on the same audio; the other response
formats; and the 400s of a file that is no audio, a bad format and a chat request to Whisper."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import start_server
from tests.tiny_encoders import build_whisper, mlx_audio_transcript, tone_wav
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

TIMEOUT = 180.0


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return build_whisper(tmp_path_factory.mktemp("stt") / "tiny-whisper")


@pytest.fixture(scope="module")
def server(whisper, tmp_path_factory):
    root = tmp_path_factory.mktemp("stt-serve")
    with start_server(build_model(root / "chat", "llama", num_layers=1), "--model",
                      f"whisper={whisper}", home=root / "home") as s:
        yield s


def test_openai_sdk_transcription_equals_mlx_audio(server, whisper):
    from openai import OpenAI

    audio = tone_wav()
    want = mlx_audio_transcript(whisper, audio)
    assert want.text  # the tiny model writes something: an empty match would test little
    client = OpenAI(base_url=server.base_url, api_key="none", timeout=TIMEOUT)
    got = client.audio.transcriptions.create(model="whisper", file=("tone.wav", audio),
                                             language="en", temperature=0.0,
                                             response_format="verbose_json")
    assert got.text == want.text
    assert got.duration == pytest.approx(3.0, abs=0.01)
    assert [(s.start, s.end, s.text) for s in got.segments] == [
        (pytest.approx(s["start"]), pytest.approx(s["end"]), s["text"]) for s in want.segments]
    plain = client.audio.transcriptions.create(model="whisper", file=("tone.wav", audio),
                                               language="en", temperature=0.0)
    assert plain.text == want.text


def test_text_srt_and_vtt(server):
    audio = tone_wav()

    def ask(fmt: str) -> httpx.Response:
        return httpx.post(server.base_url + "/audio/transcriptions", timeout=TIMEOUT,
                          files={"file": ("tone.wav", audio, "audio/wav")},
                          data={"model": "whisper", "language": "en", "temperature": "0",
                                "response_format": fmt})

    text = ask("text")
    verbose = ask("verbose_json").json()
    assert text.status_code == 200 and text.text == verbose["text"]
    n = len(verbose["segments"])
    srt, vtt = ask("srt").text, ask("vtt").text
    assert srt.startswith("1\n00:00:") and srt.count(" --> ") == n
    assert vtt.startswith("WEBVTT\n\n00:00:") and vtt.count(" --> ") == n


def test_bad_audio_format_and_kind_are_400s(server):
    url = server.base_url + "/audio/transcriptions"
    junk = httpx.post(url, timeout=TIMEOUT, files={"file": ("notes.xyz", b"not audio" * 50)},
                      data={"model": "whisper"})
    assert junk.status_code == 400 and "could not decode" in junk.json()["error"]["message"]
    fmt = httpx.post(url, timeout=TIMEOUT, files={"file": ("tone.wav", tone_wav(0.5))},
                     data={"model": "whisper", "response_format": "mp3"})
    assert fmt.status_code == 400 and "response_format" in fmt.json()["error"]["message"]
    streamed = httpx.post(url, timeout=TIMEOUT, files={"file": ("tone.wav", tone_wav(0.5))},
                          data={"model": "whisper", "stream": "true"})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    chat = httpx.post(server.base_url + "/chat/completions", timeout=TIMEOUT, json={
        "model": "whisper", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400
    assert "/v1/audio/transcriptions" in chat.json()["error"]["message"]
    wrong = httpx.post(url, timeout=TIMEOUT, files={"file": ("tone.wav", tone_wav(0.5))},
                       data={"model": server.model_id})
    assert wrong.status_code == 400 and "is a chat model" in wrong.json()["error"]["message"]
