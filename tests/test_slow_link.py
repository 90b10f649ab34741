"""Slow links carrying large messages: a 4.5 MB model over real tbf rate caps, real TCP, real processes.

At 5 Mbit/s the model's 4 MiB layer is a 7 s push and the model a 7 s
download, fourteen times the per-layer deadline.  Before chunked, paced
transfers the edges reconnected every few seconds (heartbeat replies queued
behind models), every reconnect restarted the model download from zero, no
model ever arrived, and the gateway then dropped every push as too stale.

What must hold, with the settings a user gets (only the task, the endpoint and
the budget are given):
- no reconnect storm: no connection replaced while the link works;
- models adopted, several per edge, and a download interrupted by a real
  outage goes on from the chunks it had (never restarted from zero);
- nothing dropped as stale that could have been used; every step-gradient
  counted once (the count audit);
- a device's upload cap holds: what the gateway receives from it stays under it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import fleet
import pytest
from fleet import Proc
from netns import EdgeNet, Lab, lab_edge
from test_real_loss import audit, is_status

from tests.wide_task import build_model

pytestmark = [pytest.mark.slow, pytest.mark.netns]

TASK = "tests.wide_task:task"
MODEL_BYTES = fleet.model_bytes(build_model())
RATE = "5mbit"
TRAIN_S = 60.0


def start_gateway(lab: Lab | None, procs: list[Proc]) -> tuple[Proc, str]:
    """`cloud serve` with its defaults (the task aside), in the lab's root namespace or on loopback."""
    if lab is None:
        endpoint = f"tcp://127.0.0.1:{fleet.free_port()}"
    else:
        endpoint = f"tcp://{lab.gateway_address}:{lab.free_port()}"
    argv = [
        sys.executable, "-m", "elasticfed.common.cli", "cloud", "serve", "--mode", "standalone",
        "--task", TASK,
        "--gateway-bind", endpoint, "--insecure", "--log-level", "warning", "--gateway-checkpoint-dir", "",
    ]  # fmt: skip
    gateway = Proc(argv, "gateway")
    procs.append(gateway)
    gateway.wait_for(lambda e: e.get("event") == "ready", 60, "a ready event")
    return gateway, endpoint


def start_edge(net: EdgeNet, endpoint: str, client: str, shard: str, procs: list[Proc], *flags: str) -> Proc:
    argv = [
        "nice", "-n", "10", sys.executable, "-m", "elasticfed.edge", "--gateway", endpoint,
        "--client-id", client,
        "--task", TASK, "--insecure", "--log-level", "info", "--train-shard", shard, "--state-dir", "",
        "--train-epochs", "100000", "--status-every-s", "0.5", "--drain-s", "120", *flags,
    ]  # fmt: skip
    edge = Proc(net.argv(argv), client)
    procs.append(edge)
    return edge


def stop(edges: list[Proc], gateway: Proc) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    for e in edges:
        e.signal()
    summaries = [e.summary(timeout=180) for e in edges]  # drain: up to 120 s at 2 Mbit/s
    gateway.signal()
    return summaries, gateway.summary(timeout=60)


def test_a_multi_megabyte_model_over_5_mbit_links_trains_without_reconnects_or_stale_drops(
    netns_lab: Lab, procs: list[Proc]
) -> None:
    gateway, endpoint = start_gateway(netns_lab, procs)
    nets = [lab_edge(netns_lab) for _ in range(2)]
    for net in nets:
        net.set_rate(RATE)
    edges = [start_edge(net, endpoint, f"slow-{i}", f"{i}/2", procs) for i, net in enumerate(nets)]
    for e in edges:
        e.wait_for(is_status(lambda s: s["steps"] > 0), 90, "a first step")
    t0 = edges[0].statuses()[-1]["t"]
    # The run's length on the edge's own clock; training and syncing go on by themselves.
    edges[0].wait_for(is_status(lambda s: s["t"] >= t0 + TRAIN_S), TRAIN_S + 60, f"{TRAIN_S} s of training")
    summaries, gw = stop(edges, gateway)
    produced = sum(sum(s["produced_steps"].values()) for s in summaries)
    stale = sum(s["edge_dropped_stale_steps_total"] for s in summaries)
    figures = {
        "rate": RATE,
        "model_bytes": MODEL_BYTES,
        "train_s": TRAIN_S,
        "rounds": gw["version"],
        "accuracy": round(gw["accuracy"], 4),
        "models_adopted": [s["models_adopted"] for s in summaries],
        "models_received": [s["edge_models_received_total"] for s in summaries],
        "model_bytes_received": [s["edge_model_bytes_total"] for s in summaries],
        "download_restarts": [s["edge_model_download_restarts_total"] for s in summaries],
        "reconnects": [s["edge_reconnects_total"] for s in summaries],
        "weak_syncs": [s["edge_weak_syncs_total"] for s in summaries],
        "produced_steps": produced,
        "stale_dropped_steps": stale,
        "uplink_mbit": [s["uplink_mbit"] for s in summaries],
        "downlink_mbit": [s["downlink_mbit"] for s in summaries],
        "refused": gw["rejected_by_reason"],
    }
    print(json.dumps(figures))
    for s in summaries:
        audit(gw, s)
    assert figures["reconnects"] == [0, 0], figures
    # 60 s at 5 Mbit/s carries about 37 MB down: several whole models each (each direction has
    # its own cap), or a hundred patches.  Compressed pushes complete a round in a fraction of
    # a second; rounds stay open as long as a contributor's last download took, so versions
    # come about as fast as the edges can hold them (measured: 152 versions, 142-144 adopted
    # per edge, none dropped as stale; without that minimum open time 215 versions and 8% dropped).
    assert min(figures["models_received"]) >= 4, figures
    assert min(figures["models_adopted"]) >= 2, figures
    assert stale <= 0.05 * produced, figures
    assert set(gw["rejected_by_reason"]) <= {"stale"}, figures
    assert gw["accuracy"] >= 0.8, figures
    # The measured rates are those of the link (tbf), within what TCP over it achieves: every
    # model comes as a patch (one 100-140 KB answer each), timed alone, less the path's round
    # trip.  It read 5.7-7.4, once 19.9 (CI): a chunk asked twice was timed from its second ask,
    # and round trips of heartbeats queued behind patches (56 ms on a 2 ms path) were subtracted
    # from every patch's time.  Now 5.1-5.6 (6 edges in 3 runs); the bound leaves room for the
    # tbf's 16 KB burst, which a smaller patch crosses at once.
    for mbit in figures["downlink_mbit"]:
        assert mbit is not None and 2.0 <= mbit <= 7.0, figures


def test_a_download_cut_by_an_outage_resumes_where_it_stopped(netns_lab: Lab, procs: list[Proc]) -> None:
    gateway, endpoint = start_gateway(netns_lab, procs)
    net = lab_edge(netns_lab)
    net.set_rate("2mbit")  # the model takes about 18 s to come down
    # Another seed than the gateway's: an edge that built the gateway's seed model gets its first
    # model as a patch (edge/download.py), and this is about a whole model's download.
    edge = start_edge(net, endpoint, "cut", "0/1", procs, "--train-seed", "1")
    # Part-way through a download (a quarter to three quarters of a model arrived) ...
    part = edge.wait_for(
        is_status(lambda s: MODEL_BYTES // 4 <= s["edge_model_bytes_total"] <= 3 * MODEL_BYTES // 4),
        120,
        "a download part-way",
    )
    assert part["edge_models_received_total"] == 0, part
    net.set_loss(99)  # ... the link all but dies, long enough that the edge replaces its connection
    edge.wait_for(is_status(lambda s: s["edge_reconnects_total"] >= 1), 60, "a reconnect")
    net.set_loss(0)
    done = edge.wait_for(is_status(lambda s: s["edge_models_received_total"] >= 1), 120, "a model")
    summaries, gw = stop([edge], gateway)
    figures = {
        "bytes_before_cut": part["edge_model_bytes_total"],
        "bytes_at_first_model": done["edge_model_bytes_total"],
        "model_bytes": MODEL_BYTES,
        "resumes": summaries[0]["edge_model_download_resumes_total"],
        "restarts": summaries[0]["edge_model_download_restarts_total"],
        "reconnects": summaries[0]["edge_reconnects_total"],
    }
    print(json.dumps(figures))
    audit(gw, summaries[0])
    assert figures["resumes"] >= 1, figures
    # The first model cost one model's bytes (plus the blob's alignment padding), not one and a part.
    assert done["edge_model_bytes_total"] <= MODEL_BYTES + 64, figures


def test_an_upload_cap_holds_what_the_device_sends(procs: list[Proc]) -> None:
    """On loopback (no link cap at all), `--upload-mbit 4`: the gateway receives at most that from it."""
    gateway, endpoint = start_gateway(None, procs)
    argv = [
        sys.executable, "-m", "elasticfed.edge", "--gateway", endpoint, "--client-id", "capped",
        "--task", TASK,
        "--insecure", "--log-level", "warning", "--state-dir", "", "--train-epochs", "100000",
        "--status-every-s", "0.5", "--upload-mbit", "4",
    ]  # fmt: skip
    edge = Proc(argv, "capped")
    procs.append(edge)
    first = edge.wait_for(is_status(lambda s: s["edge_sent_bytes_total"] > 0), 90, "a first push")
    last = edge.wait_for(is_status(lambda s: s["t"] >= first["t"] + 20), 60, "20 s of pushing")
    summaries, gw = stop([edge], gateway)
    sent = last["edge_sent_bytes_total"] - first["edge_sent_bytes_total"]
    mbit = sent * 8 / 1e6 / (last["t"] - first["t"])
    print(json.dumps({"cap_mbit": 4, "sent_mbit": round(mbit, 3)}))
    audit(gw, summaries[0])
    # The bucket's depth (0.1 s) and one push in debt allow a little over the average.
    assert 1.0 <= mbit <= 4 * 1.1 + 8 * MODEL_BYTES / 1e6 / 20, mbit


def _share(spec: str) -> float:
    """What part of a dense push an `auto` rung sends (bytes), from the status's `auto:<rung>`."""
    rung = spec.split(":", 1)[1] if spec.startswith("auto:") else spec
    if rung.startswith("topk:"):
        return float(rung[5:].split("+")[0]) * 3 / 4  # int8 values and coded indices: 3 bytes an entry
    return {"none": 1.0, "fp16": 0.5, "int8": 0.25}[rung]


def test_auto_compression_finds_out_that_the_link_got_faster(netns_lab: Lab, procs: list[Proc]) -> None:
    # The rate an edge measures is a lower bound from what it sends: compressed to what a slow
    # link carried, it would never learn that the link is now fast (a site moved from a cellular
    # uplink to fibre; on a GPU lender, a gateway busy with the first downloads) unless it probes.
    gateway, endpoint = start_gateway(netns_lab, procs)
    net = lab_edge(netns_lab)
    net.set_rate("1mbit")
    edge = start_edge(net, endpoint, "faster", "0/1", procs)
    topk = is_status(lambda s: s["compression"].startswith("auto:topk") and s["t"] >= 20)
    slow = edge.wait_for(topk, 120, "top-k at 1 Mbit/s")
    net.set_rate(None)
    before = _share(slow["compression"])
    denser = is_status(lambda s: s["t"] > slow["t"] and _share(s["compression"]) >= 8 * before)
    fast = edge.wait_for(denser, 90, f"a rung sending 8 times what {slow['compression']} did")
    summaries, gw = stop([edge], gateway)
    after = {"slow": slow["compression"], "fast": fast["compression"], "after_s": fast["t"] - slow["t"]}
    print(json.dumps({**after, "uplink_mbit": [slow["uplink_mbit"], fast["uplink_mbit"]]}))
    audit(gw, summaries[0])
    assert summaries[0]["edge_reconnects_total"] == 0, summaries[0]["edge_reconnects_total"]
