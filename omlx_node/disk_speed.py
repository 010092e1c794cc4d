"""How fast this node's SSD reads, for the planner's NodeSpec.disk_gbps: what a stage whose
layers stream from disk (omlx_node/layer_stream.py) pays at every step.

Measured once per disk (kept beside the calibration, keyed by the device), and only on a node
with a --weights-memory cap, the one that may stream: 256 MiB written into the weight store's
folder, flushed, pushed out of the page cache, and read back sequentially as a streamed layer is.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_BYTES = 256 << 20
_CHUNK = 8 << 20


def measure_disk(folder: Path, size: int = PROBE_BYTES) -> float:
    """Cold sequential read speed of the disk under `folder`, in GB/s."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".disk-probe-{os.getpid()}"
    block = os.urandom(_CHUNK)
    try:
        with open(probe, "wb") as f:
            for _ in range(size // _CHUNK):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(probe, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # Linux: drop it from the page cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:  # macOS: read past the cache
                import fcntl

                fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
            buf = bytearray(_CHUNK)
            t0 = time.perf_counter()
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            return size / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)
    finally:
        probe.unlink(missing_ok=True)


def node_disk_speed(cache: Path, folder: Path, remeasure: bool = False) -> float:
    """The disk speed under `folder` in GB/s, measured once per device and kept in `cache`;
    0.0 (the planner then assumes a typical SSD) if it cannot be measured, with a warning."""
    try:
        # A first join has no store yet (nor, maybe, a home): the device is its nearest folder's.
        present = next(p for p in (folder, *folder.parents) if p.exists())
        device = str(os.stat(present).st_dev)
        saved = json.loads(cache.read_text()) if cache.exists() and not remeasure else {}
        if saved.get(device, 0) > 0:
            return float(saved[device])
        speed = measure_disk(folder)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({**saved, device: speed}))
        return speed
    except (OSError, ValueError) as e:
        log.warning("could not measure the disk under %s (the planner counts a typical SSD for "
                    "streamed layers): %s", folder, e)
        return 0.0
