"""Small filesystems of their own for the full-disk tests and the soak: a tmpfs mounted for a
while, and a file that takes all but a few bytes of a filesystem's free space."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def tmpfs_unavailable() -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "mounting a tmpfs needs root on Linux"
    return None


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` for the duration (raises CalledProcessError when the
    mount fails)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True, text=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path, leave: int) -> int:
    """A file at `path` that leaves `leave` bytes of its filesystem free (fallocate: no data
    written); its size. Remove the file to give the space back."""
    free = shutil.disk_usage(path.parent).free
    size = max(0, free - leave)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return size
