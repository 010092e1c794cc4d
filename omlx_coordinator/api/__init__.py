"""The protocol adapters: thin translations between an HTTP API and the generation core."""
