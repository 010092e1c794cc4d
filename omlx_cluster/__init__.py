"""omlx-cluster, the application: the command line on top of the coordinator and the node.

Nothing imports this package; it imports `omlx_coordinator`, `omlx_node` and `omlx_shared`.
"""
