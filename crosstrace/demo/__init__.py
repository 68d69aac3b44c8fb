"""`crosstrace demo`: a whole traced system on this machine, then its report.

Starts a collector on a free loopback port with its store in the output folder, runs
the workloads as separate processes, each with its own simulated clock (offset and
drift), and analyses what they recorded. The injected clock errors are printed next to
what the collector recovered from clock samples alone.
"""
import dataclasses
import json
import os
import subprocess
import sys
import time

from ..launch import CollectorProcess


@dataclasses.dataclass
class SimClock:
    offset_ns: int
    drift_ppm: float


class Workers:
    """Child processes of one workload; each gets its own CROSSTRACE_* environment."""

    def __init__(self, collector: CollectorProcess, epoch_ns: int):
        self.collector = collector
        self.epoch_ns = epoch_ns
        self.procs: list[subprocess.Popen] = []
        self.truth: dict[str, SimClock] = {}

    def env(self, node_id: str, clock: SimClock, **extra) -> dict:
        self.truth[node_id] = clock
        return {**os.environ, "CROSSTRACE_ENDPOINT": self.collector.address, "CROSSTRACE_NODE_ID": node_id,
                "CROSSTRACE_JOB_ID": "demo", "CROSSTRACE_SIM_CLOCK_OFFSET_NS": str(clock.offset_ns),
                "CROSSTRACE_SIM_CLOCK_DRIFT_PPM": str(clock.drift_ppm),
                "CROSSTRACE_SIM_CLOCK_EPOCH_NS": str(self.epoch_ns),
                "CROSSTRACE_CLOCK_PROBE_INTERVAL_S": "1", **extra}

    def start(self, args: list[str], env: dict, wait_listening: bool = False, timeout_s: float = 60) -> str | None:
        proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        if not wait_listening:
            return None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("listening on "):
                return line.split()[-1]
            if not line and proc.poll() is not None:
                break
        raise RuntimeError(f"demo worker {' '.join(args)} did not start")

    def wait(self, proc: subprocess.Popen, timeout_s: float) -> None:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(f"demo worker {proc.args} did not finish within {timeout_s:.0f} s") from None

    def stop_all(self, timeout_s: float = 20) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_rpc_chain(workers: Workers, requests: int, say) -> None:
    say(f"rpc: frontend -> gateway -> model over gRPC, {requests} requests, three clocks")
    mod = "crosstrace.demo.rpc_chain"
    model = workers.start(["-m", mod, "--role", "model"], workers.env("model", SimClock(80_000_000, 12.0)),
                          wait_listening=True)
    gateway = workers.start(["-m", mod, "--role", "gateway", "--upstream", model],
                            workers.env("gateway", SimClock(-120_000_000, -25.0)), wait_listening=True)
    workers.start(["-m", mod, "--role", "frontend", "--upstream", gateway, "--requests", str(requests)],
                  workers.env("frontend", SimClock(250_000_000, 40.0)))
    workers.wait(workers.procs[-1], 120)


def run(out_dir: str = "crosstrace-demo", requests: int = 20, say=print) -> dict:
    from ..commands.report import build_report

    os.makedirs(out_dir, exist_ok=True)
    store = os.path.join(out_dir, "store.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(store + suffix):
            os.remove(store + suffix)
    say(f"starting a collector (store {store})")
    with CollectorProcess(store) as collector:
        say(f"collector listening on {collector.address}")
        workers = Workers(collector, epoch_ns=time.monotonic_ns())
        try:
            run_rpc_chain(workers, requests, say)
        finally:
            workers.stop_all()
    say("collector stopped; analysing")
    report, _ = build_report(store, quiet=True)
    report["demo"] = {"injected_clocks": {node: dataclasses.asdict(c) for node, c in workers.truth.items()}}
    path = os.path.join(out_dir, "report.json")
    with open(path, "w") as out:
        json.dump(report, out, indent=1)
    report["demo"]["report_json"] = path
    return report
