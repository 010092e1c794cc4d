"""How a request's tools, tool choice and reply format become what its generation needs: the
tools the chat template shows, the markup to parse calls in, and the grammar (constraints.py)
that forces calls or a JSON reply. Shared by the OpenAI chat and Responses adapters, whose
fields say the same things in different places (the `param` arguments name them in errors).

Tool modes: "none" shows the model no tools and parses nothing; "auto" parses whatever calls it
writes (constrained only for strict tools or a reply format); "required" forces one or more
calls (one with parallel calls off), "named" exactly one call of the named function.
"""

from __future__ import annotations

from dataclasses import dataclass

from omlx_coordinator.errors import APIError
from omlx_coordinator.text import constraints
from omlx_coordinator.text.tokenizer import ChatTokenizer
from omlx_coordinator.text.tool_calls import ToolCallFormat

Schema = dict | bool


@dataclass(frozen=True)
class ToolSetup:
    template_tools: list[dict] | None  # what the chat template renders (None: no tools)
    fmt: ToolCallFormat | None  # parse the output's calls in this markup (None: text only)
    tools: list[dict] | None  # what the parser resolves calls against
    single_call: bool  # parallel calls off: the first call ends the output
    grammar: str  # "" for unconstrained output


def _reply_grammar(schema: Schema | None, param: str, what: str | None = None) -> str:
    """The grammar of a JSON reply following `schema`, checked ("" for free text, None)."""
    if schema is None:
        return ""
    grammar = constraints.grammar_for_json_schema(schema, param)
    constraints.validate(grammar, param, what)
    return grammar


def setup_tools(tok: ChatTokenizer, tools: list[dict] | None, mode: str, name: str | None,
                parallel: bool, reply: Schema | None, reply_param: str,
                reply_what: str | None = None,
                schema_param: str = "tools.{i}.function.parameters") -> ToolSetup:
    """`tools` in OpenAI chat's shape ({"type": "function", "function": {...}}); `reply` the
    JSON Schema a reply without calls follows (None: free text), `reply_param` where it is in
    the request (and `reply_what` what to call it); `schema_param` names tool i's parameters."""
    if mode in ("required", "named") and not tools:
        raise APIError(400, f"tool_choice {mode!r} needs tools", param="tool_choice")
    fmt = tok.tool_call_format
    parsing = bool(tools) and mode != "none"
    if parsing and fmt is None:
        raise APIError(400, "this model cannot call tools: its chat template shows no "
                            "tool-call format mlx-lm knows", param="tools")

    def made(grammar: str) -> ToolSetup:
        return ToolSetup(tools if parsing else None, fmt if parsing else None,
                         tools if parsing else None, parsing and not parallel, grammar)

    if mode in ("required", "named"):
        assert fmt is not None and tools
        # A named function is called once; "required" may call several when parallel.
        grammar = constraints.grammar_for_tool_call(
            fmt, tools, name, parallel=mode == "required" and parallel, schema_param=schema_param)
        constraints.validate(grammar, "tool_choice")
        return made(grammar)
    reply_rule = _reply_grammar(reply, reply_param, reply_what)
    if mode == "auto" and parsing and (
            reply is not None or any(t["function"].get("strict") for t in tools or [])):
        assert fmt is not None and tools
        # The model may call a tool or reply: the calls' arguments follow their schemas (strict
        # tools), and a reply that calls none follows the reply format.
        grammar = constraints.grammar_for_tools_or_reply(fmt, tools, parallel, reply)
        constraints.validate(grammar, "tools")
        return made(grammar)
    return made(reply_rule)
