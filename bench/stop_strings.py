#!/usr/bin/env python3
"""The stop-string matcher's cost a token, ours (KMP states advanced over the new text) against
the scan it replaced (every stop string's prefixes against the held tail, each token), on the
gateway's event loop: typical stop strings over prose, and an adversarial set (16 stop strings
of 1,024 characters whose starts the output keeps matching). Medians of `--runs`.

    python -m bench.stop_strings [--tokens 2000] [--runs 5] [--out bench/results]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from omlx_coordinator.request.stop_strings import StopMatcher


class ScanMatcher:
    """The matcher before (omlx_coordinator/request/stop_strings.py at 6de3fce): each token, find()
    for every stop string, then each one's prefixes tried against the held text's end."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = [s for s in stops if s], ""

    def feed(self, delta: str) -> tuple[str, bool]:
        self.pending += delta
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at = min(hits)[0]
            out, self.pending = self.pending[:at], ""
            return out, True
        hold, p = 0, self.pending
        for s in self.stops:
            for k in range(min(len(s) - 1, len(p)), hold, -1):
                if p[-k] == s[0] and p.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


WORKLOADS = {
    # Two agent-style stop strings over prose, a word a token.
    "typical": (["</answer>", "\n\nUser:"], " word"),
    # The output is "aaaa...": every stop string starts with "a" and keeps a long tail held.
    "adversarial": ([("a" + chr(0x41 + i) * 1023) for i in range(15)] + ["a" * 1023 + "z"],
                    "a"),
}


def ms_a_token(cls, stops: list[str], piece: str, tokens: int) -> float:
    m = cls(stops)
    t0 = time.perf_counter()
    for _ in range(tokens):
        m.feed(piece)
    return (time.perf_counter() - t0) / tokens * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write stop-strings-<tag>.md here")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    lines = [f"# Stop-string matcher, ms a token ({args.tag})", "",
             f"- machine: {platform.processor() or platform.machine()}, Python "
             f"{platform.python_version()}; {args.tokens} tokens, median of {args.runs} runs", "",
             "| workload | ours (KMP) | scan (before) | scan / ours |", "| --- | ---: | ---: | ---: |"]
    for name, (stops, piece) in WORKLOADS.items():
        ours = statistics.median(ms_a_token(StopMatcher, stops, piece, args.tokens)
                                 for _ in range(args.runs))
        scan = statistics.median(ms_a_token(ScanMatcher, stops, piece, args.tokens)
                                 for _ in range(args.runs))
        lines.append(f"| {name} | {ours:.4f} | {scan:.4f} | {scan / ours:.1f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        (args.out / f"stop-strings-{args.tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
