"""omlx-cluster: one LLM endpoint over the Macs of an office."""

__version__ = "0.1.0"
