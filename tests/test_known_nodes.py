"""A coordinator's notes on its cluster across restarts (omlx_coordinator/nodes/known_nodes.py):
its members and the links it measured between them."""

from __future__ import annotations

import json

from omlx_coordinator.nodes.known_nodes import KnownNodes
from omlx_shared.link_probe import LinkMeasurement

AB = LinkMeasurement(gb_per_s=1.5, latency_us=29.0, nbytes=1 << 24)


def test_members_and_their_links_come_back_after_a_restart(tmp_path):
    known = KnownNodes(tmp_path / "cluster-nodes.json")
    gone = LinkMeasurement(gb_per_s=0.1, latency_us=900.0, nbytes=1 << 20)
    known.save({"a", "b"}, {frozenset({"a", "b"}): AB, frozenset({"a", "c"}): gone})
    again = KnownNodes(tmp_path / "cluster-nodes.json")
    assert again.load() == {"a", "b"}
    # A link to a node no longer a member is not kept.
    assert again.load_links() == {frozenset({"a", "b"}): AB}
    assert (tmp_path / "cluster-nodes.json").stat().st_mode & 0o777 == 0o600


def test_a_damaged_or_older_file_costs_only_the_readings(tmp_path):
    path = tmp_path / "cluster-nodes.json"
    path.write_text(json.dumps({"nodes": ["a", "b"]}))  # written before links were kept
    assert KnownNodes(path).load() == {"a", "b"} and KnownNodes(path).load_links() == {}
    path.write_text(json.dumps({"nodes": ["a", "b"], "links": [
        {"nodes": ["a"], "gb_per_s": 1.0, "latency_us": 1.0, "nbytes": 1},
        {"nodes": ["a", "b"], "gb_per_s": "fast", "latency_us": 1.0, "nbytes": 1},
        {"nodes": ["a", "b"], "gb_per_s": 1.5, "latency_us": 29.0, "nbytes": 1 << 24}]}))
    assert KnownNodes(path).load_links() == {frozenset({"a", "b"}): AB}
    path.write_text("{not json")
    assert KnownNodes(path).load() == set() and KnownNodes(path).load_links() == {}
