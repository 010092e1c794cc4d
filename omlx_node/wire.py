"""The pipeline's data-plane wire format: what one stage sends the next over mx.distributed.

Every pipeline step travels down the ring as up to three messages, in this order:

1. the step header: int32[HEADER_INTS], fixed shape, so a stage can always post its receive. Its
   first HEADER_FIELDS ints are the fields below; a payload of at most INLINE_PAYLOAD ints (every
   steady decode step's) rides in the rest, so such a step costs one message less: each message
   costs a fixed latency per hop, whatever its size;
2. the payload: int32[header.payload_len], only when it is longer than INLINE_PAYLOAD;
3. the hidden states: dtype of the model, shape (rows, tokens, hidden), only for PREFILL and
   DECODE steps with rows > 0. A stage receives them lazily: it builds its step's graph as soon
   as the header is in, and the device starts the moment the hidden states land.

The tail stage answers each DECODE step with rows > 0 on the ring's wrap-around link to rank 0:

1. int32[rows + L + 1]: the sampled token ids, then the logprob records of the rows that ask for
   logprobs, in row order (`omlx_node.sampling.logprob_ints` says L; 0 when no row asks), then
   F, the number of rows whose sampling failed (their sampler, penalties or grammar mask raised,
   or their sampler could not be made at admission: `omlx_node.sampling.sample_rows`). A failed
   row's token and record are placeholders, valid ids the head may feed its next step with;
2. only when some of the step's rows are constrained (a grammar, which the tail applies):
   int32[constrained rows], each row's `omlx_node.constraints.Verdict` on its token, in row
   order, then for each ERROR verdict int32[ERROR_INTS], the matcher's error (UTF-8, zero
   padded, cut to fit). It leaves after the first: the matchers need the tokens on the host,
   and the head feeds its next step with the tokens before it reads the verdicts. A failed
   row's verdict is GO and means nothing;
3. only when F > 0: int32[F], the failed rows' indices, then for each int32[ERROR_INTS], its
   error, encoded as a verdict's. Only that row's client sees it.

A DECODE step of tokens = w > 1 verifies drafts (speculative decoding, omlx_node.speculation):
row i's w positions are its input, its draft, then filler. The tail answers it with
int32[rows * (w + 1) + 1] instead of the first message: for each row [n, n tokens, zeros to
w], the draft tokens that stood then the target's own next token (1 <= n <= w), then L, then
F. The logprob records follow the runs: for each row that asks for them, w records, one for each
token of its run then zeros (`omlx_node.sampling.logprob_ints` of its k, w times).

It answers each LOOKUP step with int32[1]. Nothing else flows back, so rank 0 reads the answers
in the order it sent those steps; it admitted every row, so it knows every length.

An idle stage sleeps on a doorbell: MLX's ring backend spins a core for as long as a receive is
posted, so a pipeline with nothing to do would burn one per stage. When the head has nothing in
flight it sends an IDLE step down the pipeline; a stage that has passed it on waits to be rung
(one byte over a plain TCP link beside the data plane, `Doorbell`) before it posts its next
receive, and rings the next stage before the first step it sends after that IDLE. So steps
cost nothing more while the pipeline works, and the first one after a pause wakes each stage
as it reaches it. The byte carries no data: the steps themselves travel over mx.distributed.

Sends are asynchronous, on a CPU stream of their own: a stage goes on building its next step's
graph while the device computes the hidden states and the send waits for them, and a send never
queues a later receive (which runs on the default CPU stream) behind it. Both streams are in
order, so messages leave and are read in the order they were issued.

Header fields (int32 each; then the inline payload, zero-padded):
    0 MAGIC        guards against a peer that speaks another version or another plan
    1 op           PREFILL, DECODE, FREE, LOOKUP, TRIM, STOP or IDLE
    2 step         the head's step counter (diagnostics)
    3 target       micro-batch id (DECODE) or sequence id (PREFILL, LOOKUP, TRIM)
    4 rows         rows of hidden states that follow
    5 tokens       tokens per row (the prefill chunk length; 1 for decode, 1 + the longest
                   draft for a step that verifies drafts)
    6 payload_len  int32 count of the payload
    7 plan         the low 31 bits of the plan hash (every stage checks it)

DECODE payload: [n_cut, cuts..., n_keep, keep row indices..., n_admit, admitted records...,
n_answers, answers..., drafts...] where `cuts` (n_cut = 0 or the rows of the micro-batch's last
step) says how many positions of that step each row drops from its KV before anything else:
what a verified step ran past the tokens that stood (the tail's answer says; every stage trims
on this header). `drafts`, only in a pipeline's step of tokens > 1: for each row [n, its n
draft tokens], which the tail verifies (a tensor stage's ranks need none). `keep` lists the rows of the micro-batch that stay (-1 for n_keep means "all rows stay"),
and an answer [row, n, n tokens] gives a leaving row's tokens, its prompt and what was sampled,
so that every stage's prefix cache keeps the KV the row computed past its prompt before the row
is dropped (only when the head keeps a prefix cache). An admitted record is
what the tail needs to sample the sequence, floats carried as their int32 bit patterns:
8 ints [sequence id, temperature, top_p, min_p, top_k, flags, seed (2 ints)], then, in
this order, only the parts its flags name, so a row that asks for none costs nothing more:
    PENALIZED  [presence, frequency, repetition penalty, n, the prompt's last n tokens] (what
               the penalties look at before the first sampled token)
    LOGPROBS   [top_logprobs]
    GRAMMAR    [n, the prompt's last n tokens (generated under the grammar before a failover),
               n_bytes, the grammar's UTF-8 bytes packed 4 per int32, little-endian]
Admitted sequences join the end of the micro-batch, taking over the KV their PREFILL steps left
in each stage.
FREE payload: sequence ids whose prefill KV must be dropped (cancelled while prefilling).
PREFILL payload: empty for one row (the pipeline's); a tensor-parallel stage's chunk of several
rows lists their sequence ids, then each row's token count where the rows are right-padded to
`tokens` (`omlx_node.tensor`).
LOOKUP payload: [held, the sequence's prompt tokens but the last...]: each stage restores the
longest prefix its prefix cache holds, lowers `held` to it and passes the step on; the tail
answers the minimum, the prefix every stage holds. The stages keep the tokens to store the
sequence's blocks once its prefill is done.
TRIM payload: [n]: keep only the first n restored tokens (the head's answer to LOOKUP).
"""

from __future__ import annotations

import functools
import secrets
import socket
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from omlx_node.constraints import Verdict
from omlx_node.sampling import SamplingParams

# The ring backend moves bytes over TCP from host memory: its ops run on CPU streams, and MLX
# orders them after the device work that produced their inputs.
RECV_STREAM = mx.cpu


@functools.cache
def send_stream() -> mx.Stream:
    return mx.new_stream(mx.cpu)


MAGIC = 0x6F6D6C32  # "oml2"
HEADER_FIELDS = 8
HEADER_INTS = 64
INLINE_PAYLOAD = HEADER_INTS - HEADER_FIELDS
SEEDED, PENALIZED, LOGPROBS, GRAMMAR = 1, 2, 4, 8  # an admitted record's flags
ERROR_INTS = 128
PREFILL, DECODE, FREE, STOP, LOOKUP, TRIM, IDLE = 1, 2, 3, 4, 5, 6, 7


class WireError(RuntimeError):
    """A peer sent something this stage cannot understand: a bug or a mismatched peer."""


def _float_ints(xs: list[float]) -> list[int]:
    return np.array(xs, dtype=np.float32).view(np.int32).tolist()


def _int_floats(xs: list[int]) -> list[float]:
    return np.array(xs, dtype=np.int32).view(np.float32).tolist()


def _pack_bytes(data: bytes) -> list[int]:
    return np.frombuffer(data + bytes(-len(data) % 4), dtype="<i4").tolist()


def _unpack_bytes(ints: list[int], n: int) -> bytes:
    return np.array(ints, dtype="<i4").tobytes()[:n]


class _Reader:
    """Reads a payload front to back."""

    def __init__(self, ints: list[int]):
        self.ints, self.at = ints, 0

    def take(self, n: int) -> list[int]:
        self.at += n
        return self.ints[self.at - n:self.at]

    def one(self) -> int:
        return self.take(1)[0]


@dataclass
class Admit:
    seq_id: int
    sampling: SamplingParams
    context: list[int] = field(default_factory=list)  # penalized: the prompt's last tokens
    grammar: str = ""
    resumed: list[int] = field(default_factory=list)  # tokens its grammar's matcher takes first

    def encode(self) -> list[int]:
        p = self.sampling
        flags = ((SEEDED if p.seed is not None else 0) | (PENALIZED if p.penalized else 0)
                 | (LOGPROBS if p.logprobs is not None else 0) | (GRAMMAR if self.grammar else 0))
        seed = np.array([p.seed or 0], dtype=np.uint64).view(np.int32).tolist()
        out = [self.seq_id, *_float_ints([p.temperature, p.top_p, p.min_p]), p.top_k, flags,
               *seed]
        if flags & PENALIZED:
            out += [*_float_ints([p.presence_penalty, p.frequency_penalty,
                                  p.repetition_penalty]), len(self.context), *self.context]
        if flags & LOGPROBS:
            out.append(p.logprobs)
        if flags & GRAMMAR:
            data = self.grammar.encode()
            out += [len(self.resumed), *self.resumed, len(data), *_pack_bytes(data)]
        return out

    @classmethod
    def read(cls, r: _Reader) -> Admit:
        seq_id = r.one()
        temperature, top_p, min_p = _int_floats(r.take(3))
        top_k, flags = r.take(2)
        seed = int(np.array(r.take(2), dtype=np.int32).view(np.uint64)[0])
        params = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                  "seed": seed if flags & SEEDED else None}
        context, grammar, resumed = [], "", []
        if flags & PENALIZED:
            params.update(zip(("presence_penalty", "frequency_penalty", "repetition_penalty"),
                              _int_floats(r.take(3))))
            context = r.take(r.one())
        if flags & LOGPROBS:
            params["logprobs"] = r.one()
        if flags & GRAMMAR:
            resumed = r.take(r.one())
            n = r.one()
            grammar = _unpack_bytes(r.take(-(-n // 4)), n).decode()
        return cls(seq_id, SamplingParams(**params), context, grammar, resumed)


@dataclass
class Step:
    op: int
    step: int = 0
    target: int = 0
    rows: int = 0
    tokens: int = 0
    keep: list[int] | None = None  # DECODE: rows that stay; None = all
    cuts: list[int] = field(default_factory=list)  # DECODE: positions each row drops first
    drafts: list[list[int]] = field(default_factory=list)  # DECODE of tokens > 1: each row's
    answers: dict[int, list[int]] = field(default_factory=dict)  # DECODE: leaving rows' tokens
    admits: list[Admit] = field(default_factory=list)  # DECODE
    freed: list[int] = field(default_factory=list)  # FREE
    held: int = 0  # LOOKUP: the prefix every stage so far holds; TRIM: the one to keep
    prompt: list[int] = field(default_factory=list)  # LOOKUP
    seqs: list[int] = field(default_factory=list)  # PREFILL of several rows: their sequences
    lengths: list[int] = field(default_factory=list)  # and each row's tokens, right-padded

    def payload(self) -> list[int]:
        if self.op == DECODE:
            keep = [-1] if self.keep is None else [len(self.keep), *self.keep]
            answers = [i for row, t in self.answers.items() for i in (row, len(t), *t)]
            drafts = [i for d in self.drafts for i in (len(d), *d)]
            return [len(self.cuts), *self.cuts, *keep, len(self.admits),
                    *(i for a in self.admits for i in a.encode()), len(self.answers), *answers,
                    *drafts]
        if self.op == FREE:
            return list(self.freed)
        if self.op == PREFILL:
            return [*self.seqs, *self.lengths]
        if self.op == LOOKUP:
            return [self.held, *self.prompt]
        if self.op == TRIM:
            return [self.held]
        return []

    def load(self, payload: list[int]) -> None:
        """Sets the fields `payload()` carries for this step's op."""
        if self.op == DECODE:
            r = _Reader(payload)
            self.cuts = r.take(r.one())
            n_keep = r.one()
            if n_keep >= 0:
                self.keep = r.take(n_keep)
            self.admits = [Admit.read(r) for _ in range(r.one())]
            for _ in range(r.one()):
                row = r.one()
                self.answers[row] = r.take(r.one())
            if r.at < len(payload):
                self.drafts = [r.take(r.one()) for _ in range(self.rows)]
        elif self.op == FREE:
            self.freed = payload
        elif self.op == PREFILL:
            self.seqs, self.lengths = payload[:self.rows], payload[self.rows:]
        elif self.op == LOOKUP:
            self.held, self.prompt = payload[0], payload[1:]
        elif self.op == TRIM:
            self.held = payload[0]


def encode_header(step: Step, plan: int) -> tuple[list[int], list[int]]:
    """The step's header, and its payload when that does not ride inline in it ([] if it does)."""
    payload = step.payload()
    fields = [MAGIC, step.op, step.step, step.target, step.rows, step.tokens, len(payload),
              plan & 0x7FFFFFFF]
    inline = payload if len(payload) <= INLINE_PAYLOAD else []
    return fields + inline + [0] * (INLINE_PAYLOAD - len(inline)), payload if not inline else []


def decode_header(header: list[int], plan: int, sender: str) -> tuple[Step, int]:
    """The step a header starts, with its inline payload loaded; and the length of the payload
    still to read (0: none follows). `sender` names the peer in errors."""
    magic, op, step_no, target, rows, tokens, payload_len, peer_plan = header[:HEADER_FIELDS]
    if magic != MAGIC:
        raise WireError(f"bad step header from {sender}: {header[:HEADER_FIELDS]}")
    if peer_plan != plan & 0x7FFFFFFF:
        raise WireError(f"{sender} runs plan {peer_plan:#x}, this stage {plan & 0x7FFFFFFF:#x}")
    step = Step(op, step_no, target, rows, tokens)
    if payload_len > INLINE_PAYLOAD:
        return step, payload_len
    step.load(header[HEADER_FIELDS:HEADER_FIELDS + payload_len])
    return step, 0


def send_step(step: Step, hidden: mx.array | None, plan: int, dst: int, group) -> None:
    header, payload = encode_header(step, plan)
    _send(mx.array(header, dtype=mx.int32), dst, group)
    if payload:
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
    """Receives one step; the hidden states come back lazily (evaluated with the compute).
    `hidden_size` 0: token ids (rows, tokens) instead, which the first rank of a tensor stage
    that embeds passes on to the others (omlx_node/sub_group.py)."""
    header = _recv((HEADER_INTS,), mx.int32, src, group).tolist()
    step, payload_len = decode_header(header, plan, f"rank {src}")
    if payload_len:
        step.load(_recv((payload_len,), mx.int32, src, group).tolist())
    hidden = None
    if step.op in (PREFILL, DECODE) and step.rows > 0:
        shape = (step.rows, step.tokens, hidden_size)
        hidden = _recv(shape if hidden_size else shape[:2], dtype, src, group)
    return step, hidden


def _recv(shape: tuple[int, ...], dtype: mx.Dtype, src: int, group) -> mx.array:
    return mx.distributed.recv(shape, dtype, src, group=group, stream=RECV_STREAM)


def send_tokens(tokens: mx.array, dst: int, group) -> None:
    """The tail's answer to a LOOKUP."""
    _send(tokens.astype(mx.int32), dst, group)


def send_answer(tokens: mx.array, records: mx.array | None, failed: int, dst: int,
                group) -> None:
    """The tail's answer to a DECODE step: token ids, the logprob records of the rows that ask,
    and how many rows failed."""
    parts = [tokens.astype(mx.int32), mx.array([failed], dtype=mx.int32)]
    if records is not None:
        parts.insert(1, records)
    _send(mx.concatenate(parts), dst, group)


def send_runs(runs: list[list[int]], width: int, records: list[int], failed: int, dst: int,
              group) -> None:
    """The tail's answer to a DECODE step that verified drafts of `width` positions a row:
    each row's run of tokens (what stood of its draft, then its own next token), the logprob
    records of the rows that ask (`width` each), and how many rows failed."""
    ints = [i for run in runs for i in (len(run), *run, *[0] * (width - len(run)))]
    _send(mx.array([*ints, *records, failed], dtype=mx.int32), dst, group)


def recv_runs(rows: int, width: int, records: int, src: int, group
              ) -> tuple[list[list[int]], list[int], int]:
    """`send_runs`' message (`records`: the ints of its logprob records): each row's run, the
    records, and how many rows failed."""
    ints = _recv((rows * (width + 1) + records + 1,), mx.int32, src, group).tolist()
    at = [i * (width + 1) for i in range(rows)]
    return ([ints[a + 1:a + 1 + ints[a]] for a in at], ints[rows * (width + 1):-1], ints[-1])


def recv_tokens(rows: int, src: int, group) -> list[int]:
    return _recv((rows,), mx.int32, src, group).tolist()


def recv_answer(rows: int, records: int, src: int, group) -> mx.array:
    """`send_answer`'s message (`records`: the ints of its logprob records), lazily: evaluate it
    (or a graph that uses it) before the next receive is posted, or the two would swap."""
    return _recv((rows + records + 1,), mx.int32, src, group)


def _send_error(error: str, dst: int, group) -> None:
    data = _pack_bytes(error.encode()[:ERROR_INTS * 4])
    _send(mx.array(data + [0] * (ERROR_INTS - len(data)), dtype=mx.int32), dst, group)


def _recv_error(src: int, group) -> str:
    data = _unpack_bytes(_recv((ERROR_INTS,), mx.int32, src, group).tolist(), ERROR_INTS * 4)
    return data.rstrip(b"\0").decode(errors="ignore")  # a cut may split a character


def send_verdicts(verdicts: list[tuple[Verdict, str]], dst: int, group) -> None:
    """The grammar verdicts of a DECODE step's constrained rows, with their errors."""
    _send(mx.array([int(v) for v, _ in verdicts], dtype=mx.int32), dst, group)
    for verdict, error in verdicts:
        if verdict == Verdict.ERROR:
            _send_error(error, dst, group)


def recv_verdicts(n: int, src: int, group) -> list[tuple[Verdict, str]]:
    return [(Verdict(v), _recv_error(src, group) if v == Verdict.ERROR else "")
            for v in _recv((n,), mx.int32, src, group).tolist()]


def send_failures(failed: dict[int, str], dst: int, group) -> None:
    """The rows of a DECODE step that failed (by index in the step) and their errors."""
    _send(mx.array(list(failed), dtype=mx.int32), dst, group)
    for error in failed.values():
        _send_error(error, dst, group)


def recv_failures(n: int, src: int, group) -> dict[int, str]:
    return {i: _recv_error(src, group) for i in _recv((n,), mx.int32, src, group).tolist()}


TOKEN_BYTES = 16  # what a stage's upstream presents on its doorbell link


class Doorbell:
    """One end of the doorbell link from a stage to the next one (see the module's docstring).
    Both ends track, from the steps that cross the link, whether the receiving stage sleeps."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.asleep = True  # a stage sleeps until its first step

    def ring(self) -> None:
        try:
            self.sock.sendall(b"\1")
        except OSError:
            # The next stage is gone. The step's own sends fail on it too, where the pipeline
            # handles a lost stage; a raise here could come from outside the head's step guard.
            pass

    def wait(self) -> None:
        """Sleeps until the previous stage rings."""
        if not self.sock.recv(1):
            raise ConnectionError("the previous stage closed its doorbell link: it is gone")


def send_rung(step: Step, hidden: mx.array | None, plan: int, dst: int, group,
              doorbell: Doorbell) -> None:
    """`send_step`, ringing `dst` first if it sleeps."""
    if doorbell.asleep:
        doorbell.ring()
    send_step(step, hidden, plan, dst, group)
    doorbell.asleep = step.op == IDLE


def recv_rung(plan: int, src: int, group, hidden_size: int, dtype: mx.Dtype,
              doorbell: Doorbell) -> tuple[Step, mx.array | None]:
    """`recv_step`, first asleep until `src` rings if an IDLE step came last."""
    if doorbell.asleep:
        doorbell.wait()
    step, hidden = recv_step(plan, src, group, hidden_size, dtype)
    doorbell.asleep = step.op == IDLE
    return step, hidden


def link_doorbells(group, peers: tuple[str, ...], timeout: float
                   ) -> tuple[Doorbell | None, Doorbell | None]:
    """Links every stage to the next one's doorbell; returns this rank's (upstream: the one it
    waits on, None on the head; downstream: the one it rings, None on the tail). A stage listens
    on its peer address's host and sends the previous rank the port and a random token over the
    data plane: only a connection that presents the token is taken for its upstream."""
    rank, size = group.rank(), group.size()
    listener, token = None, b""
    if rank > 0:
        host = _host(peers[rank])
        listener = socket.create_server((host, 0), family=_family(host))
        token = secrets.token_bytes(TOKEN_BYTES)
        offer = [listener.getsockname()[1], *np.frombuffer(token, dtype="<i4").tolist()]
        _send(mx.array(offer, dtype=mx.int32), rank - 1, group)
    downstream = None
    if rank < size - 1:
        port, *key = _recv((1 + TOKEN_BYTES // 4,), mx.int32, rank + 1, group).tolist()
        sock = socket.create_connection((_host(peers[rank + 1]), port), timeout)
        sock.sendall(np.array(key, dtype="<i4").tobytes())
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a lone byte must not wait
        downstream = Doorbell(sock)
    upstream = _accept(listener, token, timeout) if listener is not None else None
    return upstream, downstream


def _host(peer: str) -> str:
    return peer.rsplit(":", 1)[0].strip("[]")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _accept(listener: socket.socket, token: bytes, timeout: float) -> Doorbell:
    """The first connection to `listener` that presents `token`; any other is dropped."""
    deadline = time.monotonic() + timeout
    with listener:
        while (left := deadline - time.monotonic()) > 0:
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                break
            conn.settimeout(left)
            try:
                presented = _read_exactly(conn, len(token))
            except OSError:
                presented = b""
            if secrets.compare_digest(presented, token):
                conn.settimeout(None)
                return Doorbell(conn)
            conn.close()
    raise TimeoutError(f"the previous stage did not link its doorbell within {timeout:.0f}s")


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    """`n` bytes, or fewer if the peer closed first."""
    data = b""
    while len(data) < n and (chunk := conn.recv(n - len(data))):
        data += chunk
    return data
