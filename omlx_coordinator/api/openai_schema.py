"""The OpenAI request bodies the gateway accepts: nothing a client sends is silently ignored.

Strict, unlike servers that drop what they do not know (mlx_lm.server, older vLLM): a field
that is not part of the API below, at any level of the body, is a 400 naming it, so a typo or
a feature we lack is never mistaken for a setting that took effect. The official `openai` SDK
sends only the fields its caller passed, so its requests pass. An optional field sent as
`null` is the same as one left out.

Chat completions, decided per field:
- implemented: model, messages, max_tokens, max_completion_tokens, temperature, top_p, n (1-8),
  stream, stream_options (include_usage; with stream only), stop, seed, presence_penalty,
  frequency_penalty, logprobs, top_logprobs (0-20), tools, tool_choice, parallel_tool_calls,
  response_format
  (text, json_object, json_schema), prediction (type "content", a string or text parts: drafts
  for speculative decoding, docs/speculative.md); extensions as in vLLM and mlx-lm: top_k, min_p,
  repetition_penalty, ignore_eos.
- accepted as metadata, without effect on the output: user, metadata, store, service_tier,
  safety_identifier, prompt_cache_key, prompt_cache_retention, prompt_cache_options,
  stream_options.include_obfuscation, content parts' prompt_cache_breakpoint (the prefix cache
  works on its own); in messages, `name` goes to the chat template.
- refused unless null (or their neutral value): audio, modalities (["text"]), function_call and
  functions (the deprecated API: use tools), logit_bias ({}), reasoning_effort,
  verbosity, web_search_options, moderation; in messages: audio, function_call, refusal;
  content parts other than text; tool types other than "function".

Completions: model, prompt (one), max_tokens, temperature, top_p, n, stream, stream_options,
stop, seed, echo, presence_penalty, frequency_penalty, logprobs (0-5) and the extensions; user
is metadata; best_of (1), logit_bias ({}) and suffix ("") are refused otherwise.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from omlx_coordinator.api.common import check_unicode
from omlx_coordinator.errors import APIError

MAX_STOP_STRINGS = 16
# Characters in one stop string: the gateway holds back up to that much of a stream and checks
# it at every token, on the loop every stream shares.
MAX_STOP_CHARS = 1024
MAX_CHOICES = 8  # n: each choice is a sequence of its own on the node
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5

# Fields of the API that this server does not implement: refused unless null or neutral.
_REFUSED = {
    "audio": "audio output is not supported (text only)",
    "modalities": "only the 'text' modality is supported",
    "function_call": "the deprecated function-calling API is not supported: use tools and "
                     "tool_choice",
    "functions": "the deprecated function-calling API is not supported: use tools and "
                 "tool_choice",
    "logit_bias": "logit_bias is not supported",
    "reasoning_effort": "reasoning_effort is not supported: the chat template decides whether "
                        "the model reasons",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "best_of": "best_of above 1 is not supported (n gives several completions)",
    "suffix": "suffix (text insertion) is not supported",
    "refusal": "assistant refusals cannot be sent back to the model: send them as content",
}
_NEUTRAL: dict[str, Any] = {"modalities": ["text"], "logit_bias": {}, "best_of": 1, "suffix": ""}


def check_stops(stops: list[str]) -> list[str]:
    """Stop strings within the bounds above (Ollama's options.stop too)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    if longest := max((len(s) for s in stops if len(s) > MAX_STOP_CHARS), default=0):
        raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters; "
                         f"one has {longest}")
    return stops


def _refuse(field: str, value: Any) -> Any:
    if value is not None and value != _NEUTRAL.get(field, None):
        raise ValueError(_REFUSED[field])
    return value


class _Strict(BaseModel):
    # Unknown fields are refused, and so are values of the wrong JSON type ("stream": "yes",
    # "max_tokens": true): no coercion (an integer still passes where a number is wanted).
    # NaN and infinities (Python's JSON reads them) are no number a sampler can use.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # metadata: nothing to obfuscate here


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=2**31 - 1)  # extension (vLLM, mlx-lm); int32
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension
    seed: int | None = Field(default=None, ge=0, lt=2**63 - MAX_CHOICES)  # choice i: seed + i
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # extension (mlx-lm, vLLM)
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens, for benchmarks
    user: str | None = None  # metadata
    logit_bias: dict[str, float] | None = None

    @field_validator("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "n", "stream", "ignore_eos",
                     "logprobs", "parallel_tool_calls", "echo", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        # Some clients send null for "the default"; pydantic would call that a wrong type.
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        return check_stops([v] if isinstance(v, str) else list(v or []))

    @field_validator("logit_bias")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI and vLLM: options for a stream the request does not ask for do nothing.
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---- chat messages ---------------------------------------------------------------------------


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # the chat template's business
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # What reasoning models (and the clients that echo their replies back) call their thinking:
    # the chat template decides what to render of it (Qwen 3's drops it from earlier turns).
    reasoning_content: str | None = None  # assistant
    audio: Any = None
    function_call: Any = None
    refusal: Any = None

    @field_validator("audio", "function_call", "refusal")
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} ones")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only tool messages carry a tool_call_id, not {self.role} ones")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant "
                             "message with tool_calls)")
        return self

    def for_template(self, index: int) -> dict:
        """The message as chat templates take it: text parts joined into a string, null
        content as "" and tool-call arguments as objects (HF templates render them with
        `tojson`), as mlx_lm.server does."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": _text(self.content, f"messages.{index}.content")}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments,
                                                      f"messages.{index}.tool_calls.{j}"
                                                      ".function.arguments")}}
                for j, c in enumerate(self.tool_calls)]
        return msg


_TEXT_PART_KEYS = {"type", "text", "prompt_cache_breakpoint"}


def _text(content: str | list[dict[str, Any]] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"unsupported content part {part.get('type')!r}: only text "
                                "parts are supported", param="messages")
        if extra := sorted(set(part) - _TEXT_PART_KEYS):
            raise APIError(400, f"'{param}.{j}': unknown field {extra[0]!r} in a text part",
                           param=f"{param}.{j}.{extra[0]}")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(text: str, param: str) -> dict:
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"'{param}' is not valid JSON ({e}): a tool call's arguments are "
                            "the JSON text of an object", param=param) from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"'{param}' must be the JSON text of an object", param=param)
    check_unicode(arguments, param)  # its escapes are read only now
    return arguments


# ---- tools and formats -----------------------------------------------------------------------


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: auto calls follow the schema too (forced ones always)

    @model_validator(mode="after")
    def _object_schema(self) -> FunctionDefinition:
        p = self.parameters
        if p is None:
            return self
        problem = None
        if p.get("type", "object") != "object":
            problem = f"must be a JSON Schema of type 'object', not {p.get('type')!r}"
        elif not isinstance(p.get("properties", {}), dict):
            problem = "has 'properties' that is not an object"
        elif not (isinstance(p.get("required", []), list)
                  and all(isinstance(r, str) for r in p.get("required", []))):
            problem = "has 'required' that is not a list of property names"
        if problem:
            raise ValueError(f"the parameters of tool {self.name!r} {problem}")
        return self


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON
    strict: bool | None = None  # enforced either way: the engine constrains fully


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only there")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Prediction(_Strict):
    """OpenAI's predicted output: text the answer is expected to repeat (a file being edited)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return (self.content if isinstance(self.content, str)
                else "".join(p.text for p in self.content))


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    # metadata
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # refused
    audio: Any = None
    modalities: list[str] | None = None
    function_call: Any = None
    functions: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None

    @field_validator("audio", "modalities", "function_call", "functions", "reasoning_effort",
                     "verbosity", "web_search_options", "moderation")
    @classmethod
    def _refused_chat(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    # Field validators, not a model validator: an error then names its field (param).
    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or []]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"two tools are named {dup[0]!r}")
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_dicts(self) -> list[dict] | None:
        """The tools as chat templates and mlx-lm's parsers take them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (see forced_tool)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def template_messages(self) -> list[dict]:
        """The messages for the chat template; a tool message must answer an earlier call."""
        ids: set[str] = set()
        out = []
        for i, m in enumerate(self.messages):
            if m.tool_call_id is not None and m.tool_call_id not in ids:
                raise APIError(400, f"messages.{i} answers tool_call_id {m.tool_call_id!r}, "
                                    "which no earlier assistant message's tool_calls has",
                               param=f"messages.{i}.tool_call_id")
            ids.update(c.id for c in m.tool_calls or [])
            out.append(m.for_template(i))
        return out


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of", "suffix")
    @classmethod
    def _refused_completion(cls, v: Any, info: ValidationInfo) -> Any:
        return _refuse(info.field_name, v)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported (n gives several "
                                 "completions of it)")
            return v[0]
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("echo"):
            raise ValueError("echo with logprobs is not supported: the prompt's tokens have no "
                             "log-probabilities here")
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens
