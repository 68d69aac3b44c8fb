"""torch.distributed.pipelining instrumentation: stage compute and stage-to-stage transfers.

    crosstrace.instrument_pipeline()   # before or after building stages and schedules

Every schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, the zero-bubble
ones...) runs stage compute through the stage's forward_one_chunk, backward_one_chunk and
backward_weight_one_chunk, and moves activations and gradients with the P2P ops the stage's
get_{fwd,bwd}_{send,recv}_ops build, which run through dist.isend/irecv or
batch_isend_irecv. crosstrace wraps those methods (on the stage base class, so every stage)
and the schedules' step():

- "pipeline.step" (INTERNAL): one schedule step, the window the collector measures bubbles in;
- "forward", "backward", "backward_input", "backward_weight" (COMPUTE);
- "isend"/"irecv" (SEND/RECV, from instrument_collectives, which this turns on);

all with pp.stage, pp.microbatch, pp.action (torch's letters: F forward, B full backward,
I backward for inputs, W backward for weights; transfers carry F or B for the pass they
belong to), pp.schedule (the schedule's class name), pp.num_stages, pp.num_microbatches
and pp.stages_per_rank.
"""
import contextvars
import functools
import itertools

import torch

from ...proto import semconv as sc
from . import torch_dist
from .torch_dist import Params, warn_once

_schedule: contextvars.ContextVar[dict] = contextvars.ContextVar("crosstrace_pp_schedule", default={})
_installed: list[tuple[type, str, object]] = []  # (class, method name, original)
_schedule_steps = itertools.count()   # schedule steps taken by this process


# stage compute method -> pp.action (torch's letters); span name per action
_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
_SPAN_NAMES = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def _compute(method):
    """A COMPUTE span around a stage's forward or backward of one microbatch."""
    params = Params(method)
    chunk_arg = list(params.position)[1]  # after self
    action = _ACTIONS[method.__name__]

    @functools.wraps(method)
    def traced(self, *args, **kwargs):
        if action != "F" and not getattr(self, "has_backward", True):   # inference: torch does nothing
            return method(self, *args, **kwargs)
        call = (self, *args)
        this = "I" if action == "B" and params.get("full_backward", call, kwargs) is False else action
        attributes = {sc.KIND: "compute", sc.PP_STAGE: self.stage_index,
                      sc.PP_MICROBATCH: params.get(chunk_arg, call, kwargs), sc.PP_ACTION: this,
                      **_schedule.get()}
        with torch_dist._tracing().tracer.start_as_current_span(_SPAN_NAMES[this], attributes=attributes):
            return method(self, *args, **kwargs)

    return traced


def _transfers(method, action: str):
    """Label the P2P ops a stage builds for one microbatch, for the spans of their transfer."""
    @functools.wraps(method)
    def traced(self, chunk, *args, **kwargs):
        ops = method(self, chunk, *args, **kwargs)
        attributes = {sc.PP_STAGE: self.stage_index, sc.PP_MICROBATCH: chunk, sc.PP_ACTION: action,
                      **_schedule.get()}
        for op in ops:
            torch_dist.tag_p2p(op.tensor, attributes)
        return ops

    return traced


def _schedule_step(method):
    """A "pipeline.step" span around one schedule step; its attributes go to every span inside.
    Outside any span and any crosstrace.step, its trace is one every rank derives alike from
    the job, the run and the count of schedule steps so far (the ranks run the same ones), as
    a step's is: each rank's own trace had its stages and transfers never meet."""
    @functools.wraps(method)
    def traced(self, *args, **kwargs):
        attributes = {sc.PP_SCHEDULE: type(self).__name__,
                      sc.PP_STAGES_PER_RANK: len(getattr(self, "_stages", ())) or 1}
        for key, field in ((sc.PP_NUM_STAGES, "_num_stages"), (sc.PP_NUM_MICROBATCHES, "_n_microbatches")):
            if isinstance(getattr(self, field, None), int):
                attributes[key] = getattr(self, field)
        token = _schedule.set(attributes)
        torch_dist.clear_p2p_tags()
        number = next(_schedule_steps)
        try:
            tracing = torch_dist._tracing()
            parent = torch_dist._parent(key=("pipeline.step", number))
            if parent is False:   # an unsampled step: recorded nothing, as before
                parent = None
            with tracing.tracer.start_as_current_span("pipeline.step", context=parent, attributes=attributes):
                return method(self, *args, **kwargs)
        finally:
            _schedule.reset(token)
            torch_dist.clear_p2p_tags()

    return traced


def _targets():
    """(class, method name, wrapper factory) for everything instrument_pipeline() wraps."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

    return [
        (Stage, "forward_one_chunk", _compute),
        (Stage, "backward_one_chunk", _compute),
        (Stage, "backward_weight_one_chunk", _compute),
        (Stage, "get_fwd_send_ops", lambda m: _transfers(m, "F")),
        (Stage, "get_fwd_recv_ops", lambda m: _transfers(m, "F")),
        (Stage, "get_bwd_send_ops", lambda m: _transfers(m, "B")),
        (Stage, "get_bwd_recv_ops", lambda m: _transfers(m, "B")),
        (schedules.PipelineScheduleSingle, "step", _schedule_step),
        (schedules.PipelineScheduleMulti, "step", _schedule_step),
    ]


def instrument_pipeline() -> bool:
    """Trace torch.distributed.pipelining stages and schedules (and turn on
    instrument_collectives() for their transfers). False where torch lacks what it needs or
    tracing is disabled."""
    if not torch_dist.instrumentable("instrument_pipeline"):
        return False
    try:
        targets = _targets()
    except (ImportError, AttributeError) as exc:
        warn_once("no-pipelining", f"instrument_pipeline: torch {torch.__version__} has no usable "
                                   f"torch.distributed.pipelining ({exc}); pipeline stages are not traced")
        return False
    torch_dist.instrument_collectives()
    done = {(cls, name) for cls, name, _ in _installed}
    for cls, name, wrap in targets:
        if (cls, name) in done:
            continue
        method = cls.__dict__.get(name)
        if method is None:
            warn_once(f"pp-{name}", f"instrument_pipeline: torch {torch.__version__} has no "
                                    f"{cls.__name__}.{name}; that part of the pipeline is not traced")
            continue
        setattr(cls, name, wrap(method))
        _installed.append((cls, name, method))
    return True


def uninstrument_pipeline() -> None:
    """Put the stage and schedule methods back (collectives stay instrumented)."""
    while _installed:
        cls, name, method = _installed.pop()
        setattr(cls, name, method)
