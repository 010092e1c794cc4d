"""One request's path from an API adapter to the nodes and back."""
