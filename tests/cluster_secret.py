"""Cluster secrets for tests: strong ones, since `coordinator`, `join` and `node` refuse weak
ones (omlx_shared/secret_strength.py). Fixed, so a failing test's logs can be read again."""

SECRET = "VPP4ohs5LtJx1StDAFgZdSwuf_rTqkrx_C5T9Yxb0ec"
OTHER_SECRET = "Ns9OHUUTDuk1tKFs0ENqzW1XaEuBbDX395QCdJCUyls"  # a node of another cluster
