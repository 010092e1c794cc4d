"""Cache-aware routing between a model's replicas: send a prompt where its prefix is cached.

Every replica keeps its own KV prefix cache, whose blocks are named by the hash chain of
omlx_shared.block_hashes (a name stands for the whole prefix up to the end of its block). The
coordinator cannot ask a node what it holds on every request, so it remembers, per replica, the
chains it sent there (`PrefixIndex`: bounded, least recently used forgotten first), and routes a
new prompt by the longest run of leading block names a replica has seen (`choose_replica`): a
continued conversation or an agent's next turn lands where its earlier turns left their KV, and
the node prefills only the rest. After a request the coordinator records the prompt's and the
output's chain on the replica that served it.

The index is a guess, not the node's truth: a node may have evicted blocks the index still names
(it then prefills more, never answers wrong), so being wrong costs time only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# 64k names of 256-token blocks: 16M tokens of prefixes per replica, ~13 MB of index.
DEFAULT_CAPACITY = 1 << 16
# A cached prefix saves its prefill, but a replica this many requests busier than the idlest one
# queues a request behind whole generations; past that, load wins over the cache (the guard
# cache-aware routers such as Ray Serve's and SGLang's also keep). It also copies a prefix every
# request shares (a system prompt, an agent's tools) onto a second replica once the first is busy.
DEFAULT_MAX_IMBALANCE = 4


class NoReadyReplica(LookupError):
    """No replica of the model is ready to take a request."""


class PrefixIndex:
    """The block names one replica has served, at most `capacity` of them, least recently
    recorded forgotten first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._names: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def record(self, chain: Sequence[str]) -> None:
        """Remember a chain the replica has just served (its prompt's and output's blocks)."""
        # Deepest block first, so the chain's first block ends up most recent: the end of a chain
        # is forgotten before its start, and a start is what any longer chain can still match.
        for name in reversed(chain):
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)

    def matched(self, chain: Sequence[str]) -> int:
        """How many leading blocks of `chain` this replica has served."""
        count = 0
        for name in chain:
            if name not in self._names:
                break
            count += 1
        return count


@dataclass
class Replica:
    """What routing knows of one replica: the prefixes it served, the requests it is running
    now, and whether it takes requests (loaded, its nodes alive)."""

    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    in_flight: int = 0
    ready: bool = True


def choose_replica(
    chain: Sequence[str], replicas: Sequence[Replica],
    max_imbalance: int = DEFAULT_MAX_IMBALANCE,
) -> int:
    """The index in `replicas` of the one to send a prompt with block chain `chain` to.

    Only ready replicas, and among them only those at most `max_imbalance` requests busier than
    the least busy one, are candidates. The candidate holding the longest prefix of the chain
    wins; ties (and no hit anywhere) go to the least in flight, then to the one whose index
    names the fewest blocks (so new conversations spread over the replicas' caches), then to the
    first. Raises NoReadyReplica when none is ready.
    """
    ready = [i for i, r in enumerate(replicas) if r.ready]
    if not ready:
        raise NoReadyReplica(f"none of the {len(replicas)} replicas is ready")
    idlest = min(replicas[i].in_flight for i in ready)
    candidates = [i for i in ready if replicas[i].in_flight <= idlest + max_imbalance]

    def rank(i: int) -> tuple[int, int, int, int]:
        r = replicas[i]
        return (-r.prefixes.matched(chain), r.in_flight, len(r.prefixes), i)

    return min(candidates, key=rank)
