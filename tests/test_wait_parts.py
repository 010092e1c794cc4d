"""Where a request's time to its first token goes (omlx_node.wait_parts), on a real engine."""

from __future__ import annotations

from omlx_node.batcher import Batcher
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageRunner
from omlx_node.wait_parts import Wait, charge, split
from tests.helpers.engine import drain
from tests.tiny_models import build_model


def test_an_iteration_splits_into_its_decode_step_and_its_prefill() -> None:
    assert split(0.032, 0.008, decoded=True, prefilled=20) == (0.008, 0.024)
    assert split(0.032, 0.008, decoded=False, prefilled=20) == (0.0, 0.032)
    assert split(0.030, 0.010, decoded=True, prefilled=0) == (0.030, 0.0)  # all of it decode
    assert split(0.005, 0.010, decoded=True, prefilled=4) == (0.005, 0.0)  # a step's at most
    wait = Wait()
    charge(wait, 0.010, 0.020, own=5, prefilled=20)
    assert (wait.decode, wait.own_prefill) == (0.010, 0.005)
    assert abs(wait.others_prefill - 0.015) < 1e-12


def test_a_prompt_that_arrives_while_others_decode_knows_what_it_waited_for(tmp_path) -> None:
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    metrics = NodeMetrics()
    batcher = Batcher(StageRunner(path), metrics, prefill_chunk=16)
    early = [batcher.submit(SeqRequest(f"e{i}", [5 + i] * 40, 30)) for i in range(2)]
    for _ in range(6):
        batcher.step()
    late = batcher.submit(SeqRequest("late", list(range(10, 110)), 4))
    drain(batcher, early + [late])
    for seq in early + [late]:
        parts = seq.wait.parts()
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) <= seq.first_token_time - seq.submitted + 1e-6
    assert late.wait.decode > 0 and late.wait.own_prefill > 0
    assert early[1].wait.others_prefill > 0  # the first prompt's chunk went before its own
    seen = {s.labels["part"]: s.value for m in metrics.registry.collect()
            if m.name == "omlx_node_request_wait_seconds" for s in m.samples
            if s.name.endswith("_count")}
    assert seen == {"decode": 3, "own_prefill": 3, "others_prefill": 3}
