"""How long each edge takes to deliver one contribution to every layer, measured at the gateway.

A round closes when `quorum` edges covered every layer or a deadline after its
first contribution passes.  A fixed deadline suits fast links; on a 10 Mbit/s
uplink one contribution to a 26 MB model takes some 25 s, so a 5 s deadline
closes rounds holding a layer or two (measured: rounds of 1 step-gradient every
5-10 s), every one a new version that obsoletes the downloads in progress and
ages every push in flight.  The round policy stretches its deadline by the time
the contributing edges need to deliver a whole contribution, which this module
measures from nothing but arrivals: no clock of the edge's, no new field.

Per edge: the rate of its uplink, sampled as the bytes that arrived over the
last few seconds (at least SPAN_S) over the time since the first of them (on a
busy FIFO link: the link's rate; an idle edge makes the sample lower, so the
estimate is the largest recent one, `common.link.RecentMax`, as the edge's own
link meter takes it).  A span of seconds, not one message's gap: after a TCP
retransmission the messages queued behind the lost segment arrive together, and
one 256 KB push over the millisecond since the previous read as gigabits per
second (measured at 10 Mbit/s and 2% loss: rounds stretched by a third of the
time a contribution took).  And the ratio of its pushes' wire bytes to their
dense size (compression makes contributions smaller).  Delivery time = ratio x
dense model bytes / rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from elasticfed.common.link import RATE_SAMPLE_MIN_BYTES, RecentMax

SPAN_S = 4.0  # a rate sample covers at least this long: bursts after a retransmission average out


@dataclass
class _Edge:
    arrivals: deque[tuple[float, int]] = field(default_factory=deque)  # (when, bytes), the last spans
    span_bytes: int = 0  # the sum of `arrivals`' bytes
    rate: RecentMax = field(default_factory=RecentMax)  # bytes/s
    wire_ratio: float = 1.0


class DeliveryPace:
    """Per edge: seconds to deliver a contribution to every layer, once its link was sampled."""

    def __init__(self, model_bytes: int) -> None:
        if model_bytes < 1:
            raise ValueError(f"model_bytes must be >= 1, got {model_bytes}")
        self.model_bytes = model_bytes
        self._edges: dict[str, _Edge] = {}

    def arrived(self, client: str, nbytes: int, now: float, dense_bytes: int = 0) -> None:
        """A message of `nbytes` from `client` was received now; a push says its layers' dense size."""
        edge = self._edges.setdefault(client, _Edge())
        if dense_bytes > 0:
            edge.wire_ratio = min(1.0, nbytes / dense_bytes)
        arrivals = edge.arrivals
        arrivals.append((now, nbytes))
        edge.span_bytes += nbytes
        while len(arrivals) > 2 and now - arrivals[1][0] >= SPAN_S:
            edge.span_bytes -= arrivals.popleft()[1]  # keep the newest stretch that still spans SPAN_S
        first, first_bytes = arrivals[0]
        carried = edge.span_bytes - first_bytes  # what came after the first
        if now - first >= SPAN_S and carried >= RATE_SAMPLE_MIN_BYTES:
            edge.rate.add(carried / (now - first), now)

    def delivery_s(self, client: str) -> float | None:
        """None until the edge's link was sampled (then a round waits only its configured deadline)."""
        rate = None if client not in self._edges else self._edges[client].rate.value
        return None if rate is None else self._edges[client].wire_ratio * self.model_bytes / rate

    def forget(self, client: str) -> None:
        self._edges.pop(client, None)
