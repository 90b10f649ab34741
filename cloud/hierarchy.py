"""Averaging over ranks of different kinds (CUDA ranks on NCCL, CPU hosts on gloo) in three stages.

Why: NCCL cannot reach a rank without a GPU, and gloo between GPUs gives up NCCL's
bandwidth.  So each kind reduces among itself on its own backend, one leader per
kind adds the kinds' sums over gloo (the bridge: one tensor per kind crosses it,
whatever the number of ranks), and each leader broadcasts the total back within
its kind.  The result is a flat all-reduce's, summed in another order: equal to
rounding (tests/test_cloud_sync.py compares it with torch DDP and with a flat
all-reduce).

A job that mixes kinds joins its process group with a backend per device type
(`dist.init_process_group("cpu:gloo,cuda:nccl")`), so that collectives over the
whole job on CPU tensors go over gloo; `LayerwiseDDP(hierarchy=...)` keeps its
own whole-job collectives (the parameter broadcast, the consistency check, the
used-parameter map) on CPU tensors for that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticfed.cloud.collectives import UnitComm
from elasticfed.cloud.compression import Compressor

# Which backend each kind reduces on when the kinds are device types.
DEVICE_BACKENDS: Mapping[str, str] = {"cuda": "nccl", "cpu": "gloo"}
_KIND_BYTES = 32  # a kind's name, as gathered from every rank


@dataclass(frozen=True)
class Hierarchy:
    """This rank's place among the kinds: its kind's group, and the bridge if it leads its kind."""

    kind: str
    kinds: tuple[str, ...]  # every rank's kind, by rank in the job's group
    local: dist.ProcessGroup  # the ranks of this kind, on the kind's backend
    bridge: dist.ProcessGroup | None  # one leader per kind, on gloo; None off the leaders (or one kind)
    leader: int  # the job-group rank of this kind's leader (its lowest rank)

    @property
    def leads(self) -> bool:
        return self.leader == dist.get_rank()

    @classmethod
    def of_kinds(
        cls,
        kind: str,
        backends: Mapping[str, str] | None = None,
        timeout: timedelta = timedelta(minutes=5),
    ) -> Hierarchy:
        """Collective over the whole job (`dist.new_group` needs every rank): every rank names its
        kind; each kind's ranks form a group on `backends[kind]` (gloo when absent), and the kinds'
        leaders a gloo bridge.  `timeout`: of every wait in these groups."""
        group = dist.group.WORLD
        encoded = kind.encode()
        if not encoded or len(encoded) > _KIND_BYTES:
            raise ValueError(f"a rank's kind must be 1-{_KIND_BYTES} bytes of UTF-8, got {kind!r}")
        backends = dict(backends or {})
        mine = torch.zeros(_KIND_BYTES, dtype=torch.uint8)
        mine[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)  # a CPU tensor: gloo in a mixed job
        kinds = tuple(bytes(t[t != 0].tolist()).decode() for t in gathered)
        ranks_of: dict[str, list[int]] = {}
        for rank, k in enumerate(kinds):
            ranks_of.setdefault(k, []).append(dist.get_global_rank(group, rank))
        local: dist.ProcessGroup | None = None
        for k in sorted(ranks_of):  # every rank creates every group, in the same order
            made = dist.new_group(ranks_of[k], timeout=timeout, backend=backends.get(k, "gloo"))
            if k == kind:
                local = made
        leaders = [ranks_of[k][0] for k in sorted(ranks_of)]
        assert local is not None
        # One kind only: its sum is the total, and nothing crosses a bridge.
        bridge = dist.new_group(leaders, timeout=timeout, backend="gloo") if len(leaders) > 1 else None
        return cls(
            kind=kind,
            kinds=kinds,
            local=local,
            bridge=bridge if dist.get_rank() in leaders else None,
            leader=ranks_of[kind][0],
        )

    @classmethod
    def by_device(cls, device: torch.device, timeout: timedelta = timedelta(minutes=5)) -> Hierarchy:
        """Kinds by device type: CUDA ranks reduce on NCCL, CPU ranks on gloo."""
        return cls.of_kinds(device.type, DEVICE_BACKENDS, timeout)


class HierarchicalSum(Compressor):
    """One flat tensor summed over every rank of every kind: within the kind (started during
    backward), across the kinds' leaders, back within the kind; `start`, `advance` and `finish`
    as a compressor's (cloud/compression.py), so `LayerSync` drives it like any other."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        hierarchy: Hierarchy,
        label: str,
        timeout: timedelta,
    ) -> None:
        self.hierarchy = hierarchy
        self.wire_bytes = numel * torch.empty((), dtype=dtype).element_size()  # within the kind
        self.local = UnitComm(hierarchy.local, label, timeout)
        self.bridge = (
            UnitComm(hierarchy.bridge, f"{label} (between kinds)", timeout) if hierarchy.bridge else None
        )
        # The bridge is gloo: a leader on a GPU stages its kind's sum through host memory.
        self.staging = (
            torch.empty(numel, dtype=dtype) if self.bridge is not None and device.type != "cpu" else None
        )
        self.single_kind = len(set(hierarchy.kinds)) == 1  # the kind's sum is the total
        self._flat: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._within_done = False

    def start(self, flat: torch.Tensor) -> None:
        self._flat = flat
        self._within_done = False
        self._work = self.local.all_reduce(flat)

    def advance(self) -> None:
        assert self._flat is not None and self._work is not None, "advance() without start()"
        self.local.wait(self._work, "all-reduce within its kind")
        self._work = None
        self._within_done = True
        if self.bridge is not None:
            across = self._flat if self.staging is None else self.staging.copy_(self._flat)
            self._work = self.bridge.all_reduce(across)

    def finish(self) -> None:
        if not self._within_done:
            self.advance()
        flat = self._flat
        assert flat is not None
        if self.bridge is not None:
            assert self._work is not None
            self.bridge.wait(self._work, "all-reduce between kinds")
            if self.staging is not None:
                flat.copy_(self.staging)
        if not self.single_kind:
            self.local.wait(self.local.broadcast(flat, self.hierarchy.leader), "broadcast within its kind")
        self._flat = None
        self._work = None
        self._within_done = False
