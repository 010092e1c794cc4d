"""A live server whose SSD KV tier's disk fills up and frees again: every request is still
served with mlx-lm's answer, /health stays ready, the tier says once that it stops writing
(and once that it resumes), and it writes again once there is room. (The tier alone, on a
full, nearly full and read-only disk: tests/test_kv_tiers.py.)"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import start_server
from tests.helpers.disks import fill, tmpfs, tmpfs_unavailable
from tests.helpers.serving import complete, expected
from tests.helpers.waiting import wait_for
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

# The tier keeps max(1 GiB, 5%) of its disk free: a disk a little larger has room for blocks
# until the filler takes it (tmpfs takes memory only for what is written or allocated).
DISK = "1100m"
LOW_SPACE = "short of its free-space reserve"
RESUMED = "SSD writes resume"


def _worker_log(home) -> str:
    """What the model's workers logged (the tier's warnings are theirs)."""
    return "".join(p.read_text(errors="replace") for p in (home / "logs").glob("*worker*.log"))


def _writes(server, result: str) -> float:
    return server.node_metrics().get(f'omlx_node_kv_cache_ssd_writes_total{{result="{result}"}}',
                                     0.0)


@pytest.mark.skipif(tmpfs_unavailable() is not None, reason=str(tmpfs_unavailable()))
def test_a_full_cache_disk_degrades_the_tier_and_loses_no_request(tmp_path):
    model = build_model(tmp_path / "m", "llama", num_layers=4)
    prompts = [[(5 * i + k) % 300 + 10 for i in range(300)] for k in range(9)]
    answers = expected(model, prompts, 8)
    with tmpfs(tmp_path / "ssd", DISK) as disk, start_server(
            model, "--paged-ssd-cache-dir", str(disk), home=tmp_path / "home",
            node_metrics=True, keepalive=None) as server:
        def round_(k: int) -> None:
            for p, want in zip(prompts[3 * k:3 * k + 3], answers[3 * k:3 * k + 3]):
                assert complete(server.url, server.model_id, p, 8)["choices"][0]["text"] == want
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200

        round_(0)
        written = wait_for(lambda: _writes(server, "ok"), 60, "blocks written to the SSD tier")
        filler = disk / "filler"
        fill(filler, 16 << 20)  # the disk now 16 MiB from full: far inside the reserve
        round_(1)
        wait_for(lambda: _writes(server, "low_space"), 60, "writes skipped for want of space")
        assert _writes(server, "ok") == written
        log = _worker_log(tmp_path / "home")
        assert log.count(LOW_SPACE) == 1, log[-3000:]  # said once, not once a block
        filler.unlink()
        round_(2)
        wait_for(lambda: _writes(server, "ok") > written, 60, "writes again once there is room")
        assert RESUMED in _worker_log(tmp_path / "home")
