"""How one sync unit's gradient crosses the ranks: `none`, `fp16`/`bf16`, `topk:<r>`, `powersgd:<k>`.

Each compressor is a small object per unit with three steps, shaped after DDP's
comm hooks: `start(flat)` during backward (the unit's gradient, already divided
by the world size, flattened), `advance()` for a second round of communication
(PowerSGD), and `finish()`, which waits and leaves the *sum over ranks* of the
contributions in the same `flat` tensor, identical on every rank.

Lossy compressors keep **error feedback**: what a step does not send stays in a
per-unit residual and is added to the next step's gradient, so for every unit

    sum over steps of what was sent  +  residual  ==  sum over steps of the gradients

(per rank for `fp16`/`bf16`/`topk`; summed over ranks for PowerSGD, whose error
is taken against the shared approximation, as in Vogels et al., 2019).
Every buffer is allocated once, when the unit is built; the hot path allocates
nothing of its own.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elasticfed.cloud.collectives import UnitComm


class Compressor(ABC):
    """One unit's gradient exchange; see the module docstring for the contract."""

    #: payload bytes this rank sends for this unit per step (what the collectives carry)
    wire_bytes: int = 0
    #: error-feedback residual (same shape as the flat gradient), or None for exact compressors
    residual: torch.Tensor | None = None

    @abstractmethod
    def start(self, flat: torch.Tensor) -> None:
        """Begin exchanging `flat` (this rank's gradient / world size); may modify it."""

    def advance(self) -> None:  # noqa: B027 - optional step, most methods have one round
        """Second round of communication, if the method has one; called in unit order."""

    @abstractmethod
    def finish(self) -> None:
        """Wait; leave the sum over ranks in the `flat` given to `start`."""


class AllReduce(Compressor):
    """No compression: one all-reduce in the gradient's own dtype, like DDP."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, comm: UnitComm) -> None:
        self.comm = comm
        self.wire_bytes = numel * _itemsize(dtype)
        self._work: dist.Work | None = None

    def start(self, flat: torch.Tensor) -> None:
        self._work = self.comm.all_reduce(flat)

    def finish(self) -> None:
        assert self._work is not None, "finish() without start()"
        self.comm.wait(self._work, "all-reduce")
        self._work = None


class CastCompressor(Compressor):
    """Send in half precision (fp16 or bf16); the rounding error is fed back next step."""

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, comm: UnitComm, wire: torch.dtype
    ) -> None:
        self.comm = comm
        self.wire = torch.empty(numel, dtype=wire, device=device)
        self.residual = torch.zeros(numel, dtype=dtype, device=device)
        self.wire_bytes = numel * _itemsize(wire)
        self._flat: torch.Tensor | None = None
        self._work: dist.Work | None = None

    def start(self, flat: torch.Tensor) -> None:
        assert self.residual is not None
        flat.add_(self.residual)
        self.wire.copy_(flat)
        self.residual.copy_(flat).sub_(self.wire)
        self._flat = flat
        self._work = self.comm.all_reduce(self.wire)

    def finish(self) -> None:
        assert self._work is not None and self._flat is not None, "finish() without start()"
        self.comm.wait(self._work, "all-reduce")
        self._flat.copy_(self.wire)
        self._work = self._flat = None


class TopKCompressor(Compressor):
    """Send the k largest-magnitude entries (values and indices); the rest waits in the residual.

    Sparse vectors from different ranks have different supports, so they cannot be
    summed by an all-reduce: every rank all-gathers every rank's (values, indices)
    in one packed byte buffer and adds them up in rank order, so all ranks hold the
    same sum.
    """

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, comm: UnitComm, ratio: float
    ) -> None:
        if numel >= 2**31:
            raise ValueError(f"top-k on {comm.label}: {numel} elements exceed int32 indices")
        self.comm = comm
        self.k = max(1, min(numel, math.ceil(ratio * numel)))
        vbytes = self.k * _itemsize(dtype)
        self.packed = torch.empty(vbytes + self.k * 4, dtype=torch.uint8, device=device)
        self.values = self.packed[:vbytes].view(dtype)
        self.indices = self.packed[vbytes:].view(torch.int32)
        self.gathered = torch.empty(comm.world, self.packed.numel(), dtype=torch.uint8, device=device)
        self.gathered_rows = list(self.gathered.unbind(0))
        self.magnitude = torch.empty(numel, dtype=dtype, device=device)
        self.top = torch.empty(self.k, dtype=dtype, device=device)
        self.top_idx = torch.empty(self.k, dtype=torch.int64, device=device)
        self.residual = torch.zeros(numel, dtype=dtype, device=device)
        self.wire_bytes = self.packed.numel()
        self._vbytes = vbytes
        self._dtype = dtype
        self._flat: torch.Tensor | None = None
        self._work: dist.Work | None = None

    def start(self, flat: torch.Tensor) -> None:
        assert self.residual is not None
        flat.add_(self.residual)
        torch.abs(flat, out=self.magnitude)
        torch.topk(self.magnitude, self.k, sorted=False, out=(self.top, self.top_idx))
        torch.index_select(flat, 0, self.top_idx, out=self.values)
        self.indices.copy_(self.top_idx)
        self.residual.copy_(flat).index_fill_(0, self.top_idx, 0)
        self._flat = flat
        self._work = self.comm.all_gather(self.gathered_rows, self.packed)

    def finish(self) -> None:
        assert self._work is not None and self._flat is not None, "finish() without start()"
        self.comm.wait(self._work, "all-gather")
        flat = self._flat
        flat.zero_()
        for row in self.gathered_rows:
            idx = row[self._vbytes :].view(torch.int32).long()
            flat.index_add_(0, idx, row[: self._vbytes].view(self._dtype))
        self._work = self._flat = None


class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD (Vogels et al., 2019) with warm start and error feedback.

    Each parameter of two or more dimensions, seen as an n x m matrix M, is sent
    as P = M Q (all-reduced, then orthonormalised) and Q = M^T P (all-reduced);
    every rank rebuilds P Q^T.  Q is kept from step to step (warm start), so one
    power iteration per step tracks the gradient's top subspace.  Parameters
    where rank r would not save bytes (biases, small matrices) go uncompressed in
    the same all-reduce as P.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        device: torch.device,
        comm: UnitComm,
        rank: int,
        seed: int = 0,
    ) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"powersgd on {comm.label}: gradients are {dtype}; PowerSGD needs float32 or "
                "float64 (use fp16/bf16 compression for half-precision models)"
            )
        self.comm = comm
        self.world = comm.world
        matrices: list[tuple[int, int, int]] = []  # (offset in flat, n, m)
        dense: list[tuple[int, int]] = []  # (offset in flat, numel)
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            n = shape[0] if len(shape) >= 2 else 0
            m = numel // n if n else 0
            r = min(rank, n, m)
            if n and r * (n + m) < n * m:
                matrices.append((offset, n, m))
            else:
                dense.append((offset, numel))
            offset += numel
        p_numel = sum(min(rank, n, m) * n for _, n, m in matrices)
        q_numel = sum(min(rank, n, m) * m for _, n, m in matrices)
        dense_numel = sum(numel for _, numel in dense)
        # Round one carries P and the dense parameters together; round two carries Q.
        self.round_one = torch.empty(p_numel + dense_numel, dtype=dtype, device=device)
        self.q_all = torch.empty(q_numel, dtype=dtype, device=device)
        generator = torch.Generator().manual_seed(seed)  # same Q start on every rank
        self.q_all.copy_(torch.randn(q_numel, generator=generator, dtype=dtype))
        self.residual = torch.zeros(offset, dtype=dtype, device=device)
        self._matrices: list[tuple[slice, torch.Tensor, torch.Tensor, int, int]] = []
        p_off = q_off = 0
        for flat_off, n, m in matrices:
            r = min(rank, n, m)
            p = self.round_one[p_off : p_off + n * r].view(n, r)
            q = self.q_all[q_off : q_off + m * r].view(m, r)
            self._matrices.append((slice(flat_off, flat_off + n * m), p, q, n, m))
            p_off += n * r
            q_off += m * r
        self._dense: list[tuple[slice, torch.Tensor]] = []
        d_off = p_numel
        for flat_off, numel in dense:
            self._dense.append((slice(flat_off, flat_off + numel), self.round_one[d_off : d_off + numel]))
            d_off += numel
        self.wire_bytes = (self.round_one.numel() + self.q_all.numel()) * _itemsize(dtype)
        self._flat: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._stage = 0

    def start(self, flat: torch.Tensor) -> None:
        assert self.residual is not None
        for where, p, q, n, m in self._matrices:
            block = flat[where].view(n, m)
            block.add_(self.residual[where].view(n, m))
            torch.matmul(block, q, out=p)
        for where, slot in self._dense:
            slot.copy_(flat[where])
        self._flat = flat
        self._work = self.comm.all_reduce(self.round_one)
        self._stage = 1

    def advance(self) -> None:
        assert self._work is not None and self._flat is not None and self._stage == 1
        self.comm.wait(self._work, "all-reduce (PowerSGD P)")
        for where, p, q, n, m in self._matrices:
            _orthonormalise_columns(p)
            torch.matmul(self._flat[where].view(n, m).t(), p, out=q)
        self._work = self.comm.all_reduce(self.q_all) if self._matrices else None
        self._stage = 2

    def finish(self) -> None:
        if self._stage == 1:
            self.advance()
        assert self._flat is not None and self._stage == 2, "finish() without start()"
        if self._work is not None:
            self.comm.wait(self._work, "all-reduce (PowerSGD Q)")
        flat = self._flat
        assert self.residual is not None
        for where, p, q, n, m in self._matrices:
            block = flat[where].view(n, m)
            own = self.residual[where].view(n, m)
            own.copy_(block)  # this rank's M (gradient + old residual)
            torch.matmul(p, q.t(), out=block)  # the shared approximation of the sum over ranks
            own.add_(block, alpha=-1.0 / self.world)
        for where, slot in self._dense:
            flat[where].copy_(slot)
        self._work = self._flat = None
        self._stage = 0


def _orthonormalise_columns(p: torch.Tensor, eps: float = 1e-8) -> None:
    """Modified Gram-Schmidt in place; a zero column stays (near) zero instead of NaN."""
    for i in range(p.shape[1]):
        col = p[:, i]
        col.div_(col.norm().add_(eps))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.addr_(col, col @ rest, alpha=-1)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_compressor(
    spec: str,
    shapes: Sequence[torch.Size],
    dtype: torch.dtype,
    device: torch.device,
    comm: UnitComm,
) -> Compressor:
    """Build the compressor a `compression` setting names for one unit."""
    numel = sum(math.prod(s) for s in shapes)
    if spec == "none":
        return AllReduce(numel, dtype, device, comm)
    if spec in ("fp16", "bf16"):
        wire = torch.float16 if spec == "fp16" else torch.bfloat16
        if dtype == wire:  # already half precision: nothing to gain, nothing to feed back
            return AllReduce(numel, dtype, device, comm)
        return CastCompressor(numel, dtype, device, comm, wire)
    kind, _, arg = spec.partition(":")
    if kind == "topk":
        ratio = float(arg)
        if not 0 < ratio <= 1:
            raise ValueError(f"compression {spec!r}: the top-k ratio must be in (0, 1]")
        return TopKCompressor(numel, dtype, device, comm, ratio)
    if kind == "powersgd":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"compression {spec!r}: the PowerSGD rank must be a positive integer")
        return PowerSGDCompressor(shapes, dtype, device, comm, int(arg))
    raise ValueError(f"compression {spec!r} is not one of none, fp16, bf16, topk:<ratio>, powersgd:<rank>")
