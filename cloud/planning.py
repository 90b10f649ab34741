"""Sync strategies: how parameters are grouped into units (`layerwise`, `blockwise`, `adaptive`).

A plan is a list of units in manifest order, each a list of parameter indices.
`layerwise` and `blockwise` are fixed rules; `adaptive` fits the grouping to
measured per-layer gradient-ready times and a measured communication cost
(latency + bytes / bandwidth), and is re-planned when those drift, the way DDP
rebuilds its buckets after the first iteration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elasticfed.common.gradient_hooks import default_block_of, group_by_block, pack_by_size

STRATEGIES = ("layerwise", "blockwise", "adaptive")


def initial_plan(
    strategy: str,
    names: Sequence[str],
    sizes_bytes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    pack_cap_bytes: int,
    block_of: Callable[[str], str] | None = None,
) -> list[list[int]]:
    """The plan a strategy starts from (adaptive starts layer-wise and re-plans once measured)."""
    if strategy in ("layerwise", "adaptive"):
        return pack_by_size(sizes_bytes, dtypes, pack_cap_bytes)
    if strategy == "blockwise":
        return group_by_block(names, dtypes, block_of or default_block_of)
    raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")


@dataclass(frozen=True)
class CommCost:
    """Seconds to all-reduce n bytes: alpha + beta * n (fitted from probes)."""

    alpha_s: float
    beta_s_per_byte: float

    def seconds(self, nbytes: int) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


def probe_comm_cost(group: dist.ProcessGroup, device: torch.device, repeats: int = 5) -> CommCost:
    """Time blocking all-reduces of a small and a large buffer on `group` (every rank must call)."""
    small, large = 256, 1 << 20  # float32 elements: 1 KiB and 4 MiB
    timings = []
    for numel in (small, large):
        buf = torch.zeros(numel, device=device)
        dist.all_reduce(buf, group=group)  # warm the connection
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        timings.append(sorted(samples)[len(samples) // 2])
    beta = max(timings[1] - timings[0], 0.0) / ((large - small) * 4)
    return CommCost(alpha_s=max(timings[0], 1e-6), beta_s_per_byte=beta)


def fit_comm_cost(samples: Sequence[tuple[int, float]], fallback: CommCost) -> CommCost:
    """Fit alpha + beta * bytes to measured (bytes, seconds) service times, robustly.

    Service times under load are noisy (the backend's thread shares cores with
    backward), so each distinct size contributes its median, weighted by how
    often it was seen.  With a single size beta cannot be told from alpha: the
    fallback's beta is kept and alpha fitted alone (likewise when all sizes are
    within a factor of two of each other).
    """
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in samples:
        by_size.setdefault(nbytes, []).append(seconds)
    if not by_size:
        return fallback
    points = [(float(b), sorted(ts)[len(ts) // 2], len(ts)) for b, ts in by_size.items()]
    weight = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / weight
    mean_y = sum(y * w for _, y, w in points) / weight
    var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    sizes = [x for x, _, _ in points]
    if var <= 0 or max(sizes) < 2 * min(sizes):  # too little spread to separate the two terms
        beta = fallback.beta_s_per_byte
    else:
        beta = max(sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / var, 0.0)
    alpha = max(mean_y - beta * mean_x, 1e-6)
    return CommCost(alpha_s=alpha, beta_s_per_byte=beta)


def finish_time(
    plan: Sequence[Sequence[int]],
    ready_at: Sequence[float],
    sizes_bytes: Sequence[int],
    cost: CommCost,
    streams: int = 1,
) -> float:
    """Predicted time from backward start to the last unit's reduction, for one plan.

    Units are launched in plan order once all their parameters are ready; unit u
    runs on stream u % streams, one collective at a time per stream.
    """
    free = [0.0] * max(streams, 1)
    launch = 0.0
    end = 0.0
    for u, unit in enumerate(plan):
        launch = max(launch, max(ready_at[i] for i in unit))
        lane = u % len(free)
        start = max(launch, free[lane])
        free[lane] = start + cost.seconds(sum(sizes_bytes[i] for i in unit))
        end = max(end, free[lane])
    return end


def best_plan(
    ready_at: Sequence[float],
    sizes_bytes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    cost: CommCost,
    max_unit_bytes: int = 32 << 20,
    lookback: int = 64,
) -> list[list[int]]:
    """Contiguous grouping that minimises the predicted finish time on one stream.

    Dynamic programming over the last unit: f(j) = min over i of
    max(ready(j), f(i - 1)) + cost(bytes(i..j)), where ready is the running
    maximum of the hooks' times (units leave in order).  Merging saves a latency
    per collective; splitting lets communication start earlier; the measured
    times decide.  O(n * lookback).
    """
    n = len(ready_at)
    ready = []
    running = 0.0
    for t in ready_at:
        running = max(running, t)
        ready.append(running)
    best = [0.0] * (n + 1)  # best[j + 1]: finish time of the best plan for params 0..j
    cut = [0] * (n + 1)
    for j in range(n):
        total = 0
        best[j + 1] = float("inf")
        for i in range(j, max(-1, j - lookback), -1):
            if dtypes[i] != dtypes[j]:
                break
            total += sizes_bytes[i]
            if total > max_unit_bytes and i != j:
                break
            finish = max(ready[j], best[i]) + cost.seconds(total)
            if finish < best[j + 1]:
                best[j + 1], cut[j + 1] = finish, i
    plan: list[list[int]] = []
    j = n
    while j > 0:
        i = cut[j]
        plan.append(list(range(i, j)))
        j = i
    plan.reverse()
    return plan


def candidate_plans(
    current: Sequence[Sequence[int]],
    ready_at: Sequence[float],
    sizes_bytes: Sequence[int],
    dtypes: Sequence[torch.dtype],
    cost: CommCost,
) -> list[list[list[int]]]:
    """Plans worth timing on the real job: the current one, the model's optimum, and optima for
    costlier collectives (the model treats communication as free for the compute it overlaps;
    where the backend's threads share cores with backward it is not), down to one unit per dtype."""
    plans = [[list(u) for u in current]]
    for scale in (1.0, 4.0, 16.0, 64.0):
        scaled = CommCost(cost.alpha_s * scale, cost.beta_s_per_byte)
        plans.append(best_plan(ready_at, sizes_bytes, dtypes, scaled))
    plans.append(
        best_plan(
            ready_at, sizes_bytes, dtypes, CommCost(1e3, 0.0), max_unit_bytes=1 << 62, lookback=len(ready_at)
        )
    )
    unique: list[list[list[int]]] = []
    for plan in plans:
        if plan not in unique:
            unique.append(plan)
    return unique


def plan_to_boundaries(plan: Sequence[Sequence[int]], n: int) -> torch.Tensor:
    """A plan as n flags: 1 where a unit starts (what rank 0 broadcasts)."""
    flags = torch.zeros(n, dtype=torch.int32)
    for unit in plan:
        flags[unit[0]] = 1
    return flags


def boundaries_to_plan(flags: torch.Tensor) -> list[list[int]]:
    plan: list[list[int]] = []
    for i, flag in enumerate(flags.tolist()):
        if flag or not plan:
            plan.append([])
        plan[-1].append(i)
    return plan
