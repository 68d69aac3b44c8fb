"""Clock samples against the collector: bursts of two-way probes over gRPC.

Runs on the exporter thread; every probe's four timestamps are kept (t1 and t4 on this
node's clock, t2 and t3 on the collector's) and travel with the next span batch.
"""
import time

import grpc

from ..proto import pb

_CLOCK_METHOD = "/crosstrace.v1.Collector/ExchangeClock"


class ClockProber:
    def __init__(self, cfg, clock, samples, get_channel):
        self.cfg = cfg
        self.clock = clock
        self.samples = samples          # deque drained into the next batch
        self._get_channel = get_channel
        self._next = 0.0

    def probe_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.cfg.clock_probe_interval_s
        exchange = self._get_channel().unary_unary(
            _CLOCK_METHOD, request_serializer=pb.ClockProbe.SerializeToString,
            response_deserializer=pb.ClockProbeReply.FromString)
        clock_now, node = self.clock.now, self.cfg.node_id
        for _ in range(self.cfg.clock_probe_burst):
            t1 = clock_now()
            try:
                reply = exchange(pb.ClockProbe(node_id=node, t1=t1), timeout=1.0)
            except grpc.RpcError:
                return
            t4 = clock_now()
            self.samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=t1, t2=reply.t2, t3=reply.t3,
                                               t4=t4, local_ns=t1))
