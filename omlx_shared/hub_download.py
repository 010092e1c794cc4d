"""Files of one hub repository revision downloaded so that any interruption resumes.

huggingface_hub 2.x writes each file to a process-unique temporary name and deletes it when the
download fails, so a download cut off by Ctrl-C, a crash or a dropped network started that file
again from its first byte on the next run (a 20 GB safetensors shard lost with it). Here each
file is received into `NAME.part` beside its final name and renamed once whole; the next attempt,
in the same run or a later one, asks the hub only for the bytes after what `.part` holds (an HTTP
Range request). The hub's own session, headers (token, user agent) and URLs are used, so
HF_TOKEN, `hf auth login`, HF_ENDPOINT and proxies work as in huggingface_hub.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tqdm import tqdm

from omlx_shared.private_files import private_opener

# Attempts per file within one run before giving up (a later run resumes from the same .part).
ATTEMPTS = 5
# The wait before a file's second attempt, doubled before each later one (up to 4 s): a hub
# that dropped one connection is given a moment, one that keeps failing a little longer.
FIRST_RETRY_SECONDS = 0.25
CHUNK = 1 << 20


class DownloadError(OSError):
    """A file could not be completed in this run; what was received is kept for the next."""


def download_files(repo_id: str, revision: str, names: dict[str, int], folder: Path,
                   endpoint: str, bar_class: type[tqdm]) -> None:
    """Download `names` (file name -> size in bytes) of `repo_id` at `revision` into `folder`,
    skipping files already whole there and resuming `.part` files, under one bytes bar."""
    have = {n: _received(folder / n, size) for n, size in names.items()}
    bar = bar_class(total=sum(names.values()), initial=sum(have.values()), unit="B",
                    unit_scale=True, unit_divisor=1024)
    failed: list[DownloadError] = []
    try:
        for name, size in names.items():
            if have[name] < size or not (folder / name).exists():
                try:
                    _download_file(repo_id, revision, name, size, folder / name, endpoint, bar)
                except DownloadError as e:  # the other files still come: a rerun needs less
                    failed.append(e)
    finally:
        bar.close()
    if failed:
        raise DownloadError("; ".join(str(e) for e in failed))


def _received(target: Path, size: int) -> int:
    if target.exists():
        return size
    part = _part(target)
    return part.stat().st_size if part.exists() else 0


def _part(target: Path) -> Path:
    return target.with_name(target.name + ".part")


def _download_file(repo_id: str, revision: str, name: str, size: int, target: Path,
                   endpoint: str, bar: tqdm) -> None:
    import httpx2
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    url = hf_hub_url(repo_id, name, revision=revision, endpoint=endpoint)
    part = _part(target)
    part.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a private repo's weights
    error: Exception | None = None
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(min(FIRST_RETRY_SECONDS * 2 ** (attempt - 1), 4.0))
        start = part.stat().st_size if part.exists() else 0
        headers = build_hf_headers()
        if start:
            headers["Range"] = f"bytes={start}-"
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                      timeout=60.0) as response:
                if response.status_code == 416 and start >= size:
                    break  # the part already holds the whole file
                response.raise_for_status()
                if response.status_code != 206 and start:
                    bar.update(-start)  # the server ignored the range: it sends all again
                    start = 0
                with open(part, "ab" if start else "wb", opener=private_opener) as out:
                    for chunk in response.iter_bytes(CHUNK):
                        out.write(chunk)
                        bar.update(len(chunk))
            if part.stat().st_size == size or size == 0:
                break
            error = DownloadError(f"{name}: received {part.stat().st_size} of {size} bytes")
        except httpx2.HTTPStatusError as e:
            if e.response.status_code < 500 and e.response.status_code != 429:
                raise DownloadError(f"{name}: {e}") from None  # retrying cannot help
            error = e
        except httpx2.TransportError as e:
            error = e
    else:
        raise DownloadError(f"{name}: {error} ({ATTEMPTS} attempts)")
    if size and part.stat().st_size != size:
        raise DownloadError(f"{name}: {part.stat().st_size} bytes received, the hub lists "
                            f"{size}; delete {part} and run again")
    os.replace(part, target)
