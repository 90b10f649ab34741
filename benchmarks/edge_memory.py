"""An edge agent's memory through a long outage: the derived budget against the measured peak.

One edge (`python -m elasticfed.edge`, the defaults a user gets: `auto` compression, patches
downlink) in a network namespace behind a tbf cap trains the base text task
against a gateway built from `cloud serve`'s defaults; after `--before-s` its
link drops every packet both ways for `--outage-s` (default 10 minutes), then
comes back for `--after-s`.  The edge's resident memory (VmRSS, and the kernel's
high-water mark VmHWM) is sampled every second.

The budget, derived from the model (P parameters of 4 bytes, D = 4P bytes):
weights, gradients and SGD momentum (3 D); the pushed direction's own momentum
(`edge/direction.py`, D); the gradient cache's bound (`cache_bound_bytes`, which
the edge reports: per unit a pending sum, a flight, a spare, the residual
under compression and up to `MAX_HELD` held sums); the public model the edge
holds and a download's buffer (2 D, the patch applied to a copy: D more at
most); plus the runtime: a process that imported everything, loaded the task's
data and built the model, measured in this run.  Training's activations come
on top (batch x context x width; measured as what the peak exceeds the rest).

Last line, one JSON object: the budget's parts, `budget_mb`, the peaks before,
during and after the outage, `held_through_outage` (the outage's peak within 5%
of training online's), and what the edge still held at exit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks", REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from netns import Lab, Unavailable, sweep_stale  # noqa: E402  (tests/netns.py)
from wan import BASE_TASK, SMALL_TASK, Worker, make_keys, wait_started  # noqa: E402

from elasticfed.cloud.config import CloudConfig  # noqa: E402
from elasticfed.cloud.durability import GatewayCheckpoints  # noqa: E402
from elasticfed.cloud.serve import build_gateway, round_logger  # noqa: E402
from elasticfed.common.task import load_task  # noqa: E402

RUNTIME_PROBE = """
import resource, sys
import torch
from elasticfed.common.task import load_task
from elasticfed.edge.agent import ElasticEdge  # noqa: F401  (everything the agent imports)
task = load_task(sys.argv[1])
model = task.build_model()
data = task.train_set()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in bytes; (0, 0) once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    kib = [int(fields.get(k, "0 kB").split()[0]) for k in ("VmRSS", "VmHWM")]
    return kib[0] * 1024, kib[1] * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small task, 20 s outage (a test)")
    parser.add_argument("--task", default=None, help=f"default {BASE_TASK}; quick: {SMALL_TASK}")
    parser.add_argument("--rate", default="10mbit", help="tbf cap of the edge's link, each way")
    parser.add_argument("--before-s", type=float, default=None, help="before the outage (90; quick 20)")
    parser.add_argument("--outage-s", type=float, default=None, help="the outage (600; quick 20)")
    parser.add_argument("--after-s", type=float, default=None, help="training after it (90; quick 25)")
    args = parser.parse_args(argv)
    spec = args.task or (SMALL_TASK if args.quick else BASE_TASK)
    before = args.before_s or (20.0 if args.quick else 90.0)
    outage = args.outage_s or (20.0 if args.quick else 600.0)
    after = args.after_s or (25.0 if args.quick else 90.0)
    try:
        sweep_stale()
        Lab.create().close()
    except Unavailable as exc:
        print(f"edge_memory: skipped: no network namespaces here: {exc}")
        print(json.dumps({"skipped": str(exc)}))
        return 0
    task = load_task(spec)
    params = sum(p.numel() for p in task.build_model().parameters())
    dense = 4 * params
    probe = subprocess.run(
        [sys.executable, "-c", RUNTIME_PROBE, spec], capture_output=True, text=True, cwd=REPO, check=True
    )
    runtime = int(probe.stdout.strip().splitlines()[-1])
    work = Path(tempfile.mkdtemp(prefix="elasticfed-memory-"))
    lab = Lab.create()
    stop = threading.Event()
    worker: Worker | None = None
    samples: list[tuple[float, int, int]] = []
    try:
        net = lab.add_edge()
        net.set_rate(args.rate)
        admission, security = make_keys(work / "keys", 1)
        defaults = CloudConfig()
        config = replace(
            defaults,
            mode="standalone",
            task=spec,
            gateway=replace(
                defaults.gateway,
                bind=f"tcp://{lab.gateway_address}:0",
                checkpoint_dir=str(work / "gateway-checkpoints"),
            ),
        )
        g = config.gateway
        checkpoints = GatewayCheckpoints(
            g.checkpoint_dir, g.checkpoint_every_rounds, g.checkpoint_keep, every_s=g.checkpoint_every_s
        )
        gateway = build_gateway(config, task, round_logger(admission), admission, checkpoints)
        gateway.restore()
        port = gateway.bind().rsplit(":", 1)[1]
        threading.Thread(target=gateway.serve, args=(stop,), name="gateway", daemon=True).start()
        argv = [
            sys.executable, "-m", "elasticfed.edge", "--gateway", f"tcp://{lab.gateway_address}:{port}",
            "--client-id", "edge-0", "--task", spec, "--state-dir", str(work / "edge-state"),
            "--status-every-s", "5", *security[0],
        ]  # fmt: skip
        worker = Worker("edge-0", net.argv(argv), work / "edge.log")
        t0 = wait_started([worker], 180.0)
        phases = [("before", before), ("outage", outage), ("after", after)]
        peaks: dict[str, int] = {}
        for phase, seconds in phases:
            if phase == "outage":
                net.set_loss(100, 100)
            elif phase == "after":
                net.set_loss(0, 0)
            end = time.monotonic() + seconds
            peak = 0
            while time.monotonic() < end and worker.proc.poll() is None:
                now_rss, _ = rss(worker.proc.pid)
                samples.append((time.monotonic() - t0, now_rss, 0))
                peak = max(peak, now_rss)
                time.sleep(1.0)
            peaks[phase] = peak
        _, hwm = rss(worker.proc.pid)
        worker.stop()
        code = worker.finish(timeout=120)
        stop.set()
        summary = worker.summary or {}
    finally:
        stop.set()
        if worker is not None and worker.proc.poll() is None:
            worker.proc.kill()
        lab.close()
    cache_bound = int(summary.get("cache_bound_bytes", 0))
    parts = {
        "weights_grads_momentum_mb": 3 * dense / 1e6,
        "pushed_direction_momentum_mb": dense / 1e6,
        "cache_bound_mb": cache_bound / 1e6,
        "public_model_and_download_mb": 3 * dense / 1e6,
        "runtime_mb": runtime / 1e6,
    }
    budget = sum(parts.values())
    produced = sum(summary.get("produced_steps", {}).values()) if summary else 0
    undelivered = sum(summary.get("undelivered_by_layer", {}).values()) if summary else -1
    result = {
        "task": task.name,
        "parameters": params,
        "rate": args.rate,
        "outage_s": outage,
        **{k: round(v, 1) for k, v in parts.items()},
        "budget_mb": round(budget, 1),
        "peak_rss_before_mb": round(peaks.get("before", 0) / 1e6, 1),
        "peak_rss_outage_mb": round(peaks.get("outage", 0) / 1e6, 1),
        "peak_rss_after_mb": round(peaks.get("after", 0) / 1e6, 1),
        "hwm_mb": round(hwm / 1e6, 1),
        # What the peak holds beyond the derived state: activations, allocator slack.
        "activations_and_other_mb": round((hwm - budget * 1e6) / 1e6, 1),
        "outage_growth_mb": round((peaks.get("outage", 0) - peaks.get("before", 0)) / 1e6, 1),
        # Ten minutes offline cost no more than training online did (5% for allocator noise).
        "held_through_outage": peaks.get("outage", 0) <= 1.05 * peaks.get("before", 0),
        "cache_bytes_max": max(summary.get("cache_bytes", 0), 0) if summary else None,
        "steps": summary.get("steps"),
        "produced_steps": produced,
        "undelivered_steps": undelivered,
        "reconnects": summary.get("edge_reconnects_total"),
        "compression": summary.get("compression"),
        "exit": code,
    }
    print(
        f"edge_memory: {task.name} ({params / 1e6:.1f} M parameters), {args.rate}, "
        f"{outage:.0f} s outage: budget {budget:.0f} MB "
        + ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
        + f"; peak RSS before {result['peak_rss_before_mb']} MB, during {result['peak_rss_outage_mb']} MB, "
        f"after {result['peak_rss_after_mb']} MB; high-water {result['hwm_mb']} MB"
    )
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
