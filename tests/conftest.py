"""Shared fixtures: real collectors and real tracer processes on loopback."""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from crosstrace.collector import spantable
from crosstrace.collector.store import Store
from crosstrace.launch import CollectorProcess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def collector(tmp_path):
    """A `crosstrace collector` child process with its store in tmp_path."""
    proc = CollectorProcess(str(tmp_path / "store.db"))
    yield proc
    proc.stop()


def run_python(code: str, env: dict | None = None, timeout: float = 60, check: bool = True,
               args: tuple = ()) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (a real tracer process), with a timeout. A crash
    (SIGSEGV, in it or in a child it forks) prints its Python stack: whether it came in
    crosstrace's code or in a thread of gRPC's own."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def launch_ranks(code: str, world: int, env_of_rank, args_of_rank=lambda rank: (),
                 timeout_s: float = 120) -> list[tuple[str, str]]:
    """Run `code` as `world` processes at once (the ranks of one job), each with
    env_of_rank(rank) and the arguments args_of_rank(rank); abort what is left at the timeout
    (each thread's Python stack goes to its stderr).
    Returns each rank's (stdout, stderr); fails if a rank did not exit 0. Output goes to
    files: a rank blocked on a full pipe would stall the collectives of all the others."""
    procs = []
    try:
        for rank in range(world):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            procs.append((subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args_of_rank(rank))],
                                           env={**env_of_rank(rank), "PYTHONFAULTHANDLER": "1"},
                                           stdout=out, stderr=err, text=True), out, err))
        deadline = time.monotonic() + timeout_s
        for proc, _, _ in procs:
            proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [proc for proc, _, _ in procs if proc.poll() is None]
        for proc in hung:   # SIGABRT: faulthandler writes every thread's stack to stderr
            proc.send_signal(signal.SIGABRT)
        for proc in hung:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    outputs, failures = [], []
    for rank, (proc, out, err) in enumerate(procs):
        with out, err:
            out.seek(0)
            err.seek(0)
            outputs.append((out.read(), err.read()))
        if proc.returncode != 0:
            failures.append(f"rank {rank} exited {proc.returncode}:\n{outputs[-1][0]}\n{outputs[-1][1][-12000:]}")
    if failures:
        raise AssertionError("\n".join(failures))
    return outputs


def local_minus_wall(now) -> tuple[int, int]:
    """(now() - the wall clock, within how much it is known): now() read between two wall
    clock reads, since a preemption between two reads (over 100 us seen here) would
    otherwise pass unnoticed into a test's truth."""
    before, local, after = time.time_ns(), now(), time.time_ns()
    return local - (before + after) // 2, after - before


def first_line(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    """The first line a child prints (its port, say); "" where it prints none within
    timeout_s, when it is killed: never a wait without end."""
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        return proc.stdout.readline()
    finally:
        timer.cancel()


def tracer_env(collector: CollectorProcess, node_id: str, **extra) -> dict:
    env = {"CROSSTRACE_ENDPOINT": collector.address, "CROSSTRACE_NODE_ID": node_id}
    env.update({f"CROSSTRACE_{k.upper()}": str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="session")
def rpc_store(tmp_path_factory):
    """A real store, made once: the RPC-chain demo workload (three processes, three clocks)."""
    from crosstrace.demo import Workers, rpc_chain

    store = str(tmp_path_factory.mktemp("rpc") / "store.db")
    with CollectorProcess(store) as collector:
        workers = Workers(collector, epoch_ns=time.monotonic_ns())
        try:
            rpc_chain.run(workers, lambda message: None, requests=8)
        finally:
            workers.stop_all()
    return store


def span_count(store_path: str) -> int:
    with Store(store_path, readonly=True) as store:
        return store.span_count()


def load_table(store_path: str):
    with Store(store_path, readonly=True) as store:
        return spantable.load(store)
