"""Bounded memory (DESIGN.md guarantee 2) through an outage and across many rounds, measured as RSS.

- An edge agent (its own process, tests/memory_probe.py) with a 17 MB model
  trains through the equivalent of a ten-minute outage (its timers scaled down
  30x: as many reconnects, saves and re-sends) while its gateway is dead; the
  outage may leave its RSS grown by less than twice the model.  Then a
  restarted gateway gets everything, once.
- A gateway (`cloud serve`, checkpoints every round) serves 64 devices for 120
  rounds: its RSS is flat once warm.

Figures are printed (`-s`) for the notes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from fleet import Proc, free_port, gateway_process, pumped
from memory_probe import build_model
from scripted import ScriptedDevice

from elasticfed.cloud.aggregation import DeadlineQuorum, MeanStep
from elasticfed.cloud.durability import GatewayCheckpoints
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.common.tasks.digits import build_model as digits_model
from elasticfed.protocol import Ack, Dense, LayerGradient, Manifest, Push, Welcome

pytestmark = pytest.mark.slow

MiB = 1 << 20


def probe_gateway(directory: Path, endpoint: str) -> Gateway:
    model = build_model()
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.001),
        GatewayOptions(bind=endpoint),
        weighting=MeanStep(max_staleness=1_000_000),
        rounds=DeadlineQuorum(deadline_s=0.2, quorum=1),
        checkpoints=GatewayCheckpoints(str(directory), every_rounds=1),
    )
    assert gw.checkpoints is not None
    gw.restore()
    return gw


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_an_edge_through_a_ten_minute_outage_grows_by_less_than_twice_its_model(
    tmp_path: Path, procs: list[Proc]
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    probe = Proc(
        [sys.executable, str(Path(__file__).with_name("memory_probe.py")), endpoint, str(tmp_path / "edge")],
        "probe",
        stdin=True,
    )
    procs.append(probe)
    with pumped(probe_gateway(tmp_path / "gateway", endpoint)):
        warm = probe.wait_for(lambda e: e.get("event") == "warm", 120, "warm-up")
    # The gateway died (no checkpoint at exit); the edge trains on.
    probe.tell("outage")
    outage = probe.wait_for(lambda e: e.get("event") == "outage_done", 600, "the outage's end")
    with pumped(probe_gateway(tmp_path / "gateway", endpoint)) as gateway:
        probe.tell("drain")
        summary = probe.wait_for(lambda e: e.get("event") == "summary", 120, "a summary")
        applied = gateway.applied_steps["probe"]
    growth = outage["peak_rss"] - outage["baseline_rss"]
    settled = outage["end_rss"] - outage["baseline_rss"]
    figures = {
        "model_mib": round(warm["model_bytes"] / MiB, 1),
        "outage_steps": outage["steps"],
        "outage_s": outage["seconds"],
        "rss_baseline_mib": round(outage["baseline_rss"] / MiB, 1),
        "rss_peak_growth_mib": round(growth / MiB, 1),
        "rss_end_growth_mib": round(settled / MiB, 1),
        "reconnects": outage["reconnects"],
        "saves": outage["saves"],
        "cache_mib": round(outage["cache_bytes"] / MiB, 1),
        "summary": summary,
    }
    print(json.dumps(figures))
    # Ten minutes with the default timers: a reconnect every 5-10 s, a save every 10 s.
    assert outage["reconnects"] >= 60 and outage["saves"] >= 60, figures
    assert outage["undelivered_steps"] >= outage["steps"], figures
    # Everything reached the restarted gateway, once, and is durable.
    ok = summary["delivered"] and summary["undelivered_steps"] == 0 and summary["held_steps"] == 0
    assert ok, (figures, probe._tail())
    # What the outage leaves: RSS once the last step is done, against RSS when it began.  The
    # peak (also printed) adds the training step's own transient buffers and a save's copy.
    assert settled < 2 * warm["model_bytes"], figures
    assert summary["durable"] == summary["produced"], figures
    assert all(n == summary["produced"] for n in applied), (applied, figures)


def test_gateway_memory_with_64_edges_is_flat_across_rounds(tmp_path: Path, procs: list[Proc]) -> None:
    port = free_port()
    gateway = gateway_process(
        port,
        "--gateway-quorum", "64", "--gateway-round-deadline-s", "30", "--gateway-max-clients", "64",
        "--gateway-checkpoint-dir", str(tmp_path), "--gateway-checkpoint-every-rounds", "1",
    )  # fmt: skip
    procs.append(gateway)
    gateway.wait_for(lambda e: e.get("event") == "ready", 60, "a ready event")
    model = digits_model()
    manifest = Manifest.from_parameters(model.named_parameters())
    grads = {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()}
    devices = [ScriptedDevice(f"tcp://127.0.0.1:{port}", f"dev-{i}", manifest) for i in range(64)]
    for d in devices:
        assert isinstance(d.hello(), Welcome)
    samples = {}
    for round_number in range(1, 121):
        for d in devices:
            layers = tuple(LayerGradient(n, Dense(t), 1) for n, t in grads.items())
            ack = d.ask(Push(seq=d.seq, base_version=d.version, layers=layers, resolved_below=d.seq))
            assert isinstance(ack, Ack) and ack.accepted, ack
            d.seq += 1
        for d in devices:
            d.version = round_number  # the 64th push closed the round
        if round_number % 10 == 0:
            samples[round_number] = rss_of(gateway.proc.pid)
    commits = sum(len(d.commits) for d in devices)
    for d in devices:
        d.close()
    # The RSS settles slowly: +1.5 MiB from round 20 to 40, +0.8 from 60 to 120, flat at the
    # end (locally; 4.3 MiB from 20 to 120 under CI's load).  Python's heap grows by 70 KiB
    # over those 100 rounds (tracemalloc): the rest is the allocator's arenas settling, which
    # a bound from round 20 mistook for a leak.  From round 60 on, 2 MiB over 60 rounds of 64
    # pushes catches anything kept per push of more than about 550 bytes.
    warm = samples[60]
    figures = {
        "rss_mib_by_round": {r: round(v / MiB, 2) for r, v in samples.items()},
        "growth_after_round_60_mib": round((max(v for r, v in samples.items() if r >= 60) - warm) / MiB, 2),
        "commits_received": commits,
    }
    print(json.dumps(figures))
    assert commits >= 64 * 100, figures  # a checkpoint and a commit every round
    assert max(v for r, v in samples.items() if r >= 60) - warm <= 2 * MiB, figures
