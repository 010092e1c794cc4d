"""The Ollama API request bodies (/api/chat, /api/generate, /api/show), as Ollama's clients (the
`ollama` Python SDK, Open WebUI, Continue, Raycast, scripts) send them.

Every field Ollama's API defines is declared (the installed `ollama` SDK's `ollama._types` is the
reference, with the few Ollama's server reads besides: `tool_call_id`, a tool call's `id` and
`index`, `min_p`, ShowRequest's `verbose`; tests/test_ollama_api.py fails when the SDK defines one
this does not), and a field no version defines is a 400 naming it, as in openai_schema.py: Ollama
itself ignores unknown options with a warning in its log, where a typo goes unnoticed. Decided
per field:
- implemented: model, messages (role, content, tool_calls with arguments as an object,
  tool_name, tool_call_id, thinking), prompt, system, raw, context (token ids of an earlier
  generate, put before this prompt), stream (true unless false, as Ollama), format ("json" or a
  JSON Schema: grammar-constrained), tools, keep_alive (api/ollama.py), logprobs, top_logprobs;
  options temperature, top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty,
  presence_penalty, frequency_penalty.
- accepted without effect: think (a model's reasoning, where its template writes any, arrives
  as content), options that set up a llama.cpp runner (num_ctx: the context is the model's
  own; num_batch, num_gpu, main_gpu, low_vram, f16_kv, logits_all, vocab_only, use_mmap,
  use_mlock, numa, num_thread, embedding_only), num_keep (a prompt past the context is a 400
  here, never cut), penalize_newline (Ollama dropped it too), mirostat_tau and mirostat_eta
  (used only with mirostat).
- refused unless neutral: images (the models served here read text), template (each model's
  own chat template renders the prompt), suffix (fill-in-the-middle), width, height and steps
  (image generation), mirostat (0), tfs_z and typical_p (1), repeat_last_n other than 20 while
  a penalty is on (the penalties look at the last 20 tokens here, mlx-lm's window).
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, \
    model_validator

from omlx_coordinator.api.openai_schema import (
    MAX_CHAT_TOP_LOGPROBS,
    Tool as OpenAITool,
    _Strict,
    check_stops,
)

# The window mlx-lm's repetition, presence and frequency penalties look back over (the node's
# PENALTY_CONTEXT): the one repeat_last_n that means what it says here.
PENALTY_WINDOW = 20
# Ollama's own defaults for what a request leaves out (its api.DefaultOptions).
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.9

# Options that would change the output and that nothing here can honour: their neutral value.
_NEUTRAL_OPTIONS: dict[str, Any] = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
_REFUSED_OPTIONS = {
    "mirostat": "Mirostat sampling is not supported: use temperature, top_k, top_p or min_p",
    "tfs_z": "tail-free sampling is not supported: use top_p or min_p",
    "typical_p": "locally typical sampling is not supported: use top_p or min_p",
}
_REFUSED = {
    "images": "images are not supported: the models served here read text only",
    "template": "a prompt template of the request's own is not supported: each model's chat "
                "template renders the prompt (send raw: true with a prompt you formatted)",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "width": "image generation is not supported",
    "height": "image generation is not supported",
    "steps": "image generation is not supported",
}


def _refuse(field: str, value: Any) -> Any:
    if value not in (None, "", []):
        raise ValueError(_REFUSED[field])
    return value


class Options(_Strict):
    # runtime options
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # negative: random
    # -1: until the context is full, as -2 (Ollama's "fill the context"); 0 and up: that many.
    num_predict: int | None = Field(default=None, ge=-2)
    stop: list[str] | None = None
    repeat_penalty: float | None = Field(default=None, ge=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    # accepted without effect (the module docstring says why)
    num_keep: int | None = None
    penalize_newline: bool | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    numa: bool | None = None
    num_ctx: int | None = Field(default=None, ge=0)
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    # refused unless neutral
    mirostat: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None

    @field_validator("mirostat", "tfs_z", "typical_p")
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v != _NEUTRAL_OPTIONS[info.field_name]:
            raise ValueError(_REFUSED_OPTIONS[info.field_name])
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else check_stops(v)

    @model_validator(mode="after")
    def _window(self) -> Options:
        penalized = (self.repeat_penalty not in (None, 0.0, 1.0) or self.presence_penalty
                     or self.frequency_penalty)
        if penalized and self.repeat_last_n not in (None, PENALTY_WINDOW):
            raise ValueError(f"repeat_last_n {self.repeat_last_n}: the penalties look at the "
                             f"last {PENALTY_WINDOW} tokens here (mlx-lm's window); send "
                             f"repeat_last_n {PENALTY_WINDOW} or leave it out")
        return self

    @field_validator("num_predict")
    @classmethod
    def _some(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("num_predict must be at least 1, or -1 for as many tokens as the "
                             "context holds")
        return v


class ToolCallFunction(_Strict):
    name: str
    arguments: dict[str, Any] = {}
    index: int | None = None  # Ollama's server numbers the calls of one message


class ToolCall(_Strict):
    id: str | None = None
    function: ToolCallFunction


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # assistant: goes to the chat template as reasoning_content
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # tool: the tool that answered
    tool_call_id: str | None = None  # tool: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _null_is_empty(cls, v: Any) -> Any:
        return "" if v is None else v

    @field_validator("images")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    @model_validator(mode="after")
    def _by_role(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} ones")
        return self


class Tool(OpenAITool):
    type: Literal["function"] = "function"


Format = Literal["", "json"] | dict[str, Any]


class _Generation(_Strict):
    """What /api/chat and /api/generate share."""

    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: Format | None = None
    options: Options | None = None
    keep_alive: float | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @field_validator("stream", "logprobs", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v: float | str | None) -> float | str | None:
        if v is not None:
            keep_alive_seconds(v)  # refused here, where the error names the field
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def opts(self) -> Options:
        return self.options or Options()


class ChatRequest(_Generation):
    messages: list[Message] = []
    tools: list[Tool] | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"two tools are named {dup[0]!r}")
        return v


class GenerateRequest(_Generation):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None
    template: str | None = None
    suffix: str | None = None
    images: list[str] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None

    @field_validator("prompt", "raw", mode="before")
    @classmethod
    def _null_is_empty(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("template", "suffix", "images", "width", "height", "steps")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)


class ShowRequest(_Strict):
    model: str | None = None
    name: str | None = None  # Ollama's older name for `model`
    verbose: bool | None = None  # model_info is the same either way
    # Ollama's server takes these to show a model as they would change it: nothing to change.
    system: str | None = None
    template: str | None = None
    options: dict[str, Any] | None = None


M = TypeVar("M", bound=BaseModel)


def validated(cls: type[M], raw: object) -> M:
    """`raw` (a body parsed whatever its content type: Ollama's clients and curl examples send
    JSON without saying so) as `cls`; what is wrong with it is the gateway's 400."""
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


# Go's time.ParseDuration units, which Ollama's keep_alive strings use ("5m", "1h30m", "300ms").
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def keep_alive_seconds(value: float | str) -> float:
    """A keep_alive as seconds: a number is seconds, a string a Go duration ("5m", "1h30m") or a
    number of seconds; negative is forever (math.inf). Raises ValueError saying what it takes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration: send seconds (300), "
                                 "a duration such as \"5m\" or \"1h30m\", 0 to unload after "
                                 "the request, or -1 to keep the model loaded") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number of seconds or a duration")
    return math.inf if seconds < 0 else seconds
