"""The wire contract between tracers and the collector: generated messages and
the attribute names both sides agree on (`semconv`)."""
import os

# gRPC's C core logs at INFO unless told otherwise: a traced program printed a line at every
# fork (a DataLoader worker's, "skipping fork() handlers"), and a TLS mismatch a raw log line
# where crosstrace says what to do. Only where the program has not chosen, before gRPC starts.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from .crosstrace.v1 import crosstrace_pb2 as pb  # noqa: E402 (after the setting above)
from .crosstrace.v1 import crosstrace_pb2_grpc as pb_grpc  # noqa: E402

SERVICE = "crosstrace.v1.Collector"
EXPORT_METHOD = f"/{SERVICE}/Export"
CLOCK_METHOD = f"/{SERVICE}/ExchangeClock"
MAX_MESSAGE_BYTES = 64 << 20   # gRPC's message limit, at tracers and collectors alike

__all__ = ["pb", "pb_grpc", "SERVICE", "EXPORT_METHOD", "CLOCK_METHOD", "MAX_MESSAGE_BYTES"]
