"""Hybrid mode for real: two gloo workers under torchrun, rank 0 hosting the gateway, two edge agents.

The cloud trains on half of the digits data, each edge on a quarter (the other half).
What must hold:
- the model is the same on both cloud ranks after every step (the parameter
  checksum comparison runs before every forward and once after the last step;
  a difference fails the job with exit 3), and both ranks end with the same
  SHA-256 of their parameters;
- the count audit: every step-gradient an edge was told was delivered is in the
  gateway's applied count, per layer; every round the gateway closed entered a
  cloud step, and the step-gradients the trainer mixed in equal, per layer, what
  the gateway applied from both edges;
- accuracy on the digits test set >= 95%.
"""

from __future__ import annotations

import sys
from pathlib import Path

import dist_cases
import pytest
import torch
from distributed import run_ranks

from elasticfed.cloud.hybrid import EdgeRounds
from tests.fleet import Proc, audit, edge, free_port

EDGE_STEPS = 120


def hybrid_job(port: int, *flags: str) -> Proc:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "elasticfed.cloud", "serve", "--mode", "hybrid", "--insecure", "--log-level", "warning",
        "--gateway-bind", f"tcp://127.0.0.1:{port}", "--train-backend", "gloo",
        "--train-shard", "0/2", "--train-epochs", "30", "--sync-check-every", "1",
        "--gateway-quorum", "2", "--gateway-round-deadline-s", "0.2",
        "--hybrid-wait-for-edges", "2", "--hybrid-wait-s", "60", "--hybrid-idle-s", "1.5",
        "--gateway-checkpoint-dir", "",  # not durable here: test_hybrid_durability.py is
        *flags,
    ]  # fmt: skip
    return Proc(argv, "torchrun")


@pytest.mark.slow
def test_two_torchrun_workers_and_two_edges_train_one_model(procs: list[Proc]) -> None:
    job = hybrid_job(free_port())
    procs.append(job)
    ready = job.wait_for(lambda e: e.get("event") == "ready", 120, "the gateway on rank 0")
    assert ready["world_size"] == 2 and ready["mode"] == "hybrid"
    edges = [
        edge(
            ready["endpoint"],
            f"edge-{i}",
            "--train-shard",
            f"{i + 1}/3",
            "--train-max-steps",
            str(EDGE_STEPS),
            "--timeout-ms",
            "300",
            "--drain-s",
            "30",
        )  # fmt: skip
        for i in range(2)
    ]
    procs.extend(edges)
    edge_summaries = [e.summary(180) for e in edges]
    summary = job.summary(180)
    assert job.proc.wait(30) == 0, job._tail()

    digests = summary["model_sha256_by_rank"]
    assert len(digests) == 2 and digests[0] == digests[1], digests
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"

    # Edge -> gateway: what each edge was told was delivered is what the gateway applied, per layer.
    gateway_status = {
        "metrics": {
            "gateway_applied_steps_total": summary["applied_steps"],
            "gateway_dropped_stale_steps_total": summary["dropped_stale_steps"],
        }
    }
    applied_per_layer: dict[str, int] = {}
    for s in edge_summaries:
        assert s["steps"] == EDGE_STEPS, s
        audit(gateway_status, s)
        for layer, n in s["delivered_steps"].items():
            applied_per_layer[layer] = applied_per_layer.get(layer, 0) + int(n)
    assert sum(applied_per_layer.values()) > 0, "no edge step-gradient was applied"
    assert sorted(summary["clients"]) == ["edge-0", "edge-1"]

    # Gateway -> cloud model: every closed round entered a cloud step, and with it every step-gradient.
    assert summary["edge_rounds_mixed"] == summary["gateway_rounds_total"] > 0, summary
    assert 0 < summary["mixing_steps"] <= summary["edge_rounds_mixed"]
    assert summary["edge_steps_mixed"] == applied_per_layer, (summary["edge_steps_mixed"], applied_per_layer)

    assert summary["accuracy"] >= 0.95, summary["accuracy"]


@pytest.mark.parametrize("weight", [0.25, 1.0])
def test_a_mixing_step_is_the_weighted_sum_on_every_rank(weight: float, tmp_path: Path) -> None:
    results = [r["ok"] for r in run_ranks(dist_cases.edge_mixing, 2, tmp_path, weight=weight)]
    for rank, res in enumerate(results):
        # The round rank 0 queued before the first step enters the second, and only it.
        assert res["mixed"] == [False, True, False, False], (rank, res["mixed"])
        assert max(res["errors"]) < 1e-5, (rank, res["errors"])
    assert results[0]["digest"] == results[1]["digest"]
    assert results[0]["rounds"] == 1 and results[0]["steps_by_layer"] == [7] * len(results[0]["digest"])


@pytest.mark.slow
def test_started_without_torchrun_it_starts_torchrun_itself(procs: list[Proc]) -> None:
    argv = [
        sys.executable, "-m", "elasticfed.common.cli", "cloud", "serve", "--mode", "hybrid", "--insecure",
        "--log-level", "warning", "--gateway-bind", f"tcp://127.0.0.1:{free_port()}",
        "--gateway-checkpoint-dir", "", "--train-backend", "gloo", "--train-epochs", "2",
        "--hybrid-nproc-per-node", "2", "--sync-check-every", "1",
    ]  # fmt: skip
    job = Proc(argv, "cloud serve")
    procs.append(job)
    summary = job.summary(120)
    assert summary["world_size"] == 2 and summary["epochs"] == 2
    assert len(set(summary["model_sha256_by_rank"])) == 1
    assert summary["edge_rounds_mixed"] == 0 and summary["clients"] == []


LIFETIME = """
import json, signal, sys, weakref
import elasticfed.cloud.hybrid as hybrid
from elasticfed.common.cli import main

refs = []
original = hybrid.EdgeMixing.__init__

def recording_init(self, *args, **kwargs):
    original(self, *args, **kwargs)
    refs.append(weakref.ref(self))

hybrid.EdgeMixing.__init__ = recording_init
code = main(sys.argv[1:])
print(json.dumps({
    "event": "lifetime",
    "code": code,
    "mixings": len(refs),
    "alive": sum(r() is not None for r in refs),
    "sigterm_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
}))
"""


def test_a_hybrid_worker_frees_its_process_groups_before_python_shuts_down(procs: list[Proc]) -> None:
    # A group freed at interpreter shutdown joins gloo workers that can no longer take the GIL:
    # a clean run then exits with SIGABRT (1 in about 15 runs of the torchrun test above, from a
    # core dump: the SIGTERM handler's closure held the mixing state, its group, to the end).
    argv = [
        sys.executable, "-c", LIFETIME, "cloud", "serve", "--mode", "hybrid", "--insecure",
        "--log-level", "warning", "--gateway-bind", f"tcp://127.0.0.1:{free_port()}",
        "--gateway-checkpoint-dir", "", "--train-backend", "gloo", "--train-epochs", "1",
        "--hybrid-idle-s", "0.2",
    ]  # fmt: skip
    job = Proc(argv, "hybrid worker")
    procs.append(job)
    assert job.proc.wait(120) == 0, job.stderr
    found = job.wait_for(lambda e: e.get("event") == "lifetime", 10, "the lifetime report")
    assert found["code"] == 0 and found["mixings"] == 1
    assert found["alive"] == 0 and found["sigterm_restored"], found


def test_hybrid_gateway_announces_and_judges_by_the_model_it_serves() -> None:
    """Rounds waiting for the trainer do not make an edge stale: it cannot download them yet."""
    from elasticfed.cloud.aggregation import DeadlineQuorum, MeanStep
    from elasticfed.cloud.gateway import Gateway, GatewayOptions
    from elasticfed.cloud.hybrid import EdgeRounds
    from tests.test_gateway import Peer, grads_for, make_model

    rounds = EdgeRounds(max_queued=2)
    gw = Gateway(
        make_model(),
        None,
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        weighting=MeanStep(max_staleness=1),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=1),
        update=rounds,
    )
    gw.bind()
    try:
        peer = Peer(gw, "a")
        peer.hello(gw.manifest)
        for seq in range(1, 7):  # each push closes a round (quorum 1); nobody takes them
            ack = peer.push(seq, grads_for(gw, 1.0), base=0)
            assert ack.accepted and ack.model_version == 0, (seq, ack)
        assert gw.version == 6 and gw.served_version == 0
        assert len(rounds) == 2 and rounds.merged == 4  # bounded: later rounds were added in
        first, merged = rounds.take(), rounds.take()
        assert first is not None and first.numbers == [1] and first.layer_steps == [1] * len(gw.names)
        assert merged is not None and merged.numbers == [2, 3, 4, 5, 6]
        assert merged.layer_steps == [5] * len(gw.names)
        assert torch.equal(merged.averages[0], torch.full_like(merged.averages[0], 5.0))
        gw.publish(1)  # the trainer mixed them in and serves the result
        ack = peer.push(7, grads_for(gw, 1.0), base=0)
        assert ack.accepted and ack.model_version == 1  # one version behind: still admitted
        gw.publish(2)
        ack = peer.push(8, grads_for(gw, 1.0), base=0)
        assert not ack.accepted and ack.code == "stale" and ack.model_version == 2
    finally:
        gw.close()


def test_a_cloud_part_smaller_than_a_batch_is_refused_at_start(procs: list[Proc]) -> None:
    argv = [
        sys.executable, "-m", "elasticfed.cloud", "serve", "--mode", "hybrid", "--insecure",
        "--log-level", "warning",
        "--gateway-bind", f"tcp://127.0.0.1:{free_port()}", "--gateway-checkpoint-dir", "",
        "--train-backend", "gloo", "--train-shard", "0/2", "--train-batch-size", "4096",
    ]  # fmt: skip
    job = Proc(argv, "cloud serve")
    procs.append(job)
    assert job.proc.wait(60) == 2
    job._threads[1].join(5)
    assert "smaller than one batch (4096)" in "".join(job.stderr), job.stderr


@pytest.mark.parametrize("why", ["sigterm", "dead-gateway"])
def test_rank_0_stops_every_rank_at_the_same_step_and_mixes_what_was_queued(why: str, tmp_path: Path) -> None:
    results = [r["ok"] for r in run_ranks(dist_cases.edge_mixing_stops, 2, tmp_path, why=why)]
    for res in results:
        # Step 1 decides to stop taking pushes and to mix the queued round; step 2 mixes it; then stop.
        assert res["steps"] == 2 and res["mixed"] == [False, True], res
    assert results[0]["rounds"] == 1
    assert results[0]["gateway_failed"] == (why == "dead-gateway")
    assert results[0]["digest"] == results[1]["digest"]


@pytest.mark.parametrize(
    ("edges", "drain_s", "steps"),
    [
        ("heard", 3600.0, None),  # edges still deliver, the deadline is far: training goes on
        ("heard", 0.0, 3),  # the deadline has passed: stop although edges are heard
        ("quiet", 3600.0, 3),  # nobody heard within idle_s: nothing to wait for
    ],
)
def test_after_the_planned_epochs_the_job_drains_while_edges_are_heard_up_to_the_deadline(
    edges: str, drain_s: float, steps: int | None, tmp_path: Path
) -> None:
    results = [
        r["ok"] for r in run_ranks(dist_cases.edge_mixing_drain, 2, tmp_path, edges=edges, drain_s=drain_s)
    ]
    for res in results:
        if steps is None:
            assert res["capped"], res
        else:
            # Step 3 ends the plan; with nothing queued, its end tells every rank to stop.
            assert res["steps"] == steps and not res["capped"], res
    assert results[0]["digest"] == results[1]["digest"]


def test_a_sealed_round_takes_no_later_round_and_a_cut_holds_exactly_the_rounds_its_state_covers() -> None:
    """The queue's half of the hybrid checkpoint's consistency (cloud/hybrid_checkpoints.py): the
    gateway's state at round 2's close (checkpoint 1) covers rounds 1-2, so round 3 must not merge
    into them even when the queue is full, and the cut holds rounds 1-2 and not 3.  Without the
    seal, round 3 merged into round 2's entry, and the cut held neither: round 2, acknowledged,
    was lost."""
    rounds = EdgeRounds(max_queued=2)
    one = [torch.ones(3)]
    rounds.apply(1, one, [1])
    rounds.apply(2, one, [1])
    rounds.seal(1)  # round 2 closed, its state handed over as checkpoint 1
    rounds.apply(3, one, [1])  # the queue is full: unsealed, this would merge into round 2
    rounds.seal(2)  # a later state (checkpoint 2), handed over before checkpoint 1 is written
    rounds.apply(4, one, [1])
    assert [r.numbers for r in rounds.covered(2)] == [[1], [2]]
    rounds.unseal(1)  # checkpoint 1 written: round 3's seal (checkpoint 2's) stays
    rounds.apply(5, one, [1])  # round 4's entry was never sealed: 5 merges into it
    assert [r.numbers for r in rounds.covered(3)] == [[1], [2], [3]]
    rounds.unseal(2)
    assert [r.numbers for r in rounds.covered(5)] == [[1], [2], [3], [4, 5]]
    assert len(rounds) == 4 and rounds.merged == 1


def test_a_newer_seal_on_the_same_round_outlives_an_older_cut_and_a_cut_is_a_copy() -> None:
    """Two states handed over with no round between them seal the same entry; writing the older
    one must leave the newer one's seal (else a round closing before the newer cut merges into it,
    and that cut, which covers only the entry's older rounds, holds none of them).  And what a cut
    holds is copied under the lock: a round merging after `covered` does not change it."""
    rounds = EdgeRounds(max_queued=1)
    one = [torch.ones(3)]
    rounds.apply(1, one, [1])
    rounds.seal(1)
    rounds.seal(2)  # an idle save, no round since
    held = rounds.covered(1)
    rounds.unseal(1)
    rounds.apply(2, one, [1])  # must not merge: checkpoint 2 covers round 1's entry
    assert [r.numbers for r in rounds.covered(1)] == [[1]]
    rounds.unseal(2)
    held_later = rounds.covered(2)
    rounds.apply(3, one, [1])  # unsealed now: merges into round 2's entry, not into the copy
    assert [r.numbers for r in held] == [[1]]
    assert [(r.numbers, r.layer_steps) for r in held_later] == [([1], [1]), ([2], [1])]
    assert [r.numbers for r in rounds.covered(3)] == [[1], [2, 3]]
