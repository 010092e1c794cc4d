"""What a node tells the planner about its machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys


def machine_memory() -> int:
    """Total memory in bytes (unified memory on a Mac)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def chip() -> str:
    """The processor's marketing name where the OS tells it (e.g. "Apple M4 Max")."""
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], text=True,
                                  capture_output=True, timeout=5).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
