"""The HTTP routes: the protocol adapters (thin translations between an HTTP API and the
generation core) and the cluster's own (/health, /cluster/*, /metrics)."""
