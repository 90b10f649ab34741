"""Scenarios that run inside each rank (see tests/distributed.py): LayerwiseDDP against torch DDP.

Every scenario builds the same model twice per rank (the two copies start equal on
a rank but differ between ranks, so the initial broadcast is exercised), trains
one copy under torch's DistributedDataParallel and the other under LayerwiseDDP
on the same per-rank data, and reports the largest differences in gradients
(after every backward), parameters and buffers.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elasticfed.cloud.hierarchy import HierarchicalSum, Hierarchy
from elasticfed.cloud.layerwise import LayerwiseDDP


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
        )
        self.head = nn.Linear(16 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (used twice per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.mix = nn.Linear(32, 32)
        self.out = nn.Linear(32, 50, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class Branchy(nn.Module):
    """`side` is used only on some ranks and steps."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(20, 32)
        self.side = nn.Linear(32, 32)
        self.never = nn.Linear(32, 32)  # unused on every rank: gradient must stay None
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if use_side:
            h = h + torch.relu(self.side(h))
        return self.head(h)


class PartlyFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(20, 32), nn.ReLU())
        self.frozen.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(x))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "cnn_bn": ConvBN,
    "tied": TiedLM,
    "branchy": Branchy,
    "frozen": PartlyFrozen,
}


def _batch(model: str, rank: int, step: int, micro: int = 0, dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + micro)
    if model == "tied":
        tokens = torch.randint(0, 50, (16,), generator=g)
        return (tokens,), torch.randint(0, 50, (16,), generator=g)
    if model == "cnn_bn":
        return (torch.randn(8, 1, 8, 8, generator=g).to(dtype),), torch.randint(0, 5, (8,), generator=g)
    x = torch.randn(8, 20, generator=g).to(dtype)
    return (x,), torch.randint(0, 5, (8,), generator=g)


def _extra(model: str, rank: int, step: int) -> dict[str, Any]:
    if model == "branchy":
        return {"use_side": (rank + step) % 3 == 0}  # some ranks use it, some steps nobody does
    return {}


class Recorder:
    def __init__(self) -> None:
        self.grad = 0.0
        self.scale = 0.0
        self.none_mismatch: list[str] = []
        self.bit_exact = True

    def grads(self, ref: nn.Module, ours: nn.Module) -> None:
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            if (a.grad is None) != (b.grad is None):
                self.none_mismatch.append(name)
                continue
            if a.grad is None:
                continue
            self.grad = max(self.grad, (a.grad.double() - b.grad.double()).abs().max().item())
            self.scale = max(self.scale, a.grad.double().abs().max().item())
            self.bit_exact &= torch.equal(a.grad, b.grad)


def compare_with_ddp(
    rank: int,
    world: int,
    model: str = "mlp",
    flavour: str = "plain",
    steps: int = 4,
    dtype: str = "float32",
    compile_backend: str | None = None,
    compile_outer: bool = False,
    set_to_none: bool = True,
    **options: Any,
) -> dict[str, Any]:
    torch_dtype = getattr(torch, dtype)
    if options.pop("kinds", None) == "halves":  # two gloo groups standing in for CUDA and CPU ranks
        options["hierarchy"] = Hierarchy.of_kinds("a" if rank < (world + 1) // 2 else "b")
    torch.manual_seed(1000 + rank)  # different on every rank: the broadcast must make them equal
    base = MODELS[model]().to(torch_dtype)
    find_unused = model == "branchy"
    ref = DDP(copy.deepcopy(base), find_unused_parameters=find_unused)
    inner = copy.deepcopy(base)
    if compile_backend:
        inner = torch.compile(inner, backend=compile_backend)
    ours = LayerwiseDDP(inner, find_unused_parameters=find_unused, **options)
    if compile_outer:  # torch.compile(LayerwiseDDP(model)): same gradients, or a clear refusal
        ours = torch.compile(ours, backend=compile_backend or "aot_eager")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    rec = Recorder()

    def loss_of(net: nn.Module, step: int, micro: int) -> torch.Tensor:
        inputs, target = _batch(model, rank, step, micro, torch_dtype)
        return F.cross_entropy(net(*inputs, **_extra(model, rank, step)).float(), target)

    for step in range(steps):
        if flavour == "plain":
            loss_of(ref, step, 0).backward()
            loss_of(ours, step, 0).backward()
        elif flavour == "no_sync":  # gradient accumulation over 3 micro-batches
            for net in (ref, ours):
                with net.no_sync():
                    loss_of(net, step, 0).backward()
                    loss_of(net, step, 1).backward()
                loss_of(net, step, 2).backward()
        elif flavour == "multi_backward":  # ours syncs every backward; DDP is told to sync only the last
            with ref.no_sync():
                loss_of(ref, step, 0).backward()
            loss_of(ref, step, 1).backward()
            loss_of(ours, step, 0).backward()
            loss_of(ours, step, 1).backward()
        else:
            raise ValueError(flavour)
        rec.grads(ref, ours)
        opt_ref.step()
        opt_ours.step()
        opt_ref.zero_grad(set_to_none=set_to_none)
        opt_ours.zero_grad(set_to_none=set_to_none)

    param_diff = max(
        (a.double() - b.double()).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters())
    )
    buffer_diff = max(
        [(a.double() - b.double()).abs().max().item() for a, b in zip(ref.buffers(), ours.buffers())] or [0.0]
    )
    # Rounding differences in the values scale with the values themselves (BatchNorm's running
    # variance is several times larger than any gradient).
    param_scale = max(p.detach().abs().max().item() for p in ref.parameters())
    buffer_scale = max(
        [b.double().abs().max().item() for b in ref.buffers() if b.is_floating_point()] or [0.0]
    )
    params_equal_across_ranks = _same_on_all_ranks(list(ours.parameters()))
    return {
        "max_grad_diff": rec.grad,
        "grad_scale": rec.scale,
        "eps": torch.finfo(torch_dtype).eps,
        "max_param_diff": param_diff,
        "max_buffer_diff": buffer_diff,
        "param_scale": param_scale,
        "buffer_scale": buffer_scale,
        "grads_bit_exact": rec.bit_exact,
        "params_bit_exact": all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters())),
        "none_mismatch": rec.none_mismatch,
        "ranks_agree": params_equal_across_ranks,
        "units": ours.stats.units,
        "replans": ours.stats.replans,
        "plans_timed": ours.stats.plans_timed,
        "plan": ours.plan(),
    }


def _same_on_all_ranks(params: list[torch.Tensor]) -> bool:
    flat = torch.cat([p.detach().double().reshape(-1) for p in params])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def rank_fails_mid_backward(
    rank: int, world: int, how: str = "die", timeout_s: float = 3.0
) -> dict[str, Any]:
    """Rank `world - 1` dies (or hangs) inside backward; the others must raise, naming a layer, in time."""
    torch.manual_seed(0)
    model = MLP()

    class Trap(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _TrapFn.apply(x)

    model.net.insert(2, Trap())  # between the first and second linear layer: mid-backward
    # All ranks here first (default timeout): on a busy machine one rank can start seconds late,
    # and the short `timeout_s` is for the failure below, not for process start-up.
    dist.barrier()
    ours = LayerwiseDDP(model, timeout_s=timeout_s)
    x = torch.randn(8, 20)
    F.cross_entropy(ours(x), torch.zeros(8, dtype=torch.long)).backward()  # one good step
    _TrapFn.armed = rank == world - 1 and how
    started = time.monotonic()
    try:
        F.cross_entropy(ours(x), torch.zeros(8, dtype=torch.long)).backward()
    except Exception as exc:
        return {"error_type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    return {"error_type": None, "message": "", "seconds": time.monotonic() - started}


class _TrapFn(torch.autograd.Function):
    armed: str | bool = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _TrapFn.armed == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if _TrapFn.armed == "hang":
            time.sleep(3600)
        return grad


def compare_many(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several compare_with_ddp scenarios in one set of processes (spawning costs seconds)."""
    results = []
    for case in cases:
        try:
            results.append(compare_with_ddp(rank, world, **case))
        except Exception as exc:  # reported per case; the next case still runs
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return results


def error_feedback(rank: int, world: int, specs: list[str], steps: int = 5) -> dict[str, Any]:
    """Error feedback, checked on what each rank actually hands to the collectives.

    Per rank and unit: sum over steps of what was sent + the residual == sum over
    steps of (gradient / world).  For PowerSGD, whose error is taken against the
    shared approximation, the same identity is checked summed over ranks, with
    the received sums.
    """
    from elasticfed.cloud import collectives, compression

    sent: dict[str, list[torch.Tensor]] = {}
    real_all_reduce, real_all_gather = collectives.UnitComm.all_reduce, collectives.UnitComm.all_gather

    def recording_all_reduce(self: Any, tensor: torch.Tensor) -> Any:
        sent.setdefault(self.label, []).append(tensor.detach().clone())
        return real_all_reduce(self, tensor)

    def recording_all_gather(self: Any, outputs: Any, tensor: torch.Tensor) -> Any:
        sent.setdefault(self.label, []).append(tensor.detach().clone())
        return real_all_gather(self, outputs, tensor)

    collectives.UnitComm.all_reduce = recording_all_reduce  # type: ignore[method-assign]
    collectives.UnitComm.all_gather = recording_all_gather  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        for spec in specs:
            sent.clear()
            torch.manual_seed(7)
            ours = LayerwiseDDP(MLP(), compression=spec, pack_cap_bytes=0)
            plain = MLP()
            index = {name: i for i, (name, _) in enumerate(plain.named_parameters())}
            units = ours.sync.units
            true_sum = [torch.zeros(u.flat.numel(), dtype=torch.float64) for u in units]
            received_sum = [torch.zeros(u.flat.numel(), dtype=torch.float64) for u in units]
            opt = torch.optim.SGD(ours.parameters(), lr=0.05)
            plain_params = list(plain.parameters())
            our_params = list(ours.module.parameters())
            for step in range(steps):
                plain.load_state_dict(ours.module.state_dict())
                plain.zero_grad()
                (x,), y = _batch("mlp", rank, step)
                F.cross_entropy(plain(x), y).backward()
                F.cross_entropy(ours(x), y).backward()
                for u, unit in enumerate(units):
                    names = [ours.layer_names[i] for i in unit.params]
                    true_sum[u] += torch.cat(
                        [plain_params[index[n]].grad.reshape(-1) for n in names]
                    ).double()
                    received_sum[u] += torch.cat(
                        [our_params[index[n]].grad.reshape(-1) for n in names]
                    ).double()
                opt.step()
                opt.zero_grad()
            per_rank = global_ = 0.0
            scale = residual_norm = 0.0
            for u, unit in enumerate(units):
                comp = unit.compressor
                residual = (
                    comp.residual.double() if comp.residual is not None else torch.zeros_like(true_sum[u])
                )
                residual_norm += residual.norm().item()
                expected = true_sum[u] / world
                scale = max(scale, expected.abs().max().item())
                if isinstance(comp, compression.PowerSGDCompressor):
                    lhs = received_sum[u] + _sum_over_ranks(residual)
                    global_ = max(global_, (lhs - _sum_over_ranks(expected)).abs().max().item())
                    continue
                sent_sum = torch.zeros_like(expected)
                for wire in sent[unit.label]:
                    if isinstance(comp, compression.TopKCompressor):
                        values = wire[: comp._vbytes].view(comp._dtype).double()
                        indices = wire[comp._vbytes :].view(torch.int32).long()
                        sent_sum.index_add_(0, indices, values)
                    else:
                        sent_sum += wire.double()
                per_rank = max(per_rank, (sent_sum + residual - expected).abs().max().item())
            dense = sum(p.numel() * p.element_size() for p in our_params)
            out[spec] = {
                "per_rank_violation": per_rank,
                "global_violation": global_,
                "scale": scale,
                "residual_norm": residual_norm,
                "wire_bytes": ours.stats.wire_bytes_last_step,
                "dense_bytes": dense,
            }
    finally:
        collectives.UnitComm.all_reduce = real_all_reduce  # type: ignore[method-assign]
        collectives.UnitComm.all_gather = real_all_gather  # type: ignore[method-assign]
    return out


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def divergence_is_named(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 nudges one layer behind the sync's back; the check must name that layer on every rank."""
    torch.manual_seed(0)
    ours = LayerwiseDDP(MLP(), check_every=2)
    (x,), y = _batch("mlp", rank, 0)
    F.cross_entropy(ours(x), y).backward()  # forward 1: no check
    if rank == 1:
        with torch.no_grad():
            ours.module.net[2].weight[3, 4] += 1e-6
    try:
        ours(x)  # forward 2: checked
    except Exception as exc:
        return {"error_type": type(exc).__name__, "message": str(exc)}
    return {"error_type": None, "message": ""}


def train_digits(rank: int, world: int, compressions: list[str], epochs: int = 20) -> dict[str, Any]:
    """Train the embedded digits task once per compression; report accuracy and bytes."""
    from elasticfed.cloud.config import SyncSettings, TrainSettings
    from elasticfed.cloud.train import train
    from elasticfed.common.tasks.digits import task

    out = {}
    for spec in compressions:
        result = train(
            task(), SyncSettings(compression=spec), TrainSettings(epochs=epochs), torch.device("cpu")
        )
        out[spec] = result.as_dict()
    return out


def sync_log_lines(rank: int, world: int) -> list[str]:
    """At debug level every unit logs one [SYNC] line per step."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("elasticfed.sync")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    ours = LayerwiseDDP(MLP(), pack_cap_bytes=0)
    (x,), y = _batch("mlp", rank, 0)
    F.cross_entropy(ours(x), y).backward()
    return [line for line in records if line.startswith("[SYNC]")]


def edge_mixing(rank: int, world: int, weight: float, steps: int = 4) -> dict[str, Any]:
    """Hybrid mode's arithmetic: a mixing step's gradient is (1 - w) x cloud mean + w x edge average.

    Rank 0 queues one edge round (a known per-layer average) in a real gateway's
    EdgeRounds; every rank runs the training loop's calls (begin_step,
    seed_gradients, backward, end_step).  Each rank also computes its own plain
    gradient on a copy, and the all-gathered copies give the expected result.
    """
    from elasticfed.cloud.gateway import Gateway
    from elasticfed.cloud.hybrid import EdgeMixing, EdgeRounds
    from elasticfed.common.gradient_hooks import trainable_parameters

    torch.manual_seed(0)
    module = MLP()
    reference = copy.deepcopy(module)
    rounds = gateway = None
    if rank == 0:
        rounds = EdgeRounds()
        gateway = Gateway(module, None, update=rounds)
    params = [p for _, p in trainable_parameters(module)]
    ref_params = [p for _, p in trainable_parameters(reference)]
    model = LayerwiseDDP(module, pack_cap_bytes=0)
    mixing = EdgeMixing(params, weight, gateway=gateway, rounds=rounds, idle_s=0.0)
    gen = torch.Generator().manual_seed(123)
    edge_avg = [torch.randn(p.numel(), generator=gen) for p in params]
    if rounds is not None:
        rounds.apply(1, edge_avg, [7] * len(params))  # waits for the end of the first step
    mixed, errors = [], []
    step = 0
    while True:
        scale = mixing.begin_step()
        if scale is None:
            break
        x, y = _batch("mlp", rank, step)
        loss = F.cross_entropy(model(*x), y)
        module.zero_grad(set_to_none=True)
        mixing.seed_gradients()
        (loss * scale).backward()
        # The reference: this rank's plain gradient, all-gathered and averaged by hand.
        reference.load_state_dict(module.state_dict())
        reference.zero_grad(set_to_none=True)
        F.cross_entropy(reference(*x), y).backward()
        mix = mixing.mixes
        assert scale == (1 - weight if mix else 1.0)
        mixed.append(mix)
        worst = 0.0
        for p, r, avg in zip(params, ref_params, edge_avg):
            every = [torch.empty_like(r.grad) for _ in range(world)]
            dist.all_gather(every, r.grad.contiguous())
            cloud = torch.stack(every).mean(0)
            expected = (1 - weight) * cloud + weight * avg.view_as(cloud) if mix else cloud
            worst = max(worst, float((p.grad - expected).abs().max()))
        errors.append(worst)
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
        step += 1
        mixing.end_step(planned_done=step >= steps)
    mixing.finish()
    digest = [float(p.detach().double().sum()) for p in params]
    return {
        "mixed": mixed,
        "errors": errors,
        "digest": digest,
        "rounds": mixing.counts.rounds,
        "steps_by_layer": mixing.counts.steps_by_layer,
    }


def edge_mixing_drain(rank: int, world: int, edges: str, drain_s: float) -> dict[str, Any]:
    """After the planned epochs (done after step 3) the job trains on while edges are heard, at most
    `drain_s`.  `edges`: "heard" (a heartbeat before every step), "quiet" (none since the start)."""
    from elasticfed.cloud.gateway import Gateway
    from elasticfed.cloud.hybrid import EdgeMixing, EdgeRounds
    from elasticfed.common.gradient_hooks import trainable_parameters

    torch.manual_seed(0)
    module = MLP()
    rounds = gateway = None
    if rank == 0:
        rounds = EdgeRounds()
        gateway = Gateway(module, None, update=rounds)
    params = [p for _, p in trainable_parameters(module)]
    model = LayerwiseDDP(module, pack_cap_bytes=0)
    mixing = EdgeMixing(params, 0.5, gateway=gateway, rounds=rounds, idle_s=60.0, drain_s=drain_s)
    steps, cap = 0, 12  # the cap stands for "still draining": the loop itself never stops the job
    while steps < cap:
        scale = mixing.begin_step()
        if scale is None:
            break
        if gateway is not None and edges == "heard":
            gateway.last_heard_at = gateway.clock()
        x, y = _batch("mlp", rank, steps)
        module.zero_grad(set_to_none=True)
        mixing.seed_gradients()
        (F.cross_entropy(model(*x), y) * scale).backward()
        steps += 1
        mixing.end_step(planned_done=steps >= 3)
    mixing.finish()
    return {
        "steps": steps,
        "capped": steps == cap,
        "digest": [float(p.detach().double().sum()) for p in params],
    }


def edge_mixing_stops(rank: int, world: int, why: str) -> dict[str, Any]:
    """Rank 0 stops the job mid-training (its SIGTERM, or its gateway thread died): every rank stops
    at the same step, and the round queued before the stop is still mixed in."""
    import threading

    from elasticfed.cloud.gateway import Gateway
    from elasticfed.cloud.hybrid import EdgeMixing, EdgeRounds
    from elasticfed.common.gradient_hooks import trainable_parameters

    torch.manual_seed(0)
    module = MLP()
    rounds = gateway = thread = None
    if rank == 0:
        rounds = EdgeRounds()
        gateway = Gateway(module, None, update=rounds)
        thread = threading.Thread(target=lambda: None)  # stands for the gateway's serving thread
        thread.start()
        if why == "sigterm":
            thread.join()
            thread = None
    params = [p for _, p in trainable_parameters(module)]
    model = LayerwiseDDP(module, pack_cap_bytes=0)
    mixing = EdgeMixing(params, 0.5, gateway=gateway, rounds=rounds, gateway_thread=thread, idle_s=60.0)
    if rounds is not None:
        rounds.apply(1, [torch.ones(p.numel()) for p in params], [3] * len(params))
        if why == "dead-gateway":
            thread.join()  # it has ended: the gateway is gone under the job
        else:
            mixing.stop_requested.set()
    steps, mixed = 0, []
    while steps < 50:  # the planned epochs are far from done: only the stop ends the loop
        scale = mixing.begin_step()
        if scale is None:
            break
        x, y = _batch("mlp", rank, steps)
        module.zero_grad(set_to_none=True)
        mixing.seed_gradients()
        (F.cross_entropy(model(*x), y) * scale).backward()
        mixed.append(mixing.mixes)
        steps += 1
        mixing.end_step(planned_done=False)
    mixing.finish()
    return {
        "steps": steps,
        "mixed": mixed,
        "rounds": mixing.counts.rounds,
        "gateway_failed": mixing.gateway_failed,
        "digest": [float(p.detach().double().sum()) for p in params],
    }


def hierarchical_against_flat(rank: int, world: int, kinds: str) -> dict[str, Any]:
    """Sums of random tensors in three stages (rank r of kind kinds[r]) against one flat all-reduce."""
    hierarchy = Hierarchy.of_kinds(kinds[rank])
    timeout = dist.default_pg_timeout
    worst = 0.0
    scale = 0.0
    for n in (1, 7, 1000, 65_537):
        torch.manual_seed(100 * rank + n)
        mine = torch.randn(n)
        flat = mine.clone()
        dist.all_reduce(flat)
        stages = HierarchicalSum(n, mine.dtype, mine.device, hierarchy, f"{n} entries", timeout)
        summed = mine.clone()
        stages.start(summed)
        stages.advance()
        stages.finish()
        worst = max(worst, (summed.double() - flat.double()).abs().max().item())
        scale = max(scale, flat.abs().max().item())
    refused = ""
    try:
        LayerwiseDDP(MLP(), compression="fp16", hierarchy=hierarchy)
    except ValueError as exc:
        refused = str(exc)
    return {
        "max_abs_diff": worst,
        "scale": scale,
        "kinds": list(hierarchy.kinds),
        "leads": hierarchy.leads,
        "refused": refused,
    }


def mixed_devices(rank: int, world: int, steps: int = 3, gpu: bool = True) -> dict[str, Any]:
    """Rank 0 on CUDA, the others on the CPU, in one job ("cpu:gloo,cuda:nccl"): LayerwiseDDP with a
    hierarchy by device against the flat average of the same gradients on the CPU."""
    device = torch.device("cuda", 0) if rank == 0 and gpu else torch.device("cpu")
    torch.manual_seed(1000 + rank)
    model = MLP().to(device)
    ours = LayerwiseDDP(model, hierarchy=Hierarchy.by_device(device), pack_cap_bytes=0)
    # The optimizer users run: on CUDA and on the CPU its kernels differ, and replicas must not drift.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    worst = 0.0
    for step in range(steps):
        inputs, target = _batch("mlp", rank, step)
        inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
        alone = copy.deepcopy(model)  # this rank's own gradient, outside the sync's hooks
        mine = torch.autograd.grad(F.cross_entropy(alone(*inputs), target), list(alone.parameters()))
        F.cross_entropy(ours(*inputs), target).backward()
        for g_mine, p in zip(mine, model.parameters()):
            flat = g_mine.detach().cpu()
            dist.all_reduce(flat)  # the flat reference, over gloo
            assert p.grad is not None
            worst = max(worst, (p.grad.detach().cpu().double() - (flat / world).double()).abs().max().item())
        optimizer.step()
        optimizer.zero_grad()
    ours.check_consistency()  # every rank holds the same parameters, on either device
    return {"max_abs_diff": worst, "device": str(device)}
