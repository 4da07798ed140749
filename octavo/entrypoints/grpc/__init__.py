"""octavo's gRPC API (octavo.proto): the service, its health and reflection, served beside HTTP
by `octavo serve --grpc-port P` (needs pip install 'octavo[grpc]'). octavo_pb2*.py are
generated from octavo.proto and committed: `python -m octavo.entrypoints.grpc.stubs` writes
them again after a change to it (a test checks they are current)."""
