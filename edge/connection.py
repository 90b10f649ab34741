"""The edge's connection to its gateway: open, replace when silent, probe, report handshake trouble.

The ZeroMQ guide's Paranoid Pirate, on the edge's side: the gateway is alive
while something comes back; when nothing has for `liveness` heartbeats (plus
what the link needs to carry what is queued on it, which an answer waits
behind), the connection is replaced at once by a new one, forever, so a
restarted gateway is found without help.  Backoff lengthens the silence
tolerated before the next replacement rather than leaving the edge without a
connection: on a link that loses 95% of messages an answer is rare but not
absent, and a pause without a connection would only lose more.

It knows the link (common/transport) and the heartbeat message, nothing of
pushes, flights or models: what a replacement does to those is the session's
reaction (edge/session.py, `_reconnect`).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import OrderedDict
from typing import Any, NamedTuple

from elasticfed.common.link import Backoff
from elasticfed.common.metrics import Counter
from elasticfed.common.transport import Event, Link, LinkEvent, SendRefused, Tracker
from elasticfed.protocol import Heartbeat, encode

log = logging.getLogger("elasticfed.edge")

MAX_QUEUED_SILENCE_S = 60.0  # queued bytes lengthen the silence tolerated by at most this
_PROBES_KEPT = 256  # answers to older heartbeats no longer matter


class Probe(NamedTuple):
    """A heartbeat sent: when, and whether nothing was queued ahead of it either way."""

    sent_at: float
    quiet: bool


_FAILURE_LOG_EVERY_S = 10.0  # libzmq retries a failed handshake quickly; say it now and then


class Connection:
    """One logical connection to the gateway over a `Link` that it opens and replaces."""

    def __init__(
        self,
        link: Link,
        gateway: str,
        heartbeat_s: float,
        liveness: int,
        backoff: Backoff,
        reconnects: Counter,
        handshake_failures: Counter,
    ) -> None:
        self.link = link
        self.gateway = gateway
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.up = False  # opened (a replacement opens a new one at once)
        self.last_recv = 0.0
        self.last_send = 0.0
        self._backoff = backoff
        self._grace = 0.0  # extra silence tolerated after replacements without an answer
        self._reconnects = reconnects
        self._handshake_failures = handshake_failures
        self._last_failure_log = -math.inf
        self._nonce = itertools.count(1)
        self._probes: OrderedDict[int, Probe] = OrderedDict()  # by heartbeat nonce

    # ------------------------------------------------------------ the connection
    def open(self, now: float) -> None:
        """Open the link (again: a new connection replaces the old; what was on it is lost)."""
        self.link.open()
        self.up = True
        self.last_recv = now

    def silent_for(self, now: float) -> float:
        return now - self.last_recv

    def dead(self, now: float, queued_s: float) -> bool:
        """Liveness judged by progress: silent longer than the heartbeats' allowance, the backoff's
        grace, and what the link needs to carry what is queued on it each way (`queued_s`)."""
        allowed = self.heartbeat_s * self.liveness + self._grace + min(MAX_QUEUED_SILENCE_S, queued_s)
        return self.silent_for(now) > allowed

    def replace(self, now: float) -> None:
        """A new connection in place of a silent one; the next silence tolerated is longer."""
        self._reconnects.inc()
        self._grace = self._backoff.next_delay()
        self.open(now)

    def heard(self, now: float) -> None:
        """Something valid came back: the link works."""
        self.last_recv = now
        self._backoff.reset()
        self._grace = 0.0

    def close(self) -> None:
        self.up = False
        self.link.close()

    # ------------------------------------------------------------------ messages
    def send(self, frames: list[Any], now: float, track: bool = False) -> Tracker | None:
        """Send; None if the link refused it (no connection up yet, or full): lost, as any message
        may be.  With `track`, the result says when the frames' buffers are free again."""
        self.last_send = now
        try:
            return self.link.send(frames, track=track)
        except SendRefused:
            return None

    def idle(self, now: float) -> bool:
        """Nothing sent for a heartbeat: time to show the gateway this edge is alive."""
        return now - self.last_send >= self.heartbeat_s

    def probe(self, now: float, resolved_below: int, quiet: bool = False) -> None:
        """A heartbeat: its answer proves what was sent before it arrived, and if `quiet` (the
        caller had nothing queued on the link either way) times the path."""
        nonce = next(self._nonce)
        self._probes[nonce] = Probe(now, quiet)
        while len(self._probes) > _PROBES_KEPT:
            self._probes.popitem(last=False)
        self.send(encode(Heartbeat(nonce=nonce, resolved_below=resolved_below)), now)

    def probe_answered(self, nonce: int) -> Probe:
        """The heartbeat answered with `nonce` (sent at -inf: not one of ours, or forgotten)."""
        return self._probes.pop(nonce, Probe(-math.inf, False))

    # -------------------------------------------------------------------- events
    def up_events(self, now: float) -> bool:
        """Read the link's events; True if a connection (and its handshake) came up, a moment to
        say hello.  Failed CURVE handshakes are counted and logged now and then: the transport
        retries them, and a refusal in a handshake is not authenticated, so it is never final."""
        came_up = False
        for event in self.link.events():
            came_up |= self.on_event(event, now)
        return came_up

    def on_event(self, event: LinkEvent, now: float) -> bool:
        if event.kind is Event.UP:
            return True
        refused = event.kind is Event.REFUSED
        self._handshake_failures.inc("refused" if refused else "failed")
        if now - self._last_failure_log < _FAILURE_LOG_EVERY_S:
            return False
        self._last_failure_log = now
        if refused:
            log.error(
                "the gateway at %s refused this device's CURVE key (%s): it is not enrolled there, "
                "or it was revoked; enrol it with `elasticfed keys enrol`. Retrying",
                self.gateway,
                event.detail,
            )
        elif event.detail == "plain":
            # No keys here: blaming them sent users after keys an insecure edge does not have.
            log.warning(
                "handshake with %s failed: the gateway went away mid-handshake, or what listens "
                "there is not an elasticfed gateway. Retrying",
                self.gateway,
            )
        else:
            log.error(
                "CURVE handshake with %s failed: is --security-gateway-public-key the key of the "
                "gateway at that address? Retrying",
                self.gateway,
            )
        return False
