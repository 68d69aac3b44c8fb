"""The tracer's export path end to end: several processes, durability across a SIGKILL
of the collector, resends after a restart, drop counting, fork safety."""
import json
import os
import time

import crosstrace
from crosstrace.collector import spantable
from crosstrace.collector.store import Store
from crosstrace.launch import CollectorProcess, wait_until
from crosstrace.proto import pb

from .conftest import first_line, load_table, run_python, span_count, tracer_env


SPANS_SCRIPT = """
import sys, crosstrace
provider = crosstrace.init()
tracer = provider.get_tracer("t")
for i in range(int(sys.argv[1])):
    with tracer.start_as_current_span("work", attributes={"i": i}):
        pass
print("flushed", provider.force_flush(20000))
"""


def test_three_processes_report_into_one_store(collector):
    for node in ("a", "b", "c"):
        out = run_python(SPANS_SCRIPT, env=tracer_env(collector, node), args=("3000",))
        assert out.stdout.strip() == "flushed True"
    store = Store(collector.store, readonly=True)
    assert store.span_count() == 9000
    assert sorted(r.node_id for r in store.nodes().values()) == ["a", "b", "c"]
    assert all(n == 0 for n in store.dropped_by_node().values())
    store.close()


def test_sigkill_after_ack_loses_no_acked_span(tmp_path):
    path = str(tmp_path / "store.db")
    collector = CollectorProcess(path)
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="durable")
    tracer = provider.get_tracer("t")
    for i in range(20000):
        with tracer.start_as_current_span("acked", attributes={"i": i}):
            pass
    assert provider.force_flush(20_000)  # every span above is acked, hence committed
    collector.kill()                      # SIGKILL: no shutdown, no checkpoint
    assert span_count(path) == 20000
    provider.shutdown(timeout_millis=100)


def test_collector_restart_mid_run_delivers_everything_once(tmp_path, caplog):
    """Each outage is said when it begins and when it ends (it was said once a process)."""
    import logging

    caplog.set_level(logging.WARNING, logger="crosstrace.tracer")
    path = str(tmp_path / "store.db")
    collector = CollectorProcess(path)
    port = collector.port
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="restart",
                                         export_interval_ms=50)
    tracer = provider.get_tracer("t")
    try:
        for outage in range(2):
            for i in range(5000):
                with tracer.start_as_current_span("before", attributes={"i": i}):
                    pass
            assert provider.force_flush(20_000)
            collector.kill()
            for i in range(5000):  # recorded while the collector is down: kept unacked, resent later
                with tracer.start_as_current_span("during", attributes={"i": i}):
                    pass
            time.sleep(0.5)
            collector = CollectorProcess(path, listen=f"127.0.0.1:{port}")
            assert provider.force_flush(30_000)
            assert span_count(path) == 10000 * (outage + 1)
    finally:
        provider.shutdown()
        collector.stop()
    assert span_count(path) == 20000
    said = [r.getMessage() for r in caplog.records]
    assert sum("will retry" in m for m in said) == 2 and sum("works again" in m for m in said) == 2, said


def test_a_failed_stream_is_opened_again_after_its_backoff_not_the_next_round(tmp_path):
    """Export rounds are seconds apart where spans are few; a stream that failed with
    batches unacked was retried only at the next round (a forked child's flush, whose
    first connection gRPC closed on fork, timed out)."""
    path = str(tmp_path / "store.db")
    collector = CollectorProcess(path)
    port = collector.port
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="retry", export_interval_ms=60_000,
                                         udp_clock=False, clock_probe_interval_s=3600)
    tracer = provider.get_tracer("t")
    try:
        assert provider.force_flush(20_000)   # the stream is up
        collector.kill()
        with tracer.start_as_current_span("sent-into-a-dead-stream"):
            pass
        assert not provider.force_flush(300)  # sent now, not at the next round a minute away
        assert wait_until(lambda: provider._exporter._requests is None, 10)   # the stream failed
        time.sleep(0.5)
        collector = CollectorProcess(path, listen=f"127.0.0.1:{port}")
        assert wait_until(lambda: span_count(path) == 1, 15)   # backoff: 0.1, 0.2, ... 5 s at most
    finally:
        provider.shutdown(timeout_millis=2000)
        collector.stop()


def test_acks_of_no_batch_sent_do_not_reset_the_backoff():
    """A server gone wrong that acks a batch it was never sent and then fails the stream:
    that ack reset the backoff, and the stream was opened again ten times a second for good."""
    import concurrent.futures

    import grpc

    streams = []

    def export(requests, context):
        streams.append(time.monotonic())
        for _ in requests:
            yield pb.ExportAck(seq=999_999)
            context.abort(grpc.StatusCode.UNAVAILABLE, "down")

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("crosstrace.v1.Collector", {
        "Export": grpc.stream_stream_rpc_method_handler(export, request_deserializer=None,
                                                        response_serializer=pb.ExportAck.SerializeToString)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    provider = crosstrace.TracerProvider(endpoint=f"127.0.0.1:{port}", node_id="odd-acks", udp_clock=False,
                                         clock_probe_interval_s=3600)
    try:
        with provider.get_tracer("t").start_as_current_span("never-acked"):
            pass
        assert not provider.force_flush(300)
        time.sleep(3)
        assert 2 <= len(streams) <= 8, len(streams)   # backoff 0.1, 0.2, 0.4, 0.8, 1.6 s: ~5; reset each time: ~30
    finally:
        provider.shutdown(timeout_millis=500)
        server.stop(None)


def test_a_forked_childs_flush_does_not_wait_for_the_parents_next_round(collector):
    """Rounds are 5 s apart by default; the parent polled for its children's handovers
    only from its next round on, and a child's flush waited for it (or timed out)."""
    out = run_python("""
        import os, time, crosstrace
        p = crosstrace.init(udp_clock=False)
        tracer = p.get_tracer("t")
        with tracer.start_as_current_span("parent"):
            pass
        assert p.force_flush(10000)
        time.sleep(0.5)                 # the parent's thread now waits for a round 5 s away
        pid = os.fork()
        if pid == 0:
            took = []
            for pause in (0.5, 2.5):      # soon after the fork, and after the parent's polls right after it
                time.sleep(pause)
                with tracer.start_as_current_span("child"):
                    pass
                t = time.monotonic()
                assert p.force_flush(4000)
                took.append(time.monotonic() - t)
            print(" ".join(f"{s:.2f}" for s in took), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(status, p.shutdown())
    """, env=tracer_env(collector, "forker"), timeout=60)
    assert out.stdout.split()[-2:] == ["0", "True"], out.stdout + out.stderr   # the child's flushes: True
    took = [float(s) for s in out.stdout.split()[:2]]
    assert max(took) < 1.5, took
    assert wait_until(lambda: span_count(collector.store) == 3, 10)


def test_full_queue_drops_and_counts_and_the_report_shows_it(collector):
    out = run_python("""
        import crosstrace, time
        p = crosstrace.init(max_queue=100, export_interval_ms=60000, batch_size=100000)
        t = p.get_tracer("t")
        for i in range(1000):           # far more than the queue holds before the next export
            t.start_span("burst").end()
        print(p.dropped_spans)
        print(p.force_flush(20000))
    """, env=tracer_env(collector, "dropper"))
    dropped, flushed = out.stdout.split()
    assert int(dropped) > 0 and flushed == "True"
    store = Store(collector.store, readonly=True)
    assert store.dropped_by_node() == {"dropper": int(dropped)}
    assert store.span_count() == 1000 - int(dropped)
    store.close()


def test_spans_too_large_for_one_message_go_in_parts(collector):
    """8000 spans with a 9 KB prompt each, taken at once: 72 MB, over gRPC's 64 MB message
    limit. The batch was refused whole, its spans dropped, and force_flush() said True."""
    out = run_python("""
        import crosstrace
        p = crosstrace.init(export_interval_ms=60000, batch_size=100000, max_queue=100000)
        t = p.get_tracer("t")
        prompt = "lorem ipsum " * 750
        for i in range(8000):
            with t.start_as_current_span("generate", attributes={"prompt": prompt, "i": i}):
                pass
        print(p.force_flush(60000), p.dropped_spans)
    """, env=tracer_env(collector, "llm"), timeout=120)
    assert out.stdout.split() == ["True", "0"], out.stderr
    assert span_count(collector.store) == 8000


def test_batches_of_large_spans_hold_about_a_megabyte(collector):
    """Encoding a batch holds the GIL throughout: 8192 spans with 2 KB attributes each froze
    the program's other threads for 20-80 ms at a time. A batch is sized by the bytes per
    span of the one before, so after the first, large spans go about 1 MB at a time."""
    out = run_python("""
        import crosstrace
        p = crosstrace.init(export_interval_ms=60000)
        t = p.get_tracer("t")
        prompt = "x" * 2048
        for _ in range(2):
            for i in range(8192):
                t.start_span("big", attributes={"prompt": prompt, "i": i}).end()
            print(p.force_flush(30000))
    """, env=tracer_env(collector, "large"), timeout=120)
    assert out.stdout.split() == ["True", "True"]
    store = Store(collector.store, readonly=True)
    try:
        segments = [seg for node, seg in store.segments() if store.nodes()[node].node_id == "large"]
    finally:
        store.close()
    assert sum(seg.count for seg in segments) == 2 * 8192
    assert max(seg.ByteSize() for seg in segments) < 1.25 * 2**20


def test_a_batch_larger_than_max_unacked_mb_goes_at_once(collector):
    """The first batch of large spans (sized before any was encoded) can exceed a small
    max_unacked_mb alone: the exporter waited 5 s for room that nothing in flight could
    make, and force_flush() timed out meanwhile."""
    out = run_python("""
        import crosstrace
        p = crosstrace.init(max_unacked_mb=1, export_interval_ms=60000)
        t = p.get_tracer("t")
        for i in range(8192):
            t.start_span("big", attributes={"prompt": "x" * 2048, "i": i}).end()
        print(p.force_flush(3000), p.dropped_spans)
    """, env=tracer_env(collector, "small-bound"), timeout=120)
    assert out.stdout.split() == ["True", "0"], out.stderr
    assert span_count(collector.store) == 8192


def test_deferred_work_runs_while_a_stream_of_spans_waits_for_acks(tmp_path):
    """Work instrumentation defers to the exporter (DDP's bucket spans) ran only between
    rounds, and a round lasts while spans keep coming and acks do not: against a collector
    that never acks, it had not run after 15 s."""
    from .test_spool import hung_collector

    server, port = hung_collector()
    try:
        out = run_python("""
            import threading, time, crosstrace
            p = crosstrace.init(max_unacked_mb=1, max_queue=5000)
            t = p.get_tracer("t")
            ran, deferred_at = threading.Event(), None
            start = time.monotonic()
            while not ran.is_set() and time.monotonic() < start + 10:
                for i in range(100):
                    t.start_span("s", attributes={"pad": "x" * 1000}).end()
                time.sleep(0.001)
                if deferred_at is None and time.monotonic() > start + 1:   # the exporter busy with a round
                    deferred_at = time.monotonic()
                    p.defer(ran.set)
            print(ran.is_set())
            import os; os._exit(0)   # no exit flush against a collector that never acks
        """, env={"CROSSTRACE_ENDPOINT": f"127.0.0.1:{port}", "CROSSTRACE_NODE_ID": "deferring"}, timeout=60)
    finally:
        server.stop(0)
    assert out.stdout.split() == ["True"], out.stderr


def test_a_span_no_encoding_takes_costs_that_span_alone(collector):
    """Lone surrogates (which Python strings hold and UTF-8 does not) in a span name and an
    attribute failed the encoding of their whole batch: every span of it was lost, and
    force_flush() said True with nothing dropped. They now travel as '?'. A start attribute
    whose str() raises is the one span dropped and counted, and force_flush() says False
    (one set later is taken as text at once, and says what went wrong)."""
    out = run_python("""
        import crosstrace
        p = crosstrace.init(export_interval_ms=60000)
        t = p.get_tracer("t")

        class Unprintable:
            def __str__(self):
                raise RuntimeError("no text")

        for i in range(100):
            at_start = {"i": i, "object": Unprintable()} if i == 30 else {"i": i}
            with t.start_as_current_span("a\\ud800b" if i == 10 else "work", attributes=at_start) as span:
                if i == 20:
                    span.set_attribute("text", "x\\udfffy")
                if i == 40:
                    span.set_attribute("object", Unprintable())
        print(p.force_flush(20000), p.dropped_spans)
    """, env=tracer_env(collector, "odd"), timeout=60)
    assert out.stdout.split() == ["False", "1"], out.stdout + out.stderr
    assert "could not encode span 'work'" in out.stderr
    with Store(collector.store, readonly=True) as store:
        table = spantable.load(store)
    assert len(table) == 99 and "a?b" in table.names
    assert sorted(a["i"] for a in table.attributes) == [i for i in range(100) if i != 30]
    assert [a["text"] for a in table.attributes if "text" in a] == ["x?y"]
    assert [a["object"] for a in table.attributes if "object" in a] == [
        "<Unprintable: str() raised RuntimeError('no text')>"]


def test_forked_children_export_their_own_spans(collector):
    out = run_python("""
        import os, sys, time, multiprocessing as mp, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        with tracer.start_as_current_span("parent-before-fork"):
            pass
        def worker(i):
            for j in range(100):
                with tracer.start_as_current_span("in-worker", attributes={"worker": i}):
                    pass
        ctx = mp.get_context("fork")     # as DataLoader workers are made
        procs = [ctx.Process(target=worker, args=(i,)) for i in range(2)]
        [q.start() for q in procs]
        [q.join(30) for q in procs]
        with tracer.start_as_current_span("open-at-fork"):
            pid = os.fork()
            if pid == 0:
                with tracer.start_as_current_span("raw-fork-child"):
                    pass
                # leaves through the parent's `with` too, which ends the child's copy of its span
                sys.exit(0 if p.force_flush(20000) else 1)
            _, status = os.waitpid(pid, 0)
            time.sleep(0.3)
        print(status, [q.exitcode for q in procs], p.force_flush(20000))
    """, env=tracer_env(collector, "forker"), timeout=90)
    assert out.stdout.split() == ["0", "[0,", "0]", "True"], out.stderr
    store = Store(collector.store, readonly=True)
    t = spantable.load(store)
    names = [t.names[i] for i in t.name]
    assert names.count("in-worker") == 200 and names.count("raw-fork-child") == 1
    assert names.count("parent-before-fork") == 1
    opened = names.index("open-at-fork")   # the parent's span, not the child's copy, which ended first
    assert t.end[opened] - t.start[opened] >= 300_000_000
    store.close()


def test_forked_children_hand_their_spans_to_the_parent_and_never_touch_grpc(collector):
    """gRPC cannot hand a forked child a process whose export stream is open: children that
    exported on channels of their own aborted in gRPC's poller (2 of 24 children of DDP
    ranks). Children hand their batches over to the parent, which sends them; here while
    the parent's stream is busy."""
    out = run_python("""
        import multiprocessing as mp, os, threading, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        busy = threading.Event()
        def parent_work():
            while not busy.is_set():
                with tracer.start_as_current_span("in-parent"):
                    pass
        threading.Thread(target=parent_work, daemon=True).start()
        def worker(i):
            for j in range(300):
                with tracer.start_as_current_span("in-worker", attributes={"worker": i}):
                    pass
            assert p.force_flush(20000)   # True once the parent has sent them and they are acked
            raise SystemExit(3 if p._exporter._channel is not None else 0)
        procs = [mp.get_context("fork").Process(target=worker, args=(i,)) for i in range(6)]
        [q.start() for q in procs]
        [q.join(60) for q in procs]
        busy.set()
        print([q.exitcode for q in procs], p.force_flush(20000))
        folder = p._exporter._children.dir
        p.shutdown()
        print(os.path.exists(folder))
    """, env=tracer_env(collector, "hands-over"), timeout=120)
    assert out.stdout.split() == ["[0,", "0,", "0,", "0,", "0,", "0]", "True", "False"], out.stdout + out.stderr
    with Store(collector.store, readonly=True) as store:
        table = spantable.load(store)
        sessions = store.db.execute("SELECT count(*) FROM sessions").fetchone()[0]
    workers = [a["worker"] for a, n in zip(table.attributes, table.name) if table.names[n] == "in-worker"]
    assert sorted(workers) == sorted(list(range(6)) * 300)
    assert sessions == 7   # the parent's and one per child: each child's batches keep their own ids


def test_a_child_whose_parent_stopped_tracing_sends_its_spans_itself(collector):
    """Once the parent's tracer no longer takes handovers, the child sends what it holds
    itself: a flush or a shutdown then neither waits out its timeout for batches the
    parent had sent already nor for a parent that will never send (both did)."""
    out = run_python("""
        import os, time, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            def spans(name, n):
                for i in range(n):
                    with tracer.start_as_current_span(name):
                        pass
            spans("handed-over", 10)
            time.sleep(0.6)      # handed over; the parent sends them
            os.read(r, 1)        # the parent's tracer has shut down
            spans("flushed", 10)
            t = time.monotonic()
            flushed = p.force_flush(5000)
            spans("at-exit", 5)
            ok = flushed and p.shutdown() and time.monotonic() - t < 3
            os._exit(0 if ok else 1)
        time.sleep(1)
        print(p.shutdown(), flush=True)
        os.write(w, b"x")
        print(os.waitpid(pid, 0)[1])
    """, env=tracer_env(collector, "orphan"), timeout=60)
    assert out.stdout.split() == ["True", "0"], out.stdout + out.stderr
    assert wait_until(lambda: span_count(collector.store) == 25, 10)


def test_children_ending_as_the_parent_shuts_down_lose_nothing(collector):
    """Children that hand over while the parent's tracer shuts down: those that looked
    before it stopped taking were taken in its last look, the others' batches go through a
    new process (the parent's last look once came before the mark went: 18 of 30 children
    lost spans). A child never opens a gRPC channel: one that sent its own aborted in
    gRPC's poller, inherited mid-call (3 of 20 runs of this test)."""
    out = run_python("""
        import os, time, grpc, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        start = time.monotonic() + 1.0
        pids = []
        for k in range(20):
            pid = os.fork()
            if pid == 0:
                grpc.insecure_channel = lambda *args, **kwargs: os._exit(3)
                time.sleep(max(0, start + k * 0.003 - time.monotonic()))
                for i in range(10):
                    with tracer.start_as_current_span("child", attributes={"k": k}):
                        pass
                os._exit(0 if p.shutdown() else 1)
            pids.append(pid)
        time.sleep(max(0, start + 0.02 - time.monotonic()))
        p.shutdown()
        print(sorted(os.waitpid(pid, 0)[1] for pid in pids) == [0] * 20)
    """, env=tracer_env(collector, "shutting-down"), timeout=60)
    assert out.stdout.split() == ["True"], out.stdout + out.stderr
    assert wait_until(lambda: span_count(collector.store) == 200, 10), span_count(collector.store)


def test_a_child_outliving_its_parents_tracer_sends_with_a_configuration_of_paths(collector, tmp_path):
    """The new process that sends an orphaned child's batches gets its configuration as JSON,
    which refused a pathlib.Path (a spool_dir so given): shutdown raised TypeError into the
    program, and its spans were lost."""
    out = run_python("""
        import os, pathlib, sys, time, crosstrace
        p = crosstrace.init(spool_dir=pathlib.Path(sys.argv[1]))
        tracer = p.get_tracer("t")
        pid = os.fork()
        if pid == 0:
            time.sleep(0.3)   # the parent's tracer is shut down meanwhile
            for i in range(30):
                with tracer.start_as_current_span("orphan"):
                    pass
            os._exit(0 if p.shutdown() else 1)
        p.shutdown()
        print(os.waitpid(pid, 0)[1])
    """, env=tracer_env(collector, "paths"), timeout=60, args=(str(tmp_path / "spool"),))
    assert out.stdout.split() == ["0"], out.stdout + out.stderr
    assert wait_until(lambda: span_count(collector.store) == 30, 10), span_count(collector.store)


def test_a_childs_handover_outlives_its_parent_in_the_spool(collector, tmp_path):
    """The parent (spool_dir set, its collector away) is killed with its child's batches
    handed over and unsent: the next process that spools there sends them."""
    spool = str(tmp_path / "spool")
    out = run_python("""
        import os, signal, crosstrace
        p = crosstrace.init(endpoint="127.0.0.1:9", spool_dir=%r)
        tracer = p.get_tracer("t")
        pid = os.fork()
        if pid == 0:
            for i in range(50):
                with tracer.start_as_current_span("child-of-killed"):
                    pass
            os._exit(0 if p.shutdown() else 1)
        print(os.waitpid(pid, 0)[1], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """ % spool, timeout=60, check=False)
    assert out.stdout.split() == ["0"], out.stdout + out.stderr
    replay = run_python("""
        import crosstrace
        print(crosstrace.init(spool_dir=%r).force_flush(20000))
    """ % spool, env=tracer_env(collector, "next"), timeout=60)
    assert replay.stdout.split() == ["True"], replay.stderr
    assert wait_until(lambda: span_count(collector.store) == 50, 10)


def test_a_child_that_no_new_process_can_send_for_sends_over_a_channel_of_its_own(collector):
    """The last resort of a child whose parent's tracer is gone: no new process could run
    (here its interpreter is gone), so it opens a gRPC channel in the child. That works only
    while gRPC restarts its threads in a forked child, as grpcio does by default since 1.74:
    with GRPC_ENABLE_FORK_SUPPORT=0 (tried against a child's crash in CI) this child died
    of SIGSEGV or SIGABRT in each of 3 runs."""
    out = run_python("""
        import os, sys, time, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        with tracer.start_as_current_span("parent"):
            pass
        assert p.force_flush(20000)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            sys.executable = "/nonexistent/python"   # no new process can run (orphans.py)
            os.read(r, 1)   # the parent's tracer has shut down
            for i in range(20):
                with tracer.start_as_current_span("child"):
                    pass
            os._exit(0 if p.shutdown() else 1)
        print(p.shutdown(), flush=True)
        os.write(w, b"x")
        print(os.waitpid(pid, 0)[1])
    """, env=tracer_env(collector, "own-channel"), timeout=60)
    assert out.stdout.split() == ["True", "0"], out.stdout + out.stderr
    assert wait_until(lambda: span_count(collector.store) == 21, 10), span_count(collector.store)


def test_a_child_of_a_killed_parent_not_yet_reaped_sends_itself(collector, tmp_path):
    """A killed parent is a zombie until its launcher reaps it, and kill(pid, 0) still
    found it: its child took it for a parent that sends, handed over to nobody, and its
    spans were lost. The parent's tracer holds a lock on its mark instead."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    parent = """
        import os, signal, time, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        pid = os.fork()
        if pid == 0:
            time.sleep(0.5)   # the parent is killed meanwhile, and not reaped yet
            for i in range(40):
                with tracer.start_as_current_span("orphan"):
                    pass
            print("child", p.shutdown(), flush=True)
            os._exit(0)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    out = run_python(f"""
        import subprocess, sys, textwrap, time
        parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent({parent!r})])
        time.sleep(5)          # a launcher that looks at its workers now and then (the child's
                               # run took over 1.5 s once, on a loaded machine)
        print(parent.wait(30))
        time.sleep(0.5)
    """, env={**tracer_env(collector, "zombie"), "TMPDIR": str(temp)}, timeout=60)
    assert out.stdout.split() == ["child", "True", "-9"], out.stdout + out.stderr
    assert wait_until(lambda: span_count(collector.store) == 40, 10)
    assert os.listdir(temp) == []   # and the killed parent's folder went with its last child


def test_children_alive_at_exit_are_ended_before_the_parent_takes_its_last_look(collector, tmp_path):
    """multiprocessing ends its children (a DataLoader's persistent workers) in its own exit
    hook, which ran after crosstrace's: the parent's last look came while they lived, and
    their folders were left behind for good, one per run."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = run_python("""
        import multiprocessing as mp, time, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        def worker(ready):
            for i in range(10):
                with tracer.start_as_current_span("worker"):
                    pass
            if p.force_flush(20000):
                ready.set()
            time.sleep(60)                      # alive until the parent's exit ends it
        ready = mp.get_context("fork").Event()
        child = mp.get_context("fork").Process(target=worker, args=(ready,), daemon=True)
        child.start()
        print(ready.wait(30))
        with tracer.start_as_current_span("parent"):
            pass
    """, env={**tracer_env(collector, "exiting"), "TMPDIR": str(temp)}, timeout=60)
    assert out.stdout.split() == ["True"], out.stdout + out.stderr
    assert wait_until(lambda: span_count(collector.store) == 11, 10)
    assert os.listdir(temp) == [], os.listdir(temp)


def test_an_exit_interrupted_while_it_joins_a_child_still_keeps_the_spans(tmp_path):
    """The parent's tracer ends after multiprocessing has joined its children; with that
    run from multiprocessing's own exit hook, a Ctrl-C in the join cost all the spans the
    parent had not sent (0 of 100 kept in the spool)."""
    import re
    import signal
    import subprocess
    import sys
    import textwrap

    spool = tmp_path / "spool"
    program = textwrap.dedent("""
        import multiprocessing as mp, os, sys, time, crosstrace
        p = crosstrace.init(endpoint="127.0.0.1:9", spool_dir=sys.argv[1], node_id="n", exit_flush_timeout_s=2)
        tracer = p.get_tracer("t")
        child = mp.get_context("fork").Process(target=time.sleep, args=(20,))   # joined at exit
        child.start()
        for i in range(100):
            with tracer.start_as_current_span("last"):
                pass
        print(child.pid, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", program, str(spool)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = int(first_line(proc))
    try:
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        try:
            os.kill(child, signal.SIGKILL)   # (it holds the pipes open)
        except ProcessLookupError:
            pass
    err = proc.stderr.read()
    kept = sum(int(m[1]) for _, _, files in os.walk(spool) for f in files
               if (m := re.match(r"^\d+-\d+-(\d+)\.batch$", f)))
    assert kept == 100, err


def test_what_children_hand_over_is_bounded_as_a_whole(tmp_path):
    """Each child bounds its own handover; children that come and go (a DataLoader's
    workers, epoch after epoch) left 6.6 MB against a 1 MB bound while the collector was
    away. The parent drops and counts the oldest beyond the bound."""
    out = run_python("""
        import os, crosstrace
        p = crosstrace.init(endpoint="127.0.0.1:9", max_unacked_mb=1, exit_flush_timeout_s=0.5)
        tracer = p.get_tracer("t")
        for generation in range(6):
            pid = os.fork()
            if pid == 0:
                for i in range(800):
                    with tracer.start_as_current_span("w", attributes={"pad": "x" * 1000, "i": i}):
                        pass
                os._exit(0 if p.shutdown() else 1)
            os.waitpid(pid, 0)
        assert p.force_flush(1500) is False
        folder = p._exporter._children.dir
        print(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs) >> 10,
              p.dropped_spans > 0)
    """, env={"TMPDIR": str(tmp_path), "CROSSTRACE_NODE_ID": "bounded"}, timeout=60)
    kib, dropped = out.stdout.split()
    assert int(kib) <= 1024 + 1024 and dropped == "True", out.stdout + out.stderr   # the bound, plus the newest batch


def test_tracer_never_blocks_when_the_collector_is_unreachable():
    provider = crosstrace.TracerProvider(endpoint="127.0.0.1:9", node_id="offline")
    tracer = provider.get_tracer("t")
    t0 = time.perf_counter()
    for _ in range(20000):
        with tracer.start_as_current_span("offline"):
            pass
    elapsed = time.perf_counter() - t0
    assert elapsed < 10  # generous: it must not wait on the network (normally ~0.05 s)
    t0 = time.perf_counter()
    provider.shutdown(timeout_millis=300)
    assert time.perf_counter() - t0 < 3


def test_a_process_that_exits_with_spans_unsent_says_so():
    """Without a collector a job exited 0 and quietly lost its spans."""
    for own_shutdown in ("", "assert p.shutdown(500) is False"):   # the program's own shutdown() too
        out = run_python(f"""
            import crosstrace
            p = crosstrace.init(endpoint="127.0.0.1:9", exit_flush_timeout_s=0.5)
            t = p.get_tracer("t")
            for i in range(10):
                with t.start_as_current_span("step"):
                    pass
            {own_shutdown}
        """)
        assert "exiting with 10 spans the collector at 127.0.0.1:9 has not acknowledged: lost" in out.stderr


def test_a_process_that_traced_nothing_exits_without_waiting_for_the_collector():
    """A program that imports a traced module and traces nothing (its --help, say), its
    collector out of reach, waited at exit for its clock samples to be acked (4.5 s by
    default); one with spans to deliver still waits, and says what it lost."""
    for spans, waits in ((0, False), (1, True)):
        out = run_python(f"""
            import time, crosstrace
            p = crosstrace.init(endpoint="127.0.0.1:9", exit_flush_timeout_s=8)
            for i in range({spans}):
                p.get_tracer("t").start_span("step").end()
            time.sleep(1)   # its first export stream has failed
            started = time.monotonic()
            p.shutdown()   # as at exit
            print(round(time.monotonic() - started, 1))
        """)
        assert (float(out.stdout) > 5) is waits, (spans, out.stdout, out.stderr)
        assert ("has not acknowledged: lost" in out.stderr) is waits


def test_spans_ended_on_other_threads_arrive(collector):
    import threading

    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="threads")
    tracer = provider.get_tracer("t")

    def work():
        for _ in range(500):
            with tracer.start_as_current_span("threaded"):
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert provider.force_flush(20_000)
    provider.shutdown()
    assert wait_until(lambda: span_count(collector.store) == 2000, 5)


def test_pool_workers_ended_by_sigterm_hand_their_spans_over(collector):
    """`with multiprocessing.Pool() as p:` ends its workers with SIGTERM (terminate()), idle
    or in the middle of their exit: 0 to 11 of 20 spans were lost, uncounted. A
    multiprocessing child's SIGTERM now hands them over first, and still ends it by SIGTERM."""
    out = run_python("""
        import json, multiprocessing as mp, os, time, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        def work(i):
            with tracer.start_as_current_span("task", attributes={"i": i}):
                time.sleep(0.002)
        exits = set()
        for round in range(3):
            with mp.get_context("fork").Pool(2) as pool:
                pool.map(work, range(round * 20, round * 20 + 20))
                workers = list(pool._pool)
            exits |= {w.exitcode for w in workers}
        print(json.dumps({"exits": sorted(exits), "flushed": p.force_flush(20000)}))
    """, env=tracer_env(collector, "pool"), timeout=90)
    result = json.loads(out.stdout)
    assert set(result["exits"]) <= {0, -15} and result["flushed"], out.stdout + out.stderr   # (0: it was exiting)
    assert "skipping fork() handlers" not in out.stderr   # gRPC's INFO line, at every fork of a traced process
    with Store(collector.store, readonly=True) as store:
        table = spantable.load(store)
    assert sorted(a["i"] for a in table.attributes) == list(range(60))


def test_a_workers_sigterm_hands_over_even_while_it_is_stuck_in_c(collector):
    """A multiprocessing child ended by SIGTERM hands its spans over and dies by SIGTERM, also
    when its main thread is stuck in C (here a mutex locked twice), where a Python signal
    handler would never run; a child whose program set a SIGTERM handler keeps it."""
    out = run_python("""
        import ctypes, multiprocessing as mp, os, signal, time, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        def stuck(name, said):
            with tracer.start_as_current_span(name):
                pass
            os.write(said, b"x")
            mutex = ctypes.create_string_buffer(64)   # PTHREAD_MUTEX_INITIALIZER: zeros
            libc = ctypes.CDLL(None)
            libc.pthread_mutex_lock(mutex)
            libc.pthread_mutex_lock(mutex)            # never returns, whatever signal comes
        def child(name, wait_s):
            ready, said = os.pipe()
            worker = mp.get_context("fork").Process(target=stuck, args=(name, said))
            worker.start()
            os.read(ready, 1)
            for _ in range(1000):   # until it waits in the kernel for the mutex
                with open(f"/proc/{worker.pid}/wchan") as f:
                    if "futex" in f.read():
                        break
                time.sleep(0.01)
            worker.terminate()
            worker.join(wait_s)
            if worker.exitcode is None:
                worker.kill()
                worker.join(5)
                return "alive"
            return worker.exitcode
        ended = child("default", 20)
        signal.signal(signal.SIGTERM, lambda *a: os._exit(7))   # the program's own: the child's too
        handled = child("handled", 2)   # stuck in C: the program's handler never runs
        print(ended, handled, p.force_flush(20000))
    """, env=tracer_env(collector, "children"), timeout=90)
    ended, handled, flushed = out.stdout.split()
    assert (ended, flushed) == ("-15", "True"), out.stdout + out.stderr
    assert handled in ("alive", "7")   # the program's handler: stuck, it never runs (7: it came before the lock)
    with Store(collector.store, readonly=True) as store:
        names = [table.names[n] for table in [spantable.load(store)] for n in table.name]
    assert "default" in names


def test_a_worker_whose_asyncio_loop_took_the_wakeup_fd_still_ends_on_sigterm(collector):
    """asyncio's loop.add_signal_handler (for any signal) takes the wakeup fd that the
    tracer's SIGTERM watcher reads, and closing the loop clears it: the worker ignored
    SIGTERM, and Process.terminate() and Pool waited for ever. Its spans still go over."""
    out = run_python("""
        import asyncio, multiprocessing as mp, os, signal, time, crosstrace
        p = crosstrace.init()
        tracer = p.get_tracer("t")
        async def serve(name, said, close):
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: None)   # a reload signal
            with tracer.start_as_current_span(name):
                pass
            if not close:
                os.write(said, b"x")
                await asyncio.sleep(60)
        def worker(name, said, close):
            asyncio.run(serve(name, said, close))   # closing the loop clears the wakeup fd
            os.write(said, b"x")
            time.sleep(60)
        exits = []
        for name, close in (("serving", False), ("closed", True)):
            ready, said = os.pipe()
            child = mp.get_context("fork").Process(target=worker, args=(name, said, close))
            child.start()
            os.read(ready, 1)
            child.terminate()
            child.join(15)
            exits.append(child.exitcode)
            if child.exitcode is None:
                child.kill()
                child.join(5)
        print(*exits, p.force_flush(20000))
    """, env=tracer_env(collector, "asyncio-workers"), timeout=90)
    assert out.stdout.split() == ["-15", "-15", "True"], out.stdout + out.stderr
    table = load_table(collector.store)
    assert sorted(table.names[n] for n in table.name) == ["closed", "serving"]


def test_a_forked_child_that_records_nothing_sends_nothing(collector):
    """gRPC cannot fully hand a forked child a process whose export stream was open (children
    of DDP ranks aborted in its poller): a child (a DataLoader worker) touches gRPC only
    once it has spans to send. It sent a first batch, and probed the clock, at once."""
    out = run_python("""
        import multiprocessing as mp, time, crosstrace
        p = crosstrace.init()
        with p.get_tracer("t").start_as_current_span("parent"):
            pass
        child = mp.get_context("fork").Process(target=time.sleep, args=(0.5,))   # past its first round
        child.start()
        child.join(30)
        print(child.exitcode, p.force_flush(20000))
    """, env=tracer_env(collector, "quiet-children"), timeout=60)
    assert out.stdout.split() == ["0", "True"], out.stderr
    with Store(collector.store, readonly=True) as store:
        sessions = store.db.execute("SELECT count(*) FROM sessions").fetchone()[0]
    assert sessions == 1     # the parent's


def test_the_exporter_thread_imports_nothing(collector):
    """A module the exporter thread imports for the first time is half-initialised in a
    child forked at that moment (grpc imports its channel module on the first channel),
    and the child could never export: everything is imported at init."""
    out = run_python("""
        import sys, crosstrace
        p = crosstrace.init(token="secret")   # the token's interceptor too
        before = set(sys.modules)
        with p.get_tracer("t").start_as_current_span("x"):
            pass
        assert p.force_flush(20000)
        print(sorted(set(sys.modules) - before))
    """, env=tracer_env(collector, "imports"))
    assert out.stdout.strip() == "[]", out.stdout


def test_exit_probes_the_clock_once_more_after_the_last_span(collector):
    """A short-lived process: its only periodic probe was at start; shutdown forces one
    more burst, so the collector has clock samples after the process's last span."""
    run_python("""
        import time, crosstrace
        p = crosstrace.init(clock_probe_interval_s=3600, udp_clock=False)
        t = p.get_tracer("t")
        time.sleep(0.5)
        with t.start_as_current_span("last"):
            pass
        p.shutdown()
    """, env=tracer_env(collector, "brief"))
    store = Store(collector.store, readonly=True)
    try:
        table = spantable.load(store)
        probes = sorted(row[7] for row in store.clock_samples() if row[1] == pb.GRPC_EXCHANGE)
    finally:
        store.close()
    last_span_end = int(table.end.max())
    assert probes[0] < last_span_end < probes[-1]


def test_clock_probes_never_hold_up_the_export(collector):
    """A probe waits for its answer, and while the traced program keeps the GIL busy each
    wait ends only at a GIL switch: a burst then takes about 150 ms. Probing on the
    exporter's thread held the export up that long, and a busy loop filled the queue: 52,494
    of 600,000 spans were lost in the first second. The stream is opened first (one span,
    flushed): opening it starts gRPC's threads, which under the busy loop took long enough,
    once in about 50 runs, to fill this small queue before any probe ran.
    The program keeps the GIL busy throughout but opens spans at 250k a second: 150 ms of
    export held up is then 37,500 spans, more than the queue holds. (A loop that only opens
    spans, a million a second with the compiled hot path, outruns the export here with no
    probe at all: this machine's 2 cores also run the collector, README.)"""
    out = run_python("""
        import time, crosstrace
        p = crosstrace.init(max_queue=16384, clock_probe_interval_s=0.05)
        t = p.get_tracer("t")
        with t.start_as_current_span("first"):
            pass
        assert p.force_flush(30000)
        n, start = 1, time.monotonic()
        end = start + 0.7
        while time.monotonic() < end:
            for _ in range(1000):
                with t.start_as_current_span("busy"):
                    pass
            n += 1000
            while time.monotonic() < start + n / 250_000:   # busy, holding the GIL, between spans
                pass
        print(n, p.dropped_spans, p.force_flush(60000))
    """, env=tracer_env(collector, "busy"), timeout=120)
    spans, dropped, flushed = out.stdout.split()
    assert (int(dropped), flushed) == (0, "True")
    store = Store(collector.store, readonly=True)
    try:
        assert store.span_count() == int(spans)
        probes = [row for row in store.clock_samples() if row[1] == pb.GRPC_EXCHANGE]
    finally:
        store.close()
    assert len(probes) >= 2 * 8     # bursts ran meanwhile: the loop did not just starve them


def test_spans_ended_during_shutdown_are_dropped_and_counted(collector):
    """Threads that go on ending spans while the tracer shuts down (or the program exits):
    those spans were left in a queue nothing took out any more, neither stored nor counted."""
    out = run_python("""
        import threading, time, crosstrace
        p = crosstrace.init()
        t = p.get_tracer("t")
        produced, stop = [0] * 4, threading.Event()
        def produce(i):
            while not stop.is_set():
                for _ in range(20):
                    with t.start_as_current_span("late"):
                        pass
                produced[i] += 20
                time.sleep(0.001)
        threads = [threading.Thread(target=produce, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        flushed = p.shutdown()
        time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join()
        print(sum(produced), p.dropped_spans, flushed)
    """, env=tracer_env(collector, "late"))
    produced, dropped, flushed = out.stdout.split()
    store = Store(collector.store, readonly=True)
    try:
        assert store.span_count() + int(dropped) == int(produced)
    finally:
        store.close()
    assert flushed == "True" and int(dropped) > 0
    assert "spans that ended while the tracer shut down were dropped" in out.stderr


def test_disabled_tracer_records_nothing():
    provider = crosstrace.TracerProvider(node_id="off", disabled=True)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("x") as span:
        assert not span.is_recording()
    provider.add_clock_sample((1, 2, "3 4 node"))
    assert not provider._queue.queue and not provider._queue.samples
    assert provider.force_flush(1000) and provider.shutdown()


def test_queued_spans_leave_nothing_for_the_garbage_collector():
    """A queued span is its fields as plain values and its attributes dict: none of them
    is tracked by the GC, even before a collection, so queued spans neither start young
    collections nor reach the old generations (queued span objects did, and full
    collections cost 1-2 us per span). take() gives them back one list per field, and
    batches() splits those."""
    import gc

    from crosstrace.tracer.clock import Clock
    from crosstrace.tracer.encode import batches
    from crosstrace.tracer.exporter import ExportQueue
    from crosstrace.tracer.provider import Tracer

    queue = ExportQueue(Clock(), max_queue=100, batch_size=100)
    tracer = Tracer(queue)
    for i in range(10):
        with tracer.start_as_current_span("with", attributes={"i": i, "s": "x", "f": 1.5}):
            pass
        tracer.start_span("plain").end()
    assert len(queue.queue) == 20 * 10
    assert not any(gc.is_tracked(entry) for entry in queue.queue)
    columns = queue.take()
    names, attributes = columns[3], columns[-1]
    assert names == ["with", "plain"] * 10 and all(len(c) == 20 for c in columns) and not queue.queue
    assert attributes[0] == {"i": 0, "s": "x", "f": 1.5} and attributes[1] is None
    parts = list(batches(columns, lambda: 15))
    assert [[len(c) for c in part] for part in parts] == [[15] * 10, [5] * 10]
    assert parts[1][3] == ["plain", "with", "plain", "with", "plain"]
    assert [len(part[0]) for part in batches(queue.take(), lambda: 15)] == [0]


def test_an_idle_export_stream_does_not_poll(collector):
    """Between batches the acks reader waits for a batch to go out, not in gRPC's blocking
    read, which woke ten times a second (1.3 ms of CPU a second on these machines), for as
    long as the process lived. A batch after the pause is still acked."""
    import threading

    # Clock probes at start only: their samples' batches would be read in the idle window.
    provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="idle", clock_probe_interval_s=3600)
    tracer = provider.get_tracer("t")

    def one_span_flushed() -> None:
        with tracer.start_as_current_span("s"):
            pass
        assert provider.force_flush(10_000)

    def switches(tid: int) -> int:
        with open(f"/proc/self/task/{tid}/status") as f:
            return int(next(line for line in f if line.startswith("voluntary_ctxt_switches")).split()[1])

    try:
        one_span_flushed()
        time.sleep(0.5)
        one_span_flushed()   # after the first clock-probe burst's samples
        acks = next(t for t in threading.enumerate() if t.name == "crosstrace-acks")
        before = switches(acks.native_id)
        time.sleep(2)
        assert switches(acks.native_id) - before <= 3   # polling: 20
        one_span_flushed()
    finally:
        provider.shutdown()
    assert span_count(collector.store) == 3


def test_a_hung_collector_is_found_and_every_span_arrives_once(tmp_path):
    """A collector that stops answering (SIGSTOP: its connection stays open, no RST) is found
    by the keepalive pings within ~30 s, where gRPC's default ping timeout took 70 s, and the
    batches go to the spool; once it answers again every span arrives, once."""
    import signal

    store = str(tmp_path / "hung.db")
    with CollectorProcess(store) as collector:
        provider = crosstrace.TracerProvider(endpoint=collector.address, node_id="hung",
                                             spool_dir=str(tmp_path / "spool"))
        tracer = provider.get_tracer("t")
        try:
            with tracer.start_as_current_span("before"):
                pass
            assert provider.force_flush(10_000)
            os.kill(collector.proc.pid, signal.SIGSTOP)
            try:
                for i in range(100):
                    with tracer.start_as_current_span("while hung", attributes={"i": i}):
                        pass
                assert wait_until(lambda: provider._exporter._requests is None, 45)
            finally:
                os.kill(collector.proc.pid, signal.SIGCONT)
            assert provider.force_flush(60_000)
        finally:
            provider.shutdown()
    assert span_count(store) == 101


def test_a_tracer_tries_its_collector_again_every_few_seconds():
    """gRPC waits up to 120 s between connection attempts (from 1 s, 1.6x each): a tracer
    whose collector came back after a 2-minute restart reconnected 71 s later, its queue
    filling meanwhile. Its attempts now come at most 5 s apart (and gRPC's 20% jitter).
    A port that accepts and closes each connection stands for the collector that is away."""
    import socket
    import subprocess
    import sys

    with socket.socket() as port:
        port.bind(("127.0.0.1", 0))
        port.listen(64)
        port.settimeout(0.5)
        env = {**os.environ, "CROSSTRACE_ENDPOINT": "127.0.0.1:%d" % port.getsockname()[1], "CROSSTRACE_NODE_ID": "x"}
        tracer = subprocess.Popen([sys.executable, "-c", "import time, crosstrace\n"
                                   "t = crosstrace.init().get_tracer('x')\n"
                                   "for _ in range(400):\n"
                                   "    with t.start_as_current_span('tick'):\n"
                                   "        time.sleep(0.1)\n"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:   # 28 s from the first attempt (the tracer's start takes its time on a loaded machine)
            attempts, give_up = [], time.monotonic() + 60
            while time.monotonic() < (attempts[0] + 28 if attempts else give_up):
                try:
                    connection, _ = port.accept()
                except socket.timeout:
                    continue
                attempts.append(time.monotonic())
                connection.close()
        finally:
            tracer.kill()
            tracer.wait(10)
    assert attempts, "the tracer never tried"
    times = [t - attempts[0] for t in attempts if t <= attempts[0] + 28] + [28]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # gRPC's 1.6x backoff, 20% jitter: a gap of 8.4 s or more within 28 s; capped: 6 s at most
    assert len(times) >= 6 and max(gaps) < 7.5, times   # before: 0 1.1 2.6 5.2 9.7 15.3 26.5
