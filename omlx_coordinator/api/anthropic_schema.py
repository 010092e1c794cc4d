"""The Anthropic Messages API request bodies the gateway accepts (POST /v1/messages and
/v1/messages/count_tokens), as Claude Code and the `anthropic` SDK send them.

Every field Anthropic's API defines (the `anthropic` SDK's request types, beta ones included,
and the sampling fields older versions define) is accepted; tests/test_anthropic_fields.py
walks the installed SDK's types and fails on one this file does not know. A field no version
defines is refused (a 400 naming it), as Anthropic's own API does. What a defined field means
here is one of three, said where it is declared:
- honoured (tools and `defer_loading`, `strict`, `output_config.format`, tool references...);
- a hint with nothing to act on here, accepted without effect (`thinking`, effort, `speed`...);
- a server-side feature we cannot provide (MCP connectors, containers, compaction, threads):
  accepted by the parser, refused with a 400 by the adapter when given a value, since
  answering without it would change the answer without the client knowing.
Hint values are taken as any string, so a new value of a hint is never a 400. Content blocks
we do not render are parsed as `OtherBlock`; the adapter (api/anthropic.py) decides whether one
is refused (images, documents) or dropped (thinking).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from omlx_coordinator.api.openai_schema import MAX_STOP_CHARS, MAX_STOP_STRINGS

# Starts the tags of the discriminated unions below; error messages leave them out of the field
# path (gateway.py), so a missing tool_use id reads 'messages.0.content.1.id'.
TAG_PREFIX = "kind="


def _tag(kind: str) -> Tag:
    return Tag(TAG_PREFIX + kind)


class _Strict(BaseModel):
    # Unknown fields are refused, and so are values of the wrong JSON type ("stream": "yes",
    # "max_tokens": true): no coercion (an integer still passes where a number is wanted).
    # NaN and infinities (Python's JSON reads them) are no number a sampler can use.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CacheControl(_Strict):
    """Accepted on any block: the prefix cache here is automatic, so breakpoints are hints."""

    type: Literal["ephemeral"]
    ttl: str | None = None  # how long Anthropic would keep it: a hint here too


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # Where an earlier reply's text came from (the SDK sends back `"citations": null` with
    # every text block it got): the model reads the text itself, so they are not rendered.
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # Who made the call (the model directly, or code a server tool ran) and the MCP toolset a
    # tool came from: the call itself reads the same to the model.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolReferenceBlock(_Strict):
    """A tool result's pointer to a deferred tool (tool search): it loads that tool, so the
    adapter renders the tool's definition in its place."""

    type: Literal["tool_reference"]
    tool_name: str = Field(min_length=1)
    cache_control: CacheControl | None = None


class ToolChangeBlock(_Strict):
    """A system message's tool addition or removal (mid-conversation tool changes): the
    adapter renders the tool's definition, or that it is gone, at that point of the
    conversation, so the prompt before it (and its cached prefix) stays the same."""

    type: Literal["tool_addition", "tool_removal"]
    # {"type": "tool_reference", "tool_name"}, {"type": "tool_definition", "definition"} or an
    # MCP reference (refused: no MCP servers here).
    tool: dict[str, Any]
    cache_control: CacheControl | None = None


class OtherBlock(BaseModel):
    """A block type we do not render (image, document, thinking, server_tool_use...)."""

    model_config = ConfigDict(extra="allow")
    type: str


def _type(v: Any) -> Any:
    return v.get("type") if isinstance(v, dict) else getattr(v, "type", None)


def _block_kind(known: tuple[str, ...]) -> Callable[[Any], str]:
    def kind(v: Any) -> str:
        t = _type(v)
        return TAG_PREFIX + (t if t in known else "other")
    return kind


ResultPart = Annotated[Annotated[TextBlock, _tag("text")]
                       | Annotated[ToolReferenceBlock, _tag("tool_reference")]
                       | Annotated[OtherBlock, _tag("other")],
                       Discriminator(_block_kind(("text", "tool_reference")))]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ResultPart] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: str | None = None  # the MCP toolset of the tool: nothing to act on


Block = Annotated[Annotated[TextBlock, _tag("text")] | Annotated[ToolUseBlock, _tag("tool_use")]
                  | Annotated[ToolResultBlock, _tag("tool_result")]
                  | Annotated[ToolChangeBlock, _tag("tool_addition")]
                  | Annotated[ToolChangeBlock, _tag("tool_removal")]
                  | Annotated[OtherBlock, _tag("other")],
                  Discriminator(_block_kind(("text", "tool_use", "tool_result", "tool_addition",
                                             "tool_removal")))]


class SystemOutputConfig(_Strict):
    effort: str | None = None  # a hint for reasoning models: nothing to apply here


class Message(_Strict):
    # "system" mid-conversation: Claude Code's mid-conversation-system beta sends one.
    role: Literal["user", "assistant", "system"]
    content: list[Block]
    # A system message's own settings: when Anthropic's server may drop it from the context
    # (the client re-sends what it wants kept; here nothing is dropped), and an effort hint.
    clear_at: str | None = None
    output_config: SystemOutputConfig | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_text_block(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content blocks")
        return v


class Tool(_Strict):
    """A client tool. Server tools (a `type` such as web_search_20250305) parse as ServerTool
    and are refused by the adapter: they run on Anthropic's servers, and dropping one would
    answer without the tool ever running."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    # Left out of the prompt (what deferring is for: it saves the context) until a tool
    # reference or a tool addition in the conversation loads it; its calls are still parsed.
    defer_loading: bool = False
    # Arguments that follow input_schema, by grammar-constrained sampling (as OpenAI's strict).
    strict: bool | None = None
    # Without effect here: arguments stream as they are generated whatever this says; only
    # the model calls tools (no code execution caller); examples are the client's hint.
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None
    input_examples: list[dict[str, Any]] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        # The shape the chat templates and the grammar builder rely on; the grammar compiler
        # checks the rest when a tool is forced.
        if v.get("type") != "object":
            raise ValueError("must be a JSON schema with \"type\": \"object\"")
        props = v.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ValueError("'properties' must map each property name to a JSON schema object")
        required = v.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("'required' must be a list of property names")
        return v


class ServerTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


def _tool_kind(v: Any) -> str:
    return TAG_PREFIX + ("custom" if _type(v) in (None, "custom") else "server")


ToolDef = Annotated[Annotated[Tool, _tag("custom")] | Annotated[ServerTool, _tag("server")],
                    Discriminator(_tool_kind)]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    # One tool call at most: generation stops after the first (api/anthropic.py).
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is given with type 'tool', and only then")
        return self


class Thinking(_Strict):
    """Accepted without effect: the model's own reasoning, if it writes any, arrives as text; no
    thinking blocks are produced, so how they would be shown (`display`) or bound to the
    prompt (`block_binding`) has nothing to act on."""

    type: str
    budget_tokens: int | None = Field(default=None, ge=1)
    display: str | None = None
    block_binding: dict[str, Any] | None = None


class ContextEdit(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ContextManagement(_Strict):
    """Claude Code sends `clear_thinking_*` edits: a no-op here, where no thinking blocks exist;
    other edits (clearing tool results) would need the server to rewrite the conversation and
    are refused by the adapter."""

    edits: list[ContextEdit] = []


class OutputFormat(_Strict):
    """Structured output: the reply is JSON that follows `schema`, by grammar-constrained
    sampling (as OpenAI's response_format)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    # Claude Code sends an effort level and agents a task budget: hints for Anthropic's
    # models, nothing to apply here.
    effort: str | None = None
    task_budget: dict[str, Any] | None = None
    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: str | None = None


class PromptBody(_Strict):
    """What is templated into the prompt: shared by /v1/messages and count_tokens."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    # The first structured-outputs beta's place for output_config.format.
    output_format: OutputFormat | None = None
    cache_control: CacheControl | None = None  # the whole prompt's breakpoint: a hint too
    # Without effect here: one speed, one place, no billing, no model that declines (so no
    # fallback is ever tried), nothing to diagnose against an earlier message.
    speed: str | None = None
    inference_geo: str | None = None
    billing_policy: dict[str, Any] | None = None
    fallback_credit_token: str | dict[str, Any] | None = None
    fallbacks: list[dict[str, Any]] | None = None
    diagnostics: dict[str, Any] | None = None
    # Anthropic's servers' own features: refused when given a value (api/anthropic.py).
    mcp_servers: list[dict[str, Any]] | None = None
    container: str | dict[str, Any] | None = None
    compaction: dict[str, Any] | None = None
    thread: dict[str, Any] | None = None


class MessagesRequest(PromptBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] = Field(
        default=[], max_length=MAX_STOP_STRINGS)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=2**31 - 1)
    stream: bool = False
    metadata: Metadata | None = None  # accepted: nothing here is per user
    service_tier: str | None = None  # accepted: one tier here
