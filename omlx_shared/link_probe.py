"""Bandwidth and latency of the data plane between two machines, measured the way a pipeline
uses it: a two-rank `mx.distributed` group over the ring backend (TCP), formed without
`mlx.launch` exactly as a shard worker forms its group (MLX_RANK and MLX_HOSTFILE, a JSON list
of each rank's "host:port"), then timed send/recv of a small and a large message.

`run_rank` runs one rank in a child process, because MLX's ring init holds the GIL while it
waits for its peer: only another process can bound that wait, and say which peer never came.
Rank 0 measures; both ranks must run at once, each listening on its own address.
`omlx-cluster link-probe` runs a rank by hand; `omlx-cluster doctor` runs both ranks on two
ring neighbours over SSH.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_BYTES = 8 << 20  # large enough that the transfer, not the round trip, dominates
DEFAULT_ROUNDS = 10
PINGS = 20


@dataclass(frozen=True)
class LinkMeasurement:
    gb_per_s: float  # GB/s (1e9 bytes) of the large message, one way
    latency_us: float  # one-way latency of a 1-byte message (half the fastest round trip)
    nbytes: int  # size of the large message

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


class ProbeError(RuntimeError):
    """The probe could not measure; the message names the rank and the peer it missed."""


def run_rank(rank: int, peers: list[str], nbytes: int = DEFAULT_BYTES,
             rounds: int = DEFAULT_ROUNDS, timeout: float = 30.0) -> LinkMeasurement | None:
    """Runs rank `rank` (0 or 1) of the probe between `peers` (rank 0's and rank 1's
    "host:port", each the address that rank listens on) and returns rank 0's measurement, None
    on rank 1. Raises ProbeError when the group does not form and measure within `timeout`
    seconds, or a rank fails."""
    if rank not in (0, 1) or len(peers) != 2:
        raise ValueError(f"a link probe is rank 0 or 1 of two peers, got rank {rank} of {peers}")
    peer = peers[1 - rank]
    with tempfile.TemporaryDirectory(prefix="omlx-link-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[p] for p in peers]))
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        try:
            done = subprocess.run(
                [sys.executable, "-m", "omlx_shared.link_probe", str(nbytes), str(rounds)],
                env=env, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise ProbeError(f"rank {rank} on {peers[rank]}: no link with {peer} within "
                             f"{timeout:.0f} s (is the other rank running, and {peer} reachable "
                             "through the firewalls?)") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ProbeError(f"rank {rank} on {peers[rank]} with {peer}: {reason}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return LinkMeasurement(**result) if result else None


def _measure(nbytes: int, rounds: int) -> dict | None:
    """One rank of the probe (this process's MLX_RANK); rank 0 returns the measurement."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="ring")
    rank, peer = group.rank(), 1 - group.rank()
    large, small = mx.zeros((nbytes,), dtype=mx.uint8), mx.zeros((1,), dtype=mx.uint8)
    mx.eval(large, small)  # made before the clock starts, not inside the first send

    def round_trip(payload: mx.array) -> float:
        """Rank 0 sends `payload` and waits for a 1-byte answer; rank 1 mirrors it."""
        start = time.perf_counter()
        if rank == 0:
            mx.eval(mx.distributed.send(payload, peer, group=group))
            mx.eval(mx.distributed.recv_like(small, peer, group=group))
        else:
            mx.eval(mx.distributed.recv_like(payload, peer, group=group))
            mx.eval(mx.distributed.send(small, peer, group=group))
        return time.perf_counter() - start

    # Sends run on the CPU stream, as the pipeline's do (omlx_node/wire.py).
    with mx.stream(mx.cpu):
        round_trip(large)  # warm-up: buffers, allocations, TCP slow start
        # The fastest ping is the link's latency (a slower one waited on a busy CPU); the
        # median transfer is what a pipeline step can count on.
        ping = min(round_trip(small) for _ in range(PINGS))
        transfer = statistics.median(round_trip(large) for _ in range(rounds))
    if rank != 0:
        return None
    # A large round trip is the transfer plus about one small round trip of latency.
    seconds = max(transfer - ping, 1e-9)
    return LinkMeasurement(gb_per_s=nbytes / seconds / 1e9, latency_us=ping / 2 * 1e6,
                           nbytes=nbytes).to_dict()


if __name__ == "__main__":  # the child process of run_rank
    print(json.dumps(_measure(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
