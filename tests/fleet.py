"""Test helpers for real fleets: edge and gateway processes (the CLI users run), a gateway in a thread.

Processes print JSON events on stdout (`status` lines, a `summary` last line);
`Proc` collects them so that tests wait on what the process says, with
deadlines, never on sleeps.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import zmq

from elasticfed.cloud.config import CloudConfig, GatewaySettings
from elasticfed.cloud.gateway import Gateway
from elasticfed.cloud.serve import build_gateway
from elasticfed.common.task import load_task

REPO = Path(__file__).resolve().parents[1]
Event = dict[str, Any]
T = TypeVar("T")


def process_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose stdout JSON events are collected as they come."""

    def __init__(self, argv: list[str], name: str, stdin: bool = False) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=process_env(),
        )
        self.events: list[Event] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        self._eof = False  # its stdout is closed and every line of it is in `events`
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_for(self, predicate: Callable[[Event], bool], timeout: float, what: str) -> Event:
        """The first event (past or future) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for event in self.events[seen:]:
                    if predicate(event):
                        return event
                seen = len(self.events)
                left = deadline - time.monotonic()
                # Ended: only once its last lines are read (they may still be in the pipe).
                if left <= 0 or (self._eof and seen == len(self.events)):
                    raise AssertionError(
                        f"{self.name}: no event with {what} within {timeout} s{self._tail()}"
                    )
                self._changed.wait(min(left, 0.1))

    def tell(self, line: str) -> None:
        """One line on the child's stdin (a Proc made with stdin=True)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read_all(self, timeout: float = 10.0) -> None:
        """After the process ended: wait until everything it printed is in `events`."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._eof, timeout):
                raise AssertionError(f"{self.name}: its output did not end within {timeout} s{self._tail()}")

    def statuses(self) -> list[Event]:
        with self._changed:
            return [e for e in self.events if e.get("event") == "status"]

    def summary(self, timeout: float) -> Event:
        """Wait for the process to end cleanly and return its last `summary` event."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name} did not finish within {timeout} s{self._tail()}") from None
        for t in self._threads:
            t.join(timeout=5)
        summaries = [e for e in self.events if e.get("event") == "summary"]
        assert code == 0 and summaries, f"{self.name} exited {code}{self._tail()}"
        return summaries[-1]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def _tail(self) -> str:
        last = "\n".join(json.dumps(e) for e in self.events[-3:])
        return f" (exit code {self.proc.poll()})\n--- last events ---\n{last}\n--- stderr ---\n" + "".join(
            self.stderr[-150:]
        )


def edge(endpoint: str, client_id: str, *flags: str) -> Proc:
    """`python -m elasticfed.edge` on the digits task, quiet; --insecure (test_security.py covers CURVE).

    Nothing is saved unless the flags give a --state-dir (tests must not share state).
    """
    argv = [
        sys.executable, "-m", "elasticfed.edge", "--gateway", endpoint, "--client-id", client_id,
        "--insecure", "--log-level", "warning", "--state-dir", "", *flags,
    ]  # fmt: skip
    return Proc(argv, client_id)


def gateway_process(port: int, *flags: str) -> Proc:
    argv = [
        sys.executable, "-m", "elasticfed.common.cli", "cloud", "serve", "--mode", "standalone",
        "--gateway-bind", f"tcp://127.0.0.1:{port}", "--insecure", "--log-level", "warning",
        "--gateway-checkpoint-dir", "", *flags,
    ]  # fmt: skip
    return Proc(argv, f"gateway:{port}")


@contextmanager
def gateway_thread(**settings: Any) -> Iterator[Gateway]:
    """The digits gateway (as `cloud serve` builds it) serving from a thread of this process."""
    config = replace(
        CloudConfig(),
        mode="standalone",
        gateway=GatewaySettings(bind="tcp://127.0.0.1:0", **settings),
    )
    with serving(build_gateway(config, load_task(config.task))) as gateway:
        yield gateway


@contextmanager
def serving(gateway: Gateway) -> Iterator[Gateway]:
    """`gateway` serving from a thread of this process until the block ends."""
    stop = threading.Event()
    thread = threading.Thread(target=gateway.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        # serve() binds in its own thread; wait until it has.
        gateway.wait_bound(10)
        yield gateway
    finally:
        stop.set()
        thread.join(10)


def applied_by_layer(gateway_status: dict[str, Any], client: str, family: str) -> dict[str, float]:
    rows = gateway_status["metrics"][family]
    prefix = f"client={client},layer="
    return {key[len(prefix) :]: value for key, value in rows.items() if key.startswith(prefix)}


def audit(gateway_status: dict[str, Any], summary: dict[str, Any]) -> None:
    """Per layer: applied once + dropped as stale == produced, and the edge was told about every drop."""
    client = summary["client"]
    applied = applied_by_layer(gateway_status, client, "gateway_applied_steps_total")
    dropped = applied_by_layer(gateway_status, client, "gateway_dropped_stale_steps_total")
    assert summary["undelivered_steps"] == 0 and summary["delivered_all"], summary
    for layer, produced in summary["produced_steps"].items():
        assert applied.get(layer, 0) + dropped.get(layer, 0) == produced, (client, layer, applied, dropped)
        assert summary["dropped_stale_steps"].get(layer, 0) == dropped.get(layer, 0)
        assert summary["delivered_steps"].get(layer, 0) == applied.get(layer, 0)


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


_pump_calls: dict[int, queue.Queue[tuple[Callable[[], Any], Future[Any]]]] = {}


def on_pump(gw: Gateway, fn: Callable[[], T]) -> T:
    """Run `fn` on the thread that serves `gw` (inside `pumped`): ZeroMQ sockets are not thread-safe,
    and a checkpoint's commit goes out on the gateway's socket."""
    done: Future[T] = Future()
    _pump_calls[id(gw)].put((fn, done))
    return done.result(timeout=30)


@contextmanager
def pumped(gw: Gateway) -> Iterator[Gateway]:
    """Serve from a thread; leaving the block is a crash: no checkpoint, no goodbye."""
    stop = threading.Event()
    deadline = time.monotonic() + 10
    while True:  # libzmq lets go of a closed socket's port asynchronously
        try:
            gw.bind()
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)

    calls: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
    _pump_calls[id(gw)] = calls

    def pump() -> None:
        while not stop.is_set():
            gw.poll_once(0.01)
            while not calls.empty():  # the gateway's socket is this thread's alone
                fn, done = calls.get()
                try:
                    done.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    done.set_exception(exc)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield gw
    finally:
        stop.set()
        thread.join(10)
        _pump_calls.pop(id(gw), None)
        assert gw.link is not None
        gw.link.close()  # no last round, no checkpoint: as when the process dies
        if gw.checkpoints is not None:
            gw.checkpoints.store.close()  # as the kernel does for a process that died
        if gw.admission is not None:
            gw.admission.close()


def train_digits(agent: Any, seconds: float, shard_index: int = 0, parts: int = 4) -> None:
    """SGD on a digits shard through `agent` (an ElasticEdge) for `seconds` of wall time."""
    from torch.utils.data import DataLoader

    from elasticfed.common.task import load_task, shard

    task = load_task("elasticfed.common.tasks.digits:task")
    opt = torch.optim.SGD(agent.parameters(), lr=0.01)
    # As the README's loop does: the gateway then moves by the edge's rate.  Unsaid, it assumes
    # the task's (0.05, five times this) and a stale backlog applied at five times the steps the
    # edge took sent the loss past the gateway's loss watch (a CI failure).
    agent.follow(opt)
    loader = DataLoader(shard(task.train_set(), shard_index, parts), batch_size=32, shuffle=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for x, y in loader:
            loss = task.loss(agent(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if time.monotonic() >= end:
                break
