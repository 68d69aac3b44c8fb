"""Training steps: one trace per step, shared by every rank without a message per step.

    with crosstrace.step(k):              # step k of the training loop
        ...
    with crosstrace.step(k, every=10):    # trace every 10th step
        ...
    @crosstrace.step                      # each call is the next step
    def train_step(batch): ...
    for batch in crosstrace.steps(loader):  # each iteration is a step; fetching the batch too
        ...

The trace id of step k follows from (job_id, run, k) alone: every rank computes the same id on its
own, so the collector finds all ranks' spans of a step in one trace. The run (run_id) keeps
a job's runs apart; the ranks agree on it once, through torch.distributed's store. A step
number below the one before starts a new round (an epoch that numbers its steps from 0
again): the round goes into the id too, so each epoch's step k is a trace of its own,
the same on every rank as long as they step alike. Sampling is the same
on every rank too (k % every == 0); inside an unsampled step the current span is a
non-recording one, so spans started under it (collectives, DDP buckets, user spans) cost
next to nothing and are not exported: crosstrace's Tracer and OpenTelemetry's SDK both
follow the parent's sampled flag.

It uses OpenTelemetry's global provider, whichever it is. Choosing a trace id through the
OpenTelemetry API means starting the span under a remote parent of that id, which other
providers keep (never recorded); crosstrace's starts the step span as a root of its trace
on each rank.
"""
import hashlib
import operator
import os
import sys
import threading
import warnings

from opentelemetry import trace as trace_api
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.status import StatusCode

from ..proto import semconv as sc
from .config import Config
from .provider import TracerProvider, attach, context_with, current_context, detach_quietly, traced_calls
from .span import RemoteParent, Span, UnsampledSpan

_M64 = (1 << 64) - 1
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)

_next_step = 0    # the number a step without an explicit number gets
_last_step = None  # the number of the step entered last, and the round it is in:
_round = 0         # how many times step numbers went down (each epoch numbering from 0)
_open: list = []   # Contexts of the open steps in this process, in the order they were entered
_open_lock = threading.Lock()


def step_trace_id(job_id: str, k: int | str, run: str = "", round_: int = 0) -> int:
    """The 128-bit trace id of step k of a job's run (or of a shared_root's key) in its
    round: the same on every rank, never 0. For a step number, a hash of (job, run, round),
    taken once, is mixed with k by a bijection: a hash per step cost ~20 us right after a
    step's compute (cold caches), on every step, sampled or not."""
    try:
        k = operator.index(k)   # a numpy integer as the int it is
    except TypeError:
        return _hash(f"{job_id}\x00{k}" + (f"\x00{run}" if run else "") + (f"\x00round {round_}" if round_ else ""))
    base = _bases.get((job_id, run, round_))
    if base is None:
        if len(_bases) >= 64:
            _bases.clear()
        base = _bases[job_id, run, round_] = _hash(f"{job_id}\x00{run}\x00round {round_}")
    return (base ^ k * _ODD) & _M128 or 1   # k * odd is one-to-one modulo 2**128: no two steps share an id


_bases: dict = {}   # (job, run, round) -> the hash its steps' ids are mixed from
_ODD = 0x9E3779B97F4A7C15F39CC0605CEDC835   # odd (2**128 / the golden ratio): spreads k over all bits
_M128 = (1 << 128) - 1


def _hash(key: str) -> int:
    digest = hashlib.blake2b(key.encode(), digest_size=16, person=b"crosstrace.step").digest()
    return int.from_bytes(digest, "big") or 1


_derived: set = set()   # the trace ids of steps and shared roots this process took lately


def _derive(*key) -> int:
    """step_trace_id(*key), noted as a trace every rank shares (see shared_by_ranks)."""
    trace_id = step_trace_id(*key)
    if len(_derived) >= 4096:   # the ones in use now are the ones taken last
        _derived.clear()
    _derived.add(trace_id)
    return trace_id


def shared_by_ranks(trace_id: int) -> bool:
    """Whether `trace_id` is one every rank derives alike (a step's, a shared root's), not
    one of this rank's own: a collective in it meets the other ranks' side."""
    return trace_id in _derived


_run = None   # this run's id, once agreed (run_id)
_RUN_KEY = "crosstrace/run_id"


def run_id() -> str:
    """What tells this run's steps from another run's of the same job id (a job run again
    into the same collector): CROSSTRACE_RUN_ID, else torchrun's run id (with its restart
    count: a restart is a new run), which every rank has from the start, else a random id
    the ranks agree on once, at the first step (or traced collective or transfer) after
    torch.distributed is initialized, through its store (the first rank to ask sets it); ""
    before that, or without any of these: step k's trace then follows from the job id
    alone. So steps taken before init_process_group under a launcher without a run id
    share their traces across runs."""
    global _run
    if _run is None:
        env = os.environ
        elastic = env.get("TORCHELASTIC_RUN_ID", "none")
        run = env.get("CROSSTRACE_RUN_ID") or (
            f"{elastic}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}" if elastic not in ("", "none") else None)
        if run is None:
            run = _agreed_run_id()
            if run is None:   # torch.distributed not (yet) initialized: asked again at the next step
                return ""
        _run = run
    return _run


def _agreed_run_id() -> str | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set(_RUN_KEY, "", os.urandom(8).hex()).decode()
    except Exception as exc:   # a store without compare_set, say: steps follow from the job id alone
        warnings.warn(f"crosstrace.step: the ranks could not agree on a run id ({exc!r}); runs of one job id "
                      "share their steps' traces (set CROSSTRACE_RUN_ID)", RuntimeWarning, stacklevel=4)
        return ""


def job_id_of(provider) -> str:
    """The job id steps are derived from: crosstrace's configured one (the same that goes
    into every batch's Resource), else CROSSTRACE_JOB_ID, else Config's default (runs are
    told apart by run_id)."""
    if isinstance(provider, TracerProvider):
        return provider.config.job_id
    return os.environ.get("CROSSTRACE_JOB_ID") or Config.job_id


def active_step():
    """The Context of the step entered last of those open in this process, or None. For code
    that runs on threads where the step's context is not current (backend and autograd
    threads)."""
    return _open[-1] if _open else None


def root_context(provider, trace_id: int):
    """The parent context of a span that is a root of the trace `trace_id` on this rank,
    while the other ranks' spans of that trace are roots on theirs."""
    if isinstance(provider, TracerProvider):
        return {_SPAN_KEY: RemoteParent(trace_id, 0)}
    return trace_api.set_span_in_context(_origin(trace_id))


def shared_root(provider, key: str):
    """root_context of a trace every rank derives alike, from the job, the run and `key`
    (a collective's group and number, say): a collective or transfer outside any step
    then has all its ranks' spans in one trace, as a step has."""
    return root_context(provider, _derive(job_id_of(provider), key, run_id()))


def _origin(trace_id: int) -> NonRecordingSpan:
    """The remote parent that carries a sampled step's trace id under another provider."""
    return NonRecordingSpan(SpanContext(trace_id, (trace_id & _M64) or 1, True, _SAMPLED))


class Step:
    """One training step: a context manager, or a decorator whose every call is a step."""

    __slots__ = ("k", "every", "name", "job_id", "attributes", "span", "_token", "_context")

    def __init__(self, k: int | None = None, every: int = 1, name: str = "step",
                 job_id: str | None = None, attributes: dict | None = None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"crosstrace.step: every must be a positive integer, not {every!r}")
        self.k = k
        self.every = every
        self.name = name
        self.job_id = job_id
        self.attributes = attributes
        self.span = None

    def __enter__(self):
        global _next_step, _last_step, _round
        if self.span is not None:
            raise RuntimeError("crosstrace.step: a step object can be entered only once")
        k = _next_step if self.k is None else int(self.k)
        if _last_step is not None and k < _last_step:
            _round += 1
        _next_step, _last_step, self.k, round_ = k + 1, k, k, _round
        provider = trace_api.get_tracer_provider()
        job, run = self.job_id or job_id_of(provider), run_id()
        if k % self.every:   # nothing recorded: no span of it needs to know that all ranks share its trace
            trace_id = step_trace_id(job, k, run, round_)
            span = UnsampledSpan(trace_id, (trace_id & _M64) or 1)
        else:
            trace_id = _derive(job, k, run, round_)
            attributes = {sc.STEP: k, sc.JOB_ID: job}
            if run:
                attributes[sc.RUN_ID] = run
            if round_:
                attributes[sc.STEP_ROUND] = round_
            if self.attributes:
                attributes.update(self.attributes)
            span = provider.get_tracer(__name__).start_span(self.name, root_context(provider, trace_id),
                                                            attributes=attributes)
        ctx = self._context = context_with(span, current_context())
        self.span = span
        self._token = attach(ctx)
        with _open_lock:
            _open.append(ctx)
        return span

    def __exit__(self, exc_type, exc, tb) -> bool:
        span = self._leave()
        if span.__class__ is not UnsampledSpan and span.is_recording():
            failed = isinstance(exc, Exception)
            if failed:
                span.record_exception(exc, escaped=True)
                span.set_status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}")
            span.end()
            if failed and isinstance(span, Span):   # sent now: torchrun ends the others by SIGTERM when one fails
                span._sink.wake()
        return False

    def discard(self) -> None:
        """Leave the step without recording it (a loop that turned out to be over)."""
        self._leave()

    def _leave(self):
        """Close the step, wherever it is among the open ones (steps on threads end in any order)."""
        with _open_lock:
            try:
                _open.remove(self._context)   # each step's own Context (its own span): found by identity
            except ValueError:   # left already: a second exit
                pass
        detach_quietly(self._token)   # a steps() loop may be closed under another context
        return self.span

    @property
    def sampled(self) -> bool:
        return self.span is not None and self.span.get_span_context().trace_flags.sampled

    def __call__(self, func):
        if self.k is not None:
            raise TypeError("crosstrace.step used as a decorator numbers the calls itself: "
                            "give it no step number")
        options = (self.every, self.name, self.job_id, self.attributes)
        return traced_calls(func, lambda: Step(None, *options))


def step(k=None, *, every: int = 1, name: str = "step", job_id: str | None = None,
         attributes: dict | None = None):
    """Step k of the training loop (the next number when k is omitted), traced when
    k % every == 0. `with crosstrace.step(k):`, `@crosstrace.step` or
    `@crosstrace.step(every=10)`. job_id defaults to crosstrace's configured job id."""
    if callable(k):
        return Step(None, every, name, job_id, attributes)(k)
    return Step(k, every, name, job_id, attributes)


def steps(iterable, *, start: int | None = None, every: int = 1, name: str = "step",
          job_id: str | None = None, attributes: dict | None = None):
    """Iterate over `iterable` (a data loader), each iteration inside its own step: the
    fetch of the item (a DATA span "next_batch") and the loop body that uses it. Numbers
    continue from `start`, else from the last step."""
    items = iter(iterable)
    k = start
    while True:
        current = Step(k, every, name, job_id, attributes)
        span = current.__enter__()
        fetch = None
        if span.is_recording():
            tracer = trace_api.get_tracer(__name__)
            fetch = tracer.start_span("next_batch", attributes={sc.KIND: "data"})
        try:
            item = next(items)
        except StopIteration:
            current.discard()  # the fetch span is never ended, so never exported
            return
        except BaseException as exc:
            current.__exit__(type(exc), exc, exc.__traceback__)
            raise
        if fetch is not None:
            fetch.end()
        try:
            yield item
        except BaseException as exc:  # GeneratorExit when the loop breaks or fails
            current.__exit__(type(exc), exc, exc.__traceback__)
            raise
        current.__exit__(None, None, None)
        k = None if k is None else k + 1
