"""OpenAI's POST /v1/audio/transcriptions over the encoding core: a multipart upload (`file`,
`model`, `language`, `prompt`, `response_format`, `temperature`, `timestamp_granularities[]`)
transcribed by a Whisper model's worker with mlx-audio's own functions (omlx_node/transcriber.py).

The file goes to the node as uploaded (at most 25 MB, as OpenAI's): the node decodes it (wav,
mp3, flac, ogg; another format is a 400 saying so). `temperature` left out is Whisper's fallback
over 0.0 to 1.0 (a window that decodes badly is decoded again hotter); given, it is the only one.
`response_format`: json (`text`), text, verbose_json (`language` as the model's code, `duration`,
`segments`, and `words` with the `word` granularity), srt or vtt (a cue per segment).
"""

from __future__ import annotations

import math
import uuid

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.params import Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import account_of, admit
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.request.encoding import transcribe
from omlx_coordinator.request.generation import GatewaySettings, check_servable
from omlx_shared.model_kinds import TRANSCRIBE
from proto import omlx_pb2 as pb

MAX_AUDIO_BYTES = 25 << 20
FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
# The form fields served; OpenAI's others (stream, chunking_strategy, include[]) are refused.
FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature",
          "timestamp_granularities[]"}


def _clock(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def subtitles(reply: pb.TranscribeReply, vtt: bool) -> str:
    """SRT or WebVTT: a numbered cue a segment."""
    cues = []
    for i, s in enumerate(reply.segments, 1):
        span = f"{_clock(s.start, '.' if vtt else ',')} --> {_clock(s.end, '.' if vtt else ',')}"
        cues.append(f"{span}\n{s.text.strip()}\n" if vtt else f"{i}\n{span}\n{s.text.strip()}\n")
    return ("WEBVTT\n\n" if vtt else "") + "\n".join(cues)


def _number(x: float) -> float | None:
    """A statistic as JSON takes it: null where the library has none (a window with no text
    token has no average log-probability: NaN)."""
    return x if math.isfinite(x) else None


def verbose(reply: pb.TranscribeReply, words: bool) -> dict:
    out = {"task": "transcribe", "language": reply.language,
           "duration": round(reply.duration, 3), "text": reply.text,
           "segments": [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end,
                         "text": s.text, "tokens": list(s.tokens),
                         "temperature": s.temperature, "avg_logprob": _number(s.avg_logprob),
                         "compression_ratio": _number(s.compression_ratio),
                         "no_speech_prob": _number(s.no_speech_prob)}
                        for s in reply.segments]}
    if words:
        out["words"] = [{"word": w.word, "start": w.start, "end": w.end}
                        for s in reply.segments for w in s.words]
    return out


def add_routes(app: FastAPI, manager: ModelManager, settings: GatewaySettings,
               keyed: list[Depends]) -> None:
    @app.post("/v1/audio/transcriptions", dependencies=keyed)
    async def transcriptions(
            request: Request, file: UploadFile = File(...), model: str = Form(...),
            language: str | None = Form(None), prompt: str | None = Form(None),
            response_format: str = Form("json"), temperature: float | None = Form(None),
            granularities: list[str] | None = Form(None, alias="timestamp_granularities[]"),
    ) -> Response:
        if unknown := sorted(set((await request.form()).keys()) - FIELDS):
            raise APIError(400, f"{unknown[0]} is not supported here; the fields served: "
                                f"{', '.join(sorted(FIELDS))}", param=unknown[0])
        served = await check_servable(manager, model, account_of(request.scope), TRANSCRIBE)
        if response_format not in FORMATS:
            raise APIError(400, f"response_format {response_format!r}: one of "
                                f"{', '.join(FORMATS)}", param="response_format")
        if temperature is not None and not 0.0 <= temperature <= 1.0:
            raise APIError(400, "temperature must be between 0 and 1", param="temperature")
        wanted = set(granularities or ())
        if bad := wanted - set(GRANULARITIES):
            raise APIError(400, f"timestamp_granularities {sorted(bad)}: each of "
                                f"{', '.join(GRANULARITIES)}", param="timestamp_granularities")
        if wanted and response_format != "verbose_json":
            raise APIError(400, "timestamp_granularities needs response_format verbose_json",
                           param="timestamp_granularities")
        audio = await file.read(MAX_AUDIO_BYTES + 1)
        if len(audio) > MAX_AUDIO_BYTES:
            raise APIError(413, f"the file is larger than {MAX_AUDIO_BYTES >> 20} MB; split it "
                                "or compress it (mp3, ogg)", param="file")
        if not audio:
            raise APIError(400, "the file is empty", param="file")
        admit(request.scope, served)
        reply = await transcribe(manager, served, settings, pb.TranscribeRequest(
            request_id=uuid.uuid4().hex, audio=audio, filename=file.filename or "",
            language=language or "", prompt=prompt or "",
            has_temperature=temperature is not None, temperature=temperature or 0.0,
            word_timestamps="word" in wanted), account_of(request.scope))
        if response_format == "text":
            return PlainTextResponse(reply.text)
        if response_format in ("srt", "vtt"):
            return PlainTextResponse(subtitles(reply, response_format == "vtt"))
        if response_format == "verbose_json":
            return JSONResponse(verbose(reply, "word" in wanted))
        return JSONResponse({"text": reply.text})
