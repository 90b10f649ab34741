"""Cloud sync step time: torch DDP (default buckets) against LayerwiseDDP, alternating in one run.

Two gloo ranks (real processes, one compute thread each) train two models:
`wide`, 16 x (Linear(512, 512) + GELU) + Linear(512, 10) at batch 64, and
`deep`, 48 x (Linear(128, 128) + LayerNorm + GELU) + Linear(128, 10) at batch 64
(145 small layers: per-collective overhead dominates).  Each round times a
block of steps of every contender in turn, so machine noise hits all of them;
the figure is the median block.  A step is forward, backward, optimizer step.
Last line: one JSON object.

    python benchmarks/cloud_sync.py [--rounds 12] [--steps 10] [--device cuda]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elasticfed.cloud.layerwise import LayerwiseDDP

COMPRESSED = ("topk:0.01", "powersgd:4")


def wide() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(512, 512), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(512, 10))


def deep() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(48):
        layers += [nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


MODELS = {"wide": (wide, 512), "deep": (deep, 128)}


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _block_seconds(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    device: torch.device,
) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, opt, x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as the slowest rank
    return float(elapsed.item()) / steps


def _grad_diff(ddp: nn.Module, ours: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    for m in (ddp, ours):
        m.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(x), y).backward()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ddp.parameters(), ours.parameters()))
    for m in (ddp, ours):
        m.zero_grad(set_to_none=True)
    return diff


def worker(rank: int, world: int, port: int, opts: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    device = torch.device(opts.device, rank) if opts.device == "cuda" else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    report: dict[str, dict] = {}
    for name in opts.models:
        build, width = MODELS[name]
        torch.manual_seed(0)
        base = build().to(device)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(opts.batch, width, generator=g).to(device)
        y = torch.randint(0, 10, (opts.batch,), generator=g).to(device)
        contenders = {
            "ddp": DDP(copy.deepcopy(base), device_ids=[rank] if device.type == "cuda" else None),
            "layerwise": LayerwiseDDP(copy.deepcopy(base)),
        }
        contenders["adaptive"] = LayerwiseDDP(copy.deepcopy(base), strategy="adaptive", replan_every=50)
        for spec in COMPRESSED:
            contenders[spec] = LayerwiseDDP(copy.deepcopy(base), compression=spec)
        grad_diff = _grad_diff(contenders["ddp"], contenders["layerwise"], x, y)
        opts_by = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in contenders.items()}
        for k, m in contenders.items():  # warm-up: allocate, connect; adaptive times its candidate plans
            for _ in range(40 if k == "adaptive" else 8):
                _step(m, opts_by[k], x, y)
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(opts.rounds):
            for k, m in contenders.items():
                times[k].append(_block_seconds(m, opts_by[k], x, y, opts.steps, device))
        dense = sum(p.numel() * p.element_size() for p in base.parameters())
        report[name] = {
            "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "max_abs_grad_diff": grad_diff,
            "bytes_per_step": {
                "ddp": dense,
                **{k: m.stats.wire_bytes_last_step for k, m in contenders.items() if k != "ddp"},
            },
            "units": contenders["layerwise"].stats.units,
            "adaptive_units": contenders["adaptive"].stats.units,
            "layers": len(contenders["layerwise"].layer_names),
        }
        del contenders, opts_by  # their pending gloo work goes before the group does
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    # Both ranks done before either tears down: once in CI a rank aborted at exit ("terminate
    # called without an active exception") with the models and their work still alive.
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds (median is reported)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    opts = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "report.json")
        mp.start_processes(worker, args=(2, port, opts, out), nprocs=2, start_method="spawn")
        report = json.loads(Path(out).read_text())

    print(f"{'model':6} {'contender':11} {'step ms':>8} {'vs DDP':>7} {'bytes/step':>11}")
    for name, r in report.items():
        for k, ms in r["step_ms"].items():
            print(f"{name:6} {k:11} {ms:8.2f} {ms / r['step_ms']['ddp']:7.3f} {r['bytes_per_step'][k]:11d}")
        print(
            f"{name:6} layers {r['layers']}, units {r['units']} (adaptive: {r['adaptive_units']}), "
            f"max |grad diff| vs DDP {r['max_abs_grad_diff']:.2e}"
        )
    first = report[opts.models[0]]
    result = {
        "step_ms_ddp": first["step_ms"]["ddp"],
        "step_ms_layerwise": first["step_ms"]["layerwise"],
        "ratio_vs_ddp": first["step_ms"]["layerwise"] / first["step_ms"]["ddp"],
        "max_abs_grad_diff": max(r["max_abs_grad_diff"] for r in report.values()),
        "bytes_per_step": first["bytes_per_step"],
        "models": {
            name: {
                "step_ms": r["step_ms"],
                "ratio_vs_ddp": {k: v / r["step_ms"]["ddp"] for k, v in r["step_ms"].items() if k != "ddp"},
                "bytes_per_step": r["bytes_per_step"],
                "max_abs_grad_diff": r["max_abs_grad_diff"],
                "layers": r["layers"],
                "units": r["units"],
                "adaptive_units": r["adaptive_units"],
            }
            for name, r in report.items()
        },
        "ranks": 2,
        "device": opts.device,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
