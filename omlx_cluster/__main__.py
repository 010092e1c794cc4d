"""`python -m omlx_cluster`: the command line, as the console script `omlx-cluster` runs it."""

import sys

from omlx_cluster.cli import main

sys.exit(main())
