"""`elasticfed linksim`: a link simulator put between real edge agents and a real gateway.

Edges connect to `--listen` instead of the gateway; linksim forwards to `--upstream`
and makes the link in between lossy, slow, bursty or down, seeded so runs repeat.
Two layers, because of what each can see:

- `--layer zmq` (default) is a message proxy. A ROUTER takes the edges; each edge
  (ROUTER routing id) gets its own DEALER to the gateway, with the same routing id,
  so the gateway sees one peer per edge, and replies go back to that edge. Each edge
  gets its own simulated link, and each direction of it is a bottleneck (`rate_kbit`,
  a token bucket on message bytes, and a `queue_kib` buffer beyond which messages are
  tail-dropped as a router's buffer drops them) followed by `common.link.FaultyChannel`
  with the edge's `--faults` spec: loss (Gilbert-Elliott bursts), delay and jitter,
  duplication, reordering, outages (a message in an outage is lost, as with the
  edge's in-process faults). The faults of an edge are seeded from `seed` and its
  routing id, so the same edges see the same fates in a rerun.
- `--layer tcp` is a byte-stream TCP proxy. It never parses ZMTP, so it works with
  any security mechanism, CURVE included. It delays bytes (jitter never reorders
  them), caps the bandwidth, and holds bytes during an outage (a blackhole; with
  `outage_mode=reset` it resets every connection instead). It refuses loss,
  duplication and reordering: dropping or repeating bytes inside a TCP stream would
  corrupt it, not simulate a lossy network.

With CURVE: a ZMQ-level proxy has to terminate the ZMTP connection, so it would
have to hold a CURVE key of its own, and the gateway would then authenticate the
proxy, not the device, which breaks per-device identity and the allow-list. So
linksim does not do that: the zmq layer is for NULL-security links (`--insecure`,
tests, demos), and an edge that tries CURVE through it fails its handshake (counted
and logged). With CURVE use the tcp layer (delay, jitter, rate, outages), and for
packet loss use the kernel (network namespaces and nftables, see tests/netns.py),
which loses packets below TCP, where TCP's retransmission turns loss into delay
just as on a real link.

Like the other roles it prints a JSON `ready` line (with the bound endpoint),
JSON `status` lines with `--status-every-s`, and on SIGTERM/SIGINT a JSON
`summary` as its last line: per direction (`up`: edge to gateway, `down`: back)
messages and bytes in and out, lost, duplicated, reordered, queue-dropped and held
in an outage. In the tcp layer a "message" is one read from a socket.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from elasticfed.common.config import setting
from elasticfed.common.exits import EXIT_USAGE
from elasticfed.common.link import ChannelStats, Faults, FaultyChannel, TokenBucket
from elasticfed.common.shared_settings import faults_spec, log_level_setting

log = logging.getLogger("elasticfed.linksim")

_ENDPOINT = re.compile(r"^tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_READ = 65536  # bytes per read in the tcp layer
_BURST_PER_POLL = 256  # messages taken from one socket before the others get a turn


def _endpoint(value: str, *, bind: bool) -> str | None:
    match = _ENDPOINT.match(value)
    if not match or int(match.group(2)) > 65535:
        return "must be a TCP endpoint like 'tcp://host:7878'"
    if not bind and (match.group(1) == "*" or int(match.group(2)) == 0):
        return "must name a host and a port to connect to, like 'tcp://gateway:7878'"
    return None


def listen_endpoint(value: str) -> str | None:
    """Where linksim listens: `tcp://HOST:PORT`, `*` for every interface, port 0 for any free port."""
    return _endpoint(value, bind=True)


def upstream_endpoint(value: str) -> str | None:
    """The gateway to forward to (empty is refused when the command runs, not at load)."""
    return None if value == "" else _endpoint(value, bind=False)


@dataclass(frozen=True)
class LinksimConfig:
    layer: str = setting(
        "zmq",
        "zmq: message proxy, per-edge faults (NULL security only); tcp: byte-stream proxy, "
        "any security incl. CURVE (delay, jitter, rate, outages; no loss)",
        choices=("zmq", "tcp"),
    )
    listen: str = setting(
        "tcp://*:7879",
        "endpoint edges connect to (port 0: a free port, see the ready line)",
        check=listen_endpoint,
    )
    upstream: str = setting(
        "",
        "the gateway's endpoint to forward to, e.g. tcp://127.0.0.1:7878 (required)",
        check=upstream_endpoint,
    )
    faults: str = setting(
        "",
        "faults of each edge's link, each direction, as the edge's --faults: "
        "'loss=0.3,burst=3,delay_ms=5,jitter_ms=2,duplicate=0.01,reorder=0.05,outage=10+5,seed=1' "
        "(outages count from linksim's start; tcp layer: delay, jitter and outages only)",
        check=faults_spec,
    )
    rate_kbit: float = setting(0.0, "bandwidth cap of each direction of a link, kbit/s (0: none)", min=0.0)
    burst_kib: float = setting(
        16.0, "bytes the capped link passes back to back (token bucket depth)", min=0.125
    )
    queue_kib: float = setting(
        1024.0,
        "bytes waiting for the cap, per direction and link, beyond which messages are tail-dropped "
        "(zmq) or reading stops (tcp)",
        min=1.0,
    )
    outage_mode: str = setting(
        "hold",
        "tcp layer, during an outage: hold the bytes (a blackhole) or reset every connection "
        "(the zmq layer loses messages in an outage)",
        choices=("hold", "reset"),
    )
    idle_close_s: float = setting(
        60.0, "zmq layer: close an edge's upstream socket after this long without traffic", min=0.1
    )
    status_every_s: float = setting(0.0, "print a JSON status line this often (0: only the summary)", min=0.0)
    log_level: str = log_level_setting()


class UsageError(ValueError):
    """A setting, or a combination of settings, that cannot work; the text names the flag."""


def check_config(config: LinksimConfig) -> Faults:
    """The faults to apply, or a UsageError naming what is wrong with the settings together."""
    if not config.upstream:
        raise UsageError(
            "--upstream is required: the gateway endpoint to forward to, e.g. tcp://127.0.0.1:7878"
        )
    faults = Faults.parse(config.faults)
    if config.layer == "tcp":
        refused = [name for name in ("loss", "duplicate", "reorder") if getattr(faults, name)]
        if refused:
            raise UsageError(
                f"--faults: {', '.join(refused)} cannot be simulated with --layer tcp: dropping, repeating "
                "or reordering bytes inside a TCP stream would corrupt it, not make the link lossy. For "
                "packet loss under TCP (works with CURVE) use the kernel: network namespaces and nftables "
                "(see tests/netns.py); for message loss on NULL-security links use --layer zmq"
            )
    elif config.outage_mode == "reset":
        raise UsageError(
            "--outage-mode reset applies to --layer tcp; in the zmq layer a message in an outage is lost"
        )
    return faults


# ---------------------------------------------------------------- counters


@dataclass
class DirectionStats:
    """What one direction (all links together) did; `pending` is what it still holds."""

    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0
    lost: int = 0
    lost_in_outage: int = 0
    duplicated: int = 0
    reordered: int = 0
    queue_dropped: int = 0
    queue_dropped_bytes: int = 0
    send_failed: int = 0
    held_in_outage: int = 0
    held_in_outage_bytes: int = 0
    pending: int = 0

    def plus(self, channel: ChannelStats) -> DirectionStats:
        """These counts with one FaultyChannel's fates added (the channel keeps its own)."""
        return dataclasses.replace(
            self,
            lost=self.lost + channel.lost,
            lost_in_outage=self.lost_in_outage + channel.lost_in_outage,
            duplicated=self.duplicated + channel.duplicated,
            reordered=self.reordered + channel.reordered,
        )


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


# ---------------------------------------------------------------- zmq layer

Frames = list[Any]  # zmq.Frame objects, never modified, so they may be sent twice
Item = tuple[bytes, Frames, int]  # routing id, message frames, message bytes


class SimLink:
    """One direction of one edge's link: a bottleneck (rate, tail-drop buffer), then the faults."""

    def __init__(
        self, faults: Faults, stream: int, start: float, config: LinksimConfig, stats: DirectionStats
    ) -> None:
        self.channel: FaultyChannel[Item] = FaultyChannel(faults, stream, start, copy=lambda item: item)
        rate = config.rate_kbit * 1000 / 8
        self.bucket = TokenBucket(rate, config.burst_kib * 1024, start) if rate else None
        self.capacity = config.queue_kib * 1024
        self.queue: deque[Item] = deque()
        self.queued = 0
        self.stats = stats

    def offer(self, item: Item, now: float) -> None:
        self.stats.messages_in += 1
        self.stats.bytes_in += item[2]
        if self.bucket is None:
            self.channel.offer(item, now)
        elif self.queue and self.queued + item[2] > self.capacity:
            # A router's buffer: the newest arrival is dropped (an empty buffer takes any one message).
            self.stats.queue_dropped += 1
            self.stats.queue_dropped_bytes += item[2]
        else:
            self.queue.append(item)
            self.queued += item[2]

    def release(self, now: float) -> list[Item]:
        """Messages that leave the link now."""
        bucket = self.bucket
        while self.queue and bucket is not None and bucket.ready_at(self.queue[0][2], now) <= now:
            item = self.queue.popleft()
            self.queued -= item[2]
            bucket.take(item[2], now)
            self.channel.offer(item, now)
        return self.channel.due(now)

    def next_event(self, now: float) -> float:
        due = self.channel.next_due()
        if self.queue and self.bucket is not None:
            due = min(due, self.bucket.ready_at(self.queue[0][2], now))
        return due

    def __len__(self) -> int:
        return len(self.queue) + len(self.channel)


@dataclass
class _Peer:
    routing_id: bytes
    dealer: zmq.Socket
    last_active: float


class ZmqProxy:
    """The zmq layer: one ROUTER for the edges, one DEALER per edge to the gateway."""

    def __init__(self, config: LinksimConfig, faults: Faults, ctx: zmq.Context) -> None:
        self.config = config
        self.faults = faults
        self.ctx = ctx
        self.start = time.monotonic()
        self.up = DirectionStats()
        self.down = DirectionStats()
        self.links: dict[bytes, tuple[SimLink, SimLink]] = {}
        self.peers: dict[bytes, _Peer] = {}
        self.by_socket: dict[zmq.Socket, _Peer] = {}
        self.opened = 0
        self.idle_closed = 0
        self.handshake_failures = 0
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished edge is counted
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an edge that reconnects keeps its routing id
        self.router.setsockopt(zmq.IPV6, int("[" in config.listen))
        self.monitor = self.router.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def bind(self) -> str:
        try:
            self.router.bind(self.config.listen)
        except zmq.ZMQError as exc:
            raise UsageError(f"--listen {self.config.listen}: cannot listen there ({exc})") from None
        return self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _link(self, routing_id: bytes) -> tuple[SimLink, SimLink]:
        link = self.links.get(routing_id)
        if link is None:
            # Seeded per edge from its routing id: an edge that keeps its id sees the same fates in a rerun.
            stream = 2 * zlib.crc32(routing_id)
            link = (
                SimLink(self.faults, stream, self.start, self.config, self.up),
                SimLink(self.faults, stream + 1, self.start, self.config, self.down),
            )
            self.links[routing_id] = link
        return link

    def _peer(self, routing_id: bytes, now: float) -> _Peer:
        peer = self.peers.get(routing_id)
        if peer is None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IPV6, int("[" in self.config.upstream))
            if routing_id[:1] != b"\x00":  # ids zmq made up start with a zero byte and cannot be set
                dealer.setsockopt(zmq.ROUTING_ID, routing_id)
            dealer.connect(self.config.upstream)
            peer = _Peer(routing_id, dealer, now)
            self.peers[routing_id] = peer
            self.by_socket[dealer] = peer
            self.poller.register(dealer, zmq.POLLIN)
            self.opened += 1
        return peer

    def _close(self, peer: _Peer) -> None:
        self.poller.unregister(peer.dealer)
        del self.by_socket[peer.dealer]
        del self.peers[peer.routing_id]
        peer.dealer.close(linger=0)

    def _receive(self, sock: zmq.Socket, now: float) -> None:
        for _ in range(_BURST_PER_POLL):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if sock is self.router:
                routing_id, body = frames[0].bytes, frames[1:]
                peer = self._peer(routing_id, now)
                self._link(routing_id)[0].offer((routing_id, body, _size(body)), now)
            else:
                peer = self.by_socket[sock]
                self._link(peer.routing_id)[1].offer((peer.routing_id, frames, _size(frames)), now)
            peer.last_active = now

    def _handshake_failed(self) -> None:
        while True:
            try:
                self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handshake_failures += 1
            if self.handshake_failures == 1:
                log.error(
                    "an edge failed the ZMTP handshake: the zmq layer speaks NULL security only, "
                    "so an edge with CURVE cannot pass through it; use --layer tcp with CURVE"
                )

    def _send(self, now: float) -> float:
        """Send what is due; the time of the next thing that will be."""
        wake = math.inf
        for link_up, link_down in self.links.values():
            for routing_id, frames, size in link_up.release(now):
                try:
                    self._peer(routing_id, now).dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.ZMQError:
                    self.up.send_failed += 1
                    continue
                self.up.messages_out += 1
                self.up.bytes_out += size
            for routing_id, frames, size in link_down.release(now):
                try:
                    self.router.send_multipart([routing_id, *frames], flags=zmq.NOBLOCK, copy=False)
                except zmq.ZMQError:  # the edge is gone (EHOSTUNREACH) or not reading (EAGAIN)
                    self.down.send_failed += 1
                    continue
                self.down.messages_out += 1
                self.down.bytes_out += size
            wake = min(wake, link_up.next_event(now), link_down.next_event(now))
        return wake

    def _sweep(self, now: float) -> None:
        for peer in list(self.peers.values()):
            if now - peer.last_active > self.config.idle_close_s:
                up, down = self.links[peer.routing_id]
                if not up and not down:
                    self._close(peer)
                    self.idle_closed += 1

    def report(self) -> dict[str, Any]:
        up, down = self.up, self.down
        for link_up, link_down in self.links.values():
            up = up.plus(link_up.channel.stats)
            down = down.plus(link_down.channel.stats)
        up = dataclasses.replace(up, pending=sum(len(link[0]) for link in self.links.values()))
        down = dataclasses.replace(down, pending=sum(len(link[1]) for link in self.links.values()))
        return {
            "layer": "zmq",
            "edges": len(self.links),
            "upstream_sockets": len(self.peers),
            "upstream_opened": self.opened,
            "upstream_idle_closed": self.idle_closed,
            "handshake_failures": self.handshake_failures,
            "up": dataclasses.asdict(up),
            "down": dataclasses.asdict(down),
        }

    def serve(self, stop: threading.Event, status: Callable[[], None] | None, every_s: float) -> None:
        next_status = time.monotonic() + every_s if status and every_s else math.inf
        next_sweep = time.monotonic() + min(1.0, self.config.idle_close_s)
        wake = math.inf
        while not stop.is_set():
            now = time.monotonic()
            until = min(wake, next_status, next_sweep, now + 0.1) - now
            events = self.poller.poll(max(0, math.ceil(until * 1000)))
            now = time.monotonic()
            for sock, _ in events:
                if sock is self.monitor:
                    self._handshake_failed()
                else:
                    self._receive(sock, now)
            wake = self._send(now)
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + min(1.0, self.config.idle_close_s)
            if now >= next_status and status is not None:
                status()
                next_status = now + every_s

    def close(self) -> None:
        for peer in list(self.peers.values()):
            self._close(peer)
        self.router.disable_monitor()
        self.monitor.close(linger=0)
        self.router.close(linger=0)


def _size(frames: Frames) -> int:
    return sum(len(frame) for frame in frames)


# ---------------------------------------------------------------- tcp layer


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host == "*":
        host = "0.0.0.0"
    return host.strip("[]"), int(port)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), as a middlebox that gave up on the connection would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


class _Pump:
    """One direction of one TCP connection: read, delay (order kept), hold in outages, cap, write."""

    def __init__(
        self,
        proxy: TcpProxy,
        stats: DirectionStats,
        stream: int,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
    ) -> None:
        self.proxy = proxy
        self.stats = stats
        self.rng = random.Random(proxy.faults.seed * 1_000_003 + stream)
        self.src = src
        self.dst = dst
        config = proxy.config
        rate = config.rate_kbit * 1000 / 8
        self.bucket = TokenBucket(rate, config.burst_kib * 1024, time.monotonic()) if rate else None
        self.piece = max(1024, int(config.burst_kib * 1024))
        self.capacity = config.queue_kib * 1024
        self.items: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.last_due = 0.0
        self.has_items = asyncio.Event()
        self.has_space = asyncio.Event()

    def _delay(self) -> float:
        faults = self.proxy.faults
        delay = faults.delay_ms
        if faults.jitter_ms:
            delay = max(0.0, self.rng.gauss(delay, faults.jitter_ms))
        return delay / 1000.0

    async def read(self) -> None:
        while True:
            while self.queued >= self.capacity:  # backpressure: TCP's flow control slows the sender
                self.has_space.clear()
                await self.has_space.wait()
            data = await self.src.read(_READ)
            now = time.monotonic()
            if data:
                self.stats.messages_in += 1
                self.stats.bytes_in += len(data)
            # Order is kept: a byte never overtakes an earlier one, whatever the jitter drew.
            self.last_due = max(self.last_due, now + self._delay())
            self.items.append((self.last_due, data))
            self.queued += len(data)
            self.has_items.set()
            if not data:
                return

    async def write(self) -> None:
        while True:
            while not self.items:
                self.has_items.clear()
                await self.has_items.wait()
            due, data = self.items[0]
            await _sleep_until(due)
            if not data:
                if self.dst.can_write_eof():
                    self.dst.write_eof()
                return
            held = False
            for start in range(0, len(data), self.piece):
                piece = data[start : start + self.piece]
                while (end := self.proxy.outage_end(time.monotonic())) is not None:
                    if not held:
                        held = True
                        self.stats.held_in_outage += 1
                        self.stats.held_in_outage_bytes += len(data)
                    await _sleep_until(end)
                if self.bucket is not None:
                    await _sleep_until(self.bucket.ready_at(len(piece), time.monotonic()))
                    self.bucket.take(len(piece), time.monotonic())
                self.dst.write(piece)
                await self.dst.drain()
            self.items.popleft()
            self.queued -= len(data)
            self.has_space.set()
            self.stats.messages_out += 1
            self.stats.bytes_out += len(data)


class TcpProxy:
    """The tcp layer: each accepted connection gets its own connection upstream and two pumps."""

    def __init__(self, config: LinksimConfig, faults: Faults) -> None:
        self.config = config
        self.faults = faults
        self.start = time.monotonic()
        self.up = DirectionStats()
        self.down = DirectionStats()
        self.connections = 0
        self.open: set[tuple[asyncio.StreamWriter, ...]] = set()
        self.connect_failed = 0
        self.resets = 0
        self.server: asyncio.AbstractServer | None = None
        self.pumps: list[_Pump] = []

    def outage_end(self, now: float) -> float | None:
        """The end of the outage `now` is in (back-to-back outages joined), or None."""
        t, end = now - self.start, None
        moved = True
        while moved:
            moved = False
            for start, length in self.faults.outages:
                if start <= t < start + length:
                    t, end, moved = start + length, start + length, True
        return None if end is None else self.start + end

    async def bind(self) -> str:
        host, port = _host_port(self.config.listen)
        try:
            self.server = await asyncio.start_server(self._accept, host, port)
        except OSError as exc:
            raise UsageError(f"--listen {self.config.listen}: cannot listen there ({exc})") from None
        bound = self.server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        return f"tcp://{shown}:{bound[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        end = self.outage_end(time.monotonic())
        if end is not None and self.config.outage_mode == "reset":
            self.resets += 1
            _abort(writer)
            return
        if end is not None:
            await _sleep_until(end)  # held: the connection reaches the gateway once the outage is over
        try:
            up_reader, up_writer = await asyncio.open_connection(*_host_port(self.config.upstream))
        except OSError as exc:
            self.connect_failed += 1
            log.warning("cannot connect to %s: %s", self.config.upstream, exc)
            _abort(writer)
            return
        pair = (writer, up_writer)
        self.open.add(pair)
        pumps = [
            _Pump(self, self.up, 2 * index, reader, up_writer),
            _Pump(self, self.down, 2 * index + 1, up_reader, writer),
        ]
        self.pumps.extend(pumps)
        tasks = [asyncio.ensure_future(coro) for p in pumps for coro in (p.read(), p.write())]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.debug("connection %d ended: %s", index, task.exception())
        finally:
            self.open.discard(pair)
            self.pumps = [p for p in self.pumps if p not in pumps]
            for w in pair:
                w.close()

    async def _resets(self) -> None:
        """outage_mode=reset: at the start of each outage every open connection is reset."""
        for start, _ in sorted(self.faults.outages):
            await _sleep_until(self.start + start)
            for pair in list(self.open):
                self.resets += 1
                for w in pair:
                    _abort(w)

    def report(self) -> dict[str, Any]:
        up = dataclasses.replace(self.up, pending=sum(len(p.items) for p in self.pumps if p.stats is self.up))
        down = dataclasses.replace(
            self.down, pending=sum(len(p.items) for p in self.pumps if p.stats is self.down)
        )
        return {
            "layer": "tcp",
            "connections": self.connections,
            "open_connections": len(self.open),
            "connect_failed": self.connect_failed,
            "resets": self.resets,
            "up": dataclasses.asdict(up),
            "down": dataclasses.asdict(down),
        }

    async def serve(self, stop: asyncio.Event, status: Callable[[], None] | None, every_s: float) -> None:
        resets = asyncio.ensure_future(self._resets()) if self.config.outage_mode == "reset" else None
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), timeout=every_s if status and every_s else None)
                except asyncio.TimeoutError:
                    if status is not None:
                        status()
        finally:
            if resets is not None:
                resets.cancel()
            assert self.server is not None
            self.server.close()
            for pair in list(self.open):
                for w in pair:
                    w.transport.abort()


# ---------------------------------------------------------------- the command


def _usage(problem: str) -> int:
    print(f"elasticfed linksim: error: {problem}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace, config: LinksimConfig) -> int:
    """Run the simulator until SIGTERM/SIGINT; the summary is the last line."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        faults = check_config(config)
    except UsageError as exc:
        return _usage(str(exc))
    if config.layer == "tcp":
        return _run_tcp(config, faults)
    return _run_zmq(config, faults)


def _ready(config: LinksimConfig, faults: Faults, endpoint: str, started: float) -> None:
    # `clock_started`: time.monotonic() when outages started counting; one clock for every
    # process of a Linux machine, so a harness can place the outage windows exactly.
    _emit(
        "ready",
        clock_started=started,
        layer=config.layer,
        endpoint=endpoint,
        upstream=config.upstream,
        faults=faults.describe(),
        rate_kbit=config.rate_kbit,
        queue_kib=config.queue_kib,
    )


def _run_zmq(config: LinksimConfig, faults: Faults) -> int:
    ctx = zmq.Context()
    proxy = ZmqProxy(config, faults, ctx)
    try:
        endpoint = proxy.bind()
    except UsageError as exc:
        proxy.close()
        ctx.term()
        return _usage(str(exc))
    log.info("zmq layer: NULL security only (with CURVE use --layer tcp); forwarding to %s", config.upstream)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    proxy.start = started  # outages count from here, the moment the ready line goes out
    _ready(config, faults, endpoint, started)

    def status() -> None:
        _emit("status", t=round(time.monotonic() - started, 3), **proxy.report())

    try:
        proxy.serve(stop, status, config.status_every_s)
    finally:
        report = proxy.report()
        proxy.close()
        ctx.term()
    _emit("summary", seconds=round(time.monotonic() - started, 3), **report)
    return 0


def _run_tcp(config: LinksimConfig, faults: Faults) -> int:
    async def main() -> int:
        proxy = TcpProxy(config, faults)
        try:
            endpoint = await proxy.bind()
        except UsageError as exc:
            return _usage(str(exc))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        started = proxy.start = time.monotonic()
        _ready(config, faults, endpoint, started)

        def status() -> None:
            _emit("status", t=round(time.monotonic() - started, 3), **proxy.report())

        try:
            await proxy.serve(stop, status, config.status_every_s)
        finally:
            report = proxy.report()
        _emit("summary", seconds=round(time.monotonic() - started, 3), **report)
        return 0

    return asyncio.run(main())
