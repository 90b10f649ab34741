"""Links in one process, no sockets: a router and any number of dealers on a `MemoryHub`.

They keep the ZeroMQ links' semantics that the protocol relies on (FIFO each way,
a dealer's routing id moves to its newest connection, a dealer with no router
listening has its sends refused, a reply to a peer that is gone is refused), so
the edge session and the gateway run on them unchanged: protocol state-machine
tests need no sockets, and wrapped in a `FaultyLink` they see a lossy link.
"""

from __future__ import annotations

import threading
from collections import deque

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
from elasticfed.protocol import frame_bytes


def _copy(frames: Frames) -> list[bytes]:
    # A sender may reuse its buffers once `send` returns (nothing is tracked here).
    return [bytes(frame_bytes(f)) for f in frames]


class MemoryHub:
    """The shared medium; one lock guards every end's queues."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.router: MemoryRouter | None = None
        self.dealers: dict[bytes, MemoryDealer] = {}  # routing id -> its newest connection

    def router_link(self) -> MemoryRouter:
        return MemoryRouter(self)

    def dealer_link(self, routing_id: bytes, user_id: str | None = None) -> MemoryDealer:
        """A dealer; `user_id` is what the router is told of its key (as CURVE's User-Id)."""
        return MemoryDealer(self, routing_id, user_id)


class _End(Link):
    def __init__(self, hub: MemoryHub) -> None:
        self.hub = hub
        self.inbox: deque[Received] = deque()
        self.woken = False
        self.closed = False

    def poll(self, timeout_s: float) -> bool:
        with self.hub.cond:
            self.hub.cond.wait_for(lambda: self.inbox or self.woken or self._has_events(), timeout_s)
            self.woken = False
            return bool(self.inbox) or self._has_events()

    def receive(self) -> Received | None:
        with self.hub.cond:
            return self.inbox.popleft() if self.inbox else None

    def wake(self) -> None:
        with self.hub.cond:
            self.woken = True
            self.hub.cond.notify_all()

    def _has_events(self) -> bool:
        return False


class MemoryRouter(_End):
    def open(self) -> str:
        with self.hub.cond:
            if self.hub.router is not None and not self.hub.router.closed:
                raise OSError("this hub has a router already")
            self.hub.router = self
            self.closed = False
            for dealer in self.hub.dealers.values():
                dealer.pending.append(LinkEvent(Event.UP))
            self.hub.cond.notify_all()
        return "memory://hub"

    def send(self, frames: Frames, peer: bytes = b"", track: bool = False) -> Tracker:
        with self.hub.cond:
            dealer = self.hub.dealers.get(peer)
            if self.closed or dealer is None:
                raise SendRefused(Refusal.PEER_GONE)
            dealer.inbox.append(Received(_copy(frames)))
            self.hub.cond.notify_all()
        return DONE

    def close(self, linger_s: float = 0.0) -> None:
        with self.hub.cond:
            self.closed = True
            self.inbox.clear()
            if self.hub.router is self:
                self.hub.router = None
            self.hub.cond.notify_all()


class MemoryDealer(_End):
    def __init__(self, hub: MemoryHub, routing_id: bytes, user_id: str | None) -> None:
        super().__init__(hub)
        self.routing_id = routing_id
        self.user_id = user_id
        self.pending: list[LinkEvent] = []
        self.connected = False

    def open(self) -> str:
        with self.hub.cond:
            self.inbox.clear()  # replies in flight to the old connection are lost with it
            self.pending.clear()
            self.connected = True
            self.hub.dealers[self.routing_id] = self  # the newest connection takes the route
            if self.hub.router is not None:
                self.pending.append(LinkEvent(Event.UP))
            self.hub.cond.notify_all()
        return "memory://hub"

    def send(self, frames: Frames, peer: bytes = b"", track: bool = False) -> Tracker:
        with self.hub.cond:
            router = self.hub.router
            if not self.connected or router is None or self.hub.dealers.get(self.routing_id) is not self:
                raise SendRefused(Refusal.NO_PEER)  # as ZMQ_IMMEDIATE: nothing queued for no one
            router.inbox.append(Received(_copy(frames), peer=self.routing_id, user_id=self.user_id))
            self.hub.cond.notify_all()
        return DONE

    def events(self) -> list[LinkEvent]:
        with self.hub.cond:
            events, self.pending = self.pending, []
            return events

    def close(self, linger_s: float = 0.0) -> None:
        with self.hub.cond:
            self.connected = False
            self.closed = True
            if self.hub.dealers.get(self.routing_id) is self:
                del self.hub.dealers[self.routing_id]
            self.inbox.clear()
            self.hub.cond.notify_all()

    def _has_events(self) -> bool:
        return bool(self.pending)
