"""Edge -> gateway on loopback: push throughput against raw pyzmq, and the edge's step overhead.

1. Push throughput.  The edge side is the real session and cache (a unit per
   layer, credit-limited pipelining, checksums, acks); the gateway is the real
   gateway (decode, validate, accumulate) in another process.  The reference is
   raw pyzmq in the same run: a DEALER sends the same payload bytes to a ROUTER
   in another process that answers each with a small ack, with the same window
   of outstanding messages as our credit.  4 MiB layers (MB/s) and 4 KiB
   layers (layers/s; ours packed into ~1 MiB pushes as by default, and unpacked).
   Both sides send bytes that already exist: the raw client one bytes object,
   ours the cache's buffers, re-armed as a new step without a copy (the copy
   of a gradient into the cache is the hook's cost, measured in figure 2).
2. Edge step overhead: training steps with `ElasticEdge` pushing every step to
   a gateway process, against the same loop with no sink, in alternating
   blocks.  Headline: a small conv net (the usual Jetson workload).  Also an
   MLP, the worst case (least compute per parameter sent), with the time the
   training thread spends in the sink.  The gateway shares this machine's two
   cores, which a real edge does not.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time

import torch
import zmq
from torch import nn

from cloud.aggregation import DeadlineQuorum
from cloud.gateway import Gateway, GatewayOptions
from edge.agent import ElasticEdge
from edge.cache import GradientCache
from edge.session import EdgeSession, SessionOptions
from protocol import Manifest

CREDIT = 8


class Layers(nn.Module):
    """`count` independent parameters of `numel` floats: a model that is only its layers."""

    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(numel)) for _ in range(count))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, 10),
    )  # fmt: skip


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _gateway_main(kind: str, count: int, numel: int, endpoint_q: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    model = Layers(count, numel) if kind == "layers" else MODELS[kind]()
    # Rounds close on a 1 s deadline (a fleet's pace), never on every push.
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        GatewayOptions(bind="tcp://127.0.0.1:0", credit=CREDIT),
        rounds=DeadlineQuorum(deadline_s=1.0, quorum=1_000_000),
    )
    endpoint_q.put(gw.bind())
    ev = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), ev.set()), daemon=True).start()
    gw.serve(ev)


def _raw_server(endpoint_q: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_q.put(f"tcp://127.0.0.1:{port}")
    while not stop.is_set():
        if sock.poll(50):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                sock.send_multipart([frames[0], frames[1].bytes[:8]])


def _start(target, *args) -> tuple[mp.Process, str, mp.Event]:  # type: ignore[no-untyped-def, type-arg]
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(*args, q, stop), daemon=True)
    proc.start()
    return proc, q.get(timeout=60), stop


def raw_rate(endpoint: str, payload: bytes, seconds: float) -> float:
    """Messages per second with CREDIT outstanding, DEALER -> ROUTER -> ack."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    seq = 0
    outstanding = 0
    done = 0
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        while outstanding < CREDIT:
            seq += 1
            sock.send_multipart([seq.to_bytes(8, "little"), payload], copy=False)
            outstanding += 1
        sock.recv_multipart()
        outstanding -= 1
        done += 1
    while outstanding:
        sock.recv_multipart()
        outstanding -= 1
    sock.close()
    return done / (time.perf_counter() - start)


def push_rate(endpoint: str, count: int, numel: int, pack_bytes: int, seconds: float) -> float:
    """Layers per second delivered (acked) by our session, producer adding as fast as it can."""
    model = Layers(count, numel)
    named = [(n, p) for n, p in reversed(list(model.named_parameters()))]
    manifest = Manifest.from_parameters(model.named_parameters())
    units: list[list[int]] = []
    for i in range(len(named)):
        if units and (len(units[-1]) + 1) * numel * 4 <= pack_bytes:
            units[-1].append(i)
        else:
            units.append([i])
    cache = GradientCache([[(named[i][0], (numel,), torch.float32) for i in u] for u in units])
    session = EdgeSession(
        SessionOptions(gateway=endpoint, client_id=f"bench-{numel}", timeout_s=5.0), manifest, cache
    )
    session.start()
    grads = [torch.ones(numel) for _ in range(count)]
    deadline = time.perf_counter() + 10
    while not session.welcomed and time.perf_counter() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    end = start + seconds
    for u, unit in enumerate(units):
        cache.add(u, [grads[i] for i in unit], 0)
    while time.perf_counter() < end:
        # Re-arm every sent unit as one more step with the same bytes (no copy: see the docstring).
        with cache.lock:
            for state in cache.units:
                if state.pending_count == 0:
                    state.pending_count = 1
        session.request_sync(range(len(units)))
        time.sleep(0.0002)
    elapsed = time.perf_counter() - start
    pushes = session.metrics.pushes.total()
    session.close(drain_s=0)
    return pushes * (count / len(units)) / elapsed


def step_overhead(endpoint: str, kind: str, steps: int, blocks: int) -> dict[str, float]:
    """Median step seconds: bare loop, and with ElasticEdge pushing every step; sink time per step."""
    torch.manual_seed(1)
    if kind == "cnn":
        x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))
    else:
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def block(model: nn.Module) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t)
        return times

    bare = MODELS[kind]()
    edge = ElasticEdge(
        MODELS[kind](), SessionOptions(gateway=endpoint, client_id=f"bench-{kind}", timeout_s=0.5)
    )
    sink_s = [0.0]
    add = edge.cache.add

    def timed_add(*args: object) -> None:
        t = time.perf_counter()
        add(*args)  # type: ignore[arg-type]
        sink_s[0] += time.perf_counter() - t

    edge.cache.add = timed_add  # type: ignore[method-assign]
    bare_t: list[float] = []
    edge_t: list[float] = []
    block(bare)
    edge.wait_ready(10)
    block(edge)  # warm-up
    sink_s[0] = 0.0
    for _ in range(blocks):
        bare_t += block(bare)
        edge_t += block(edge)
    pushes = edge.session.metrics.pushes.total()
    edge.close(drain_s=5)
    return {
        "bare_ms": statistics.median(bare_t) * 1e3,
        "edge_ms": statistics.median(edge_t) * 1e3,
        "sink_ms": sink_s[0] / len(edge_t) * 1e3,
        "pushes_per_step": pushes / (len(edge_t) + steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per throughput measurement")
    parser.add_argument("--steps", type=int, default=30, help="steps per timing block")
    parser.add_argument("--blocks", type=int, default=6, help="alternating bare/edge blocks")
    opts = parser.parse_args()
    torch.set_num_threads(1)

    big, small = 1 << 20, 1024  # 4 MiB and 4 KiB of fp32
    figures: dict[str, float] = {}

    proc, ep, stop = _start(_raw_server)
    raw_big = raw_rate(ep, b"\0" * (big * 4), opts.seconds)
    raw_small = raw_rate(ep, b"\0" * (small * 4), opts.seconds)
    stop.set()
    proc.join(10)

    proc, ep, stop = _start(_gateway_main, "layers", 16, big)
    ours_big = push_rate(ep, 16, big, 0, opts.seconds)
    stop.set()
    proc.join(10)

    proc, ep, stop = _start(_gateway_main, "layers", 512, small)
    ours_small_packed = push_rate(ep, 512, small, 1 << 20, opts.seconds)
    ours_small_unpacked = push_rate(ep, 512, small, 0, opts.seconds)
    stop.set()
    proc.join(10)

    steps = {}
    for kind in ("cnn", "mlp"):
        proc, ep, stop = _start(_gateway_main, kind, 0, 0)
        steps[kind] = step_overhead(ep, kind, opts.steps, opts.blocks)
        stop.set()
        proc.join(10)

    mib = big * 4 / 1e6
    cnn_s, mlp_s = steps["cnn"], steps["mlp"]
    figures = {
        "push_mbps_4mib": round(ours_big * mib, 1),
        "raw_zmq_mbps_4mib": round(raw_big * mib, 1),
        "ratio_vs_raw_4mib": round(ours_big / raw_big, 3),
        "layers_per_s_4kib": round(ours_small_packed),
        "layers_per_s_4kib_unpacked": round(ours_small_unpacked),
        "raw_msgs_per_s_4kib": round(raw_small),
        "edge_step_ms_bare": round(cnn_s["bare_ms"], 3),
        "edge_step_ms_sink": round(cnn_s["edge_ms"], 3),
        "edge_step_overhead_ratio": round(cnn_s["edge_ms"] / cnn_s["bare_ms"], 3),
        "edge_sink_ms_per_step": round(cnn_s["sink_ms"], 3),
        "mlp_step_ms_bare": round(mlp_s["bare_ms"], 3),
        "mlp_step_ms_sink": round(mlp_s["edge_ms"], 3),
        "mlp_step_overhead_ratio": round(mlp_s["edge_ms"] / mlp_s["bare_ms"], 3),
        "mlp_sink_ms_per_step": round(mlp_s["sink_ms"], 3),
        "mlp_pushes_per_step": round(mlp_s["pushes_per_step"], 2),
    }
    print(f"{'figure':<28} {'value':>12}")
    for k, v in figures.items():
        print(f"{k:<28} {v:>12}")
    print(json.dumps(figures))


MODELS = {"cnn": cnn, "mlp": mlp}


if __name__ == "__main__":
    main()
