"""The wire contract between tracers and the collector: generated messages and
the attribute names both sides agree on (`semconv`)."""
from .crosstrace.v1 import crosstrace_pb2 as pb
from .crosstrace.v1 import crosstrace_pb2_grpc as pb_grpc

SERVICE = "crosstrace.v1.Collector"
EXPORT_METHOD = f"/{SERVICE}/Export"
CLOCK_METHOD = f"/{SERVICE}/ExchangeClock"
MAX_MESSAGE_BYTES = 64 << 20   # gRPC's message limit, at tracers and collectors alike

__all__ = ["pb", "pb_grpc", "SERVICE", "EXPORT_METHOD", "CLOCK_METHOD", "MAX_MESSAGE_BYTES"]
