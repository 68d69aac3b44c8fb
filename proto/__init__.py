"""The wire contract between tracers and the collector: generated messages and
the attribute names both sides agree on (`semconv`)."""
from .crosstrace.v1 import crosstrace_pb2 as pb
from .crosstrace.v1 import crosstrace_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
