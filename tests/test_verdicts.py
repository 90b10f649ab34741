"""The push checks (cloud/verdicts.py) as plain functions: no gateway, no sockets."""

from __future__ import annotations

import torch

from elasticfed.cloud import verdicts
from elasticfed.cloud.aggregation import Buffered, MeanStep, contribution
from elasticfed.cloud.clients import ClientState
from elasticfed.cloud.verdicts import Verdict
from elasticfed.protocol import Dense, LayerGradient, Push, Reason
from elasticfed.protocol.payload import Quantized


def push(seq: int, *layers: LayerGradient, base: int = 0, attempt: int = 0) -> Push:
    return Push(seq=seq, base_version=base, layers=tuple(layers), attempt=attempt)


def dense(values: list[float], count: int = 1, name: str = "w") -> LayerGradient:
    return LayerGradient(name, Dense(torch.tensor(values)), count)


def test_a_push_judged_before_gets_its_first_verdict_again() -> None:
    state = ClientState("a", b"r")
    state.record(3, "", 1, 7)  # applied, copy 1, in checkpoint 7
    state.record(4, Reason.STALE.value, 0)
    assert verdicts.repeated(state, push(5), durable_epoch=2) is None  # new
    again = verdicts.repeated(state, push(3, attempt=2), durable_epoch=2)
    assert again == Verdict(
        True, "duplicate", "answered before; not applied again", 1, 7, recorded=False, repeat=True
    )
    stale = verdicts.repeated(state, push(4), durable_epoch=2)
    assert stale is not None and not stale.accepted and stale.code == "stale" and stale.repeat


def test_below_resolved_below_a_forgotten_verdict_is_an_application_in_a_saved_checkpoint() -> None:
    state = ClientState("a", b"r")
    state.record(1, "", 0, 4)
    state.resolve_below(2)  # the edge no longer needs seq 1's verdict
    forgotten = verdicts.repeated(state, push(1), durable_epoch=9)
    assert forgotten is not None and forgotten.accepted and forgotten.epoch == 4
    restored = ClientState("b", b"r", resolved_below=5)  # nothing forgotten here: the restored checkpoint's
    old = verdicts.repeated(restored, push(2), durable_epoch=9)
    assert old is not None and old.accepted and old.epoch == 9


def test_a_push_beyond_the_window_is_refused_and_not_remembered() -> None:
    state = ClientState("a", b"r", resolved_below=10)
    assert verdicts.beyond_window(state, push(13), window=4) is None
    far = verdicts.beyond_window(state, push(14), window=4)
    assert far is not None and far.code == "window" and not far.recorded and not far.repeat
    for seq in range(10, 14):
        state.record(seq, "", 0)
    full = verdicts.beyond_window(state, push(13), window=4)  # as many verdicts held as the window
    assert full is not None and full.code == "window"


def test_staleness_is_judged_by_what_the_edge_could_have_avoided() -> None:
    weighting = MeanStep(max_staleness=5)
    state = ClientState("a", b"r")
    # Not downloading: judged against the newest version.
    assert verdicts.avoidable_staleness(state, base_version=2, newest=10, weighting=weighting, now=100.0) == 8
    # Fetching version 9 a moment ago: the versions after 9 are the link's doing.
    state.fetching, state.fetched_at = 9, 99.0
    assert verdicts.avoidable_staleness(state, base_version=2, newest=10, weighting=weighting, now=100.0) == 7
    # ... but not once it stopped asking for chunks.
    assert (
        verdicts.avoidable_staleness(
            state, base_version=2, newest=10, weighting=weighting, now=99.0 + verdicts.FETCH_GRACE_S + 1
        )
        == 8
    )
    # ... nor when what it fetched last is the model it trains from (it fetches only when it will
    # adopt: the versions since are its choice, not its link's).
    state.fetching, state.fetched_at = 2, 99.0
    assert verdicts.avoidable_staleness(state, base_version=2, newest=10, weighting=weighting, now=100.0) == 8
    # ... and never beyond HARD_STALENESS_FACTOR x max_staleness.
    state.fetching, state.fetched_at = 99, 99.0
    far = verdicts.avoidable_staleness(state, base_version=0, newest=100, weighting=weighting, now=100.0)
    assert far == 100
    assert verdicts.too_stale(push(1), staleness=5, avoidable=5, weighting=weighting) is None
    drop = verdicts.too_stale(push(1, attempt=2), staleness=9, avoidable=6, weighting=weighting)
    assert drop == Verdict(False, "stale", "9 versions behind", 2)


def test_a_payload_that_overflows_once_expanded_is_refused_and_logged() -> None:
    codes = torch.tensor([127, 1], dtype=torch.int8)
    big = Quantized(codes, torch.tensor([1000.0], dtype=torch.float16), 256, (2,))  # 127000 > fp16 max
    fine = Quantized(codes, torch.tensor([0.5], dtype=torch.float16), 256, (2,))
    ok = push(1, LayerGradient("w", fine))
    assert verdicts.not_finite(ok, [contribution(layer.payload) for layer in ok.layers]) is None
    bad = push(2, LayerGradient("w", fine), LayerGradient("b", big), attempt=1)
    verdict = verdicts.not_finite(bad, [contribution(layer.payload) for layer in bad.layers])
    assert verdict is not None and verdict.code == "nonfinite" and verdict.logged and verdict.attempt == 1
    assert "layer b" in verdict.detail and "Quantized" in verdict.detail


def test_the_norm_bound_clips_per_layer_or_rejects_the_push() -> None:
    weighting = Buffered(edge_lr=0.1, gateway_lr=0.1, expected=1, exponent=0.5, max_staleness=10)
    msg = push(1, dense([3.0, 4.0], count=1, name="w"), dense([0.3, 0.4], count=1, name="b"))
    parts = [contribution(layer.payload) for layer in msg.layers]
    assert verdicts.norm_factors(msg, parts, 0.0, "clip", weighting) == [1.0, 1.0]  # no bound
    assert verdicts.norm_factors(msg, parts, 1.0, "clip", weighting) == [0.2, 1.0]  # |w| = 5
    refused = verdicts.norm_factors(msg, parts, 1.0, "reject", weighting)
    assert isinstance(refused, Verdict) and refused.code == "norm" and refused.logged
    assert "layer w" in refused.detail
