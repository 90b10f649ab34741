"""`LayerwiseDDP`: a drop-in for DistributedDataParallel that syncs each layer as backward produces it.

Follow one gradient: `loss.backward()` runs autograd; when a parameter's
gradient is fully accumulated, `common.gradient_hooks.GradientHooks` marks it ready and,
once its whole unit is ready and every earlier unit has gone, calls
`LayerSync.unit_ready`, which copies the unit's gradients into a flat buffer,
divides by the world size and starts the unit's compressor (an asynchronous
all-reduce for `none`) while backward goes on with earlier layers.  At the end
of backward the hook manager calls `LayerSync.backward_done`, which waits for
every unit (each wait with a deadline) and writes the averages back into
`.grad`; `backward()` returns, and the user's `optimizer.step()` sees the same
gradients DDP would have produced.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticfed.cloud import planning
from elasticfed.cloud.collectives import CollectiveError, UnitComm
from elasticfed.cloud.compression import Compressor, make_compressor
from elasticfed.cloud.hierarchy import HierarchicalSum, Hierarchy
from elasticfed.common.gradient_hooks import GradientHooks, trainable_parameters
from elasticfed.protocol.payload import checksum, tensor_buffer

log = logging.getLogger("elasticfed.sync")

CHECK_EVERY_ENV = "ELASTICFED_CHECK_EVERY"
DEFAULT_PACK_CAP_BYTES = 1 << 20


class DivergenceError(RuntimeError):
    """Ranks hold different parameters; the message names the first layer that differs."""


@dataclass
class SyncStats:
    """What the sync did, for logs, metrics and benchmarks."""

    steps: int = 0
    units: int = 0
    wire_bytes_last_step: int = 0
    wire_bytes_total: int = 0
    replans: int = 0
    plans_timed: int = 0
    unit_ms_last_step: list[float] = field(default_factory=list)


class _Unit:
    """One collective's worth of parameters, with buffers allocated once."""

    __slots__ = (
        "comm",
        "compressor",
        "current",
        "dtype",
        "flat",
        "index",
        "label",
        "nbytes",
        "params",
        "started",
        "views",
    )

    def __init__(
        self,
        index: int,
        params: list[int],
        names: Sequence[str],
        tensors: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        timeout: timedelta,
        compression: str,
        hierarchy: Hierarchy | None = None,
    ) -> None:
        self.index = index
        self.params = params
        first = tensors[params[0]]
        self.dtype = first.dtype
        shapes = [tensors[i].shape for i in params]
        numel = sum(math.prod(s) for s in shapes)
        self.nbytes = numel * first.element_size()
        if len(params) == 1:
            self.label = f"layer {names[params[0]]!r} (unit {index})"
        else:
            self.label = (
                f"layers {names[params[0]]!r} .. {names[params[-1]]!r} ({len(params)} layers, unit {index})"
            )
        self.flat = torch.empty(numel, dtype=self.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for shape in shapes:
            size = math.prod(shape)
            self.views.append(self.flat[offset : offset + size].view(shape))
            offset += size
        self.compressor: Compressor
        if hierarchy is not None:  # within each kind, between the kinds' leaders, back
            hierarchical = HierarchicalSum(numel, self.dtype, first.device, hierarchy, self.label, timeout)
            self.comm = hierarchical.local
            self.compressor = hierarchical
        else:
            self.comm = UnitComm(group, self.label, timeout)
            self.compressor = make_compressor(compression, shapes, self.dtype, first.device, self.comm)
        self.current: torch.Tensor | None = None
        self.started = 0.0


class LayerSync:
    """The cloud sink of the hook manager: one asynchronous collective per unit, waited at the end."""

    def __init__(
        self,
        names: Sequence[str],
        params: Sequence[nn.Parameter],
        groups: Sequence[dist.ProcessGroup],
        *,
        compression: str,
        overlap: bool,
        find_unused_parameters: bool,
        timeout: timedelta,
        hierarchy: Hierarchy | None = None,
    ) -> None:
        self.names = list(names)
        self.params = list(params)
        self.groups = list(groups)
        self.world = dist.get_world_size(groups[0])
        self.compression = compression
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.timeout = timeout
        self.hierarchy = hierarchy
        self.stats = SyncStats()
        self.failed: BaseException | None = None
        self.units: list[_Unit] = []
        self._launched: list[_Unit] = []
        self._warned_unused: set[int] = set()
        # Job-wide collectives of a job mixing kinds take CPU tensors (gloo reaches every rank).
        self.job_device = torch.device("cpu") if hierarchy is not None else params[0].device
        self._used = torch.zeros(len(params), dtype=torch.int32, device=self.job_device)
        self._used_comm = UnitComm(groups[0], "the used-parameter map", timeout)
        self.after_step: Callable[[], None] | None = None
        self.record_completion = False  # set by the adaptive strategy; debug logging turns it on too
        self.service_samples: deque[tuple[int, float]] = deque(maxlen=1024)

    def build(self, plan: Sequence[Sequence[int]]) -> None:
        """(Re)allocate units and their buffers for a plan; never on the hot path."""
        self.units = [
            _Unit(
                u,
                list(unit),
                self.names,
                self.params,
                self.groups[u % len(self.groups)],
                self.timeout,
                self.compression,
                self.hierarchy,
            )
            for u, unit in enumerate(plan)
        ]
        self.stats.units = len(self.units)
        record = self.record_completion or log.isEnabledFor(logging.DEBUG)
        for unit in self.units:
            unit.comm.record_completion = record

    # ------------------------------------------------------------ the sink
    def unit_ready(self, u: int) -> None:
        self._check_usable()
        unit = self.units[u]
        try:
            grad = self.params[unit.params[0]].grad if len(unit.params) == 1 else None
            if grad is not None and grad.is_contiguous() and grad.dtype == unit.dtype:
                flat = grad.view(-1)  # reduce in place: no copy in, no copy out
            else:
                flat = unit.flat
                for i, view in zip(unit.params, unit.views):
                    g = self.params[i].grad
                    if g is None:
                        view.zero_()
                    elif g.data_ptr() != view.data_ptr():  # after the first step .grad *is* the view
                        view.copy_(g)
            flat.div_(self.world)
            unit.current = flat
            unit.started = time.perf_counter()
            unit.compressor.start(flat)
            self._launched.append(unit)
            if not self.overlap:  # debugging: block on every unit before backward goes on
                unit.compressor.advance()
                unit.compressor.finish()
        except BaseException as exc:
            self._fail(exc)
            raise

    def backward_done(self) -> None:
        self._check_usable()
        try:
            used_work = None
            if self.find_unused_parameters:
                for i, p in enumerate(self.params):
                    self._used[i] = p.grad is not None
                used_work = self._used_comm.all_reduce(self._used)
            if self.overlap:
                for unit in self._launched:
                    unit.compressor.advance()
                for unit in self._launched:
                    unit.compressor.finish()
            if used_work is not None:
                self._used_comm.wait(used_work, "all-reduce")
            wire = 0
            times = []
            debug = log.isEnabledFor(logging.DEBUG)
            stream_free: dict[int, float] = {}
            now = time.perf_counter()
            for unit in self._launched:
                self._write_back(unit)
                wire += unit.compressor.wire_bytes
                done = unit.comm.done_at if unit.comm.record_completion else now
                times.append((done - unit.started) * 1e3)
                if unit.comm.record_completion:
                    # Service time: from when the stream could start this unit to its completion.
                    lane = id(unit.comm.group)
                    began = max(unit.started, stream_free.get(lane, 0.0))
                    stream_free[lane] = done
                    self.service_samples.append((unit.compressor.wire_bytes, max(done - began, 0.0)))
                if debug:
                    log.debug(
                        "[SYNC] %s: %.2f ms from ready to reduced, %d B on the wire",
                        unit.label,
                        times[-1],
                        unit.compressor.wire_bytes,
                    )
            self.stats.steps += 1
            self.stats.wire_bytes_last_step = wire
            self.stats.wire_bytes_total += wire
            self.stats.unit_ms_last_step = times
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._launched = []
        if self.after_step is not None:
            self.after_step()

    # ------------------------------------------------------------- helpers
    def _write_back(self, unit: _Unit) -> None:
        if unit.current is not unit.flat:
            return  # reduced in place in the gradient itself
        for i, view in zip(unit.params, unit.views):
            p = self.params[i]
            if p.grad is not None:
                # The gradient becomes a view of the unit's buffer (DDP's gradient_as_bucket_view):
                # no copy out now, and none in at the next step unless zero_grad() set it to None.
                p.grad = view
                continue
            if self.find_unused_parameters and int(self._used[i]) == 0:
                continue  # unused on every rank: left as None, like DDP
            if not self.find_unused_parameters and i not in self._warned_unused:
                self._warned_unused.add(i)
                warnings.warn(
                    f"parameter {self.names[i]!r} got no gradient on this rank in this step; its "
                    "gradient is set to the average of the other ranks (zero if none used it). "
                    "Pass find_unused_parameters=True to leave globally unused parameters' "
                    "gradients as None, exactly like DDP.",
                    stacklevel=2,
                )
            p.grad = view

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise CollectiveError(
                f"layer-wise sync stopped after an earlier failure ({self.failed}); the process group "
                "cannot be trusted any more: restart the workers (torchrun --max-restarts) "
            )

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, CollectiveError):
            self.failed = exc
        self._launched = []


class LayerwiseDDP(nn.Module):
    """Data-parallel wrapper with layer-wise gradient sync; use it where you would use DDP.

    Construction broadcasts rank 0's parameters and buffers.  Every backward
    averages gradients over the ranks, one unit (a layer, or small layers packed
    up to `pack_cap_bytes`) at a time as backward produces them; `backward()`
    returns once every unit is averaged, so the training loop does not change.

    Options: `strategy` (`layerwise`, `blockwise`, `adaptive`), `compression`
    (`none`, `fp16`, `bf16`, `topk:<ratio>`, `powersgd:<rank>`, with error
    feedback), `overlap` (False blocks on every unit, for debugging), `streams`
    (process groups over the same ranks, units spread round-robin),
    `find_unused_parameters` (exact DDP handling of parameters no rank used),
    `timeout_s` (deadline on every wait), `check_every` (compare parameter
    checksums across ranks every N steps; also from ELASTICFED_CHECK_EVERY),
    `hierarchy` (ranks of different kinds, e.g. CUDA and CPU: each unit summed
    within each kind, across the kinds' leaders and back; cloud/hierarchy.py).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        strategy: str = "layerwise",
        compression: str = "none",
        overlap: bool = True,
        streams: int = 1,
        pack_cap_bytes: int = DEFAULT_PACK_CAP_BYTES,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        timeout_s: float = 300.0,
        check_every: int | None = None,
        block_of: Callable[[str], str] | None = None,
        replan_every: int = 200,
        hierarchy: Hierarchy | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "LayerwiseDDP needs torch.distributed: call dist.init_process_group() first "
                "(torchrun sets the environment for it)"
            )
        _refuse_compiled_autograd()
        if strategy not in planning.STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not one of {', '.join(planning.STRATEGIES)}")
        if streams < 1:
            raise ValueError(f"streams must be at least 1, got {streams}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if pack_cap_bytes < 0:
            raise ValueError(f"pack_cap_bytes must be >= 0, got {pack_cap_bytes}")
        if hierarchy is not None and (compression != "none" or streams != 1 or strategy == "adaptive"):
            raise ValueError(
                "a hierarchy of kinds sums each unit in three stages of its own: it takes compression "
                f"'none', one stream and strategy 'layerwise' or 'blockwise' (got compression "
                f"{compression!r}, {streams} streams, strategy {strategy!r})"
            )
        if check_every is None:
            check_every = _env_int(CHECK_EVERY_ENV)
        self.module = module
        self.strategy = strategy
        self.broadcast_buffers = broadcast_buffers
        self.check_every = check_every
        self.replan_every = replan_every
        self.process_group = process_group or dist.group.WORLD
        if hierarchy is not None and len(hierarchy.kinds) != dist.get_world_size(self.process_group):
            raise ValueError(
                f"the hierarchy spans {len(hierarchy.kinds)} ranks (the whole job) but this "
                f"LayerwiseDDP's process group has {dist.get_world_size(self.process_group)}: use it "
                "over the whole job"
            )
        self.hierarchy = hierarchy
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self._src = dist.get_global_rank(self.process_group, 0)
        timeout = timedelta(seconds=timeout_s)
        ranks = dist.get_process_group_ranks(self.process_group)
        groups = [self.process_group] + [dist.new_group(ranks, timeout=timeout) for _ in range(streams - 1)]

        named = trainable_parameters(module)
        self.layer_names = [name for name, _ in named]
        params = [p for _, p in named]
        self._sizes = [p.numel() * p.element_size() for p in params]
        self._dtypes = [p.dtype for p in params]
        self._synced_buffers = [b for b in module.buffers()]
        self._sync_buffers_next_forward = True
        self._coalesced: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._forwards = 0

        self._broadcast_state()
        self.sync = LayerSync(
            self.layer_names,
            params,
            groups,
            compression=compression,
            overlap=overlap,
            find_unused_parameters=find_unused_parameters,
            timeout=timeout,
            hierarchy=hierarchy,
        )
        plan = planning.initial_plan(
            strategy, self.layer_names, self._sizes, self._dtypes, pack_cap_bytes, block_of
        )
        self.sync.build(plan)
        self.hooks = GradientHooks(named, self.sync, plan)
        self._cost: planning.CommCost | None = None
        self._tuning: dict[str, Any] = {
            "elapsed": 0.0,
            "steps": 0,
            "ready": torch.zeros(len(params), dtype=torch.float64),
            "candidates": [],
            "times": [],
            "baseline": None,
        }
        if strategy == "adaptive":
            self._cost = planning.probe_comm_cost(self.process_group, params[0].device)
            self.sync.record_completion = True
            self.sync.build(plan)
            self.sync.after_step = self._observe_for_replan
        log.info(
            "layer-wise sync: %d layers in %d units, strategy %s, compression %s, %d stream(s), "
            "overlap %s, rank %d of %d",
            len(params),
            len(plan),
            strategy,
            compression,
            streams,
            "on" if overlap else "off",
            self.rank,
            self.world_size,
        )

    # -------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "torch.compile cannot trace LayerwiseDDP (its sync is hooks and collectives): compile "
                "the model inside it instead, LayerwiseDDP(torch.compile(model)), which syncs the same "
                "gradients"
            )
        self.sync._check_usable()
        self._forwards += 1
        if self.check_every and self._forwards % self.check_every == 0 and torch.is_grad_enabled():
            self.check_consistency()
        if self._sync_buffers_next_forward and self.broadcast_buffers and self._synced_buffers:
            self._broadcast(self._synced_buffers)
        sync_this_step = torch.is_grad_enabled() and self.hooks.sync_enabled
        # DDP's rule: buffers are broadcast in a forward that follows a synced training forward.
        self._sync_buffers_next_forward = sync_this_step
        outputs = self.module(*args, **kwargs)
        return self.hooks.arm(outputs) if sync_this_step else outputs

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block syncs the total."""
        with self.hooks.disabled():
            yield

    @property
    def stats(self) -> SyncStats:
        return self.sync.stats

    def plan(self) -> list[list[str]]:
        """The current units, as layer names (for logs and tests)."""
        return [[self.layer_names[i] for i in unit] for unit in self.hooks.plan]

    # ------------------------------------------------------ consistency check
    def check_consistency(self) -> None:
        """Compare every parameter's checksum across ranks; raise naming the first layer that differs."""
        sums = torch.tensor([_signed64(_tensor_checksum(p)) for p in self.sync.params], dtype=torch.int64)
        sums = sums.to(self.sync.job_device)
        gathered = [torch.empty_like(sums) for _ in range(self.world_size)]
        dist.all_gather(gathered, sums, group=self.process_group)
        table = torch.stack(gathered).cpu()
        differs = (table != table[0]).any(dim=0)
        if bool(differs.any()):
            i = int(differs.nonzero()[0])
            ranks = [r for r in range(self.world_size) if table[r, i] != table[0, i]]
            raise DivergenceError(
                f"ranks hold different parameters after step {self.stats.steps}: first diverged layer "
                f"{self.layer_names[i]!r} (manifest position {i}) differs from rank 0 on rank(s) {ranks}; "
                f"{int(differs.sum())} of {len(self.layer_names)} layers differ"
            )

    # ------------------------------------------------------------ internals
    def _broadcast_state(self) -> None:
        self._broadcast([p.detach() for p in self.module.parameters()] + self._synced_buffers, keep=False)

    def _broadcast(self, tensors: Sequence[torch.Tensor], keep: bool = True) -> None:
        """Broadcast from group rank 0, coalesced per dtype and device (a handful of collectives).

        With `keep`, the flat buffers are kept for the next call (the per-step buffer broadcast).
        """
        # A job mixing kinds broadcasts through host memory (gloo reaches every rank).
        staged = self.hierarchy is not None
        plan = self._coalesced if keep and self._coalesced else _coalesce(tensors, staged)
        if keep:
            self._coalesced = plan
        with torch.no_grad():
            for flat, group in plan:
                if self.rank == 0:
                    if all(t.device == flat.device for t in group):
                        torch.cat([t.reshape(-1) for t in group], out=flat)
                    else:
                        flat.copy_(torch.cat([t.reshape(-1).to(flat.device) for t in group]))
                dist.broadcast(flat, src=self._src, group=self.process_group)
                if self.rank != 0:
                    offset = 0
                    for t in group:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()

    def _observe_for_replan(self) -> None:
        """Adaptive strategy: time candidate plans on the real job, keep the fastest, re-tune on drift.

        Runs at the end of every backward.  Every decision is taken at the same
        step on every rank from all-reduced or broadcast numbers, so all ranks
        always switch plans together.
        """
        assert self._cost is not None
        tuning = self._tuning
        tuning["elapsed"] += time.perf_counter() - self.hooks._started
        tuning["ready"] += torch.tensor(self.hooks.ready_at, dtype=torch.float64)
        tuning["steps"] += 1
        steps = self.sync.stats.steps
        trial_steps = 4
        if tuning["candidates"]:  # timing candidates: one settle step, then trial_steps timed
            if tuning["steps"] == 1:
                tuning["elapsed"] = 0.0
            if tuning["steps"] < trial_steps + 1:
                return
            tuning["times"].append(tuning["elapsed"] / trial_steps)
            nxt = len(tuning["times"])
            if nxt < len(tuning["candidates"]):
                self._switch(tuning["candidates"][nxt])
            else:
                times = torch.tensor(tuning["times"], dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.process_group)
                best = int(times.argmin())
                tuning["baseline"] = float(times[best])
                self._switch(tuning["candidates"][best])
                log.info(
                    "adaptive sync: timed %d plans (%s ms per backward); chose %d units",
                    len(times),
                    ", ".join(f"{t * 1e3:.1f}" for t in times.tolist()),
                    self.sync.stats.units,
                )
                tuning["candidates"] = []
                if best:
                    self.sync.stats.replans += 1
            self._restart_window()
            return
        warmup = 3
        if steps == warmup or (steps > warmup and tuning["steps"] >= self.replan_every):
            mean = torch.tensor([tuning["elapsed"] / tuning["steps"]], dtype=torch.float64)
            dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=self.process_group)
            drifted = tuning["baseline"] is None or float(mean) > tuning["baseline"] * 1.15
            if drifted:
                self._propose_candidates()
            self._restart_window()

    def _propose_candidates(self) -> None:
        """Rank 0 proposes plans from measured ready times and costs; every rank receives them."""
        assert self._cost is not None
        ready = self._tuning["ready"] / max(self._tuning["steps"], 1)
        dist.all_reduce(ready, group=self.process_group)
        ready = (ready / self.world_size).tolist()
        n = len(ready)
        most = 6
        table = torch.zeros(most + 1, n, dtype=torch.int32)
        if self.rank == 0:
            self._cost = planning.fit_comm_cost(list(self.sync.service_samples), self._cost)
            plans = planning.candidate_plans(self.hooks.plan, ready, self._sizes, self._dtypes, self._cost)[
                :most
            ]
            table[0, 0] = len(plans)
            for k, plan in enumerate(plans):
                table[k + 1] = planning.plan_to_boundaries(plan, n)
        dist.broadcast(table, src=self._src, group=self.process_group)
        count = int(table[0, 0])
        self._tuning["candidates"] = [planning.boundaries_to_plan(table[k + 1]) for k in range(count)]
        self.sync.stats.plans_timed += count
        self._tuning["times"] = []
        self._switch(self._tuning["candidates"][0])

    def _switch(self, plan: list[list[int]]) -> None:
        if plan != self.hooks.plan:
            self.sync.build(plan)
            self.hooks.set_plan(plan)

    def _restart_window(self) -> None:
        self._tuning["elapsed"] = 0.0
        self._tuning["steps"] = 0
        self._tuning["ready"].zero_()


def _coalesce(
    tensors: Sequence[torch.Tensor], on_host: bool = False
) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    # Staged through host memory, tensors group by dtype alone: ranks on different devices must
    # make the same broadcasts.
    by_kind: dict[tuple[torch.dtype, torch.device | None], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, None if on_host else t.device), []).append(t.detach())
    return [
        (
            torch.empty(
                sum(t.numel() for t in group),
                dtype=group[0].dtype,
                device="cpu" if on_host else group[0].device,
            ),
            group,
        )
        for group in by_kind.values()
    ]


def _tensor_checksum(t: torch.Tensor) -> int:
    return checksum(tensor_buffer(t.detach().cpu()))


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


def _env_int(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a whole number of steps") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must be >= 0")
    return value


def _refuse_compiled_autograd() -> None:
    """Compiled autograd traces the hooks into a graph, where our per-layer collectives cannot run."""
    try:
        from torch._dynamo import config as dynamo_config
    except ImportError:  # pragma: no cover - torch without dynamo
        return
    if getattr(dynamo_config, "compiled_autograd", False):
        raise RuntimeError(
            "LayerwiseDDP does not support compiled autograd (torch._dynamo.config.compiled_autograd): "
            "its per-layer hooks would be traced instead of run. Turn compiled autograd off; "
            "torch.compile of the model itself is supported: LayerwiseDDP(torch.compile(model))"
        )
