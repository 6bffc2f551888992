"""Requests to the device plugin's gRPC server whose bytes are no message of their method.

grpcio parses a request with the generated deserializer before the servicer sees it; a
`DecodeError` there reaches grpcio's own handler, which answers UNKNOWN ("Unexpected
<class 'DecodeError'>") and logs a traceback at ERROR for every such call. The
interceptor `RefuseUndecodable` wraps each method's deserializer so that bytes that do
not parse become an `Undecodable` value, and the method answers it INVALID_ARGUMENT with
one WARNING line (method, size, the parser's reason), before any of the plugin's code
runs: such a call changes nothing.

It owns only that; what a well-formed request gets is `gpuplace.agent.plugin`'s. O(1) per
call beyond the parse itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request whose bytes did not parse."""

    size: int
    reason: str


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except message.DecodeError as error:
            return Undecodable(len(raw), str(error)[:200])

    return deserialize


async def _refuse(method: str, request: Undecodable, context: grpc.aio.ServicerContext) -> None:
    log.warning(
        "undecodable request refused",
        extra={"method": method, "bytes": request.size, "error": request.reason},
    )
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request to {method} is not a valid protobuf message of its type: {request.reason}",
    )


def _unary(method: str, behaviour: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    async def answer(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(method, request, context)
        return await behaviour(request, context)

    return answer


def _stream(method: str, behaviour: Callable[[Any, Any], AsyncIterator[Any]]) -> Any:
    async def answer(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _refuse(method, request, context)
        async for item in behaviour(request, context):
            yield item

    return answer


class RefuseUndecodable(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc.aio: Any
    """See the module docstring. Each method's handler is wrapped once (a dict look-up per
    call after that). Methods with a streamed request (none in the device-plugin API) are
    passed on unchanged."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        path = str(handler_call_details.method)
        kept = self._wrapped.get(path)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = _wrap(path.rsplit("/", 1)[-1], handler)
        self._wrapped[path] = (handler, wrapped)
        return wrapped


def _wrap(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserializer = _tolerant(handler.request_deserializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _unary(method, handler.unary_unary),
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _stream(method, handler.unary_stream),
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler
