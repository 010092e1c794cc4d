"""The heap a long-lived process builds while it starts, kept out of the garbage collector's way.

A full (generation 2) collection walks every object the collector tracks. A gateway or a shard
worker holds hundreds of thousands from its start (mlx-lm's, transformers' and gRPC's modules, a
tokenizer's vocabulary, FastAPI's routes), none of them garbage, and walking them is slow on a
small machine (bench/results/gc-cpu.md): a pause of every stream, or of the engine between two
steps, whenever enough allocation set one off. Once a process has started, freezing what it holds
(as vLLM does) leaves a full collection only what was made since.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects once, then moves every object still alive where no collection walks it. For the
    end of a process's start; calling it again later (after more was loaded) freezes that too."""
    gc.collect()
    gc.freeze()
