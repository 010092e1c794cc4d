"""Where a request's time to its first token goes, measured on the engine's own iterations.

A prompt that arrives while others run waits through engine iterations until its first token;
each iteration is one decode step of the running rows and then one prefill chunk (pieces of one
or several prompts). `charge` splits each iteration's wall time between the prompts waiting
through it: the decode step's share (what the rows already answering cost it), the pieces of
its own prompt, and other prompts' pieces. The decode step's share is the pace's measured time
of a decode step (omlx_node.step_pace): on one device the step and the prefill run one after the
other, and their boundary is not observable without a synchronisation that would slow both.
What is left of the time to a first token (the engine between iterations, the request's way in
and out) is `other`. The scheduling choices in docs/scheduling.md were made on these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

PARTS = ("decode", "own_prefill", "others_prefill")


@dataclass
class Wait:
    """Seconds of a request's wait for its first token, by what the engine was doing."""

    decode: float = 0.0  # the running rows' decode steps
    own_prefill: float = 0.0  # its own prompt's pieces
    others_prefill: float = 0.0  # other prompts' pieces, before or beside its own

    def parts(self) -> dict[str, float]:
        return {p: getattr(self, p) for p in PARTS}


def split(seconds: float, decode_s: float, decoded: bool, prefilled: int) -> tuple[float, float]:
    """One iteration took `seconds`: a decode step if `decoded` (about `decode_s` of it, the
    whole iteration when it prefilled nothing), and `prefilled` prompt tokens. Returns the
    seconds of its decode step and of its prefill."""
    if not prefilled:
        return (seconds if decoded else 0.0), 0.0
    step = min(seconds, decode_s or seconds) if decoded else 0.0
    return step, seconds - step


def charge(wait: Wait, step: float, prefill: float, own: int, prefilled: int) -> None:
    """A prompt waited through an iteration's decode `step` and `prefill` (seconds, see
    `split`), in which `own` of the `prefilled` tokens were its own."""
    wait.decode += step
    mine = prefill * own / prefilled if prefilled else 0.0
    wait.own_prefill += mine
    wait.others_prefill += prefill - mine
