"""`crosstrace demo`: a whole traced system on this machine, then its report.

Starts a collector on a free loopback port with its store in the output folder, runs
the workloads as separate processes, each with its own simulated clock (offset and
drift), and analyses what they recorded. The injected clock errors are printed next to
what the collector recovered from clock samples alone.
"""
import dataclasses
import os
import time

from ..launch import CollectorProcess
from ..tracer.clock import Clock
from .workers import Workers


# name -> (module with run(workers, say, **options) -> dict, needs torch, what it shows)
WORKLOADS = {
    "rpc": ("crosstrace.demo.rpc_chain", False, "frontend -> gateway -> model over gRPC, three clocks"),
    "edge": ("crosstrace.demo.edge", True, "edge device -> delaying link -> cloud model, clock off by 100s of ms"),
    "ddp": ("crosstrace.demo.ddp", True, "4-rank DDP training on gloo with one straggler"),
    "pipeline": ("crosstrace.demo.pipeline", True, "2-stage pipeline-parallel training"),
}


def _torch_missing() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is None


def run(out_dir: str = "crosstrace-demo", requests: int = 20, workloads=tuple(WORKLOADS), say=print) -> dict:
    """Run the chosen workloads against one collector, then analyse the store. The report
    gains a `demo` section: what was injected (clocks, straggler, link delays), so that it
    can be set next to what the analysis found."""
    import importlib

    from ..collector.views import html, perfetto, report_json
    from ..collector.report import analyse_report

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"the output folder {out_dir} is a file; give --out a folder")
    os.makedirs(out_dir, exist_ok=True)
    store = os.path.join(out_dir, "store.db")
    _replace_store(store)
    injected, skipped = {}, {}
    options = {"rpc": {"requests": requests}}
    say(f"starting a collector (store {store})")
    with CollectorProcess(store) as collector:
        say(f"collector listening on {collector.address}")
        workers = Workers(collector, epoch_ns=time.monotonic_ns())
        try:
            for name in workloads:
                module, needs_torch, _ = WORKLOADS[name]
                if needs_torch and _torch_missing():
                    skipped[name] = "torch is not installed (pip install torch==2.13.0 'crosstrace[torch]')"
                    say(f"{name}: skipped, {skipped[name]}")
                    continue
                started = time.monotonic()
                injected[name] = importlib.import_module(module).run(workers, say, **options.get(name, {}))
                say(f"{name}: done in {time.monotonic() - started:.1f} s")
        finally:
            workers.stop_all()
    say("collector stopped; analysing")
    report, analysed, attributed = analyse_report(store)
    report["demo"] = {"injected_clocks": {node: dataclasses.asdict(c) for node, c in workers.truth.items()},
                      "clock_epoch_ns": workers.epoch_ns, "workloads": injected, "skipped": skipped}
    files = {"report_json": os.path.join(out_dir, "report.json"), "html": os.path.join(out_dir, "report.html"),
             "perfetto": os.path.join(out_dir, "trace.json")}
    report_json.write(files["report_json"], report)
    html.write(files["html"], report, analysed, attributed)
    perfetto.write(files["perfetto"], analysed, attributed)
    report["demo"]["files"] = files
    return report


def _replace_store(store: str) -> None:
    """Remove an earlier run's store, unless a collector is writing it (ValueError): the
    demo once deleted a live collector's store under it, and then failed on its lock."""
    from ..collector.store import take_writer_lock

    try:
        lock = take_writer_lock(store)
    except ValueError as exc:
        raise ValueError(f"{exc}: stop that collector, or give the demo another --out") from None
    try:
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(store + suffix):
                os.remove(store + suffix)
    finally:
        lock.close()


def injected_offset_at(clock: dict, epoch_ns: int, local_ns: int) -> float:
    """The simulated clock's offset (local minus true time) when it read `local_ns`."""
    return Clock(clock["offset_ns"], clock["drift_ppm"], epoch_ns).offset_at_local(local_ns)
