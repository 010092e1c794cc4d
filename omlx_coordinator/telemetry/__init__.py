"""What the gateway measures (/metrics) and the rebalancer that acts on the measurements."""
