"""Which waiting prompt may start its prefill: not one that would compute again what a prompt
just ahead of it is computing now.

Agents of one kind start sessions with the same system prompt and tools, a second or less apart.
A prompt's cached prefix is looked up when its prefill is planned, and the engine plans the next
waiting prompt into the same chunk as the last piece of the one ahead of it: the second session
then restored what the first had stored so far and prefilled the rest of the shared prompt
itself (on the CPU agent benchmark, 384 of its 1,504 shared tokens). Waiting one iteration, until
the prompt ahead is prefilled and kept, it restores all of them.
"""

from __future__ import annotations

from collections.abc import Sequence


def shared_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # the first difference is in [lo, hi): halve on slices (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def waits_for_ahead(prompt: Sequence[int], ahead: list[tuple[Sequence[int], int]],
                    block_size: int) -> bool:
    """Whether a prompt not looked up yet should wait for a prompt `ahead` of it in this chunk
    ((its tokens, how many of them it restored)): it would, once that one is kept, restore at
    least one block more than the cache holds now."""
    for tokens, restored in ahead:
        if shared_start(prompt, tokens) // block_size * block_size > restored:
            return True
    return False
