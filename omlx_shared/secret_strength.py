"""How hard a cluster secret is to guess: a simple, explainable estimate in bits.

What the secret yields can be checked offline (docs/security.md: a node's certificate, a sniffed
registration), so a guess costs an attacker one scrypt and nothing else: only ~128 bits of
randomness put the secret out of reach. The estimate charges each part of the secret what an
attacker who tries dictionaries, digits, repeats and keyboard sequences first would pay for it:

- a word (3+ letters, all lower case, ALL UPPER or Capitalised, with a vowel in every five
  letters: random letters mostly are not) counts as one pick from a 65,536-word vocabulary,
  16 bits, however long it is (unless its letters one by one cost less);
- a repeat of earlier text (3+ characters) counts 8 bits: where it repeats from, and how much;
- a character that continues a run or a sequence (aaa, abc, 4321) or walks along a keyboard
  row (qwerty) counts 1 bit;
- any other character counts log2 of the alphabet its classes span (lower case 26, upper case
  26, digits 10, anything else 33).

So a random secret (`omlx-cluster secret new`: 43 URL-safe base64 characters, ~250 bits here)
passes with a wide margin, and a phrase of words passes only with about eight random words
(four are ~80 bits: refused).
"""

from __future__ import annotations

import math
import re

MIN_LENGTH = 20
MIN_BITS = 128
WORD_BITS = 16.0
REPEAT_BITS = 8.0
STEP_BITS = 1.0
JUDGED_CHARS = 256  # a longer secret is judged by its start: more text only adds bits

_WORD = re.compile(r"[a-z]{3,}|[A-Z]{3,}|[A-Z][a-z]{2,}")
_NOT_SAID = re.compile(r"[^aeiouy]{5}|^[^aeiouy]*$")  # letters no word of a language holds
_MIN_REPEAT = 3
_KEYBOARD_ROWS = ("1234567890", "qwertyuiop", "asdfghjkl", "zxcvbnm")


def _alphabet(text: str) -> int:
    classes = ((str.islower, 26), (str.isupper, 26), (str.isdigit, 10))
    size = sum(n for test, n in classes if any(test(c) for c in text))
    other = any(not (c.isascii() and c.isalnum()) for c in text)
    return size + (33 if other else 0) or 1


def _continues(text: str, i: int) -> bool:
    """Whether text[i] is the key next to text[i-1] on a keyboard row, or repeats the step from
    text[i-2] to text[i-1] (0 or 1 either way)."""
    if i < 1:
        return False
    pair = text[i - 1:i + 1].lower()
    if any(pair in row or pair[::-1] in row for row in _KEYBOARD_ROWS):
        return True
    if i < 2:
        return False
    step = ord(text[i - 1]) - ord(text[i - 2])
    return abs(step) <= 1 and ord(text[i]) - ord(text[i - 1]) == step


def _chars_bits(text: str, start: int, end: int, per_char: float) -> float:
    return sum(STEP_BITS if _continues(text, i) else per_char for i in range(start, end))


def _repeat_length(text: str, i: int) -> int:
    """The length of the longest text starting at i that also occurs before i (0 if shorter
    than a repeat worth counting)."""
    n = _MIN_REPEAT
    while i + n <= len(text) and text[i:i + n] in text[:i]:
        n += 1
    return n - 1 if n > _MIN_REPEAT else 0


def _word_end(text: str, i: int) -> int | None:
    """Where the word starting at text[i] ends, if one does."""
    word = _WORD.match(text, i)
    if word is None or _NOT_SAID.search(word.group().lower()):
        return None
    return word.end()


def strength_bits(secret: str) -> float:
    """The estimate above, in bits."""
    text = secret[:JUDGED_CHARS]
    per_char = math.log2(_alphabet(text))
    bits, i = 0.0, 0
    while i < len(text):
        if n := _repeat_length(text, i):
            bits, i = bits + REPEAT_BITS, i + n
        elif end := _word_end(text, i):
            bits, i = bits + min(WORD_BITS, _chars_bits(text, i, end, per_char)), end
        else:
            bits, i = bits + _chars_bits(text, i, i + 1, per_char), i + 1
    return bits


def weakness(secret: str) -> str | None:
    """Why `secret` is too weak to be a cluster secret, or None if it is strong enough."""
    if len(secret) < MIN_LENGTH:
        return f"it is {len(secret)} characters long, and {MIN_LENGTH} is the least"
    bits = strength_bits(secret)
    if bits < MIN_BITS:
        return (f"a guesser who tries words, digits, repeats and sequences first would need "
                f"about 2^{bits:.0f} tries, and 2^{MIN_BITS} is the least")
    return None
