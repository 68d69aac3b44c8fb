"""Span kinds and attribute keys shared by tracer and collector.

The collector joins spans across ranks and nodes by these keys, so they are part
of the wire contract, like the .proto file.
"""
from enum import IntEnum


class Kind(IntEnum):
    """Mirrors crosstrace.v1.SpanKind."""
    INTERNAL = 0
    COMPUTE = 1
    COLLECTIVE = 2
    SEND = 3
    RECV = 4
    RPC_CLIENT = 5
    RPC_SERVER = 6
    DATA = 7


class Status(IntEnum):
    UNSET = 0
    OK = 1
    ERROR = 2


# OpenTelemetry's span kinds, by name, onto crosstrace's: a CLIENT span is an RPC client, and
# so on; INTERNAL (and anything else) is INTERNAL. The tracer reads it for the OpenTelemetry
# API's kinds, the collector for OTLP's, both ways.
OTEL_KINDS = {"CLIENT": Kind.RPC_CLIENT, "SERVER": Kind.RPC_SERVER, "PRODUCER": Kind.SEND, "CONSUMER": Kind.RECV}

# Overrides the span kind when set on a plain OpenTelemetry span ("compute", "data", ...).
KIND = "crosstrace.kind"
KIND_BY_NAME = {k.name.lower(): k for k in Kind}   # the values KIND takes
KIND_NAMES = {k.value: name for name, k in KIND_BY_NAME.items()}   # and back: what exports name a kind

# Training steps: the trace id of step k is derived from (job_id, k) on every rank.
STEP = "crosstrace.step"
STEP_ROUND = "crosstrace.step.round"   # on a step whose number came again (an epoch from 0): which time
JOB_ID = "crosstrace.job_id"
RUN_ID = "crosstrace.run_id"      # on step, collective and p2p spans where the run is known (tracer/step.py)

# Collectives: the same collective has the same (group, seq) on every rank.
COLL_GROUP = "collective.group"
COLL_SEQ = "collective.seq"
COLL_OP = "collective.op"
COLL_BYTES = "collective.bytes"
COLL_RANKS = "collective.ranks"
COLL_ASYNC = "collective.async"
COLL_ROOT = "collective.root"      # global rank of the root of a broadcast or reduce
COLL_IS_ROOT = "collective.is_root"   # on a rooted op's span: whether this rank is its root
# The device type of its tensors (cpu, cuda, ...): on a device a synchronous call returns
# once the op is queued (NCCL), so its end says nothing of when the others entered.
COLL_DEVICE = "collective.device"

# Point-to-point: a send and its receive share (group, src, dst, tag, seq).
P2P_GROUP = "p2p.group"
P2P_SRC = "p2p.src"
P2P_DST = "p2p.dst"
P2P_TAG = "p2p.tag"
P2P_SEQ = "p2p.seq"
P2P_BYTES = "p2p.bytes"
P2P_DEVICE = "p2p.device"   # as collective.device: a receive on a device ends when queued, not received

# DDP gradient buckets (collective spans issued by the DDP comm hook).
DDP_BUCKET = "ddp.bucket"
DDP_PARAMS = "ddp.params"
DDP_READY_NS = "ddp.ready_ns"
DDP_HOOK = "ddp.hook"              # the user's own comm hook, when crosstrace wraps one
# Attributes that hold a time on the clock of the span's node, as its start and end do:
# exports that place spans on the aligned timeline place these with them.
NODE_CLOCK_TIMES = (DDP_READY_NS,)

# Pipeline parallel (torch.distributed.pipelining).
PP_STAGE = "pp.stage"
PP_MICROBATCH = "pp.microbatch"
PP_ACTION = "pp.action"            # "F", "B" or "W"
PP_SCHEDULE = "pp.schedule"
PP_NUM_STAGES = "pp.num_stages"
PP_NUM_MICROBATCHES = "pp.num_microbatches"
PP_STAGES_PER_RANK = "pp.stages_per_rank"

# RPCs (OpenTelemetry semantic conventions).
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS = "rpc.grpc.status_code"

# Resources outside a crosstrace tracer (OTLP) and exports to OpenTelemetry backends.
NODE_ID = "crosstrace.node_id"
RANK = "crosstrace.rank"
ROLE = "crosstrace.role"
ERROR_BOUND_NS = "crosstrace.error_bound_ns"   # exported spans: bound on the aligned times' error
# Resource.labels: CLOCK_LABEL says which clock a node's span times are on: CLOCK_UNIX_EPOCH, the
# wall clock (OTLP senders), or a tracer's monotonic clock, "monotonic:<boot and simulation>"
# (tracer/clock.py Clock.domain); SOURCE_LABEL says how spans came in.
CLOCK_LABEL = "clock"
CLOCK_UNIX_EPOCH = "unix_epoch"
SOURCE_LABEL = "source"
