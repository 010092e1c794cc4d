"""A tensor-parallel stage inside a pipeline: a run of neighbouring ranks of the plan's one
mx.distributed group, with its own collectives.

A tensor x pipeline plan (docs/cluster.md, "Tensor x pipeline") needs two groups in each process: its
stage's ranks, which all-reduce twice a layer, and the whole pipeline, whose stages pass steps
along. MLX cannot give one process two groups: `Group.split` raises "[ring] Group split not
supported" on the ring backend (mlx 0.32.4, checked over 4 processes), and a second `init()`
returns the same group. So the plan keeps one group over every rank, in ring
order, each stage a contiguous run of it (its ranks are ring neighbours), and a `SubGroup`
is such a run: its collectives are sends and receives between neighbours over that same group,
MLX's data plane, no transport of our own:

- 2 ranks swap their parts at once (one message each way) and add them lower rank first, so
  both hold the same bits;
- k > 2 ranks pass a running sum up the run and the total back down: 2(k - 1) messages one
  after another, what MLX's own ring all_sum takes on k ranks.

The models' sharded layers (mlx-lm's `shard()` layers call `mx.distributed.all_sum(x,
group=...)`, as do several families' MoE blocks, and `all_gather` in others) are built with a
SubGroup as their group: `install` has `all_sum`, `all_min` and `all_gather` route a SubGroup
here and every real group to MLX as before. Messages between two ranks are read in the order
they were sent, and a receive has no inputs: only the order in which receives are scheduled
keeps them in step with the peer's sends. So each collective is scheduled as soon as it is
built (`reduce`), its own part sent first.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from omlx_node.wire import send_stream


class SubGroup:
    """Ranks [first, first + size) of `world`, ring neighbours, as a group of `size`: what the
    sharders and the collectives below read of a group."""

    def __init__(self, world, first: int, size: int):
        if not 0 <= first <= world.rank() < first + size <= world.size():
            raise ValueError(f"rank {world.rank()} is not in ranks [{first}, {first + size}) "
                             f"of a group of {world.size()}")
        self.world, self.first, self._size = world, first, size

    def rank(self) -> int:
        return self.world.rank() - self.first

    def size(self) -> int:
        return self._size

    def split(self, color: int, key: int = -1):
        raise RuntimeError("a tensor stage's ranks cannot be split further")


def _send(x: mx.array, rank: int, group: SubGroup) -> None:
    mx.async_eval(mx.distributed.send(x, group.first + rank, group=group.world,
                                      stream=send_stream()))


def _recv(like: mx.array, rank: int, group: SubGroup) -> mx.array:
    return mx.distributed.recv(like.shape, like.dtype, group.first + rank, group=group.world,
                               stream=mx.cpu)


def reduce(x: mx.array, group: SubGroup, op) -> mx.array:
    """`op` (an associative, commutative elementwise function of two arrays) over every rank's
    `x`, the same bits on each. Scheduled at once, receives too: a graph that nobody
    evaluates (a prefill's positions but the last, whose logits are dropped) must still read
    what the peers sent it, or its next receive would read that instead."""
    k, r = group.size(), group.rank()
    if k == 1:
        return x
    if k == 2:
        _send(x, 1 - r, group)
        other = _recv(x, 1 - r, group)
        out = op(x, other) if r == 0 else op(other, x)
    else:
        out = x if r == 0 else op(_recv(x, r - 1, group), x)
        if r < k - 1:
            _send(out, r + 1, group)
            out = _recv(x, r + 1, group)
        if r > 0:
            _send(out, r - 1, group)
    mx.async_eval(out)
    return out


def all_sum(x: mx.array, group: SubGroup) -> mx.array:
    return reduce(x, group, mx.add)


def all_min(x: mx.array, group: SubGroup) -> mx.array:
    return reduce(x, group, mx.minimum)


def all_gather(x: mx.array, group: SubGroup) -> mx.array:
    """Every rank's `x` concatenated along the first axis, in rank order: a sum of each in its
    own slot of zeros (adding zeros is exact)."""
    k, r = group.size(), group.rank()
    n = x.shape[0]
    slots = mx.concatenate([mx.zeros((r * n, *x.shape[1:]), x.dtype), x,
                            mx.zeros(((k - 1 - r) * n, *x.shape[1:]), x.dtype)])
    return all_sum(slots, group)


def _routed(collective, mine):
    @functools.wraps(collective)
    def call(x, *args, group=None, **kwargs):
        if isinstance(group, SubGroup):
            return mine(x, group)
        return collective(x, *args, group=group, **kwargs)
    call.omlx_routed = True
    return call


def install() -> None:
    """Routes `mx.distributed.all_sum`, `all_min` and `all_gather` of a SubGroup here (once)."""
    d = mx.distributed
    for name, mine in (("all_sum", all_sum), ("all_min", all_min), ("all_gather", all_gather)):
        if not getattr(getattr(d, name), "omlx_routed", False):
            setattr(d, name, _routed(getattr(d, name), mine))
