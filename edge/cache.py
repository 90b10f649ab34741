"""The edge's CPU-side gradient cache: per unit, what is not yet sent and the one unanswered send.

Each unit (one layer, or small layers packed together) owns a fixed number of
host buffers, whatever the number of steps or the length of an outage (the
bound is `bound_bytes`; the README's "Bounded memory" states it):

- `pending`: the sum of step-gradients produced since the last send, with their
  count (backward adds into it; a sync hands it over);
- `flight`: the one send of this unit the gateway has not answered yet.  Its
  bytes never change while it is unanswered, so a re-send after a lost ack has
  the same sequence number and content, and the gateway's (client, seq)
  de-duplication makes it count once.  A flight that missed its deadline is
  *weakly synced*; it stays here and is re-sent when the link answers again.

Merging a weak flight into `pending` would save one buffer but could count
twice: a lost *ack* is indistinguishable from a lost push until the gateway
answers.  So new gradients of a unit whose flight is unanswered wait in
`pending` (their count grows, their memory does not) until it is answered.

Acknowledged is not yet durable: a gateway that checkpoints says, with each ack,
which checkpoint (`epoch`, a checkpoint number) will hold the push, and later that
the checkpoint is on disk (a commit).  Until then the push's buffer is *held*:
acknowledged pushes of a unit with the same gateway instance and epoch are
summed into one held buffer, and a unit with `MAX_HELD` held buffers takes no
new flight (its pending count grows instead), so held sums add at most `MAX_HELD`
buffers per unit whatever the commit delay.  If the gateway instance dies before
its checkpoint, the held sums go back into `pending` and are sent again (see
`lost_to_pending`); the restarted gateway never saw them, so they count once.

Under uplink compression (edge/compression.py) `take` encodes `pending + residual`
once, keeps the wire payloads in the flight (a re-send is the same bytes), the
decoded sum in the flight's buffer (what the gateway will add, and what goes
back to `pending` if a gateway dies before its checkpoint), and the difference
in the unit's `residual`, which enters the next flight.  So the *mass* audit
holds per unit: produced == applied + dropped + residual + pending + flight.
With `audit=True` the cache keeps float64 sums of what was produced and dropped
to check it (a copy of every unit: for tests and benchmarks).

For the edge's own restarts (edge/persistence.py): a sum a save recorded as
*pending* must not leave before a later save records it as a flight, or a crash
in between would reload it as pending and send it again under a new sequence
number.  So the flight a unit takes after such a save starts in `SAVE_FIRST` until
the next save (which the session makes at once); a flight recorded by a save
keeps its seq, and the gateway answers a re-send of it as a duplicate.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from elasticfed.protocol.payload import Payload, payload_bytes

if TYPE_CHECKING:
    from elasticfed.edge.compression import Compression


class FlightState(enum.Enum):
    """Where an unanswered push is.  The cache creates a flight; edge/flights.py alone moves it on.

    SAVE_FIRST -> QUEUED (a save recorded it) -> OUTSTANDING (sent) -> WEAK (its deadline
    passed, its connection was replaced, or the gateway sent it back unjudged) -> OUTSTANDING
    (re-sent) ...; an answer with a verdict ends it from any state.
    """

    SAVE_FIRST = "save_first"  # holds a sum the last save recorded as pending: no send before the next save
    QUEUED = "queued"  # taken; its first send waits for credit or for room on the link
    OUTSTANDING = "outstanding"  # sent; its deadline has not passed
    WEAK = "weak"  # unanswered and not outstanding: it goes again (on an answer, or on a timer)


@dataclass
class Flight:
    """One unanswered send of a unit."""

    seq: int
    buffer: torch.Tensor
    count: int
    base_version: int
    first_sent: float
    deadline: float
    last_sent: float = 0.0
    state: FlightState = FlightState.QUEUED
    missed: bool = False  # missed a deadline at least once: its answer is late, not strong
    release: Any = None  # object with .done once the transport no longer reads `buffer`
    attempts: int = 0  # re-sends so far (the push's `attempt` is this number when sent)
    resend_at: float = 0.0  # when a weak flight goes again if no answer came first
    payloads: tuple[Payload, ...] | None = None  # per layer, as sent; None: dense views of `buffer`
    wire_bytes: int = 0  # payload bytes of one send

    def __post_init__(self) -> None:
        if not self.wire_bytes:
            self.wire_bytes = self.buffer.numel() * self.buffer.element_size()


@dataclass
class Held:
    """Acknowledged pushes of a unit, summed, that the gateway has not yet written to disk."""

    instance: str  # the gateway instance that acknowledged them
    epoch: int  # durable once that instance has written checkpoint number `epoch`
    buffer: torch.Tensor
    count: int
    base_version: int
    release: Any = None  # as Flight.release, for the buffer's last send


MAX_HELD = 2  # held sums per unit; at this many the unit waits for a commit before sending again


@dataclass(frozen=True)
class SavedFlight:
    """An unanswered push as saved: it goes again after a restart under the same seq and bytes."""

    seq: int
    count: int
    base_version: int
    buffer: torch.Tensor  # the sum the gateway adds (decoded, when compressed)
    payloads: tuple[Payload, ...] | None = None  # compressed: per layer, as sent


@dataclass(frozen=True)
class SavedHeld:
    """A held sum as saved: acknowledged by `instance`, durable with its checkpoint `epoch`."""

    instance: str
    epoch: int
    count: int
    base_version: int
    buffer: torch.Tensor


@dataclass(frozen=True)
class UnitSnapshot:
    """One unit's state worth saving, as values: what edge/persistence.py writes and reads back."""

    pending_count: int = 0
    pending_base: int = 0
    produced: int = 0
    durable: int = 0
    dropped: int = 0
    pending: torch.Tensor | None = None  # None when pending_count is 0
    flight: SavedFlight | None = None
    residual: torch.Tensor | None = None  # the error-feedback residual (compression)
    held: tuple[SavedHeld, ...] = ()
    mass: tuple[torch.Tensor, torch.Tensor] | None = None  # (produced, dropped) float64: audit only


def _free(release: Any) -> bool:
    return release is None or getattr(release, "done", True)


@dataclass
class UnitState:
    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    pending: torch.Tensor
    pending_count: int = 0
    pending_base: int = 0
    flight: Flight | None = None
    spare: torch.Tensor | None = None
    # GPU path: a device-to-host copy in progress into `staging`, added into pending once done.
    staging: torch.Tensor | None = None
    staged_event: Any = None
    staged: bool = False
    staged_first: bool = False
    produced: int = 0  # step-gradients ever added (for the count audit)
    saved_pending: bool = False  # the last save recorded this pending sum (see the module docstring)
    held: list[Held] = field(default_factory=list)
    durable: int = 0  # step-gradients the gateway declared durable (for the count audit)
    dropped: int = 0  # step-gradients the gateway refused or dropped as too stale
    residual: torch.Tensor | None = None  # what compressed flights did not carry (error feedback)
    produced_mass: torch.Tensor | None = None  # float64 sum of every step-gradient (audit only)
    dropped_mass: torch.Tensor | None = None  # float64 sum of refused flights (audit only)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer tensors over a unit buffer (contiguous, so they encode without a copy)."""
        return [
            buffer[start : start + math.prod(shape)].view(shape)
            for start, shape in zip(self.offsets, self.shapes)
        ]


class GradientCache:
    """Pending sums, unanswered sends and held sums for every unit; bounded (`bound_bytes`)."""

    def __init__(
        self,
        units: Sequence[Sequence[tuple[str, tuple[int, ...], torch.dtype]]],
        pin_memory: bool = False,
        compression: Compression | None = None,
        audit: bool = False,
    ) -> None:
        self.lock = threading.Lock()
        self.pin_memory = pin_memory
        self.compression = compression if compression is not None and compression.lossy else None
        self.audit = audit
        # The learning rate every sum here is in units of (edge/agent.py): the first rate a step ran
        # at, kept for good (saved) so sums cached before a schedule changed it still add up.
        self.lr: float | None = None
        self.units: list[UnitState] = []
        for u, layers in enumerate(units):
            dtypes = {dtype for _, _, dtype in layers}
            if len(dtypes) != 1:
                raise ValueError(
                    f"unit {u} mixes dtypes {sorted(map(str, dtypes))}; plans keep one dtype per unit"
                )
            offsets, total = [], 0
            for _, shape, _ in layers:
                offsets.append(total)
                total += math.prod(shape)
            dtype = dtypes.pop()
            self.units.append(
                UnitState(
                    index=u,
                    names=tuple(n for n, _, _ in layers),
                    shapes=tuple(tuple(s) for _, s, _ in layers),
                    offsets=tuple(offsets),
                    numel=total,
                    dtype=dtype,
                    pending=self._buffer(total, dtype),
                )
            )
            unit = self.units[-1]
            if self.compression is not None:
                unit.residual = torch.zeros(total, dtype=dtype)
            if audit:
                unit.produced_mass = torch.zeros(total, dtype=torch.float64)
                unit.dropped_mass = torch.zeros(total, dtype=torch.float64)

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)

    # ------------------------------------------------------------- training thread
    def rate_unit(self, lr: float) -> float:
        """The rate the sums are in units of, fixed by the first positive `lr` offered."""
        if self.lr is None and lr > 0:
            self.lr = lr
        return self.lr if self.lr is not None else 1.0

    def add(self, u: int, grads: Sequence[torch.Tensor | None], base_version: int) -> None:
        """Add one step-gradient of unit `u` (None for a parameter unused this step: zero)."""
        unit = self.units[u]
        on_device = next((g for g in grads if g is not None and g.device.type != "cpu"), None)
        with self.lock:
            self.settle(unit)
            if unit.pending_count == 0:
                unit.pending_base = base_version
            if on_device is not None:
                self._stage(unit, grads, on_device.device)
            else:
                # An empty pending buffer holds stale bytes (buffers are recycled unzeroed): the
                # first step-gradient is copied in, later ones added. One memory pass either way.
                first = unit.pending_count == 0
                for view, grad in zip(unit.views(unit.pending), grads):
                    if grad is None:
                        if first:
                            view.zero_()
                    elif first:
                        view.copy_(grad.detach())
                    else:
                        view.add_(grad.detach())
            if unit.produced_mass is not None:
                for view, grad in zip(unit.views(unit.produced_mass), grads):
                    if grad is not None:
                        view.add_(grad.detach().to("cpu", torch.float64))
            unit.pending_count += 1
            unit.produced += 1

    def _stage(self, unit: UnitState, grads: Sequence[torch.Tensor | None], device: torch.device) -> None:
        # Asynchronous device-to-host copy into pinned memory; added into pending by the next
        # reader (`settle`), so backward never waits for the copy.
        if unit.staging is None:
            unit.staging = torch.zeros(unit.numel, dtype=unit.dtype, pin_memory=True)
        for view, grad in zip(unit.views(unit.staging), grads):
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        unit.staged_event, unit.staged = event, True
        unit.staged_first = unit.pending_count == 0

    @staticmethod
    def settle(unit: UnitState) -> None:
        """Fold a unit's staged sum (copied off the device, see `add`) into its pending sum; under
        `lock`.  Whoever reads `pending` settles first: the I/O thread, a save."""
        if unit.staged:
            unit.staged_event.synchronize()
            if unit.staged_first:
                unit.pending.copy_(unit.staging)
            else:
                unit.pending.add_(unit.staging)
            unit.staged = False

    # ------------------------------------------------------------------ I/O thread
    def take(self, u: int, seq: int, now: float, timeout_s: float) -> Flight | None:
        """Turn unit `u`'s pending sum into its flight, if it has one and no flight is unanswered."""
        unit = self.units[u]
        with self.lock:
            self.settle(unit)
            if unit.flight is not None or unit.pending_count == 0 or len(unit.held) >= MAX_HELD:
                return None
            fresh = unit.spare if unit.spare is not None else self._buffer(unit.numel, unit.dtype)
            unit.spare = None
            sent, payloads, wire = unit.pending, None, 0
            if self.compression is not None:
                sent, payloads, wire = self._compress(unit, fresh)
            elif unit.residual is not None:  # saved by a run that compressed: it goes out now
                unit.pending.add_(unit.residual)
                unit.residual = None
            flight = Flight(
                seq=seq,
                buffer=sent,
                count=unit.pending_count,
                base_version=unit.pending_base,
                first_sent=now,
                deadline=now + timeout_s,
                last_sent=now,
                payloads=payloads,
                wire_bytes=wire,
            )
            if unit.saved_pending:
                flight.state, unit.saved_pending = FlightState.SAVE_FIRST, False
            unit.flight = flight
            if self.compression is None:
                unit.pending = fresh
            unit.pending_count = 0
            return flight

    def _compress(
        self, unit: UnitState, fresh: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[Payload, ...], int]:
        """Encode pending + residual into `fresh` (the decoded flight); the rest becomes the residual.

        Buffers rotate, none is allocated: the summed pending becomes the residual, and the
        old residual buffer the next pending (its bytes are overwritten by the next first add).
        """
        assert self.compression is not None and unit.residual is not None
        total = unit.pending
        total.add_(unit.residual)
        payloads = tuple(
            self.compression.encode(view.reshape(-1), shape)
            for view, shape in zip(unit.views(total), unit.shapes)
        )
        for view, payload in zip(unit.views(fresh), payloads):
            view.copy_(payload.to_dense())
        total.sub_(fresh)
        unit.pending, unit.residual = unit.residual, total
        wire = sum(payload_bytes(p) for p in payloads)
        return fresh, payloads, wire

    def resolve(self, u: int, hold: tuple[str, int] | None = None, durable: bool = False) -> Flight | None:
        """The gateway answered the flight of unit `u`.

        `hold` = (gateway instance, epoch): it was applied but is not durable yet, so it is
        kept, summed with what that instance acknowledged for the same epoch.  Otherwise
        its buffer becomes the next spare; `durable`: it was applied and is on disk already.
        """
        unit = self.units[u]
        with self.lock:
            flight, unit.flight = unit.flight, None
            if flight is None:
                return None
            if hold is None:
                if durable:
                    unit.durable += flight.count
                self._recycle(unit, flight.buffer, flight.release)
                return flight
            instance, epoch = hold
            same = next((h for h in unit.held if h.instance == instance and h.epoch == epoch), None)
            if same is None:
                unit.held.append(
                    Held(instance, epoch, flight.buffer, flight.count, flight.base_version, flight.release)
                )
                return flight
            # Add into a buffer no send is still reading (a queued zero-copy re-send would
            # otherwise change under the transport), and let the other one go.
            if _free(same.release):
                same.buffer.add_(flight.buffer)
                self._recycle(unit, flight.buffer, flight.release)
            elif _free(flight.release):
                flight.buffer.add_(same.buffer)
                same.buffer, same.release = flight.buffer, None
            else:
                same.buffer = same.buffer + flight.buffer
                same.release = None
            same.count += flight.count
            same.base_version = min(same.base_version, flight.base_version)
            return flight

    def dropped(self, u: int, flight: Flight) -> None:
        """The gateway refused or dropped `flight` (answered, not applied): its work is gone."""
        unit = self.units[u]
        with self.lock:
            unit.dropped += flight.count
            if unit.dropped_mass is not None:
                unit.dropped_mass.add_(flight.buffer.double())

    def _recycle(self, unit: UnitState, buffer: torch.Tensor, release: Any) -> None:
        # Reuse the buffer only once the transport has let go of it (a zero-copy send may
        # still be queued); otherwise drop it and let the next take() allocate.
        if unit.spare is None and _free(release):
            unit.spare = buffer  # not zeroed: the next first add overwrites it

    # ---------------------------------------------------------------- snapshots
    def snapshot(self) -> list[UnitSnapshot]:
        """Every unit's state worth saving, consistent under the lock; from the I/O thread.

        The pending sum and the produced mass are copied (training adds into them); the flight,
        held sums and residual are shared, since only the I/O thread changes them.  Each pending
        sum is marked as saved: a flight taken from it waits for the next save (SAVE_FIRST).
        """
        out = []
        with self.lock:
            for unit in self.units:
                self.settle(unit)
                unit.saved_pending = unit.pending_count > 0
                flight = unit.flight
                mass = None
                if unit.produced_mass is not None and unit.dropped_mass is not None:
                    mass = (unit.produced_mass.clone(), unit.dropped_mass)
                out.append(
                    UnitSnapshot(
                        pending_count=unit.pending_count,
                        pending_base=unit.pending_base,
                        produced=unit.produced,
                        durable=unit.durable,
                        dropped=unit.dropped,
                        pending=unit.pending.clone() if unit.pending_count else None,
                        flight=None
                        if flight is None
                        else SavedFlight(
                            flight.seq, flight.count, flight.base_version, flight.buffer, flight.payloads
                        ),
                        residual=unit.residual,
                        held=tuple(
                            SavedHeld(h.instance, h.epoch, h.count, h.base_version, h.buffer)
                            for h in unit.held
                        ),
                        mass=mass,
                    )
                )
        return out

    def restore(self, units: Sequence[UnitSnapshot], lr: float | None, now: float) -> dict[int, int]:
        """Put a snapshot (checked by its reader: shapes, counts, finite values) into a cache that
        nothing has used yet.  Reloaded flights are weak and unsent on any connection: they go
        again once a gateway answers.  Returns seq -> unit of those flights, oldest first."""
        if len(units) != len(self.units):
            raise ValueError(f"a snapshot of {len(units)} units for a cache of {len(self.units)}")
        flights: dict[int, int] = {}
        with self.lock:
            for unit, saved in zip(self.units, units):
                unit.pending_count, unit.pending_base = saved.pending_count, saved.pending_base
                if saved.pending is not None:
                    unit.pending.copy_(saved.pending)
                unit.saved_pending = saved.pending_count > 0
                unit.produced, unit.durable, unit.dropped = saved.produced, saved.durable, saved.dropped
                # Copies: held sums are summed into in place, flights recycled as spares.
                unit.held = [
                    Held(h.instance, h.epoch, h.buffer.clone(), h.count, h.base_version) for h in saved.held
                ]
                if saved.residual is not None:
                    # Kept even if this run does not compress: the next push carries it.
                    unit.residual = saved.residual.clone()
                if saved.mass is not None and unit.produced_mass is not None:
                    unit.produced_mass, unit.dropped_mass = (t.clone() for t in saved.mass)
                f = saved.flight
                if f is not None:
                    unit.flight = Flight(
                        seq=f.seq,
                        buffer=f.buffer.clone(),
                        count=f.count,
                        base_version=f.base_version,
                        first_sent=now,
                        deadline=now,
                        last_sent=-math.inf,
                        state=FlightState.WEAK,
                        missed=True,
                        payloads=f.payloads,
                        wire_bytes=sum(payload_bytes(p) for p in f.payloads) if f.payloads else 0,
                    )
                    flights[f.seq] = unit.index
            if lr is not None:
                self.lr = lr
        return dict(sorted(flights.items()))

    # ------------------------------------------------------------------ durability
    def commit(self, instance: str, durable_epoch: int) -> list[int]:
        """`instance` has written checkpoint `durable_epoch`: release what it covers.

        Returns, per unit, the step-gradients that became durable.
        """
        released = [0] * len(self.units)
        with self.lock:
            for unit in self.units:
                keep = []
                for held in unit.held:
                    if held.instance == instance and held.epoch <= durable_epoch:
                        unit.durable += held.count
                        released[unit.index] += held.count
                        self._recycle(unit, held.buffer, held.release)
                    else:
                        keep.append(held)
                unit.held = keep
        return released

    def lost_to_pending(self, instance: str, durable_epoch: int) -> list[int]:
        """`instance` died with checkpoint `durable_epoch` as its newest: what it acknowledged
        after that was lost with it and goes back into `pending`, to be sent again.

        Call `commit` for the same instance first.  Returns, per unit, the step-gradients
        moved back.  Until the moved sums are persisted, no send may happen (the caller
        persists at once; see edge/persistence.py).
        """
        moved = [0] * len(self.units)
        with self.lock:
            for unit in self.units:
                keep = []
                for held in unit.held:
                    if held.instance != instance or held.epoch <= durable_epoch:
                        keep.append(held)
                        continue
                    self.settle(unit)
                    if unit.pending_count == 0:
                        unit.pending.copy_(held.buffer)
                        unit.pending_base = held.base_version
                    else:
                        unit.pending.add_(held.buffer)
                        unit.pending_base = min(unit.pending_base, held.base_version)
                    unit.pending_count += held.count
                    moved[unit.index] += held.count
                    self._recycle(unit, held.buffer, held.release)
                unit.held = keep
        return moved

    def holding(self) -> list[str]:
        """Gateway instances whose acknowledged pushes are held here, oldest first."""
        with self.lock:
            return list(dict.fromkeys(h.instance for u in self.units for h in u.held))

    def held_steps(self) -> int:
        """Step-gradients acknowledged but not yet durable (summed over units)."""
        with self.lock:
            return sum(h.count for u in self.units for h in u.held)

    # ------------------------------------------------------------------- accounting
    def undelivered(self) -> int:
        """Step-gradients (summed over units) not yet answered by the gateway."""
        with self.lock:
            return sum(u.pending_count + (u.flight.count if u.flight else 0) for u in self.units)

    def undelivered_by_unit(self) -> list[int]:
        """Per unit, step-gradients not yet answered (each counts for every layer of its unit)."""
        with self.lock:
            return [u.pending_count + (u.flight.count if u.flight else 0) for u in self.units]

    def host_bytes(self) -> int:
        """Bytes of host memory the cache holds now (the bounded-memory guarantee)."""
        with self.lock:
            total = 0
            for u in self.units:
                held = [h.buffer for h in u.held]
                flight = u.flight.buffer if u.flight else None
                for t in (u.pending, u.spare, u.staging, flight, u.residual, *held):
                    if t is not None:
                        total += t.numel() * t.element_size()
                if u.flight is not None and u.flight.payloads is not None:
                    total += u.flight.wire_bytes
            return total

    def bound_bytes(self) -> int:
        """The most `host_bytes()` can be: pending, flight and `MAX_HELD` held sums (+ staging on a GPU,
        + the residual and the flight's encoded payload under compression) per unit; a spare only
        exists when one of those does not."""
        per = 2 + MAX_HELD + (1 if self.pin_memory else 0) + (1 if self.compression is not None else 0)
        dense = sum(u.numel * u.dtype.itemsize for u in self.units)
        if self.compression is None:
            return per * dense
        # A flight's payloads are at most dense (`auto` may be at its dense rung).
        return (per + 1) * dense

    def wire_bytes(self, u: int) -> int:
        """Payload bytes of one push of unit `u` (what the link will carry)."""
        unit = self.units[u]
        if self.compression is None:
            return unit.numel * unit.dtype.itemsize
        return sum(
            self.compression.wire_bytes(math.prod(shape), unit.dtype.itemsize) for shape in unit.shapes
        )

    def mass(self, u: int) -> dict[str, torch.Tensor]:
        """Float64 sums of unit `u`'s gradient mass by where it is (the mass audit; `audit=True`).

        produced == applied by the gateway + dropped + residual + pending + flight, once every
        answered flight's verdict is in (held sums were applied: they are the gateway's).
        """
        unit = self.units[u]
        if unit.produced_mass is None or unit.dropped_mass is None:
            raise RuntimeError("the mass audit needs GradientCache(audit=True)")
        with self.lock:
            self.settle(unit)
            zero = torch.zeros(unit.numel, dtype=torch.float64)
            return {
                "produced": unit.produced_mass.clone(),
                "dropped": unit.dropped_mass.clone(),
                "residual": zero if unit.residual is None else unit.residual.double(),
                "pending": unit.pending.double() if unit.pending_count else zero,
                "flight": unit.flight.buffer.double() if unit.flight is not None else zero,
            }
