"""How the gateway turns edge contributions into one update: weighting and round policies.

Small policy objects, in the spirit of Flower's `Strategy`:

- a `Weighting` says whether a contribution is admitted at its staleness and
  how much its sum is discounted;
- an `Aggregation` makes the per-layer accumulators: the mean (a running sum,
  the default) or a robust statistic over devices (coordinate-wise median or
  trimmed mean) for fleets that may hold faulty or hostile devices;
- a `RoundPolicy` says when the open round closes.

`Buffered` (the default, `--gateway-weighting buffered`) is the success-weighted
rule of DESIGN.md section 6, the way FedBuff buffers asynchronous updates: a
contribution's sum over c local steps is how far the edge's own model moved (times
its learning rate), so it weighs as many steps as it successfully synced, and the
update is the sum of those moves over max(contributions, quorum).  A device whose
pushes were weak is therefore not under-weighted, only late.

`MeanStep` (`mean-step`) divides a layer's sum by the number of step-gradients
in it: one mean step per round, however many local steps it carries.  Where every
push carries one step the two agree; where a lossy link makes an edge deliver a
thousand steps at once, the mean step throws that local progress away (measured:
`cloud serve`, 2 edges at 30% loss, the gateway killed and restarted 3 times,
25.6% digits accuracy against 96.7% buffered; 13-19% at 95% loss in
benchmarks/convergence.py).  It stays for gradient-like contributions of one step
each, where it is the plain average.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from elasticfed.protocol.payload import Payload, Sparse


def contribution(payload: Payload) -> torch.Tensor:
    """What a pushed payload adds to its layer: the flat layer as a sparse COO tensor for a sparse
    payload (an accumulator adds its k entries), the dense layer otherwise."""
    return payload.to_sparse_coo() if isinstance(payload, Sparse) else payload.to_dense()


def entries(tensor: torch.Tensor) -> torch.Tensor:
    """The values a contribution holds: what finiteness and norms read (a sparse one's indices are
    unique, so its norm is the layer's)."""
    return tensor.values() if tensor.is_sparse else tensor


class Weighting(Protocol):
    """Admission and weight of a contribution: its staleness (model versions behind) and count."""

    def admit(self, staleness: int) -> bool: ...

    def scale(self, staleness: int, lr: float | None = None) -> float:
        """Factor on the contribution's sum; `lr`: the rate the edge says its sum is in units of."""
        ...

    def share(self, count: int) -> int:
        """What the contribution adds to the divisor of its layer's average."""
        ...

    def min_divisor(self) -> int:
        """The divisor of a layer's average is at least this (however few contributed)."""
        ...


def staleness_weight(staleness: int, discount: float = 1.0, exponent: float = 0.0) -> float:
    """(1 + s)^-exponent (FedBuff's and FedScale's 1/sqrt(1 + s) at 0.5) x discount^s.

    A step-gradient computed on a model s versions old points where that model
    needed to go; early in training such gradients are large, and applied at full
    weight to a model that moved on they undo its progress (measured on the base
    text task at 10 Mbit/s: 4.9 bits per byte at 90 s, back to 7.5 at 210 s).
    """
    return (1.0 + staleness) ** -exponent * discount**staleness


@dataclass(frozen=True)
class MeanStep:
    """sum(staleness_weight(s) * sums) / sum(counts); older than `max_staleness`: dropped, counted."""

    max_staleness: int = 8
    discount: float = 1.0
    exponent: float = 0.0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"staleness discount must be in (0, 1], got {self.discount}")
        if not 0.0 <= self.exponent <= 4.0:
            raise ValueError(f"staleness exponent must be in [0, 4], got {self.exponent}")

    def admit(self, staleness: int) -> bool:
        return staleness <= self.max_staleness

    def scale(self, staleness: int, lr: float | None = None) -> float:
        # A mean step is in gradient units whatever rate the edge ran at: the gateway's own rate
        # makes it a move.
        return staleness_weight(staleness, self.discount, self.exponent)

    def share(self, count: int) -> int:
        return count

    def min_divisor(self) -> int:
        return 1


@dataclass(frozen=True)
class Buffered:
    """sum of (lr / gateway_lr) * discount**staleness * sum, over max(contributions, expected).

    `lr` is the learning rate the contribution says its sum is in units of (each
    step entered it times its own rate over that one, edge/agent.py), so lr x sum
    is how far the edge's model moved, whatever rates and schedules each edge ran;
    `edge_lr` stands in for an edge that does not say.  The ratio turns that move
    into a gradient for the gateway's optimizer: with plain SGD and a full round
    the update is exactly the mean of the edges' moves (FedAvg).  A round that
    closed on its deadline with fewer contributions than `expected` (the quorum)
    still divides by `expected`, as FedBuff divides by its buffer size: otherwise
    one edge's delivery of hundreds of local steps would move the whole model as
    far as that edge moved, and the next round another edge's would pull it back
    (measured at 1 Mbit/s: the final accuracy swung between 82% and 95%).
    """

    edge_lr: float
    gateway_lr: float
    max_staleness: int = 8
    discount: float = 1.0
    expected: int = 1
    exponent: float = 0.0

    def __post_init__(self) -> None:
        if self.edge_lr <= 0 or self.gateway_lr <= 0:
            raise ValueError(
                f"learning rates must be > 0, got edge {self.edge_lr}, gateway {self.gateway_lr}"
            )
        MeanStep(self.max_staleness, self.discount, self.exponent)  # same checks
        if self.expected < 1:
            raise ValueError(f"expected contributions must be >= 1, got {self.expected}")

    def admit(self, staleness: int) -> bool:
        return staleness <= self.max_staleness

    def scale(self, staleness: int, lr: float | None = None) -> float:
        rate = lr or self.edge_lr
        return rate / self.gateway_lr * staleness_weight(staleness, self.discount, self.exponent)

    def share(self, count: int) -> int:
        return 1

    def min_divisor(self) -> int:
        return self.expected


class Accumulator(Protocol):
    """One layer's contributions in the open round."""

    def add(self, client: str, tensor: torch.Tensor, count: int, scale: float) -> None:
        """Add a (scaled) sum; `count` is its share of the divisor (see `Weighting.share`).

        `tensor` is the layer (any shape), or the flat layer as a coalesced sparse COO tensor: a
        top-k push of 1% adds its k entries, not the layer's n (100x less gateway work per push).
        """
        ...

    def average(self, min_divisor: int = 1) -> torch.Tensor | None:
        """The layer's update for the round (None: nobody contributed)."""
        ...

    def reset(self) -> None: ...


class LayerAccumulator:
    """Running discounted sum and count of one layer's contributions in the open round."""

    __slots__ = ("count", "total")

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.total = torch.empty(numel, dtype=dtype)
        self.count = 0

    def add(self, client: str, tensor: torch.Tensor, count: int, scale: float) -> None:
        """Add a (scaled) sum; `count` is its share of the divisor (see `Weighting.share`)."""
        if tensor.is_sparse:
            if self.count == 0:
                self.total.zero_()
            values = tensor.values().to(self.total.dtype)
            self.total.index_add_(0, tensor.indices()[0], values, alpha=scale)
            self.count += count
            return
        flat = tensor.reshape(-1)
        if self.count == 0:  # the first contribution of the round overwrites (no zeroing pass)
            if scale == 1.0:
                self.total.copy_(flat)
            else:
                torch.mul(flat, scale, out=self.total)
        elif scale == 1.0:
            self.total.add_(flat)
        else:
            self.total.add_(flat, alpha=scale)
        self.count += count

    def average(self, min_divisor: int = 1) -> torch.Tensor | None:
        return self.total / max(self.count, min_divisor) if self.count else None

    def reset(self) -> None:
        self.count = 0


class PerDeviceAccumulator:
    """Each device's own average of the layer, then a robust statistic across devices.

    Memory is one buffer per device that contributed in the round (DESIGN.md
    guarantee 2 allows growth with the number of clients, not with messages).
    The result is scaled by devices / max(devices, min_divisor), the same rule
    as the mean's divisor, so a deadline round with few devices moves as little.
    """

    __slots__ = ("numel", "reduce", "sums")

    def __init__(self, numel: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.numel = numel
        self.reduce = reduce
        self.sums: dict[str, list] = {}  # client -> [sum tensor, count]

    def add(self, client: str, tensor: torch.Tensor, count: int, scale: float) -> None:
        flat = (tensor.to_dense() if tensor.is_sparse else tensor).reshape(-1).to(torch.float32)
        entry = self.sums.get(client)
        if entry is None:
            self.sums[client] = [flat * scale, count]
        else:
            entry[0].add_(flat, alpha=scale)
            entry[1] += count

    def average(self, min_divisor: int = 1) -> torch.Tensor | None:
        if not self.sums:
            return None
        means = torch.stack([total / max(count, 1) for total, count in self.sums.values()])
        devices = means.shape[0]
        return self.reduce(means) * (devices / max(devices, min_divisor))

    def reset(self) -> None:
        self.sums.clear()


def coordinate_median(values: torch.Tensor) -> torch.Tensor:
    """Median over dim 0; with an even count, the mean of the two middle values."""
    n = values.shape[0]
    ordered = values.sort(dim=0).values
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


class Aggregation(Protocol):
    """Makes the accumulator of each layer: how contributions become one update."""

    name: str

    def accumulator(self, numel: int) -> Accumulator: ...


@dataclass(frozen=True)
class MeanAggregation:
    """The weighted mean (DESIGN.md section 6): a running sum, one buffer per layer."""

    name: str = "mean"

    def accumulator(self, numel: int) -> Accumulator:
        return LayerAccumulator(numel)


@dataclass(frozen=True)
class CoordinateMedian:
    """Per coordinate, the median of the devices' averages: one bad device of three cannot move it
    outside the honest devices' range."""

    name: str = "median"

    def accumulator(self, numel: int) -> Accumulator:
        return PerDeviceAccumulator(numel, coordinate_median)


@dataclass(frozen=True)
class TrimmedMean:
    """Per coordinate, drop the `trim` share (rounded up) of largest and of smallest device averages,
    mean the rest; where that leaves nothing, the median."""

    trim: float = 0.2
    name: str = "trimmed_mean"

    def __post_init__(self) -> None:
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trimmed mean: trim must be in [0, 0.5), got {self.trim}")

    def accumulator(self, numel: int) -> Accumulator:
        return PerDeviceAccumulator(numel, self._reduce)

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        n = values.shape[0]
        k = math.ceil(self.trim * n)  # 0.2 of 3 or 4 devices still drops one at each end
        if n - 2 * k < 1:
            return coordinate_median(values)
        return values.sort(dim=0).values[k : n - k].mean(dim=0)


def aggregation_named(name: str, trim: float = 0.2) -> Aggregation:
    """The policy a config names: mean, median or trimmed_mean."""
    if name == "mean":
        return MeanAggregation()
    if name == "median":
        return CoordinateMedian()
    if name == "trimmed_mean":
        return TrimmedMean(trim)
    raise ValueError(f"unknown aggregation {name!r}: use mean, median or trimmed_mean")


@dataclass
class OpenRound:
    """What the gateway knows about the round being filled."""

    number: int
    layers: int
    opened_at: float | None = None  # first contribution
    covered: dict[str, set[int]] = field(default_factory=dict)  # client -> layer indices contributed
    steps: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    contributions: int = 0
    layer_steps: list[int] = field(default_factory=list)  # step-gradients added, per layer
    # Per layer, the sum of scale x steps added (what the update weighs them by): the step mass.
    layer_mass: list[float] = field(default_factory=list)
    # client -> seconds its link needs for a contribution to every layer (cloud/delivery.py)
    delivery_s: dict[str, float] = field(default_factory=dict)
    # client -> seconds its last model download took, as it said (ModelFetch.fetch_ms)
    fetch_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_steps:
            self.layer_steps = [0] * self.layers
        if not self.layer_mass:
            self.layer_mass = [0.0] * self.layers

    def record(
        self,
        client: str,
        layer_indices: list[int],
        count: int,
        staleness: int,
        now: float,
        delivery_s: float | None = None,
        fetch_s: float | None = None,
    ) -> None:
        if self.opened_at is None:
            self.opened_at = now
        if delivery_s is not None:
            self.delivery_s[client] = delivery_s
        if fetch_s is not None:
            self.fetch_s[client] = fetch_s
        self.covered.setdefault(client, set()).update(layer_indices)
        self.steps += count
        self.contributions += 1
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)

    def complete_clients(self) -> int:
        """Clients that contributed to every layer in this round."""
        return sum(1 for layers in self.covered.values() if len(layers) == self.layers)


class RoundPolicy(Protocol):
    """When the open round closes."""

    def should_close(self, round_: OpenRound, now: float) -> bool: ...

    def time_left(self, round_: OpenRound, now: float) -> float | None:
        """Seconds until the round would close on time alone (None: no deadline running)."""
        ...


@dataclass(frozen=True)
class DeadlineQuorum:
    """Close once `quorum` clients covered every layer, or at the deadline after the first contribution;
    never before the contributors can fetch the version it makes.

    The deadline is `deadline_s` plus the time the contributors' links need for one whole
    contribution (the quorum-th fastest; `OpenRound.delivery_s`), at most `max_stretch_s`:
    on a fast link that is nothing, on a slow one it keeps a round from closing on a layer
    or two and minting a version every few seconds that no download can keep up with.

    The minimum open time is the other direction of the same link: the time the contributors' last model
    downloads took (the quorum-th fastest; `OpenRound.fetch_s`), at most `max_stretch_s`.
    Compressed contributions are small: at 5 Mbit/s a 4.5 MB model's pushes completed a
    round every 0.28 s while a patch took a second to come down, so every edge trained on a
    model 4-8 versions old and 8% of its work was dropped as stale.  Versions no edge can
    hold only age the work in flight; a round that waits gathers more into one version.
    """

    deadline_s: float = 5.0
    quorum: int = 1
    max_stretch_s: float = 300.0

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.quorum < 1 or self.max_stretch_s < 0:
            raise ValueError(
                f"need deadline_s > 0, quorum >= 1 and max_stretch_s >= 0, got {self.deadline_s}, "
                f"{self.quorum}, {self.max_stretch_s}"
            )

    def should_close(self, round_: OpenRound, now: float) -> bool:
        if round_.opened_at is None:
            return False  # nothing to apply
        if now < round_.opened_at + self.min_open_s(round_):
            return False
        if round_.complete_clients() >= self.quorum:
            return True
        return now >= self.deadline(round_)

    def time_left(self, round_: OpenRound, now: float) -> float | None:
        if round_.opened_at is None:
            return None
        if round_.complete_clients() >= self.quorum:
            return round_.opened_at + self.min_open_s(round_) - now
        return max(self.deadline(round_), round_.opened_at + self.min_open_s(round_)) - now

    def deadline(self, round_: OpenRound) -> float:
        assert round_.opened_at is not None
        return round_.opened_at + self.deadline_s + self.stretch(round_)

    def stretch(self, round_: OpenRound) -> float:
        return self._quorum_th(round_.delivery_s)

    def min_open_s(self, round_: OpenRound) -> float:
        """Seconds a round stays open at least: what the contributors need to fetch a version."""
        return self._quorum_th(round_.fetch_s)

    def _quorum_th(self, seconds: dict[str, float]) -> float:
        times = sorted(seconds.values())
        if not times:
            return 0.0
        return min(self.max_stretch_s, times[min(self.quorum, len(times)) - 1])


@dataclass(frozen=True)
class CosineDecay:
    """Learning-rate factor for round r of `rounds`: half a cosine from 1 down to `floor`, then flat.

    A fleet's last rounds apply averages of whatever arrived late; a decayed step
    keeps them from shaking a model that has converged.
    """

    rounds: int
    floor: float = 0.05

    def __post_init__(self) -> None:
        if self.rounds < 1 or not 0.0 <= self.floor <= 1.0:
            raise ValueError(
                f"cosine decay needs rounds >= 1 and floor in [0, 1], got {self.rounds}, {self.floor}"
            )

    def __call__(self, round_number: int) -> float:
        progress = min(1.0, max(0, round_number - 1) / self.rounds)
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
