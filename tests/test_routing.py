"""Cache-aware routing between replicas (omlx_coordinator/models/routing.py) over the block names of
omlx_shared/block_hashes.py, which the node's KV cache names its blocks by. Pure: no MLX."""

from __future__ import annotations

import random

import pytest

from omlx_coordinator.models.routing import NoReadyReplica, PrefixIndex, Replica, choose_replica
from omlx_shared.block_hashes import block_hashes

MODEL = "org/model"
BS = 4


def chain(tokens: list[int]) -> list[str]:
    return block_hashes(MODEL, tokens, BS)


def serve(replicas: list[Replica], prompt: list[int], output: list[int]) -> int:
    """Route a request, and record what it left cached, as the coordinator does."""
    i = choose_replica(chain(prompt), replicas)
    replicas[i].prefixes.record(chain(prompt + output))
    return i


def conversation(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(length)]


def test_block_names_are_the_ones_the_node_stores_its_blocks_under() -> None:
    # The names are an on-disk format (block files are found by them): pinned here, to the values
    # the function gave before it moved out of omlx_node/kv_cache/blocks.py.
    assert block_hashes("org/model", list(range(40)), 16) == [
        "2510df10783d29b6a0d5b5cfd518623f784dec26673f0f6b4add183dcc607b38",
        "f85816eddb33aa76cadbfa3e2309a2f996d25a92c587a5d63429f3bf7bf760f0",
    ]
    assert block_hashes("m", [0, 1, 2**40, -5], 2) == [
        "3c34c6f4a92703ffa468fcd324009526d757cfdd03d6838b4a86066e298a60a0",
        "508761e5cf35b546b3c246ddf970a6e5867d36954574160c06bf972e2050c65c",
    ]
    assert block_hashes("m", list(range(3)), 4) == []
    with pytest.raises(ValueError):
        block_hashes("m", [1], 0)


def test_a_repeated_conversation_lands_on_the_replica_holding_it() -> None:
    rng = random.Random(1)
    replicas = [Replica() for _ in range(3)]
    prompts = [conversation(rng, 40) for _ in range(3)]
    first = [serve(replicas, p, conversation(rng, 8)) for p in prompts]
    assert sorted(first) == [0, 1, 2]  # distinct conversations spread over the replicas
    for p, home in zip(prompts, first):
        replicas[(home + 1) % 3].in_flight = 2  # another replica is busier: the cache still wins
        assert choose_replica(chain(p), replicas) == home
        replicas[(home + 1) % 3].in_flight = 0


def test_a_continued_conversation_follows_its_earlier_turns() -> None:
    rng = random.Random(2)
    replicas = [Replica() for _ in range(4)]
    talks = {name: conversation(rng, 30) for name in "abcd"}
    homes = {}
    for turn in range(4):
        for name, history in talks.items():
            output = conversation(rng, 10)
            where = serve(replicas, history, output)
            assert homes.setdefault(name, where) == where, f"{name} moved at turn {turn}"
            history += output + conversation(rng, 6)  # the next user message
    assert sorted(homes.values()) == [0, 1, 2, 3]


def test_the_longest_prefix_wins_ties_go_to_the_least_loaded() -> None:
    rng = random.Random(3)
    system = conversation(rng, 16)  # a shared system prompt: 4 blocks
    replicas = [Replica() for _ in range(3)]
    replicas[0].prefixes.record(chain(system))
    replicas[1].prefixes.record(chain(system + conversation(rng, 8)))
    asked = chain(system + conversation(rng, 8))
    replicas[0].in_flight, replicas[1].in_flight = 2, 1
    assert choose_replica(asked, replicas) == 1  # both hold 4 blocks: the less busy one
    replicas[1].in_flight = 3
    assert choose_replica(asked, replicas) == 0
    mine = chain(system + [7] * 8)
    replicas[2].prefixes.record(mine)
    assert choose_replica(mine, replicas) == 2  # 6 blocks beat 4


def test_no_hit_goes_to_the_least_loaded_then_the_emptiest_cache() -> None:
    replicas = [Replica(in_flight=n) for n in (2, 1, 1)]
    replicas[1].prefixes.record(chain(list(range(8))))
    assert choose_replica(chain([9] * 8), replicas) == 2
    replicas[2].in_flight = 5
    assert choose_replica(chain([9] * 8), replicas) == 1
    assert choose_replica([], [Replica(), Replica()]) == 0  # a prompt shorter than a block


def test_concurrent_distinct_conversations_spread_by_load() -> None:
    rng = random.Random(4)
    replicas = [Replica() for _ in range(3)]
    for _ in range(9):  # nine requests in flight at once, none finished
        i = choose_replica(chain(conversation(rng, 20)), replicas)
        replicas[i].in_flight += 1
    assert [r.in_flight for r in replicas] == [3, 3, 3]


def test_a_busy_holder_gives_way_past_the_imbalance_limit() -> None:
    rng = random.Random(5)
    prompt = conversation(rng, 32)
    replicas = [Replica(), Replica()]
    replicas[0].prefixes.record(chain(prompt))
    replicas[0].in_flight = 4
    assert choose_replica(chain(prompt), replicas) == 0
    assert choose_replica(chain(prompt), replicas, max_imbalance=3) == 1
    replicas[0].in_flight = 5
    assert choose_replica(chain(prompt), replicas) == 1  # default limit 4


def test_a_replica_not_ready_is_never_chosen() -> None:
    rng = random.Random(6)
    prompt = conversation(rng, 32)
    replicas = [Replica(), Replica(), Replica()]
    replicas[1].prefixes.record(chain(prompt))
    replicas[1].ready = False
    replicas[0].in_flight = 1
    assert choose_replica(chain(prompt), replicas) == 2
    replicas[2].ready = False
    assert choose_replica(chain(prompt), replicas) == 0
    replicas[0].ready = False
    with pytest.raises(NoReadyReplica):
        choose_replica(chain(prompt), replicas)
    with pytest.raises(NoReadyReplica):
        choose_replica(chain(prompt), [])


def test_the_index_is_bounded_and_forgets_the_least_recent_first() -> None:
    rng = random.Random(7)
    index = PrefixIndex(capacity=20)
    talks = [chain(conversation(rng, 5 * BS)) for _ in range(30)]  # 5 blocks each
    for c in talks:
        index.record(c)
        assert len(index) <= 20
    assert len(index) == 20
    assert [index.matched(c) for c in talks[-4:]] == [5, 5, 5, 5]
    assert all(index.matched(c) == 0 for c in talks[:-4])
    index.record(talks[-4])  # used again: now the most recent
    index.record(chain(conversation(rng, 5 * BS)))
    assert index.matched(talks[-4]) == 5 and index.matched(talks[-3]) == 0


def test_a_chain_longer_than_the_index_keeps_its_start() -> None:
    index = PrefixIndex(capacity=8)
    long = chain(list(range(30 * BS)))
    index.record(long)
    assert len(index) == 8 and index.matched(long) == 8
    # An older chain's tail goes before its start: a prefix stays matchable as long as possible.
    index = PrefixIndex(capacity=6)
    a, b = chain(list(range(4 * BS))), chain(list(range(100, 100 + 3 * BS)))
    index.record(a)
    index.record(b)
    assert index.matched(a) == 3 and index.matched(b) == 3
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


def test_the_coordinator_and_the_node_name_blocks_alike() -> None:
    # The node's KV cache imports the same function (the coordinator must not import omlx_node,
    # so it lives in omlx_shared); the node package is importable where MLX is.
    kv_cache = pytest.importorskip("omlx_node.kv_cache")
    assert kv_cache.block_hashes is block_hashes
