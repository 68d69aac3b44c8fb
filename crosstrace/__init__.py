"""crosstrace: distributed tracing for multi-node ML jobs and edge-to-cloud inference."""
from opentelemetry import trace as _trace

from .proto.semconv import Kind
from .tracer.instrument.grpc import instrument_channel, server_interceptor
from .tracer.provider import Tracer, TracerProvider

__version__ = "0.1.0"


def init(set_global: bool = True, **options) -> TracerProvider:
    """Start tracing this process: a TracerProvider configured by `options` (see
    crosstrace.tracer.config.Config) and the CROSSTRACE_* environment, registered as
    OpenTelemetry's global provider unless `set_global=False`."""
    provider = TracerProvider(**options)
    if set_global:
        _trace.set_tracer_provider(provider)
    return provider


__all__ = ["Kind", "Tracer", "TracerProvider", "init", "instrument_channel", "server_interceptor"]
