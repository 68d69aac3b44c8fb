"""crosstrace: distributed tracing for multi-node ML jobs and edge-to-cloud inference."""
import os as _os
import warnings as _warnings

from opentelemetry import trace as _trace

# In a clone of the repository the subpackages (proto/, tracer/, collector/, clock_sync/)
# sit beside this folder, where only an install puts them inside it: Python started in the
# clone's root imports this folder rather than the installed package, and finds them there.
_source_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "tracer")) and \
        _os.path.isfile(_os.path.join(_source_root, "tracer", "provider.py")):
    __path__.append(_source_root)

from .proto.semconv import Kind
from .tracer.instrument.grpc import (aio_client_interceptors, aio_server_interceptor, instrument_channel,
                                     server_interceptor)
from .tracer.provider import Tracer, TracerProvider
from .tracer.step import step, steps

__version__ = "0.1.0"


_made_global = None   # the global provider init() made (not one OTEL_PYTHON_TRACER_PROVIDER made)


def init(set_global: bool = True, **options) -> TracerProvider:
    """Start tracing this process: a TracerProvider configured by `options` (see
    crosstrace.tracer.config.Config) and the CROSSTRACE_* environment, registered as
    OpenTelemetry's global provider unless `set_global=False`. Called again, it returns the
    global one it made, and says so (OpenTelemetry keeps its first global provider)."""
    global _made_global
    if set_global and _made_global is not None and not _made_global._shutdown:
        # OpenTelemetry keeps its first global provider: a second one ran beside it
        given = ", ".join(f"{key}={value!r}" for key, value in options.items())
        _warnings.warn("crosstrace: init() was called already; its tracer goes on"
                       + (f", and these options are not taken: {given}" if given else ""), RuntimeWarning,
                       stacklevel=2)
        return _made_global
    provider = TracerProvider(**options)
    if set_global:
        _trace.set_tracer_provider(provider)   # (refused, and said, where one is set already)
        _made_global = provider if _trace.get_tracer_provider() is provider else None
    return provider


# torch instrumentation: imported on first use, so that `import crosstrace` never imports torch.

def instrument_collectives() -> bool:
    """Trace torch.distributed collectives and point-to-point ops (see tracer/instrument/torch_dist.py)."""
    from .tracer.instrument import torch_dist
    return torch_dist.instrument_collectives()


def uninstrument_collectives() -> None:
    """Undo instrument_collectives()."""
    from .tracer.instrument import torch_dist
    torch_dist.uninstrument_collectives()


def instrument_ddp(model, hook=None, state=None):
    """Trace a DistributedDataParallel model's gradient buckets; returns the model. A comm
    hook of your own goes here, not to model.register_comm_hook() (see torch_dist.instrument_ddp)."""
    from .tracer.instrument import torch_dist
    return torch_dist.instrument_ddp(model, hook, state)


def uninstrument_ddp(model) -> None:
    """Undo instrument_ddp(model)."""
    from .tracer.instrument import torch_dist
    torch_dist.uninstrument_ddp(model)


def instrument_pipeline() -> bool:
    """Trace torch.distributed.pipelining stages, schedules and their transfers."""
    from .tracer.instrument import pipeline
    return pipeline.instrument_pipeline()


def uninstrument_pipeline() -> None:
    """Undo instrument_pipeline() (collectives stay instrumented)."""
    from .tracer.instrument import pipeline
    pipeline.uninstrument_pipeline()


__all__ = ["Kind", "Tracer", "TracerProvider", "aio_client_interceptors", "aio_server_interceptor", "init",
           "instrument_channel", "instrument_collectives",
           "instrument_ddp", "instrument_pipeline", "server_interceptor", "step", "steps",
           "uninstrument_collectives", "uninstrument_ddp", "uninstrument_pipeline"]
