"""The collector against a client's garbage: clear gRPC statuses, bad spans rejected one by
one and counted by reason, good spans stored, other clients unaffected. Raw batches go
over a real gRPC stream to a real collector process."""
import struct
import time

import grpc
import numpy as np
import pytest

from crosstrace.collector.store import Store
from crosstrace.launch import wait_until
from crosstrace.proto import pb

from .conftest import run_python, span_count

EXPORT = "/crosstrace.v1.Collector/Export"


def batch(n: int, seq: int = 1, node: str = "raw", trace_hi: int = 7, first_id: int = 1, **override) -> pb.SpanBatch:
    cols = {
        "trace_id_hi": np.full(n, trace_hi, "<u8"), "trace_id_lo": np.full(n, 9, "<u8"),
        "span_id": np.arange(first_id, first_id + n, dtype="<u8"), "parent_span_id": np.zeros(n, "<u8"),
        "start_ns": np.arange(n, dtype="<i8") * 1000 + 10**9, "end_ns": np.arange(n, dtype="<i8") * 1000 + 10**9 + 500,
        "kind": np.ones(n, "u1"), "status": np.zeros(n, "u1"), "name": np.zeros(n, "<u4"),
        "thread": np.ones(n, "<u8"),
    }
    cols.update(override)
    b = pb.SpanBatch(resource=pb.Resource(node_id=node), session_id=b"s" * 16, seq=seq, count=n,
                     strings=["op"], attributes_json=b"[" + b",".join([b"null"] * n) + b"]")
    for field, arr in cols.items():
        setattr(b, field, arr.tobytes() if isinstance(arr, np.ndarray) else arr)
    return b


def export(address: str, messages: list[bytes], timeout: float = 10):
    """Send raw messages on one Export stream; return (acks, error or None)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(EXPORT, request_serializer=None, response_deserializer=pb.ExportAck.FromString)
        acks = []
        try:
            for ack in call(iter(messages), timeout=timeout):
                acks.append(ack)
        except grpc.RpcError as err:
            return acks, err
        return acks, None


def rejects(collector) -> dict:
    with Store(collector.store, readonly=True) as store:
        return store.rejects()


def test_good_batch_is_acked_and_stored(collector):
    acks, err = export(collector.address, [batch(100).SerializeToString()])
    assert err is None and [(a.seq, a.accepted) for a in acks] == [(1, 100)]
    assert span_count(collector.store) == 100


def test_undecodable_message_gets_invalid_argument_and_collector_stays_up(collector):
    acks, err = export(collector.address, [b"\xff\xfe not a protobuf \x00" * 3])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "undecodable SpanBatch" in err.details()
    acks, err = export(collector.address, [batch(5).SerializeToString()])
    assert err is None and acks[0].accepted == 5
    assert rejects(collector)["malformed_batch"] == 1


def test_wrong_id_length_is_a_clear_invalid_argument(collector):
    bad = batch(4, span_id=b"\x01" * 31)  # 4 spans need 32 bytes
    acks, err = export(collector.address, [batch(3).SerializeToString(), bad.SerializeToString()])
    assert [a.accepted for a in acks] == [3]  # the good batch before it was stored
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "span_id has 31 bytes; expected 8 per span x count=4" in err.details()


def test_bad_spans_are_rejected_individually_and_the_rest_stored(collector):
    n = 10
    start = np.arange(n, dtype="<i8") * 1000 + 10**9
    end = start + 500
    end[1] = start[1] - 1                    # end before start
    start[2] = end[2] = (1 << 62) + 5        # absurd: ~146 years after boot
    start[6], end[6] = -(1 << 63), 1 << 62   # absurd too (abs() of the first would wrap around)
    ids = np.arange(1, n + 1, dtype="<u8")
    ids[3] = 0                               # invalid span id
    kinds = np.ones(n, "u1")
    kinds[4] = 200                           # unknown kind
    names = np.zeros(n, "<u4")
    names[5] = 9                             # no such string
    acks, err = export(collector.address, [batch(n, start_ns=start, end_ns=end, span_id=ids, kind=kinds,
                                                  name=names).SerializeToString()])
    assert err is None
    ack = acks[0]
    assert ack.accepted == 4
    assert dict(ack.rejected) == {"end_before_start": 1, "absurd_timestamp": 2, "invalid_span_id": 1,
                                  "unknown_kind": 1, "bad_name_index": 1}
    assert span_count(collector.store) == 4
    assert rejects(collector)["end_before_start"] == 1


def test_bad_attributes_json_is_invalid_argument(collector):
    b = batch(2)
    b.attributes_json = b'[{"a": 1}]'  # one entry for two spans
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "count=2" in err.details()
    b.attributes_json = b"[not json"
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid JSON" in err.details()


def test_json_nested_too_deep_is_invalid_argument(collector):
    b = batch(2)
    b.attributes_json = b"[" * 100_000
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid JSON" in err.details()


def test_out_of_range_counters_are_refused_and_the_collector_goes_on(collector):
    """seq and dropped_spans are uint64 on the wire, int64 in the store: such a batch is
    refused when it is checked, before it can reach a shared group commit."""
    for bad in (batch(3, seq=(1 << 64) - 1, node="bad"), batch(3, seq=1, node="bad2")):
        if bad.resource.node_id == "bad2":
            bad.dropped_spans = 1 << 63
        acks, err = export(collector.address, [bad.SerializeToString()])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most" in err.details()
    acks, err = export(collector.address, [batch(50, node="good").SerializeToString()])
    assert err is None and acks[0].accepted == 50 and span_count(collector.store) == 50


def test_missing_node_id_is_invalid_argument(collector):
    acks, err = export(collector.address, [batch(2, node="").SerializeToString()])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "node_id is empty" in err.details()


def test_oversize_batch_gets_resource_exhausted(collector):
    huge = b"\x0a" + b"\xff\xff\xff\x3f" + b"x" * (65 << 20)  # a 65 MiB field: above the 64 MiB limit
    acks, err = export(collector.address, [huge], timeout=60)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.details()
    assert export(collector.address, [batch(1).SerializeToString()])[0][0].accepted == 1


def test_resent_batch_is_stored_once(collector):
    data = batch(50).SerializeToString()
    acks, err = export(collector.address, [data, data])  # e.g. a resend after a lost ack
    assert err is None and [(a.accepted, a.duplicates) for a in acks] == [(50, 0), (0, 50)]
    # Overlapping spans in a different batch of the same trace, on a new stream.
    acks, err = export(collector.address, [batch(30, seq=2, first_id=41).SerializeToString()])
    assert (acks[0].accepted, acks[0].duplicates) == (20, 10)
    # The same span ids in another trace are different spans.
    acks, err = export(collector.address, [batch(50, seq=3, trace_hi=8).SerializeToString()])
    assert acks[0].accepted == 50
    assert span_count(collector.store) == 120


def test_duplicates_within_one_batch_are_stored_once(collector):
    ids = np.array([1, 2, 2, 3, 1], dtype="<u8")
    acks, _ = export(collector.address, [batch(5, span_id=ids).SerializeToString()])
    assert (acks[0].accepted, acks[0].duplicates) == (3, 2)


def test_duplicates_across_batches_of_one_group_commit_are_stored_once(tmp_path):
    """Batches that arrive together are committed in one transaction (group commit): a span
    in two of them is stored once, and the window remembers the group's spans afterwards."""
    from crosstrace.collector.ingest import check

    with Store(str(tmp_path / "store.db")) as store:
        group = [check(batch(40, seq=1)), check(batch(30, seq=2, first_id=31)), check(batch(10, seq=3, first_id=51))]
        assert [(r.accepted, r.duplicates) for r in store.write(group)] == [(40, 0), (20, 10), (0, 10)]
        assert [(r.accepted, r.duplicates) for r in store.write([check(batch(80, seq=4))])] == [(20, 60)]
        assert store.span_count() == 80


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_literal(name: str, value: str) -> bytes:
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def test_stream_dying_mid_batch_stores_the_complete_batches_only(collector):
    """A hand-made HTTP/2 client sends one whole batch, then half of the next, then vanishes."""
    import socket

    host, port = collector.address.rsplit(":", 1)
    headers = b"".join(_hpack_literal(k, v) for k, v in [
        (":method", "POST"), (":scheme", "http"), (":path", EXPORT), (":authority", collector.address),
        ("content-type", "application/grpc"), ("te", "trailers")])
    whole = batch(11, trace_hi=31).SerializeToString()
    partial = batch(1000, seq=2, trace_hi=32).SerializeToString()
    grpc_msgs = (b"\x00" + struct.pack(">I", len(whole)) + whole
                 + b"\x00" + struct.pack(">I", len(partial)) + partial[: len(partial) // 2])
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        data_frames = b"".join(_h2_frame(0, 0, 1, grpc_msgs[i:i + 16384])  # HTTP/2's default max frame
                               for i in range(0, len(grpc_msgs), 16384))
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b"")
                     + _h2_frame(1, 0x4, 1, headers) + data_frames)
        deadline = time.monotonic() + 10
        while span_count(collector.store) < 11 and time.monotonic() < deadline:
            time.sleep(0.05)
    time.sleep(0.3)
    assert span_count(collector.store) == 11
    acks, err = export(collector.address, [batch(2, seq=10, trace_hi=5).SerializeToString()])
    assert err is None and acks[0].accepted == 2
    assert span_count(collector.store) == 13


@pytest.mark.parametrize("count", [0])
def test_empty_batch_with_clock_samples_only(collector, count):
    b = batch(count)
    b.attributes_json = b""
    b.clock_samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=1, t2=2, t3=3, t4=4))
    for _ in range(2):   # and its resend after a lost ack: not kept as a batch, read once all the same
        acks, err = export(collector.address, [b.SerializeToString()])
        assert err is None and acks[0].accepted == 0
    store = Store(collector.store, readonly=True)
    assert len(store.clock_samples()) == 1
    store.close()


def test_accepted_spans_of_any_shape_leave_report_and_exports_working(collector, tmp_path):
    """The collector keeps attributes and extras as a client sent them (valid JSON): join keys
    that are lists or objects, nesting and strings orjson cannot write, events and links of
    the wrong shape. None of it may stop a report or an export of the whole store."""
    import json
    import subprocess
    import sys

    from .test_otlp import receiving

    attributes = [{"collective.group": [1], "collective.seq": 1}, {"p2p.src": [0], "p2p.dst": 1, "p2p.seq": 0},
                  {"collective.group": "g", "collective.seq": {"x": 1}}, {"big": 1 << 70}]
    raw = b"[" + b",".join(json.dumps(a).encode() for a in attributes) + b',{"s":"\\ud800","deep":' \
        + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}]"
    extras = [[0, {"events": "nope"}], [1, {"events": [["e", "not a time", None]], "links": [["zz", "yy", None]]}],
              [2, {"status_message": {"a": 1}, "links": "no"}]]
    b = batch(5, kind=np.array([2, 3, 2, 1, 1], "u1"), status=np.array([0, 0, 2, 0, 0], "u1"))
    b.attributes_json, b.extras_json = raw, json.dumps(extras).encode()
    for t in (10**9, 2 * 10**9):   # the node's clock model, without which an OTLP export leaves it out
        b.clock_samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=t, t2=t + 100, t3=t + 200, t4=t + 300))
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err is None and acks[0].accepted == 5

    with receiving() as (receiver, port):
        for args in (["report"], ["export", "--jsonl", str(tmp_path / "s.jsonl"), "--perfetto", str(tmp_path / "p.json"),
                                  "--otlp", f"127.0.0.1:{port}"]):
            out = subprocess.run([sys.executable, "-m", "crosstrace", *args, "--store", collector.store],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 5
    assert sum(len(s.spans) for r in receiver.requests for rs in r.resource_spans for s in rs.scope_spans) == 5


def test_a_batch_checked_after_shutdown_began_is_told_to_retry(tmp_path):
    """A stream's batch may finish its check after the collector stopped its writer (a big
    batch, SIGTERM meanwhile): it must be answered (UNAVAILABLE: retry), not wait for ever,
    which kept the collector from exiting."""
    from crosstrace.collector.ingest import check
    from crosstrace.collector.server import StoreUnavailable, Writer

    with Store(str(tmp_path / "s.db")) as store:
        writer = Writer(store)
        assert writer.submit(check(batch(3))).result(timeout=10).accepted == 3
        writer.close()
        with pytest.raises(StoreUnavailable, match="shutting down"):
            writer.submit(check(batch(3, seq=2))).result(timeout=10)


def test_bytes_in_flight_are_bounded():
    """A batch waits while others fill the bound (alone it always fits); after the wait its
    client is told to retry, and it goes through once there is room."""
    import threading

    from crosstrace.collector.server import InFlight, StoreUnavailable

    bound = InFlight(64 << 20, wait_s=0.3)
    with bound.hold(100 << 20):                     # larger than the bound, alone: admitted
        with pytest.raises(StoreUnavailable, match="busy"):
            with bound.hold(1 << 20):
                pass
    entered = threading.Event()

    def second():
        with bound.hold(8 << 20):
            entered.set()

    bound.wait_s = 10
    with bound.hold(60 << 20):
        waiting = threading.Thread(target=second)
        waiting.start()
        time.sleep(0.2)
        assert not entered.is_set()   # 60 + 8 MB would not fit: it waits
    waiting.join(10)
    assert entered.is_set() and bound.used == 0


def test_bytes_waiting_for_room_are_bounded():
    """Batches waiting for room are held as they came: 24 streams of 40 MB batches held 1.8
    GB. Beyond waiting_bytes a batch is told to retry at once; alone it always waits."""
    import threading

    from crosstrace.collector.server import InFlight, StoreUnavailable

    bound = InFlight(64 << 20, wait_s=10, waiting_bytes=100 << 20)
    waiters = []

    def wait_for_room():
        with bound.hold(40 << 20):
            pass

    with bound.hold(64 << 20):
        for _ in range(2):
            waiters.append(threading.Thread(target=wait_for_room))
            waiters[-1].start()
        assert wait_until(lambda: bound.waiting == 80 << 20, 5)
        with pytest.raises(StoreUnavailable, match="80 MB of batches waiting"):
            with bound.hold(40 << 20):
                pass
    for thread in waiters:
        thread.join(10)
    assert bound.used == bound.waiting == 0

    def wait_with(size):
        with bound.hold(size):
            pass

    with bound.hold(20 << 20):   # one that fits now goes in, however much waits
        waiters = [threading.Thread(target=wait_with, args=(90 << 20,))]
        waiters[0].start()
        assert wait_until(lambda: bound.waiting == 90 << 20, 5)
        with bound.hold(30 << 20):
            assert bound.used == 50 << 20
    waiters[0].join(10)
    assert bound.used == bound.waiting == 0
    with bound.hold(64 << 20), pytest.raises(StoreUnavailable, match="busy"):
        bound.wait_s = 0.1
        with bound.hold(200 << 20):   # alone among the waiting, a batch over the bound waits
            pass


def test_a_full_collector_tells_clients_to_retry(tmp_path):
    """--max-streams bounds the calls served at once (each tracer holds a stream); one more
    gets RESOURCE_EXHAUSTED, which the tracer retries, and is served once a stream ends."""
    import threading

    from crosstrace.launch import CollectorProcess, wait_until

    probe = pb.ClockProbe(t1=1).SerializeToString()
    done = threading.Event()

    def answer():
        try:
            return exchange(probe, timeout=5)
        except grpc.RpcError as err:
            return err.code()

    with CollectorProcess(str(tmp_path / "s.db"), extra_args=("--max-streams", "2")) as collector, \
            grpc.insecure_channel(collector.address) as channel:
        exchange = channel.unary_unary("/crosstrace.v1.Collector/ExchangeClock", request_serializer=None,
                                       response_deserializer=None)
        def hold():   # an idle export stream, as a tracer between batches holds one
            return channel.stream_stream(EXPORT, request_serializer=None,
                                         response_deserializer=pb.ExportAck.FromString)(idle_requests(done))

        def full() -> bool:
            for i, call in enumerate(streams):
                if call.done():   # refused while a probe held a slot: opened again
                    streams[i] = hold()
            return answer() == grpc.StatusCode.RESOURCE_EXHAUSTED

        streams = []
        try:
            streams += [hold(), hold()]
            assert wait_until(full, 20), [call.code() if call.done() else "open" for call in streams]   # both served
            streams[0].cancel()
            assert wait_until(lambda: isinstance(reply := answer(), bytes) and
                              pb.ClockProbeReply.FromString(reply).t1 == 1, 20)
        finally:
            done.set()
            for call in streams:
                call.cancel()


def test_one_connection_cannot_take_every_stream(tmp_path):
    """One client connection opening more idle streams than --max-streams took every slot,
    and every other client was refused for as long as it stayed connected. Its streams
    beyond STREAMS_PER_CONNECTION now wait at that client."""
    import threading

    from crosstrace.collector.server import STREAMS_PER_CONNECTION
    from crosstrace.launch import CollectorProcess

    done = threading.Event()
    probe = pb.ClockProbe(t1=1).SerializeToString()
    with CollectorProcess(str(tmp_path / "s.db"), extra_args=("--max-streams", str(STREAMS_PER_CONNECTION + 4))) \
            as collector, grpc.insecure_channel(collector.address) as greedy, \
            grpc.insecure_channel(collector.address, options=[("grpc.use_local_subchannel_pool", 1)]) as other:
        # (`other` is another client's connection: channels in one process share one by default)
        streams = [greedy.stream_stream(EXPORT, request_serializer=None, response_deserializer=pb.ExportAck.FromString)(
            idle_requests(done)) for _ in range(STREAMS_PER_CONNECTION + 4)]
        try:
            time.sleep(2)   # all of them opened, as far as the connection lets them
            exchange = other.unary_unary("/crosstrace.v1.Collector/ExchangeClock", request_serializer=None,
                                         response_deserializer=pb.ClockProbeReply.FromString)
            assert exchange(probe, timeout=10).t1 == 1
            assert not any(call.done() for call in streams)   # none refused: they wait
        finally:
            done.set()
            for call in streams:
                call.cancel()


def idle_requests(done):
    """A request iterator that sends nothing until `done` is set (an idle stream; 60 s at most)."""
    done.wait(60)
    yield from ()


def test_a_node_id_on_another_clock_gets_a_row_of_its_own_for_good(tmp_path):
    """Rows are keyed by (node id, clock label), kept across collector restarts; a batch
    that names no clock (an older tracer's) takes the node id's first row; a node id that
    itself ends in '#2' is not taken for another's second clock."""
    from crosstrace.collector.ingest import check

    def node_of(store, node_id, clock=None):
        b = pb.SpanBatch(session_id=np.random.bytes(16), seq=1, resource=pb.Resource(node_id=node_id))
        if clock:
            b.resource.labels["clock"] = clock
        store.write([check(b)])
        return {r.node_id: i for i, r in store.nodes().items()}, store._node_ids[(node_id, clock or "")][1]

    path = str(tmp_path / "store.db")
    with Store(path) as store:
        assert node_of(store, "n#2", "monotonic:A")[1] == "n#2"   # a tracer's own node id
        assert node_of(store, "n")[1] == "n"                        # an older tracer: claims nothing
        assert node_of(store, "n", "monotonic:Y")[1] == "n"         # the first clock claims the row
        assert node_of(store, "n")[1] == "n"
        assert node_of(store, "n", "monotonic:X")[1] == "n#3"       # '#2' is another node's
        rows, _ = node_of(store, "n", "monotonic:Y")
    with Store(path) as store:                                       # the collector restarted
        assert node_of(store, "n", "monotonic:Y")[1] == "n" and node_of(store, "n", "monotonic:X")[1] == "n#3"
        assert node_of(store, "n#2", "monotonic:A")[0] == rows and set(rows) == {"n", "n#2", "n#3"}
        assert store.reused_node_ids() == {"n"}                    # not "n#2", a node id of its own


def test_a_node_ids_next_clock_costs_the_same_however_many_it_had(tmp_path):
    """A row for a node id's next clock was found by trying #2, #3, ... one lookup each, on
    the writer thread: a client naming a new clock in every batch slowed every batch."""
    from crosstrace.collector.ingest import check

    def on_clock(k):
        b = pb.SpanBatch(session_id=np.random.bytes(16), seq=1, resource=pb.Resource(node_id="n"))
        b.resource.labels["clock"] = f"monotonic:{k}"
        return check(b)

    with Store(str(tmp_path / "store.db")) as store:
        store.write([on_clock(k) for k in range(60)])
        statements = []
        store.db.set_trace_callback(statements.append)
        store.write([on_clock(60)])
        store.db.set_trace_callback(None)
        assert {r.node_id for r in store.nodes().values()} == {"n", *(f"n#{k}" for k in range(2, 62))}
        assert len([s for s in statements if "FROM nodes WHERE node_id" in s]) == 1


def test_samples_naming_a_node_id_on_two_clocks_name_the_right_row(tmp_path):
    """Once a node id has come back on another clock ("srv#2"), a sample that names it as
    its peer goes through the row of the clock it says it met (a relay's exchanges carry
    peer_clock); one that does not say (an RPC's) is left out: which clock it met is unknown."""
    from crosstrace.collector.ingest import check

    def batch(node_id, clock, samples=()):
        b = pb.SpanBatch(session_id=np.random.bytes(16), seq=1, resource=pb.Resource(node_id=node_id))
        b.resource.labels["clock"] = clock
        b.clock_samples.extend(samples)
        return check(b)

    def sample(peer, peer_clock="", local_ns=1):
        return pb.ClockSample(source=pb.GRPC_EXCHANGE, peer=peer, peer_clock=peer_clock, t1=local_ns, t2=2, t3=3,
                              t4=local_ns + 4, local_ns=local_ns)

    with Store(str(tmp_path / "store.db")) as store:
        store.write([batch("srv", "monotonic:Y"), batch("srv", "monotonic:X"), batch("other", "monotonic:Z")])
        store.write([batch("cli", "monotonic:C", [sample("srv", "monotonic:X", 1), sample("srv", "monotonic:Y", 2),
                                                  sample("srv", "", 3), sample("other", "", 4),
                                                  sample("srv", "monotonic:unknown", 5)])])
        rows = store.clock_samples()
    assert [(row[2], row[7]) for row in rows] == [("srv#2", 1), ("srv", 2), ("other", 4)]


def test_a_span_whose_attributes_or_extras_are_not_an_object_is_rejected_alone(collector):
    """One span's entry of another type (a number, a list) refused its whole batch, with the
    good spans in it."""
    b = batch(4)
    b.attributes_json = b'[{"a":1},5,null,{"b":2}]'
    b.extras_json = b'[[0,{"status_message":"ok"}],[3,"oops"]]'
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err is None and acks[0].accepted == 2 and dict(acks[0].rejected) == {"attributes_or_extras_not_an_object": 2}
    assert rejects(collector)["attributes_or_extras_not_an_object"] == 2


def test_attributes_nested_too_deep_to_write_back_are_rejected_one_by_one(collector, tmp_path):
    """JSON that reads but cannot be written back (1000 levels: json's recursion fails where
    orjson's limit is passed) failed the store write: the client was told to retry a batch
    that never could succeed, and a span stored whole broke every export."""
    import subprocess
    import sys

    b = batch(3)
    b.attributes_json = b'[{"a":1},{"deep":' + b"[" * 1000 + b"]" * 1000 + b'},{"ok":' + b"[" * 400 + b"]" * 400 + b"}]"
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err is None and acks[0].accepted == 2 and dict(acks[0].rejected) == {"attributes_too_deep": 1}
    out = subprocess.run([sys.executable, "-m", "crosstrace", "export", "--jsonl", str(tmp_path / "s.jsonl"),
                          "--store", collector.store], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 2


def test_absurd_clock_samples_are_rejected_and_reports_go_on(collector):
    """One NTP sample of INT64_MIN/INT64_MAX was stored, and every report and export of the
    store failed on it (OverflowError). Samples are checked as spans are, one by one."""
    import subprocess
    import sys

    b = batch(2)
    low, high = -(1 << 63), (1 << 63) - 1
    b.clock_samples.extend([
        pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=10**9, t2=10**9 + 100, t3=10**9 + 200, t4=10**9 + 300),
        pb.ClockSample(source=pb.NTP, offset_ns=low, error_ns=high, local_ns=low),
        pb.ClockSample(source=pb.UDP_EXCHANGE, t1=10**9, t2=10**9 + 100, t3=10**9 + 200, t4=10**9 - 1),   # t4 < t1
        pb.ClockSample(source=pb.NTP, offset_ns=5, error_ns=-1, local_ns=10**9),
        # bounds of decades (a float polygon of them came out empty: IndexError in every report),
        # and a round trip of two hours
        pb.ClockSample(source=pb.NTP, offset_ns=10**9, error_ns=788643926284085998, local_ns=1),
        pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=10**9, t2=10**9 + 100, t3=10**9 + 200, t4=10**9 + 7200 * 10**9),
        # clocks 2^63 ns apart (the offset wrapped around), and sources nothing reads
        pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=-(1 << 62), t2=1 << 62, t3=1 << 62, t4=-(1 << 62) + 100),
        pb.ClockSample(source=99, t1=10**9, t2=10**9 + 100, t3=10**9 + 200, t4=10**9 + 300),
        pb.ClockSample(source=pb.CLOCK_SOURCE_UNSPECIFIED, offset_ns=5, local_ns=10**9)])
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err is None and acks[0].accepted == 2 and dict(acks[0].rejected) == {"absurd_clock_sample": 8}
    store = Store(collector.store, readonly=True)
    try:
        assert [row[1] for row in store.clock_samples()] == [pb.GRPC_EXCHANGE]
    finally:
        store.close()
    out = subprocess.run([sys.executable, "-m", "crosstrace", "report", "--store", collector.store],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_what_ingest_keeps_breaks_no_reader(collector, tmp_path):
    """Spans each fine on their own that together broke the readers: spans that are each
    other's parent (the HTML page's nesting walk never ended), one trace from -2**62 to
    2**62 ns (its extent wrapped int64: a crash, or negative durations), a stage count of
    1e400 (an infinity), and dropped counts whose sum is beyond int64 (SQLite's sum())."""
    import json
    import subprocess
    import sys

    limit, month = 1 << 62, 30 * 24 * 3600 * 10**9
    looped = batch(2, parent_span_id=np.array([2, 1], "<u8"))
    wide = batch(2, seq=2, trace_hi=8, first_id=10, start_ns=np.array([-limit, limit - month], "<i8"),
                 end_ns=np.array([-limit + 500, limit], "<i8"))
    staged = batch(1, seq=3, trace_hi=9, first_id=20)
    staged.attributes_json = b'[{"pp.stage":0,"pp.microbatch":0,"pp.action":"F","pp.num_stages":1e400,' \
                             b'"ddp.ready_ns":9223372036854775807}]'   # a node-clock time at int64's limit
    many = [batch(1, seq=1, trace_hi=10, first_id=30 + k, node="dropping") for k in range(2)]
    for k, b in enumerate(many):
        b.session_id, b.dropped_spans = bytes([k]) * 16, (1 << 63) - 1
    for b in (looped, wide, staged, *many):
        b.clock_samples.extend(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=t, t2=t + 100, t3=t + 200, t4=t + 300)
                               for t in (10**9, 2 * 10**9))
    for b in (looped, wide, staged, *many):
        acks, err = export(collector.address, [b.SerializeToString()])
        assert err is None and acks[0].accepted == b.count
    for args in (["report", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html")],
                 ["report", "--trace", f"{7:016x}{9:016x}", "--html", str(tmp_path / "looped.html")],
                 ["export", "--jsonl", str(tmp_path / "s.jsonl"), "--perfetto", str(tmp_path / "p.json")],
                 ["clocks"]):
        out = subprocess.run([sys.executable, "-m", "crosstrace", *args, "--store", collector.store],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["dropped_spans"]["dropping"] == 2 * ((1 << 63) - 1)
    exported = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [s["attributes"]["ddp.ready_ns"] for s in exported if "ddp.ready_ns" in s["attributes"]] == \
        [(1 << 63) - 1]   # left as it came: placed, it wrapped around to -9223372036854406874
    assert len(report["traces"]) == 4
    for trace in report["traces"]:
        assert trace["duration_ns"] >= 0 and all(s["duration_ns"] >= 0 for s in trace["critical_path"])


def test_exchanges_are_placed_by_the_collector_clock_that_answered_them(tmp_path):
    """A batch probed before its collector came back on another clock can arrive after
    (spooled, or held while it was down): its exchanges were shifted by the new clock's
    offset, an uptime off. A probe's answer names its clock; the store shifts each exchange
    by the clock that answered it, and leaves out one answered by a clock it never had."""
    from crosstrace.collector.ingest import check

    path = str(tmp_path / "store.db")
    Store(path, clock="collector:A").close()                           # the first collector's clock
    later = Store(path, now=lambda: time.monotonic_ns() - 3600 * 10**9, clock="collector:B")
    try:
        assert abs(later.shift_ns - 3600 * 10**9) < 10**9
        b = batch(1)
        for t1, answered_by in ((1, "collector:A"), (2, "collector:B"), (3, ""), (4, "collector:unknown")):
            b.clock_samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=t1, t2=10, t3=20, t4=t1 + 30,
                                                  local_ns=t1, peer_clock=answered_by))
        later.write([check(b)])
        shifted = {row[3]: row[4] - 10 for row in later.clock_samples()}
    finally:
        later.close()
    assert shifted == {1: 0, 2: later.shift_ns, 3: later.shift_ns}   # the last: a tracer that did not say


def test_a_resent_batch_counts_its_rejects_once(collector):
    """A batch resent after a lost ack (a spool's replay) is stored once; its rejected spans
    were counted again with every resend in the store. Each ack still says them: a tracer
    resends only a batch whose ack it never got."""
    data = batch(10, span_id=np.r_[0, np.arange(2, 11)].astype("<u8")).SerializeToString()   # one invalid id
    acks, err = export(collector.address, [data, data])
    again, err_again = export(collector.address, [data])
    assert err is None and err_again is None
    assert [dict(a.rejected) for a in acks + again] == [{"invalid_span_id": 1}] * 3
    assert [a.accepted for a in acks + again] == [9, 0, 0]
    assert rejects(collector) == {"invalid_span_id": 1}


def test_resource_attributes_no_export_could_read_are_refused(collector):
    """Every OTLP export of the store reads a resource's attributes_json: one batch whose
    JSON was broken made them all fail."""
    for bad in (b"{not json", b"[1, 2]", b'{"a": ' + b"[" * 600 + b"]" * 600 + b"}"):
        b = batch(1)
        b.resource.attributes_json = bad
        acks, err = export(collector.address, [b.SerializeToString()])
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, bad[:20]
        assert "resource.attributes_json" in err.details()
    good = batch(1)
    good.resource.attributes_json = b'{"service.name": "cam", "replicas": 3}'
    acks, err = export(collector.address, [good.SerializeToString()])
    assert err is None and acks[0].accepted == 1


def test_the_dedup_window_forgets_a_quarter_at_most():
    """Runs merged like a binary counter became one run of everything; forgetting it left
    only the newest batch in the window, and a span resent a batch later was stored twice."""
    from crosstrace.collector.dedup import RecentKeys

    window, keys = RecentKeys(capacity=4000), np.arange(1, 400 * 31 + 1, dtype=np.uint64)
    for k in range(400):
        window.add(keys[31 * k:31 * (k + 1)])
        seen = keys[:31 * (k + 1)]
        assert len(window) >= min(len(seen), 3000)
        assert window.contains(seen[-min(len(seen), 3000):]).all()


def test_a_second_collector_on_one_store_is_refused(collector):
    """Each collector keeps its own window of recent spans: two on one store stored a span
    that came to both twice."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "crosstrace", "collector", "--listen", "127.0.0.1:0", "--store",
                          collector.store], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is in use by another collector" in out.stderr, out.stderr


def test_a_store_whose_creation_was_cut_short_opens(tmp_path):
    """A collector killed after creating some or all of the tables, before their first row,
    left a store that no collector could open again (schema version None). Another
    program's database with a `meta` table of its own is still refused, and left alone."""
    import gc
    import sqlite3

    from crosstrace.collector import store as store_module

    for name, script in (("all.db", store_module._SCHEMA),
                         ("some.db", store_module._SCHEMA.split("CREATE TABLE IF NOT EXISTS segments")[0]),
                         ("other.db", "CREATE TABLE meta (key TEXT, value TEXT); CREATE TABLE users (name TEXT);")):
        path = tmp_path / name
        with sqlite3.connect(path) as db:
            db.executescript(script)
        if name == "other.db":
            with pytest.raises(ValueError, match="not a crosstrace store|schema version"):
                Store(str(path))
            with sqlite3.connect(path) as db:
                assert {t for (t,) in db.execute("SELECT name FROM sqlite_master")} == {"meta", "users"}
            continue
        Store(str(path)).close()
        with Store(str(path), readonly=True) as store:
            assert store.meta("schema_version") == str(store_module.SCHEMA_VERSION)
    # A writer dropped without close() releases the lock with it (it blamed another collector).
    Store(str(tmp_path / "all.db"))
    gc.collect()
    Store(str(tmp_path / "all.db")).close()


def test_a_node_id_is_looked_up_by_index(tmp_path):
    """Each new node id (one per process by default) looked its rows up with a query whose
    `OR` scanned every node: 25 ms per new node id at 100k nodes, on the writer thread."""
    from crosstrace.collector.store import _NODE_ROWS

    with Store(str(tmp_path / "s.db")) as store:
        plan = [row[3] for row in store.db.execute("EXPLAIN QUERY PLAN " + _NODE_ROWS, ("a", "a"))]
    assert not [step for step in plan if step.startswith("SCAN")], plan


def test_a_window_reads_the_newest_data_and_retention_deletes_the_oldest(tmp_path):
    """A store written for weeks: a report reads what arrived in its last DURATION (and the
    clock samples just before), and `--retain` deletes what is older; batches of clock
    samples only (an idle tracer's, every 10 s) leave no record to delete."""
    from crosstrace.collector.ingest import check

    hour = 3600 * 10**9
    clock = [0]
    path = str(tmp_path / "s.db")
    with Store(path, now=lambda: clock[0]) as store:
        for k in range(3):                       # spans and samples an hour apart
            clock[0] = k * hour
            b = batch(10, seq=2 * k + 1, first_id=100 * k + 1, trace_hi=k + 1)
            b.clock_samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=10**9 + k, t2=10**9 + 100,
                                                  t3=10**9 + 200, t4=10**9 + 300))
            idle = batch(0, seq=2 * k + 2)
            idle.clock_samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=k * hour, t2=k * hour + 100,
                                                     t3=k * hour + 200, t4=k * hour + 300))
            store.write([check(b), check(idle)])
        assert store.db.execute("SELECT count(*) FROM batches").fetchone()[0] == 3
    with Store(path, readonly=True) as store:
        store.keep_last(90 * 60 * 10**9)
        assert [seg.count for _, seg in store.segments()] == [10, 10]           # the last two hours' spans
        assert len(store.clock_samples()) == 4                                  # and their samples
        assert [seg.count for _, seg in store.segments(["0000000000000003"])] == [10]
    with Store(path, now=lambda: clock[0]) as store:
        assert store.expire(90 * 60 * 10**9) == 10
        assert store.span_count() == 20 and len(store.clock_samples()) == 4
        assert store.db.execute("SELECT count(*) FROM batches").fetchone()[0] == 2


def test_report_last_and_collector_retain_from_the_command_line(tmp_path):
    import json
    import subprocess
    import sys
    import time

    from crosstrace.collector.ingest import check
    from crosstrace.launch import CollectorProcess

    clock, path = [0], str(tmp_path / "weeks.db")
    with Store(path, now=lambda: clock[0]) as store:
        for k, n in enumerate((5, 3)):                     # two days apart
            clock[0] = k * 2 * 86400 * 10**9
            store.write([check(batch(n, seq=k + 1, trace_hi=k + 1, first_id=10 * k + 1))])
    out = subprocess.run([sys.executable, "-m", "crosstrace", "report", "--store", path, "--last", "1d",
                          "--json", "-"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [t["spans"] for t in json.loads(out.stdout)["traces"]] == [3]

    with CollectorProcess(str(tmp_path / "s.db"), extra_args=("--retain", "2s")) as collector:
        acks, _ = export(collector.address, [batch(5).SerializeToString()])
        assert acks[0].accepted == 5
        deadline = time.monotonic() + 20
        while span_count(collector.store) and time.monotonic() < deadline:   # checked every 0.5 s
            time.sleep(0.2)
        assert span_count(collector.store) == 0


def test_clocks_list_the_nodes_with_data_in_the_window(tmp_path):
    """Nodes whose data lies before a report's window, or expired, are not listed: a report
    of the last hour on a store kept for weeks listed every node ever seen, as unsampled."""
    import json
    import subprocess
    import sys

    from crosstrace.collector.ingest import check

    day, clock, path = 86400 * 10**9, [0], str(tmp_path / "weeks.db")
    with Store(path, now=lambda: clock[0]) as store:
        for k, node, sampled in ((0, "old-job", True), (2, "new-job", True), (2, "unsampled", False)):
            clock[0] = k * day
            b = batch(3, seq=1, node=node, trace_hi=k + 1, first_id=10 * len(node))
            b.session_id = node.encode().ljust(16, b".")
            if sampled:
                b.clock_samples.append(pb.ClockSample(source=pb.GRPC_EXCHANGE, t1=10**9, t2=10**9 + 100,
                                                      t3=10**9 + 200, t4=10**9 + 300))
            store.write([check(b)])
    for command in (["report", "--json", "-"], ["clocks", "--json"]):
        out = subprocess.run([sys.executable, "-m", "crosstrace", *command, "--store", path, "--last", "1d"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        clocks = json.loads(out.stdout)["clocks"]
        assert sorted(clocks) == ["new-job", "unsampled"]
        assert clocks["unsampled"]["flags"] == ["no_samples"] and clocks["new-job"]["samples"] == 1
    with Store(path, now=lambda: clock[0]) as store:
        assert store.expire(day) == 3                      # the old job's spans and sample
        assert sorted(r.node_id for r in store.nodes().values()) == ["new-job", "old-job", "unsampled"]
    out = subprocess.run([sys.executable, "-m", "crosstrace", "clocks", "--store", path, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert sorted(json.loads(out.stdout)["clocks"]) == ["new-job", "unsampled"], out.stderr


def test_the_writers_node_cache_is_bounded(tmp_path, monkeypatch):
    """One node id per process by default: a collector that ran for weeks kept every one."""
    from crosstrace.collector import store as store_mod
    from crosstrace.collector.ingest import check

    monkeypatch.setattr(store_mod, "_NODE_CACHE", 2)
    with Store(str(tmp_path / "s.db")) as store:
        for i, k in enumerate([*range(5), 0]):   # host/0 again: found, not made again
            b = batch(1, seq=1, node=f"host/{k}", first_id=i + 1)
            b.session_id = bytes([i + 1]) * 16
            store.write([check(b)])
            assert len(store._node_ids) <= 2
        assert sorted(r.node_id for r in store.nodes().values()) == [f"host/{k}" for k in range(5)]
        assert store.span_count() == 6


def test_wide_integers_survive_a_batch_stored_in_part(collector):
    """A batch with a rejected span is stored rewritten: its JSON too must say that it holds
    integers beyond 64 bits, or they read back as rounded floats."""
    from crosstrace.proto.attributes_json import dumps

    wide = 24197857161011715162171839636988778105
    b = batch(2, end_ns=np.array([10**9 + 500, 10**9 - 1], "<i8"))   # the second ends before it starts
    b.attributes_json = dumps([{"uuid": wide}, {"uuid": 1}])
    acks, err = export(collector.address, [b.SerializeToString()])
    assert err is None and acks[0].accepted == 1
    with Store(collector.store, readonly=True) as store:
        [(_, segment)] = list(store.segments())
    from crosstrace.collector.columns import loads
    assert loads(segment.attributes_json) == [{"uuid": wide}]


def test_records_of_a_store_begun_before_they_had_a_time_are_kept_a_while(tmp_path):
    """A store of the version before: its batch records were given time 0 and went at the
    first --retain, and a resend of a batch stored seconds before was no longer told apart."""
    from crosstrace.collector.ingest import check

    path = str(tmp_path / "old.db")
    with Store(path) as store:
        store.write([check(batch(3))])
        store.db.execute("DROP INDEX batches_received")
        store.db.execute("ALTER TABLE batches DROP COLUMN received_ns")   # as that version wrote it
    with Store(path) as store:
        store.expire(3600 * 10**9)
        assert store.write([check(batch(3))])[0].resent
        plan = [row[3] for row in store.db.execute("EXPLAIN QUERY PLAN DELETE FROM batches WHERE received_ns < 0")]
        assert not [step for step in plan if step.startswith("SCAN")], plan   # each tick finds them by index


def test_a_full_store_is_said_once_a_minute_and_its_recovery_too(tmp_path, caplog):
    """A full disk failed every batch, each with a 12-line traceback in the collector's log.
    Here SQLite's own page cap fills the store: a line says so, with a count, and another
    says when batches go through again; the tracer's retries lose nothing."""
    import logging
    import threading

    from crosstrace.collector.server import Collector

    collector = Collector(str(tmp_path / "s.db"), "127.0.0.1:0").start()
    try:
        db = collector.store.db
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        with collector.store._lock:
            db.execute(f"PRAGMA max_page_count = {pages}")   # full from now on
        caplog.set_level(logging.WARNING, logger="crosstrace.collector")
        done = threading.Event()
        env = {"CROSSTRACE_ENDPOINT": collector.address, "CROSSTRACE_NODE_ID": "filler",
               "CROSSTRACE_EXPORT_INTERVAL_MS": "100"}
        worker = threading.Thread(target=lambda: (run_python("""
            import time, crosstrace
            p = crosstrace.init()
            for i in range(30):
                with p.get_tracer("t").start_as_current_span("s", attributes={"i": i, "blob": "x" * 200_000}):
                    pass
                time.sleep(0.1)
            assert p.force_flush(60000)
        """, env, timeout=90), done.set()))
        worker.start()
        assert wait_until(lambda: sum("store write failed" in r.getMessage() for r in caplog.records) >= 1, 30)
        time.sleep(1.5)   # more batches fail meanwhile (the tracer retries), unsaid
        with collector.store._lock:
            db.execute("PRAGMA max_page_count = 1073741823")
        worker.join(90)
        assert done.is_set()
    finally:
        collector.stop()
    failed = [r for r in caplog.records if "store write failed" in r.getMessage()]
    assert len(failed) == 1 and "database or disk is full" in failed[0].getMessage() and not failed[0].exc_info
    (again,) = [r.getMessage() for r in caplog.records if "the store takes batches again" in r.getMessage()]
    assert int(again.split("after ")[1].split()[0]) >= 2, again   # several failed, one line said so
    assert span_count(str(tmp_path / "s.db")) == 30


def test_equal_attribute_values_are_read_once(tmp_path):
    """A report holds one copy of each distinct string and list value (a 512-rank job's
    collective spans each held their own list of 512 ranks: 2.8 KB a span), and values that
    compare equal in Python but not in JSON ([1], [true], [1.0]) stay apart."""
    import orjson

    from crosstrace.collector import spantable
    from crosstrace.collector.ingest import check

    values = [[1, 2], [True, 2], [1.0, 2], [1, 2], "rank", "rank", [[1], 2], [[1], 2], 2**70]
    b = batch(len(values))
    b.attributes_json = orjson.dumps([{"v": v} for v in values[:-1]] + [None]).replace(b"null]", b'{"v":%d}]' % 2**70)
    with Store(str(tmp_path / "s.db")) as store:
        store.write([check(b)])
        table = spantable.load(store)
    got = [a["v"] for a in table.attributes]
    assert got == values and [type(v[0]) for v in got[:3]] == [int, bool, float]
    assert got[0] is got[3] and got[4] is got[5] and got[6] is got[7]
    assert got[0] is not got[1] and got[0] is not got[2]
