"""Synchronous FedAvg over real links: the reference `benchmarks/wan.py` compares elasticfed against.

Plain FedAvg (McMahan et al.), nothing more: each round the server sends the
global model (every tensor of its state dict, full precision) to every client;
each client loads it, trains `local_steps` SGD steps (the task's learning rate,
momentum and batch size, a fresh optimizer per round) on its shard and sends
its whole model back; the server waits for all of them, averages weighted by
samples, and starts the next round.  A slow or lossy link stalls the whole
round: that is the point of measuring it on the same capped links.

Transport: pyzmq over TCP with ZeroMQ's defaults (a ROUTER on the server, a
DEALER per client; TCP retransmits, ZeroMQ reconnects), as a user writing
FedAvg on ZeroMQ would have it.  Every message is a msgpack header and one
raw frame per tensor (no pickle).

The server is a class `benchmarks/wan.py` runs in its own process (root
namespace); a client is `python benchmarks/fedavg_wan.py client ...`, started
inside an edge's network namespace.  The server keeps each round's averaged
model with its time, and the caller evaluates them afterwards, so evaluation
never takes CPU from training.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python benchmarks/fedavg_wan.py` from a checkout
    sys.path.insert(0, str(REPO))

from elasticfed.common.task import Task, load_task, shard  # noqa: E402

VERSION = 1
State = dict[str, torch.Tensor]
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16,
                                                     torch.bfloat16, torch.int64, torch.int32, torch.uint8,
                                                     torch.bool)}  # fmt: skip


# ------------------------------------------------------------------------------ messages
def encode(kind: str, state: State | None = None, **fields: Any) -> list[Any]:
    """A msgpack header naming every tensor, then each tensor's bytes as its own frame (zero-copy)."""
    tensors = []
    frames: list[Any] = []
    for name, t in (state or {}).items():
        t = t.detach().contiguous()
        tensors.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        frames.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    header = {"v": VERSION, "kind": kind, "tensors": tensors, **fields}
    return [msgpack.packb(header), *frames]


def decode(frames: list[Any]) -> tuple[dict[str, Any], State]:
    """The header and the tensors, copied out of the frames (the frames may then go)."""
    header = msgpack.unpackb(bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]))
    if header.get("v") != VERSION:
        raise ValueError(f"fedavg message version {header.get('v')!r}, expected {VERSION}")
    specs = header.get("tensors", [])
    if len(specs) != len(frames) - 1:
        raise ValueError(f"{len(specs)} tensors named, {len(frames) - 1} frames")
    state: State = {}
    for (name, dtype, shape), frame in zip(specs, frames[1:]):
        raw = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        state[name] = flat.view(_DTYPES[dtype]).reshape(shape)
    return header, state


def frames_bytes(frames: list[Any]) -> int:
    return sum(len(f.buffer) if hasattr(f, "buffer") else len(f) for f in frames)


# ------------------------------------------------------------------------------ server
@dataclass
class RoundPoint:
    """The global model after `round` rounds, `seconds` after the clock started."""

    seconds: float
    round: int
    state: State


@dataclass
class FedAvgServer:
    """The server's whole loop: wait for every client, then rounds until the budget is spent."""

    bind: str  # e.g. tcp://10.213.0.1 (a random port is taken)
    clients: int
    model: torch.nn.Module
    sock: zmq.Socket = field(init=False)
    endpoint: str = field(init=False)
    ctx: zmq.Context = field(init=False)
    hello_at: float | None = field(default=None, init=False)
    sent_bytes: int = field(default=0, init=False)
    received_bytes: int = field(default=0, init=False)
    incomplete_round: int = field(default=0, init=False)  # the round the budget cut short (0: none)

    def __post_init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(self.bind)
        self.endpoint = f"{self.bind}:{port}"

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def _recv(self, deadline: float) -> tuple[bytes, dict[str, Any], State] | None:
        left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        if not self.sock.poll(min(left_ms, 200) + 1):
            return None
        frames = self.sock.recv_multipart(copy=False)
        self.received_bytes += frames_bytes(frames[1:])
        header, state = decode(frames[1:])
        return bytes(frames[0].buffer), header, state

    def wait_for_clients(self, limit_s: float) -> dict[bytes, int]:
        """Every client's routing id and sample count; `hello_at` is when the first one was ready."""
        found: dict[bytes, int] = {}
        deadline = time.monotonic() + limit_s
        while len(found) < self.clients and time.monotonic() < deadline:
            got = self._recv(deadline)
            if got is None:
                continue
            route, header, _ = got
            if header["kind"] == "hello":
                if self.hello_at is None:
                    self.hello_at = time.monotonic()
                found[route] = int(header["samples"])
        return found

    def run(self, budget_s: float, start_limit_s: float) -> list[RoundPoint]:
        """Rounds until `budget_s` after the first client was ready; the points, round 0 first."""
        members = self.wait_for_clients(start_limit_s)
        if len(members) < self.clients:
            raise RuntimeError(f"only {len(members)} of {self.clients} FedAvg clients said hello")
        assert self.hello_at is not None
        t0 = self.hello_at
        end = t0 + budget_s
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        points = [RoundPoint(0.0, 0, state)]
        r = 0
        while time.monotonic() < end:
            r += 1
            out = encode("model", state, round=r)
            size = frames_bytes(out)
            for route in members:
                self.sock.send_multipart([route, *out], copy=False)
                self.sent_bytes += size
            updates: dict[bytes, State] = {}
            while len(updates) < len(members) and time.monotonic() < end:
                got = self._recv(end)
                if got is None:
                    continue
                route, header, update = got
                if header["kind"] == "update" and header["round"] == r and route in members:
                    updates[route] = update
            if len(updates) < len(members):
                self.incomplete_round = r  # the budget ran out while waiting for the slowest
                break
            total = sum(members.values())
            state = {
                name: sum(
                    (updates[route][name].double() * (n / total) for route, n in members.items()),
                    torch.zeros((), dtype=torch.float64),
                ).to(state[name].dtype)
                for name in state
            }
            points.append(RoundPoint(time.monotonic() - t0, r, state))
        for route in members:
            self.sock.send_multipart([route, *encode("stop")])
        return points


# ------------------------------------------------------------------------------ client
def _batches(task: Task, data: Any, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The shard's batches for ever, reshuffled each epoch (a client's data is its own)."""
    loader = torch.utils.data.DataLoader(
        data, batch_size=task.batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed + 17)
    )
    while True:
        yield from loader


def client_main(args: argparse.Namespace) -> int:
    """Say hello, then: receive the model, train `local_steps` steps, send it back, until told to stop.

    SIGTERM (the budget is over) ends it at the next step, with its summary line.
    """
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    torch.manual_seed(args.seed)
    task = load_task(args.task)
    data = shard(task.train_set(), args.index, args.clients, "iid", seed=args.seed)
    batches = _batches(task, data, args.seed)
    # The same device an elasticfed edge's `--train-device auto` picks: the GPU where there is one.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = task.build_model().to(device)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(args.server)
    sock.send_multipart(encode("hello", samples=len(data), client=args.index))  # type: ignore[arg-type]
    print(json.dumps({"event": "ready", "client": args.index, "samples": len(data)}), flush=True)
    rounds = steps = 0
    sent = received = 0
    train_s = wait_s = 0.0
    began = time.monotonic()
    while not stopping.is_set():
        t = time.monotonic()
        while not stopping.is_set() and not sock.poll(200):
            pass
        if stopping.is_set():
            break
        frames = sock.recv_multipart(copy=False)
        wait_s += time.monotonic() - t
        received += frames_bytes(frames)
        header, state = decode(frames)
        if header["kind"] == "stop":
            break
        t = time.monotonic()
        model.load_state_dict(state)
        opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum)
        for _ in range(args.local_steps):
            if stopping.is_set():  # the budget is over: this round's model would never be averaged
                break
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = task.loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        train_s += time.monotonic() - t
        if stopping.is_set():
            break
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        out = encode("update", state, round=header["round"], samples=len(data))
        sent += frames_bytes(out)
        sock.send_multipart(out, copy=False)
        rounds += 1
    summary = {
        "event": "summary", "client": args.index, "rounds": rounds, "steps": steps,
        "sent_bytes": sent, "received_bytes": received, "train_s": round(train_s, 2),
        "wait_s": round(wait_s, 2), "seconds": round(time.monotonic() - began, 2),
    }  # fmt: skip
    print(json.dumps(summary), flush=True)
    sock.close(linger=0)
    ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A synchronous FedAvg client (benchmarks/wan.py starts it).")
    sub = parser.add_subparsers(dest="command", required=True)
    client = sub.add_parser("client")
    client.add_argument("--server", required=True)
    client.add_argument("--index", type=int, required=True)
    client.add_argument("--clients", type=int, required=True)
    client.add_argument("--task", required=True)
    client.add_argument("--local-steps", type=int, default=20)
    client.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return client_main(args)


if __name__ == "__main__":
    sys.exit(main())
