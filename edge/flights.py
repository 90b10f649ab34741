"""The edge session's unanswered pushes, oldest first: the one place a flight's state changes.

The cache (edge/cache.py) creates a flight when it takes a unit's pending sum and
ends it when the gateway's verdict comes; in between, every move between the
states of `FlightState` is a method here, so the session says *what happened*
(sent, missed its deadline, sent back unjudged, connection replaced, saved) and
this module says what that does to each flight.  It knows nothing of sockets,
credit or the link's rate: which flight goes next is asked of `due`, and
whether it may go now is the session's scheduler's business.
"""

from __future__ import annotations

from collections.abc import Iterator

from elasticfed.edge.cache import Flight, FlightState, GradientCache


class Flights:
    """Unanswered pushes by seq; seqs only grow, so the map stays oldest first."""

    def __init__(self, cache: GradientCache) -> None:
        self.cache = cache
        self._units: dict[int, int] = {}  # seq -> unit
        self._outstanding = 0  # flights in OUTSTANDING (counted: asked on every send)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._units)

    def __contains__(self, seq: int) -> bool:
        return seq in self._units

    def unit_of(self, seq: int) -> int | None:
        return self._units.get(seq)

    def flight(self, seq: int) -> Flight | None:
        u = self._units.get(seq)
        return None if u is None else self.cache.units[u].flight

    def __iter__(self) -> Iterator[tuple[int, Flight]]:
        """(unit, flight), oldest first; a snapshot, so the caller may change states meanwhile."""
        for u in list(self._units.values()):
            flight = self.cache.units[u].flight
            if flight is not None:
                yield u, flight

    def oldest(self, default: int) -> int:
        """The oldest unanswered seq, or `default` (the next seq) when none is."""
        return next(iter(self._units), default)

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def waiting(self) -> bool:
        """Some flight waits to be sent (again): the link should be asked whether it works."""
        return len(self._units) > self._outstanding

    def due(self, now: float, answered_since: float, on_timer: bool) -> list[tuple[int, Flight]]:
        """Flights that should go now, oldest first: those waiting for their first send, and weak
        ones sent before a request the gateway has since answered (on a FIFO link their answer
        would have come first) or, with `on_timer` (a link that loses messages), due on their timer."""
        out = []
        for u, flight in self:
            if flight.state is FlightState.QUEUED:
                out.append((u, flight))
            elif flight.state is FlightState.WEAK and (
                flight.last_sent < answered_since or (on_timer and now >= flight.resend_at)
            ):
                out.append((u, flight))
        return out

    def overdue(self, now: float) -> list[tuple[int, Flight]]:
        return [(u, f) for u, f in self if f.state is FlightState.OUTSTANDING and now >= f.deadline]

    def deadlines(self) -> list[float]:
        return [f.deadline for _u, f in self if f.state is FlightState.OUTSTANDING]

    def resend_times(self) -> list[float]:
        """When weak flights go again on their timer (used on a link that loses messages)."""
        return [f.resend_at for _u, f in self if f.state is FlightState.WEAK]

    # ------------------------------------------------------------------ moving on
    def add(self, u: int, flight: Flight) -> None:
        """A flight the cache just took (or a saved state reloaded) for unit `u`."""
        assert not self._units or flight.seq > next(reversed(self._units)), "seqs only grow"
        self._units[flight.seq] = u
        if flight.state is FlightState.OUTSTANDING:
            self._outstanding += 1

    def sent(self, flight: Flight, now: float, deadline: float, resend_s: float) -> None:
        """Sent (first time or again): outstanding until `deadline`."""
        if flight.state is FlightState.WEAK:
            flight.attempts += 1
            flight.resend_at = now + resend_s
        else:
            flight.first_sent = now
        flight.last_sent = now
        flight.deadline = deadline
        self._set(flight, FlightState.OUTSTANDING)

    def missed(self, flight: Flight, resend_s: float) -> bool:
        """Its deadline passed, or the connection it went out on is gone: weak.  True the first
        time this flight misses (a weak sync to count)."""
        if flight.state is FlightState.OUTSTANDING:
            flight.resend_at = flight.last_sent + resend_s
            self._set(flight, FlightState.WEAK)
        first, flight.missed = not flight.missed, True
        return first

    def sent_back(self, flight: Flight, forget_attempts: bool = False) -> None:
        """The gateway answered without judging it (window full, not welcomed), or the link refused
        the send: weak again, not a miss.  `forget_attempts`: a new gateway instance, to which the
        copies sent so far do not count."""
        if flight.state is FlightState.OUTSTANDING:
            self._set(flight, FlightState.WEAK)
        if forget_attempts:
            flight.attempts = 0

    def connection_replaced(self, resend_s: float) -> list[tuple[int, Flight]]:
        """What was outstanding is lost with the connection (copies are counted per connection);
        returns the flights that missed here."""
        missed = []
        for u, flight in self:
            if flight.state is FlightState.OUTSTANDING and self.missed(flight, resend_s):
                missed.append((u, flight))
            flight.attempts = 0
        return missed

    def saved(self) -> None:
        """A save recorded every flight: none holds a sum recorded only as pending any more."""
        for _u, flight in self:
            if flight.state is FlightState.SAVE_FIRST:
                self._set(flight, FlightState.QUEUED)

    def answered(self, seq: int) -> int | None:
        """The gateway judged `seq`: it leaves (the cache resolves its buffer); its unit, if it was here."""
        u = self._units.pop(seq, None)
        if u is not None:
            flight = self.cache.units[u].flight
            if flight is not None and flight.state is FlightState.OUTSTANDING:
                self._outstanding -= 1
        return u

    def _set(self, flight: Flight, state: FlightState) -> None:
        if flight.state is FlightState.OUTSTANDING:
            self._outstanding -= 1
        if state is FlightState.OUTSTANDING:
            self._outstanding += 1
        flight.state = state
