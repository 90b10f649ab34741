"""What a gateway remembers of one edge: where to answer it and the verdicts it may not have heard.

Exactly-once rests here: a push's verdict is kept until the edge says it no longer needs it
(`resolved_below`: every seq below it is resolved on the edge's side), so a re-sent copy gets
the first verdict again instead of being applied twice.  Checkpoints save `resolved_below` and
the verdicts (cloud/durability.py); the rest is this instance's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class ClientState:
    """What the gateway remembers of one edge: its route and its recent verdicts."""

    client_id: str
    route: bytes
    resolved_below: int = 0  # every seq below this is resolved on the edge's side
    # seq -> (code, attempt, epoch): code "" is applied; attempt is the copy of the push that was
    # judged; epoch the checkpoint that makes an applied push durable (0: none).
    verdicts: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # heap of the seqs in `verdicts`
    last_seen: float = 0.0
    # Said hello to this gateway instance.  Not so for a state restored from a checkpoint: the
    # edge must say hello (and learn of the restart) before a push is accepted.
    welcomed: bool = False
    # The newest epoch among applied verdicts forgotten below `resolved_below`: a duplicate from down
    # there was applied in a checkpoint up to it (see _on_push).
    forgotten_epoch: int = 0
    # The model version this edge is downloading (chunks served), and when it last asked: on a
    # slow link, versions published during a download are ones it could not have had (_on_push).
    fetching: int = 0
    fetched_at: float = float("-inf")
    # How long its last download took, as it says (ModelFetch.fetch_ms): rounds close no faster.
    fetch_s: float | None = None

    def record(self, seq: int, code: str, attempt: int, epoch: int = 0) -> None:
        self.verdicts[seq] = (code, attempt, epoch)
        heapq.heappush(self.order, seq)

    def pending(self, limit: int) -> tuple[tuple[int, str, int], ...]:
        """Verdicts the edge may not have heard yet (oldest first), for a cumulative acknowledgement."""
        seqs = self.order if len(self.order) <= limit else heapq.nsmallest(limit, self.order)
        return tuple((seq, self.verdicts[seq][0], self.verdicts[seq][2]) for seq in sorted(seqs))

    def resolve_below(self, seq: int) -> None:
        """The edge says it no longer needs verdicts below `seq`: forget them (bounded memory).
        It only ever rises: a late message naming a lower one changes nothing."""
        if seq <= self.resolved_below:
            return
        self.resolved_below = seq
        while self.order and self.order[0] < seq:
            verdict = self.verdicts.pop(heapq.heappop(self.order), None)
            if verdict is not None and not verdict[0]:
                self.forgotten_epoch = max(self.forgotten_epoch, verdict[2])
