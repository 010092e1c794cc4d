"""One request inside a node's engine: what is asked (SeqRequest), the state the engine keeps
for it (Sequence), how its stream ends (Finish), and where the events of sequences that share
one reader go (Outbox). The engines (batcher.py, pipeline.py, tensor.py) and the worker's
session (session.py) share these."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from omlx_node.constraints import GrammarMatcher
from omlx_node.sampling import PENALTY_CONTEXT, Logprob, SamplingParams
from omlx_node.speculation import Proposer, SpecStats
from omlx_node.wait_parts import Wait

_seq_ids = itertools.count(1)


@dataclass(frozen=True)
class SeqRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    grammar: str = ""  # an llguidance grammar (omlx_node.constraints); "": unconstrained
    resumed_tokens: int = 0  # the prompt's last ones were generated under `grammar` already
    prediction: tuple[int, ...] = ()  # OpenAI's predicted output: drafts (omlx_node.speculation)

    @property
    def resumed(self) -> list[int]:
        """The tokens a grammar's matcher takes before the first sampled one."""
        return self.prompt[len(self.prompt) - self.resumed_tokens:] if self.grammar else []

    @property
    def penalty_context(self) -> list[int]:
        """What a penalized sequence's penalties look at before its first token."""
        return self.prompt[-PENALTY_CONTEXT:] if self.sampling.penalized else []


@dataclass
class Finish:
    """The last event of a sequence's stream. `reason`: "stop", "length", "cancelled",
    "error" (this sequence failed: `error` is its own), "aborted" (the engine stopped, as for a
    new plan: safe to run again) or "lost" (the node failed under it, e.g. a stage of its
    pipeline was lost: the worker goes down, and the coordinator may run it again elsewhere)."""

    reason: str
    error: str = ""


class Outbox:
    """Where the engine hands the events of sequences that share one reader (a worker's
    session): each step's events of them all as one list of (sequence, event), so the reader
    wakes once a step, not once a token. A list holding a sequence's first token or its end
    sets `urgent`: a reader that holds steps back to send several at once (`Session`) must
    not hold those, which a client waits for."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self.urgent = threading.Event()

    def put(self, item: object, urgent: bool = True) -> None:
        self._items.put(item)
        if urgent:
            self.urgent.set()

    def get(self, timeout: float | None = None) -> object:
        """The oldest item; raises queue.Empty after `timeout` seconds without one."""
        return self._items.get(timeout=timeout)

    def get_nowait(self) -> object:
        return self._items.get_nowait()


class Sequence:
    """One request inside the engine. Its events are ints (tokens) and then one Finish: in
    `events`, or in its `outbox`; when the request asked for logprobs, each token's is in
    `logprobs` before the token is out."""

    def __init__(self, req: SeqRequest, matcher: GrammarMatcher | None = None,
                 outbox: Outbox | None = None):
        self.req = req
        self.sid = next(_seq_ids) & 0x7FFFFFFF  # int32 on the wire
        self.events: queue.Queue[int | Finish] = queue.Queue()
        self.outbox = outbox
        self.logprobs: deque[Logprob] = deque()
        self.matcher = matcher  # its grammar's, compiled at submit (a pipeline's tail has its own)
        self.prefilled = 0
        self.cached = 0  # prompt tokens restored from the prefix cache
        self.looked_up = False  # the prefix cache was asked (and answered)
        self.held = -1  # before `looked_up`: the prompt tokens the cache held at a look ahead
        self.lookup_sent = False  # (pipeline head) the stages were asked
        self.generated = 0
        self.sampled: list[int] = []  # every token sampled for it, a stop token included
        self.input_is_prompt = True  # its decode input is still the last prompt token
        self.cancelled = False
        self.finished = False  # its Finish is out; a pipeline drops its row at the next step
        self.submitted = time.perf_counter()
        self.prefill_started = 0.0  # 0: still queued
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.wait = Wait()  # where its time to a first token went (wait_parts.py)
        self.proposer: Proposer | None = None  # drafts its tokens (set when it joins a batch)
        self.spec = SpecStats()

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def to_prefill(self) -> list[int]:
        return self.req.prompt[:-1]

    @property
    def fed(self) -> list[int]:
        """The tokens its KV holds, in order, once it decodes: its prompt, then each sampled
        token that a later step took as input (the last one or two may not have run yet)."""
        return self.req.prompt + self.sampled
