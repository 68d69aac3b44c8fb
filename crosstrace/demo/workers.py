"""The demo's worker processes: each a separate Python process with its own CROSSTRACE_*
environment and simulated clock, reporting to the demo's collector."""
import dataclasses
import os
import subprocess
import sys
import time

from ..launch import CHILD_FLAGS, CollectorProcess, free_port


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
        # A session of its own: Ctrl-C in the terminal reaches the demo alone, which stops its workers.
        proc = subprocess.Popen([sys.executable, *CHILD_FLAGS, *args], env=env, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
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

    def finish(self, proc: subprocess.Popen, timeout_s: float, name: str) -> None:
        """Wait for a worker that runs to its end; one that fails fails the demo."""
        self.wait(proc, timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"demo worker {name} exited with {proc.returncode}")

    def run_ranks(self, module: str, job_id: str, node: str, clocks, args: list[str], timeout_s: float = 90):
        """Start one process per rank of a gloo job (torchrun's environment, node ids
        "<node>-<rank>", one simulated clock each) and wait for all of them to succeed. Each
        training job needs its own job id: step k's trace id is derived from (job id, k)."""
        port = str(free_port())
        procs = []
        for rank, clock in enumerate(clocks):
            env = self.env(f"{node}-{rank}", clock, CROSSTRACE_JOB_ID=job_id, RANK=str(rank),
                           WORLD_SIZE=str(len(clocks)), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, OMP_NUM_THREADS="1")
            self.start(["-m", module, *args], env)
            procs.append(self.procs[-1])
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(procs):
            self.finish(proc, max(1.0, deadline - time.monotonic()), f"{node}-{rank} ({module})")

    def stop_all(self, timeout_s: float = 20) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
