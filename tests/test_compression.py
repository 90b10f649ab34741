"""Uplink compression with error feedback: what the wire carries, what stays, and that nothing is lost.

The mass audit: for every unit, what the gateway applied + what it refused +
what the edge still holds (residual, pending, in flight) equals the sum of every
step-gradient the edge produced, through loss, duplicates, an outage and a restart.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fleet import gateway_thread, train_digits

from elasticfed.common import topk
from elasticfed.common.checkpoint import CheckpointError
from elasticfed.common.link import Faults
from elasticfed.common.task import load_task
from elasticfed.common.topk import largest_magnitudes
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.cache import GradientCache
from elasticfed.edge.compression import INT8_CHUNK, AutoCompression, UplinkCompression, quantize
from elasticfed.edge.persistence import MASS_AUDIT_FILE, read_mass_audit, write_mass_audit
from elasticfed.edge.session import SessionOptions
from elasticfed.protocol import LayerGradient, Push, Sparse, decode, encode
from elasticfed.protocol.payload import payload_bytes

TASK = load_task("elasticfed.common.tasks.digits:task")
SPECS = ["fp16", "int8", "topk:0.01", "topk:0.01+fp16", "topk:0.01+int8"]


def test_specs_parse_to_one_canonical_name_and_say_what_they_send() -> None:
    assert UplinkCompression.parse(" TopK:0.010+INT8 ").spec == "topk:0.01+int8"
    assert not UplinkCompression.parse("none").lossy
    assert UplinkCompression.parse("int8").encodings == {"int8"}
    assert UplinkCompression.parse("topk:0.1+int8").encodings == {"sparse", "dense"}
    for bad in ("topk:0", "topk:2", "topk:nan", "topk:0.1+fp8", "gzip"):
        with pytest.raises(ValueError, match="compression"):
            UplinkCompression.parse(bad)


def test_auto_picks_the_densest_encoding_whose_push_takes_a_quarter_of_a_step() -> None:
    auto = UplinkCompression.parse("auto")
    assert isinstance(auto, AutoCompression) and auto.current.spec == "int8"  # until measured
    model = 10_000_000  # bytes, dense: 8 s at 10 Mbit/s
    link = 1.25e6  # 10 Mbit/s
    assert auto.observe(link, 32.0, model).spec == "none"  # a quarter step is as long as a dense push
    assert auto.observe(link, 16.0, model).spec == "fp16"
    assert auto.observe(link, 10.0, model).spec == "int8"
    assert auto.observe(link, 8.0, model).spec == "topk:0.2+int8"  # below int8: top-k, at most 0.25
    # A Jetson's 50 ms step: a push every 0.2 s at most, a quarter of it on the link: 62 KB.
    assert auto.observe(link, 0.05, model).spec == "topk:0.008+int8"
    assert auto.observe(4e5, 0.05, model).spec == "topk:0.003+int8"  # 3.2 Mbit/s
    assert auto.observe(1e5, 0.05, model).spec == "topk:0.001+int8"  # 0.8 Mbit/s: the floor
    assert auto.observe(1e9, 0.05, model).spec == "none"  # a data-centre link
    x = torch.randn(1000)
    payload = auto.encode(x, (1000,))
    assert torch.equal(payload.to_dense(), x) and payload.tensor.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(3,), (64, 65), (300, 300), (1, 70_001)])
def test_the_predicted_bytes_are_the_bytes_sent(spec: str, shape: tuple[int, ...]) -> None:
    # Pacing and credit work from the prediction before a push exists; it must be exact.
    policy = UplinkCompression.parse(spec)
    x = torch.randn(math.prod(shape))
    payload = policy.encode(x, shape)
    assert payload_bytes(payload) == policy.wire_bytes(x.numel(), 4)
    frames = encode(Push(seq=1, base_version=0, layers=(LayerGradient("w", payload),)))
    assert sum(len(memoryview(f)) for f in frames[1:]) == payload_bytes(payload)


def test_topk_keeps_exactly_the_largest_entries() -> None:
    x = torch.randn(10_000) * 0.01
    big = torch.randperm(10_000)[:100]
    x[big] = torch.randn(100).sign() * (1 + torch.rand(100))
    payload = UplinkCompression.parse("topk:0.01").encode(x, (100, 100))
    assert isinstance(payload, Sparse)
    assert torch.equal(payload.indices(), big.sort().values)
    assert torch.equal(payload.to_dense().view(-1)[big], x[big])


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("kind", ["gaussian", "heavy-tailed", "mostly-zero"])
def test_the_sampled_threshold_keeps_what_an_exact_topk_keeps(ratio: float, kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    n = 300_000  # past the sampled path's floor
    x = torch.randn(n, generator=gen)
    if kind == "heavy-tailed":
        x = x / torch.rand(n, generator=gen).clamp_min(1e-3)
    elif kind == "mostly-zero":  # an embedding's gradient: rows nobody used are zero (ties)
        x[torch.rand(n, generator=gen) < 0.995] = 0.0
    k = math.ceil(ratio * n)
    got = largest_magnitudes(x, k)
    want = torch.topk(x.abs(), k).values
    assert got.numel() == k and bool((got[1:] > got[:-1]).all())  # sorted, unique
    assert torch.equal(x[got].abs().sort(descending=True).values, want)


def test_a_sample_that_misses_the_large_entries_falls_back_to_the_exact_topk() -> None:
    n, k = 300_000, 3000
    largest_magnitudes(torch.randn(n), k)  # fixes the sampled positions for this size
    sampled = topk._samples[n]
    x = torch.rand(n) * 0.5
    x[sampled] = 1.0 + torch.rand(sampled.numel())  # the sample sees only the largest: too few above
    got = largest_magnitudes(x, k)
    assert torch.equal(got, torch.topk(x.abs(), k).indices.sort().values)


def test_int8_error_is_at_most_half_a_step_of_its_chunk() -> None:
    x = torch.randn(5 * INT8_CHUNK + 17) * torch.logspace(-3, 2, 5 * INT8_CHUNK + 17)
    q = quantize(x, (x.numel(),))
    err = (q.to_dense() - x).abs()
    step = q.scales.repeat_interleave(INT8_CHUNK)[: x.numel()]
    assert bool((err <= step / 2 + 1e-6 * x.abs()).all())


def _cache(spec: str, audit: bool = True) -> GradientCache:
    layers = [("a.weight", (40, 30), torch.float32), ("a.bias", (40,), torch.float32)]
    return GradientCache(
        [layers, [("b.weight", (70_000,), torch.float32)]],
        compression=UplinkCompression.parse(spec),
        audit=audit,
    )


def _frames(cache: GradientCache, u: int) -> list[bytes]:
    flight = cache.units[u].flight
    assert flight is not None and flight.payloads is not None
    layers = tuple(LayerGradient(n, p, flight.count) for n, p in zip(cache.units[u].names, flight.payloads))
    return [
        bytes(memoryview(f).cast("B")) for f in encode(Push(seq=flight.seq, base_version=0, layers=layers))
    ]


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_loses_nothing_and_a_flight_never_changes_while_unanswered(spec: str) -> None:
    cache = _cache(spec)
    gen = torch.Generator().manual_seed(1)
    sent = [torch.zeros(u.numel, dtype=torch.float64) for u in cache.units]
    seq = 1
    for step in range(40):
        for u, unit in enumerate(cache.units):
            cache.add(u, [torch.randn(s, generator=gen) for s in unit.shapes], base_version=0)
        if step % 3 == 2:
            for u in range(len(cache.units)):
                flight = cache.take(u, seq, 0.0, 1.0)
                assert flight is not None
                seq += 1
                before = _frames(cache, u)
                # More training, more takes of other units: the unanswered flight's bytes stay.
                cache.add(u, [torch.randn(s, generator=gen) for s in cache.units[u].shapes], base_version=0)
                assert _frames(cache, u) == before
                decoded = decode(before)
                assert torch.equal(
                    torch.cat([layer.payload.to_dense().reshape(-1) for layer in decoded.layers]),
                    flight.buffer,
                )
                sent[u] += flight.buffer.double()
                cache.resolve(u)
    for u in range(len(cache.units)):
        mass = cache.mass(u)
        assert mass["residual"].abs().sum() > 0  # compression left something behind
        total = sent[u] + mass["residual"] + mass["pending"] + mass["flight"] + mass["dropped"]
        assert torch.allclose(total, mass["produced"], atol=1e-4, rtol=1e-5), (
            (total - mass["produced"]).abs().max()
        )


def test_the_mass_audit_file_holds_what_the_cache_says_and_a_damaged_one_is_refused(tmp_path: Path) -> None:
    cache = _cache("topk:0.01+int8")
    gen = torch.Generator().manual_seed(2)
    for u, unit in enumerate(cache.units):
        cache.add(u, [torch.randn(s, generator=gen) for s in unit.shapes], base_version=0)
    assert cache.take(1, 1, 0.0, 1.0) is not None
    path = tmp_path / MASS_AUDIT_FILE
    write_mass_audit(cache, path)
    units = read_mass_audit(path)
    assert [names for names, _ in units] == [list(unit.names) for unit in cache.units]
    for u, (_, mass) in enumerate(units):
        for part, tensor in cache.mass(u).items():
            assert torch.equal(mass[part], tensor), (u, part)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(path)):
        read_mass_audit(path)


def test_compressed_pushes_are_a_hundredth_of_dense_for_topk_one_percent_int8() -> None:
    cache = _cache("topk:0.01+int8")
    cache.add(1, [torch.randn(70_000)], base_version=0)
    flight = cache.take(1, 1, 0.0, 1.0)
    assert flight is not None
    assert 70_000 * 4 / flight.wire_bytes >= 100


def edge(endpoint: str, state_dir: Path, faults: str, spec: str) -> ElasticEdge:
    torch.manual_seed(0)
    return ElasticEdge(
        TASK.build_model(),
        SessionOptions(
            gateway=endpoint,
            client_id="e0",
            timeout_s=0.1,
            heartbeat_s=0.2,
            reconnect_first_s=0.05,
            reconnect_cap_s=0.5,
            faults=Faults.parse(faults),
            state_dir=str(state_dir),
            persist_every_s=0.5,
        ),
        compression=spec,
        audit=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["topk:0.01+int8", "int8"])
def test_mass_audit_through_loss_duplicates_an_outage_and_a_restart(tmp_path: Path, spec: str) -> None:
    faults = "loss=0.2,duplicate=0.2,reorder=0.1,outage=1.5+2,seed=3"
    with gateway_thread(quorum=1, round_deadline_s=0.2, max_staleness=1000, audit_mass=True) as gateway:
        first = edge(gateway.bound_endpoint, tmp_path, faults, spec)
        train_digits(first, 4.0)
        first.close(drain_s=0.0)  # stopped with flights unanswered: they are saved and re-sent
        unanswered = first.cache.undelivered()
        residual = [u.residual.clone() for u in first.cache.units]
        again = edge(gateway.bound_endpoint, tmp_path, "loss=0.2,duplicate=0.2,seed=4", spec)
        assert again.session.state is not None and again.session.state.loaded is not None
        assert again.cache.undelivered() == unanswered
        for unit, saved in zip(again.cache.units, residual):  # the residual is durable state
            assert unit.residual is not None and torch.equal(unit.residual, saved)
        train_digits(again, 3.0, shard_index=1)
        assert again.close(drain_s=60.0), again.status()["undelivered_steps"]
    status = gateway.status()
    applied = gateway.applied_mass("e0")
    link = again.status()["link_up"]
    assert link["lost"] > 0 and link["duplicated"] > 0  # the faults were felt
    assert status["metrics"]["gateway_duplicates_total"]  # and duplicates reached the gateway
    worst = 0.0
    for u, unit in enumerate(again.cache.units):
        mass = again.cache.mass(u)
        gateway_side = torch.cat([applied[name] for name in unit.names])
        total = gateway_side + mass["dropped"] + mass["residual"] + mass["pending"] + mass["flight"]
        scale = mass["produced"].abs().max().item()
        worst = max(worst, (total - mass["produced"]).abs().max().item() / scale)
        assert mass["residual"].abs().sum() > 0
    assert worst < 1e-5, worst
