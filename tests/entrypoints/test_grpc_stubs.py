"""The committed gRPC stubs are those octavo.proto generates (byte for byte where the installed
grpcio-tools is the version that made them; else the same descriptor); the exceptions the
servicer meets become the statuses that mirror their HTTP ones; a --grpc-port that cannot be
served is refused before the model loads."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")
pytest.importorskip("grpc_health")
pytest.importorskip("grpc_reflection")


def test_committed_stubs_are_generated_from_the_proto(tmp_path):
    from google.protobuf import descriptor_pb2

    from octavo.entrypoints.grpc import octavo_pb2, octavo_pb2_grpc, stubs

    fresh = stubs.generate(tmp_path)
    committed = Path(octavo_pb2.__file__).parent
    # the fresh module's descriptor, read without importing it (it would clash in the pool)
    text = fresh[0].read_text()
    start = text.index("AddSerializedFile(") + len("AddSerializedFile(")
    serialized = ast.literal_eval(text[start:text.index(")\n", start)])
    expected = descriptor_pb2.FileDescriptorProto.FromString(serialized)
    assert descriptor_pb2.FileDescriptorProto.FromString(
        octavo_pb2.DESCRIPTOR.serialized_pb) == expected, \
        "octavo.proto changed: run python -m octavo.entrypoints.grpc.stubs"
    if octavo_pb2_grpc.GRPC_GENERATED_VERSION == _tools_version():
        for path in fresh:
            assert path.read_bytes() == (committed / path.name).read_bytes(), \
                f"{path.name} is stale: run python -m octavo.entrypoints.grpc.stubs"


def _tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def test_errors_become_the_statuses_of_their_http_ones():
    from octavo.engine.async_engine import EngineDeadError, QueueFullError
    from octavo.entrypoints.grpc.servicer import _status
    from octavo.entrypoints.http import APIError, RequestTimedOut

    codes = grpc.StatusCode
    assert _status(ValueError("top_p must be <= 1")) == (codes.INVALID_ARGUMENT,
                                                          "top_p must be <= 1")
    assert _status(APIError(404, "no such model", "model")) == (codes.NOT_FOUND,
                                                               "model: no such model")
    assert _status(APIError(401, "missing key"))[0] == codes.UNAUTHENTICATED
    assert _status(QueueFullError("server busy"))[0] == codes.RESOURCE_EXHAUSTED
    assert _status(EngineDeadError("gone")) == (codes.UNAVAILABLE, "engine is dead: gone")
    assert _status(RequestTimedOut(2.0))[0] == codes.DEADLINE_EXCEEDED
    assert _status(APIError(504, "ran past --request-timeout"))[0] == codes.DEADLINE_EXCEEDED
    assert _status(APIError(499, "aborted"))[0] == codes.CANCELLED
    assert _status(RuntimeError("a bug")) is None  # grpc reports it as UNKNOWN


def test_a_grpc_port_equal_to_the_http_port_is_refused_before_loading(tmp_path):
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "serve",
                           "--model", str(tmp_path / "absent"), "--port", "8123",
                           "--grpc-port", "8123"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--grpc-port must be a port other than --port" in \
        done.stderr, done.stderr[-2000:]
