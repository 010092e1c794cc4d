"""The cluster's members: membership, node clients, worker sessions, weights sent to nodes."""
