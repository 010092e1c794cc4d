"""Speech to text: mlx-audio's Whisper, loaded and run with the library's own functions.

The uploaded file is decoded by mlx-audio's reader (miniaudio: wav, mp3, flac, ogg, ...) to
16 kHz mono, then `Model.generate` transcribes it as `mlx_audio.stt` does: 30-second windows,
each conditioned on the text before it, timestamps per segment (and per word when asked).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_RATE = 16000  # Whisper's


@dataclass
class Transcript:
    text: str
    language: str
    duration: float  # seconds of audio
    segments: list[dict] = field(default_factory=list)  # mlx-audio's segment dicts


def decode_audio(data: bytes, filename: str = ""):
    """The file's samples at 16 kHz mono, float32; ValueError when it is no audio the reader
    knows."""
    from mlx_audio.audio_io import read

    try:
        samples, _ = read(io.BytesIO(data), dtype="float32", sample_rate=SAMPLE_RATE,
                          nchannels=1)
    except Exception as e:  # the reader's own errors differ by format and decoder
        raise ValueError(f"could not decode {filename or 'the file'} as audio ({e}); send "
                         "wav, mp3, flac or ogg") from None
    return samples.reshape(-1)


class Transcriber:
    def __init__(self, path: Path):
        from mlx_audio.stt.utils import load_model

        self.model = load_model(str(path))

    def run(self, audio: bytes, filename: str = "", language: str = "", prompt: str = "",
            temperature: float | None = None, word_timestamps: bool = False) -> Transcript:
        import mlx.core as mx

        samples = decode_audio(audio, filename)
        if samples.size == 0:
            raise ValueError(f"{filename or 'the file'} holds no audio samples")
        options = {} if temperature is None else {"temperature": temperature}
        out = self.model.generate(mx.array(samples), language=language or None,
                                  initial_prompt=prompt or None,
                                  word_timestamps=word_timestamps, **options)
        return Transcript(out.text, out.language or language, samples.size / SAMPLE_RATE,
                          list(out.segments or []))
