"""Coordinator side: OpenAI gateway, node client, metrics. Holds no model weights."""
