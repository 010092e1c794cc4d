"""Benchmarks, one module a claim: run one from the repository root as `python -m bench.<name>`
(docs/benchmarks.md). `bench.common` and `bench.load_client` hold what they share."""
