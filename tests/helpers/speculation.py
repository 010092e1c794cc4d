"""What the speculative-decoding tests share: a prompt that loops, a flat cost curve, and one
request run through a batcher to its end."""

from __future__ import annotations

from omlx_node.batcher import Batcher, SeqRequest
from tests.helpers.engine import drain

# Repetitive: a random model's greedy output soon loops, and prompt lookup drafts the loop.
TEXT = "one two three four five six seven eight nine ten. " * 4 + "one two three"


# A weight-bound device's cost curve (k+1 positions cost what one does): rows draft all k_max
# tokens while their drafts stand. On a real node the measured curve decides.
FLAT = {1: 1.0, 256: 1.0}


def run_one(batcher: Batcher, req: SeqRequest) -> tuple[list[int], str, object]:
    seq = batcher.submit(req)
    [(tokens, finish)] = drain(batcher, [seq])
    return tokens, finish.reason, seq
