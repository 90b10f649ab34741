"""The one boundary where torch.distributed errors and timeouts become errors that name layers.

A hung or dead rank must never turn into a silent hang on the others: every wait
has a deadline, and whatever gloo or NCCL raises is translated here, once, into a
`CollectiveError` that says which layers, which rank, which operation and how
long it waited.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the layers and the rank."""


class UnitComm:
    """Collectives of one sync unit on one process group, with a deadline on every wait."""

    __slots__ = ("done_at", "group", "label", "rank", "record_completion", "timeout", "world", "_started")

    def __init__(self, group: dist.ProcessGroup, label: str, timeout: timedelta) -> None:
        self.group = group
        self.label = label
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timeout
        self._started = 0.0
        # When set, the time each collective completes is noted (from the backend's future);
        # the adaptive planner and the [SYNC] debug lines read it.
        self.record_completion = False
        self.done_at = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """Sum over ranks, asynchronously."""
        self._started = time.perf_counter()
        try:
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        except Exception as exc:  # gloo/NCCL raise RuntimeError and friends; one translation point
            raise self._error("all-reduce", exc) from exc
        return self._noted(work)

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """`src`'s tensor to every rank of the group (`src`: a rank of the whole job), asynchronously."""
        self._started = time.perf_counter()
        try:
            work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        except Exception as exc:
            raise self._error("broadcast", exc) from exc
        return self._noted(work)

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        self._started = time.perf_counter()
        try:
            work = dist.all_gather(list(outputs), tensor, group=self.group, async_op=True)
        except Exception as exc:
            raise self._error("all-gather", exc) from exc
        return self._noted(work)

    def _noted(self, work: dist.Work) -> dist.Work:
        if self.record_completion:
            work.get_future().then(self._note_done)
        return work

    def _note_done(self, _: torch.futures.Future) -> None:
        self.done_at = time.perf_counter()

    def wait(self, work: dist.Work, op: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except Exception as exc:
            raise self._error(op, exc) from exc

    def _error(self, op: str, exc: BaseException) -> CollectiveError:
        waited = time.perf_counter() - self._started
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if "timed out" in text.lower() or waited >= self.timeout.total_seconds() * 0.99:
            hint = (
                f"; no answer within the {self.timeout.total_seconds():g} s sync timeout: "
                "another rank has probably died or hangs"
            )
        return CollectiveError(
            f"{op} of {self.label} failed on rank {self.rank} of {self.world} "
            f"after {waited:.2f} s: {text}{hint}"
        )
