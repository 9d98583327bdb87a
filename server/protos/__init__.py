"""Triton's KServe v2 gRPC protocol (grpc_service.proto, model_config.proto; BSD licence in LICENSE)
and the modules protoc generates from it (python -m tools.grpc_protos)."""
