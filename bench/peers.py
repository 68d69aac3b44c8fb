"""What the benchmarks measure crosstrace against: the OpenTelemetry SDK at its cheapest."""
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class NoopExporter(SpanExporter):
    """Exports nothing: the SDK's cost without any export work."""

    def export(self, spans):
        return SpanExportResult.SUCCESS
