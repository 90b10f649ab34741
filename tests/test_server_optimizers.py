"""The gateway's optimizers on the buffered update, against updates computed by hand on a tiny model;
and a gateway whose model diverges (non-finite, or finite with an exploded loss) stops without serving
or saving it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elasticfed.cloud.aggregation import Buffered, DeadlineQuorum
from elasticfed.cloud.config import CloudConfig, GatewaySettings
from elasticfed.cloud.durability import GatewayCheckpoints
from elasticfed.cloud.gateway import Gateway, GatewayDiverged, GatewayOptions, edge_push
from elasticfed.cloud.serve import build_gateway, contradictions
from elasticfed.cloud.server_optimizers import Yogi, server_optimizer
from elasticfed.cloud.watch import LossWatch
from elasticfed.common.task import load_task
from elasticfed.protocol import Dense, LayerGradient, ModelChunk, ModelFetch, Push
from tests.test_gateway import Peer, make_model

EDGE_LR = 0.1


def two_edge_gateway(optimizer_of, gateway_lr: float, **kwargs: object) -> Gateway:  # type: ignore[no-untyped-def]
    model = make_model()
    gw = Gateway(
        model,
        optimizer_of(model.parameters()),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        weighting=Buffered(edge_lr=EDGE_LR, gateway_lr=gateway_lr, max_staleness=4, expected=2),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=2),
        **kwargs,  # type: ignore[arg-type]
    )
    gw.bind()
    return gw


def rounds_of(gw: Gateway, count: int, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Play `count` rounds of two edges' pushes; yield each round's pseudo-gradient (the mean move)."""
    gen = torch.Generator().manual_seed(seed)
    a, b = Peer(gw, "a"), Peer(gw, "b")
    a.hello(gw.manifest)
    b.hello(gw.manifest)
    for r in range(count):
        sa = {n: torch.randn(p.shape, generator=gen) for n, p in zip(gw.names, gw.params)}
        sb = {n: torch.randn(p.shape, generator=gen) * 3 for n, p in zip(gw.names, gw.params)}
        assert a.push(r + 1, sa, count=7, base=r).accepted
        assert b.push(r + 1, sb, count=1, base=r).accepted
        gw.poll_once(0.0)
        assert gw.version == r + 1
        yield {n: EDGE_LR * (sa[n] + sb[n]) / 2 for n in gw.names}


def test_each_version_says_its_step_mass_so_its_change_gives_the_mean_pushed_direction() -> None:
    """ModelChunk.mass (SCAFFOLD's fleet direction on the edge, edge/drift.py): per round, lr x scale x
    steps over the divisor; minus the model's change over the mass's is the mean pushed direction."""
    gw = two_edge_gateway(lambda ps: server_optimizer("sgd", ps, 0.5), 0.5)
    try:
        gen = torch.Generator().manual_seed(0)
        before = {n: p.detach().clone() for n, p in zip(gw.names, gw.params)}
        a, b = Peer(gw, "a"), Peer(gw, "b")
        a.hello(gw.manifest)
        b.hello(gw.manifest)
        sa = {n: torch.randn(p.shape, generator=gen) for n, p in zip(gw.names, gw.params)}
        sb = {n: torch.randn(p.shape, generator=gen) for n, p in zip(gw.names, gw.params)}
        assert a.push(1, sa, count=7).accepted and b.push(1, sb, count=1).accepted
        gw.poll_once(0.0)
        assert gw.version == 1
        assert gw.mass == pytest.approx(EDGE_LR * (7 + 1) / 2)  # 8 steps at the edges' rate, over 2
        for n, p in zip(gw.names, gw.params):
            mean_direction = (sa[n] + sb[n]) / 8
            torch.testing.assert_close(-(p.detach() - before[n]) / gw.mass, mean_direction)
        chunk = newest_chunk(a)
        assert chunk.version == 1 and chunk.mass == pytest.approx(gw.mass)
    finally:
        gw.close()
    for bent in (
        two_edge_gateway(lambda ps: server_optimizer("sgd", ps, 0.5, 0.9), 0.5),
        two_edge_gateway(lambda ps: server_optimizer("adam", ps, 0.01), 1.0),
    ):
        try:  # momentum or Adam bends the step: the mass says nothing, so it is not said
            list(rounds_of(bent, 1))
            peer = Peer(bent, "c")
            peer.hello(bent.manifest)
            chunk = newest_chunk(peer)
            assert chunk.version == 1 and chunk.mass == 0.0
        finally:
            bent.close()


def newest_chunk(peer: Peer) -> ModelChunk:
    peer.send(ModelFetch(version=0, offset=0, length=1 << 20))
    for _ in range(100):
        msg = peer.recv()
        if isinstance(msg, ModelChunk):
            return msg
    raise AssertionError("no model chunk")


def test_fedadam_steps_adam_on_the_mean_move() -> None:
    lr, b1, b2, tau = 0.01, 0.9, 0.99, 1e-3
    gw = two_edge_gateway(lambda ps: server_optimizer("adam", ps, lr, betas=(b1, b2), tau=tau), 1.0)
    try:
        x = {n: p.detach().clone() for n, p in zip(gw.names, gw.params)}
        m = {n: torch.zeros_like(t) for n, t in x.items()}
        v = {n: torch.zeros_like(t) for n, t in x.items()}
        for t, g in enumerate(rounds_of(gw, 3), start=1):
            for n in x:
                m[n] = b1 * m[n] + (1 - b1) * g[n]
                v[n] = b2 * v[n] + (1 - b2) * g[n] ** 2
                m_hat, v_hat = m[n] / (1 - b1**t), v[n] / (1 - b2**t)
                x[n] = x[n] - lr * m_hat / (v_hat.sqrt() + tau)
            for n, p in zip(gw.names, gw.params):
                torch.testing.assert_close(p.detach(), x[n], rtol=1e-5, atol=1e-6)
    finally:
        gw.close()


def test_fedyogi_moves_its_second_moment_additively() -> None:
    lr, b1, b2, tau, v0 = 0.01, 0.9, 0.99, 1e-3, 1e-6
    gw = two_edge_gateway(lambda ps: Yogi(ps, lr=lr, betas=(b1, b2), eps=tau, initial_accumulator=v0), 1.0)
    try:
        x = {n: p.detach().clone() for n, p in zip(gw.names, gw.params)}
        m = {n: torch.zeros_like(t) for n, t in x.items()}
        v = {n: torch.full_like(t, v0) for n, t in x.items()}
        for t, g in enumerate(rounds_of(gw, 3, seed=1), start=1):
            for n in x:
                m[n] = b1 * m[n] + (1 - b1) * g[n]
                g2 = g[n] ** 2
                v[n] = v[n] - (1 - b2) * g2 * torch.sign(v[n] - g2)
                x[n] = x[n] - lr * (m[n] / (1 - b1**t)) / ((v[n] / (1 - b2**t)).sqrt() + tau)
            for n, p in zip(gw.names, gw.params):
                torch.testing.assert_close(p.detach(), x[n], rtol=1e-5, atol=1e-6)
    finally:
        gw.close()
    with pytest.raises(ValueError, match="Yogi: need lr > 0"):
        Yogi(make_model().parameters(), lr=0.0)


def test_fedavgm_is_sgd_momentum_on_the_mean_move_over_the_gateways_rate() -> None:
    lr, mu = 0.5, 0.9
    gw = two_edge_gateway(lambda ps: server_optimizer("sgd", ps, lr, momentum=mu), lr)
    try:
        x = {n: p.detach().clone() for n, p in zip(gw.names, gw.params)}
        buf: dict[str, torch.Tensor] = {}
        for g in rounds_of(gw, 3, seed=2):
            for n in x:
                grad = g[n] / lr  # what the buffered rule hands SGD: its step lands on the mean move
                buf[n] = grad if n not in buf else mu * buf[n] + grad
                x[n] = x[n] - lr * buf[n]
            for n, p in zip(gw.names, gw.params):
                torch.testing.assert_close(p.detach(), x[n], rtol=1e-5, atol=1e-6)
    finally:
        gw.close()


def test_edges_push_moves_unless_the_gateway_adds_momentum_of_its_own() -> None:
    params = list(make_model().parameters())
    assert edge_push(server_optimizer("sgd", params, 0.1)) == "step"
    assert edge_push(server_optimizer("sgd", params, 0.1, momentum=0.9)) == "gradient"
    assert edge_push(server_optimizer("adam", params, 0.01)) == "step"
    assert edge_push(server_optimizer("yogi", params, 0.01)) == "step"
    assert edge_push(None) == "gradient"  # hybrid: the cloud trainer's optimizer
    with pytest.raises(ValueError, match="gateway optimizer 'lamb' is not one of sgd, adam, yogi"):
        server_optimizer("lamb", params, 0.1)


def test_the_gateway_settings_build_the_optimizer_they_name() -> None:
    task = load_task("digits")
    for name, kind, lr in (
        ("sgd", torch.optim.SGD, task.lr),
        ("adam", torch.optim.Adam, 0.01),
        ("yogi", Yogi, 0.01),
    ):
        config = replace(
            CloudConfig(),
            mode="standalone",
            gateway=GatewaySettings(bind="tcp://127.0.0.1:0", optimizer=name),
        )
        gw = build_gateway(config, task)
        assert type(gw.optimizer) is kind
        assert gw.optimizer.param_groups[0]["lr"] == pytest.approx(lr)
        # Adaptive: the move itself is the pseudo-gradient; SGD: the move over its own rate.
        assert gw.weighting.scale(0) == pytest.approx(1.0 if name == "sgd" else task.lr)  # type: ignore[attr-defined]
    config = replace(
        CloudConfig(), mode="standalone", gateway=GatewaySettings(optimizer="adam", momentum=0.9)
    )
    assert "--gateway-momentum 0.9 is SGD's" in (contradictions(config) or "")
    with pytest.raises(ValueError, match="is SGD's"):
        build_gateway(config, task)
    hybrid = replace(CloudConfig(), mode="hybrid", gateway=GatewaySettings(optimizer="yogi"))
    assert "in hybrid mode the cloud trainer's optimizer" in (contradictions(hybrid) or "")
    assert contradictions(CloudConfig()) is None


def test_a_diverging_gateway_stops_before_serving_or_saving_the_broken_model(tmp_path: Path) -> None:
    model = make_model()
    checkpoints = GatewayCheckpoints(tmp_path / "ckpt", every_rounds=1, keep=3)
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=1e30),  # finite averages, an overflowing step
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        weighting=Buffered(edge_lr=1e30, gateway_lr=1e30, expected=1),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=1),
        checkpoints=checkpoints,
    )
    gw.bind()
    peer = Peer(gw, "a")
    peer.hello(gw.manifest)
    tiny = {n: torch.full_like(p, 1e-32) for n, p in zip(gw.names, gw.params)}
    assert peer.push(1, tiny).accepted
    gw.poll_once(0.0)
    assert gw.version == 1 and checkpoints.saved_version == 1
    good = {n: p.detach().clone() for n, p in zip(gw.names, gw.params)}
    served = gw.snapshot()
    huge = {n: torch.full_like(p, 1e30) for n, p in zip(gw.names, gw.params)}
    peer.send(
        Push(seq=2, base_version=1, layers=tuple(LayerGradient(n, Dense(g), 1) for n, g in huge.items()))
    )
    with pytest.raises(GatewayDiverged, match="round 2 made the model non-finite .* lower --gateway-lr"):
        for _ in range(500):  # the push arrives, quorum 1 closes the round at once
            gw.poll_once(0.01)
    assert gw.version == 1 and gw.snapshot() is served  # nothing new published
    gw.close()
    assert checkpoints.saved_version == 1  # the clean stop did not save the broken model
    peer.sock.close(linger=0)

    model2 = make_model()
    again = Gateway(
        model2,
        torch.optim.SGD(model2.parameters(), lr=0.1),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        checkpoints=GatewayCheckpoints(tmp_path / "ckpt", every_rounds=1, keep=3),
    )
    assert again.checkpoints is not None and again.restore() is not None
    assert again.version == 1
    for n, p in zip(again.names, again.params):
        torch.testing.assert_close(p.detach(), good[n], rtol=0, atol=0)
    again.close()


def probe_of(x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    def probe(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(x), y))

    return probe


def test_a_gateway_whose_loss_explodes_stops_before_serving_or_saving_the_model(tmp_path: Path) -> None:
    """A finite model can be ruined (a server step far too large): its loss on the probe exceeds ten
    times an untrained model's, so the round is neither published nor checkpointed."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=gen), torch.randint(0, 2, (64,), generator=gen)
    probe = probe_of(x, y)
    reference = probe(make_model())
    model = make_model()
    checkpoints = GatewayCheckpoints(tmp_path / "ckpt", every_rounds=1, keep=3)
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=1),
        checkpoints=checkpoints,
        watch=LossWatch(probe, reference, ratio=10.0, budget=1.0),
    )
    gw.bind()
    peer = Peer(gw, "a")
    peer.hello(gw.manifest)
    small = {n: 0.01 * torch.randn(p.shape, generator=gen) for n, p in zip(gw.names, gw.params)}
    assert peer.push(1, small).accepted
    gw.poll_once(0.0)
    assert gw.version == 1 and checkpoints.saved_version == 1
    assert gw.watch is not None and gw.watch.probes == 1 and gw.watch.last_loss < 2 * reference
    served = gw.snapshot()
    big = {n: 300 * torch.randn(p.shape, generator=gen) for n, p in zip(gw.names, gw.params)}
    peer.send(
        Push(seq=2, base_version=1, layers=tuple(LayerGradient(n, Dense(g), 1) for n, g in big.items()))
    )
    with pytest.raises(GatewayDiverged, match=r"round 2: the model's loss on the probe is .* over 10 times"):
        for _ in range(500):  # the push arrives, quorum 1 closes the round at once
            gw.poll_once(0.01)
    assert all(bool(torch.isfinite(p).all()) for p in gw.params)  # finite: only the loss tells
    assert gw.watch.last_loss > 10 * reference
    assert gw.version == 1 and gw.snapshot() is served  # nothing new published
    gw.close()
    assert checkpoints.saved_version == 1  # the clean stop did not save the ruined model
    peer.sock.close(linger=0)


def test_the_loss_watch_probes_within_its_share_of_time() -> None:
    now = [0.0]
    calls = []

    def probe(model: torch.nn.Module) -> float:
        calls.append(now[0])
        now[0] += 0.01  # a probe takes 10 ms
        return 1.0

    watch = LossWatch(probe, reference=1.0, ratio=10.0, budget=0.02, clock=lambda: now[0])
    model = make_model()
    assert watch.check(model) is None and len(calls) == 1  # the first version is always probed
    now[0] = 0.4  # 10 ms spent in 0.4 s: 2.5%, over the 2% budget
    assert watch.check(model) is None and len(calls) == 1
    now[0] = 0.5  # 2%: due again
    assert watch.check(model) is None and len(calls) == 2
    watch.probe = lambda m: float("nan")
    now[0] = 10.0
    assert "is nan" in (watch.check(model) or "")


def test_the_loss_watch_of_a_task_measures_an_untrained_model_and_leaves_the_random_state() -> None:
    task = load_task("digits")
    before = torch.random.get_rng_state()
    watch = LossWatch.for_task(task, 10.0)
    assert torch.equal(before, torch.random.get_rng_state())
    assert watch.reference == pytest.approx(2.303, abs=0.1)  # ln 10: chance level on ten classes
    assert f"{task.batch_size} test examples of digits" in watch.described
    for bad in (1.0, 0.5, float("inf")):
        with pytest.raises(ValueError, match="ratio must be a finite number above 1"):
            LossWatch(watch.probe, 1.0, ratio=bad)
    gw = build_gateway(replace(CloudConfig(), mode="standalone"), task)
    assert gw.watch is not None and gw.watch.ratio == GatewaySettings().max_loss_ratio == 10.0
    gw.close()
    off = build_gateway(replace(CloudConfig(), gateway=GatewaySettings(max_loss_ratio=0.0)), task)
    assert off.watch is None
    off.close()


def test_serve_refuses_contradictory_optimizer_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from elasticfed.common.cli import main

    assert main(["cloud", "serve", "--gateway-optimizer", "adam", "--gateway-momentum", "0.5"]) == 2
    assert "--gateway-momentum 0.5 is SGD's" in capsys.readouterr().err
    assert main(["cloud", "serve", "--gateway-max-loss-ratio", "0.5", "--print-config"]) == 2
    assert "must be 0 (off) or above 1, got 0.5" in capsys.readouterr().err


def test_a_gateway_restarted_with_another_optimizer_keeps_what_was_applied(tmp_path: Path) -> None:
    """Changing --gateway-optimizer between runs must not throw acknowledged work away: the model,
    version and verdicts come back, only the optimizer's state starts fresh."""
    checkpoints = GatewayCheckpoints(tmp_path / "ckpt", every_rounds=1, keep=3)
    first = two_edge_gateway(lambda ps: server_optimizer("sgd", ps, 0.5), 0.5, checkpoints=checkpoints)
    try:
        list(rounds_of(first, 2))
        saved = {n: p.detach().clone() for n, p in zip(first.names, first.params)}
    finally:
        first.close()
    model = make_model()
    again = Gateway(
        model,
        server_optimizer("adam", model.parameters(), 0.01),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        checkpoints=GatewayCheckpoints(tmp_path / "ckpt", every_rounds=1, keep=3),
    )
    try:
        assert again.checkpoints is not None and again.restore() is not None
        assert again.checkpoints.skipped == []
        assert again.version == 2 and set(again.clients) == {"a", "b"}
        for n, p in zip(again.names, again.params):
            torch.testing.assert_close(p.detach(), saved[n], rtol=0, atol=0)
        assert not again.optimizer.state  # type: ignore[union-attr]  # fresh moments
    finally:
        again.close()
