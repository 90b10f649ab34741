"""The transport boundary: what the edge session and the gateway need of a message connection.

A `Link` moves multi-frame messages and nothing else: it never decodes them.  The
ZeroMQ sockets (zeromq.py), the in-process pair the protocol tests run on
(memory.py) and the fault-injecting wrapper (faulty.py) all implement it, and
every lower-layer error is translated here into `SendRefused`, so neither the
session nor the gateway imports `zmq`.

Threads: `wake()` may be called from any thread (it ends a `poll` early); every
other method belongs to the one I/O thread that owns the link.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Frames = Sequence[Any]  # bytes, bytearray, memoryview or zmq.Frame; see protocol.codec.frame_bytes


class Refusal(enum.Enum):
    """Why a message was not taken; the message is lost either way, as on a link that drops it."""

    NO_PEER = "no_peer"  # a dealer with no connection up (yet): nothing is queued for an absent peer
    QUEUE_FULL = "queue_full"  # the peer's queue is at its high-water mark
    PEER_GONE = "peer_gone"  # a router's reply to a peer that is no longer connected


class SendRefused(Exception):
    """The link did not take a message (see `Refusal`); nothing of it was sent."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.value)
        self.refusal = refusal


@dataclass(frozen=True)
class Received:
    """One message: its frames, and on a router who sent it."""

    frames: list[Any]
    peer: bytes = b""  # the sender's routing id (a router's side); b"" on a dealer
    user_id: str | None = None  # the authenticated key behind it (CURVE's User-Id), if any


class Event(enum.Enum):
    """What a dealer learns about its connection besides messages."""

    UP = "up"  # the connection (and its handshake, with CURVE) is up: a good moment to say hello
    REFUSED = "refused"  # the peer refused this end's key (CURVE/ZAP); retried by the transport
    FAILED = "failed"  # a handshake failed otherwise (e.g. the wrong server key); retried too
    # (detail "plain": no keys involved, e.g. the peer went away mid-handshake or is not ZeroMQ)


@dataclass(frozen=True)
class LinkEvent:
    kind: Event
    detail: str = ""


class Tracker:
    """Whether the transport is done reading a sent buffer (`done`); the cache reuses it after."""

    done = True


DONE = Tracker()


class Link(ABC):
    """One end of a message connection (a dealer to one peer, or a router to many)."""

    #: Whether messages can be lost on a live connection (faults injected here, or a proxy that
    #: drops): the session then re-sends on timers from the start instead of learning it.
    loses_messages: bool = False

    @abstractmethod
    def open(self) -> str:
        """Connect (a dealer) or bind (a router); returns the endpoint.  Opening a dealer again
        replaces its connection: whatever was in flight on the old one is lost, as over TCP."""

    @abstractmethod
    def send(self, frames: Frames, peer: bytes = b"", track: bool = False) -> Tracker:
        """Queue one message (to `peer` on a router) without blocking.

        With `track`, the result's `done` turns true once the transport no longer reads the
        frames' buffers (zero-copy sends); otherwise it is `DONE`.  Raises `SendRefused`.
        """

    @abstractmethod
    def poll(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a message, an event or a `wake()`; True if one may be there."""

    @abstractmethod
    def receive(self) -> Received | None:
        """The next message, or None at once if there is none."""

    def drop_in_flight(self) -> None:
        """The peer is a new instance: what a simulated link still holds from the connection to the
        old one must not arrive (over TCP it died with that connection).  Real links: nothing."""
        return None

    def events(self) -> list[LinkEvent]:
        """Connection events since the last call (a dealer's handshakes); none by default."""
        return []

    @abstractmethod
    def wake(self) -> None:
        """End a `poll` in progress (or the next one) early; callable from any thread."""

    @abstractmethod
    def close(self, linger_s: float = 0.0) -> None:
        """Release the connection; replies already queued get `linger_s` to leave."""

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters of what the link did to messages (a fault wrapper's); JSON-able."""
        return {}
