"""gRPC control-plane contract (omlx.proto) and its generated code.

Regenerate after editing omlx.proto:
    python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. proto/omlx.proto
"""
