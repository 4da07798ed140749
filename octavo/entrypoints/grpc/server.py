"""The gRPC server beside the HTTP one (`octavo serve --grpc-port P`), on the same event loop
and engine: the Octavo service (servicer.py), the standard grpc.health.v1 health service
(SERVING while /health answers 200) and server reflection. The API key travels in metadata and
is checked as the HTTP guard checks its headers; health and reflection are open, as /health
is. Messages are bounded by --max-request-bytes."""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from octavo.entrypoints.grpc import octavo_pb2 as pb
from octavo.entrypoints.grpc import octavo_pb2_grpc as pb_grpc
from octavo.entrypoints.grpc.servicer import OctavoServicer
from octavo.entrypoints.guard import key_matches
from octavo.entrypoints.http import ServerState

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Octavo"].full_name
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
HEALTH_POLL_S = 0.5


class _KeyCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call to the Octavo service without the API key."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if key_matches(metadata.get("authorization"), metadata.get("x-api-key"), self.api_key):
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")

        kind = grpc.unary_stream_rpc_method_handler if handler.response_streaming \
            else grpc.unary_unary_rpc_method_handler
        return kind(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class GrpcServer:
    """The running server: `stop()` ends its calls (their requests abort) within `grace` s."""

    def __init__(self, server: grpc.aio.Server, watcher: asyncio.Task) -> None:
        self.server = server
        self.watcher = watcher

    async def stop(self, grace: float | None) -> None:
        self.watcher.cancel()
        await self.server.stop(grace)


async def start_grpc_server(state: ServerState, host: str, port: int,
                            max_concurrent_rpcs: int | None = None) -> GrpcServer:
    """Listening on host:port once this returns (an error if the port cannot be bound)."""
    limit = state.max_request_bytes
    server = grpc.aio.server(
        interceptors=[_KeyCheck(state.api_key)] if state.api_key else [],
        # no SO_REUSEPORT: a port another server holds is an error, not a shared port
        options=[("grpc.max_receive_message_length", limit),
                 ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=max_concurrent_rpcs)
    pb_grpc.add_OctavoServicer_to_server(OctavoServicer(state), server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    reflection.enable_server_reflection(
        [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"--grpc-port: cannot listen on {address}: {exc}") from None
    if bound == 0:
        raise OSError(f"--grpc-port: cannot listen on {address}")
    await _set_health(state, health_service)
    await server.start()
    watcher = asyncio.get_running_loop().create_task(_report_health(state, health_service))
    logger.info("gRPC: serving %s, health and reflection on %s", SERVICE, address)
    return GrpcServer(server, watcher)


async def _set_health(state: ServerState, service, last: int | None = None) -> int:
    """SERVING while the engine lives and answers (as /health's 200), else NOT_SERVING."""
    engine = state.engine
    status = health_pb2.HealthCheckResponse.NOT_SERVING if engine.dead or engine.hung() \
        else health_pb2.HealthCheckResponse.SERVING
    if status != last:
        for name in ("", SERVICE):
            await service.set(name, status)
    return status


async def _report_health(state: ServerState, service) -> None:
    last = None
    while True:
        last = await _set_health(state, service, last)
        await asyncio.sleep(HEALTH_POLL_S)
