"""Shared fixtures: real collectors and real tracer processes on loopback."""
import os
import subprocess
import sys
import textwrap
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
    """Run `code` in a fresh interpreter (a real tracer process), with a timeout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


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
