"""Gateway checkpoints: resume bit-exactly, keep de-duplication across a restart, skip torn files."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from fleet import Proc, free_port
from test_gateway import Peer, grads_for, make_model

from elasticfed.cloud.aggregation import DeadlineQuorum
from elasticfed.cloud.clients import ClientState
from elasticfed.cloud.durability import GatewayCheckpoints, GatewayState, StepCounts, decode, encode
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.common.checkpoint import CheckpointError
from elasticfed.protocol import Welcome


def gateway_with(directory: Path, every: int = 1) -> tuple[Gateway, GatewayCheckpoints]:
    model = make_model()
    checkpoints = GatewayCheckpoints(str(directory), every_rounds=every, keep=3)
    gw = Gateway(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        rounds=DeadlineQuorum(deadline_s=60.0, quorum=1),
        checkpoints=checkpoints,
    )
    return gw, checkpoints


def play_round(gw: Gateway, peer: Peer, seq: int, value: float) -> None:
    assert peer.push(seq, grads_for(gw, value), base=gw.version).accepted
    gw.maybe_close_round()


def params(gw: Gateway) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in zip(gw.names, gw.params)}


def test_a_restarted_gateway_resumes_bit_exactly_and_remembers_what_it_applied(tmp_path: Path) -> None:
    first, _ = gateway_with(tmp_path)
    first.bind()
    peer = Peer(first, "a")
    assert isinstance(peer.hello(first.manifest), Welcome)
    for seq, value in ((1, 0.1), (2, -0.3)):
        play_round(first, peer, seq, value)
    saved = params(first)
    first.close()

    second, checkpoints = gateway_with(tmp_path)
    assert second.restore() is not None
    assert second.version == first.version == 2 and second.open.number == 3
    assert all(torch.equal(saved[n], p) for n, p in params(second).items())
    second.bind()
    peer = Peer(second, "a")
    assert isinstance(peer.hello(second.manifest), Welcome)
    replay = peer.push(2, grads_for(second, -0.3), base=1)  # applied before the restart
    assert replay.accepted and replay.detail == "answered before; not applied again"
    # One more round on both: the optimizer's momentum came back too.
    play_round(second, peer, 3, 0.2)
    resumed = params(second)
    second.close()

    third, checkpoints = gateway_with(tmp_path / "reference")
    third.bind()
    peer = Peer(third, "a")
    peer.hello(third.manifest)
    for seq, value in ((1, 0.1), (2, -0.3), (3, 0.2)):
        play_round(third, peer, seq, value)
    assert all(torch.equal(resumed[n], p) for n, p in params(third).items())
    third.close()


@pytest.mark.parametrize("damage", ["truncate", "random", "other_model"])
def test_a_torn_or_foreign_newest_checkpoint_is_skipped_for_the_previous_good_one(
    tmp_path: Path, damage: str
) -> None:
    first, checkpoints = gateway_with(tmp_path)
    first.bind()
    peer = Peer(first, "a")
    peer.hello(first.manifest)
    play_round(first, peer, 1, 0.1)
    good = params(first)
    play_round(first, peer, 2, 0.5)
    newest = checkpoints.last_saved
    assert newest is not None
    first.close()
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "random":
        newest.write_bytes(torch.randint(0, 256, (len(data),), dtype=torch.uint8).numpy().tobytes())
    else:  # a checkpoint of another model under the newest name
        other = torch.nn.Linear(2, 2)
        from elasticfed.common.checkpoint import write_tensors

        write_tensors(
            newest, {"model/weight": other.weight.detach()}, {"manifest": "x"}, kind="elasticfed-gateway"
        )

    second, checkpoints = gateway_with(tmp_path)
    resumed_from = second.restore()
    assert resumed_from is not None and resumed_from != newest and second.version == 1
    assert all(torch.equal(good[n], p) for n, p in params(second).items())
    assert [p for p, _ in checkpoints.skipped] == [newest]
    why = checkpoints.skipped[0][1]
    assert str(newest) in why
    expected = {"truncate": "truncated", "random": "not a safetensors file", "other_model": "another model"}
    assert expected[damage] in why, why


def test_cloud_serve_resumes_and_says_from_where(tmp_path: Path) -> None:
    def serve() -> tuple[Proc, dict]:
        argv = [
            sys.executable, "-m", "elasticfed.common.cli", "cloud", "serve", "--mode", "standalone",
            "--insecure",
            "--gateway-bind", f"tcp://127.0.0.1:{free_port()}", "--gateway-checkpoint-dir", str(tmp_path),
            "--gateway-checkpoint-every-rounds", "1", "--log-level", "warning",
        ]  # fmt: skip
        proc = Proc(argv, "gateway")
        return proc, proc.wait_for(lambda e: e.get("event") == "ready", 60, "ready")

    proc, ready = serve()
    assert ready["resumed_from"] is None and ready["version"] == 0
    from scripted import ScriptedDevice

    from elasticfed.common.tasks.digits import build_model
    from elasticfed.protocol import Manifest

    manifest = Manifest.from_parameters(build_model().named_parameters())
    dev = ScriptedDevice(ready["endpoint"], "a", manifest)
    dev.hello()
    dev.push({s.name: torch.full(s.shape, 0.01) for s in manifest})
    dev.wait_version(1)
    dev.close()
    proc.signal(signal.SIGTERM)
    assert proc.summary(30)["version"] == 1
    proc, ready = serve()
    assert ready["version"] == 1 and ready["resumed_from"].endswith(".safetensors"), json.dumps(ready)
    proc.signal(signal.SIGTERM)
    proc.summary(30)


def test_a_checkpoint_from_before_resolved_below_took_the_wires_name_restores_it() -> None:
    client = ClientState("cam", b"r", resolved_below=7)
    client.record(8, "", 0, 3)
    state = GatewayState(
        manifest="m",
        model={"w": torch.zeros(2)},
        optimizer_tensors={},
        optimizer_meta={},
        version=3,
        round=4,
        epoch=3,
        clients={"cam": client},
        lineage={},
        applied_steps=StepCounts.empty(),
    )
    tensors, meta = encode(state)
    assert meta["clients"]["cam"]["resolved_below"] == 7
    meta["clients"]["cam"]["floor"] = meta["clients"]["cam"].pop("resolved_below")  # as written before
    restored = decode(tensors, meta).clients["cam"]
    assert restored.resolved_below == 7 and restored.verdicts == {8: ("", 0, 3)}


def test_the_applied_step_history_is_a_table_in_the_checkpoint_and_old_maps_still_load() -> None:
    """10,000 devices x 101 layer names as JSON made each checkpoint's metadata 1 M entries, checked
    and written on the serving thread (1 s at 5,000 devices); now one int64 tensor."""
    client = ClientState("cam", route=b"")
    counts = {"cam": [3, 0], "dev-2": [1, 4]}
    state = GatewayState(
        manifest="m",
        model={"w": torch.zeros(2)},
        optimizer_tensors={"opt/w": torch.ones(2)},
        optimizer_meta={},
        version=3,
        round=4,
        epoch=3,
        clients={"cam": client},
        lineage={},
        applied_steps=StepCounts.of(("w", "b"), counts),
    )
    tensors, meta = encode(state)
    assert "applied_steps" not in meta and meta["applied_steps_index"]["clients"] == ["cam", "dev-2"]
    restored = decode(tensors, meta)
    assert restored.applied_steps.by_client() == {"cam": {"w": 3}, "dev-2": {"w": 1, "b": 4}}
    assert set(restored.optimizer_tensors) == {"opt/w"}  # the table is not optimizer state
    # Written before the table: client -> layer -> count in the JSON.
    del meta["applied_steps_index"], tensors["audit/applied_steps"]
    meta["applied_steps"] = {"cam": {"w": 3}, "dev-2": {"w": 1, "b": 4}}
    assert decode(tensors, meta).applied_steps.by_client() == restored.applied_steps.by_client()
    # A table that does not match its index, or counts below 0, is refused, saying so.
    tensors, meta = encode(state)
    tensors["audit/applied_steps"] = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(CheckpointError, match="applied steps"):
        decode(tensors, meta)
    tensors["audit/applied_steps"] = -torch.ones(2, 2, dtype=torch.int64)
    with pytest.raises(CheckpointError, match="negative"):
        decode(tensors, meta)
