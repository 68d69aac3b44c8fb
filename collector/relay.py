"""Relay mode (`crosstrace collector --forward-to ENDPOINT`): an edge gateway's collector
that keeps its devices' batches like any collector (so the site can be analysed on its
own while the uplink is down) and hands every one on upstream as it came, with its
session and seq, so that the upstream collector deduplicates replays exactly.

One thing changes on the way: a device's two-way clock exchanges answered by this relay
(GRPC_EXCHANGE / UDP_EXCHANGE samples with no peer) measured the device against the
relay, so they go up with `peer` = the relay's node id, and `peer_clock` = the relay's clock
that answered them, which the device noted from the answer (a relay rebooted under its node
id is another clock upstream, Store.clock_samples). The relay's own exchanges with
upstream travel in its own batches; upstream then composes device -> relay -> upstream,
with bounds that add (collector/align.py). Relays chain the same way, and each adds its mark to the batch's `relayed_by`: a batch
that comes back to a relay (two relays forwarding to each other) was stored there when it
first passed, and goes no further, where it circled for ever.

The upstream side (stream, acks, spool, the relay's own clock probes) is the tracer's
Exporter, wired in by `crosstrace collector`; here it is any object with
`forward(batch)` that returns once the batch is durable.
"""
import logging

from ..proto import MAX_MESSAGE_BYTES, pb
from .ingest import TooLarge
from .store import MEASURED_HERE

log = logging.getLogger("crosstrace.collector")

# What marking a batch adds at most: its relay mark (a 16-byte session id, tag and length),
# and per clock exchange named, two strings' tags and lengths and its own length's growth.
_MARK_BYTES = 20
_SAMPLE_MARK_BYTES = 12


def for_upstream(batch: "pb.SpanBatch", relay_node_id: str, relay_clock: str) -> "pb.SpanBatch":
    """`batch` with its device-to-relay clock exchanges naming the relay as their peer (in
    place), and its clock where the device did not say (an older tracer): a batch probed
    before the relay rebooted names the clock that answered it, not the relay's now."""
    for sample in batch.clock_samples:
        if not sample.peer and sample.source in MEASURED_HERE:
            sample.peer = relay_node_id
            sample.peer_clock = sample.peer_clock or relay_clock
    return batch


class Relay:
    """The collector's `forward` hook: every ingested batch, after the local commit.
    `clock`: the relay's clock's name (tracer.clock.Clock.domain)."""

    def __init__(self, node_id: str, upstream, clock: str):
        self.node_id = node_id
        self.upstream = upstream
        self.clock = clock
        self.mark = upstream.session_id   # this relay process: node ids need not be unique
        self._warned = False

    def came_back(self, batch: "pb.SpanBatch") -> bool:
        """Whether `batch` passed this relay before: stored here then, forwarded no further."""
        if self.mark not in batch.relayed_by:
            return False
        if not self._warned:
            self._warned = True
            log.warning("crosstrace relay %s: a batch from %s came back after %d relay(s): a forwarding loop "
                        "(check each relay's --forward-to); such batches are not stored or forwarded again",
                        self.node_id, batch.resource.node_id, len(batch.relayed_by))
        return True

    def check_fits(self, batch: "pb.SpanBatch", size: int | None = None) -> None:
        """Refuse, before it is kept and acked, a batch that would go over gRPC's message limit
        once marked for upstream (its mark, and the relay named in its clock exchanges):
        upstream refused it, and the relay dropped the batch it had acked. `size`: its bytes
        as they came (else measured, which costs about what serializing it does)."""
        marked = sum(1 for s in batch.clock_samples if not s.peer and s.source in MEASURED_HERE)
        size = (batch.ByteSize() if size is None else size) + _MARK_BYTES + marked * (
            len(self.node_id.encode()) + len(self.clock.encode()) + _SAMPLE_MARK_BYTES)
        if size > MAX_MESSAGE_BYTES:
            raise TooLarge(f"batch seq={batch.seq} would be about {size} bytes once marked for upstream; a relay "
                           f"forwards at most {MAX_MESSAGE_BYTES} bytes a batch")

    def __call__(self, batch: "pb.SpanBatch") -> None:
        batch.relayed_by.append(self.mark)
        self.upstream.forward(for_upstream(batch, self.node_id, self.clock))
