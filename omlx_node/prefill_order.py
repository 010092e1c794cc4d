"""Which waiting prompt prefills first: the oldest, or (`Engine.shortest_first`) the one with the
least left to prefill, aged; and not one that would compute again what a prompt just ahead of it
is computing now.

Shortest remaining first, measured and not the default (docs/scheduling.md): an agent's later
turn re-sends its history and prefills only what is
new (a tool result, a few hundred tokens), while a new session may prefill thousands. Taken
oldest first, a short turn waited behind every longer prompt that came before it, and what it
waited for counted twice in its turn time. Ordered by what is left to prefill, a prompt
partly prefilled keeps its place, and a prompt's wait counts against its length at the rate
prefill runs (`priority`): one that has waited as long as its own prefill would take comes
before any newcomer, so no prompt starves behind a stream of shorter ones. Measured in
docs/scheduling.md.

Agents of one kind start sessions with the same system prompt and tools, a second or less apart.
A prompt's cached prefix is looked up when its prefill is planned, and the engine plans the next
waiting prompt into the same chunk as the last piece of the one ahead of it: the second session
then restored what the first had stored so far and prefilled the rest of the shared prompt
itself (a good part of the shared prompt on the CPU agent benchmark,
bench/results/agent-sessions-cpu.md). Waiting one iteration, until
the prompt ahead is prefilled and kept, it restores all of them.
"""

from __future__ import annotations

from collections.abc import Sequence


def priority(left: int, waited: float, token_s: float) -> float:
    """A waiting prompt's place (lower: sooner): its tokens `left` to prefill, less those the
    engine could have prefilled in the `waited` seconds it has waited (`token_s`: seconds a
    prompt token takes, 0 until measured)."""
    return left - (waited / token_s if token_s > 0 else 0.0)


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
