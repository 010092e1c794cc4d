#!/usr/bin/env python3
"""How long a token waits between the engine and the thread that streams it, in one process.

The engine thread (`Batcher.step` in a loop, as the worker runs it) puts each token on its
sequence's queue; a consumer thread per stream reads it, as the worker's gRPC handler threads
do. Both need the GIL: the consumer gets it when the engine blocks (waiting for the device) or,
when the engine never waits, at the interpreter's switch interval (5 ms). Prints, for 1 and 8
streams, the median and worst lag of each stream's first token (engine's emit time to the
consumer's read), and the median gap between a stream's tokens.

    python bench/diag_handoff.py [--layers 4] [--hidden 256] [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from omlx_node.batcher import Batcher, Finish, SeqRequest
    from omlx_node.metrics import NodeMetrics
    from omlx_node.stage import StageRunner
    from tests.tiny_models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "m", "llama", num_layers=args.layers,
                           hidden_size=args.hidden)
        batcher = Batcher(StageRunner(path), NodeMetrics())
        running = True

        def engine() -> None:
            while running:
                batcher.step(block=True)

        worker = threading.Thread(target=engine)
        worker.start()
        count = 0

        def streams(n: int, tokens: int) -> tuple[list[float], list[float]]:
            nonlocal count
            lags: list[float] = []
            gaps: list[float] = []

            def consume(seq) -> None:
                arrivals = []
                while not isinstance(seq.events.get(timeout=60), Finish):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 1:
                        lags.append(arrivals[0] - seq.first_token_time)
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

            readers = []
            for _ in range(n):
                count += 1
                prompt = [5 + (j * 7 + count) % 200 for j in range(32)]
                seq = batcher.submit(SeqRequest(f"r{count}", prompt, tokens))
                readers.append(threading.Thread(target=consume, args=(seq,)))
                readers[-1].start()
            for r in readers:
                r.join()
            return lags, gaps

        try:
            streams(1, 16)  # warm-up
            print(f"random llama, {args.layers} layers, hidden {args.hidden}; {args.tokens} "
                  f"tokens a stream, {args.rounds} rounds; switch interval "
                  f"{sys.getswitchinterval() * 1e3:.0f} ms")
            for n in (1, 8):
                lags, gaps = [], []
                for _ in range(args.rounds):
                    more_lags, more_gaps = streams(n, args.tokens)
                    lags += more_lags
                    gaps += more_gaps
                print(f"{n} stream(s): first token's handoff {statistics.median(lags) * 1e3:.3f} "
                      f"ms median, {max(lags) * 1e3:.2f} ms worst; gap between tokens "
                      f"{statistics.median(gaps) * 1e3:.2f} ms median")
        finally:
            running = False
            worker.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
