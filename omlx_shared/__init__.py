"""The shared kernel of omlx-cluster: what the coordinator and the node both import.

Auth, the discovery wire format, the model store and GGUF import, safetensors headers,
hardware probes, child processes. It imports neither `omlx_node` nor `omlx_coordinator`.
"""

__version__ = "0.1.0"
