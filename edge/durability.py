"""What makes an edge's work survive crashes: its own saves, and the gateway's commits.

Two promises meet here.  The gateway's (DESIGN guarantee 1): a push it applied
is held in the cache until the checkpoint that holds it is on disk, which a
commit says; what a dead instance acknowledged but never wrote goes back to
pending and is sent again.  The edge's: with a state directory, a kill -9
loses at most `persist_every_s` of training, and nothing reloaded is counted
twice, because a pending sum leaves only after a save has recorded it as a
flight (edge/persistence.py says why that suffices).

So a save is due every `persist_every_s` when something changed, as soon as
half the gateway's verdict window is used since the last one (the gateway
keeps verdicts from the oldest seq a save could send again, `resolved_below`),
and at once, with nothing sent until it worked, whenever sending depends on it:
a welcome that told the edge which seqs are fresh, held sums moved back to
pending, a flight that holds a sum the last save recorded as pending.

It decides and records; the session supplies the next seq and takes pending
sums into flights just before a save (`take_pending`), since seqs are its.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from elasticfed.common.metrics import Counter
from elasticfed.edge.cache import GradientCache
from elasticfed.edge.flights import Flights
from elasticfed.edge.metrics import EdgeMetrics
from elasticfed.edge.persistence import EdgeState, Loaded
from elasticfed.protocol import Manifest

log = logging.getLogger("elasticfed.edge")

SAVE_RETRY_S = 0.5  # a save that failed (disk full, read-only) is tried again this soon
_INSTANCES_KEPT = 64  # gateway instances whose commits are remembered (older ones are long gone)

Hold = tuple[str, int]  # (gateway instance, checkpoint epoch) that will hold an applied push


class Durability:
    """The edge's save policy and the gateway's commits, over one cache and its flights."""

    def __init__(
        self,
        cache: GradientCache,
        flights: Flights,
        manifest: Manifest,
        state: EdgeState | None,
        persist_every_s: float,
        metrics: EdgeMetrics,
        now: float,
    ) -> None:
        self.cache = cache
        self.flights = flights
        self.manifest = manifest
        self.state = state  # None: nothing is saved (no state directory)
        self.persist_every_s = persist_every_s
        self.metrics = metrics
        self.must_save = False  # a save must succeed before anything more is sent
        self._retry_at = 0.0
        self._next_save = now + persist_every_s
        self._saved: tuple[int, ...] | None = None  # the state's signature at the last save
        # The lowest seq the saved state could send again after a crash: the gateway must keep
        # its verdict, or a reloaded push it refused would be taken for a duplicate of an
        # applied one.  None while a save is being written.
        self._saved_below: int | None = None
        self._durable_seen: dict[str, int] = {}  # instance -> newest checkpoint it said is on disk

    @property
    def saves(self) -> bool:
        return self.state is not None

    # ------------------------------------------------------------------- loading
    def load(self, seq: int, now: float) -> Loaded | None:
        """Fill the cache from the newest saved state, if any; its flights join `flights`."""
        loaded = None if self.state is None else self.state.load(self.cache, self.manifest, now)
        if loaded is not None:
            seq = loaded.seq
            for fseq, u in loaded.flights.items():
                flight = self.cache.units[u].flight
                assert flight is not None and flight.seq == fseq
                self.flights.add(u, flight)
            self._saved = self._signature(seq)
        if self.state is not None:
            self._saved_below = self.flights.oldest(seq)
        return loaded

    def resolved_below(self, seq: int) -> int:
        """The gateway may forget verdicts below this: every unanswered flight (sent or not yet,
        `seq` being the next one) and whatever the last save could send again are above it."""
        oldest = self.flights.oldest(seq)
        return oldest if self._saved_below is None else min(oldest, self._saved_below)

    # -------------------------------------------------------------------- saving
    def wake_times(self) -> list[float]:
        if self.state is None:
            return []
        return [self._next_save, self._retry_at] if self.must_save else [self._next_save]

    def save_before_sending(self) -> None:
        """Sending waits until the next save has worked (it is forced at the next tick)."""
        self.must_save = True

    def tick(self, now: float, seq: int, window: int, take_pending: Callable[[float], int]) -> None:
        """Save if one is due: on the period when something changed, to free the verdict window,
        or again after a forced save failed."""
        if self.state is None:
            return
        if now >= self._next_save or self._window_needs_save(seq, window):
            self.save(now, seq, take_pending)
        elif self.must_save and now >= self._retry_at:
            self.save(now, seq, take_pending, force=True)

    def save(self, now: float, seq: int, take_pending: Callable[[float], int], force: bool = False) -> bool:
        """Save when something changed since the last save (`force`: always, and nothing more is
        sent until it worked); True once the state on disk is current.

        `take_pending(now)` turns pending sums into flights and returns the next seq, so that
        the save records them as flights (a sum saved as pending is never sent before the
        next save).
        """
        if self.state is None:
            return False
        self._next_save = now + self.persist_every_s
        if not force and self._signature(seq) == self._saved and not self.must_save:
            return True
        if force:
            self.must_save = True
        below = self._saved_below
        self._saved_below = None  # what the save about to be written could re-send, not the last one
        seq = take_pending(now)
        try:
            self.state.save(self.cache, self.manifest, seq)
        except OSError as exc:  # a full or read-only disk must not stop training; say so
            self._saved_below = below
            self._retry_at = now + SAVE_RETRY_S
            log.error("could not save the edge state to %s: %s", self.state.store.directory, exc)
            return False
        self.must_save = False
        self.flights.saved()
        self._saved_below = self.flights.oldest(seq)
        self._saved = self._signature(seq)
        self.metrics.persists.inc()
        return True

    def close(self) -> None:
        if self.state is not None:
            self.state.store.close()

    def _signature(self, seq: int) -> tuple[int, ...]:
        """Changes whenever the state worth saving does (cheap: counts, not bytes)."""
        units = self.cache.units
        return (
            seq,
            sum(u.produced for u in units),
            sum(u.durable + u.dropped for u in units),
            len(self.flights),
            self.cache.held_steps(),
        )

    def _window_needs_save(self, seq: int, window: int) -> bool:
        """Half the gateway's verdict window is used since the last save, and a save would free it
        (waiting for `persist_every_s` would stall a fast edge on `window` refusals)."""
        below = self._saved_below
        if below is None or seq - below < window // 2:
            return False
        return self.flights.oldest(seq) > below

    # ------------------------------------------------------------------- commits
    def hold(self, instance: str, epoch: int) -> Hold | None:
        """Where an applied push waits to become durable: (instance, epoch) of the checkpoint that
        will hold it; None if it needs no wait (a gateway that does not checkpoint, or a
        checkpoint already on disk: a late or repeated verdict)."""
        if not epoch or not instance or epoch <= self._durable_seen.get(instance, 0):
            return None
        return (instance, epoch)

    def commit(self, instance: str, epoch: int) -> list[int]:
        """`instance` has written checkpoint `epoch`: release what it covers.  Returns, per unit,
        the step-gradients that became durable (all zero for a commit already seen)."""
        if not instance or epoch <= self._durable_seen.get(instance, 0):
            return [0] * len(self.cache.units)
        self._durable_seen[instance] = epoch
        while len(self._durable_seen) > _INSTANCES_KEPT:
            del self._durable_seen[next(iter(self._durable_seen))]
        released = self.cache.commit(instance, epoch)
        self._count(self.metrics.durable, released)
        return released

    def lost(self, durable: Sequence[tuple[str, int]], alive: str) -> tuple[list[int], list[int]]:
        """A welcome's answer about the instances whose pushes this edge holds: each is durable
        through a checkpoint; what an instance other than the `alive` one acknowledged beyond
        it died with it and goes back to pending.  Returns, per unit, the step-gradients
        released (durable) and those moved back, to be sent again after a save (a reload must
        not find them held *and* pending)."""
        released = [0] * len(self.cache.units)
        moved = [0] * len(self.cache.units)
        for instance, epoch in durable:
            released = _plus(released, self.commit(instance, epoch))
            if instance == alive:
                continue  # the rest of what it holds becomes durable with its next commits
            back = self.cache.lost_to_pending(instance, epoch)
            if any(back):
                log.warning(
                    "gateway instance %s died before writing %d acknowledged step-gradients of this "
                    "edge to disk (its newest checkpoint in this lineage is %d): sending them again",
                    instance,
                    sum(back),
                    epoch,
                )
                self._count(self.metrics.resent_lost, back)
                moved = _plus(moved, back)
        return released, moved

    def _count(self, counter: Counter, per_unit: Sequence[int]) -> None:
        for u, n in enumerate(per_unit):
            if n:
                for name in self.cache.units[u].names:
                    counter.inc(name, by=n)


def _plus(a: Sequence[int], b: Sequence[int]) -> list[int]:
    return [x + y for x, y in zip(a, b)]
