"""Tool calls in a model's output: the markup of its family and mlx-lm's parser for it.

mlx-lm 0.32 ships one parser per family (`mlx_lm/tool_parsers/<family>.py`: `tool_call_start`,
`tool_call_end`, `parse_tool_call(text, tools)`) and infers the family from the chat template
(`mlx_lm/tokenizer_utils.py::_infer_tool_parser`; a `tool_parser_type` in tokenizer_config.json
wins, as in mlx-lm's loader). They are reused here, but the coordinator must not import MLX, and
`import mlx_lm.anything` runs `mlx_lm/__init__.py`, which does. So the `tool_parsers` folder is
registered as a package of its own name (its modules import each other relatively) and
`tokenizer_utils.py` (which imports only transformers) is loaded as a lone module, both from
the files `importlib.util.find_spec("mlx_lm")` locates without importing the package.

Streaming (`ToolCallStream(..., stream=True)`, what a streamed reply uses): once a call's name
is known its arguments go out as they are generated, as CallStart, CallArguments pieces, then
CallEnd; nothing sent is ever taken back, and only text that may still be markup (a partial end
marker) waits. The pieces add up to the arguments string the whole-call parse gives.
- json_tools (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Qwen, Hermes and the
  like) streams: the call starts when `"name": "..."` is complete, and the `arguments` object
  follows re-written as json.dumps writes it (streamed_json.py). A body whose `arguments` come
  before the name, or are not an object, waits for its end (after the name: the arguments come
  whole).
- Every other family comes whole at its end marker, as before: their arguments are not JSON as
  written (qwen3_coder, glm47, laguna, longcat, minimax_m2, minicpm5, kimi_k3, muse_spark write
  XML-like parameters typed by the tool's schema; gemma4, function_gemma, pythonic their own
  syntax), or are JSON that the parser may instead read as a Python literal (kimi_k2), or hold
  several calls whose boundaries a prefix cannot tell yet (mistral).
Once a call has started, markup that breaks off (cut by max_tokens, or not JSON further on)
ends the call with the arguments sent so far, which are then not JSON (as OpenAI's own are when
max_tokens cuts a call); a whole-call reply gives such markup back as text instead.

Used by every protocol adapter (api/openai.py, api/anthropic.py, api/responses.py) and by
constraints.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from omlx_coordinator.text.streamed_json import JsonStream

log = logging.getLogger(__name__)

_PARSERS_PACKAGE = "_omlx_mlx_lm_tool_parsers"  # not mlx_lm.*: that name would run its init
_TOKENIZER_UTILS = "_omlx_mlx_lm_tokenizer_utils"


def _mlx_lm_dir() -> Path:
    # find_spec of a top-level package locates it without importing it.
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mlx-lm is not installed; the coordinator needs its tool parsers")
    return Path(next(iter(spec.submodule_search_locations)))


# Requests format their prompts on worker threads: without the lock a second thread could take
# a module another is still executing from sys.modules, half-made.
_loading = threading.RLock()


def _load(name: str, path: Path, package_dir: Path | None = None) -> ModuleType:
    with _loading:
        return _load_locked(name, path, package_dir)


def _load_locked(name: str, path: Path, package_dir: Path | None) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(package_dir)] if package_dir else None)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: relative imports inside it look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@cache
def _tokenizer_utils() -> ModuleType:
    return _load(_TOKENIZER_UTILS, _mlx_lm_dir() / "tokenizer_utils.py")


@cache
def _parser_module(family: str) -> ModuleType:
    folder = _mlx_lm_dir() / "tool_parsers"
    with _loading:
        _load(_PARSERS_PACKAGE, folder / "__init__.py", package_dir=folder)
        return importlib.import_module(f"{_PARSERS_PACKAGE}.{family}")


class ChatTokenizer(Protocol):
    """What this module needs of tokenizer.ChatTokenizer, which imports this module (so it
    cannot import that one back)."""

    @property
    def tool_call_format(self) -> ToolCallFormat | None: ...


@dataclass
class ToolCall:
    id: str  # "call_<hex>", or the model's own id where its markup carries one (Mistral, Kimi)
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ToolCallFormat:
    """A family's tool-call markup: `start` + body + `end` (`end` "" for Mistral, whose calls
    run to the end of the output)."""

    family: str  # mlx-lm's parser name: json_tools, qwen3_coder, mistral, ...
    start: str
    end: str
    _parser: Callable[[str, Any], Any]
    # The vocabulary's own tokens for `start` / `end` (Qwen's <tool_call> is an added token),
    # None where the marker is spelled in ordinary tokens: a grammar that forces a call must
    # write that token, as the model was trained to (constraints.py).
    start_id: int | None = None
    end_id: int | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer: ChatTokenizer) -> ToolCallFormat | None:
        """The format of this model's family, None when it has none (cached by the tokenizer)."""
        return tokenizer.tool_call_format

    @classmethod
    def infer(cls, hf_tokenizer: Any) -> ToolCallFormat | None:
        """Infers the family as mlx-lm's loader does (uncached: use for_tokenizer)."""
        init_kwargs = getattr(hf_tokenizer, "init_kwargs", None) or {}
        family = init_kwargs.get("tool_parser_type") or \
            _tokenizer_utils()._infer_tool_parser(hf_tokenizer)
        if family is None:
            return None
        try:
            module = _parser_module(family)
        except ImportError as e:
            # Decoding asks for the format too: a bad name must not break plain generation.
            log.warning("no mlx-lm tool parser %r (%s): tool calls are off", family, e)
            return None
        start, end = module.tool_call_start, module.tool_call_end
        added = hf_tokenizer.get_added_vocab()
        return cls(family, start, end, module.parse_tool_call, added.get(start),
                   added.get(end) if end else None)

    def parse(self, text: str, tools: list[dict] | None) -> list[ToolCall]:
        """The calls in one piece of markup (the text between `start` and `end`); raises
        ValueError when it is not a well-formed call."""
        try:
            parsed = self._parser(text, tools)
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError) as e:
            # mlx-lm's parsers raise whatever their input provokes (json, ast, regex lookups).
            raise ValueError(f"not a {self.family} tool call: {e}") from e
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError(f"not a {self.family} tool call: {call!r}")
            calls.append(ToolCall(_call_id(call.get("id")), call["name"],
                                  _arguments_json(call.get("arguments", {}))))
        return calls


def _call_id(model_id: Any) -> str:
    # Mistral's templates insist on the ids its model wrote when the calls come back.
    return model_id if isinstance(model_id, str) and model_id else "call_" + uuid.uuid4().hex


def _arguments_json(arguments: Any) -> str:
    if isinstance(arguments, str):  # some templates render the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments are not JSON: {arguments!r}") from e
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments are not an object: {arguments!r}")
    return json.dumps(arguments, ensure_ascii=False)


def call_input(arguments: str) -> dict:
    """A call's arguments as an object; {} for a streamed call cut off (its arguments are then
    not JSON)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


@dataclass
class CallStart:
    """A call begins: pieces of its arguments follow, then its CallEnd."""

    id: str
    name: str


@dataclass
class CallArguments:
    text: str  # the next piece of the open call's arguments


@dataclass
class CallEnd:
    call: ToolCall  # the whole call: its arguments are its pieces put together


Item = str | CallStart | CallArguments | CallEnd

# The families whose calls stream (the module docstring says why the others do not).
STREAMED_FAMILIES = frozenset({"json_tools"})


class ToolCallStream:
    """Splits streamed output into text and tool calls.

    Text before a call goes out at once; a tail that could still be the start of `fmt.start` is
    held back only while it could be (as stop_strings.py holds partial matches); markup never
    reaches the text, each call comes out as CallStart, CallArguments, CallEnd: all at its end
    marker, or with `stream` as it is generated where the family allows (module docstring).
    Markup that does not parse whole (or is cut off unparseable at the end) comes out as text,
    markers included: the client sees what the model wrote rather than losing it."""

    def __init__(self, fmt: ToolCallFormat, tools: list[dict] | None, stream: bool = False):
        self.fmt, self.tools = fmt, tools
        self.stream = stream and fmt.family in STREAMED_FAMILIES
        self.pending = ""  # held text: a possible start marker, or a possible end marker
        self.call: _WholeCall | _JsonCall | None = None  # the open call, after a start marker

    def feed(self, text: str) -> list[Item]:
        out: list[Item] = []
        self.pending += text
        start, end = self.fmt.start, self.fmt.end
        while True:
            if self.call is None:
                i = self.pending.find(start)
                if i < 0:
                    cut = len(self.pending) - _partial_suffix(self.pending, start)
                    _add_text(out, self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return out
                _add_text(out, self.pending[:i])
                self.pending = self.pending[i + len(start):]
                self.call = (_JsonCall if self.stream else _WholeCall)(self.fmt, self.tools)
            elif not end:  # the call runs to the end of the output
                out += self.call.feed(self.pending)
                self.pending = ""
                return out
            else:
                j = self.pending.find(end)
                if j < 0:
                    cut = len(self.pending) - _partial_suffix(self.pending, end)
                    out += self.call.feed(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return out
                out += self.call.feed(self.pending[:j]) + self.call.close(ended=True)
                self.pending, self.call = self.pending[j + len(end):], None

    def flush(self) -> list[Item]:
        """The end of the output: an open call is parsed (an unterminated one too, as mlx-lm
        does; a forced call's grammar always writes the end marker), held text comes out."""
        out: list[Item] = []
        if self.call is not None:
            out += self.call.feed(self.pending) + self.call.close(ended=False)
        else:
            _add_text(out, self.pending)
        self.pending, self.call = "", None
        return out


class _WholeCall:
    """A call's markup kept until its end, then parsed whole."""

    def __init__(self, fmt: ToolCallFormat, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
        self.body: list[str] = []

    def feed(self, text: str) -> list[Item]:
        self.body.append(text)
        return []

    def close(self, ended: bool) -> list[Item]:
        """`ended`: the end marker came (else the output ended first)."""
        body = "".join(self.body)
        try:
            calls = self.fmt.parse(body, self.tools)
        except ValueError:
            return [self.fmt.start + body + (self.fmt.end if ended else "")]
        return [item for c in calls
                for item in (CallStart(c.id, c.name), CallArguments(c.arguments), CallEnd(c))]


class _JsonCall(_WholeCall):
    """A json_tools call (`{"name": ..., "arguments": {...}}`), streamed: CallStart once the
    name is complete, then the arguments' canonical text as it comes. Where that cannot be (the
    body is no such object), the rest waits for the end marker and is parsed whole."""

    def __init__(self, fmt: ToolCallFormat, tools: list[dict] | None):
        super().__init__(fmt, tools)
        self.json: JsonStream | None = JsonStream()  # None once the rest waits for the end
        self.texts: dict[str, list[str]] = {}  # the other members' values, canonical
        self.start: CallStart | None = None
        self.arguments: list[str] | None = None  # the pieces sent, None before the first

    def feed(self, text: str) -> list[Item]:
        super().feed(text)
        if self.json is None:
            return []
        try:
            pieces = self.json.feed(text)
        except ValueError:
            self.json = None
            return []
        out: list[Item] = []
        for p in pieces:
            if p.member == "arguments":
                if self.start is None or (self.arguments is None and p.text[:1] != "{"):
                    self.json = None  # not streamable: the rest waits for the end
                    break
                if p.text:
                    self.arguments = self.arguments if self.arguments is not None else []
                    self.arguments.append(p.text)
                    out.append(CallArguments(p.text))
            elif p.member is not None:
                self.texts.setdefault(p.member, []).append(p.text)
                if p.end and p.member == "name" and self.start is None:
                    if not self._begin():
                        break
                    out.append(self.start)
        return out

    def _begin(self) -> bool:
        name = json.loads("".join(self.texts["name"]))
        if not isinstance(name, str):
            self.json = None
            return False
        # A model's own id is taken where it came first (json_tools models write none).
        model_id = json.loads("".join(self.texts["id"])) if "id" in self.texts else None
        self.start = CallStart(_call_id(model_id), name)
        return True

    def close(self, ended: bool) -> list[Item]:
        if self.start is None:
            return super().close(ended)
        if self.arguments is not None:
            arguments, out = "".join(self.arguments), []
        else:  # the arguments did not stream: the whole body gives them, if it parses
            try:
                calls = self.fmt.parse("".join(self.body), self.tools)
            except ValueError:
                calls = []
            arguments = calls[0].arguments if len(calls) == 1 else ""
            out = [CallArguments(arguments)] if arguments else []
        return out + [CallEnd(ToolCall(self.start.id, self.start.name, arguments))]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _add_text(out: list[Item], text: str) -> None:
    if text:
        out.append(text)
