"""The pipeline's data-plane wire format: what one stage sends the next over mx.distributed.

Every pipeline step travels down the ring as up to three messages, in this order:

1. the step header: int32[HEADER_INTS], fixed shape, so a stage can always post its receive;
2. the payload: int32[header.payload_len], only when payload_len > 0 (decode ops, freed ids);
3. the hidden states: dtype of the model, shape (rows, tokens, hidden), only for PREFILL and
   DECODE steps with rows > 0.

The tail stage answers each DECODE step with rows > 0 by sending int32[rows] sampled token ids
to rank 0 (the ring's wrap-around link), and each LOOKUP step with int32[1]. Nothing else flows
back, so rank 0 reads the answers in the order it sent those steps.

Header fields (int32 each):
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

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from omlx_node.sampling import SamplingParams

# The ring backend moves bytes over TCP from host memory: its ops run on the CPU stream, and MLX
# orders them after the GPU work that produced their inputs.
STREAM = mx.cpu

MAGIC = 0x6F6D6C31  # "oml1"
HEADER_INTS = 8
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
    header = [MAGIC, step.op, step.step, step.target, step.rows, step.tokens, len(payload),
              plan & 0x7FFFFFFF]
    # Sequential evals: arrays sent in one eval may go out in any order.
    mx.eval(mx.distributed.send(mx.array(header, dtype=mx.int32), dst, group=group,
                                    stream=STREAM))
    if payload:
        mx.eval(mx.distributed.send(mx.array(payload, dtype=mx.int32), dst, group=group,
                                        stream=STREAM))
    if hidden is not None:
        mx.eval(mx.distributed.send(hidden, dst, group=group, stream=STREAM))


def recv_step(plan: int, src: int, group, hidden_size: int, dtype: mx.Dtype
              ) -> tuple[Step, mx.array | None]:
    """Receives one step; the hidden states come back lazily (evaluated with the compute)."""
    header = mx.distributed.recv((HEADER_INTS,), mx.int32, src, group=group,
                                 stream=STREAM).tolist()
    magic, op, step_no, target, rows, tokens, payload_len, peer_plan = header
    if magic != MAGIC:
        raise WireError(f"bad step header from rank {src}: {header}")
    if peer_plan != plan & 0x7FFFFFFF:
        raise WireError(f"rank {src} runs plan {peer_plan:#x}, this stage {plan & 0x7FFFFFFF:#x}")
    payload = (mx.distributed.recv((payload_len,), mx.int32, src, group=group,
                                     stream=STREAM).tolist()
               if payload_len else [])
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
        hidden = mx.distributed.recv((rows, tokens, hidden_size), dtype, src, group=group,
                                     stream=STREAM)
    return step, hidden


def send_tokens(tokens: mx.array, dst: int, group) -> None:
    mx.eval(mx.distributed.send(tokens.astype(mx.int32), dst, group=group, stream=STREAM))


def recv_tokens(rows: int, src: int, group) -> list[int]:
    return mx.distributed.recv((rows,), mx.int32, src, group=group, stream=STREAM).tolist()
