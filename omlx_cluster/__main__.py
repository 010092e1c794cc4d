"""`python -m omlx_cluster`: the command line, as the console script `omlx-cluster` runs it."""

import sys

from omlx_cluster.cli import main

# Guarded: a spawned child (the gateway's body parser) imports the parent's main module.
if __name__ == "__main__":
    sys.exit(main())
