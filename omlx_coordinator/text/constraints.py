"""The llguidance grammars a request's output must follow (GenerationRequest.grammar), built
with llguidance's own compilers and checked here, at the gateway, so a schema the node's engine
cannot compile is a 400 that says which part, never a failed generation.

- `grammar_for_json_schema(schema, param)`: JSON that follows `schema` (OpenAI's `json_object` format
  is {"type": "object"}; `json_schema` formats' `strict: false` is enforced all the same: the
  engine can only constrain fully).
  JSON is laid out as json.dumps writes it (see _JSON_LAYOUT).
- `grammar_for_tool_call(fmt, tools, name)`: the model's own tool-call markup, `fmt.start` +
  the call JSON its family's parser reads + `fmt.end`, with the arguments constrained by the
  tool's `parameters` schema (tool_choice `required` or a named function). Only families whose
  call is a JSON object between plain-text markers can be forced: mlx-lm's `json_tools`
  (Qwen 2.5/3, Hermes and the like: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`). Every other family is a 400 naming it: qwen3_coder, glm47, minimax_m2,
  minicpm5, longcat, muse_spark, kimi_k3 write XML-like parameters, pythonic and gemma4 /
  function_gemma call syntax, and mistral and kimi_k2 open their calls with a special token
  that a text grammar does not produce.
- `grammar_for_tools_or_reply(fmt, tools, parallel, reply)`: tool_choice `auto` with the
  calls' arguments constrained (OpenAI's `strict` tools): free text and then calls, or a JSON
  reply following `response_format` instead of calls. Same families as above.
- `validate(grammar, param)`: compiles a grammar as the engine will (without its vocabulary),
  and takes a schema grammar's first step, where some recursive `$ref`s fail.

Grammars come out in llguidance's JSON TopLevelGrammar form, which the node's LLMatcher reads.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper

from omlx_coordinator.errors import APIError
from omlx_coordinator.text.tool_calls import ToolCallFormat

# The families whose calls `grammar_for_tool_call` can force (see the module docstring).
FORCEABLE_FAMILIES = frozenset({"json_tools"})
# Qwen's templates render a call as start + "\n" + JSON + "\n" + end; the forced call matches
# what the model was trained to write.
_CALL_PADDING = "\n"
# JSON as json.dumps and the templates' `tojson` write it: one space after "," and ":", none
# elsewhere. llguidance's default allows any whitespace between tokens, which lets a model pad
# its output with blank lines until max_tokens instead of closing the object.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_for_json_schema(schema: dict[str, Any] | bool, param: str) -> str:
    """JSON that follows `schema` (a JSON Schema; `true` or `{}` is any JSON value); a schema
    the engine cannot read (nested past its recursion limit) is a 400 naming `param`."""
    try:
        # llguidance's layout overrides need an object: {} is the `true` schema's object form.
        text = json.dumps({} if schema is True else schema)
    except RecursionError:  # ~500 schemas deep: llguidance would refuse 200 already
        raise APIError(400, f"{param!r} nests too deeply to be read as a JSON Schema; the "
                            "engine takes fewer than 200 nested schemas", param=param) from None
    try:
        return LLMatcher.grammar_from_json_schema(text, overrides=_JSON_LAYOUT)
    except ValueError as e:
        raise APIError(400, f"{param!r} cannot be read as a JSON Schema: {e}",
                       param=param) from None


def grammar_for_tool_call(fmt: ToolCallFormat, tools: list[dict], name: str | None,
                          parallel: bool = False,
                          schema_param: str = "tools.{i}.function.parameters") -> str:
    """One call (several when `parallel`) in `fmt`'s markup of the tool named `name`, or of any
    of `tools` (OpenAI's shape: {"type": "function", "function": {"name", "parameters"}}).
    `schema_param` names tool i's schema in the client's own API, for errors.

    Raises APIError 400 for a family that cannot be forced, a name not among the tools, or a
    tool whose parameters the engine cannot compile (naming the tool)."""
    return _grammar(f"start: {_calls(parallel)}\n", _call_rule(fmt, tools, name, schema_param))


def grammar_for_tools_or_reply(fmt: ToolCallFormat, tools: list[dict], parallel: bool,
                               reply: dict[str, Any] | bool | None) -> str:
    """tool_choice auto, constrained: a reply, then or instead calls (several when `parallel`)
    whose arguments follow their tool's schema (OpenAI's `strict` tools). `reply`: the JSON
    Schema of a reply that calls no tool (`response_format`), or None for free text before the
    calls. Free text needs a call marker that is a token of its own, which text never writes:
    otherwise a 400 naming `tools`."""
    if fmt.family not in FORCEABLE_FAMILIES:
        raise APIError(400, f"this model's tool calls ({fmt.family} format) cannot be "
                            "constrained (their markup is not a JSON object between plain-text "
                            "markers), so neither strict tool schemas nor a response_format "
                            "beside tools can be enforced: drop strict or response_format",
                       param="tools")
    call = _call_rule(fmt, tools, None, "tools.{i}.function.parameters")
    if reply is not None:
        schema = json.dumps({**(reply if isinstance(reply, dict) else {}),
                             "x-guidance": _JSON_LAYOUT})
        return _grammar(f"start: {_calls(parallel)} | reply\nreply: %json {schema}\n", call)
    if fmt.start_id is None:
        raise APIError(400, f"this model writes its tool-call marker {fmt.start!r} as plain "
                            "text, so free text cannot be told from a call and strict tool "
                            "schemas cannot be enforced under tool_choice \"auto\": use "
                            "tool_choice \"required\" or a named function, or drop strict",
                       param="tools")
    return _grammar(f"start: TEXT ({_calls(parallel)})?\nTEXT: /(.|\\n)*/\n", call)


def _calls(parallel: bool) -> str:
    # Qwen's templates put a newline between two calls.
    return f"call ({json.dumps(chr(10))} call)*" if parallel else "call"


def _grammar(lark: str, call: str) -> str:
    return json.dumps({"grammars": [{"lark_grammar": lark + f"call: {call}\n"}]})


def _call_rule(fmt: ToolCallFormat, tools: list[dict], name: str | None,
               schema_param: str) -> str:
    """The lark rule of one call of the tool named `name` (None: any of `tools`)."""
    if fmt.family not in FORCEABLE_FAMILIES:
        raise APIError(400, f"this model's tool calls ({fmt.family} format) cannot be forced: "
                            "its call markup is not a JSON object between plain-text markers; "
                            "use tool_choice \"auto\"", param="tool_choice")
    calls = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters")
        if parameters is None:  # OpenAI: no parameters is an empty parameter list
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        param = schema_param.format(i=i)
        validate(grammar_for_json_schema(parameters, param), param,
                 f"the parameters of tool {function['name']!r}")
        calls.append({"type": "object",
                      "properties": {"name": {"const": function["name"]},
                                     "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False})
    if not calls:
        names = [t["function"]["name"] for t in tools]
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the "
                            f"tools {names}", param="tool_choice")
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": _JSON_LAYOUT}
    return " ".join([_marker(fmt.start, fmt.start_id), json.dumps(_CALL_PADDING), "%json",
                     json.dumps(schema), json.dumps(_CALL_PADDING), _marker(fmt.end, fmt.end_id)])


def _marker(text: str, token_id: int | None) -> str:
    # llguidance treats every added token as special: a text literal never produces it, so a
    # marker that is a token of its own is written as that token (`<[id]>`).
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def validate(grammar: str, param: str, what: str | None = None) -> None:
    """Raises APIError 400 naming `param` (and `what` it is) unless the engine can compile
    `grammar`, and, for a JSON Schema's grammar, take its first step: some schemas compile
    and fail only there, a recursive `$ref` with nothing else in it ("NoExtensionBias") or
    beside sibling keys among them."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    error = messages[0] if failed else _first_step(grammar) if _is_schema(grammar) else ""
    if error:
        raise APIError(400, f"{what or repr(param)} cannot be compiled into a grammar for "
                            f"constrained decoding: {error.replace(_TERSE_MARK, '').strip()}",
                       param=param)


def _is_schema(grammar: str) -> bool:
    # Only a schema's grammar is free of the model's token markers (`<[id]>`), which the byte
    # vocabulary below lacks; a call grammar's schemas were each validated before it.
    return "json_schema" in json.loads(grammar)["grammars"][0]


def _first_step(grammar: str) -> str:
    """The error of a matcher's first mask for `grammar` ("" if none)."""
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=_TERSE)
    if not matcher.is_error():
        matcher.compute_bitmask()
    error = matcher.get_error() if matcher.is_error() else ""
    # llguidance's name for a grammar that admits no output at all.
    return ("no JSON value can follow it (such as a $ref that leads only back to itself)"
            if error.startswith("NoExtensionBias") else error)


# Errors without the parser's state, which would echo the whole grammar back.
_TERSE = LLParserLimits(verbose_errors=False)
_TERSE_MARK = "<non-verbose/>"


class _Bytes:
    """A vocabulary of the 256 bytes and an end token: a schema's first step does not depend
    on the model's tokens, and this one costs nothing to build."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_Bytes()))
