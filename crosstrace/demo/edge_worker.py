"""The edge demo's processes: an edge device that preprocesses and calls the cloud over
gRPC, and a cloud service with one model worker (a small torch model).

    python -m crosstrace.demo.edge_worker --role cloud
    python -m crosstrace.demo.edge_worker --role edge --upstream HOST:PORT --requests 30
The cloud prints "listening on HOST:PORT" and serves until SIGTERM. Requests wait in a
queue for the single model worker (a `queue` span), then run (an `inference` span of kind
COMPUTE). The edge sends from a few camera streams at once, so some requests do wait.
torch is imported by the cloud only: edge devices have none.
"""
import argparse
import concurrent.futures
import queue
import random
import sys
import threading
import time

import grpc
from opentelemetry import context as context_api
from opentelemetry import trace

import crosstrace

from .rpc_chain import METHOD, busy, serve

STREAMS = 3          # camera streams on the edge, each sending its requests one after another


def cloud(listen: str) -> None:
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(768, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10)).eval()
    with torch.inference_mode():
        model(torch.zeros(16, 768))        # warm up before the first request
    tracer = trace.get_tracer("crosstrace.demo.cloud")
    waiting: "queue.SimpleQueue" = queue.SimpleQueue()

    def model_worker() -> None:
        while True:
            request, ctx, enqueued, answer = waiting.get()
            # Recorded here, on the worker's thread, so that the wait and the inference follow each
            # other in its program order (and on the critical path).
            tracer.start_span("queue", context=ctx, start_time=enqueued).end()
            with tracer.start_as_current_span("inference", context=ctx, kind=crosstrace.Kind.COMPUTE):
                with torch.inference_mode():
                    logits = model(torch.frombuffer(bytearray(request), dtype=torch.float32).reshape(-1, 768))
                answer.set_result(logits.argmax(dim=1).numpy().tobytes())

    threading.Thread(target=model_worker, daemon=True).start()

    def handle(request, context):
        answer = concurrent.futures.Future()
        waiting.put((request, context_api.get_current(), time.time_ns(), answer))
        return answer.result(timeout=30)

    serve(listen, handle)


def edge(upstream: str, requests: int) -> bool:
    """Send the requests over STREAMS threads; False where a stream failed."""
    tracer = trace.get_tracer("crosstrace.demo.edge")
    raw = grpc.insecure_channel(upstream)
    grpc.channel_ready_future(raw).result(timeout=30)   # connected: no request pays the handshake
    channel = crosstrace.instrument_channel(raw)
    infer = channel.unary_unary(METHOD)
    image = bytes(4 * 768 * 4)      # 4 feature vectors, float32

    failed = []

    def stream(index: int, count: int) -> None:
        rng = random.Random(index)
        for i in range(count):
            try:
                with tracer.start_as_current_span("edge-request", attributes={"stream": index, "request": i}):
                    with tracer.start_as_current_span("preprocess", kind=crosstrace.Kind.COMPUTE):
                        busy(3 + 2 * rng.random())
                    infer(image, timeout=30)
            except grpc.RpcError as exc:   # the span says so; the stream ends
                failed.append(f"{exc.code().name}: {exc.details()}")
                return
            time.sleep(0.02 * rng.random())

    threads = [threading.Thread(target=stream, args=(s, requests // STREAMS + (s < requests % STREAMS)))
               for s in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if failed:
        print(f"edge: {len(failed)} of {STREAMS} request streams failed ({failed[0]})", file=sys.stderr)
    return not failed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("edge", "cloud"), required=True)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--upstream", help="the cloud's address (through the delaying link)")
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    provider = crosstrace.init(role=args.role)   # endpoint, node id and clock from CROSSTRACE_* env
    ok = True
    if args.role == "cloud":
        cloud(args.listen)
    else:
        ok = edge(args.upstream, args.requests)
    provider.shutdown()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
