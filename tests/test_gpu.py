"""The edge agent training on a GPU, as on a Jetson: gradients leave the device without backward
waiting for them (edge/cache.py stages them in pinned memory), and every step still arrives once.

CI has no GPU: these tests skip there and run on a GPU lender (`--train-device auto` picks it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fleet import edge, gateway_thread

from elasticfed.edge.persistence import MASS_AUDIT_FILE, read_mass_audit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "topk:0.05+int8"])
def test_an_edge_on_the_gpu_delivers_every_step_once_through_loss(tmp_path: Path, compression: str) -> None:
    with gateway_thread(quorum=1, round_deadline_s=0.2, audit_mass=True) as gateway:
        proc = edge(
            gateway.bound_endpoint, "gpu", "--train-max-steps", "600", "--audit-mass",
            "--state-dir", str(tmp_path), "--compression", compression,
            "--faults", "loss=0.2,duplicate=0.1,seed=2",
        )  # fmt: skip
        summary = proc.summary(240)
        applied = gateway.applied_mass("gpu")
        version = gateway.version
    start = next(e for e in proc.events if e.get("event") == "start")
    assert start["device"].startswith("cuda"), start  # auto found the GPU
    assert summary["delivered_all"] and summary["undelivered_steps"] == 0, summary
    assert summary["steps"] == 600 and summary["models_adopted"] > 1 and version > 1
    assert summary["loss"] < 1.0, summary["loss"]  # it trained (digits starts at 2.3)
    worst = 0.0
    for names, mass in read_mass_audit(tmp_path / MASS_AUDIT_FILE):
        total = torch.cat([applied[n] for n in names]) + mass["dropped"] + mass["residual"] + mass["pending"]
        assert mass["produced"].abs().sum() > 0
        scale = float(mass["produced"].abs().max())
        worst = max(worst, float((total - mass["produced"]).abs().max()) / scale)
    assert worst < 1e-5, worst  # what the GPU produced = what the gateway applied + what the edge holds


@pytest.mark.slow
def test_cuda_and_cpu_ranks_average_in_one_job(tmp_path: Path) -> None:
    """Issue #23's CPU+GPU group: a CUDA rank (NCCL within its kind) and two CPU ranks (gloo)."""
    import dist_cases
    from distributed import run_ranks

    results = run_ranks(dist_cases.mixed_devices, 3, tmp_path, backend="cpu:gloo,cuda:nccl")
    assert [r["ok"]["device"] for r in results] == ["cuda:0", "cpu", "cpu"]
    for r in results:
        assert r["ok"]["max_abs_diff"] <= 1e-6, r
