"""gRPC client and server interceptors: RPC_CLIENT / RPC_SERVER spans, W3C trace context
in metadata through the OpenTelemetry propagator.

    channel = crosstrace.instrument_channel(grpc.insecure_channel(addr))
    server = grpc.server(pool, interceptors=[crosstrace.server_interceptor()])
"""
import grpc
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.trace.status import StatusCode

from ...proto import semconv as sc

_CLIENT = trace_api.SpanKind.CLIENT
_SERVER = trace_api.SpanKind.SERVER


def _split_method(full_method: str) -> tuple[str, str]:
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


def _rpc_attributes(full_method: str) -> dict:
    service, method = _split_method(full_method)
    return {sc.RPC_SYSTEM: "grpc", sc.RPC_SERVICE: service, sc.RPC_METHOD: method}


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class ClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    def __init__(self, tracer_provider=None):
        self._tracer = trace_api.get_tracer(__name__, tracer_provider=tracer_provider)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        with self._tracer.start_as_current_span(method.lstrip("/"), kind=_CLIENT,
                                                attributes=_rpc_attributes(method)) as span:
            metadata = list(client_call_details.metadata or [])
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            metadata.extend(carrier.items())
            outcome = continuation(_ClientCallDetails(client_call_details, metadata), request)
            code = outcome.code() if hasattr(outcome, "code") else grpc.StatusCode.OK
            span.set_attribute(sc.RPC_GRPC_STATUS, code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(StatusCode.ERROR, f"{code.name}: {outcome.details()}")
            return outcome


def instrument_channel(channel: grpc.Channel, tracer_provider=None) -> grpc.Channel:
    """A channel whose calls are traced as RPC_CLIENT spans and carry the trace context."""
    return grpc.intercept_channel(channel, ClientInterceptor(tracer_provider))


class ServerInterceptor(grpc.ServerInterceptor):
    def __init__(self, tracer_provider=None):
        self._tracer = trace_api.get_tracer(__name__, tracer_provider=tracer_provider)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method
        tracer, behavior = self._tracer, handler.unary_unary
        attributes = _rpc_attributes(method)

        def traced(request, context):
            parent = propagate.extract(dict(context.invocation_metadata()))
            with tracer.start_as_current_span(method.lstrip("/"), context=parent, kind=_SERVER,
                                              attributes=attributes) as span:
                try:
                    return behavior(request, context)
                finally:
                    code = context.code() if hasattr(context, "code") else None
                    span.set_attribute(sc.RPC_GRPC_STATUS, (code or grpc.StatusCode.OK).value[0])

        return grpc.unary_unary_rpc_method_handler(traced, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def server_interceptor(tracer_provider=None) -> grpc.ServerInterceptor:
    """Pass to grpc.server(..., interceptors=[...]): every call becomes an RPC_SERVER span
    under the caller's trace context."""
    return ServerInterceptor(tracer_provider)
