"""How fast the link drains, measured from the protocol's own answers; what follows from it.

A ZeroMQ connection is one FIFO each way.  Whatever the edge queues on it, a
heartbeat or an ack sent after waits behind, so on a slow link the edge must
know how much it may queue, how long an answer may take, and how long silence
can last before the connection is presumed dead.  `LinkMeter` estimates one
direction's rate from request/answer pairs (a push and its ack, a model fetch
and its chunk): on a FIFO link every byte sent since a message of a busy run
went out has crossed once its answer comes, a lower bound on the rate; the
estimate is the largest recent one.  `Backlog` says what is still on the link
by that rate, without waiting for answers that queue behind the other
direction's traffic.

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

from collections import deque

from elasticfed.common.link import RATE_SAMPLE_MIN_BYTES, RecentMax, TokenBucket

RUN_WINDOW_S = 10.0  # a busy run's rate is taken over about this long of its newest answers


class LinkMeter:
    """One direction's measured rate (bytes/s) and the budgets and delays it implies."""

    def __init__(
        self,
        initial_bps: float = 4e6,
        queue_s: float = 1.0,
        min_budget: int = 256 * 1024,
    ) -> None:
        if initial_bps <= 0 or queue_s <= 0 or min_budget < 1:
            raise ValueError("initial_bps and queue_s must be > 0, min_budget >= 1")
        self.rate = float(initial_bps)
        self.queue_s = queue_s
        self.min_budget = min_budget
        self.measured = False
        # The path's round trip, the smallest seen (observe_rtt: the owner passes only small
        # messages sent with nothing of its own queued either way, or a sample holding queueing
        # makes every lone answer read fast); a long but empty path is not a slow one.
        self.rtt = 0.0
        self._rtt_seen = False
        self._last_answer = float("-inf")
        self._runs_from = float("-inf")  # messages sent before this join no run (new_run)
        self._run: deque[tuple[float, float, int]] = deque()  # (sent, answered, bytes): a busy run
        self._run_bytes = 0  # their bytes (small pushes make long runs: not summed per answer)
        self._samples = RecentMax()  # bytes/s

    def observe_rtt(self, seconds: float) -> None:
        if seconds > 0 and (not self._rtt_seen or seconds < self.rtt):
            self.rtt, self._rtt_seen = seconds, True

    def answered(self, nbytes: int, sent_at: float, now: float) -> None:
        """An answer to a message of `nbytes` sent at `sent_at` (on this connection) came now.

        If the link was still busy with the previous answer when this message was sent, the
        message joins a busy run: every byte of the run's recent messages crossed between the
        first one's send and now, a sample of the rate.  Send times, not answer gaps: answers
        that queued behind traffic the other way (or a busy gateway) come in bunches, and a gap
        of a millisecond once read as 80 Mbit/s on a 10 Mbit/s link sent its edge's pushes into
        30 s queues.  A message sent onto an idle link starts a run; its own time also holds the
        round trip (less the smallest seen, a lower bound as long as that was measured on a quiet
        path), used only while nothing better is known or when it is above the estimate.  Its
        own small answers say nothing of the round trip: the other direction may have held them
        (model patches of 10-30 KB took 50 ms at 5 Mbit/s; taken as the round trip, every larger
        answer read 6.4 Mbit/s).
        """
        busy = sent_at <= self._last_answer
        self._last_answer = now
        if sent_at < self._runs_from:
            return  # sent before a probe began: it would dilute the probe's run
        if not busy:
            self._clear_run()
        self._run.append((sent_at, now, nbytes))
        self._run_bytes += nbytes
        while len(self._run) > 2 and now - self._run[1][1] >= RUN_WINDOW_S:
            self._run_bytes -= self._run.popleft()[2]
        total = self._run_bytes
        if total < RATE_SAMPLE_MIN_BYTES:
            # Too few bytes to time: the path's latency, not its rate.  Small messages still join
            # a busy run: compressed pushes of a few KB each are the whole uplink of an edge.
            return
        began = self._run[0][0] + (self.rtt if len(self._run) == 1 else 0.0)
        # At least a millisecond: an answer that came back within the round trip says the link
        # carried the message in no measurable time, a fast link, not an unmeasured one.
        sample = total / max(now - began, 1e-3)
        # A lower bound (bytes sent after `began` crossed by now): the estimate is the largest
        # recent one (common.link.RecentMax).
        if len(self._run) == 1 and self.measured and sample <= self.rate:
            return  # a lone message on an idle link: the round trip blurs it; it says nothing new
        self._samples.add(sample, now)
        self.rate, self.measured = self._samples.value or sample, True

    def new_run(self, now: float) -> None:
        """Time what is sent from `now` on by itself (a probe: earlier messages would dilute it)."""
        self._runs_from = now
        self._clear_run()

    def connection_replaced(self) -> None:
        self._last_answer = float("-inf")
        self._clear_run()  # the rate samples stay: the same path

    def _clear_run(self) -> None:
        self._run.clear()
        self._run_bytes = 0

    def budget(self, size: int = 0) -> int:
        """Bytes that may be outstanding on the connection (at least one message of `size`)."""
        return max(self.min_budget, size, int(self.rate * self.queue_s))

    def expected_s(self, nbytes: int) -> float:
        """Seconds for the link to carry `nbytes`."""
        return nbytes / self.rate


class Backlog:
    """Bytes still crossing one direction, by a fluid model: a send adds, the measured rate drains.

    An answer proves the bytes before it crossed, but on a slow link it may queue behind
    megabytes going the other way (model chunks ahead of an ack): judging room on the uplink
    by answers alone left it idle while acks waited (measured: 3 of 10 Mbit/s used).  The
    owner takes the smaller of this and what is unanswered, so answers still cut it.  Until
    the rate is measured nothing drains: only answers make room.
    """

    def __init__(self, meter: LinkMeter) -> None:
        self.meter = meter
        self._level = 0.0
        self._at = 0.0

    def level(self, now: float) -> float:
        if not self.meter.measured:
            return self._level
        return max(0.0, self._level - self.meter.rate * (now - self._at))

    def add(self, nbytes: int, now: float) -> None:
        self._level, self._at = self.level(now) + nbytes, now

    def clear(self) -> None:
        self._level = 0.0


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
