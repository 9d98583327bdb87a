"""The committed gRPC modules are what the vendored protos generate (tools.grpc_protos)."""

from tools import grpc_protos


def test_generated_modules_match_the_protos():
    assert grpc_protos.main(["--check"]) == 0
