"""Links between an edge and the gateway: fault injection, delay queue, retry backoff.

`Faults` describes a bad link (loss with or without bursts, delay and jitter,
duplication, reordering, scheduled outages); `FaultyChannel` applies it to one
direction of a message stream, seeded so that a run can be repeated exactly;
`TokenBucket` caps a link's bandwidth (used by `elasticfed linksim`);
`RecentMax` is how both ends estimate a link's rate from lower bounds.
The edge session puts one channel on each direction of its socket, in process,
which is how the tests and `elasticfed demo` make a loopback link lossy.
Nothing here knows about training or about what the messages mean.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_OUTAGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*\+\s*(\d+(?:\.\d+)?)\s*$")


@dataclass(frozen=True)
class Faults:
    """What is wrong with a link, per message, in each direction.

    `loss` is the long-run share of messages lost. With `burst` > 1 losses come
    in bursts of that mean length (a Gilbert-Elliott chain whose bad state loses
    everything and whose good state loses nothing); with `burst` = 1 each message
    is lost independently. `outages` are (start_s, duration_s) windows, counted
    from when the link was made, in which nothing gets through either way.
    """

    loss: float = 0.0
    burst: float = 1.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    outages: tuple[tuple[float, float], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("loss", "duplicate", "reorder"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"faults: {name} must be in [0, 1), got {value}")
        if self.burst < 1.0:
            raise ValueError(
                f"faults: burst is a mean burst length in messages, at least 1, got {self.burst}"
            )
        if self.burst > 1.0 and self.loss > 0 and self.loss / (1 - self.loss) > self.burst:
            need = self.loss / (1 - self.loss)
            raise ValueError(
                f"faults: a loss of {self.loss:.0%} needs bursts of at least {need:.1f} messages on "
                f"average (burst={self.burst} would have to stay in the bad state more than it leaves it)"
            )
        for name in ("delay_ms", "jitter_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"faults: {name} must be >= 0, got {getattr(self, name)}")
        for start, length in self.outages:
            if start < 0 or length <= 0:
                raise ValueError(
                    f"faults: outage ({start}, {length}) needs start >= 0 and a positive duration"
                )

    @property
    def active(self) -> bool:
        return any((self.loss, self.delay_ms, self.jitter_ms, self.duplicate, self.reorder, self.outages))

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """`loss=0.3,burst=3,delay_ms=5,outage=10+10,seed=1` (empty: a perfect link)."""
        if not spec.strip():
            return cls()
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        outages: list[tuple[float, float]] = []
        for item in spec.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"faults: {item.strip()!r} is not key=value")
            if key == "outage":
                match = _OUTAGE.match(raw)
                if not match:
                    raise ValueError(f"faults: outage {raw!r} must look like START_S+DURATION_S, e.g. 10+5")
                outages.append((float(match.group(1)), float(match.group(2))))
                continue
            if key not in known or key == "outages":
                choices = ", ".join(sorted([*known.keys() - {"outages"}, "outage"]))
                raise ValueError(f"faults: unknown key {key!r} (known: {choices})")
            try:
                values[key] = int(raw) if key == "seed" else float(raw)
            except ValueError:
                raise ValueError(f"faults: {key}={raw!r} is not a number") from None
        return cls(outages=tuple(outages), **values)

    def describe(self) -> str:
        if not self.active:
            return "lossless"
        parts = []
        if self.loss:
            kind = f"bursts of {self.burst:g}" if self.burst > 1 else "independent"
            parts.append(f"{self.loss:.0%} loss ({kind})")
        if self.delay_ms or self.jitter_ms:
            parts.append(f"delay {self.delay_ms:g}±{self.jitter_ms:g} ms")
        if self.duplicate:
            parts.append(f"{self.duplicate:.0%} duplicated")
        if self.reorder:
            parts.append(f"{self.reorder:.0%} reordered")
        for start, length in self.outages:
            parts.append(f"outage {length:g} s at {start:g} s")
        return ", ".join(parts)


class GilbertElliott:
    """Two-state loss chain: `good` loses nothing, `bad` loses everything; burst = mean bad run."""

    def __init__(self, loss: float, burst: float, rng: random.Random) -> None:
        self.rng = rng
        self.independent = burst <= 1.0 or loss == 0.0
        self.loss = loss
        self.leave_bad = 1.0 / burst
        self.enter_bad = loss * self.leave_bad / (1.0 - loss) if loss < 1 else 1.0
        self.bad = False

    def lost(self) -> bool:
        if self.independent:
            return self.rng.random() < self.loss
        if self.bad:
            self.bad = self.rng.random() >= self.leave_bad
        else:
            self.bad = self.rng.random() < self.enter_bad
        return self.bad


@dataclass
class ChannelStats:
    offered: int = 0
    lost: int = 0
    lost_in_outage: int = 0
    duplicated: int = 0
    reordered: int = 0


class FaultyChannel(Generic[T]):
    """One direction of a link: decides, per message, when (and how often) it is delivered."""

    def __init__(self, faults: Faults, stream: int, start: float, copy: Callable[[T], T]) -> None:
        self.faults = faults
        self.rng = random.Random(faults.seed * 1_000_003 + stream)
        self.loss = GilbertElliott(faults.loss, faults.burst, self.rng)
        self.start = start
        self.copy = copy
        self.stats = ChannelStats()
        self._queue: list[tuple[float, int, T]] = []
        self._order = itertools.count()
        self._held: T | None = None

    def in_outage(self, now: float) -> bool:
        t = now - self.start
        return any(start <= t < start + length for start, length in self.faults.outages)

    def offer(self, message: T, now: float) -> None:
        """Take a message; it comes out of `due()` later, or never."""
        self.stats.offered += 1
        if self.in_outage(now):
            self.stats.lost += 1
            self.stats.lost_in_outage += 1
            return
        if self.loss.lost():
            self.stats.lost += 1
            return
        copies = 1
        if self.faults.duplicate and self.rng.random() < self.faults.duplicate:
            copies = 2
            self.stats.duplicated += 1
        held, self._held = self._held, None
        if self.faults.reorder and held is None and self.rng.random() < self.faults.reorder:
            # Held back until the next message has gone: the two swap places.
            self._held = self.copy(message)
            self.stats.reordered += 1
            copies -= 1
        delayed = bool(self.faults.delay_ms or self.faults.jitter_ms)
        for _ in range(copies):
            # A message that waits in the queue must not change under us (it may be a zero-copy view).
            self._schedule(self.copy(message) if delayed else message, now)
        if held is not None:
            self._schedule(held, now)

    def _schedule(self, message: T, now: float) -> None:
        delay = self.faults.delay_ms
        if self.faults.jitter_ms:
            delay = max(0.0, self.rng.gauss(delay, self.faults.jitter_ms))
        heapq.heappush(self._queue, (now + delay / 1000.0, next(self._order), message))

    def due(self, now: float) -> list[T]:
        out = []
        while self._queue and self._queue[0][0] <= now:
            out.append(heapq.heappop(self._queue)[2])
        return out

    def clear(self) -> int:
        """Drop every message not delivered yet (its connection is gone); returns how many."""
        dropped = len(self)
        self._queue.clear()
        self._held = None
        self.stats.lost += dropped
        return dropped

    def next_due(self) -> float:
        return self._queue[0][0] if self._queue else math.inf

    def __len__(self) -> int:
        return len(self._queue) + (self._held is not None)


class TokenBucket:
    """A bandwidth cap: `rate` bytes per second, at most `depth` bytes back to back.

    A message larger than the depth waits for a full bucket and leaves it in debt,
    so big messages pass at the capped average rate instead of never passing.
    """

    def __init__(self, rate: float, depth: float, now: float) -> None:
        if rate <= 0 or depth <= 0:
            raise ValueError(f"token bucket: rate and depth must be positive, got {rate} and {depth}")
        self.rate = rate
        self.depth = depth
        self.tokens = depth
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.depth, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def ready_at(self, size: int, now: float) -> float:
        """When a message of `size` bytes may leave (now, or later)."""
        self._refill(now)
        need = min(float(size), self.depth)
        return now if self.tokens >= need else now + (need - self.tokens) / self.rate

    def take(self, size: int, now: float) -> None:
        """A message of `size` bytes leaves now."""
        self._refill(now)
        self.tokens -= size


@dataclass
class Backoff:
    """Exponential backoff with full jitter (the one retry schedule; Flower and AWS use the same)."""

    first_s: float = 0.2
    cap_s: float = 5.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        # The exponent stops growing long after the cap is reached: 2.0**1024 overflows, which
        # crashed an edge's I/O thread after 1,024 unanswered tries (hellos at 95% loss: 25 s).
        ceiling = min(self.cap_s, self.first_s * 2.0 ** min(self.attempt, 64))
        self.attempt += 1
        return self.rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0


RATE_SAMPLE_MIN_BYTES = 32 * 1024  # a smaller message's timing is the path's latency, not its rate
RATE_WINDOW_S = 30.0  # a link's rate is the largest lower bound measured this recently


class RecentMax:
    """The largest sample of the last `window_s` seconds (the newest, if all are older).

    Rate samples taken from message timings are lower bounds (an idle link or a late
    answer only makes them lower), so the estimate is the largest recent one, as BBR
    estimates a bottleneck's bandwidth: an average of lower bounds drifts down, and a
    sender paced by it makes that the link's speed.  The edge's link meter and the
    gateway's delivery pace both use it.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        # A monotonic queue: a sample no larger than a newer one can never be the maximum again,
        # so the front is the maximum and both calls cost O(1) amortised (the gateway samples
        # every message of every edge on its receive loop).
        while self._samples and self._samples[-1][1] <= value:
            self._samples.pop()
        self._samples.append((now, value))
        while len(self._samples) > 1 and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    @property
    def value(self) -> float | None:
        return self._samples[0][1] if self._samples else None
