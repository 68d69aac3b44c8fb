"""Demo workload: frontend -> gateway -> model over gRPC, each its own process and clock.

    python -m crosstrace.demo.rpc_chain --role model --listen 127.0.0.1:0
Servers print "listening on HOST:PORT" and serve until SIGTERM; the frontend sends
--requests requests and exits. All of them flush their spans before exiting.
"""
import argparse
import concurrent.futures
import random
import signal
import threading
import time

import grpc
from opentelemetry import trace

import crosstrace

METHOD = "/demo.Stage/Process"


def busy(ms: float) -> None:
    """Compute-like work that holds the CPU (sleep would not)."""
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += 1


def serve(listen: str, handle) -> None:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4),
                         interceptors=[crosstrace.server_interceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("demo.Stage", {
        "Process": grpc.unary_unary_rpc_method_handler(handle)})])
    port = server.add_insecure_port(listen)
    server.start()
    print(f"listening on {listen.rsplit(':', 1)[0]}:{port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait(2)


def run(workers, say, requests: int = 20) -> dict:
    """The workload in `crosstrace demo`: the three roles as worker processes, three clocks."""
    from .workers import SimClock

    say(f"rpc: frontend -> gateway -> model over gRPC, {requests} requests, three clocks")
    mod = "crosstrace.demo.rpc_chain"
    model = workers.start(["-m", mod, "--role", "model"], workers.env("model", SimClock(80_000_000, 12.0)),
                          wait_listening=True)
    gateway = workers.start(["-m", mod, "--role", "gateway", "--upstream", model],
                            workers.env("gateway", SimClock(-120_000_000, -25.0)), wait_listening=True)
    workers.start(["-m", mod, "--role", "frontend", "--upstream", gateway, "--requests", str(requests)],
                  workers.env("frontend", SimClock(250_000_000, 40.0)))
    workers.finish(workers.procs[-1], 120, "frontend")
    return {"requests": requests}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("frontend", "gateway", "model"), required=True)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--upstream", help="address of the next stage")
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    provider = crosstrace.init(role=args.role)  # endpoint, node id and clock from CROSSTRACE_* env
    tracer = trace.get_tracer("crosstrace.demo")
    rng = random.Random(7)

    if args.role == "model":
        def handle(request, context):
            with tracer.start_as_current_span("inference", kind=crosstrace.Kind.COMPUTE):
                busy(4 + rng.random() * 2)
            return b"logits"
        serve(args.listen, handle)
    elif args.role == "gateway":
        channel = crosstrace.instrument_channel(grpc.insecure_channel(args.upstream))
        call = channel.unary_unary(METHOD)

        def handle(request, context):
            with tracer.start_as_current_span("route", kind=crosstrace.Kind.COMPUTE):
                busy(0.5)
            return call(request, timeout=10)
        serve(args.listen, handle)
    else:
        channel = crosstrace.instrument_channel(grpc.insecure_channel(args.upstream))
        call = channel.unary_unary(METHOD)
        for i in range(args.requests):
            with tracer.start_as_current_span("request", attributes={"request": i}):
                with tracer.start_as_current_span("preprocess", kind=crosstrace.Kind.COMPUTE):
                    busy(2 + rng.random())
                call(b"image", timeout=10)
            time.sleep(0.01)
    provider.shutdown()


if __name__ == "__main__":
    main()
