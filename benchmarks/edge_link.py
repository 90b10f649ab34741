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
   The cost of security: each of these (ours 4 MiB, ours 4 KiB packed, raw
   4 MiB and 4 KiB) also runs with CURVE on, in blocks alternating with CURVE
   off (off, on, on, off, ...) over the same payloads.  Ours with CURVE is the
   deployed setup: gateway key folder, enrolled device keys, the ZAP thread and
   the per-message identity check; raw pyzmq with CURVE is libzmq's encryption
   alone (server and client keys, no ZAP handler), so the two ratios show how
   much of the cost is libzmq's CURVE and how much is ours.  `curve_ratio` is
   ours on/off for 4 MiB layers.  Every other figure (ratio_vs_raw, unpacked,
   figure 2) is CURVE off on both sides.  The gateway's per-device rate limit
   is off throughout (it would cap the 4 KiB figures).
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
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq
from torch import nn

from elasticfed.cloud.admission import CurveAdmission
from elasticfed.cloud.aggregation import DeadlineQuorum
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.common.keys import KeyFolder, KeyPair, generate, read_key_file
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.cache import GradientCache
from elasticfed.edge.session import EdgeSession, SessionOptions
from elasticfed.protocol import Manifest

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


def _gateway_main(
    kind: str,
    count: int,
    numel: int,
    keys_dir: str,
    endpoint_q: mp.Queue,  # type: ignore[type-arg]
    stop: mp.Event,  # type: ignore[valid-type]
) -> None:
    """A gateway process; with `keys_dir` (a key folder) CURVE on, enrolled devices only."""
    torch.set_num_threads(1)
    model = Layers(count, numel) if kind == "layers" else MODELS[kind]()
    # Rounds close on a 1 s deadline (a fleet's pace), never on every push.  No rate limit:
    # it is a guard against a misbehaving device and would cap the 4 KiB figures.
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        GatewayOptions(bind="tcp://127.0.0.1:0", credit=CREDIT, rate_messages_per_s=0),
        rounds=DeadlineQuorum(deadline_s=1.0, quorum=1_000_000),
        admission=CurveAdmission.from_folder(keys_dir) if keys_dir else None,
    )
    endpoint_q.put(gw.bind())
    ev = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), ev.set()), daemon=True).start()
    gw.serve(ev)


def _raw_server(curve_secret: bytes, endpoint_q: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    """Two ROUTERs answering each message with a small ack: plain, and a CURVE server (no ZAP)."""
    ctx = zmq.Context.instance()
    plain, curve = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    curve.curve_server = True
    curve.curve_secretkey = curve_secret
    curve.curve_publickey = zmq.curve_public(curve_secret)
    poller = zmq.Poller()
    endpoints = []
    for sock in (plain, curve):
        sock.setsockopt(zmq.LINGER, 0)
        endpoints.append(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
        poller.register(sock, zmq.POLLIN)
    endpoint_q.put(tuple(endpoints))
    while not stop.is_set():
        for sock, _ in poller.poll(50):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                sock.send_multipart([frames[0], frames[1].bytes[:8]])


def _spawn(target, *args) -> tuple[mp.Process, mp.Queue, mp.Event]:  # type: ignore[no-untyped-def, type-arg]
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(*args, q, stop), daemon=True)
    proc.start()
    return proc, q, stop


def _start(*jobs: tuple) -> list[tuple[mp.Process, Any, mp.Event]]:  # type: ignore[type-arg]
    """Start a process per (target, *args), all at once; each with the endpoint(s) it put."""
    started = [_spawn(*job) for job in jobs]
    return [(proc, q.get(timeout=60), stop) for proc, q, stop in started]


def _stop(*procs: tuple[mp.Process, Any, mp.Event]) -> None:  # type: ignore[type-arg]
    for _, _, stop in procs:
        stop.set()
    for proc, _, _ in procs:
        proc.join(10)


class Keys:
    """A gateway key folder in a temporary directory; `device(name)` enrols a new key pair as `name`."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="edge_link-keys-")
        self.folder = KeyFolder(self.root)
        self.gateway_public = read_key_file(self.folder.init()).public

    def device(self, name: str) -> tuple[KeyPair, bytes]:
        """`SessionOptions.curve` for a device enrolled as `name` (its client id)."""
        public, secret = generate(name, Path(self.root) / "devices")
        self.folder.enrol(name, public)
        return read_key_file(secret, need_secret=True), self.gateway_public

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def raw_rate(
    endpoint: str, payload: bytes, seconds: float, curve: tuple[bytes, bytes, bytes] | None = None
) -> tuple[float, float]:
    """(messages, seconds) with CREDIT outstanding, DEALER -> ROUTER -> ack.

    `curve`: (server public, client public, client secret) for a CURVE client.
    """
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(endpoint)
    sock.send_multipart([b"\0" * 8, b"warm-up"])  # connected (and the handshake done) before the clock
    sock.recv_multipart()
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
    return done, time.perf_counter() - start


class _Cache(GradientCache):
    """New buffers hold a gradient (ones), not stale memory: the benchmark re-arms units without adding.

    A real edge copies each step's gradient into a new buffer; here the fill is that pass.
    """

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.ones(numel, dtype=dtype)


class Pusher:
    """Our session and cache against one gateway; `run` measures, as often as asked, over one session.

    `client_id` must be new to the gateway (a known one would start again at seq 1, below
    the gateway's resolved_below for it: its pushes would be answered as duplicates, not applied).
    """

    def __init__(
        self,
        endpoint: str,
        count: int,
        numel: int,
        pack_bytes: int,
        client_id: str,
        curve: tuple[KeyPair, bytes] | None = None,
    ) -> None:
        model = Layers(count, numel)
        named = [(n, p) for n, p in reversed(list(model.named_parameters()))]
        manifest = Manifest.from_parameters(model.named_parameters())
        self.units: list[list[int]] = []
        for i in range(len(named)):
            if self.units and (len(self.units[-1]) + 1) * numel * 4 <= pack_bytes:
                self.units[-1].append(i)
            else:
                self.units.append([i])
        self.cache = _Cache([[(named[i][0], (numel,), torch.float32) for i in u] for u in self.units])
        self.client_id = client_id
        self.session = EdgeSession(
            SessionOptions(gateway=endpoint, client_id=client_id, timeout_s=5.0, curve=curve),
            manifest,
            self.cache,
        )
        self.session.start()
        grads = [torch.ones(numel) for _ in range(count)]
        for u, unit in enumerate(self.units):
            self.cache.add(u, [grads[i] for i in unit], 0)
        deadline = time.perf_counter() + 10
        while not self.session.welcomed and time.perf_counter() < deadline:
            time.sleep(0.01)
        if not self.session.welcomed:
            self.session.close(drain_s=0)
            raise RuntimeError(f"{client_id}: no welcome from {endpoint} in 10 s")

    def accepted(self) -> float:
        """Layers the gateway accepted so far (a push of a packed unit counts each of its layers)."""
        m = self.session.metrics
        return m.strong.total() + m.late.total()

    def run(self, seconds: float, block: int = 0) -> tuple[float, float]:
        """(layers accepted, seconds), the producer adding as fast as it can; then drains, untimed."""
        cache, session = self.cache, self.session
        before = self.accepted()
        start = time.perf_counter()
        end = start + seconds
        # A window that closed before the first answer would report a rate of zero (a quick run on
        # a loaded machine: 0.5 s, not one 4 MiB push answered): the window lasts until one is.
        while time.perf_counter() < end or (self.accepted() == before and time.perf_counter() < start + 60):
            # Re-arm every sent unit as one more step with the same bytes (no copy: see the
            # docstring), computed on the newest model this edge holds (else, once the gateway
            # is max_staleness rounds on, every push would be dropped as stale).
            with cache.lock:
                for state in cache.units:
                    if state.pending_count == 0:
                        state.pending_count = 1
                        state.pending_base = session.have_version
            session.request_sync(range(len(self.units)))
            time.sleep(0.0002)
        elapsed = time.perf_counter() - start
        done = self.accepted() - before
        # Untimed: what is armed goes and is answered, so the next block starts on a quiet link.
        deadline = time.perf_counter() + 10
        while cache.undelivered() and time.perf_counter() < deadline:
            time.sleep(0.005)
        session.raise_if_failed()
        return done, elapsed

    def close(self) -> None:
        rejected = self.session.metrics.rejected.total()
        self.session.close(drain_s=0)
        if rejected:
            print(f"warning: {self.client_id}: the gateway refused {rejected:.0f} pushes", file=sys.stderr)


def alternate(
    off: Callable[[float, int], tuple[float, float]],
    on: Callable[[float, int], tuple[float, float]],
    seconds: float,
    blocks: int = 2,
) -> tuple[float, float]:
    """Rates (per second) of CURVE off and on, `seconds` each, in `blocks` blocks: off on, on off, ...

    First a short warm-up of each, not counted (a fresh gateway's first pushes fault in its
    accumulators).  `measure(seconds, block)` returns (done, elapsed); the warm-up's block is -1.
    """
    for measure in (off, on):
        measure(min(0.25, seconds / blocks), -1)
    totals = {off: [0.0, 0.0], on: [0.0, 0.0]}
    for b in range(blocks):
        for measure in (off, on) if b % 2 == 0 else (on, off):
            done, elapsed = measure(seconds / blocks, b)
            totals[measure][0] += done
            totals[measure][1] += elapsed
    return totals[off][0] / totals[off][1], totals[on][0] / totals[on][1]


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
    parser.add_argument(
        "--seconds", type=float, default=4.0, help="per throughput measurement (CURVE on and off: each)"
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per timing block")
    parser.add_argument("--blocks", type=int, default=6, help="alternating bare/edge blocks")
    opts = parser.parse_args()
    torch.set_num_threads(1)

    big, small = 1 << 20, 1024  # 4 MiB and 4 KiB of fp32
    keys = Keys()
    try:
        # Raw pyzmq, CURVE off and on (libzmq's encryption alone: no ZAP handler).
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        client_keys = (server_public, client_public, client_secret)
        [raw] = _start((_raw_server, server_secret))
        plain_ep, curve_ep = raw[1]
        raw_rates: dict[str, tuple[float, float]] = {}
        ours: dict[str, tuple[float, float]] = {}
        for name, numel in (("big", big), ("small", small)):
            payload = b"\0" * (numel * 4)
            raw_rates[name] = alternate(
                lambda s, b, p=payload: raw_rate(plain_ep, p, s),
                lambda s, b, p=payload: raw_rate(curve_ep, p, s, client_keys),
                opts.seconds,
            )
        _stop(raw)

        # Ours: a gateway process with CURVE off and one with CURVE on, per layer size; one
        # session each (the CURVE one enrolled under its client id), warmed up, then alternating.
        for count, numel, pack, tag in ((16, big, 0, "4mib"), (512, small, 1 << 20, "4kib")):
            off, on = _start(
                (_gateway_main, "layers", count, numel, ""),
                (_gateway_main, "layers", count, numel, keys.root),
            )
            cid = f"bench-{tag}"
            plain = Pusher(off[1], count, numel, pack, cid)
            secure = Pusher(on[1], count, numel, pack, cid, keys.device(cid))
            ours[tag] = alternate(plain.run, secure.run, opts.seconds)
            plain.close()
            secure.close()
            if tag == "4kib":  # and unpacked: a push per 4 KiB layer (CURVE off)
                unpacked = Pusher(off[1], count, numel, 0, f"{cid}-unpacked")
                unpacked.run(min(0.25, opts.seconds))  # warm-up, as in alternate()
                done, elapsed = unpacked.run(opts.seconds)
                ours_small_unpacked = done / elapsed
                unpacked.close()
            _stop(off, on)
    finally:
        keys.remove()

    steps = {}
    for kind in ("cnn", "mlp"):
        [proc] = _start((_gateway_main, kind, 0, 0, ""))
        steps[kind] = step_overhead(proc[1], kind, opts.steps, opts.blocks)
        _stop(proc)

    mib = big * 4 / 1e6
    raw_big, raw_big_curve = raw_rates["big"]
    raw_small, raw_small_curve = raw_rates["small"]
    ours_big, ours_big_curve = ours["4mib"]
    ours_small_packed, ours_small_curve = ours["4kib"]
    cnn_s, mlp_s = steps["cnn"], steps["mlp"]
    figures = {
        "push_mbps_4mib": round(ours_big * mib, 1),
        "raw_zmq_mbps_4mib": round(raw_big * mib, 1),
        "ratio_vs_raw_4mib": round(ours_big / raw_big, 3),
        "layers_per_s_4kib": round(ours_small_packed),
        "layers_per_s_4kib_unpacked": round(ours_small_unpacked),
        "raw_msgs_per_s_4kib": round(raw_small),
        # CURVE on (ours: enrolled keys, ZAP, identity check; raw: libzmq's CURVE alone).
        "push_mbps_4mib_curve": round(ours_big_curve * mib, 1),
        "curve_ratio": round(ours_big_curve / ours_big, 3),
        "layers_per_s_4kib_curve": round(ours_small_curve),
        "curve_ratio_small": round(ours_small_curve / ours_small_packed, 3),
        "raw_zmq_mbps_4mib_curve": round(raw_big_curve * mib, 1),
        "raw_curve_ratio": round(raw_big_curve / raw_big, 3),
        "raw_msgs_per_s_4kib_curve": round(raw_small_curve),
        "raw_curve_ratio_small": round(raw_small_curve / raw_small, 3),
        "ratio_vs_raw_4mib_curve": round(ours_big_curve / raw_big_curve, 3),
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
    f = figures
    print(
        f"CURVE on/off: ours x{f['curve_ratio']} (4 MiB, {f['push_mbps_4mib_curve']} vs "
        f"{f['push_mbps_4mib']} MB/s), x{f['curve_ratio_small']} (4 KiB packed, "
        f"{f['layers_per_s_4kib_curve']} vs {f['layers_per_s_4kib']} layers/s); raw pyzmq "
        f"x{f['raw_curve_ratio']} (4 MiB, {f['raw_zmq_mbps_4mib_curve']} vs {f['raw_zmq_mbps_4mib']} MB/s), "
        f"x{f['raw_curve_ratio_small']} (4 KiB, {f['raw_msgs_per_s_4kib_curve']} vs "
        f"{f['raw_msgs_per_s_4kib']} msgs/s)"
    )
    print(json.dumps(figures))


MODELS = {"cnn": cnn, "mlp": mlp}


if __name__ == "__main__":
    main()
