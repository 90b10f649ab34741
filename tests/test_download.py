"""Chunked model downloads and link pacing, without sockets; then the gateway's side over a real one.

`ModelDownload` and `LinkMeter` are pure: the session sends what they say and
feeds them what arrives, so every property here is checked by driving them by
hand: assembly, the byte budget, resumption after a lost connection (never from
zero), a version the gateway stopped serving, corrupt blobs, rates measured
from answer timings.  The gateway part drives `ModelFetch` by hand against a
real gateway, and checks the staleness admission that keeps a fleet with slow
downloads from stalling.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
import torch
from fleet import free_port, pumped
from test_gateway import Peer, grads_for
from torch import nn

from elasticfed.cloud.aggregation import DeadlineQuorum, MeanStep
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.edge.cache import GradientCache
from elasticfed.edge.compression import AutoCompression
from elasticfed.edge.download import ModelDownload
from elasticfed.edge.pacing import Backlog, LinkMeter, UploadCap
from elasticfed.edge.session import EdgeSession, SessionOptions
from elasticfed.protocol import Manifest, ModelChunk, ModelFetch, Reason, blob, decode, encode

CHUNK = 1024


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 7))  # 1,447 parameters


def served(model: nn.Module, version: int) -> tuple[Manifest, torch.Tensor, int]:
    manifest = Manifest.from_parameters(model.named_parameters())
    data = blob.pack(manifest, dict(model.named_parameters()))
    return manifest, data, blob.digest(data)


def answer(data: torch.Tensor, digest: int, version: int, offset: int, length: int) -> ModelChunk:
    """What a gateway sends for a request, through the codec (as it would come off the wire)."""
    end = min(len(data), offset + length)
    chunk = ModelChunk(
        version=version, size=len(data), digest=digest, offset=offset, data=data.numpy()[offset:end].data
    )
    msg = decode([bytes(f) for f in encode(chunk)])
    assert isinstance(msg, ModelChunk)
    return msg


def test_a_download_assembles_the_served_model_exactly_within_its_byte_budget() -> None:
    model = make_model()
    manifest, data, digest = served(model, 3)
    download = ModelDownload(manifest, CHUNK)
    download.start(3)
    finished = None
    now = 0.0
    while finished is None:
        asks = download.requests(budget_bytes=3 * CHUNK, now=now, reask_after_s=math.inf)
        assert asks, "a download that is not finished always has something to ask for"
        assert download.outstanding_bytes() <= 3 * CHUNK
        for version, offset, length in asks:
            assert version == 3 and offset % CHUNK == 0 and 0 < length <= CHUNK
            finished, _ = download.on_chunk(answer(data, digest, 3, offset, length), now)
        now += 0.1
    assert finished.version == 3 and finished.full
    params = dict(model.named_parameters())
    assert [layer.name for layer in finished.layers] == [spec.name for spec in manifest]
    for layer in finished.layers:
        assert torch.equal(layer.payload.tensor, params[layer.name].detach())
    assert download.stats.bytes == manifest.blob_bytes and download.stats.duplicates == 0
    assert not download.active
    # First request (t = 0) to the model assembled (the last batch, answered at `now` - 0.1):
    # what the edge tells the gateway, which mints versions no faster.
    assert download.last_fetch_s == pytest.approx(now - 0.1)


def test_a_lost_connection_asks_only_for_what_is_missing() -> None:
    manifest, data, digest = served(make_model(), 1)
    download = ModelDownload(manifest, CHUNK)
    download.start(1)
    got = 0
    finished = None
    cuts = 0
    while finished is None:
        asks = download.requests(budget_bytes=2 * CHUNK, now=0.0, reask_after_s=math.inf)
        # Only the first request of each batch is answered; then the connection goes.
        version, offset, length = asks[0]
        finished, _ = download.on_chunk(answer(data, digest, version, offset, length), 0.0)
        got += length
        if finished is None:
            download.connection_lost()
            cuts += 1
    assert cuts >= 3
    assert got == manifest.blob_bytes  # every byte came once: never restarted from zero
    assert download.stats.resumed == cuts and download.stats.restarts == 0


def test_requests_that_never_left_are_asked_again_on_the_same_connection() -> None:
    """A replaced connection refuses sends until its handshake (ZMQ_IMMEDIATE): over TCP nothing
    re-asks, so a request recorded as asked but never sent would stall the download for good
    (measured: 1.3 of 4.5 MB, then nothing for minutes after an outage)."""
    manifest, data, digest = served(make_model(), 1)
    download = ModelDownload(manifest, CHUNK)
    download.start(1)
    refused = download.requests(budget_bytes=3 * CHUNK, now=0.0, reask_after_s=math.inf)
    assert len(refused) == 3
    assert download.requests(budget_bytes=3 * CHUNK, now=1.0, reask_after_s=math.inf) == []
    for _version, offset, _length in refused:
        download.unasked(offset)
    assert download.outstanding_bytes() == 0
    again = download.requests(budget_bytes=3 * CHUNK, now=2.0, reask_after_s=math.inf)
    assert again == refused
    finished = None
    while finished is None:
        for version, offset, length in again:
            finished, _ = download.on_chunk(answer(data, digest, version, offset, length), 2.0)
        again = download.requests(budget_bytes=3 * CHUNK, now=2.0, reask_after_s=math.inf)
    assert download.stats.bytes == manifest.blob_bytes and download.stats.duplicates == 0


def test_a_version_the_gateway_no_longer_serves_starts_over_on_the_one_it_does() -> None:
    manifest, old, old_digest = served(make_model(0), 1)
    _, new, new_digest = served(make_model(1), 5)
    download = ModelDownload(manifest, CHUNK)
    download.start(1)
    first = download.requests(budget_bytes=CHUNK, now=0.0, reask_after_s=math.inf)[0]
    download.on_chunk(answer(old, old_digest, 1, first[1], first[2]), 0.0)
    second = download.requests(budget_bytes=CHUNK, now=0.0, reask_after_s=math.inf)[0]
    # Asked for version 1; the gateway forgot it and answers from version 5.
    finished, _ = download.on_chunk(answer(new, new_digest, 5, second[1], second[2]), 0.0)
    assert finished is None and download.version == 5 and download.stats.restarts == 1
    # A late chunk of version 1 changes nothing.
    download.on_chunk(answer(old, old_digest, 1, 0, CHUNK), 0.0)
    assert download.version == 5
    while finished is None:
        for version, offset, length in download.requests(4 * CHUNK, 0.0, math.inf):
            assert version == 5
            finished, _ = download.on_chunk(answer(new, new_digest, 5, offset, length), 0.0)
    assert finished.version == 5
    assert torch.equal(blob.pack(manifest, {x.name: x.payload.tensor for x in finished.layers}), new)


def test_a_blob_that_fails_its_digest_or_holds_nan_is_never_adopted() -> None:
    manifest, data, digest = served(make_model(), 2)
    download = ModelDownload(manifest, CHUNK)
    download.start(2)
    finished = None
    for _version, offset, length in download.requests(10**9, 0.0, math.inf):
        finished, _ = download.on_chunk(answer(data, digest ^ 1, 2, offset, length), 0.0)
    assert finished is None and download.stats.corrupt == 1 and download.active  # asked again
    poisoned = data.clone()
    poisoned[:4].view(torch.float32)[0] = float("nan")  # the first layer's first value
    download.start(2)
    for _version, offset, length in download.requests(10**9, 0.0, math.inf):
        finished, _ = download.on_chunk(answer(poisoned, blob.digest(poisoned), 2, offset, length), 0.0)
    assert finished is None and download.stats.corrupt == 2


def test_chunks_that_do_not_fit_are_ignored() -> None:
    manifest, data, digest = served(make_model(), 1)
    download = ModelDownload(manifest, CHUNK)
    download.start(1)
    download.requests(CHUNK, 0.0, math.inf)
    for bad in (
        answer(data, digest, 1, 10, CHUNK),  # not at a chunk boundary
        answer(data, digest, 1, 0, CHUNK - 1),  # short
    ):
        assert download.on_chunk(bad, 0.0) == (None, None)
    other_size = ModelChunk(version=1, size=len(data) + 8, digest=digest, offset=0, data=memoryview(b"x" * 8))
    assert download.on_chunk(other_size, 0.0) == (None, None)
    assert download.stats.chunks == 0


def test_requests_are_asked_again_only_after_the_re_ask_interval() -> None:
    manifest, _, _ = served(make_model(), 1)
    download = ModelDownload(manifest, CHUNK)
    download.start(1)
    asked = download.requests(2 * CHUNK, now=0.0, reask_after_s=1.0)
    assert len(asked) == 2
    assert download.requests(2 * CHUNK, now=0.5, reask_after_s=1.0) == []
    assert sorted(download.requests(2 * CHUNK, now=1.0, reask_after_s=1.0)) == sorted(asked)


def test_requests_asked_before_a_later_messages_answer_are_asked_again_at_once() -> None:
    """FIFO each way: an answer to a message sent after a request means the request's own answer
    is lost (the gateway could not send it, or refused the request), even over TCP."""
    manifest, _data, _digest = served(make_model(), 3)
    download = ModelDownload(manifest, CHUNK)
    download.start(3)
    first = download.requests(2 * CHUNK, 1.0, math.inf)
    second = download.requests(4 * CHUNK, 2.0, math.inf)
    assert len(first) == 2 and len(second) == 2
    # An answer to something sent at 2.0: the two asked at 1.0 are lost, those asked at 2.0 (the
    # same instant, perhaps sent just before it) are not.
    again = download.requests(4 * CHUNK, 3.0, math.inf, lost_before=2.0)
    assert again == first
    assert download.requests(4 * CHUNK, 3.5, math.inf, lost_before=2.0) == []  # asked at 3.0 now


def test_an_answer_to_a_chunk_asked_again_covers_only_its_first_ask() -> None:
    """Which copy an answer is to is unknown: counting it as the latest one's, a late answer to the
    first copy declared every request sent in between lost (asked again, and so on)."""
    manifest, data, digest = served(make_model(), 3)
    download = ModelDownload(manifest, CHUNK)
    download.start(3)
    assert [o for _, o, _ in download.requests(2 * CHUNK, 1.0, math.inf)] == [0, CHUNK]
    assert len(download.requests(2 * CHUNK, 2.0, math.inf, lost_before=1.5)) == 2  # both again
    download.on_chunk(answer(data, digest, 3, 0, CHUNK), 2.5)  # to the copy asked at 1.0, or 2.0
    assert download.answered_upto == 1.0
    later = download.requests(3 * CHUNK, 3.0, math.inf)
    assert later and all(offset >= 2 * CHUNK for _, offset, _ in later)
    download.on_chunk(answer(data, digest, 3, CHUNK, CHUNK), 3.5)
    reasks = download.stats.reasks
    assert all(o > 3 * CHUNK for _, o, _ in download.requests(3 * CHUNK, 4.0, math.inf))  # new ones
    assert download.stats.reasks == reasks  # nothing asked at 3.0 is lost
    # A request is counted lost only once `lost_after_s` old: a link that reorders a little.
    download = ModelDownload(manifest, CHUNK)
    download.start(3)
    assert [o for _, o, _ in download.requests(CHUNK, 1.0, math.inf)] == [0]
    assert [o for _, o, _ in download.requests(2 * CHUNK, 2.0, math.inf)] == [CHUNK]
    download.on_chunk(answer(data, digest, 3, CHUNK, CHUNK), 2.5)  # overtook the answer at 0
    assert download.answered_upto == 2.0
    assert 0 not in [o for _, o, _ in download.requests(2 * CHUNK, 2.6, math.inf, lost_after_s=2.0)]
    assert 0 in [o for _, o, _ in download.requests(2 * CHUNK, 3.1, math.inf, lost_after_s=2.0)]


def test_a_chunk_asked_more_than_once_does_not_time_the_link() -> None:
    """Karn's rule: an answer to a chunk asked twice may be to either ask.  Timed from the last,
    a chunk asked again just before its first answer came read as 20 Mbit/s on a 5 Mbit/s link
    (CI, stop 39), and the edge queued four times what the link could carry."""
    torch.manual_seed(0)
    big = 64 * 1024  # large enough to time (common.link.RATE_SAMPLE_MIN_BYTES)
    manifest, data, digest = served(nn.Linear(256, 256), 3)  # 263 KB: 5 chunks
    download = ModelDownload(manifest, big)
    download.start(3)
    rate = big / 0.5  # the link carries a chunk in half a second
    meter = LinkMeter(initial_bps=rate)
    assert [o for _, o, _ in download.requests(2 * big, 0.0, math.inf)] == [0, big]
    assert len(download.requests(2 * big, 0.9, math.inf, lost_before=0.8, lost_after_s=0.5)) == 2
    # The answers to the first asks: at the link's rate from 0.0, a moment after the second asks.
    for offset, at in ((0, 0.5), (big, 1.0)):
        _, asked = download.on_chunk(answer(data, digest, 3, offset, big), at)
        assert asked is not None and (asked.first, asked.last) == (0.0, 0.9)
        assert asked.timed_from is None
    # Asked once: timed from that ask, and the meter reads the link's rate, not more.
    later = download.requests(2 * big, 2.0, math.inf)
    assert [o for _, o, _ in later] == [2 * big, 3 * big]
    for k, (_, offset, length) in enumerate(later):
        _, asked = download.on_chunk(answer(data, digest, 3, offset, length), 2.5 + 0.5 * k)
        assert asked is not None and asked.timed_from == 2.0
        meter.answered(length, asked.timed_from, 2.5 + 0.5 * k)
    assert meter.measured and rate * 0.99 <= meter.rate <= rate * 1.01
    # What the session would have read timing the re-asked chunks from their last ask.
    wrong = LinkMeter(initial_bps=rate)
    wrong.answered(big, 0.9, 1.0)
    assert wrong.rate > 4 * rate


def test_requests_of_a_larger_layout_are_dropped_when_a_smaller_patch_replaces_it() -> None:
    """Kept, they were asked again at lengths of 0 and below (refused by the gateway as malformed)."""
    model = make_model()
    manifest, data, digest = served(model, 1)
    download = ModelDownload(manifest, CHUNK)
    download.hold(1, data)
    download.start(2)  # a patch from 1, of a size known once its first chunk comes

    def patch(version: int, size: int, offset: int) -> ModelChunk:
        body = bytes(min(CHUNK, size - offset))
        return ModelChunk(
            version=version, size=size, digest=7, offset=offset, data=body, base=1, model_digest=9,
            base_digest=digest,
        )  # fmt: skip

    assert download.requests(8 * CHUNK, 1.0, math.inf) == [(2, 0, CHUNK)]
    download.on_chunk(patch(2, 5 * CHUNK, 0), 1.1)
    assert len(download.requests(8 * CHUNK, 1.2, math.inf)) == 4  # chunks 1-4 of 5
    download.on_chunk(patch(3, 2 * CHUNK, 0), 1.3)  # version 3's patch, 2 chunks, replaces it
    assert download.chunks == 2 and download.outstanding_bytes() == CHUNK  # chunk 1 of 2, no more
    asked = download.requests(8 * CHUNK, 5.0, 1.0)  # everything outstanding is asked again
    assert asked == [(3, CHUNK, CHUNK)]


def test_each_download_counts_its_own_re_asks() -> None:
    # The session backs its probe off by this count while the downlink is unmeasured; patches
    # never measure it, and a count over every download pinned each one's first re-ask at
    # seconds (1 model in 6 versions at 30% loss).
    manifest, data, digest = served(make_model(), 1)
    download = ModelDownload(manifest, CHUNK)
    download.start(1)
    asked = download.requests(CHUNK, now=0.0, reask_after_s=1.0)
    assert download.requests(CHUNK, now=1.0, reask_after_s=1.0) == asked
    assert download.requests(CHUNK, now=2.0, reask_after_s=1.0) == asked
    assert download.reasked == 2
    download.start(2)
    assert download.reasked == 0
    assert download.stats.reasks == 2  # the statistic stays cumulative


def test_the_meter_measures_a_busy_fifo_link_and_ignores_idle_gaps() -> None:
    meter = LinkMeter(initial_bps=1e3)
    assert meter.budget(5000) == 256 * 1024  # the minimum, until measured
    rate = 1.25e6  # 10 Mbit/s
    size = 256 * 1024
    # Four messages sent at once: each answer comes one message's link time after the previous.
    for i in range(4):
        meter.answered(size, sent_at=0.0, now=0.05 + (i + 1) * size / rate)
    assert meter.rate == pytest.approx(rate, rel=0.2)
    # After an idle minute, one message: its gap holds the round trip too (a lower bound), ignored.
    meter.answered(size, sent_at=100.0, now=100.0 + 5 * size / rate)
    assert meter.rate == pytest.approx(rate, rel=0.2)
    assert meter.expected_s(int(rate)) == pytest.approx(1.0, rel=0.2)
    assert meter.budget(10 * 2**20) == 10 * 2**20  # one message larger than the budget still goes
    small = LinkMeter(initial_bps=1e3)
    small.answered(100, sent_at=0.0, now=1.0)  # a small answer times the round trip, not the link
    assert not small.measured


def test_small_pushes_in_a_busy_run_measure_the_link_and_a_probe_is_timed_alone() -> None:
    # Compressed pushes of 4 KB, sent back to back over 2 Mbit/s: none is worth timing alone (the
    # round trip), but together they are the edge's whole uplink and must measure it.
    meter = LinkMeter(initial_bps=1e3)
    rate, size = 2.5e5, 4096
    for i in range(40):
        meter.answered(size, sent_at=i * size / rate, now=0.02 + (i + 1) * size / rate)
    assert meter.measured and meter.rate == pytest.approx(rate, rel=0.2)
    # A probe starts a run of its own: what was sent before it (here slowly) is not mixed in.
    probe = LinkMeter(initial_bps=1e3)
    for i in range(20):  # one 4 KB push every 0.1 s, each answered 0.15 s later: 40 KB/s
        probe.answered(size, sent_at=i * 0.1, now=i * 0.1 + 0.15)
    assert probe.rate == pytest.approx(4.1e4, rel=0.15)
    probe.new_run(now=2.0)
    probe.answered(size, sent_at=1.5, now=2.05)  # sent before the probe: not timed
    for i in range(20):  # then 8 KB every 0.02 s, answered as the link carries them: 400 KB/s
        probe.answered(2 * size, sent_at=2.0 + i * 0.02, now=2.02 + i * 0.02)
    assert probe.rate == pytest.approx(4.1e5, rel=0.15)


def test_auto_compression_probes_for_a_faster_link_and_stops_when_it_finds_none() -> None:
    auto = AutoCompression()
    model, step = 26_000_000, 0.8  # the base text model, a step of 0.8 s
    first = auto.observe(2.7e5, step, model, now=0.0)  # 2.2 Mbit/s measured while the link was busy
    assert first.spec == "topk:0.003+int8" and not auto.probing
    assert auto.observe(2.7e5, step, model, now=9.9).spec == first.spec  # not yet
    probe = auto.observe(2.7e5, step, model, now=10.0)
    assert auto.probing and probe.ratio == pytest.approx(2 * first.ratio, rel=0.5)  # twice the budget
    assert auto.observe(2.7e5, step, model, now=10.5).spec == probe.spec
    assert auto.observe(5.4e5, step, model, now=11.0).spec == "topk:0.005+int8"  # settling: gain 1
    # The probe's run measured twice the rate: probe again at once; the link is free, so it grows.
    assert not auto.probing
    auto.observe(5.4e5, step, model, now=12.0)
    assert auto.probing and auto.probes == 2
    rate, now = 5.4e5, 12.0
    while auto.current.lossy and now < 60.0:
        now += 0.5
        rate = rate * 2 if auto.probing else rate  # the link carries whatever the edge sends
        auto.observe(rate, step, model, now=now)
    assert not auto.current.lossy, (now, auto.current.spec)  # dense on a free link within a minute
    # A link that is really that slow: one probe, no growth, the next only PROBE_EVERY_S later.
    slow = AutoCompression()
    slow.observe(2.7e5, step, model, now=0.0)
    slow.observe(2.7e5, step, model, now=10.0)
    for t in (11.0, 12.5, 20.0):
        slow.observe(2.7e5, step, model, now=t)
    assert slow.probes == 1 and not slow.probing
    slow.observe(2.7e5, step, model, now=22.5)
    assert slow.probes == 2


def test_a_small_answers_time_on_the_link_is_not_taken_for_the_round_trip() -> None:
    # 5 Mbit/s, a 2 ms path: a 30 KB patch takes 50 ms, mostly on the link.  Taken whole as the
    # round trip, it was subtracted from a 120 KB patch's 194 ms, which then read as 6.7 Mbit/s.
    rate, path = 6.25e5, 0.002
    meter = LinkMeter(initial_bps=1.25e5)
    meter.answered(30_000, sent_at=0.0, now=path + 30_000 / rate)
    meter.answered(120_000, sent_at=1.0, now=1.0 + path + 120_000 / rate)
    assert meter.measured and meter.rate <= rate * 1.02
    assert meter.rate >= rate * 0.95  # still the link's rate, not the 1 Mbit/s guess


def test_answers_that_come_in_a_bunch_never_read_as_a_faster_link() -> None:
    # Ten 1 MB pushes sent at once over 10 Mbit/s; their acks queued behind model chunks and
    # came within 10 ms of each other 8 s later.  Gaps between answers would say 1 GB/s.
    meter = LinkMeter(initial_bps=1e3)
    for i in range(10):
        meter.answered(1_000_000, sent_at=0.0, now=8.0 + i * 0.001)
    assert meter.measured and meter.rate <= 1.25e6 * 1.01
    # The link keeps busy: one push every 0.8 s, answered as it crosses.
    for i in range(30):
        meter.answered(1_000_000, sent_at=8.0 + i * 0.8, now=8.8 + i * 0.8)
    assert meter.rate == pytest.approx(1.25e6, rel=0.15)


def test_the_backlog_drains_at_the_measured_rate_without_waiting_for_answers() -> None:
    # An ack may wait seconds behind model chunks going the other way; the uplink is free
    # as soon as its bytes crossed, which the measured rate says.
    meter = LinkMeter(initial_bps=1e3)
    backlog = Backlog(meter)
    backlog.add(1_000_000, now=0.0)
    assert backlog.level(now=50.0) == 1_000_000  # unmeasured: only answers make room
    backlog.clear()  # a new connection: nothing of ours on it
    assert backlog.level(now=50.0) == 0.0
    meter.answered(256 * 1024, sent_at=50.0, now=50.0 + 256 * 1024 / 1.25e6)  # 10 Mbit/s
    backlog.add(2_500_000, now=100.0)
    backlog.add(1_250_000, now=101.0)  # one second later: one second's bytes crossed
    assert backlog.level(now=101.0) == pytest.approx(2_500_000, rel=0.01)
    assert backlog.level(now=102.0) == pytest.approx(1_250_000, rel=0.01)
    assert backlog.level(now=110.0) == 0.0  # never below empty


def test_the_upload_cap_holds_the_average_rate() -> None:
    cap = UploadCap(mbit=4.0, now=0.0)
    now, sent = 0.0, 0
    while now < 20.0:
        ready = cap.ready_at(300_000, now)
        now = max(now, ready)
        cap.take(300_000, now)
        sent += 300_000
    assert sent * 8 / 1e6 / now <= 4.0 * 1.05
    assert not UploadCap(0.0, 0.0).active
    with pytest.raises(ValueError, match="upload cap"):
        UploadCap(-1.0, 0.0)


# ---------------------------------------------------------------- the gateway's side


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    model = make_model()
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GatewayOptions(bind="tcp://127.0.0.1:0", model_versions_kept=2, max_chunk_bytes=2048),
        weighting=MeanStep(max_staleness=1),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=1),
    )
    gw.bind()
    yield gw
    gw.close()


def fetch(peer: Peer, version: int, offset: int, length: int) -> ModelChunk:
    peer.send(ModelFetch(version=version, offset=offset, length=length))
    chunk = peer.recv()
    assert isinstance(chunk, ModelChunk), chunk
    return chunk


def test_the_gateway_serves_slices_of_kept_versions_and_the_newest_for_a_forgotten_one(
    gateway: Gateway,
) -> None:
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    v0 = blob.pack(gateway.manifest, gateway.snapshot())
    chunk = fetch(peer, 0, 1024, 10**6)  # 0: the newest; the length is capped by max_chunk_bytes
    assert chunk.version == 0 and chunk.size == len(v0) and len(chunk.data) == 2048
    assert bytes(chunk.data) == v0.numpy()[1024:3072].tobytes() and chunk.digest == blob.digest(v0)
    for version in (1, 2, 3):
        assert peer.push(version, grads_for(gateway, 0.1), base=version - 1).accepted
        gateway.poll_once(0.0)
    assert gateway.served_version == 3
    # Two versions kept: 3 (newest) and 2; version 0 is gone, and its request gets version 3.
    assert fetch(peer, 2, 0, 1024).version == 2
    late = fetch(peer, 0 + 1, 0, 1024)
    assert late.version == 3
    assert fetch(peer, 3, len(v0) + 10, 1024).data.nbytes == 0  # past the end: nothing, no error


def test_a_version_an_edge_is_fetching_is_kept_while_newer_ones_come_and_go(gateway: Gateway) -> None:
    slow, fast = Peer(gateway, "slow"), Peer(gateway, "fast")
    slow.hello(gateway.manifest)
    fast.hello(gateway.manifest)
    assert fast.push(1, grads_for(gateway, 0.1), base=0).accepted
    gateway.poll_once(0.0)
    assert fetch(slow, 1, 0, 1024).version == 1
    for version in range(2, 7):  # two versions kept; five more published while "slow" fetches 1
        assert fast.push(version, grads_for(gateway, 0.1), base=version - 1).accepted
        gateway.poll_once(0.0)
        assert fetch(slow, 1, 1024, 1024).version == 1
    assert gateway.served_version == 6
    # Versions nobody fetched went first: 5 is gone (asking for it gets the newest), 1 and 6 stay.
    assert fetch(fast, 5, 0, 1024).version == 6
    assert fetch(slow, 1, 2048, 1024).version == 1


def test_pushes_of_an_edge_still_downloading_are_not_dropped_for_versions_it_could_not_have(
    gateway: Gateway,
) -> None:
    slow, fast = Peer(gateway, "slow"), Peer(gateway, "fast")
    slow.hello(gateway.manifest)
    fast.hello(gateway.manifest)
    for version in (1, 2, 3):  # the fleet moves on while "slow" downloads version 1, chunk by chunk
        assert fast.push(version, grads_for(gateway, 0.1), base=version - 1).accepted
        gateway.poll_once(0.0)
        assert fetch(slow, 1, 1024 * (version - 1), 1024).version == 1
    assert gateway.served_version == 3
    # Based on version 0 while downloading 1: 1 version it could have avoided (max_staleness 1).
    assert slow.push(1, grads_for(gateway, 0.1), base=0).accepted
    assert gateway.metrics.staleness.summary("slow")["max"] == 3  # weighed by its whole staleness
    # "fast" downloads nothing: 3 versions behind is too stale.
    stale = fast.push(4, grads_for(gateway, 0.1), base=0)
    assert not stale.accepted and stale.code == Reason.STALE.value
    # Nor is anything admitted beyond 4 x max_staleness, downloading or not.
    for version in range(4, 10):
        assert fast.push(version + 1, grads_for(gateway, 0.1), base=version - 1).accepted
        gateway.poll_once(0.0)
        fetch(slow, 1, 0, 1024)
    assert gateway.served_version >= 8
    far = slow.push(2, grads_for(gateway, 0.1), base=0)
    assert not far.accepted and far.code == Reason.STALE.value


def test_a_round_waits_for_the_download_time_an_edge_reports(gateway: Gateway) -> None:
    """Over a real socket: `fetch_ms` in an edge's request becomes the minimum open time of the rounds it
    contributes to (quorum 1 would otherwise close on its push at once)."""
    clock = [100.0]
    gateway.clock = lambda: clock[0]
    peer = Peer(gateway, "a")
    peer.hello(gateway.manifest)
    peer.send(ModelFetch(version=0, offset=0, length=1024, fetch_ms=3000))
    assert isinstance(peer.recv(), ModelChunk)
    assert peer.push(1, grads_for(gateway, 0.1), base=0).accepted
    gateway.poll_once(0.0)
    assert gateway.served_version == 0  # complete, but the edge needs 3 s to fetch a version
    clock[0] = 103.0
    gateway.poll_once(0.0)
    assert gateway.served_version == 1


def test_what_is_missing_bounds_the_wait_and_shrinks_as_chunks_come() -> None:
    # The re-ask timer waits for at most what is missing: a small model is asked again soon.
    manifest, data, digest = served(make_model(), 1)
    download = ModelDownload(manifest, CHUNK)
    assert download.missing_bytes() == 0  # nothing being downloaded
    download.start(1)
    assert download.missing_bytes() == manifest.blob_bytes
    (version, offset, length), *_ = download.requests(CHUNK, now=0.0, reask_after_s=1.0)
    download.on_chunk(answer(data, digest, version, offset, length), now=0.1)
    left = manifest.blob_bytes - length
    # An upper bound, by whole chunks: never below what is missing, at most one chunk above.
    assert left <= download.missing_bytes() < min(manifest.blob_bytes, left + CHUNK)


def test_a_patch_under_way_when_the_base_is_forgotten_goes_on_as_a_whole_model() -> None:
    """A new gateway instance welcomes the edge at the version it holds: no new download starts,
    but the patch under way asked from a base the edge no longer counts on."""
    old, new = make_model(0), make_model(1)
    manifest, old_data, old_digest = served(old, 55)
    download = ModelDownload(manifest, CHUNK)
    download.start(55)
    finished = None
    while finished is None:
        for _version, offset, length in download.requests(4 * CHUNK, 0.0, math.inf):
            finished, _ = download.on_chunk(answer(old_data, old_digest, 55, offset, length), 0.0)
    download.start(56)  # a patch from 55
    assert download.base == 55
    download.forget_public()
    # What the session asks the gateway for (ModelFetch.base): a whole model now, never a patch
    # from the forgotten base, whose chunks this edge would refuse, and ask again, forever.
    assert download.base == 0 and download.active and download.size == manifest.blob_bytes
    _, data, digest = served(new, 56)
    finished = None
    for _ in range(100):
        for version, offset, length in download.requests(4 * CHUNK, 1.0, math.inf):
            assert version == 56
            finished, _ = download.on_chunk(answer(data, digest, 56, offset, length), 1.0)
        if finished is not None:
            break
    assert finished is not None and finished.version == 56 and download.base == 0
    params = dict(new.named_parameters())
    for layer in finished.layers:
        assert torch.equal(layer.payload.tensor, params[layer.name].detach())


def test_model_requests_the_gateway_refused_are_asked_again_on_a_live_connection() -> None:
    """A gateway that cannot answer a request (its rate limit here; a full queue to the edge is
    the same) leaves it unanswered on a live connection: the heartbeats' answers show it lost.

    Before, over TCP only a new connection asked again, and heartbeats kept the connection alive:
    an edge waited forever for a model (this test: 61 requests refused, no model in 60 s)."""
    model = nn.Linear(128, 128)  # 66 KB: 65 requests of 1 KiB
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        GatewayOptions(bind=f"tcp://127.0.0.1:{free_port()}", rate_messages_per_s=100, rate_burst=4),
        weighting=MeanStep(max_staleness=1),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=1),
    )
    named = list(model.named_parameters())
    options = SessionOptions(
        gateway=gw.options.bind, client_id="e", heartbeat_s=0.05, liveness=40, model_chunk_bytes=1024
    )
    cache = GradientCache([[(n, tuple(p.shape), p.dtype) for n, p in named]])
    # It says it holds version 7; the gateway serves 0: the whole model comes down.
    session = EdgeSession(options, Manifest.from_parameters(named), cache, model_version=7)
    with pumped(gw):
        session.start()
        try:
            deadline = time.monotonic() + 60
            while session.have_version != 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # a poll with a deadline: the session has no event for it
            refused = gw.metrics.rejected.get("e", Reason.RATE_LIMITED.value)
            assert refused > 0, "the rate limit refused nothing: the test shows nothing"
            assert session.have_version == 0, (session.status(), refused)
            received = session.take_model()
            assert received is not None and received.version == 0
            for layer in received.layers:
                assert torch.equal(layer.payload.tensor, dict(named)[layer.name].detach())
        finally:
            session.close()
