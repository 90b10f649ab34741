"""How fast the link drains, measured from the protocol's own answers; what follows from it.

A ZeroMQ connection is one FIFO each way.  Whatever the edge queues on it, a
heartbeat or an ack sent after waits behind, so on a slow link the edge must
know how much it may queue, how long an answer may take, and how long silence
can last before the connection is presumed dead.  `LinkMeter` estimates one
direction's rate from request/answer pairs (a push and its ack, a model fetch
and its chunk): on a FIFO link the time from the later of a message's send and
the previous answer to its own answer is the time the link spent on it.

From the rate:
- `budget(size)`: bytes that may be outstanding, about `queue_s` of the link
  (never less than one message: a push larger than a second of link still goes);
- `expected_s(bytes)`: how long an answer to a message with `bytes` queued ahead
  (itself included) should take; deadlines and silence allowances grow with it,
  so a push that cannot be acknowledged within 500 ms at 10 Mbit/s is expected,
  not a failure.

Until the first answer the rate is a guess (`initial_bps`); an underestimate
only makes the first transfers more cautious.  A cap (`cap_bps`) is a token
bucket on what this side sends: a site keeps the rest of its link.
"""

from __future__ import annotations

from common.link import TokenBucket

MIN_SAMPLE_BYTES = 32 * 1024  # smaller answers time the round trip, not the link


class LinkMeter:
    """One direction's measured rate (bytes/s) and the budgets and delays it implies."""

    def __init__(
        self,
        initial_bps: float = 4e6,
        queue_s: float = 1.0,
        min_budget: int = 256 * 1024,
        alpha: float = 0.3,
    ) -> None:
        if initial_bps <= 0 or queue_s <= 0 or min_budget < 1 or not 0 < alpha <= 1:
            raise ValueError("initial_bps and queue_s must be > 0, min_budget >= 1, alpha in (0, 1]")
        self.rate = float(initial_bps)
        self.queue_s = queue_s
        self.min_budget = min_budget
        self.alpha = alpha
        self.measured = False
        # The path's round trip, the smallest seen (small messages, the handshake): a sample taken
        # on an idle link holds it, and a long but empty path is not a slow one.
        self.rtt = 0.0
        self._rtt_seen = False
        self._last_answer = float("-inf")

    def observe_rtt(self, seconds: float) -> None:
        if seconds > 0 and (not self._rtt_seen or seconds < self.rtt):
            self.rtt, self._rtt_seen = seconds, True

    def answered(self, nbytes: int, sent_at: float, now: float) -> None:
        """An answer to a message of `nbytes` sent at `sent_at` (on this connection) came now.

        If the link was still busy with the previous answer when this message was sent, the
        gap between the two answers is this message's time on the link: a sample of the rate.
        Otherwise the gap also holds the round trip (and any queue in the other direction):
        a lower bound, used only while nothing better is known or when it is above the estimate.
        """
        busy = sent_at <= self._last_answer
        began = max(sent_at, self._last_answer) if busy else sent_at + self.rtt
        self._last_answer = now
        if nbytes < MIN_SAMPLE_BYTES:
            if not busy:
                self.observe_rtt(now - sent_at)
            return
        # At least a millisecond: an answer that came back within the round trip says the link
        # carried the message in no measurable time, a fast link, not an unmeasured one.
        sample = nbytes / max(now - began, 1e-3)
        if not self.measured:
            self.rate, self.measured = sample, True
        elif busy or sample > self.rate:
            self.rate += self.alpha * (sample - self.rate)

    def connection_replaced(self) -> None:
        self._last_answer = float("-inf")

    def budget(self, size: int = 0) -> int:
        """Bytes that may be outstanding on the connection (at least one message of `size`)."""
        return max(self.min_budget, size, int(self.rate * self.queue_s))

    def expected_s(self, nbytes: int) -> float:
        """Seconds for the link to carry `nbytes`."""
        return nbytes / self.rate


class UploadCap:
    """At most `mbit` Mbit/s on average from this device (0: no cap); bursts of up to one message."""

    def __init__(self, mbit: float, now: float) -> None:
        if mbit < 0:
            raise ValueError(f"upload cap must be >= 0 Mbit/s, got {mbit}")
        rate = mbit * 1e6 / 8
        # Depth of a tenth of a second: the cap holds over short windows, and one message
        # larger than that leaves the bucket in debt (common.link.TokenBucket).
        self._bucket = TokenBucket(rate, max(rate / 10, 1500.0), now) if rate else None

    @property
    def active(self) -> bool:
        return self._bucket is not None

    def ready_at(self, nbytes: int, now: float) -> float:
        return now if self._bucket is None else self._bucket.ready_at(nbytes, now)

    def take(self, nbytes: int, now: float) -> None:
        if self._bucket is not None:
            self._bucket.take(nbytes, now)
