"""Benchmarks keep working: each runs briefly and ends with one JSON object of its figures."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_codec_benchmark_reports_its_figures() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/codec.py", "--rounds", "1", "--repeat", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("encode_decode_gbps_4mib", "memcpy_gbps", "ratio_vs_memcpy", "small_layers_per_s"):
        assert figures[key] > 0, key
    # Zero copies is a property, not a speed: it holds on any machine.
    assert figures["copies_per_payload"] == 0
    assert figures["decode_copies_per_payload"] == 0
    costs = figures["gateway_ms_per_dense_mb"]
    assert set(costs) == {"none", "fp16", "int8", "topk:0.01", "topk:0.01+int8"}
    assert all(ms > 0 for ms in costs.values()), costs


@pytest.mark.slow
def test_cloud_sync_benchmark_reports_its_figures() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/cloud_sync.py",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--models",
            "deep",
            "wide",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("step_ms_ddp", "step_ms_layerwise", "ratio_vs_ddp"):
        assert figures[key] > 0, key
    assert figures["max_abs_grad_diff"] == 0.0  # 2 ranks: one addition per element, bit-exact
    assert set(figures["models"]) == {"deep", "wide"}
    sent = figures["bytes_per_step"]
    assert sent["layerwise"] == sent["ddp"] and sent["topk:0.01"] < sent["ddp"] / 10


@pytest.mark.slow
def test_edge_link_benchmark_reports_its_figures() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/edge_link.py", "--seconds", "0.5", "--steps", "3", "--blocks", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in (
        "push_mbps_4mib", "raw_zmq_mbps_4mib", "ratio_vs_raw_4mib", "layers_per_s_4kib",
        "raw_msgs_per_s_4kib", "edge_step_overhead_ratio", "mlp_step_overhead_ratio",
        # the cost of security: CURVE on against off, ours and raw pyzmq
        "curve_ratio", "push_mbps_4mib_curve", "curve_ratio_small", "layers_per_s_4kib_curve",
        "raw_curve_ratio", "raw_zmq_mbps_4mib_curve", "raw_curve_ratio_small", "raw_msgs_per_s_4kib_curve",
    ):  # fmt: skip
        assert figures[key] > 0, key
    assert figures["mlp_pushes_per_step"] > 0.5  # on a lossless link nearly every step is pushed


@pytest.mark.slow
def test_convergence_benchmark_writes_its_csv_plot_and_figures(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/convergence.py", "--time-s", "3", "--rounds", "60", "--losses", "0,60",
         "--packet-losses", "10", "--drain-s", "2", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(figures["final_acc"]) == {"0", "60"} and set(figures["time_to_90_s"]) == {"0", "60"}
    assert all(0.0 <= acc <= 1.0 for acc in figures["final_acc"].values())
    assert all(figures["audit_ok"].values()), (figures, result.stderr[-4000:])
    assert 0.0 < figures["fedavg_final_acc"] <= 1.0 and "fedavg_time_to_90_s" in figures
    assert set(figures["fedavg_lossy_final_acc"]) == {"60"}  # FedAvg over the same lossy link
    # Kernel packet loss ran, or the JSON says exactly why not.
    assert set(figures["packet_final_acc"]) == {"10"} or figures["packet_skipped"]
    with open(figures["csv"]) as f:
        rows = list(csv.DictReader(f))
    runs = {row["run"] for row in rows}
    assert {"fedavg", "fedavg, message loss 60%", "message loss 0%", "message loss 60%"} <= runs
    for name, acc in figures["final_acc"].items():  # the CSV's last point is the JSON's figure
        last = [row for row in rows if row["run"] == f"message loss {name}%"][-1]
        assert abs(float(last["accuracy"]) - acc) < 1e-4
    with open(figures["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_noniid_benchmark_quick_reports_consistent_figures() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/noniid.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    f = json.loads(result.stdout.strip().splitlines()[-1])
    runs = f["runs"]
    assert set(runs) == {"reference", "defaults dirichlet:0.1", "best dirichlet:0.1", "fedavg dirichlet:0.1"}
    assert f["audit_exact"] is True, (f, result.stderr[-4000:])
    assert f["default_noniid_acc"] == runs["defaults dirichlet:0.1"]["acc"]
    assert f["default_noniid_gap_pts"] == pytest.approx(
        100 * (f["iid_lossless_acc"] - f["default_noniid_acc"]), abs=0.01
    )
    assert f["fedavg_noniid_acc"] == runs["fedavg dirichlet:0.1"]["acc"]
    sites = runs["defaults dirichlet:0.1"]["sites"]
    assert len(sites) == 4 and f["worst_site_acc"] == min(sites)
    # The site figures weigh per-class accuracy by each site's label mix: their mean, weighted by the
    # sites' sizes, is near the test accuracy, and a skewed partition makes them differ.
    assert all(0.0 <= a <= 1.0 for a in sites) and max(sites) - min(sites) > 0.0
    # The gateway's new defaults weigh stale work instead of dropping it (the old max 8 dropped 30%).
    assert f["stale_dropped_share"] <= 0.05, f
    assert f["lm_bpb_gap"] is None and f["lm"] is None  # --quick leaves the text task out


@pytest.mark.slow
@pytest.mark.netns
def test_wan_benchmark_quick_reports_consistent_figures(tmp_path: Path) -> None:
    """benchmarks/wan.py --quick: every key, the count audit, and figures that agree with its CSV.

    Not the project's targets (those need the default size); only that the instrument is sound.
    """
    result = subprocess.run(
        [sys.executable, "benchmarks/wan.py", "--quick", "--out-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    if "skipped" in figures:
        pytest.skip(f"no network namespaces here: {figures['skipped']}")
    report = result.stdout[-6000:]
    rates = ("capped_models_per_edge_per_min", "reconnects_per_edge_per_min", "stale_dropped_share")
    for key in rates:
        assert isinstance(figures[key], (int, float)) and figures[key] >= 0, (key, report)
    assert figures["stale_dropped_share"] <= 1
    bpb = ("capped_final_bpb", "uncapped_final_bpb", "fedavg_final_bpb", "initial_bpb", "target_bpb")
    for key in bpb:  # null only for a model whose parameters went NaN
        assert figures[key] is None or isinstance(figures[key], float), (key, report)
    for key in ("capped_reached_target", "audit_exact", "target_below_initial"):
        assert isinstance(figures[key], bool), key
    assert figures["audit_exact"] is True, report
    assert isinstance(figures["fedavg_time_to_target_ratio"], float)
    budget = figures["budget_s"]
    if figures["uncapped_final_bpb"] is not None:
        assert figures["target_bpb"] == pytest.approx(figures["uncapped_final_bpb"] * 1.10, abs=1e-3)
    ours, theirs = figures["capped_time_to_target_s"], figures["fedavg_time_to_target_s"]
    assert figures["capped_reached_target"] == (ours is not None)
    ours_or_budget = budget if ours is None else ours
    theirs_or_budget = budget if theirs is None else theirs
    expected = theirs_or_budget / ours_or_budget if ours_or_budget > 0 else 1.0
    # The JSON's times are rounded to 0.1 s, its ratio comes from the unrounded ones: at 15 s
    # to target that alone is 0.3% each (CI: 1.023 reported, 15.4 / 15.1 = 1.0199 recomputed).
    slack = expected * (0.05 / max(ours_or_budget, 0.05) + 0.05 / max(theirs_or_budget, 0.05)) + 5e-4
    assert figures["fedavg_time_to_target_ratio"] == pytest.approx(expected, abs=slack)
    # Compression and downlink patches: the instrument's own consistency, and what must hold at any
    # size (nothing lost or counted twice, every edge's model the gateway's public one).
    assert figures["mass_audit_exact"] is True and figures["downlink_bit_identical"] is True, report
    assert figures["mass_audit_worst"] < 1e-5
    for key in ("uplink_bytes_ratio", "downlink_bytes_ratio", "capped_dense_downlink_bytes_ratio"):
        assert isinstance(figures[key], float) and figures[key] > 0, (key, report)
    # Whole models: at most one a version per edge, plus the snapshots of a start.
    assert figures["capped_dense_downlink_bytes_ratio"] >= 0.5
    if figures["uncapped_dense_final_bpb"] is not None:
        assert figures["target_bpb_dense"] == pytest.approx(
            figures["uncapped_dense_final_bpb"] * 1.05, abs=1e-3
        )
    assert figures["compressed_reached_target"] == (figures["compressed_time_to_target_s"] is not None)
    for key in ("time_to_target_speedup", "fedavg_vs_compressed_ratio"):
        assert isinstance(figures[key], float) and figures[key] > 0, key
    assert figures["bpb_gap"] is None or isinstance(figures["bpb_gap"], float)

    with open(figures["csv"]) as f:
        rows = list(csv.DictReader(f))
    by_run: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_run.setdefault(row["contender"], []).append(row)
    finals = {
        "elasticfed uncapped": "uncapped_final_bpb",
        "elasticfed uncapped dense": "uncapped_dense_final_bpb",
        "elasticfed capped": "capped_final_bpb",
        "elasticfed capped dense": "capped_dense_final_bpb",
        "fedavg capped": "fedavg_final_bpb",
    }
    assert set(by_run) == set(finals)
    for name, points in by_run.items():
        seconds = [float(p["seconds"]) for p in points]
        assert seconds[0] == 0.0 and seconds == sorted(seconds) and seconds[-1] <= budget + 5, name
        # Every contender starts from the same seed model, whose figure is initial_bpb.
        assert float(points[0]["bits_per_byte"]) == pytest.approx(figures["initial_bpb"], abs=1e-3), name
        if figures[finals[name]] is not None:  # the CSV's last point is the JSON's final figure
            assert float(points[-1]["bits_per_byte"]) == pytest.approx(figures[finals[name]], abs=1e-3)
        # The live model (what edges are served) beside the reported one (the gateway's average);
        # both start from the seed model, and FedAvg has only its global model.
        assert float(points[0]["live_bits_per_byte"]) == pytest.approx(figures["initial_bpb"], abs=1e-3)
        if name.startswith("elasticfed"):
            live = figures["live_final_bpb"][name]
            assert live is None or float(points[-1]["live_bits_per_byte"]) == pytest.approx(live, abs=1e-3)
        else:
            assert [p["live_bits_per_byte"] for p in points] == [p["bits_per_byte"] for p in points]
    if ours is not None:  # the time to target is the first capped point at or under it
        capped = by_run["elasticfed capped"]
        first = next(p for p in capped if float(p["bits_per_byte"]) <= figures["target_bpb"])
        assert float(first["seconds"]) == pytest.approx(ours, abs=0.1)
    with open(figures["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.netns
def test_edge_memory_quick_holds_through_an_outage(tmp_path: Path) -> None:
    """benchmarks/edge_memory.py --quick: the budget's parts, the peaks, and an outage that costs
    no memory beyond training online (the full run's 10 minutes are in the README)."""
    result = subprocess.run(
        [sys.executable, "benchmarks/edge_memory.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    if "skipped" in figures:
        pytest.skip(f"no network namespaces here: {figures['skipped']}")
    assert figures["parameters"] > 10**6 and figures["budget_mb"] > figures["runtime_mb"] > 0
    assert figures["peak_rss_before_mb"] > 0 and figures["peak_rss_outage_mb"] > 0
    assert figures["held_through_outage"] is True, figures
    # The high-water mark covers the sampled peaks, within the kernel's RSS counting: each thread
    # caches its count and syncs it every 64 page faults (up to 256 KiB a thread; measured: a
    # peak of 552.0 MB sampled, a high-water mark of 551.8 MB read later).
    assert figures["hwm_mb"] >= figures["peak_rss_outage_mb"] - 4.0, figures


@pytest.mark.slow
def test_fleet_benchmark_quick_counts_every_push_of_a_churning_lossy_fleet_once() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/fleet.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    f = json.loads(result.stdout.strip().splitlines()[-1])
    assert f["devices"] == f["welcomed"] == 200, f
    # 5% of messages lost each way and devices leaving mid-push: every push still answered, and for
    # every device and layer the gateway applied or dropped as stale exactly what it produced.
    assert f["unanswered"] == 0 and f["audit_exact"] is True, (f, result.stderr[-3000:])
    assert f["churn_departures"] > 0, f
    assert f["pushes_per_s_1"] > 0 and f["pushes_per_gateway_cpu_s_1"] > 0, f
    assert 0 < f["p50_ack_ms"] <= f["p99_ack_ms"], f
    assert isinstance(f["rss_kib_per_device"], float) and f["versions"] > 1, f
    assert f["scale_ratio"] is None and "shards" in f["not_measured"]  # not built: null, and why
