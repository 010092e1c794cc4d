"""How many of a stage's layers stay on the SSD: the planner's side of omlx_node/layer_stream.py.

A node may cap the weights it keeps in memory (`--weights-memory`). A stage whose weights pass
that cap (or the node's memory, once capped) keeps its last layers on disk and reads each just
ahead of its turn: what it holds is its resident weights plus two streamed layers' buffers (the
one in use, and the last one's, kept by MLX's allocator for the next to reuse), and each decode
step reads every streamed layer once more, at the node's disk read speed. Pure
arithmetic over prefix sums: the planner's DP asks it for every candidate range.
"""

from __future__ import annotations

from collections.abc import Sequence

# Sequential read speed (GB/s) a node's SSD is counted at until it is measured: a Mac's internal
# SSD reads 3-7 GB/s, a SATA disk ~0.5.
DEFAULT_DISK_GBPS = 3.0
# Streamed layers' worth of buffers a streaming stage holds besides its resident layers.
STREAM_BUFFERS = 2


def streamed_layers(prefix: Sequence[int], i: int, k: int, weights: int, room: int,
                    capped: bool, largest_layer: int) -> int | None:
    """Layers at the end of [i, k) kept on disk so the stage's resident weights fit `room`:
    0 when all fit, None when they cannot (not `capped`, or even all but one streamed is too
    much). `prefix[n]` is the bytes of layers [0, n); `weights` the stage's whole weights."""
    if weights <= room:
        return 0
    if not capped or k - i < 2:
        return None

    def held(n: int) -> int:
        return weights - (prefix[k] - prefix[k - n]) + STREAM_BUFFERS * largest_layer

    lo, hi = 1, k - i - 1
    if held(hi) > room:
        return None
    while lo < hi:  # the fewest layers that make it fit: fewer reads a step
        mid = (lo + hi) // 2
        if held(mid) <= room:
            hi = mid
        else:
            lo = mid + 1
    return lo


def disk_ms(streamed_bytes: int, disk_gbps: float) -> float:
    """What reading a step's streamed layers costs, in ms (the compute it overlaps is counted
    apart: read-ahead hides at most the shorter of the two, so the sum is an upper bound)."""
    return streamed_bytes / (disk_gbps * 1e9) * 1e3
