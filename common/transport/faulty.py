"""A link that loses, delays, duplicates and reorders messages: faults injected in process.

It wraps any other link (the edge's DEALER in tests and `elasticfed demo`, or the
in-process pair in protocol tests) with one `FaultyChannel` per direction, the
same fault model `elasticfed linksim` applies between real sockets.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from elasticfed.common.link import Faults, FaultyChannel
from elasticfed.common.transport.base import DONE, Frames, Link, LinkEvent, Received, SendRefused, Tracker
from elasticfed.protocol import frame_bytes

_Outgoing = tuple[bytes, list[bytes]]  # peer, frames


class FaultyLink(Link):
    """`inner` as seen through a bad link; outages count from when this wrapper was made."""

    def __init__(self, inner: Link, faults: Faults, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.faults = faults
        self.clock = clock
        self.start = clock()
        self.up: FaultyChannel[_Outgoing] = FaultyChannel(faults, 0, self.start, lambda m: m)
        self.down: FaultyChannel[Received] = FaultyChannel(faults, 1, self.start, lambda m: m)
        self.loses_messages = faults.loss > 0 or bool(faults.outages) or inner.loses_messages
        self._arrived: deque[Received] = deque()

    def open(self) -> str:
        self.drop_in_flight()
        return self.inner.open()

    def drop_in_flight(self) -> None:
        """Messages the channels still hold were on a connection that is gone: as over TCP, none
        of them may arrive on the next one (an old instance's ack, an old copy of a push)."""
        self.up.clear()
        self.down.clear()
        self._arrived.clear()

    def send(self, frames: Frames, peer: bytes = b"", track: bool = False) -> Tracker:
        # Copied now: a message held back must not change under us (it may be a view of a buffer
        # the caller reuses once the send returns).
        self.up.offer((peer, [bytes(frame_bytes(f)) for f in frames]), self.clock())
        self._flush(self.clock())
        return DONE

    def poll(self, timeout_s: float) -> bool:
        now = self.clock()
        self._flush(now)
        if self._ready(now):
            return True
        due = min(self.up.next_due(), self.down.next_due())
        wait = timeout_s if math.isinf(due) else max(0.0, min(timeout_s, due - now))
        self.inner.poll(wait)
        now = self.clock()
        self._flush(now)
        return self._ready(now)

    def receive(self) -> Received | None:
        if not self._arrived:
            self._ready(self.clock())
        return self._arrived.popleft() if self._arrived else None

    def events(self) -> list[LinkEvent]:
        return self.inner.events()

    def wake(self) -> None:
        self.inner.wake()

    def close(self, linger_s: float = 0.0) -> None:
        self.inner.close(linger_s)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {"link_up": dict(self.up.stats.__dict__), "link_down": dict(self.down.stats.__dict__)}

    def _flush(self, now: float) -> None:
        for peer, frames in self.up.due(now):
            try:
                self.inner.send(frames, peer)
            except SendRefused:
                pass  # lost on the way, as any message on this link may be

    def _ready(self, now: float) -> bool:
        """Take what reached the inner link into the down channel; True if something is due."""
        while (message := self.inner.receive()) is not None:
            self.down.offer(message, now)
        self._arrived.extend(self.down.due(now))
        return bool(self._arrived)
