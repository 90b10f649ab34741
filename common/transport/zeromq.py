"""The ZeroMQ links: an edge's DEALER and the gateway's ROUTER, the only data-path `zmq` code.

Every `zmq` error of sending and receiving is translated here (`SendRefused`),
and the CURVE handshake monitor becomes `LinkEvent`s, so the session and the
gateway hold protocol logic only.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from elasticfed.common.keys import KeyPair, configure_client
from elasticfed.common.transport.base import (
    DONE,
    Event,
    Frames,
    Link,
    LinkEvent,
    Received,
    Refusal,
    SendRefused,
    Tracker,
)
from elasticfed.protocol import DEFAULT_LIMITS, Limits

log = logging.getLogger("elasticfed.transport")

FILES_BESIDES_PEERS = 64  # the process's own files: checkpoints, logs, libzmq's internal pipes

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_names = itertools.count()


class _Waker:
    """An inproc pipe another thread writes to so that a poll ends early; one wake-up in flight."""

    def __init__(self, ctx: zmq.Context) -> None:
        address = f"inproc://elasticfed-wake-{next(_names)}"
        self.rx = ctx.socket(zmq.PAIR)
        self.rx.bind(address)
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.connect(address)
        self._lock = threading.Lock()
        self._pending = False
        self._closed = False

    def wake(self) -> None:
        with self._lock:
            if self._pending or self._closed:
                return
            self._pending = True
            try:
                self._tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # wake-ups are queued already
                pass

    def drain(self) -> None:
        # Drain first, then clear: a wake-up sent in between is then either drained (and what it
        # announced is seen by the caller's next look) or still in the pipe with the flag clear.
        # The other order could leave the flag set with nothing in the pipe, and later wake-ups
        # would wait for the next timer.
        while self.rx.poll(0):
            self.rx.recv()
        with self._lock:
            self._pending = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._tx.close(linger=0)
        self.rx.close(linger=0)


class DealerLink(Link):
    """An edge's connection to the gateway: a DEALER with a stable routing id, CURVE when keyed.

    `open()` again replaces the socket (the routing id moves the gateway's route to the new
    connection, ROUTER_HANDOVER); the wake pipe survives replacements.
    """

    def __init__(
        self,
        endpoint: str,
        routing_id: bytes,
        limits: Limits = DEFAULT_LIMITS,
        curve: tuple[KeyPair, bytes] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.routing_id = routing_id
        self.limits = limits
        self.curve = curve
        self.ctx = zmq.Context.instance()
        self._waker = _Waker(self.ctx)
        self._poller = zmq.Poller()
        self._poller.register(self._waker.rx, zmq.POLLIN)
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._events: list[LinkEvent] = []

    def open(self) -> str:
        self._close_socket()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not there
        # A stable routing id: the gateway (ROUTER_HANDOVER) hands it to the newest connection.
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        apply_limits(sock, self.limits)
        if self.curve is not None:
            configure_client(sock, *self.curve)
        # Handshake events: UP the moment the connection is up (with ZMQ_IMMEDIATE a send before
        # that is refused), and a clear error when the gateway refuses this device's key.
        self._monitor = sock.get_monitor_socket(
            _HANDSHAKE_EVENTS, addr=f"inproc://elasticfed-monitor-{next(_names)}"
        )
        self._poller.register(self._monitor, zmq.POLLIN)
        sock.connect(self.endpoint)
        self._sock = sock
        self._poller.register(sock, zmq.POLLIN)
        return self.endpoint

    def send(self, frames: Frames, peer: bytes = b"", track: bool = False) -> Tracker:
        if self._sock is None:
            raise SendRefused(Refusal.NO_PEER)
        if track:
            # Every frame zero-copy and tracked: send_multipart's own tracker covers only the
            # last frame, and a frame under zmq's copy threshold reports done at once, while a
            # larger one before it may still be queued, reading the caller's buffer.
            frames = [zmq.Frame(f, copy=False, track=True) for f in frames]
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no connected peer, or at the high-water mark
            raise SendRefused(Refusal.NO_PEER) from None
        return zmq.MessageTracker(*frames) if track else DONE

    def poll(self, timeout_s: float) -> bool:
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000) + 1)))
        if events.get(self._waker.rx):
            self._waker.drain()
        if self._monitor is not None and events.get(self._monitor):
            self._read_monitor()
        return bool(self._events) or (self._sock is not None and bool(events.get(self._sock)))

    def receive(self) -> Received | None:
        if self._sock is None:
            return None
        try:
            return Received(self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False))
        except zmq.Again:
            return None

    def events(self) -> list[LinkEvent]:
        events, self._events = self._events, []
        return events

    def wake(self) -> None:
        self._waker.wake()

    def close(self, linger_s: float = 0.0) -> None:
        self._close_socket()
        self._waker.close()

    def _read_monitor(self) -> None:
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._events.append(LinkEvent(Event.UP))
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._events.append(LinkEvent(Event.REFUSED, f"ZAP status {event['value']}"))
            else:  # the detail says whether keys can be the cause
                self._events.append(LinkEvent(Event.FAILED, "curve" if self.curve is not None else "plain"))

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._poller.unregister(self._monitor)
            if self._sock is not None:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            self._poller.unregister(self._sock)
            self._sock.close(linger=0)
            self._sock = None
        self._events.clear()


class RouterLink(Link):
    """The gateway's socket: a ROUTER many edges connect to, each message tagged with its peer."""

    def __init__(
        self,
        endpoint: str,
        limits: Limits = DEFAULT_LIMITS,
        queue_per_peer: int = 1000,
        secure: Callable[[zmq.Socket], None] | None = None,
        peers: int = 1024,
    ) -> None:
        self.endpoint = endpoint
        self.limits = limits
        self.queue_per_peer = queue_per_peer
        self.peers = peers  # connections it must be able to hold at once: a file each
        self.secure = secure  # makes the socket a CURVE server before it binds (cloud/admission.py)
        self.ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._waker: _Waker | None = None
        self._poller = zmq.Poller()

    def open(self) -> str:
        allow_open_files(self.peers + FILES_BESIDES_PEERS)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an undeliverable reply raises instead of vanishing
        # An edge keeps its routing id across reconnects: the new connection takes over the old
        # (possibly half-open) one, and the edge stays welcomed without another round trip.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Per connection, libzmq queues at most this many messages while the serving thread is
        # busy, then stops reading that TCP connection (back-pressure, nothing dropped).
        sock.setsockopt(zmq.RCVHWM, self.queue_per_peer)
        apply_limits(sock, self.limits)
        if self.secure is not None:
            self.secure(sock)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._waker = _Waker(self.ctx)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._waker.rx, zmq.POLLIN)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def send(self, frames: Frames, peer: bytes = b"", track: bool = False) -> Tracker:
        if self._sock is None:
            raise SendRefused(Refusal.PEER_GONE)
        try:
            self._sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise SendRefused(Refusal.QUEUE_FULL) from None
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            raise SendRefused(Refusal.PEER_GONE) from None
        return DONE

    def poll(self, timeout_s: float) -> bool:
        if self._sock is None:
            return False
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000) + 1)))
        if self._waker is not None and events.get(self._waker.rx):
            self._waker.drain()
        return bool(events.get(self._sock))

    def receive(self) -> Received | None:
        if self._sock is None:
            return None
        try:
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        body = frames[1:]
        user_id = _user_id(body[0]) if body and self.secure is not None else None
        return Received(body, peer=frames[0].bytes, user_id=user_id)

    def wake(self) -> None:
        if self._waker is not None:
            self._waker.wake()

    def close(self, linger_s: float = 0.0) -> None:
        if self._sock is not None:
            self._poller.unregister(self._sock)
            self._sock.close(linger=int(linger_s * 1000))
            self._sock = None
        if self._waker is not None:
            self._poller.unregister(self._waker.rx)
            self._waker.close()
            self._waker = None


def apply_limits(sock: zmq.Socket, limits: Limits = DEFAULT_LIMITS) -> None:
    """Make libzmq itself refuse oversized messages on `sock`.

    The decoder's caps apply to frames already received; ZMQ_MAXMSGSIZE stops a peer at the
    socket (it is disconnected) before a message larger than the cap is allocated.
    """
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)


def _user_id(frame: Any) -> str | None:
    """The ZAP User-Id libzmq attached to a received frame (the CURVE key), if any."""
    try:
        value = frame.get("User-Id")
    except (AttributeError, zmq.ZMQError):
        return None
    return str(value) if value else None


def allow_open_files(needed: int) -> int:
    """Raise this process's soft limit on open files toward `needed` (at most to the hard limit, as
    the Go runtime does at start); returns the limit now, with a warning if short of `needed`.

    Why: each edge's connection is a file, and a common soft limit is 1024: past it libzmq
    cannot accept a connection and the devices beyond it retry forever, unexplained."""
    try:
        import resource
    except ImportError:  # not a Unix: nothing to raise
        return needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return needed
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft < needed:
        log.warning(
            "this process may open %d files and serving its devices needs about %d (a connection "
            "each): raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)",
            soft,
            needed,
        )
    return soft
