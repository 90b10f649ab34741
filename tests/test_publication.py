"""Downlink patches: every edge holds the gateway's public model bit for bit, and it stays near x_global.

`PublicModel` (cloud/publication.py) is driven by hand against `ModelDownload`
(edge/download.py), the edge's real assembly code, with every chunk going
through the codec as it would off the wire; then a real gateway and two edges
over a link that loses and duplicates messages.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from fleet import gateway_thread, train_digits
from torch import nn

from elasticfed.cloud.gateway import Gateway
from elasticfed.cloud.publication import PublicModel, downlink_ratio
from elasticfed.common.link import Faults
from elasticfed.common.task import load_task
from elasticfed.edge.agent import ElasticEdge
from elasticfed.edge.download import ModelDownload
from elasticfed.edge.session import SessionOptions
from elasticfed.protocol import LayerTensor, Manifest, ModelChunk, ModelPatch, blob, decode, encode
from elasticfed.protocol.payload import Dense, Sparse

CHUNK = 4096
TASK = load_task("elasticfed.common.tasks.digits:task")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 70,001 entries in one layer: patches straddle the sparse encoding's 65,536-entry blocks.
    return nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 7), nn.Linear(1, 70_001))


class Server:
    """What the gateway does with a `ModelFetch` (cloud/gateway.py), minus the socket."""

    def __init__(self, model: nn.Module, ratio: float, history: int = 32) -> None:
        self.model = model
        self.manifest = Manifest.from_parameters(model.named_parameters())
        self.public = PublicModel(self.manifest, ratio, history)
        self.version = 0
        self.sent = {"patch": 0, "snapshot": 0}
        self.publish()

    def publish(self) -> None:
        self.version += 1
        self.served = self.public.advance(self.version, blob.pack(self.manifest, self.global_params()))

    def global_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def step(self, gen: torch.Generator, scale: float = 0.01) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * scale)
        self.publish()

    def answer(self, version: int, offset: int, length: int, base: int, base_digest: int) -> ModelChunk:
        patch = self.public.patch(base, base_digest, self.version)
        if patch is not None:
            data, digest, kind = patch.data, patch.digest, "patch"
        else:
            data, digest, kind, base, base_digest = self.served, self.public.digest, "snapshot", 0, 0
        end = min(len(data), offset + length)
        self.sent[kind] += end - offset
        chunk = ModelChunk(
            version=self.version,
            size=len(data),
            digest=digest,
            offset=offset,
            data=data.numpy()[offset:end].data,
            base=base,
            model_digest=self.public.digest,
            base_digest=base_digest,
        )
        msg = decode([bytes(f) for f in encode(chunk)])
        assert isinstance(msg, ModelChunk)
        return msg


def fetch(server: Server, download: ModelDownload, whole: bool = False) -> None:
    """Bring `download` to the server's newest version, as the session would (one under way, as a
    refused patch leaves, goes on)."""
    if not download.active:
        download.start(server.version, whole=whole)
    for _ in range(1000):
        for version, offset, length in download.requests(8 * CHUNK, 0.0, math.inf):
            model, _ = download.on_chunk(
                server.answer(version, offset, length, download.base, download.base_digest), 0.0
            )
            if model is not None:
                assert model.version == server.version
                return
    raise AssertionError("the download never finished")


def test_edges_that_apply_patches_hold_the_public_model_bit_for_bit_and_it_stays_near_the_global() -> None:
    server = Server(make_model(), ratio=0.05)
    every, fifth = ModelDownload(server.manifest, CHUNK), ModelDownload(server.manifest, CHUNK)
    fetch(server, every)
    fetch(server, fifth)
    dense = server.manifest.blob_bytes
    gen = torch.Generator().manual_seed(1)
    distances = []
    for v in range(2, 42):
        server.step(gen)
        distances.append(server.public.distance)
        before = server.sent["patch"]
        fetch(server, every)
        assert server.sent["patch"] - before < 0.1 * dense  # 5% of entries at 6 bytes against 4
        assert torch.equal(every.public, server.served) and every.public_version == v
        if v % 5 == 0:
            fetch(server, fifth)
            assert torch.equal(fifth.public, server.served)
    assert every.stats.snapshots == 1 and every.stats.patches == 40 and every.stats.patch_failures == 0
    assert fifth.stats.snapshots == 1 and fifth.stats.patches == 8
    # Error feedback on the model: x_public trails x_global by a bounded distance, not a growing one.
    assert 0 < max(distances) < 0.05, distances
    assert max(distances[20:]) < 1.5 * max(distances[10:20]), distances


def test_a_ratio_of_one_makes_the_public_model_the_global_one() -> None:
    server = Server(make_model(), ratio=1.0)
    download = ModelDownload(server.manifest, CHUNK)
    fetch(server, download)
    server.step(torch.Generator().manual_seed(2))
    fetch(server, download)
    # Every entry changed: a patch would outgrow the model, which comes whole.
    assert server.public.distance == 0.0 and download.stats.snapshots == 2
    assert torch.equal(download.public, blob.pack(server.manifest, server.global_params()))


def test_an_edge_behind_the_history_or_a_patch_larger_than_the_model_gets_a_snapshot() -> None:
    server = Server(make_model(), ratio=0.05, history=4)
    download = ModelDownload(server.manifest, CHUNK)
    fetch(server, download)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):  # five versions on: the changes since the edge's are no longer all known
        server.step(gen)
    assert server.public.patch(download.public_version, download.public_digest, server.version) is None
    fetch(server, download)
    assert download.stats.snapshots == 2 and torch.equal(download.public, server.served)

    wide = Server(make_model(), ratio=0.5)  # two versions of half the entries: 75% changed
    download = ModelDownload(wide.manifest, CHUNK)
    fetch(wide, download)
    wide.step(gen)
    assert (
        wide.public.patch(download.public_version, download.public_digest, wide.version) is not None
    )  # 50%: 3 of 4 bytes
    wide.step(gen)
    assert wide.public.patch(download.public_version, download.public_digest, wide.version) is None
    fetch(wide, download)
    assert download.stats.snapshots == 2 and torch.equal(download.public, wide.served)


def hostile(server: Server, download: ModelDownload, patch_blob: torch.Tensor) -> list[ModelChunk]:
    """A gateway's answers carrying `patch_blob` as the patch to its newest model, digest and all."""
    return [
        ModelChunk(
            version=server.version,
            size=len(patch_blob),
            digest=blob.digest(patch_blob),
            offset=offset,
            data=patch_blob.numpy()[offset : offset + CHUNK].data,
            base=download.public_version,
            model_digest=server.public.digest,
            base_digest=download.public_digest,
        )
        for offset in range(0, len(patch_blob), CHUNK)
    ]


@pytest.mark.parametrize("fault", ["wrong_value", "wrong_version", "garbage", "index_out_of_range"])
def test_a_patch_that_does_not_make_the_gateways_model_is_refused_and_the_model_fetched_whole(
    fault: str,
) -> None:
    server = Server(make_model(), ratio=0.05)
    download = ModelDownload(server.manifest, CHUNK)
    fetch(server, download)
    held = download.public.clone()
    server.step(torch.Generator().manual_seed(4))
    patch = server.public.patch(download.public_version, download.public_digest, server.version)
    assert patch is not None
    msg = ModelPatch(base=download.public_version, version=server.version, layers=())
    frames = blob.unframe(patch.data, 64)
    good = decode([bytes(f) for f in frames], manifest=server.manifest)
    assert isinstance(good, ModelPatch)
    if fault == "wrong_value":
        first = good.layers[0].payload
        assert isinstance(first, Sparse)
        values = first.values.tensor.clone()
        values[0] += 1.0
        layers = (LayerTensor(good.layers[0].name, replace(first, values=Dense(values))), *good.layers[1:])
        bad = blob.frame(encode(replace(good, layers=layers)))
    elif fault == "wrong_version":
        bad = blob.frame(encode(replace(good, version=server.version - 1)))
    elif fault == "garbage":
        bad = patch.data.clone()
        bad[-1] ^= 0xFF  # the digest is recomputed: only the patch's own checks can catch it
        bad[:4] = torch.tensor([200, 0, 0, 0], dtype=torch.uint8)  # 200 frames claimed
    else:
        wrong = LayerTensor(
            "2.bias", Sparse.from_indices(torch.tensor([70_001]), Dense(torch.zeros(1)), (70_001,))
        )
        bad = blob.frame(encode(replace(msg, layers=(wrong,))))
    download.start(server.version)
    download.requests(8 * CHUNK, 0.0, math.inf)
    for chunk in hostile(server, download, bad):
        model, _ = download.on_chunk(chunk, 0.0)
        assert model is None
    assert download.stats.patch_failures == 1
    assert torch.equal(download.public, held)  # what the edge held is untouched
    assert download.base_digest == 0  # the next request is for the model whole
    fetch(server, download)
    assert download.stats.snapshots == 2 and torch.equal(download.public, server.served)


def test_a_chunk_of_a_patch_from_another_base_is_ignored() -> None:
    server = Server(make_model(), ratio=0.05)
    download = ModelDownload(server.manifest, CHUNK)
    fetch(server, download)
    server.step(torch.Generator().manual_seed(5))
    download.start(server.version)
    patch = server.public.patch(download.public_version, download.public_digest, server.version)
    assert patch is not None
    chunk = hostile(server, download, patch.data)[0]
    for stray in (
        replace(chunk, base=download.public_version + 7),
        replace(chunk, base_digest=download.public_digest ^ 1),  # the same version of another model
        replace(chunk, base_digest=0),  # a whole model's chunk, of a patch's size
    ):
        assert download.on_chunk(stray, 0.0) == (None, None)
    assert download.active and download.stats.patch_failures == 0


def test_an_edge_that_built_the_seed_model_gets_its_first_model_as_a_patch() -> None:
    server = Server(make_model(), ratio=0.05)
    seed = server.served  # version 1: the model as built, whole
    same, other = ModelDownload(server.manifest, CHUNK), ModelDownload(server.manifest, CHUNK)
    same.hold(server.version, seed.clone())
    # A model of the same shapes from another seed: not the gateway's.
    other.hold(server.version, blob.pack(server.manifest, dict(make_model(seed=9).named_parameters())))
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        server.step(gen)
    fetch(server, same)
    assert same.stats.snapshots == 0 and same.stats.patches == 1
    assert (
        server.sent["snapshot"] == 0 and 0 < server.sent["patch"] < 0.25 * server.manifest.blob_bytes
    )  # 3 x 5% at 6 bytes
    assert torch.equal(same.public, server.served) and same.held() == (server.version, server.public.digest)
    # The other seed's digest is not the gateway's version 1: it is answered whole, and follows on.
    fetch(server, other)
    assert other.stats.snapshots == 1 and other.stats.patch_failures == 0
    assert torch.equal(other.public, server.served)
    server.step(gen)
    fetch(server, other)
    assert other.stats.patches == 1 and torch.equal(other.public, server.served)


def test_a_held_model_must_be_a_blob_of_the_manifest() -> None:
    server = Server(make_model(), ratio=0.05)
    download = ModelDownload(server.manifest, CHUNK)
    with pytest.raises(ValueError, match="blob of this manifest"):
        download.hold(0, server.served[:-4])
    with pytest.raises(ValueError, match="blob of this manifest"):
        download.hold(0, server.served.view(torch.float32))


def test_downlink_spec() -> None:
    assert downlink_ratio("full") == 0.0 and downlink_ratio("topk:0.05") == 0.05
    for bad in ("topk:0", "topk:1.5", "topk:x", "delta", ""):
        with pytest.raises(ValueError, match="full or topk"):
            downlink_ratio(bad)


def lossy_edge(gateway: Gateway, model: nn.Module, name: str, seed: int) -> ElasticEdge:
    """An edge over a link that loses and duplicates a fifth of its messages each way."""
    return ElasticEdge(
        model,
        SessionOptions(
            gateway=gateway.bound_endpoint,
            client_id=name,
            timeout_s=0.1,
            heartbeat_s=0.2,
            faults=Faults.parse(f"loss=0.2,duplicate=0.2,seed={seed}"),
            state_dir="",
        ),
    )


def test_edges_over_a_lossy_link_hold_the_gateways_public_model_of_their_version() -> None:
    with gateway_thread(quorum=1, round_deadline_s=0.2, model_versions_kept=1024) as gateway:
        edges = [lossy_edge(gateway, TASK.build_model(), f"e{i}", i) for i in range(2)]
        for i, agent in enumerate(edges):
            train_digits(agent, 3.0, i, parts=2)
        for agent in edges:
            agent.close(drain_s=0.0)
        served = gateway.status()["metrics"]["gateway_model_served_bytes_total"]
        for agent in edges:
            download = agent.session.download
            assert download.stats.patches >= 3 and download.stats.patch_failures == 0, download.stats
            assert download.public is not None
            assert gateway.served_digest(download.public_version) == blob.digest(download.public)
    assert served["kind=patch"] > 0 and gateway.public is not None


def seeded(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TASK.build_model()


def test_an_edge_built_from_the_gateways_seed_never_downloads_a_whole_model() -> None:
    """The gateway's first version is its seed model (seed 0 by default, as the edge's): an edge
    that built the same holds it, and every model it gets, the first included, is a patch."""
    with gateway_thread(quorum=1, round_deadline_s=0.2, model_versions_kept=1024) as gateway:
        edges = [lossy_edge(gateway, seeded(seed), f"seed{seed}", seed) for seed in (0, 1)]
        for i, agent in enumerate(edges):
            train_digits(agent, 2.0, i, parts=2)
        for agent in edges:
            agent.close(drain_s=0.0)
        served = gateway.status()["metrics"]["gateway_model_served_bytes_total"]
        same, other = (agent.session.download for agent in edges)
        assert same.stats.patches >= 2 and same.stats.snapshots == 0, same.stats
        # Another seed's model is no version of the gateway's: its first model comes whole.
        assert other.stats.snapshots >= 1 and other.stats.patch_failures == 0, other.stats
        for download in (same, other):
            assert download.public is not None
            assert gateway.served_digest(download.public_version) == blob.digest(download.public)
        # Only the other edge's snapshots went whole (a lossy link may ask a chunk twice).
        dense = same.manifest.blob_bytes
        assert served["kind=snapshot"] >= other.stats.snapshots * dense
        assert served["kind=snapshot"] <= 2 * other.stats.snapshots * dense
