"""Intermittent links, with real tracer processes and real collectors: an edge that runs
with its collector down spools to disk and delivers every span once it is back (the oldest
dropped and counted beyond the spool limit); the node's next process replays what the last
one left; a tracer killed mid-stream and a collector killed mid-run lose no acked span and
store none twice."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from crosstrace.collector import spantable
from crosstrace.collector.store import Store
from crosstrace.launch import CollectorProcess, free_port, wait_until

EDGE = """
import os, sys, time, crosstrace
n, pad = int(sys.argv[1]), int(sys.argv[2])
p = crosstrace.init()
t = p.get_tracer("edge")
for i in range(n):
    with t.start_as_current_span("edge-work", attributes={"i": i, "pad": f"{i:08d}" * pad}):
        pass
    if i % 2000 == 1999:
        time.sleep(0.2)                     # an edge that runs for a while
spool = os.environ["CROSSTRACE_SPOOL_DIR"]
deadline = time.monotonic() + 20
def on_disk():
    return sum(name.endswith(".batch") for _, _, names in os.walk(spool) for name in names)
while not on_disk() and time.monotonic() < deadline:
    time.sleep(0.05)
print("spooled", on_disk(), flush=True)
if sys.argv[3] == "flush":
    print("flushed", p.force_flush(60000), p.dropped_spans, flush=True)
else:
    p.shutdown(timeout_millis=500)            # gone before the collector is back
    print("exited", flush=True)
"""


def start(code: str, env: dict, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})


def next_line(proc: subprocess.Popen, prefix: str, timeout_s: float = 60) -> list[str]:
    """The words of the child's next stdout line that starts with `prefix` (killed on timeout)."""
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(prefix):
                return line.split()[1:]
    finally:
        timer.cancel()
    raise AssertionError(f"child exited ({proc.wait(5)}) before {prefix!r}: {proc.stderr.read()}")


def finish(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    try:
        assert proc.wait(timeout_s) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def edge_env(port: int, node: str | None, spool, **extra) -> dict:
    """A tracer's environment; node None: the default node id, <host>/<pid>."""
    env = {"CROSSTRACE_ENDPOINT": f"127.0.0.1:{port}", "CROSSTRACE_SPOOL_DIR": str(spool),
           "CROSSTRACE_UDP_CLOCK": "0", "CROSSTRACE_EXPORT_INTERVAL_MS": "50"}
    if node is not None:
        env["CROSSTRACE_NODE_ID"] = node
    env.update({f"CROSSTRACE_{k.upper()}": str(v) for k, v in extra.items()})
    return env


def stored_indices(path: str, node: str | None = None) -> list[int]:
    """The `i` attribute of every stored span (of `node`), sorted: duplicates would show."""
    store = Store(path, readonly=True)
    try:
        table = spantable.load(store)
    finally:
        store.close()
    return sorted(table.attributes[r]["i"] for r in range(len(table.node))
                  if node is None or table.nodes[table.node[r]] == node)


def dropped(path: str) -> dict[str, int]:
    store = Store(path, readonly=True)
    try:
        return store.dropped_by_node()
    finally:
        store.close()


def test_edge_offline_for_a_while_delivers_every_span_once_it_is_back(tmp_path):
    port = free_port()
    edge = start(EDGE, edge_env(port, "camera", tmp_path / "spool"), 10000, 1, "flush")
    try:
        spooled = int(next_line(edge, "spooled")[0])
        assert spooled > 0                       # on disk while the collector was away
        with CollectorProcess(str(tmp_path / "store.db"), listen=f"127.0.0.1:{port}") as collector:
            flushed, lost = next_line(edge, "flushed")
            finish(edge)
            assert (flushed, lost) == ("True", "0")
            assert stored_indices(collector.store) == list(range(10000))
            assert dropped(collector.store) == {"camera": 0}
    finally:
        finish(edge)
    assert not [f for _, _, names in os.walk(tmp_path / "spool") for f in names if f.endswith(".batch")]


def test_full_spool_drops_the_oldest_and_the_report_counts_them(tmp_path):
    port = free_port()
    n = 12000          # ~2.5 MB of batches for a 1 MB spool
    edge = start(EDGE, edge_env(port, "camera", tmp_path / "spool", spool_max_mb=1, batch_size=500), n, 25, "flush")
    try:
        next_line(edge, "spooled")
        with CollectorProcess(str(tmp_path / "store.db"), listen=f"127.0.0.1:{port}") as collector:
            flushed, lost = next_line(edge, "flushed")
            finish(edge)
            kept = stored_indices(collector.store)
            assert flushed == "True" and int(lost) > 0
            assert len(kept) + int(lost) == n
            assert kept == list(range(n - len(kept), n))     # the newest survive
            assert dropped(collector.store) == {"camera": int(lost)}
    finally:
        finish(edge)


@pytest.mark.parametrize("node", ["robot", None])
def test_the_next_process_of_a_node_replays_what_the_last_one_left(tmp_path, node):
    """Also with the default node id, <host>/<pid>: new in every process, and the next one
    looked for batches under its own id only, so they stayed on disk for good."""
    port = free_port()
    spool = tmp_path / "spool"
    first = start(EDGE, edge_env(port, node, spool), 3000, 1, "exit")
    next_line(first, "exited")
    finish(first)
    assert any(f.endswith(".batch") for _, _, names in os.walk(spool) for f in names)
    with CollectorProcess(str(tmp_path / "store.db"), listen=f"127.0.0.1:{port}") as collector:
        second = start(EDGE, edge_env(port, node, spool), 10, 1, "flush")
        assert next_line(second, "flushed") == ["True", "0"]
        finish(second)
        # 3000 spans of the first process (i = 0..2999), 10 of the second (i = 0..9)
        assert stored_indices(collector.store) == sorted(list(range(3000)) + list(range(10)))
    assert os.listdir(spool) == []   # no folder left behind: one per process under default node ids


def hung_collector():
    """A real gRPC server that takes every Export batch and never acks (a collector stuck
    committing: the stream stays up). Returns (server, port)."""
    import concurrent.futures

    import grpc

    def export(requests, context):
        for _ in requests:
            pass
        return iter(())

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("crosstrace.v1.Collector", {
        "Export": grpc.stream_stream_rpc_method_handler(export, request_deserializer=None,
                                                        response_serializer=None)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_spans_held_for_a_collector_that_never_acks_reach_the_spool(tmp_path):
    """The exporter waits for room among unacked batches (max_unacked_mb) with spans in
    hand; at exit those were neither spooled nor counted (39,675 of 150,000 in a review's
    run) while shutdown went on without it. All of them reach the spool, and the node's
    next process delivers each once."""
    spool = tmp_path / "spool"
    server, port = hung_collector()
    try:
        first = start("""
            import sys, crosstrace
            t = crosstrace.init().get_tracer("edge")
            for i in range(30000):    # at once: the exporter takes ~30 batches of 1 MB, one in flight
                t.start_span("edge-work", attributes={"i": i, "pad": "x" * 1000}).end()
        """, edge_env(port, "edge", spool, max_unacked_mb=1, exit_flush_timeout_s=2, export_interval_ms=1000,
                      max_queue=30000))
        finish(first)
    finally:
        server.stop(0)
    with CollectorProcess(str(tmp_path / "store.db"), listen=f"127.0.0.1:{port}") as collector:
        second = start(EDGE, edge_env(port, "edge", spool), 10, 1, "flush")
        assert next_line(second, "flushed", timeout_s=120) == ["True", "0"]
        finish(second)
        assert stored_indices(collector.store) == sorted(list(range(30000)) + list(range(10)))


STREAM = """
import sys, crosstrace
p = crosstrace.init()
t = p.get_tracer("edge")
n = int(sys.argv[1])
for i in range(n):
    with t.start_as_current_span("streamed", attributes={"i": i}):
        pass
    if i % 500 == 499 and p.force_flush(30000):
        print("acked", i + 1, flush=True)    # every span up to here is committed
print("flushed", p.force_flush(60000), flush=True)
"""


def test_tracer_killed_mid_stream_loses_no_acked_span_and_duplicates_none(tmp_path):
    with CollectorProcess(str(tmp_path / "store.db")) as collector:
        env = edge_env(collector.port, "killed", tmp_path / "spool", export_interval_ms=10)
        edge = start(STREAM, env, 10**9)
        try:
            while int(next_line(edge, "acked")[0]) < 5000:
                pass
            acked = int(next_line(edge, "acked")[0])
            edge.send_signal(signal.SIGKILL)     # mid-stream: batches sent and not acked yet
        finally:
            edge.kill()
            edge.wait(10)
    kept = stored_indices(collector.store)
    assert kept[:acked] == list(range(acked))    # every acked span
    assert len(set(kept)) == len(kept)           # none twice


def test_collector_killed_and_restarted_mid_run_loses_nothing(tmp_path):
    path = str(tmp_path / "store.db")
    collector = CollectorProcess(path)
    port = collector.port
    env = edge_env(port, "steady", tmp_path / "spool", export_interval_ms=10)
    edge = start(STREAM.replace('print("acked"', 'time.sleep(0.02); print("acked"').replace(
        "import sys,", "import sys, time,"), env, 40000)
    try:
        next_line(edge, "acked")
        collector.kill()                         # SIGKILL while the tracer streams
        time.sleep(0.5)
        collector = CollectorProcess(path, listen=f"127.0.0.1:{port}")
        assert next_line(edge, "flushed") == ["True"]
        finish(edge)
    finally:
        collector.stop()
        finish(edge)
    assert stored_indices(path) == list(range(40000))


def test_a_spool_that_cannot_be_written_costs_memory_only_up_to_its_bound(tmp_path):
    """Disk full or folder gone: the tracer keeps at most max_unacked_mb in memory, counts the
    rest as dropped, and neither raises into the program nor at shutdown."""
    import shutil

    import crosstrace

    provider = crosstrace.TracerProvider(endpoint=f"127.0.0.1:{free_port()}", node_id="edge",
                                         spool_dir=str(tmp_path / "spool"), max_unacked_mb=1, batch_size=1000)
    while (tmp_path / "spool").exists():             # every spool write fails from now on
        shutil.rmtree(tmp_path / "spool", ignore_errors=True)   # (a first batch may be going there meanwhile)
    tracer = provider.get_tracer("t")
    for i in range(30_000):
        with tracer.start_as_current_span("frame", attributes={"i": i, "pad": "x" * 100}):
            pass
    exporter = provider._exporter
    assert wait_until(lambda: not provider._queue.queue and provider.dropped_spans > 0, 30)
    assert exporter._memory_bytes <= (1 << 20) + 200_000   # the bound, plus the newest batch
    assert provider.shutdown(5000) is False               # not everything was delivered; no exception


SPOOL_STARTS = """
import os, sys
from crosstrace.tracer.spool import Spool
failures = 0
for _ in range(100):
    try:
        spool = Spool(sys.argv[1], f"host/{os.getpid()}", os.urandom(8))
        spool.adopt()
        spool.close()
    except OSError:
        failures += 1
print(failures)
"""


def test_processes_starting_together_each_get_their_spool(tmp_path):
    """Ranks on one host starting at once on one spool folder: one's adoption of dead
    processes' batches took another's new, still unlocked and empty session folder and
    removed it, and that process ran without a spool (95 of 1600 starts)."""
    procs = [start(SPOOL_STARTS, {}, tmp_path) for _ in range(4)]
    try:
        failures = [int(proc.communicate(timeout=120)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert failures == [0, 0, 0, 0]


def test_a_relay_under_sync_full_puts_each_spooled_batch_on_disk(tmp_path, monkeypatch):
    """`crosstrace collector --sync full --forward-to ...` promises an acked batch survives a
    power loss; the batches it acked wait for upstream in its spool, which was never
    fsynced. With fsync, the file and its folder are (the syscalls are watched, not faked)."""
    from crosstrace.tracer.spool import Spool

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    for fsync in (False, True):
        spool = Spool(str(tmp_path / str(fsync)), "relay", os.urandom(8), fsync=fsync)
        item = spool.write(b"batch", seq=1, spans=3)
        assert Spool.read(item) == b"batch"
        spool.close()
    folder = os.path.dirname(item.path)
    assert synced == [os.path.dirname(folder), str(tmp_path / "True"),              # at start
                      os.path.join(folder, os.path.basename(item.path) + ".tmp"), folder]
    result = subprocess.run([sys.executable, "-m", "crosstrace", "collector", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert "per spooled batch in relay mode" in " ".join(result.stdout.split())
    import argparse

    from crosstrace.commands.collector import _upstream
    for sync in ("normal", "full"):
        args = argparse.Namespace(node_id="relay", forward_to="127.0.0.1:9", spool=str(tmp_path / sync),
                                  store=str(tmp_path / "relay.db"), spool_max_mb=None, sync=sync)
        exporter, _ = _upstream(args)
        try:
            assert exporter._spool.fsync == (sync == "full")
        finally:
            exporter.shutdown(0.5)


def test_a_node_folder_removed_while_adopting_costs_nothing(tmp_path, monkeypatch):
    """Node folders go when their last process leaves them empty: one gone between adopt()'s
    listing and its scan made the whole scan fail, and a dead process's batches stayed."""
    from crosstrace.tracer import spool as spool_mod

    root = tmp_path / "spool"
    dead = spool_mod.Spool(str(root), "dead", b"d" * 16)
    dead.write(b"batch", 7, 1)
    for fd in dead._held.values():   # its process is gone: its lock is free
        os.close(fd)
    dead._held.clear()
    (root / "leaving").mkdir()
    real = os.scandir

    def scandir(path):
        entries = list(real(path))
        if os.path.samefile(path, root):   # another process removes its empty node folder now
            (root / "leaving").rmdir()
        return iter(entries)

    monkeypatch.setattr(spool_mod.os, "scandir", scandir)
    found = spool_mod.Spool(str(root), "next", b"n" * 16).adopt()
    assert [(item.seq, item.spans) for item in found] == [(7, 1)]


def test_children_batches_are_taken_once_and_a_dropped_one_is_let_go(tmp_path):
    """What a parent reads of its forked children's handover folders (spool.ChildBatches):
    each batch once, in the order its child wrote it; one its child dropped (its spool full)
    is reported gone, so that the parent does not wait for its ack; a gone child's folder
    is removed once empty."""
    from crosstrace.tracer.spool import ChildBatches, child_spool, parent_sends, tell_parent

    batches = ChildBatches(str(tmp_path), b"p" * 16)
    assert batches.new() == ([], [])
    batches.start()
    assert parent_sends(batches.dir)
    child = child_spool(batches.dir, b"c" * 16, False)
    batches.new()
    first, second = child.write(b"one", 1, 10), child.write(b"two", 2, 20)
    assert not batches.changed()              # a poll between rounds is one stat of the folder
    time.sleep(0.02)                          # (past a tick of the folder's clock, where it is coarse)
    tell_parent(batches.dir)
    assert batches.changed()
    found, gone = batches.new()
    assert not batches.changed()
    assert [(b.seq, b.spans, b.size) for b in found] == [(1, 10, 3), (2, 20, 3)] and gone == []
    assert batches.new() == ([], [])
    child.remove(first)                       # the child drops its oldest
    found, gone = batches.new()
    assert found == [] and gone == [first.path]
    batches.remove(second)                    # acked: the parent removes it
    assert not os.path.exists(second.path)
    batches.new()
    assert os.path.isdir(child.dir)           # the child lives (holds its lock): its folder stays
    child.forget_after_fork()                 # its lock let go, as by a child killed
    batches.new()
    assert not os.path.exists(child.dir)
    batches.stop_taking()
    assert not parent_sends(batches.dir)
    assert batches.close() == 0 and not os.path.exists(batches.dir)


def test_children_batches_outside_a_spool_dir_are_private_and_counted_when_left(tmp_path, monkeypatch):
    """Without a spool_dir the children's folder is a private temporary one (a predictable
    name could be taken first by another user); what a gone child left there untaken is
    removed at close and counted, as nothing would ever send it."""
    import stat
    import tempfile

    from crosstrace.tracer.spool import ChildBatches, child_spool

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    batches = ChildBatches("", b"p" * 16)
    batches.start()
    assert os.path.dirname(batches.dir) == str(tmp_path)
    assert stat.S_IMODE(os.stat(batches.dir).st_mode) == 0o700
    child = child_spool(batches.dir, b"c" * 16, False)
    child.write(b"one", 1, 10)
    child.forget_after_fork()                 # gone, its batch never taken
    assert batches.close() == 10 and os.listdir(tmp_path) == []
