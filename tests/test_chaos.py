"""Chaos: a gateway killed three times and an edge killed twice during a lossy training run.

Real processes: `elasticfed cloud serve` with a checkpoint directory, three
`elasticfed edge` agents with state directories and 30% message loss each way.
At seeded random moments (model versions) the gateway gets SIGKILL, while an
edge holds acknowledged pushes not yet on disk, and is started again on the same
port and directory; one edge gets SIGKILL twice and is started again on its state
directory.  Both runs, with and without kills, train until the gateway closed
the same number of rounds; then everything stops cleanly (SIGTERM: drain, save).

What must hold (DESIGN.md guarantee 1, issue 7), per edge and layer, with the
gateway's counts over its checkpointed history:

- every step-gradient an edge was told is durable is in the model: applied >= durable;
- nothing counts twice: applied <= what the edge really produced (its runs'
  produced counts; a killed run's from its last status line, which comes every
  step, plus the one step that may have been under way);
- the edges that were never killed: applied == durable == produced exactly:
  what a dead gateway lost was sent again, once;
- nothing is left undelivered or held, and a dead gateway's loss was re-sent.

And the accuracy is at most 3 points below the same run without kills: the
killed edge's last unsaved steps are lost and its restarted run's first pushes
are stale, and the digits test set has 360 examples (one is 0.28 points); pairs
of runs differed by up to 1.1 points either way, and either run of a pair can be
the unlucky one.  Exactness is the count audit's job.
"""

from __future__ import annotations

import json
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fleet import Proc, free_port

pytestmark = pytest.mark.slow

EDGES = 3
ROUNDS = 180  # both runs train until the gateway closed this many rounds
GATEWAY_FLAGS = [
    "--gateway-quorum", "2", "--gateway-round-deadline-s", "0.25", "--gateway-max-staleness", "50",
    "--gateway-weighting", "buffered", "--gateway-edge-lr", "0.01", "--gateway-momentum", "0.9",
    "--gateway-checkpoint-every-rounds", "5", "--gateway-checkpoint-keep", "3",
]  # fmt: skip
EDGE_FLAGS = [
    "--timeout-ms", "100", "--heartbeat-ms", "200", "--train-lr", "0.01", "--train-epochs", "100000",
    "--status-every-s", "0.000001", "--drain-s", "60", "--persist-every-s", "0.2",
]  # fmt: skip


def start_gateway(endpoint: str, directory: Path, procs: list[Proc]) -> tuple[Proc, dict[str, Any]]:
    argv = [
        sys.executable, "-m", "elasticfed.common.cli", "cloud", "serve", "--mode", "standalone",
        "--gateway-bind", endpoint, "--insecure", "--log-level", "warning",
        "--gateway-checkpoint-dir", str(directory), *GATEWAY_FLAGS,
    ]  # fmt: skip
    gateway = Proc(argv, "gateway")
    procs.append(gateway)
    ready = gateway.wait_for(lambda e: e.get("event") == "ready", 60, "a ready event")
    return gateway, ready


def start_edge(endpoint: str, i: int, state: Path, procs: list[Proc]) -> tuple[Proc, dict[str, Any]]:
    argv = [
        sys.executable, "-m", "elasticfed.edge", "--gateway", endpoint, "--client-id", f"edge-{i}",
        "--insecure", "--log-level", "warning", "--train-shard", f"{i}/{EDGES}",
        "--faults", f"loss=0.3,seed={i + 1}", "--state-dir", str(state / f"edge-{i}"),
        "--train-duration-s", "600", *EDGE_FLAGS,
    ]  # fmt: skip
    edge = Proc(argv, f"edge-{i}")
    procs.append(edge)
    start = edge.wait_for(lambda e: e.get("event") == "start", 60, "a start event")
    return edge, start


def at_version(proc: Proc, version: int, more: Callable[[dict[str, Any]], bool] = lambda e: True) -> None:
    """Wait until `proc` trains from global model `version` or newer (and `more` holds)."""
    proc.wait_for(
        lambda e: e.get("event") == "status" and e["version"] >= version and more(e),
        240,
        f"model version {version}",
    )


def run(tmp: Path, procs: list[Proc], chaos: bool, seed: int = 7) -> dict[str, Any]:
    """Train until the gateway closed ROUNDS rounds (the same for both runs), then stop cleanly."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    gateway, _ = start_gateway(endpoint, tmp / "gateway", procs)
    edges = [start_edge(endpoint, i, tmp, procs) for i in range(EDGES)]
    runs: list[list[dict[str, Any]]] = [[{"start": start}] for _, start in edges]
    procs_of = [proc for proc, _ in edges]
    kills = {"gateway": 0, "edge": 0}
    resumed: list[Any] = []
    if chaos:
        rng = random.Random(seed)
        # Moments, as model versions (rounds closed): three for the gateway, two for edge 2, mixed.
        plan = sorted(
            [(int(rng.uniform(0.1, 0.8) * ROUNDS), "gateway") for _ in range(3)]
            + [(int(rng.uniform(0.15, 0.75) * ROUNDS), "edge") for _ in range(2)]
        )
        for moment, what in plan:
            if what == "gateway":
                # Killed while edge 0 holds acknowledged pushes that are not on disk yet.
                at_version(procs_of[0], moment, lambda e: e["held_steps"] > 0)
                gateway.proc.kill()
                gateway.proc.wait(10)
                gateway, ready = start_gateway(endpoint, tmp / "gateway", procs)
                assert ready["resumed_from"] is not None, ready
                resumed.append(ready["resumed_from"])
                kills["gateway"] += 1
            else:
                victim = procs_of[2]
                # Killed once this run has work on record (durable), so the kill has something to
                # keep as well as unsaved steps to lose: on a loaded machine a restarted edge can
                # take longer to start than the gateway takes to close the rounds to the next moment.
                at_version(victim, moment, lambda e: e.get("edge_durable_steps_total", 0) > 0)
                victim.proc.kill()
                victim.proc.wait(10)
                victim.read_all()  # its last status lines may still be in the pipe
                runs[2][-1]["last_status"] = victim.statuses()[-1]
                procs_of[2], start = start_edge(endpoint, 2, tmp, procs)
                assert start["resumed_from"] is not None, start
                runs[2].append({"start": start})
                kills["edge"] += 1
    at_version(procs_of[0], ROUNDS)
    for proc in procs_of:
        proc.signal(signal.SIGTERM)  # stop training, drain, save
    summaries = [proc.summary(240) for proc in procs_of]
    for i, summary in enumerate(summaries):
        runs[i][-1]["summary"] = summary
    gateway.signal(signal.SIGTERM)
    final = gateway.summary(60)
    return {"gateway": final, "summaries": summaries, "runs": runs, "kills": kills, "resumed": resumed}


def produced_at_most(runs: list[dict[str, Any]], layer: str) -> int:
    """Step-gradients of `layer` this edge really produced over all runs (an upper bound)."""
    total = 0
    for r in runs:
        begin = r["start"]["produced_steps"][layer]
        if "summary" in r:
            total += r["summary"]["produced_steps"][layer] - begin
        else:
            last = r.get("last_status")
            end = last["produced"] if last is not None else begin
            total += end + 1 - begin  # the status comes after each step; one more may have begun
    return total


def test_kill_9_of_the_gateway_three_times_and_an_edge_twice_loses_nothing_durable_and_counts_once(
    tmp_path: Path, procs: list[Proc]
) -> None:
    reference = run(tmp_path / "reference", procs, chaos=False)
    chaos = run(tmp_path / "chaos", procs, chaos=True)
    gw = chaos["gateway"]
    assert chaos["kills"] == {"gateway": 3, "edge": 2}
    history = gw["history_applied_steps"]
    figures: dict[str, Any] = {
        "accuracy_reference": reference["gateway"]["accuracy"],
        "accuracy_chaos": gw["accuracy"],
        "rounds_reference": reference["gateway"]["version"],
        "rounds_chaos": gw["version"],
        "resumed_from": chaos["resumed"],
        "edges": {},
    }
    problems = []
    for i, summary in enumerate(chaos["summaries"]):
        client = f"edge-{i}"
        applied = history.get(client, {})  # absent: nothing of this edge's was ever applied
        if summary["undelivered_steps"] or summary["held_steps"]:
            problems.append(
                (client, "left undelivered or held", summary["undelivered_steps"], summary["held_steps"])
            )
        rows = {}
        for layer, durable in summary["durable_steps"].items():
            row = rows[layer] = {
                "durable": durable,
                "applied": applied.get(layer, 0),
                "produced_at_most": produced_at_most(chaos["runs"][i], layer),
                "produced": summary["produced_steps"][layer],
                "dropped": summary["dropped_steps"][layer],
                "dropped_stale": summary["dropped_stale_steps"].get(layer, 0),
            }
            if row["applied"] < durable:
                problems.append((client, layer, "durable but not applied", row))
            if row["applied"] > row["produced_at_most"]:
                problems.append((client, layer, "applied more than produced", row))
            if i != 2 and (row["applied"] != durable or durable + row["dropped"] != row["produced"]):
                problems.append((client, layer, "not exactly once", row))
        figures["edges"][client] = {
            **next(iter(rows.values())),
            "lost_by_gateway_resent": summary.get("edge_lost_by_gateway_steps_total", 0),
            "runs": [
                {k: r[k]["produced_steps"] if k == "start" else None for k in r if k == "start"}
                | {"durable_at_start": next(iter(r["start"]["durable_steps"].values()))}
                for r in chaos["runs"][i]
            ],
        }
    print(json.dumps(figures))
    assert not problems, (problems, figures)
    # The path that matters was taken: a dead gateway's acknowledged pushes were sent again.
    assert sum(e["lost_by_gateway_resent"] for e in figures["edges"].values()) > 0, figures
    assert gw["accuracy"] >= reference["gateway"]["accuracy"] - 0.03, figures


def test_cloud_serve_with_its_defaults_trains_through_loss_and_three_gateway_kills(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """Issue 20's scenario: nothing set but what a deployment must say (bind, checkpoint folder,
    standalone); 2 edges with the edge's defaults at 30% message loss; the gateway killed -9 and
    restarted 3 times, at moments set by edge 0's local steps (a restarted gateway resumes from its
    newest checkpoint, every 10 rounds or 30 s by default, and edges re-send what no checkpoint
    held).  With the old default weighting (mean-step) this ended at 25.6%; 94.4-96.9% before the
    drift bound (edge/drift.py); with a horizon of 1000 steps 95.3-96.9% locally and 94.4% once in
    CI; with the default of 200, 96.4-96.9% in four runs.

    The edges train for 45 s, not 4000 steps: a restart here takes about 7 s (Python, torch, the
    task), so with 4000 steps (3 s of digits) the edges finished while the gateway was down and the
    final model was two whole local runs merged in the last 2 rounds (3-4 versions in all):
    93.3-96.9%, under the bar in 3 of about 10 CI runs.  Devices train on while a gateway restarts
    and after: with 45 s the last gateway publishes 24-52 versions, 96.9-98.1% in three runs."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    folder = tmp_path / "gateway"
    argv = [
        sys.executable, "-m", "elasticfed.common.cli", "cloud", "serve", "--mode", "standalone",
        "--gateway-bind", endpoint, "--insecure", "--log-level", "warning",
        "--gateway-checkpoint-dir", str(folder),
    ]  # fmt: skip

    def start() -> Proc:
        gateway = Proc(argv, "gateway")
        procs.append(gateway)
        gateway.wait_for(lambda e: e.get("event") == "ready", 60, "a ready event")
        return gateway

    gateway = start()
    edges = []
    for i in range(2):
        edge = Proc(
            [
                sys.executable,
                "-m",
                "elasticfed.edge",
                "--gateway",
                endpoint,
                "--client-id",
                f"edge-{i}",
                "--insecure",
                "--log-level",
                "warning",
                "--train-shard",
                f"{i}/2",
                "--faults",
                f"loss=0.3,seed={i + 1}",
                "--state-dir",
                str(tmp_path / f"edge-{i}"),
                "--train-duration-s",
                "45",
                "--train-epochs",
                "100000",
                "--status-every-s",
                "0.2",
            ],  # fmt: skip
            f"edge-{i}",
        )
        procs.append(edge)
        edges.append(edge)
    resumed = []
    for moment in (300, 600, 900):  # edge 0's local steps when the gateway dies (versions roll back)
        edges[0].wait_for(
            lambda e, m=moment: e.get("event") == "status" and e["produced"] >= m, 240, f"step {moment}"
        )
        gateway.proc.kill()
        gateway.proc.wait(10)
        gateway = start()
        resumed.append(gateway.events[-1].get("resumed_from"))
    summaries = [edge.summary(240) for edge in edges]
    gateway.signal(signal.SIGTERM)
    final = gateway.summary(60)
    figures = {
        "accuracy": final["accuracy"],
        "version": final["version"],
        "resumed_from": resumed,
        "undelivered": [s["undelivered_steps"] for s in summaries],
        "dropped_stale": [sum(s["dropped_stale_steps"].values()) for s in summaries],
        "produced": [sum(s["produced_steps"].values()) for s in summaries],
    }
    print(json.dumps(figures))
    assert all(r is not None for r in resumed), figures  # each restart resumed from a checkpoint
    assert figures["accuracy"] >= 0.95, figures
    assert not any(figures["undelivered"]), figures
