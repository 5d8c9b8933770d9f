"""What stands before the admin service's handlers: a bearer token, where the node has one, and a
request that its method's message type cannot parse answered as any invalid request.
"""

from __future__ import annotations

import hmac

import grpc


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without ``authorization: Bearer TOKEN`` (compared in constant time); health
    checks stay open so load balancers and orchestrators can probe the node."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        presented = dict(handler_call_details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(str(presented).encode(), self._expected):
            return handler

        def deny(request, context):  # type: ignore[no-untyped-def]
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin token: pass it as 'authorization: Bearer TOKEN'")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


class _Undecodable:
    """What a request that its method's message type cannot parse is handed on as."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class RequestDecodingInterceptor(grpc.ServerInterceptor):
    """Answers a request that is not a valid message of its method's type with INVALID_ARGUMENT, as
    any other invalid request: gRPC's own answer is INTERNAL ("Exception deserializing request!"),
    which says the node is broken."""

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def lenient(data: bytes) -> object:
            try:
                return parse(data)
            except Exception as exc:  # protobuf's DecodeError, or whatever a deserializer raises on bytes it cannot read
                return _Undecodable(f"{type(exc).__name__}: {exc}"[:200])

        def checked(request: object, context: grpc.ServicerContext) -> object:
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message for {method} ({request.reason})")
            return request

        if handler.request_streaming:
            inner = handler.stream_stream or handler.stream_unary

            def behavior(requests, context):  # type: ignore[no-untyped-def]
                return inner((checked(request, context) for request in requests), context)

        else:
            inner = handler.unary_stream or handler.unary_unary

            def behavior(request, context):  # type: ignore[no-untyped-def]
                return inner(checked(request, context), context)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(behavior, request_deserializer=lenient, response_serializer=handler.response_serializer)
