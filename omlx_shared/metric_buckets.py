"""Histogram buckets shared by the node's and the gateway's latency metrics, so dashboards can
put both on one panel: 5 ms (a decode step on a Mac) to 2 min (a cold long prefill)."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
