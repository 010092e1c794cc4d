"""One JSON object read as its text arrives, re-written as it goes in the exact form
`json.dumps(json.loads(text), ensure_ascii=False)` gives the whole: one space after "," and
":", no other whitespace, escapes decoded and re-encoded, numbers re-spelled by Python.

tool_calls.py streams a call's arguments with it: the pieces a client gets add up to the
arguments string a whole-call parse would give, so a streamed reply and a whole one agree.
Nothing is sent that could change: a number or literal waits for the character after it, an
escape for its last digit (a high surrogate for the escape that may pair with it). One
difference from json.loads stays: a key written twice comes out twice (json.loads keeps the
last value), as the first is already sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters json.dumps writes as they are
_SCALAR = re.compile(r"[-+.0-9A-Za-z]+")  # numbers and literals (NaN, Infinity: json.loads')
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_OPENS = {"}": "{", "]": "["}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


@dataclass(frozen=True)
class Piece:
    """Canonical text of the object, and the top-level member it belongs to (None for the
    object's own braces, keys and separators); `end` with no text: that member's value is
    complete."""

    member: str | None
    text: str
    end: bool = False


class JsonStream:
    """One JSON object. `feed` raises ValueError where the text stops being JSON."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers, "{" or "["
        # What comes next: value, value_or_close, key, key_or_close, colon, comma_or_close.
        self.expect = "value"
        self.in_string = False
        self.key: list[str] | None = None  # the top-level key being read, canonical
        self.member: str | None = None  # the top-level member whose value is being read
        self.high = ""  # a high surrogate waiting for the escape that may pair with it
        self.held = ""  # raw text not yet whole: an escape, a number, a literal
        self.done = False
        self.out: list[Piece] = []

    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` completes; text past the object's end is left unread."""
        buf, i, self.held = self.held + text, 0, ""
        while i < len(buf) and not self.done:
            step = self._string(buf, i) if self.in_string else self._token(buf, i)
            if step is None:  # needs more text
                self.held = buf[i:]
                break
            i = step
        out, self.out = self.out, []
        return _joined(out)

    def _emit(self, text: str) -> None:
        if self.key is not None:
            self.key.append(text)
        self.out.append(Piece(self.member, text))

    def _string(self, buf: str, i: int) -> int | None:
        m = _PLAIN.match(buf, i)
        if m:
            self._flush_high()
            self._emit(m.group())
            return m.end()
        c = buf[i]
        if c == '"':
            self._flush_high()
            self._emit('"')
            self.in_string = False
            if self.expect != "colon":  # a value's string, not a key's
                self._value_done()
            return i + 1
        if c != "\\":
            raise ValueError(f"control character {c!r} in a JSON string")
        if i + 1 >= len(buf):
            return None
        kind = buf[i + 1]
        if kind in _ESCAPES:
            self._char(_ESCAPES[kind])
            return i + 2
        if kind != "u":
            raise ValueError(f"bad JSON escape \\{kind}")
        digits = buf[i + 2:i + 6]
        if len(digits) < 4:
            if not _HEX4.match(digits + "0000"[len(digits):]):
                raise ValueError(f"bad JSON escape \\u{digits}")
            return None
        if not _HEX4.fullmatch(digits):
            raise ValueError(f"bad JSON escape \\u{digits}")
        self._char(chr(int(digits, 16)))
        return i + 6

    def _char(self, ch: str) -> None:
        """An escaped character; surrogates pair as json.loads pairs them (an escaped high
        surrogate right before an escaped low one), others stand alone."""
        if self.high and "\udc00" <= ch <= "\udfff":
            ch = chr(0x10000 + ((ord(self.high) - 0xD800) << 10) + (ord(ch) - 0xDC00))
            self.high = ""
        self._flush_high()
        if "\ud800" <= ch <= "\udbff":
            self.high = ch
        else:
            self._emit(json.dumps(ch, ensure_ascii=False)[1:-1])

    def _flush_high(self) -> None:
        if self.high:
            high, self.high = self.high, ""
            self._emit(high)

    def _token(self, buf: str, i: int) -> int | None:
        c, expect = buf[i], self.expect
        if c in _WS:
            return i + 1
        if expect in ("value", "value_or_close"):
            if c == "]" and expect == "value_or_close":
                return self._close(c, i)
            if c in "{[":
                self._emit(c)
                self.stack.append(c)
                self.expect = "key_or_close" if c == "{" else "value_or_close"
                return i + 1
            if c == '"':
                self._emit(c)
                self.in_string = True
                return i + 1
            m = _SCALAR.match(buf, i)
            if m is None:
                raise ValueError(f"{c!r} where a JSON value belongs")
            if m.end() == len(buf):  # the number may go on
                return None
            # json.loads checks it (and spells NaN, Infinity and 1E5 as a whole parse does).
            self._emit(json.dumps(json.loads(m.group())))
            self._value_done()
            return m.end()
        if expect in ("key", "key_or_close"):
            if c == "}" and expect == "key_or_close":
                return self._close(c, i)
            if c != '"':
                raise ValueError(f"{c!r} where a JSON key belongs")
            if len(self.stack) == 1:
                self.member, self.key = None, []
            self._emit(c)
            self.in_string, self.expect = True, "colon"
            return i + 1
        if expect == "colon":
            if c != ":":
                raise ValueError(f"{c!r} where ':' belongs")
            self.out.append(Piece(self.member, ": "))
            if self.key is not None:
                self.member, self.key = json.loads("".join(self.key)), None
            self.expect = "value"
            return i + 1
        if c == ",":
            self.out.append(Piece(self.member, ", "))
            self.expect = "key" if self.stack[-1] == "{" else "value"
            return i + 1
        if c in "}]":
            return self._close(c, i)
        raise ValueError(f"{c!r} where ',' or a closing bracket belongs")

    def _close(self, c: str, i: int) -> int:
        if not self.stack or self.stack[-1] != _OPENS[c]:
            raise ValueError(f"{c!r} closes nothing open")
        self.stack.pop()
        # The object's own closing brace is no member's text.
        self.out.append(Piece(self.member if self.stack else None, c))
        self._value_done()
        return i + 1

    def _value_done(self) -> None:
        if not self.stack:
            self.done = True
        elif len(self.stack) == 1:
            self.out.append(Piece(self.member, "", end=True))
            self.member = None
            self.expect = "comma_or_close"
        else:
            self.expect = "comma_or_close"


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring pieces of one member as one: a client gets a piece a token, not a
    character."""
    out: list[Piece] = []
    for p in pieces:
        if out and not p.end and not out[-1].end and out[-1].member == p.member:
            out[-1] = Piece(p.member, out[-1].text + p.text)
        else:
            out.append(p)
    return out
