"""A prefill longer than --stall-timeout is not a wedged plan: while its steps advance the head
worker reports progress (omlx_node/session.py), so the plan is not re-planned under it. The
worker is slowed by a cgroup CPU quota so that a 2,000-token prompt takes several times the
timeout to prefill; the answer is mlx-lm's, and the model never stops being ready."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import start_server
from tests.helpers.processes import status
from tests.helpers.rebalance import cgroup_unavailable, cpu_quota
from tests.helpers.serving import complete, expected
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

STALL_TIMEOUT = 3.0
PROMPT_TOKENS = 2000  # the model holds 2,048
SHARE = 0.2  # of one CPU: a prefill of ~10 s, each 16-token step well under a second


@pytest.mark.skipif(cgroup_unavailable() is not None, reason=str(cgroup_unavailable()))
def test_a_prefill_longer_than_the_stall_timeout_is_not_a_wedge(tmp_path):
    model = build_model(tmp_path / "m", "llama", num_layers=8, hidden_size=256)
    prompt = [(7 * i) % 300 + 10 for i in range(PROMPT_TOKENS)]
    reference = expected(model, [prompt], 8)[0]
    with start_server(model, "--stall-timeout", str(STALL_TIMEOUT), "--prefill-chunk", "16",
                      home=tmp_path / "home", keepalive=None) as server:
        before = status(server.url)
        worker = before["nodes"][0]["worker_pid"]
        answer: dict = {}
        asking = threading.Thread(target=lambda: answer.update(
            complete(server.url, server.model_id, prompt, 8)))
        with cpu_quota([worker], SHARE):
            started = time.monotonic()
            asking.start()
            not_ready = 0
            while asking.is_alive():
                assert time.monotonic() - started < 240, "no answer within 240 s"
                not_ready += status(server.url)["ready"] is not True
                time.sleep(0.5)
            took = time.monotonic() - started
        assert took > 2 * STALL_TIMEOUT, f"the prefill took {took:.1f} s: too quick to tell"
        assert answer["choices"][0]["text"] == reference
        assert not_ready == 0, f"not ready {not_ready} time(s) during the prefill"
        assert status(server.url)["epoch"] == before["epoch"]  # never re-planned
        assert "the plan is wedged" not in server.log_path.read_text()
