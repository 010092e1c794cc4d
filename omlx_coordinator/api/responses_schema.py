"""The OpenAI Responses API request body (POST /v1/responses), as Codex CLI and the `openai` SDK
send it.

Every top-level field the API defines is declared (the installed SDK's ResponseCreateParams is
the reference; tests/test_responses_api.py fails when it defines one this does not), so a field
no version defines is a 400 naming it, as in openai_schema.py. Decided per field:
- implemented: model, input, instructions, max_output_tokens, temperature, top_p, tools
  (function tools, and namespace tools grouping them), tool_choice, parallel_tool_calls,
  text.format (text, json_object, json_schema), previous_response_id, store, stream.
- accepted without effect on the output: metadata, user, safety_identifier, prompt_cache_key,
  prompt_cache_options, prompt_cache_retention (the prefix cache works on its own),
  service_tier, stream_options, include (no reasoning items or built-in tool results exist
  here), reasoning and text.verbosity (hints: the chat template decides whether the model
  reasons), max_tool_calls (built-in tools only), truncation (a prompt past the context is a
  400 either way), access_programs, image, background false, client_metadata (Codex sends it;
  not in the SDK).
- refused unless null: background true and background_options, conversation, prompt (stored
  prompt templates), moderation, context_management (server-side compaction), top_logprobs and
  the logprobs include.
Input items the model cannot read (images, files, built-in tools' calls) and tools that would
run on OpenAI's servers are refused by the adapter (api/responses.py), which drops `reasoning`
items (a client echoes them back; there is nothing to render).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from omlx_coordinator.api.anthropic_schema import TAG_PREFIX
from omlx_coordinator.api.openai_schema import FunctionDefinition, _Strict

# Fields that would change the output and that nothing here can honour: refused unless null.
_REFUSED = {
    "background_options": "background mode is not supported: send the request and read it",
    "conversation": "the Conversations API is not supported here: send the conversation as "
                    "input, or continue one with previous_response_id",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "moderation": "moderation is not supported",
    "context_management": "server-side compaction is not supported",
}
# Includes that would add output this server does not produce.
_REFUSED_INCLUDES = {"message.output_text.logprobs": "logprobs are not supported on "
                                                     "/v1/responses (use /v1/chat/completions)"}


def _tag(kind: str) -> Tag:
    return Tag(TAG_PREFIX + kind)


def _type(v: Any) -> Any:
    return v.get("type") if isinstance(v, dict) else getattr(v, "type", None)


def _kind(known: tuple[str, ...], default: str | None = None):
    def kind(v: Any) -> str:
        t = _type(v) or default
        return TAG_PREFIX + (t if t in known else "other")
    return kind


class Other(BaseModel):
    """An input item, content part or tool of a type the adapter does not render: it refuses
    or drops it, by type."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None


class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a hint: the cache is automatic


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[Annotated[InputText, _tag("input_text")]
                 | Annotated[OutputText, _tag("output_text")]
                 | Annotated[Refusal, _tag("refusal")] | Annotated[Other, _tag("other")],
                 Discriminator(_kind(("input_text", "output_text", "refusal")))]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    # What the API returns with an item (and a client sends back with it): no effect here.
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Part]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


Item = Annotated[Annotated[MessageItem, _tag("message")]
                 | Annotated[FunctionCallItem, _tag("function_call")]
                 | Annotated[FunctionCallOutputItem, _tag("function_call_output")]
                 | Annotated[Other, _tag("other")],
                 # An item with a role and no type is a message (EasyInputMessage).
                 Discriminator(_kind(("message", "function_call", "function_call_output"),
                                     default="message"))]


class FunctionTool(FunctionDefinition):
    type: Literal["function"]
    # Left out of the prompt (saving its context) while calls of it are still parsed.
    defer_loading: bool = False
    # No effect on the output: who may call it, what it returns, whether it runs async.
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")


NamespaceMember = Annotated[Annotated[FunctionTool, _tag("function")]
                            | Annotated[Other, _tag("other")],
                            Discriminator(_kind(("function",)))]


class NamespaceTool(_Strict):
    """Function tools grouped under a name: the model sees each function by its own name, and
    a call of one comes back with its `namespace`."""

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str = ""
    tools: list[NamespaceMember]


ToolDef = Annotated[Annotated[FunctionTool, _tag("function")]
                    | Annotated[NamespaceTool, _tag("namespace")]
                    | Annotated[Other, _tag("other")],
                    Discriminator(_kind(("function", "namespace")))]


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


# Other choices (allowed_tools, built-in tool types...) are refused by the adapter, by type.
ToolChoice = Annotated[Annotated[NamedFunction, _tag("function")] | Annotated[Other, _tag("other")],
                       Discriminator(_kind(("function",)))]


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # enforced either way: the engine constrains fully

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs its name and schema")
        if self.type != "json_schema" and (self.name or self.schema_ is not None):
            raise ValueError("name and schema belong to the json_schema format only")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: no effect here


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # nothing to obfuscate here


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # accepted without effect (see the module docstring)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    truncation: Literal["auto", "disabled"] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    background: bool | None = None
    # refused unless null
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None
    context_management: Any = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator(*_REFUSED)
    @classmethod
    def _refused(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and v != []:
            raise ValueError(_REFUSED[info.field_name])
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("background mode is not supported: send the request and read it")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError(_REFUSED_INCLUDES["message.output_text.logprobs"])
        return v

    @field_validator("include")
    @classmethod
    def _includes(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if name in _REFUSED_INCLUDES:
                raise ValueError(_REFUSED_INCLUDES[name])
        return v

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: str | list) -> str | list:
        if not v:
            raise ValueError("the input is empty: send a string or a list of items")
        return v
