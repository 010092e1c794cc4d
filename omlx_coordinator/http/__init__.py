"""The HTTP server: the app, TLS, connection hygiene, request bodies, the docs page."""
