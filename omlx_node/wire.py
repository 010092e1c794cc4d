"""The pipeline's data-plane wire format: what one stage sends the next over mx.distributed.

Every pipeline step travels down the ring as up to three messages, in this order:

1. the step header: int32[HEADER_INTS], fixed shape, so a stage can always post its receive. Its
   first HEADER_FIELDS ints are the fields below; a payload of at most INLINE_PAYLOAD ints (every
   steady decode step's) rides in the rest, so such a step costs one message less: each message
   costs a fixed ~0.1-0.3 ms per hop, whatever its size;
2. the payload: int32[header.payload_len], only when it is longer than INLINE_PAYLOAD;
3. the hidden states: dtype of the model, shape (rows, tokens, hidden), only for PREFILL and
   DECODE steps with rows > 0. A stage receives them lazily: it builds its step's graph as soon
   as the header is in, and the device starts the moment the hidden states land.

The tail stage answers each DECODE step with rows > 0 by sending int32[rows] sampled token ids
to rank 0 (the ring's wrap-around link), and each LOOKUP step with int32[1]. Nothing else flows
back, so rank 0 reads the answers in the order it sent those steps.

Sends are asynchronous, on a CPU stream of their own: a stage goes on building its next step's
graph while the device computes the hidden states and the send waits for them, and a send never
queues a later receive (which runs on the default CPU stream) behind it. Both streams are in
order, so messages leave and are read in the order they were issued.

Header fields (int32 each; then the inline payload, zero-padded):
    0 MAGIC        guards against a peer that speaks another version or another plan
    1 op           PREFILL, DECODE, FREE, LOOKUP, TRIM or STOP
    2 step         the head's step counter (diagnostics)
    3 target       micro-batch id (DECODE) or sequence id (PREFILL, LOOKUP, TRIM)
    4 rows         rows of hidden states that follow
    5 tokens       tokens per row (the prefill chunk length; 1 for decode)
    6 payload_len  int32 count of the payload
    7 plan         the low 31 bits of the plan hash (every stage checks it)

DECODE payload: [n_keep, keep row indices..., n_admit, admitted records...] where `keep` lists the
rows of the micro-batch that stay (-1 for n_keep means "all rows stay") and each admitted record is
ADMIT_INTS ints: sequence id, then the sequence's sampling parameters (the tail samples), floats
carried as their int32 bit patterns. Admitted sequences join the end of the micro-batch, taking
over the KV their PREFILL steps left in each stage.
FREE payload: sequence ids whose prefill KV must be dropped (cancelled while prefilling).
LOOKUP payload: [held, the sequence's prompt tokens but the last...]: each stage restores the
longest prefix its prefix cache holds, lowers `held` to it and passes the step on; the tail
answers the minimum, the prefix every stage holds. The stages keep the tokens to store the
sequence's blocks once its prefill is done.
TRIM payload: [n]: keep only the first n restored tokens (the head's answer to LOOKUP).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from omlx_node.sampling import SamplingParams

# The ring backend moves bytes over TCP from host memory: its ops run on CPU streams, and MLX
# orders them after the device work that produced their inputs.
RECV_STREAM = mx.cpu


@functools.cache
def send_stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


MAGIC = 0x6F6D6C31  # "oml1"
HEADER_FIELDS = 8
HEADER_INTS = 64
INLINE_PAYLOAD = HEADER_INTS - HEADER_FIELDS
ADMIT_INTS = 8
PREFILL, DECODE, FREE, STOP, LOOKUP, TRIM = 1, 2, 3, 4, 5, 6


class WireError(RuntimeError):
    """A peer sent something this stage cannot understand: a bug or a mismatched peer."""


@dataclass
class Admit:
    seq_id: int
    sampling: SamplingParams

    def encode(self) -> list[int]:
        p = self.sampling
        floats = np.array([p.temperature, p.top_p, p.min_p], dtype=np.float32).view(np.int32)
        seed = np.array([p.seed or 0], dtype=np.uint64).view(np.int32)
        return [self.seq_id, *floats.tolist(), p.top_k, int(p.seed is not None), *seed.tolist()]

    @classmethod
    def decode(cls, ints: list[int]) -> "Admit":
        temperature, top_p, min_p = np.array(ints[1:4], dtype=np.int32).view(np.float32).tolist()
        seed = int(np.array(ints[6:8], dtype=np.int32).view(np.uint64)[0]) if ints[5] else None
        return cls(ints[0], SamplingParams(temperature=temperature, top_p=top_p, top_k=ints[4],
                                           min_p=min_p, seed=seed))


@dataclass
class Step:
    op: int
    step: int = 0
    target: int = 0
    rows: int = 0
    tokens: int = 0
    keep: list[int] | None = None  # DECODE: rows that stay; None = all
    admits: list[Admit] = field(default_factory=list)  # DECODE
    freed: list[int] = field(default_factory=list)  # FREE
    held: int = 0  # LOOKUP: the prefix every stage so far holds; TRIM: the one to keep
    prompt: list[int] = field(default_factory=list)  # LOOKUP

    def payload(self) -> list[int]:
        if self.op == DECODE:
            keep = [-1] if self.keep is None else [len(self.keep), *self.keep]
            return [*keep, len(self.admits), *(i for a in self.admits for i in a.encode())]
        if self.op == FREE:
            return list(self.freed)
        if self.op == LOOKUP:
            return [self.held, *self.prompt]
        if self.op == TRIM:
            return [self.held]
        return []


def send_step(step: Step, hidden: mx.array | None, plan: int, dst: int, group) -> None:
    payload = step.payload()
    fields = [MAGIC, step.op, step.step, step.target, step.rows, step.tokens, len(payload),
              plan & 0x7FFFFFFF]
    inline = payload if len(payload) <= INLINE_PAYLOAD else []
    header = fields + inline + [0] * (INLINE_PAYLOAD - len(inline))
    _send(mx.array(header, dtype=mx.int32), dst, group)
    if payload and not inline:
        _send(mx.array(payload, dtype=mx.int32), dst, group)
    if hidden is not None:
        _send(hidden, dst, group)


def _send(x: mx.array, dst: int, group) -> None:
    # One async_eval per message: messages in one eval may leave in any order.
    mx.async_eval(mx.distributed.send(x, dst, group=group, stream=send_stream()))


def flush() -> None:
    """Waits until every message sent so far has left (before a stage exits)."""
    mx.synchronize(send_stream())


def recv_step(plan: int, src: int, group, hidden_size: int, dtype: mx.Dtype
              ) -> tuple[Step, mx.array | None]:
    """Receives one step; the hidden states come back lazily (evaluated with the compute)."""
    header = _recv((HEADER_INTS,), mx.int32, src, group).tolist()
    magic, op, step_no, target, rows, tokens, payload_len, peer_plan = header[:HEADER_FIELDS]
    if magic != MAGIC:
        raise WireError(f"bad step header from rank {src}: {header[:HEADER_FIELDS]}")
    if peer_plan != plan & 0x7FFFFFFF:
        raise WireError(f"rank {src} runs plan {peer_plan:#x}, this stage {plan & 0x7FFFFFFF:#x}")
    if payload_len <= INLINE_PAYLOAD:
        payload = header[HEADER_FIELDS:HEADER_FIELDS + payload_len]
    else:
        payload = _recv((payload_len,), mx.int32, src, group).tolist()
    step = Step(op, step_no, target, rows, tokens)
    if op == DECODE:
        n_keep, rest = payload[0], payload[1:]
        if n_keep >= 0:
            step.keep, rest = rest[:n_keep], rest[n_keep:]
        n_admit, rest = rest[0], rest[1:]
        step.admits = [Admit.decode(rest[i * ADMIT_INTS:(i + 1) * ADMIT_INTS])
                       for i in range(n_admit)]
    elif op == FREE:
        step.freed = payload
    elif op == LOOKUP:
        step.held, step.prompt = payload[0], payload[1:]
    elif op == TRIM:
        step.held = payload[0]
    hidden = None
    if op in (PREFILL, DECODE) and rows > 0:
        hidden = _recv((rows, tokens, hidden_size), dtype, src, group)
    return step, hidden


def _recv(shape: tuple[int, ...], dtype: mx.Dtype, src: int, group) -> mx.array:
    return mx.distributed.recv(shape, dtype, src, group=group, stream=RECV_STREAM)


def send_tokens(tokens: mx.array, dst: int, group) -> None:
    _send(tokens.astype(mx.int32), dst, group)


def recv_token_array(rows: int, src: int, group) -> mx.array:
    """The tail's answer, lazily: evaluate it (or a graph that uses it) before the next receive
    is posted, or the two would swap."""
    return _recv((rows,), mx.int32, src, group)


def recv_tokens(rows: int, src: int, group) -> list[int]:
    return recv_token_array(rows, src, group).tolist()
