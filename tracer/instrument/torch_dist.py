"""torch.distributed instrumentation: collectives, point-to-point ops, DDP gradient buckets.

    crosstrace.instrument_collectives()     # all_reduce & co. -> COLLECTIVE spans,
                                            # send/recv & co. -> SEND/RECV spans
    crosstrace.instrument_ddp(ddp_model)    # one COLLECTIVE span per gradient bucket

The keys the collector joins on (proto/semconv.py):
- Collectives: (collective.group, collective.seq). The group is torch's group name, the
  same on every rank; seq counts the collectives crosstrace saw on that group in this
  process (explicit ones and DDP buckets alike, those of unsampled steps and of a rank
  that joined early under DDP's join() too), so one collective has one number on every
  rank. Also op (the family: all_gather_into_tensor is "all_gather"), bytes (this
  rank's input), ranks (the group's global ranks), async, and the root of a broadcast,
  reduce, gather or scatter.
- Point-to-point: (p2p.group, p2p.src, p2p.dst, p2p.tag, p2p.seq), ranks global; seq
  counts the messages from src to dst with that tag on that group in the order each side
  posts them, which is the order the backends match them in (each group is a communicator
  of its own).

Timing: a synchronous call is timed by the call (with NCCL it returns once the kernel is
queued: host time only; collective.device names the tensors' device, and the collector
takes no clock facts from the ends of collectives on a device); an async one (async_op=True, isend, irecv, batch_isend_irecv)
from the call until its wait() returns, is_completed() reports it done, or the future
from get_future() completes. A DDP bucket from the moment DDP issues its all-reduce to the
completion callback, which runs on a backend thread (with NCCL the future may complete once
the kernel is queued: host time again); the time its last gradient was ready is the
attribute ddp.ready_ns (same clock as the span). A sampled pass's buckets become spans
together, once its last one completes (or before the next forward), off the all-reduce's
path; each keeps the issuing thread and context.

Spans are recorded inside a sampled step (crosstrace.step) or outside any step; inside an
unsampled one only the counters advance. A call made inside an instrumented call (torch's
send() calls isend()) counts once, as the outer call.

Limits: references taken before instrument_collectives() (`from torch.distributed import
all_reduce`) bypass it; ops inside torch's private _coalescing_manager are counted but
not timed; an async op whose Work is never waited on in Python (DDP's join() hands its
own to the reducer) is counted but has no span; a receive from any source gets its src
and seq when it completes, which pairs it right where such receives complete in the
order they were posted (a blocking recv, irecvs waited in order), and may pair it with
another send of its sender where they do not (the collector unpairs those whose sizes
differ); under torch.compile the wrappers and DDP's hooks run as Python, outside the
compiled graph (a collective called in a compiled function breaks the graph there); a
collective issued from a thread with no trace context of its own belongs to the step open
in the process at that moment (DDP's autograd and backend threads, and a backward run on a
thread, need that), so one that a thread runs beside the steps (a heartbeat) may fall in a
step on one rank and outside it on another, and is then left unmatched.
"""
import atexit
import functools
import inspect
import itertools
import os
import sys
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist
from opentelemetry import trace as trace_api
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.status import StatusCode

from ...proto import semconv as sc
from ..provider import TracerProvider, before_shutdown, current_context
from ..span import Span, UnsampledSpan
from ..step import active_step, run_id, shared_by_ranks, shared_root

AVAILABLE = dist.is_available()
if AVAILABLE:
    from torch.distributed import distributed_c10d as c10d

_warned: set[str] = set()


def _not_compiled(fn):
    """`fn` run as Python under torch.compile too: Dynamo would trace into crosstrace's
    bookkeeping (the DDP model's forward hook and process group, which C++ calls from
    inside a compiled forward, crashed it: a script object's member is not registered)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def warn_once(key: str, message: str) -> None:
    """One clear warning per cause; instrumentation never stops the job it traces."""
    if key in _warned:
        return
    _warned.add(key)
    # Pointed at the first caller outside crosstrace and torch (which calls crosstrace's hooks
    # and wrappers, torch.compiler.disable's among them): the user's line.
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("crosstrace", "torch"):
        level, frame = level + 1, frame.f_back
    warnings.warn(f"crosstrace: {message}", RuntimeWarning, stacklevel=level)


def instrumentable(what: str) -> bool:
    """Whether `what` should wrap anything: torch.distributed is there (else a warning once),
    and tracing is on. Where crosstrace's provider records nothing (CROSSTRACE_DISABLED),
    nothing is wrapped and the job runs untouched."""
    if not AVAILABLE:
        warn_once("no-distributed", f"{what}: this torch {torch.__version__} has no torch.distributed; "
                                    "nothing is traced")
        return False
    provider = trace_api.get_tracer_provider()
    return not (isinstance(provider, TracerProvider) and provider.config.disabled)


# -- where spans go -------------------------------------------------------------------------

class _Tracing:
    """The global provider's tracer and clock, refreshed when the global provider changes."""
    provider = None
    tracer = None
    now = staticmethod(lambda: _tracing().now())  # until the first _tracing(): resolve, then stamp


def _tracing() -> type[_Tracing]:
    provider = trace_api.get_tracer_provider()
    if provider is not _Tracing.provider:
        _Tracing.tracer = provider.get_tracer("crosstrace.torch")
        _Tracing.now = provider.clock.now if isinstance(provider, TracerProvider) else time.time_ns
        _Tracing.provider = provider
    return _Tracing


_NOW = object()   # _parent's default: the context and the step open on this thread now


def _sampled(context) -> bool | None:
    """Whether the span current in `context` is sampled; None where it holds no valid span.
    crosstrace's spans are sampled, known without building a SpanContext: this runs on
    every collective and every DDP forward, where the OpenTelemetry API's calls cost ~20 us
    in all right after a forward's compute (cold caches)."""
    span = context.get(_SPAN_KEY)
    if isinstance(span, Span):
        return True
    if span.__class__ is UnsampledSpan:   # inside an unsampled step
        return False
    if not isinstance(span, trace_api.Span):   # nothing there, or not a span: as the API reads it
        return None
    ctx = span.get_span_context()
    return ctx.trace_flags.sampled if ctx.is_valid else None


def _parent(context=None, step=_NOW, key=None):
    """The parent context of a new span: `context` (None: the current one), else on threads
    without a context of their own the open step's, False inside an unsampled step (record
    nothing). Given a `step` (the open step, or None, captured earlier), that one is used.
    With neither, the root of the trace every rank derives from `key` (a collective's or a
    transfer's join key; step.shared_root), so that its ranks' spans still meet."""
    ctx = current_context() if context is None else context
    sampled = _sampled(ctx)
    if sampled is not None:
        if sampled and key is not None and "own-trace" not in _warned:
            _in_own_trace(ctx, _JOINED[key[0]])
        return context if sampled else False
    if step is _NOW:
        step = active_step()
    if step is None:
        return context if key is None else shared_root(_tracing().provider, key)
    return step if _sampled(step) else False


_JOINED = {"collective": "collective", "p2p": "send or receive", "pipeline.step": "pipeline schedule step"}


def _in_own_trace(context, what: str) -> None:
    """Say once where a collective (a transfer, a pipeline step) runs in a span of the user's
    own outside any crosstrace.step: it is a child of that span, in this rank's own trace,
    which no other rank's side of it is in, so the collector cannot join them."""
    span = context.get(_SPAN_KEY)
    trace_id = span.trace_id if isinstance(span, Span) else span.get_span_context().trace_id
    if shared_by_ranks(trace_id) or not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    name = getattr(span, "name", type(span).__name__)
    warn_once("own-trace", f"a {what} ran inside the span {name!r}, which is in no crosstrace.step: it is "
                           "recorded in this rank's own trace, the other ranks' side of it in theirs, and the "
                           "collector cannot join them (nor tell waiting from transfer). Wrap each training "
                           "step in crosstrace.step(k), inside that span or instead of it")


def _in_run(attributes: dict) -> dict:
    """`attributes` with this run's id (step.run_id), where there is one: the collector keys
    a collective or a transfer outside any step within its run, so that two runs of one job
    id, whose counters both start at 0, are not joined. Inside a step its trace does that."""
    run = run_id()
    if run:
        attributes[sc.RUN_ID] = run
    return attributes


def _end(spans, exc: BaseException | None = None, end_time: int | None = None) -> None:
    for span in spans:
        if span is None:
            continue
        if isinstance(exc, Exception):
            span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
        span.end(end_time)


class _Local(threading.local):
    busy = False  # inside an instrumented call on this thread: nested calls are not traced again


_local = _Local()


# -- keys ---------------------------------------------------------------------------------

class _Group:
    __slots__ = ("name", "ranks", "seq", "unsettled")

    def __init__(self, name: str, ranks: list[int], previous: "_Group | None" = None):
        self.name = name
        self.ranks = ranks
        self.seq = previous.seq if previous else itertools.count()
        self.unsettled = previous.unsettled if previous else set()  # BucketTracers with a pass to count

    def take(self) -> int:
        """The next collective's number, after the buckets of DDP passes run untraced."""
        if self.unsettled:
            for buckets in tuple(self.unsettled):
                buckets.settle()
        return next(self.seq)


_groups: dict[str, _Group] = {}
_pairs: dict[tuple[str, int, int, int], itertools.count] = {}
_p2p_tags: dict[int, dict] = {}


def _group(pg) -> _Group | None:
    """Name, global ranks and collective counter of a process group; None where this rank
    is not a member (torch does nothing there either)."""
    if pg is None:
        pg = c10d._get_default_group()
    elif pg is c10d.GroupMember.NON_GROUP_MEMBER:
        return None
    name = pg.group_name
    group = _groups.get(name)
    if group is None or len(group.ranks) != pg.size():  # new, or re-created under the same name
        group = _groups[name] = _Group(name, c10d.get_process_group_ranks(pg), group)
    return group


def _pair_seq(group: str, src: int, dst: int, tag: int) -> int:
    """The next message's number from src to dst with this tag on this group: each group is a
    communicator of its own, whose messages between two ranks match apart from another's."""
    key = (group, src, dst, tag)
    counter = _pairs.get(key)
    if counter is None:
        counter = _pairs.setdefault(key, itertools.count())
    return next(counter)


def _group_name(pg) -> str:
    return (pg if pg is not None else c10d._get_default_group()).group_name


def tag_p2p(tensor, attributes: dict) -> None:
    """Extra attributes for the next send or receive of `tensor` (pipeline.py adds the
    stage, microbatch and action this way)."""
    _p2p_tags[id(tensor)] = attributes


def clear_p2p_tags() -> None:
    _p2p_tags.clear()


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(map(_nbytes, value))
    return 0


def _device(value) -> str | None:
    """The device type of the first tensor in `value` (cpu, cuda, ...), None without one."""
    if isinstance(value, torch.Tensor):
        return value.device.type
    if isinstance(value, (list, tuple)):
        return next(filter(None, map(_device, value)), None)
    return None


class Params:
    """Where a function's arguments are, to read them per call without inspect.bind()."""

    def __init__(self, fn):
        params = inspect.signature(fn).parameters
        self.position = {name: i for i, name in enumerate(params)}
        self.default = {name: p.default for name, p in params.items()}

    def get(self, name: str, args: tuple, kwargs: dict):
        if name in kwargs:
            return kwargs[name]
        i = self.position[name]
        return args[i] if i < len(args) else self.default[name]


# -- collectives and point-to-point -------------------------------------------------------

# function -> (op family, the argument holding this rank's input, the argument naming a root)
COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor", None),
    "all_gather": ("all_gather", "tensor", None),
    "all_gather_into_tensor": ("all_gather", "input_tensor", None),
    "reduce_scatter": ("reduce_scatter", "input_list", None),
    "reduce_scatter_tensor": ("reduce_scatter", "input", None),
    "all_to_all": ("all_to_all", "input_tensor_list", None),
    "all_to_all_single": ("all_to_all", "input", None),
    "broadcast": ("broadcast", "tensor", "src"),
    "reduce": ("reduce", "tensor", "dst"),
    "gather": ("gather", "tensor", "dst"),
    "scatter": ("scatter", "tensor", "src"),
    "all_reduce_coalesced": ("all_reduce", "tensors", None),
    "all_gather_single": ("all_gather", "input_tensor", None),
    "reduce_scatter_single": ("reduce_scatter", "input", None),
    "barrier": ("barrier", None, None),
}
# torch 2.13's successors of all_gather_into_tensor and reduce_scatter_tensor: an older torch
# has nothing by these names to trace, and nothing to warn about.
NEWER = {"all_gather_single", "reduce_scatter_single"}
POINT_TO_POINT = {"send": True, "isend": True, "recv": False, "irecv": False}  # name -> is a send


def _global_rank(group, rank, group_rank):
    """A peer or root as a global rank, from either of torch's ways to name it."""
    if rank is not None or group_rank is None:
        return rank
    return c10d.get_global_rank(group if group is not None else c10d._get_default_group(), group_rank)


def _collective_span(name: str, group: _Group, op: str, asynchronous: bool, measure):
    """The span of the next collective on `group`, keyed (group, seq); None inside an
    unsampled step (the number is taken either way). `measure()` gives (its tensors, global
    rank of the root or None), read only for a span that is recorded."""
    seq = group.take()
    parent = _parent(key=("collective", group.name, seq))
    if parent is False:
        return None
    tensors, root = measure()
    attributes = _collective_keys(group, seq, op, asynchronous, _nbytes(tensors))
    device = _device(tensors)
    if device is not None:
        attributes[sc.COLL_DEVICE] = device
    if root is not None:
        root = attributes[sc.COLL_ROOT] = int(root)
        attributes[sc.COLL_IS_ROOT] = root == c10d.get_rank()   # (a node's rank may be unknown to the collector)
    return _tracing().tracer.start_span(name, parent, attributes=_in_run(attributes))


def _collective_keys(group: _Group, seq: int, op: str, asynchronous: bool, nbytes: int) -> dict:
    """A collective span's attributes that every one has (the join key and what it moved)."""
    return {sc.KIND: "collective", sc.COLL_GROUP: group.name, sc.COLL_SEQ: seq, sc.COLL_OP: op,
            sc.COLL_RANKS: group.ranks, sc.COLL_ASYNC: asynchronous, sc.COLL_BYTES: nbytes}


def _traced_collective(name: str, original):
    op, input_arg, root_arg = COLLECTIVES[name]
    params = Params(original)

    def traced(*args, **kwargs):
        if _local.busy:
            return original(*args, **kwargs)
        span = failure = None
        asynchronous = False
        try:
            pg = params.get("group", args, kwargs)
            group = _group(pg)
            if group is not None:
                asynchronous = bool(params.get("async_op", args, kwargs))
                span = _collective_span(name, group, op, asynchronous, lambda: (
                    params.get(input_arg, args, kwargs) if input_arg else None,
                    None if root_arg is None else _global_rank(pg, params.get(root_arg, args, kwargs),
                                                               params.get(f"group_{root_arg}", args, kwargs))))
        except Exception as exc:  # tracing must not change what the call does
            failure = exc
        return _call(name, original, args, kwargs, [span] if span is not None else None, asynchronous, failure)

    return _not_compiled(traced)


def _start_p2p(name: str, send: bool, pg, peer, tag: int, tensor):
    """A SEND or RECV span keyed (group, src, dst, tag, seq); None when not recorded. The
    pair's counter advances either way (not for a receive from any source: _any_source)."""
    extra = _p2p_tags.pop(id(tensor), None)
    me = c10d.get_rank()
    src, dst = (me, peer) if send else (peer, me)
    group = _group_name(pg)
    seq = _pair_seq(group, src, dst, tag) if peer is not None else None
    parent = _parent(key=None if seq is None else ("p2p", group, src, dst, tag, seq))
    if parent is False:
        return None
    attributes = {sc.KIND: "send" if send else "recv", sc.P2P_GROUP: group, sc.P2P_SRC: src, sc.P2P_DST: dst,
                  sc.P2P_TAG: tag, sc.P2P_SEQ: seq, sc.P2P_BYTES: _nbytes(tensor)}
    device = _device(tensor)
    if device is not None:
        attributes[sc.P2P_DEVICE] = device
    if extra:
        attributes.update(extra)
    return _tracing().tracer.start_span(name, parent, attributes=_in_run(attributes))


def _any_source(group, tag: int):
    """For a receive from any source: set src and seq once the sender is known."""
    def finish(result, spans):
        src = result if isinstance(result, int) else _global_rank(group, None, result._source_rank())
        seq = _pair_seq(_group_name(group), src, c10d.get_rank(), tag)
        for span in spans:
            if span is not None:
                span.set_attributes({sc.P2P_SRC: src, sc.P2P_SEQ: seq})
    return finish


def _traced_p2p(name: str, original):
    send = POINT_TO_POINT[name]
    peer_arg = "dst" if send else "src"
    asynchronous = name.startswith("i")
    params = Params(original)

    def traced(*args, **kwargs):
        if _local.busy:
            return original(*args, **kwargs)
        span = failure = finish = None
        try:
            group = params.get("group", args, kwargs)
            if group is not c10d.GroupMember.NON_GROUP_MEMBER:
                peer = _global_rank(group, params.get(peer_arg, args, kwargs),
                                    params.get(f"group_{peer_arg}", args, kwargs))
                tag = params.get("tag", args, kwargs) or 0
                span = _start_p2p(name, send, group, peer, tag, params.get("tensor", args, kwargs))
                if peer is None:  # counted once the sender is known, recorded or not
                    finish = _any_source(group, tag)
        except Exception as exc:
            failure = exc
        return _call(name, original, args, kwargs, [span] if span is not None else None, asynchronous,
                     failure, finish)

    return _not_compiled(traced)


def _traced_batch(name: str, untraced_batch):
    isend = c10d.isend

    def traced(p2p_op_list):
        if _local.busy:
            return untraced_batch(p2p_op_list)
        spans, failure, sends = [], None, []
        try:
            for p2p in p2p_op_list:
                send = p2p.op == isend  # the original or its stand-in: they compare equal
                p2p.op = c10d.isend if send else c10d.irecv  # torch tells them apart by identity
                sends.append(send)
                spans.append(_start_p2p("isend" if send else "irecv", send, p2p.group, p2p.peer, p2p.tag,
                                        p2p.tensor))
        except Exception as exc:
            spans, failure = [], exc
        try:
            works = _call(name, untraced_batch, (p2p_op_list,), {}, spans, False, failure, ended=False)
        finally:   # the user's ops go back holding torch's own functions, which it knows after uninstrumenting
            for p2p, send in zip(p2p_op_list, sends):
                p2p.op = original("isend" if send else "irecv")
        recorded = [s for s in spans if s is not None]
        if not recorded:
            return works
        if len(works) == len(spans):
            return [w if s is None else _TracedWork(w, [s]) for w, s in zip(works, spans)]
        if works:  # coalesced (NCCL): the last work completes them all
            return [*works[:-1], _TracedWork(works[-1], recorded)]
        _end(recorded)
        return works

    return _not_compiled(traced)


def _call(name, original, args, kwargs, spans, asynchronous, failure, finish=None, ended=True):
    """Run the original with nested calls untraced; end or hand over the spans."""
    _local.busy = True
    try:
        result = original(*args, **kwargs)
    except BaseException as exc:
        if spans:
            _end(spans, exc)
        raise
    finally:
        _local.busy = False
    if failure is not None:
        warn_once(f"trace-{name}", f"could not trace torch.distributed.{name} ({failure!r}); it runs untraced")
    if not ended or (not spans and finish is None):
        return result
    spans = spans or []
    try:
        if asynchronous and result is not None:
            if isinstance(result, getattr(c10d, "_IllegalWork", ())):
                return result  # inside torch's coalescing manager: counted, not timed
            return _TracedWork(result, spans, finish)
        if finish is not None and result is not None:
            finish(result, spans)
        _end(spans)
    except Exception as exc:
        warn_once(f"trace-{name}", f"could not trace torch.distributed.{name} ({exc!r}); it runs untraced")
    return result


class _TracedWork(dist.Work if AVAILABLE else object):
    """The Work of an async op; its spans end once the op is known complete: wait()
    returned, is_completed() said so, or the future from get_future() finished. Everything
    else is the wrapped Work's."""

    def __init__(self, work, spans, finish=None):
        super().__init__()
        self._work = work
        self._pending = [spans]  # list.pop() is atomic: exactly one caller ends the spans
        self._finish = finish

    def _complete(self, exc: BaseException | None = None) -> None:
        try:
            spans = self._pending.pop()
        except IndexError:
            return
        try:
            if self._finish is not None and exc is None:
                self._finish(self._work, spans)
            _end(spans, exc)
        except Exception as err:
            warn_once("trace-work", f"could not end a torch.distributed span ({err!r})")

    def wait(self, *args, **kwargs):
        try:
            done = self._work.wait(*args, **kwargs)
        except BaseException as exc:
            self._complete(exc)
            raise
        if done is not False:
            self._complete()
        return done

    def is_completed(self):
        done = self._work.is_completed()
        if done:
            self._complete()
        return done

    def get_future(self):
        future = self._work.get_future()
        future.add_done_callback(lambda _: self._complete())
        return future


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._work, name)(*args, **kwargs)
    method.__name__ = name
    return method


if AVAILABLE:
    for _name in dir(dist.Work):
        if not _name.startswith("__") and _name not in _TracedWork.__dict__ and _name not in (
                "unbox", "_pybind11_conduit_v1_"):
            setattr(_TracedWork, _name, _delegate(_name))


class _Patched:
    """The traced stand-in for a torch.distributed function. It compares equal to the
    function it wraps, so torch's own checks (P2POp takes only isend or irecv) accept
    either, including references taken before instrumenting."""

    def __init__(self, original, call):
        functools.update_wrapper(self, original)
        self._call = call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __eq__(self, other):
        return other is self or other is self.__wrapped__ or (
            isinstance(other, _Patched) and other.__wrapped__ is self.__wrapped__)

    def __hash__(self):
        return hash(self.__wrapped__)

    def __repr__(self):
        return f"<crosstrace-traced {self.__wrapped__!r}>"


WRAPPERS = {**{name: _traced_collective for name in COLLECTIVES},
            **{name: _traced_p2p for name in POINT_TO_POINT},
            "batch_isend_irecv": _traced_batch}
_installed: dict[str, tuple] = {}  # name -> (original, stand-in)


def instrument_collectives() -> bool:
    """Trace torch.distributed's collectives and point-to-point ops (both torch.distributed
    and torch.distributed.distributed_c10d); False where torch.distributed is missing or
    tracing is disabled."""
    if not instrumentable("instrument_collectives"):
        return False
    for name, make in WRAPPERS.items():
        if name in _installed:
            continue
        original = getattr(c10d, name, None)
        if original is None and name in NEWER:
            continue
        if original is None:
            warn_once(f"missing-{name}", f"torch {torch.__version__} has no torch.distributed.{name}; "
                                         "it is not traced")
            continue
        patched = _Patched(original, make(name, original))
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                setattr(module, name, patched)
        _installed[name] = (original, patched)
    return True


def uninstrument_collectives() -> None:
    """Put the original functions back (where nobody has replaced ours since)."""
    for name, (original, patched) in list(_installed.items()):
        for module in (c10d, dist):
            if getattr(module, name, None) is patched:
                setattr(module, name, original)
        del _installed[name]


def original(name: str):
    """The untraced torch.distributed function."""
    return _installed[name][0] if name in _installed else getattr(c10d, name)


# -- DDP gradient buckets ------------------------------------------------------------------

def instrument_ddp(model, hook=None, state=None):
    """Trace each gradient bucket of a DistributedDataParallel model as a COLLECTIVE span
    (bucket index, bytes, parameter count, ready/issue/complete times). Returns the model.

    Without `hook`, DDP keeps its own all-reduce: its reducer is given a process group that
    is the model's own (the same backends) with allreduce() recording the bucket. DDP scales
    each gradient while copying it into its bucket, so the gradients stay DDP's own and
    tracing adds no pass over them, which any comm hook would (it must scale the bucket
    itself). To keep a comm hook of your own, pass it here (`instrument_ddp(model,
    hook=powerSGD_hook, state=...)`) instead of to model.register_comm_hook(): crosstrace
    then registers a comm hook that records each bucket and runs yours. DDP allows one hook
    per model, so a model that already has one (or a built-in C++ hook) is left untraced with
    a warning; so is a model whose hook is registered after this call. With tracing disabled
    (CROSSTRACE_DISABLED) the model is left as it is."""
    if not instrumentable("instrument_ddp"):
        return model
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        warn_once("ddp-type", f"instrument_ddp needs a DistributedDataParallel model, not "
                              f"{type(model).__name__}; its gradient sync is not traced")
        return model
    buckets = _tracers.get(model)
    if buckets is not None and buckets.hook is not None:      # crosstrace's comm hook is on for good
        if hook is not None and hook is not buckets.hook:
            warn_once("ddp-rehook", f"this DDP model keeps the comm hook {buckets.hook_name} it was first "
                                    "instrumented with: DDP allows one per model; the new hook is not used")
        if model in _instrumented:
            return model
    else:
        existing = _comm_hook_of(model)
        if existing is not None:
            warn_once("ddp-hooked", f"this DDP model already has the comm hook {existing} and DDP allows one; "
                                    "pass it as crosstrace.instrument_ddp(model, hook=..., state=...) instead "
                                    "of model.register_comm_hook() to trace it. Its buckets are not traced")
            return model
        if buckets is not None and hook is not None:   # traced without a hook so far: a hook from now on
            uninstrument_ddp(model)
            buckets = None
        elif model in _instrumented:
            return model
    buckets = buckets or BucketTracer(model, hook, state)
    try:
        if buckets.hook is None:
            # The reducer holds the C++ side only: without a Python reference the group's
            # Python methods would be gone, and the reducer would call the backends untraced.
            buckets.reducer_group = _BucketGroup(model.process_group, buckets)
            buckets.use(model, buckets.reducer_group)
            # DDP's join hook all-reduces zeros on a rank out of data, through the reducer:
            # counted on that rank as the others' backward pass is.
            model._match_all_reduce_for_bwd_pass = functools.partial(buckets.shadow_pass, model)
        elif _tracers.get(model) is not buckets:     # a new tracer with the user's hook
            model.register_comm_hook(buckets, _traced_bucket)
        model._distributed_broadcast_coalesced = functools.partial(buckets.broadcast_buffers, model)
        buckets.forward_handle = model.register_forward_hook(buckets.forward_done)
    except (AttributeError, RuntimeError, ValueError, TypeError) as exc:
        warn_once("ddp-register", f"could not trace this DDP model's buckets with torch {torch.__version__} "
                                  f"({exc}); it trains untraced")
        return model
    _tracers[model] = buckets
    _instrumented.add(model)
    return model


def uninstrument_ddp(model) -> None:
    """Undo instrument_ddp(model): DDP's reducer gets the model's own process group back.
    A comm hook cannot be taken off a DDP model: with a hook of yours, crosstrace's stays
    around it and only stops recording (instrument_ddp(model) resumes it)."""
    if model not in _instrumented:
        return
    _instrumented.discard(model)
    buckets = _tracers[model]
    buckets.forward_handle.remove()
    buckets.settle(last=True)
    buckets.next_pass()
    buckets.sampled = False
    model.__dict__.pop("_distributed_broadcast_coalesced", None)
    if buckets.reducer_group is not None:
        buckets.use(model, model.process_group)
        model.__dict__.pop("_match_all_reduce_for_bwd_pass", None)
        buckets.reducer_group = None


def _comm_hook_of(model) -> str | None:
    """The name of a comm hook the model has (built-in C++ ones too), None if it has none."""
    try:
        return model._get_ddp_logging_data().get("comm_hook")
    except (AttributeError, RuntimeError):
        hooks = getattr(model, "_comm_hooks", None)
        return getattr(hooks[0][0], "__qualname__", "a comm hook") if hooks else None


_tracers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # DDP model -> its BucketTracer, kept
_instrumented: "weakref.WeakSet" = weakref.WeakSet()                 # the models being traced now
_BACKEND_TYPES = dist.ProcessGroup.BackendType.__members__ if AVAILABLE else {}


class _BucketGroup(dist.ProcessGroup if AVAILABLE else object):
    """The process group DDP's reducer all-reduces its buckets through once instrumented:
    it holds the model's group's own backends (and its name and bound device, which a
    backend registered here is given), so every call goes straight to them; allreduce()
    also records the bucket."""

    def __init__(self, group, buckets: "BucketTracer"):
        super().__init__(group.rank(), group.size())
        self.bound_device_id = group.bound_device_id
        self._set_group_name(group.group_name)
        for device in group._device_types:
            backend = group._get_backend(device)
            kind = _BACKEND_TYPES.get(backend.name().upper(), dist.ProcessGroup.BackendType.CUSTOM)
            self._register_backend(device, kind, backend)
        default = _BACKEND_TYPES.get(group.name().upper())   # the name of the group's default backend
        if default is not None:
            self._set_default_backend(default)
        self._group, self._buckets = group, buckets

    def getBackendName(self) -> str:
        return self._group.name()

    @_not_compiled
    def broadcast(self, tensors, opts):
        """DDP's bucket rebuild broadcasts the new bucket order (once, in the second forward),
        a collective like the others; the reducer waits for it at once, so it is waited for
        here, inside its span. Inherited, the call would go to the backend with the GIL held
        by torch's trampoline, and a gloo worker that frees a finished work holding Python
        state needs the GIL while it holds the queue lock that the call waits for: a
        deadlock (the DDP test hung so, 3 times in about 140 runs). The group's own binding
        releases the GIL, and so does wait()."""
        def bucket_order():
            work = self._group.broadcast(tensors, opts)
            work.wait()
            return work

        return self._buckets.collective("ddp.broadcast_bucket_order", bucket_order, tensors, opts.rootRank)

    @_not_compiled
    def allreduce(self, tensors, opts):
        bucket = self._buckets.issued(tensors)
        try:
            work = self._group.allreduce(tensors, opts)
        except BaseException as exc:
            if bucket is not None:
                bucket(None, exc)
            raise
        if bucket is not None:
            work.get_future().add_done_callback(bucket)
        return work


def _bucket_layout(model, param_index: dict) -> tuple[list, bool]:
    """Per bucket, in DDP's launch order: (bytes, the reducer's variable indices); and
    whether that is final until DDP rebuilds. DDP's logging data has the rebuilt layout from
    the forward after the rebuild on; before, it has the sizes only, and one bucket is all
    parameters. Otherwise the layout is read from zero-filled copies of the buckets, on the
    host only: on a GPU a copy as large as the gradients could exceed the memory, and the
    buckets go without their parameters."""
    data = model._get_ddp_logging_data()
    if data.get("rebuilt_per_bucket_param_indices"):
        sizes = data["rebuilt_bucket_sizes"].split(",")
        indices = data["rebuilt_per_bucket_param_indices"].split(",")
        return [(int(size), [int(i) for i in members.split()]) for size, members in zip(sizes, indices)], True
    sizes = [int(size) for size in str(data.get("bucket_sizes", "")).split(",") if size.strip()]
    rebuilt = getattr(model, "_has_rebuilt_buckets", False)
    if len(sizes) == 1 and not rebuilt:
        return [(sizes[0], sorted(param_index.values()))], True
    if all(p.device.type == "cpu" for p in model.parameters()):
        return [(b.buffer().numel() * b.buffer().element_size(), [param_index.get(id(p)) for p in b.parameters()])
                for b in model.reducer._get_zeros_like_grad_buckets()], True
    return [], not rebuilt   # rebuilt: the logging data has the layout from the next forward on


def _buckets_final(model) -> bool:
    """Whether DDP's buckets stay as they are: rebuilt (once, in the second forward), or
    never to be (find_unused_parameters without static_graph). A rank that joins under
    join() before its second forward rebuilds them in the join hook, unflagged: they are
    never final there, and each bucket is counted as it goes."""
    return bool(getattr(model, "_has_rebuilt_buckets", False)) or (
        bool(getattr(model, "find_unused_parameters", False)) and not getattr(model, "static_graph", False))


def _traced_bucket(state, bucket):
    """The comm hook DDP calls with each bucket when the user's hook is wrapped (DDP wants
    the parameter named `bucket`)."""
    return state.run(bucket)


class BucketTracer:
    """Records the gradient buckets of one DDP model. After each forward it decides whether
    the backward pass to come is recorded (its step is sampled). Every bucket takes a number
    of the group's collective counter, recorded or not, so that the numbers follow the
    group's real order and ranks whose sampling differs still agree on them.

    An unsampled pass runs DDP's all-reduce untouched, in C++ through the model's own
    process group. Its buckets are counted all at once when the group's counter is next
    used after its backward ran (the reducer's per-gradient times then changed). Until
    DDP's buckets are final, an unsampled pass goes through the recording group, which
    counts each. A bucket's ready time is its last gradient's, from the times DDP's reducer
    notes for every gradient anyway, so no Python runs per gradient."""

    def __init__(self, model, hook=None, state=None):
        self.hook, self.state = hook, state
        self.hook_name = getattr(hook, "__qualname__", repr(hook)) if hook is not None else None
        ignored = getattr(model, "parameters_to_ignore", ())
        params = [p for name, p in model.module.named_parameters() if p.requires_grad and name not in ignored]
        self.param_index = {id(p): i for i, p in enumerate(params)}  # the reducer's variable indices
        self.layout = []       # per bucket, in DDP's launch order: (bytes, variable indices)
        self.layout_of = None  # the model's _has_rebuilt_buckets when the layout was read
        self.next = 0          # the bucket DDP launches next in this backward pass
        self.completed = []    # buckets of sampled passes, completed, not recorded yet (_InFlight)
        self.pending = False   # their recording is handed to the exporter and has not run yet
        self.passes = 0        # backward passes begun (and buckets recorded before each)
        self.stats_before = None   # the reducer's per-gradient times of the pass before this one
        self.keys = _group(model.process_group)   # the group's name, ranks and collective counter
        self.sampled = False   # whether the backward pass to come is recorded
        self.reducer = None
        self.tracing = _Tracing   # the provider's tracer and clock, looked up after each forward
        self.backward_start = 0
        self.reducer_group = None   # the recording group (without a hook of the user's)
        self.routed = None          # the group the reducer all-reduces through now
        self.unsettled = 0          # buckets of an unsampled pass, not counted yet
        self.times_before = None    # the reducer's per-gradient times when that pass's forward ended
        self.forward_handle = None

    @_not_compiled
    def forward_done(self, module, inputs, output) -> None:
        """After a forward that a synced backward pass will follow: that pass launches the
        buckets again from the first, and is recorded if its step is sampled. DDP rebuilds
        its buckets once, early in a forward; then the layout is read anew."""
        self.next_pass()
        if not (torch.is_grad_enabled() and module.require_backward_grad_sync):
            return   # an evaluation forward, or one under no_sync(): no all-reduce follows it
        self.next = 0
        self.sampled = False   # until this step's decision is known: record nothing
        rebuilt = getattr(module, "_has_rebuilt_buckets", None)
        try:
            self.sampled = _parent() is not False
            if self.sampled:
                self.tracing = _tracing()
                self.backward_start = self.tracing.now()  # DDP's prepare_for_backward started its clock just before
            self.reducer = module.reducer
            if self.hook is None and rebuilt != self.layout_of:   # early passes only: a hook comes before training
                hooked = _comm_hook_of(module)
                if hooked is not None:
                    warn_once("ddp-hooked-later", f"the comm hook {hooked} was registered on this DDP model after "
                                                  "crosstrace.instrument_ddp(): DDP runs it instead of the all-reduce "
                                                  "crosstrace traces, so its buckets are not traced; pass it as "
                                                  "crosstrace.instrument_ddp(model, hook=..., state=...) instead")
                self.layout, final = _bucket_layout(module, self.param_index)
                if final:
                    self.layout_of = rebuilt
        except Exception as exc:
            self.layout, self.layout_of = [], rebuilt   # tried again after the next rebuild only
            warn_once("ddp-layout", f"could not read this DDP model's buckets ({exc!r}); they are traced "
                                    "without their parameters")
        if self.reducer_group is not None:
            self._route(module)

    def _route(self, module) -> None:
        """Give the reducer the recording group for a sampled backward pass, the model's own
        for an unsampled one whose buckets are final. Between a forward and its backward no
        all-reduce of DDP's is in flight. Never raises."""
        try:
            times = self.settle(last=True)
            own = module.process_group
            if self.reducer_group._group is not own:   # DDP's _update_process_group moved the model
                self.reducer_group, self.keys = _BucketGroup(own, self), _group(own)
            untraced = not self.sampled and bool(self.layout) and _buckets_final(module)
            if untraced:
                try:
                    self.times_before = times if times is not None else module.reducer.get_backward_stats()
                except (AttributeError, RuntimeError):
                    untraced = False   # whether the pass ran could not be told: counted per bucket
            self.use(module, own if untraced else self.reducer_group)
            if untraced:
                self.unsettled = len(self.layout)
                self.keys.unsettled.add(self)
        except Exception as exc:  # never let tracing break gradient sync
            warn_once("ddp-route", f"could not route this DDP model's unsampled steps ({exc!r}); "
                                   "they go through crosstrace's process group")

    def use(self, module, group) -> None:
        """Have DDP's reducer all-reduce through `group` (one call, when that changes)."""
        if group is not self.routed:
            module.reducer._update_process_group(group)
            self.routed = group

    def settle(self, last: bool = False):
        """Count the buckets of the last unsampled pass if its backward has run. With
        `last`, no backward can follow any more: a pass that did not run is forgotten.
        Returns the reducer's per-gradient times it read (None: none read), which are the
        next pass's `times_before` where no backward runs in between (one read a step less)."""
        if not self.unsettled:
            return None
        times = self.reducer.get_backward_stats()
        ran = times != self.times_before
        if ran or last:
            unsettled, self.unsettled = self.unsettled, 0
            self.keys.unsettled.discard(self)
            for _ in range(unsettled if ran else 0):
                next(self.keys.seq)
        return times

    def shadow_pass(self, model):
        """DDP's join hook on a rank out of data, matching the others' backward pass with
        all-reduces of zeros: through the recording group, which counts them."""
        try:
            self.settle(last=True)
            self.sampled, self.next = False, 0
            self.use(model, self.reducer_group)
        except Exception as exc:  # never let tracing break the join
            warn_once("ddp-route", f"could not count the all-reduces of DDP's join ({exc!r})")
        return type(model)._match_all_reduce_for_bwd_pass(model)

    @_not_compiled
    def broadcast_buffers(self, model, tensors, buffer_size, authoritative_rank=0):
        """DDP's broadcast of the module's buffers (BatchNorm's running statistics) before each
        forward. Untraced, a rank that waited there for a late one was counted as computing."""
        return self.collective("ddp.broadcast_buffers", functools.partial(
            type(model)._distributed_broadcast_coalesced, model, tensors, buffer_size, authoritative_rank),
            tensors, authoritative_rank)

    def collective(self, name: str, call, tensors, root: int):
        """Run `call`, one of DDP's broadcasts of `tensors`, as a collective on the model's
        group (numbered on every rank, recorded in a sampled step); `root` is a rank of the
        group."""
        span = failure = None
        try:
            group = self.keys
            span = _collective_span(name, group, "broadcast", False, lambda: (tensors, group.ranks[root]))
        except Exception as exc:  # tracing must not change what the call does
            failure = exc
        return _call(name, call, (), {}, [span] if span is not None else None, False, failure)

    def issued(self, tensors):
        """DDP's reducer all-reduces `tensors`: the bucket to record, None when the step is
        not sampled or this is not a bucket (DDP's int32 map of unused parameters). DDP
        launches a backward pass's buckets in their order; the layout read after the forward
        names each one's parameters. Never raises."""
        try:
            if len(tensors) != 1:
                return None
            tensor = tensors[0]
            if not (tensor.is_floating_point() or tensor.is_complex()):
                return None
            k = self.next
            self.next = k + 1
            seq = self.keys.take()
            if not self.sampled:
                return None
            nbytes = tensor.nbytes
            layout = self.layout[k] if k < len(self.layout) else None
            return _InFlight(self, k, seq, nbytes, layout[1] if layout is not None and layout[0] == nbytes else None)
        except Exception as exc:  # never let tracing break gradient sync
            warn_once("ddp-trace", f"could not trace a DDP bucket ({exc!r}); gradients are synced untraced")
            return None

    def run(self, bucket):
        """The comm hook's work: note the bucket, run the user's hook on it."""
        record = None
        try:
            seq = self.keys.take()
            if self.sampled:
                index, buffer = self.param_index, bucket.buffer()
                record = _InFlight(self, bucket.index(), seq, buffer.nbytes,
                                   [index.get(id(p)) for p in bucket.parameters()])
        except Exception as exc:  # never let tracing break gradient sync
            warn_once("ddp-trace", f"could not trace a DDP bucket ({exc!r}); gradients are synced untraced")
        _local.busy = True  # the hook's own collectives are this bucket's
        try:
            future = self.hook(self.state, bucket)
        except BaseException as exc:
            if record is not None:
                record(None, exc)
            raise
        finally:
            _local.busy = False
        if record is not None:
            future.add_done_callback(record)
        return future

    def completed_one(self, late: bool) -> None:
        """A bucket completed (on a backend thread): have the completed ones recorded off the
        training loop's path, by crosstrace's exporter thread before its next batch
        (TracerProvider.defer; once until it has run). Built where the pass's last bucket
        completed, their spans took ~110 us a step (cold caches, and the GIL the optimizer
        step wanted meanwhile). Under another provider: at once, where the pass's last
        bucket completes (or one after its pass)."""
        defer = self._defer()
        if defer is None:
            if late or len(self.completed) >= (len(self.layout) or 1):
                self.record()
        elif not self.pending:
            self.pending = True
            defer(self.record)

    def _defer(self):
        """The provider's TracerProvider.defer; None under another provider (records at once)."""
        return getattr(self.tracing.provider, "defer", None)

    def next_pass(self) -> None:
        """From the training loop's thread before the next pass: the reducer's per-gradient
        times are the ending pass's until the next backward starts, so its buckets' ready
        times are fixed now (for buckets recorded later, and those completing later), and
        under another provider than crosstrace's its completed buckets are recorded."""
        if self.sampled and self.reducer is not None:
            try:
                self.stats_before = self.reducer.get_backward_stats()
            except (AttributeError, RuntimeError):
                self.stats_before = None
        self.passes += 1
        for bucket in list(self.completed):
            bucket.fix_ready()
        if self._defer() is None:
            self.record()

    def record(self) -> None:
        """Turn the completed buckets into spans. Safe from several threads at once: each
        bucket is popped once."""
        self.pending = False
        completed = self.completed
        while completed:
            try:
                bucket = completed.pop()
            except IndexError:
                return
            try:
                self._span(bucket)
            except Exception as exc:  # never raise into a backend thread or the training loop
                warn_once("ddp-trace", f"could not trace a DDP bucket ({exc!r}); gradients are synced untraced")

    def _span(self, bucket: "_InFlight") -> None:
        group, params, issued = bucket.group, bucket.params, bucket.issued
        parent = _parent(bucket.context, bucket.step, ("collective", group.name, bucket.seq))
        if parent is False:
            return
        attributes = _collective_keys(group, bucket.seq, "all_reduce", True, bucket.nbytes)
        attributes[sc.DDP_BUCKET] = bucket.index
        if params is not None:
            attributes[sc.DDP_PARAMS] = len(params)
            bucket.fix_ready()
            attributes[sc.DDP_READY_NS] = bucket.ready
        if self.hook_name is not None:
            attributes[sc.DDP_HOOK] = self.hook_name
        tracing = _tracing()
        ours = isinstance(tracing.provider, TracerProvider)   # then `issued` is on its clock, else epoch ns
        span = tracing.tracer.start_span("ddp.all_reduce", parent, attributes=_in_run(attributes),
                                         start_time=None if ours else issued)
        if ours and isinstance(span, Span):
            span.start = issued
            span.thread = bucket.thread   # the issuing thread's
        error = bucket.error
        if error is None and bucket.future is not None:
            try:
                bucket.future.value()
            except Exception as exc:
                error = exc
        end = bucket.end
        if ours:
            end = _completed_within(parent, issued, end)
        # `end` is on the tracing clock; a crosstrace span's end() takes epoch ns and maps them
        # back, so both conversions happen now: drift and wall-clock steps since cancel out
        _end([span], error, time.time_ns() + (end - tracing.now()) if ours else end)

    def _ready(self, params, issued: int, backward_start: int, stats=None) -> int:
        """When the bucket's last gradient was accumulated. The reducer notes each one's time
        from the start of the backward pass (prepare_for_backward, on its own clock), which
        was just before forward_done stamped backward_start: at most that little late, and
        never after the all-reduce was issued. The reducer's times are the pass's until the
        next backward starts: a bucket of a pass that is over gets `stats`, the times
        copied when the next forward ended."""
        try:
            since = stats if stats is not None else self.reducer.get_backward_stats()
            last = max(since[i] for i in params if i is not None)
        except (AttributeError, RuntimeError, IndexError, TypeError, ValueError):
            return issued
        return min(backward_start + last, issued)


def _completed_within(parent, issued: int, end: int) -> int:
    """A bucket's end, no later than the end of the span it was issued in. The callback that
    stamps it runs on the backend thread once the future has completed, and waits for the
    GIL there (or behind a slow callback of a user's hook), while the reducer's wait
    returned at completion: stamps came up to 4.7 ms after the rank's backward and step
    had ended. Backward waits for every bucket, so a span open across it (the step, a
    backward span) ended after the all-reduce did; one that ended before the bucket was
    issued (a remote parent) bounds nothing."""
    span = parent.get(_SPAN_KEY)
    if isinstance(span, Span) and issued < span.end_ns < end:
        return span.end_ns
    return end


class _InFlight:
    """A bucket of a recorded pass, noted where it is issued (its number, size, time and
    the issuing thread's context), and its completion callback, which runs on a backend
    thread: it stamps the end and queues the bucket for BucketTracer.record (completed_one
    says who runs it, and when). The backend drops its callbacks after completing
    the future, and dropping one takes the GIL, which aborts the process if the interpreter
    is already finalizing (a short script that exits right after its last backward). So the
    buckets not dropped yet are counted, and at exit crosstrace waits for them, briefly; and
    so does the tracer's shutdown, which the loop may reach before the last pass's callbacks
    ran (the reducer's wait returns before them): their spans would be dropped."""

    __slots__ = ("tracer", "group", "index", "seq", "nbytes", "params", "issued", "backward_start", "context",
                 "step", "thread", "pass_", "end", "future", "error", "ready")
    held: list = []           # one entry per callback not dropped yet (append and pop are atomic)
    _exit_hook = False

    def __init__(self, tracer: BucketTracer, index: int, seq: int, nbytes: int, params):
        _InFlight.held.append(None)
        self.tracer, self.index, self.seq, self.nbytes, self.params = tracer, index, seq, nbytes, params
        self.group = tracer.keys   # the model's group when issued: recorded later, it may have moved
        self.issued = tracer.tracing.now()
        self.backward_start, self.pass_ = tracer.backward_start, tracer.passes
        self.context, self.step, self.thread = current_context(), active_step(), threading.get_ident()
        self.ready = None
        if not _InFlight._exit_hook:
            _InFlight._exit_hook = True
            atexit.register(_InFlight.at_exit)
            before_shutdown(_InFlight.at_exit)   # the last buckets complete as the loop may shut down

    def __call__(self, future, error: BaseException | None = None) -> None:
        tracer = self.tracer
        self.end, self.future, self.error = tracer.tracing.now(), future, error   # its outcome is read later
        late = self.pass_ != tracer.passes
        if late:
            self.fix_ready()
        tracer.completed.append(self)
        tracer.completed_one(late)

    def fix_ready(self) -> None:
        """Fix the ready time (once), from the reducer's times of this bucket's pass: read now
        while it lasts, else those copied when it ended (BucketTracer.next_pass)."""
        if self.ready is None and self.params is not None:
            tracer = self.tracer
            stats = None if self.pass_ == tracer.passes else tracer.stats_before
            self.ready = tracer._ready(self.params, self.issued, self.backward_start, stats)

    def __del__(self):
        try:
            _InFlight.held.pop()
        except IndexError:   # one of a parent's, in a forked child that forgot them
            pass

    @staticmethod
    def at_exit(timeout_s: float = 1.0) -> None:
        """Record what completed until every bucket is dropped (or the time is up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for tracer in list(_tracers.values()):
                tracer.record()
            if not _InFlight.held or time.monotonic() >= deadline:
                return
            time.sleep(0.001)


def _forget_buckets_after_fork() -> None:
    """In a forked child (a DataLoader worker): the parent's buckets in flight are not the
    child's. Kept, its exit waited a second for callbacks it has none of, at every epoch's
    end, and recorded spans the parent records."""
    for tracer in list(_tracers.values()):
        tracer.completed, tracer.pending = [], False
    _InFlight.held.clear()


if AVAILABLE:
    os.register_at_fork(after_in_child=_forget_buckets_after_fork)
