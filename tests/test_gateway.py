"""The gateway against a hand-driven DEALER socket: verdicts, de-duplication, weighting, rounds, models."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq
from torch import nn

from elasticfed.cloud.aggregation import (
    Buffered,
    CosineDecay,
    DeadlineQuorum,
    LayerAccumulator,
    MeanStep,
    OpenRound,
    aggregation_named,
    contribution,
    entries,
    staleness_weight,
)
from elasticfed.cloud.delivery import DeliveryPace
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.protocol import (
    Ack,
    Commit,
    Dense,
    Heartbeat,
    Hello,
    LayerGradient,
    Manifest,
    Message,
    Model,
    ModelRequest,
    Push,
    Reason,
    Reject,
    Welcome,
    decode,
    encode,
)
from elasticfed.protocol.payload import Sparse


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


class Peer:
    """One edge, spoken by hand; the gateway is pumped from the same thread, so order is exact."""

    def __init__(self, gateway: Gateway, name: str) -> None:
        self.gateway = gateway
        self.name = name
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(gateway.bound_endpoint)
        self.commits: list[Commit] = []  # commits arrive unasked; recv() sets them aside here

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(encode(msg))

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = 5.0) -> Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.gateway.poll_once(0.005)
            if self.sock.poll(5):
                msg = decode(self.sock.recv_multipart())
                if isinstance(msg, Commit):
                    self.commits.append(msg)
                    continue
                return msg
        raise AssertionError(f"{self.name}: no answer from the gateway within {timeout} s")

    def hello(self, manifest: Manifest) -> Message:
        self.send(Hello(client_id=self.name, manifest=manifest, model_version=0, next_seq=1))
        return self.recv()

    def push(
        self, seq: int, grads: dict[str, torch.Tensor], count: int = 1, base: int = 0, lr: float = 0.0
    ) -> Ack:
        layers = tuple(LayerGradient(n, Dense(g), count) for n, g in grads.items())
        self.send(Push(seq=seq, base_version=base, layers=layers, lr=lr))
        answer = self.recv()
        assert isinstance(answer, Ack), answer
        return answer


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    model = make_model()
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        GatewayOptions(bind="tcp://127.0.0.1:0", credit=5, window=64),
        weighting=MeanStep(max_staleness=1, discount=0.5),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=2),
    )
    gw.bind()
    yield gw
    gw.close()


def grads_for(gw: Gateway, value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p, value) for n, p in zip(gw.names, gw.params)}


def test_hello_with_a_different_model_is_refused_naming_the_layer(gateway: Gateway) -> None:
    other = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 5))
    answer = Peer(gateway, "odd").hello(Manifest.from_parameters(other.named_parameters()))
    assert isinstance(answer, Reject) and answer.code == Reason.MANIFEST.value
    assert "entry 0: ours is 2.bias [2] float32, theirs is 2.bias [5] float32" in answer.detail
    assert gateway.metrics.rejected.get("?", "manifest") == 1  # a claimed name is not a label


def test_welcome_carries_credit_and_version(gateway: Gateway) -> None:
    welcome = Peer(gateway, "a").hello(gateway.manifest)
    assert isinstance(welcome, Welcome)
    assert welcome.manifest_digest == gateway.manifest.digest and welcome.model_version == 0
    assert welcome.settings["credit"] == 5 and welcome.settings["window"] == 64


def test_push_before_hello_is_not_applied(gateway: Gateway) -> None:
    ack = Peer(gateway, "a").push(1, grads_for(gateway, 1.0))
    assert not ack.accepted and ack.code == Reason.NOT_WELCOMED.value
    assert gateway.acc[0].count == 0


def test_a_duplicate_is_answered_the_same_and_applied_once(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    first = peer.push(1, grads_for(gateway, 1.0), count=3)
    again = peer.push(1, grads_for(gateway, 1.0), count=3)
    assert first.accepted and first.code == "" and first.credit == 5
    assert again.accepted and again.code == Reason.DUPLICATE.value
    assert [acc.count for acc in gateway.acc] == [3] * len(gateway.acc)
    assert gateway.metrics.duplicates.get("a") == 1
    # Once the edge says it no longer needs the verdict, a very late copy is still not applied.
    peer.send(Push(seq=2, base_version=0, layers=(), resolved_below=2))
    peer.recv()
    assert peer.push(1, grads_for(gateway, 1.0)).code == Reason.DUPLICATE.value
    assert gateway.acc[0].count == 3


def test_seq_beyond_the_window_is_refused_unjudged(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    ack = peer.push(64, grads_for(gateway, 1.0))
    assert not ack.accepted and ack.code == Reason.WINDOW.value
    assert peer.push(63, grads_for(gateway, 1.0)).accepted


def test_success_weighted_average_with_staleness_discount_and_drop(gateway: Gateway) -> None:
    a, b = Peer(gateway, "a"), Peer(gateway, "b")
    a.hello(gateway.manifest)
    b.hello(gateway.manifest)
    w0 = [p.detach().clone() for p in gateway.params]
    ga = {n: torch.randn_like(p) for n, p in zip(gateway.names, gateway.params)}
    gb = {n: torch.randn_like(p) for n, p in zip(gateway.names, gateway.params)}
    assert a.push(1, ga, count=1).accepted
    assert gateway.version == 0  # quorum is 2
    assert b.push(1, gb, count=3).accepted
    gateway.poll_once(0.0)
    assert gateway.version == 1
    for p, w, n in zip(gateway.params, w0, gateway.names):
        torch.testing.assert_close(p.detach(), w - 0.5 * (ga[n] + gb[n]) / 4, rtol=0, atol=1e-6)

    # Round 2: a fresh contribution and one a version behind (discount 0.5), then one too stale.
    w1 = [p.detach().clone() for p in gateway.params]
    gc = {n: torch.randn_like(p) for n, p in zip(gateway.names, gateway.params)}
    assert a.push(2, gc, count=2, base=1).accepted
    assert b.push(2, gb, count=2, base=0).accepted
    gateway.poll_once(0.0)
    assert gateway.version == 2
    # momentum 0: the step is exactly lr * average
    for p, w, n in zip(gateway.params, w1, gateway.names):
        expected = w - 0.5 * (gc[n] + 0.5 * gb[n]) / 4
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    stale = a.push(3, gc, count=7, base=0)  # 2 versions behind, max_staleness 1
    assert not stale.accepted and stale.code == Reason.STALE.value
    assert gateway.metrics.dropped_stale.get("a", gateway.names[0]) == 7
    assert gateway.acc[0].count == 0


def test_model_request_answers_the_current_version(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    peer.send(ModelRequest(have_version=0))
    model = peer.recv()
    assert isinstance(model, Model) and model.full and model.version == 0
    for layer, p in zip(model.layers, gateway.params):
        assert torch.equal(layer.payload.tensor, p.detach())
    peer.send(ModelRequest(have_version=0, names=(gateway.names[1],)))
    part = peer.recv()
    assert isinstance(part, Model) and not part.full and [x.name for x in part.layers] == [gateway.names[1]]


def test_heartbeat_is_answered_with_the_version(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    peer.send(Heartbeat(nonce=7))
    answer = peer.recv()
    assert isinstance(answer, Heartbeat) and answer.reply and answer.nonce == 7


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"\x93not a map"], Reason.MALFORMED),
        ([b"\x82\xa1v\x07\xa4type\xa4push"], Reason.VERSION),
    ],
)
def test_garbage_is_refused_with_a_reason_and_the_gateway_serves_on(
    gateway: Gateway, frames: list[bytes], reason: Reason
) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    peer.send_raw(frames)
    answer = peer.recv()
    assert isinstance(answer, Reject) and answer.code == reason.value
    assert peer.push(1, grads_for(gateway, 1.0)).accepted
    assert gateway.metrics.rejected.get("a", reason.value) == 1


def test_nonfinite_gradient_is_refused_and_not_applied(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    bad = grads_for(gateway, 1.0)
    bad[gateway.names[0]][0] = float("nan")
    peer.send(Push(seq=1, base_version=0, layers=tuple(LayerGradient(n, Dense(g)) for n, g in bad.items())))
    answer = peer.recv()
    assert isinstance(answer, Reject) and answer.code == Reason.NONFINITE.value
    assert all(acc.count == 0 for acc in gateway.acc)


def test_round_policy_closes_on_quorum_or_deadline() -> None:
    policy = DeadlineQuorum(deadline_s=1.0, quorum=2)
    rnd = OpenRound(number=1, layers=2)
    assert not policy.should_close(rnd, now=100.0)  # nothing to apply
    rnd.record("a", [0, 1], 1, 0, now=10.0)
    assert not policy.should_close(rnd, now=10.5)
    rnd.record("b", [0], 1, 0, now=10.6)  # b has not covered every layer
    assert not policy.should_close(rnd, now=10.7)
    assert policy.should_close(rnd, now=11.0)  # deadline
    rnd.record("b", [1], 1, 0, now=10.8)
    assert policy.should_close(rnd, now=10.8)  # quorum


def test_a_round_waits_as_long_as_its_contributors_links_need_for_a_whole_contribution() -> None:
    # On a slow link a contribution to every layer takes longer than the configured deadline:
    # the round waits for it (the quorum-th fastest contributor), capped, instead of closing
    # on a layer or two.
    policy = DeadlineQuorum(deadline_s=1.0, quorum=2, max_stretch_s=30.0)
    rnd = OpenRound(number=1, layers=2)
    rnd.record("a", [0], 1, 0, now=10.0, delivery_s=20.0)
    assert policy.time_left(rnd, now=10.0) == pytest.approx(1.0 + 20.0)  # one contributor: its time
    rnd.record("b", [0], 1, 0, now=10.5, delivery_s=4.0)
    rnd.record("c", [0], 1, 0, now=10.6, delivery_s=8.0)
    assert policy.stretch(rnd) == 8.0  # the second fastest of three, for a quorum of 2
    assert not policy.should_close(rnd, now=18.9) and policy.should_close(rnd, now=19.0)
    rnd.record("c", [1], 1, 0, now=11.0, delivery_s=500.0)  # the latest estimate counts; capped
    assert policy.stretch(rnd) == 20.0
    slowest = OpenRound(number=2, layers=2)
    slowest.record("a", [0], 1, 0, now=0.0, delivery_s=500.0)
    assert policy.deadline(slowest) == 1.0 + 30.0
    rnd.record("a", [1], 1, 0, now=11.0)
    rnd.record("b", [1], 1, 0, now=11.0)
    assert policy.should_close(rnd, now=11.0)  # quorum, whatever the stretch


def test_a_round_stays_open_as_long_as_its_contributors_take_to_fetch_a_version() -> None:
    # Compressed contributions complete a round in a fraction of a second; a version minted
    # faster than the edges download it only ages their work.  The minimum open time is the quorum-th
    # fastest contributor's last download time, capped like the stretch.
    policy = DeadlineQuorum(deadline_s=1.0, quorum=1, max_stretch_s=30.0)
    rnd = OpenRound(number=1, layers=2)
    rnd.record("a", [0, 1], 1, 0, now=10.0, fetch_s=2.5)
    assert policy.min_open_s(rnd) == 2.5
    assert not policy.should_close(rnd, now=12.4)  # complete, but no edge could fetch it yet
    assert policy.time_left(rnd, now=12.0) == pytest.approx(0.5)
    assert policy.should_close(rnd, now=12.5)
    rnd.record("b", [0, 1], 1, 0, now=10.1, fetch_s=0.5)
    assert policy.min_open_s(rnd) == 0.5 and policy.should_close(rnd, now=10.5)  # quorum 1: fastest
    slow = OpenRound(number=2, layers=2)
    slow.record("a", [0], 1, 0, now=0.0, fetch_s=8.0)  # incomplete: the deadline (1 s) is earlier
    assert not policy.should_close(slow, now=7.9) and policy.should_close(slow, now=8.0)
    assert policy.time_left(slow, now=0.0) == pytest.approx(8.0)
    hostile = OpenRound(number=3, layers=2)
    hostile.record("a", [0, 1], 1, 0, now=0.0, fetch_s=1e9)
    assert policy.min_open_s(hostile) == 30.0
    fresh = OpenRound(number=4, layers=2)
    fresh.record("a", [0, 1], 1, 0, now=0.0)  # no download finished yet: no minimum
    assert policy.should_close(fresh, now=0.0)


def test_delivery_pace_measures_an_edges_link_from_arrivals_alone() -> None:
    pace = DeliveryPace(model_bytes=10_000_000)
    pace.arrived("a", 100, now=0.0)  # a hello
    pace.arrived("a", 1_000_000, now=1.0, dense_bytes=1_000_000)
    assert pace.delivery_s("a") is None  # one second is not yet a span worth timing
    for t in (2.0, 3.0, 4.0, 5.0):  # a busy link: 1 MB a second
        pace.arrived("a", 1_000_000, now=t, dense_bytes=1_000_000)
    assert pace.delivery_s("a") == pytest.approx(10.0)
    # A stall (a retransmission), then what queued behind it arrives at once: the old
    # one-gap sample read 1 MB in a millisecond as 1 GB/s; over a span it stays a lower bound.
    for t in (9.0, 9.001, 9.002):
        pace.arrived("a", 1_000_000, now=t, dense_bytes=1_000_000)
    assert pace.delivery_s("a") == pytest.approx(10.0)  # the largest recent sample stands
    pace.arrived("a", 250_000, now=9.25, dense_bytes=1_000_000)  # int8-like: a quarter the bytes
    assert pace.delivery_s("a") == pytest.approx(0.25 * 10_000_000 / 1_000_000)
    pace.forget("a")
    assert pace.delivery_s("a") is None
    with pytest.raises(ValueError, match="model_bytes"):
        DeliveryPace(0)


def test_staleness_weights_are_the_fields_polynomial_and_exponential_rules() -> None:
    assert staleness_weight(0, 1.0, 0.5) == 1.0  # a fresh contribution enters whole
    assert staleness_weight(3, 1.0, 0.5) == pytest.approx(0.5)  # FedBuff: 1/sqrt(1 + 3)
    assert staleness_weight(3, 0.5, 0.0) == pytest.approx(0.125)  # exponential only
    assert staleness_weight(1, 0.5, 1.0) == pytest.approx(0.25)  # both
    assert staleness_weight(5, 1.0, 0.0) == 1.0  # none
    rule = Buffered(edge_lr=0.1, gateway_lr=0.2, exponent=0.5)
    assert rule.scale(8) == pytest.approx(0.5 / 3)
    assert MeanStep(exponent=0.5).scale(15) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="staleness exponent"):
        MeanStep(exponent=-1.0)
    with pytest.raises(ValueError, match="staleness exponent"):
        Buffered(edge_lr=0.1, gateway_lr=0.2, exponent=5.0)


def test_accumulator_and_weighting_validate() -> None:
    acc = LayerAccumulator(3)
    assert acc.average() is None
    acc.add("a", torch.ones(3) * 2, 2, 1.0)  # sums of 2 step-gradients each
    acc.add("b", torch.ones(3) * 8, 2, 0.5)
    torch.testing.assert_close(acc.average(), torch.full((3,), (2 + 0.5 * 8) / 4))
    with pytest.raises(ValueError, match="discount"):
        MeanStep(discount=0.0)
    with pytest.raises(ValueError, match="quorum"):
        DeadlineQuorum(quorum=0)


@pytest.mark.parametrize("aggregation", ["mean", "median", "trimmed_mean"])
def test_a_sparse_push_adds_what_its_dense_expansion_adds(aggregation: str) -> None:
    # The gateway keeps top-k pushes sparse (k entries of work, not n); a round that starts with
    # one must not read the buffer's leftovers of the round before.
    n = 300_000  # several 65,536-entry blocks of the sparse format
    gen = torch.Generator().manual_seed(0)

    def sparse_push(k: int, dtype: torch.dtype) -> Sparse:
        idx = torch.randperm(n, generator=gen)[:k].sort().values
        return Sparse.from_indices(idx, Dense(torch.randn(k, generator=gen).to(dtype)), (n,))

    pushes = [
        ("a", sparse_push(3000, torch.float32), 3, 0.5),
        ("b", Dense(torch.randn(n, generator=gen)), 1, 1.0),
        ("a", sparse_push(500, torch.float16), 2, 0.7),
        ("c", sparse_push(3000, torch.float32), 1, 1.0),
    ]
    sparse_acc = aggregation_named(aggregation).accumulator(n)
    dense_acc = aggregation_named(aggregation).accumulator(n)
    sparse_acc.add("z", torch.full((n,), 1e6), 1, 1.0)  # the round before: leftovers in the buffer
    sparse_acc.reset()
    for client, payload, count, scale in pushes:
        sparse_acc.add(client, contribution(payload), count, scale)
        dense_acc.add(client, payload.to_dense().to(torch.float32), count, scale)
    assert contribution(pushes[0][1]).is_sparse and contribution(pushes[0][1])._nnz() == 3000
    expected, got = dense_acc.average(min_divisor=2), sparse_acc.average(min_divisor=2)
    assert expected is not None and got is not None
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert float(entries(contribution(pushes[0][1])).norm()) == pytest.approx(
        float(pushes[0][1].to_dense().norm()), rel=1e-6
    )


def test_a_reply_that_cannot_be_delivered_is_counted_not_lost_silently(gateway: Gateway) -> None:
    # ROUTER_MANDATORY: a route that is gone raises inside the gateway, which counts it.
    gateway._reply(b"an-edge-that-left", Heartbeat(nonce=1, reply=True))
    assert gateway.metrics.send_failures.get("peer_gone") == 1


def test_a_copy_of_a_judged_push_is_answered_from_its_header_without_decoding_its_payload(
    gateway: Gateway,
) -> None:
    """A re-sent push costs a header read, not a decode: its payload frames are never looked at.
    Shown by a copy whose payload is garbage: answered as the duplicate it is, where the same
    garbage under a new seq is refused as malformed."""
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    assert peer.push(1, grads_for(gateway, 1.0), count=3).accepted
    layers = tuple(LayerGradient(n, Dense(g), 3) for n, g in grads_for(gateway, 1.0).items())
    frames = [bytes(f) for f in encode(Push(seq=1, base_version=0, layers=layers, attempt=2))]
    garbled = [frames[0]] + [b"\xff" * len(f) for f in frames[1:]]
    peer.send_raw(garbled)
    again = peer.recv()
    assert isinstance(again, Ack) and again.seq == 1 and again.accepted
    assert again.code == Reason.DUPLICATE.value and again.attempt == 0  # the first copy's verdict
    assert [acc.count for acc in gateway.acc] == [3] * len(gateway.acc)
    assert gateway.metrics.duplicates.get("a") == 1
    fresh = [bytes(f) for f in encode(Push(seq=2, base_version=0, layers=layers))]
    peer.send_raw([fresh[0]] + [b"\xff" * len(f) for f in fresh[1:]])
    refused = peer.recv()
    assert isinstance(refused, Reject) and refused.code == Reason.CHECKSUM.value, refused
    assert [acc.count for acc in gateway.acc] == [3] * len(gateway.acc)


def test_a_duplicate_of_a_stale_push_gets_the_same_verdict_and_is_counted_once(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    gateway.publish(5)  # the served model is 5 versions ahead; max_staleness is 1
    first = peer.push(1, grads_for(gateway, 1.0), count=2, base=0)
    again = peer.push(1, grads_for(gateway, 1.0), count=2, base=0)
    assert (first.accepted, first.code) == (again.accepted, again.code) == (False, Reason.STALE.value)
    assert gateway.metrics.rejected.get("a", Reason.STALE.value) == 1
    assert gateway.metrics.dropped_stale.get("a", gateway.names[0]) == 2
    assert gateway.metrics.duplicates.get("a") == 1


def test_cosine_decay_goes_from_full_to_floor_and_stays() -> None:
    decay = CosineDecay(rounds=100, floor=0.05)
    assert decay(1) == pytest.approx(1.0)
    assert decay(51) == pytest.approx(0.525)
    assert decay(101) == pytest.approx(0.05) and decay(1000) == pytest.approx(0.05)
    assert all(decay(r) >= decay(r + 1) for r in range(1, 120))


def test_every_answer_repeats_the_verdicts_the_edge_may_not_have_heard(gateway: Gateway) -> None:
    # A cumulative acknowledgement: over a lossy link one answer that gets through settles all.
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    assert peer.push(1, grads_for(gateway, 1.0)).verdicts == ()
    ack2 = peer.push(2, grads_for(gateway, 1.0))
    assert ack2.verdicts == ((1, "", 0),)
    gateway.close_round()
    gateway.close_round()
    stale = peer.push(3, grads_for(gateway, 1.0), base=0)  # 2 versions behind: dropped
    assert stale.code == Reason.STALE.value and stale.verdicts == ((1, "", 0), (2, "", 0))
    peer.send(Heartbeat(nonce=1))
    beat = peer.recv()
    assert isinstance(beat, Heartbeat) and beat.verdicts == ((1, "", 0), (2, "", 0), (3, "stale", 0))
    # The edge says it has heard everything below 3: only the newest verdict is repeated.
    peer.send(Heartbeat(nonce=2, resolved_below=3))
    beat = peer.recv()
    assert isinstance(beat, Heartbeat) and beat.verdicts == ((3, "stale", 0),)


def test_the_ack_of_a_resend_names_the_copy_that_was_applied(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    layers = tuple(LayerGradient(n, Dense(g), 1) for n, g in grads_for(gateway, 1.0).items())
    peer.send(Push(seq=1, base_version=0, layers=layers, attempt=2))  # the 2nd re-send arrived first
    first = peer.recv()
    peer.send(Push(seq=1, base_version=0, layers=layers, attempt=0))  # the original, late
    late = peer.recv()
    assert isinstance(first, Ack) and first.accepted and first.attempt == 2
    assert isinstance(late, Ack) and late.code == Reason.DUPLICATE.value and late.attempt == 2
    assert gateway.acc[0].count == 1


def test_a_reconnected_edge_keeps_its_welcome_with_the_same_routing_id(gateway: Gateway) -> None:
    ctx = zmq.Context.instance()
    old = Peer(gateway, "a")
    old.sock.close(linger=0)
    old.sock = ctx.socket(zmq.DEALER)
    old.sock.setsockopt(zmq.ROUTING_ID, b"a")
    old.sock.setsockopt(zmq.LINGER, 0)
    old.sock.connect(gateway.bound_endpoint)
    old.hello(gateway.manifest)
    new = Peer(gateway, "a")
    new.sock.close(linger=0)
    new.sock = ctx.socket(zmq.DEALER)
    new.sock.setsockopt(zmq.ROUTING_ID, b"a")  # same id: ROUTER_HANDOVER gives it the route
    new.sock.setsockopt(zmq.LINGER, 0)
    new.sock.connect(gateway.bound_endpoint)
    ack = new.push(1, grads_for(gateway, 1.0))
    assert ack.accepted, ack  # no second hello needed
    old.sock.close(linger=0)


def _progress_gateway(expected: int, clock: Callable[[], float] = time.monotonic) -> Gateway:
    """The buffered rule: edges at lr 0.1, the gateway's SGD at 0.5, no staleness weight."""
    model = make_model()
    return Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        weighting=Buffered(edge_lr=0.1, gateway_lr=0.5, max_staleness=4, expected=expected),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=expected),
        clock=clock,
    )


def test_local_progress_is_the_mean_of_the_edges_moves() -> None:
    gw = _progress_gateway(expected=2)
    gw.bind()
    try:
        a, b = Peer(gw, "a"), Peer(gw, "b")
        a.hello(gw.manifest)
        b.hello(gw.manifest)
        w0 = [p.detach().clone() for p in gw.params]
        sa = {n: torch.randn_like(p) for n, p in zip(gw.names, gw.params)}
        sb = {n: torch.randn_like(p) for n, p in zip(gw.names, gw.params)}
        assert a.push(1, sa, count=10).accepted  # a's model moved by -0.1 * sa over 10 local steps
        assert b.push(1, sb, count=2).accepted
        gw.poll_once(0.0)
        assert gw.version == 1
        for p, w, n in zip(gw.params, w0, gw.names):
            # FedAvg: the mean of the moves, whatever the step counts.
            torch.testing.assert_close(p.detach(), w - 0.1 * (sa[n] + sb[n]) / 2, rtol=0, atol=1e-6)
        # A round that closes (on its deadline) with one of the two expected edges: that edge's
        # move counts for its share of the fleet, not for the whole fleet (FedBuff's rule).
        w1 = [p.detach().clone() for p in gw.params]
        assert a.push(2, sa, count=300, base=1).accepted
        gw.close_round()
        for p, w, n in zip(gw.params, w1, gw.names):
            torch.testing.assert_close(p.detach(), w - 0.1 * sa[n] / 2, rtol=0, atol=1e-6)
    finally:
        gw.close()
    with pytest.raises(ValueError, match="learning rates must be > 0"):
        Buffered(edge_lr=0.0, gateway_lr=0.5)
    with pytest.raises(ValueError, match="expected contributions"):
        Buffered(edge_lr=0.1, gateway_lr=0.5, expected=0)


def test_a_contribution_that_says_its_rate_moves_the_model_as_far_as_the_edge_moved() -> None:
    """Edges at different rates: each sum times its own rate; one that says none, the gateway's 0.1."""
    gw = _progress_gateway(expected=3)
    gw.bind()
    try:
        a, b, c = Peer(gw, "a"), Peer(gw, "b"), Peer(gw, "c")
        for peer in (a, b, c):
            peer.hello(gw.manifest)
        w0 = [p.detach().clone() for p in gw.params]
        sums = [{n: torch.randn_like(p) for n, p in zip(gw.names, gw.params)} for _ in range(3)]
        assert a.push(1, sums[0], count=10, lr=0.4).accepted  # a moved by -0.4 * its sum
        assert b.push(1, sums[1], count=3, lr=0.004).accepted
        assert c.push(1, sums[2], count=5).accepted  # an edge that does not say: edge_lr, 0.1
        gw.poll_once(0.0)
        assert gw.version == 1
        for p, w, n in zip(gw.params, w0, gw.names):
            move = 0.4 * sums[0][n] + 0.004 * sums[1][n] + 0.1 * sums[2][n]
            torch.testing.assert_close(p.detach(), w - move / 3, rtol=0, atol=1e-6)
    finally:
        gw.close()


def _gateway(**options: object) -> Gateway:
    model = make_model()
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        GatewayOptions(bind="tcp://127.0.0.1:0", **options),  # type: ignore[arg-type]
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=2),
    )
    gw.bind()
    return gw


def test_a_device_over_its_rate_is_refused_and_the_others_are_not() -> None:
    clock = [0.0]
    gw = _gateway(rate_messages_per_s=10.0, rate_burst=5)
    gw.clock = lambda: clock[0]
    try:
        fast, calm = Peer(gw, "fast"), Peer(gw, "calm")
        assert isinstance(fast.hello(gw.manifest), Welcome) and isinstance(calm.hello(gw.manifest), Welcome)
        answers = []
        for nonce in range(10):  # a burst of 5 (the hello came before the device was known)
            fast.send(Heartbeat(nonce=nonce))
            answers.append(fast.recv())
        codes = [a.code if isinstance(a, Reject) else "ok" for a in answers]
        assert codes == ["ok"] * 5 + ["rate_limited"] * 5
        calm.send(Heartbeat(nonce=1))
        assert isinstance(calm.recv(), Heartbeat)  # its own budget
        clock[0] += 0.25  # 2.5 tokens back: two more messages pass
        fast.send(Heartbeat(nonce=99))
        assert isinstance(fast.recv(), Heartbeat)
        assert gw.metrics.rejected.get("fast", "rate_limited") == 5
    finally:
        gw.close()


def test_the_client_table_is_bounded() -> None:
    gw = _gateway(max_clients=2)
    try:
        assert isinstance(Peer(gw, "a").hello(gw.manifest), Welcome)
        assert isinstance(Peer(gw, "b").hello(gw.manifest), Welcome)
        answer = Peer(gw, "c").hello(gw.manifest)
        assert isinstance(answer, Reject) and answer.code == "too_many_clients"
        assert isinstance(Peer(gw, "a").hello(gw.manifest), Welcome)  # known devices still come back
        assert sorted(gw.clients) == ["a", "b"]
    finally:
        gw.close()


def test_caps_are_sized_from_the_model_and_the_largest_real_messages_fit(gateway: Gateway) -> None:
    from elasticfed.protocol import TopK, limits_for

    limits = limits_for(gateway.manifest)
    assert (
        gateway.limits == dataclasses.replace(limits, encodings=("dense", "int8", "sparse"))
        and limits.max_message_bytes < 2**20
    )
    # The largest messages a real edge sends about this model: dense, full top-k with int64 indices.
    dense = Push(
        seq=1,
        base_version=0,
        layers=tuple(LayerGradient(s.name, Dense(torch.ones(s.shape)), 1) for s in gateway.manifest),
    )
    topk = Push(
        seq=2,
        base_version=0,
        layers=tuple(
            LayerGradient(s.name, TopK(torch.ones(s.numel), torch.arange(s.numel), s.shape), 1)
            for s in gateway.manifest
        ),
    )
    hello = Hello(client_id="x" * 255, manifest=gateway.manifest, model_version=0, next_seq=1)
    for msg in (dense, topk, hello):
        decode(encode(msg), limits=limits, manifest=gateway.manifest)
    # One byte over, in two frames each under libzmq's per-frame cap: refused before parsing.
    peer = Peer(gateway, "big")
    peer.hello(gateway.manifest)
    half = b"\0" * (limits.max_message_bytes // 2 + 1)
    peer.send_raw([msgpack_header(), half, half])
    answer = peer.recv()
    assert isinstance(answer, Reject) and answer.code == "too_large"


def msgpack_header() -> bytes:
    import msgpack

    return msgpack.packb({"v": 1, "type": "push"})


def test_compressed_pushes_are_refused_unless_accepted_and_refused_if_they_overflow(gateway: Gateway) -> None:
    from elasticfed.protocol import TopK

    i = max(range(len(gateway.params)), key=lambda j: gateway.params[j].numel())
    sparse = TopK(torch.ones(2), torch.tensor([0, 1]), tuple(gateway.params[i].shape))
    peer = Peer(gateway, "plain")
    peer.hello(gateway.manifest)
    peer.send(Push(seq=1, base_version=0, layers=(LayerGradient(gateway.names[i], sparse, 1),)))
    answer = peer.recv()
    assert isinstance(answer, Reject) and answer.code == "encoding" and "not accepted here" in answer.detail
    gateway.close()
    model = make_model()
    gateway = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        GatewayOptions(bind="tcp://127.0.0.1:0", encodings=("dense", "topk")),
    )
    gateway.bind()
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    i = max(range(len(gateway.params)), key=lambda j: gateway.params[j].numel())  # 12 elements
    name, shape = gateway.names[i], tuple(gateway.params[i].shape)
    # Every value finite in fp16, but five of them on one index sum past fp16's largest (65504).
    values = torch.full((5,), 60000.0, dtype=torch.float16)
    layers = (LayerGradient(name, TopK(values, torch.zeros(5, dtype=torch.int64), shape), 1),)
    peer.send(Push(seq=1, base_version=0, layers=layers))
    answer = peer.recv()
    assert isinstance(answer, Ack) and not answer.accepted and answer.code == "nonfinite"
    assert gateway.open.steps == 0 and gateway.metrics.rejected.get("a", "nonfinite") == 1
    gateway.close()


def test_a_gradient_wider_than_its_layer_is_refused(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    wide = {n: torch.full_like(p, 1e300, dtype=torch.float64) for n, p in zip(gateway.names, gateway.params)}
    peer.send(
        Push(seq=1, base_version=0, layers=tuple(LayerGradient(n, Dense(g), 1) for n, g in wide.items()))
    )
    answer = peer.recv()
    assert isinstance(answer, Reject) and answer.code == "dtype" and "wider than" in answer.detail


def test_finite_pushes_that_overflow_together_leave_the_model_finite(gateway: Gateway) -> None:
    before = {n: p.detach().clone() for n, p in zip(gateway.names, gateway.params)}
    a, b = Peer(gateway, "a"), Peer(gateway, "b")
    a.hello(gateway.manifest)
    b.hello(gateway.manifest)
    assert a.push(1, grads_for(gateway, 3e38)).accepted and b.push(1, grads_for(gateway, 3e38)).accepted
    gateway.close_round()
    for n, p in zip(gateway.names, gateway.params):
        assert torch.equal(p.detach(), before[n])  # no layer was stepped with inf
    assert sum(gateway.status()["metrics"]["gateway_nonfinite_layers_total"].values()) == len(gateway.names)


def test_a_full_client_table_forgets_the_device_silent_longest_once_idle() -> None:
    clock = [0.0]
    gw = _gateway(max_clients=1, client_idle_s=600.0)
    gw.clock = lambda: clock[0]
    try:
        assert isinstance(Peer(gw, "old").hello(gw.manifest), Welcome)
        clock[0] = 599.0
        answer = Peer(gw, "new").hello(gw.manifest)
        assert isinstance(answer, Reject) and answer.code == "too_many_clients"  # not idle long enough
        clock[0] = 601.0
        assert isinstance(Peer(gw, "new").hello(gw.manifest), Welcome)
        assert sorted(gw.clients) == ["new"]
    finally:
        gw.close()


def test_a_device_forgotten_to_make_room_keeps_its_unheard_verdicts_and_is_never_applied_twice() -> None:
    """A device that went silent before hearing its push's verdict, forgotten for a newcomer, comes
    back and sends that push again: it is answered as before (before: applied a second time).
    Its verdicts are saved while it is away; a full table of such devices refuses newcomers."""
    clock = [0.0]
    gw = _gateway(max_clients=1, client_idle_s=600.0)
    gw.clock = lambda: clock[0]
    try:
        old = Peer(gw, "old")
        assert isinstance(old.hello(gw.manifest), Welcome)
        first = old.push(1, grads_for(gw, 1.0))
        assert first.accepted and first.code == ""  # applied; the device goes silent unanswered
        clock[0] = 601.0
        assert isinstance(Peer(gw, "new").hello(gw.manifest), Welcome)
        assert sorted(gw.clients) == ["new"] and gw.status()["dormant_clients"] == 1
        assert gw.state().clients["old"].verdicts  # saved while it is away
        clock[0] = 1300.0  # "new" only said hello: nothing of it needs keeping
        back = Peer(gw, "old")
        assert isinstance(back.hello(gw.manifest), Welcome)
        again = back.push(1, grads_for(gw, 1.0))
        assert again.accepted and again.code == "duplicate", again
        assert gw.applied_steps["old"] == [1] * len(gw.names)
        assert gw.status()["dormant_clients"] == 0 and "new" not in gw.clients
        # Full of devices with unheard verdicts: a newcomer is refused, saying why.
        assert back.push(2, grads_for(gw, 1.0)).accepted
        clock[0] = 2000.0
        assert isinstance(Peer(gw, "third").hello(gw.manifest), Welcome)  # "old" kept aside
        gw.clients["third"].record(1, "", 0)  # an unheard verdict of its own
        clock[0] = 2700.0
        refused = Peer(gw, "fourth").hello(gw.manifest)
        assert isinstance(refused, Reject) and refused.code == "too_many_clients", refused
        assert "unheard verdicts" in refused.detail
        assert set(gw.state().clients) == {"old", "third"}  # both saved
        # Full as it is, a device back from aside gets in: the idle one goes aside in its place.
        assert isinstance(Peer(gw, "old").hello(gw.manifest), Welcome)
        assert sorted(gw.clients) == ["old"] and gw.status()["dormant_clients"] == 1
    finally:
        gw.close()


def test_room_is_made_first_from_idle_devices_with_nothing_to_keep() -> None:
    clock = [0.0]
    gw = _gateway(max_clients=2, client_idle_s=600.0)
    gw.clock = lambda: clock[0]
    try:
        a = Peer(gw, "a")
        a.hello(gw.manifest)
        assert a.push(1, grads_for(gw, 1.0)).accepted  # its verdict unheard: it must be kept
        clock[0] = 100.0
        Peer(gw, "b").hello(gw.manifest)  # nothing to keep
        clock[0] = 800.0  # both idle; "a" silent longer
        assert isinstance(Peer(gw, "c").hello(gw.manifest), Welcome)
        assert sorted(gw.clients) == ["a", "c"] and gw.status()["dormant_clients"] == 0
    finally:
        gw.close()


class BrokenWeighting(MeanStep):
    """A policy with a bug (a user's own object): the service must outlive it."""

    def scale(self, staleness: int, lr: float | None = None) -> float:
        raise ZeroDivisionError("bug in a user policy")


def test_a_message_whose_handling_fails_costs_that_message_not_the_service() -> None:
    model = make_model()
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        weighting=BrokenWeighting(),
    )
    gw.bind()
    try:
        peer = Peer(gw, "a")
        peer.hello(gw.manifest)
        peer.send(Push(seq=1, base_version=0, layers=(LayerGradient(gw.names[0], Dense(torch.zeros(2)), 1),)))
        answer = peer.recv()
        assert isinstance(answer, Reject) and answer.code == "malformed"
        assert "ZeroDivisionError: bug in a user policy" in answer.detail
        peer.send(Heartbeat(nonce=7))
        assert isinstance(peer.recv(), Heartbeat)  # still serving
    finally:
        gw.close()


def test_trimmed_mean_rounds_the_trim_up() -> None:
    from elasticfed.cloud.aggregation import TrimmedMean

    acc = TrimmedMean(trim=0.2).accumulator(2)
    for client, value in (("a", 1.0), ("b", 2.0), ("c", 1000.0)):
        acc.add(client, torch.full((2,), value), 1, 1.0)
    average = acc.average()
    assert average is not None and torch.equal(average, torch.full((2,), 2.0))  # one dropped at each end


def test_the_welcome_answers_every_instance_the_edge_holds_pushes_of(gateway: Gateway) -> None:
    peer = Peer(gateway, "a")
    hello = Hello(
        client_id="a",
        manifest=gateway.manifest,
        model_version=0,
        next_seq=1,
        holding=("gw-dead", gateway.gateway_id),
    )
    peer.send(hello)
    welcome = peer.recv()
    assert isinstance(welcome, Welcome)
    # No checkpoints here: nothing of either is on disk, so the edge sends the dead one's again.
    assert welcome.durable == (("gw-dead", 0), (gateway.gateway_id, 0))
    assert welcome.settings["commits"] is False and welcome.next_seq == 0


def test_a_hello_raises_resolved_below_so_a_late_copy_below_it_is_never_applied(gateway: Gateway) -> None:
    # After a restart, a proxy could still deliver an old copy of a push the edge has resolved
    # (and, if a dead gateway applied it, sends again as a new push): it must count as a duplicate.
    peer = Peer(gateway, "a")
    peer.send(Hello(client_id="a", manifest=gateway.manifest, model_version=0, next_seq=5, resolved_below=5))
    assert isinstance(peer.recv(), Welcome)
    late = peer.push(3, grads_for(gateway, 1.0))
    assert late.accepted and late.detail == "answered before; not applied again"
    assert gateway.metrics.duplicates.get("a") == 1 and gateway.open.contributions == 0
