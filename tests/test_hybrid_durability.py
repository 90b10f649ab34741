"""Hybrid mode keeps guarantee 1 through kill -9 of its ranks (DESIGN.md section 7, issue 21 item 2).

Real processes: a torchrun job of two gloo workers (`cloud serve --mode hybrid`, rank 0 hosting
the gateway) with a checkpoint directory and `--max-restarts`, and three edge agents with 30%
message loss each way.  Rank 0 is killed -9 twice while an edge holds acknowledged pushes that
are not yet on disk, and rank 1 once; each time torchrun restarts both workers, which resume
from the job's newest checkpoint (cloud/hybrid_checkpoints.py) on the same port.  Then the
edges stop (drain), and the job, its planned epochs long done, ends once they are quiet.

What must hold, per edge and layer, with the gateway's counts over its checkpointed history:
- nothing durable is lost and nothing counts twice: applied == durable == produced - dropped
  (no edge is killed, so what each produced is known exactly);
- every applied step-gradient entered the cloud model once: the step-gradients the trainer
  mixed, over the checkpointed history, equal what the gateway applied from all edges, per
  layer (a checkpoint that saved the verdicts and the model at different moments breaks it);
- the path that matters was taken: pushes a dead rank 0 acknowledged were sent again;
- both ranks end with the same model.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fleet import Proc, free_port

pytestmark = pytest.mark.slow

EDGES = 3


def workers(pid: int) -> list[int]:
    """The pids of torchrun `pid`'s live worker processes (children running elasticfed.cloud)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            if b"elasticfed.cloud" in argv:
                found.append(int(child))
    return found


def start_job(endpoint: str, directory: Path, procs: list[Proc]) -> Proc:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=5", "-m", "elasticfed.cloud", "serve", "--mode", "hybrid", "--insecure",
        "--log-level", "warning", "--gateway-bind", endpoint, "--train-backend", "gloo",
        "--train-shard", "0/2", "--train-epochs", "2", "--sync-check-every", "1",
        "--gateway-quorum", "2", "--gateway-round-deadline-s", "0.25",
        "--gateway-checkpoint-every-rounds", "5", "--train-checkpoint-dir", str(directory),
        "--hybrid-idle-s", "2", "--hybrid-drain-s", "900", "--hybrid-wait-for-edges", str(EDGES),
        "--hybrid-wait-s", "120",
    ]  # fmt: skip
    job = Proc(argv, "torchrun")
    procs.append(job)
    return job


def start_edge(endpoint: str, i: int, state: Path, procs: list[Proc]) -> Proc:
    argv = [
        sys.executable, "-m", "elasticfed.edge", "--gateway", endpoint, "--client-id", f"edge-{i}",
        "--insecure", "--log-level", "warning", "--train-shard", f"{i + 1}/{EDGES + 1}",
        "--faults", f"loss=0.3,seed={i + 1}", "--state-dir", str(state / f"edge-{i}"),
        "--timeout-ms", "100", "--heartbeat-ms", "200", "--train-epochs", "100000",
        "--train-duration-s", "900", "--status-every-s", "0.000001", "--drain-s", "120",
    ]  # fmt: skip
    edge = Proc(argv, f"edge-{i}")
    procs.append(edge)
    edge.wait_for(lambda e: e.get("event") == "start", 60, "a start event")
    return edge


def test_kill_9_of_either_rank_under_torchrun_loses_nothing_durable_and_mixes_each_step_once(
    tmp_path: Path, procs: list[Proc]
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    job = start_job(endpoint, tmp_path / "job", procs)
    ready = job.wait_for(lambda e: e.get("event") == "ready", 120, "rank 0 ready")
    assert ready["resumed_from"] is None and ready["durable_epoch"] == 0, ready
    edges = [start_edge(endpoint, i, tmp_path, procs) for i in range(EDGES)]
    resumed = []
    pids: set[int] = set()
    for victim in ("rank 0", "rank 1", "rank 0"):
        # Killed while edge 0 holds acknowledged pushes that are not on disk, once this instance
        # has committed some (so the restart has something to resume from and something to lose).
        # Only statuses from now on count (wait_for also scans past events).
        last = edges[0].wait_for(lambda e: e.get("event") == "status", 60, "a status")
        last = edges[0].statuses()[-1]
        durable_before = last.get("edge_durable_steps_total", 0)

        def holding(e: dict[str, Any], t0: float = last["t"], durable: int = durable_before) -> bool:
            return (
                e.get("event") == "status"
                and e["t"] > t0
                and e["held_steps"] > 0
                and e.get("edge_durable_steps_total", 0) > durable
            )

        edges[0].wait_for(holding, 240, "held acknowledged pushes")
        rank0 = int(ready["pid"])
        pid = rank0 if victim == "rank 0" else next(p for p in workers(job.proc.pid) if p != rank0)
        os.kill(pid, signal.SIGKILL)
        pids.add(rank0)
        ready = job.wait_for(
            lambda e: e.get("event") == "ready" and e["pid"] not in pids,
            180,
            f"rank 0 ready again after kill -9 of {victim}",
        )
        assert ready["resumed_from"] is not None and ready["pid"] != rank0, ready
        resumed.append(ready["resumed_from"])
    for e in edges:
        e.signal(signal.SIGTERM)
    summaries = [e.summary(240) for e in edges]
    final = job.summary(240)  # planned epochs long done: the job ends once the edges went quiet

    digests = final["model_sha256_by_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    history = final["history_applied_steps"]
    mixed = final["edge_steps_mixed"]
    problems: list[Any] = []
    applied_all: dict[str, int] = {}
    for i, summary in enumerate(summaries):
        client = f"edge-{i}"
        applied = history.get(client, {})
        if summary["undelivered_steps"] or summary["held_steps"]:
            problems.append(
                (client, "left undelivered or held", summary["undelivered_steps"], summary["held_steps"])
            )
        for layer, durable in summary["durable_steps"].items():
            row = {
                "durable": durable,
                "applied": applied.get(layer, 0),
                "produced": summary["produced_steps"][layer],
                "dropped": summary["dropped_steps"][layer],
            }
            applied_all[layer] = applied_all.get(layer, 0) + row["applied"]
            if row["applied"] != durable or durable + row["dropped"] != row["produced"]:
                problems.append((client, layer, "not exactly once", row))
    if mixed != {k: v for k, v in applied_all.items() if v}:
        problems.append(("mixed into the cloud model", mixed, "applied by the gateway", applied_all))
    resent = sum(s.get("edge_lost_by_gateway_steps_total", 0) for s in summaries)
    print(json.dumps({"resumed": resumed, "resent": resent, "mixed": mixed, "applied": applied_all}))
    assert not problems, problems
    assert resent > 0, "no acknowledged push of a dead rank 0 was sent again: the kills missed"


def cloud_only_job(directory: Path, epochs: int, procs: list[Proc]) -> Proc:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=3", "-m", "elasticfed.cloud", "serve", "--mode", "hybrid", "--insecure",
        "--log-level", "warning", "--gateway-bind", f"tcp://127.0.0.1:{free_port()}",
        "--train-backend", "gloo", "--train-shard", "0/2", "--train-epochs", str(epochs),
        "--train-checkpoint-dir", str(directory),
    ]  # fmt: skip
    job = Proc(argv, "torchrun")
    procs.append(job)
    return job


def test_a_job_killed_mid_epoch_resumes_where_it_stood_and_ends_with_the_same_model(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """The trainer's half of the cut: model, optimizer (momentum), learning-rate schedule and the
    position in the data.  A job without edges checkpoints at every epoch end (written at the next
    step, so it resumes one batch into an epoch); killed -9 after some, and restarted by torchrun,
    it must end bit for bit where a run without the kill ends.  A resume at the epoch's start
    (batches seen twice), a lost momentum or a schedule started afresh all change the digest."""
    epochs = 60
    reference = cloud_only_job(tmp_path / "reference", epochs, procs).summary(240)
    job = cloud_only_job(tmp_path / "killed", epochs, procs)
    ready = job.wait_for(lambda e: e.get("event") == "ready", 120, "rank 0 ready")
    folder = tmp_path / "killed"
    deadline = time.monotonic() + 120
    while len(list(folder.glob("hybrid-*.safetensors"))) < 2:  # past the first epochs, not at the end
        assert time.monotonic() < deadline, "no checkpoint written within 120 s"
        assert job.proc.poll() is None, "the job ended before it could be killed: raise epochs"
        time.sleep(0.005)
    os.kill(int(ready["pid"]), signal.SIGKILL)
    again = job.wait_for(lambda e: e.get("event") == "ready" and e["pid"] != ready["pid"], 120, "a restart")
    assert again["resumed_from"] is not None, again
    final = job.summary(240)
    assert 0 < final["resumed_from_epoch"] < epochs and final["resumed_from_step"] > 0, final
    assert final["steps"] == reference["steps"], (final["steps"], reference["steps"])
    assert final["model_sha256_by_rank"] == reference["model_sha256_by_rank"], (final, reference)
