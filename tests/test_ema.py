"""The model a gateway reports: the moving average of its published versions (cloud/ema.py), by
hand, through a real gateway's rounds (edges still get the live model), and across a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticfed.cloud.config import CloudConfig, GatewaySettings
from elasticfed.cloud.durability import GatewayCheckpoints, decode
from elasticfed.cloud.ema import ModelEma
from elasticfed.cloud.gateway import Gateway, GatewayOptions
from elasticfed.cloud.server_optimizers import server_optimizer
from elasticfed.common import config as cfg
from elasticfed.common.checkpoint import CheckpointError, read_tensors
from tests.test_gateway import make_model
from tests.test_server_optimizers import rounds_of, two_edge_gateway


def test_the_average_by_hand() -> None:
    ema = ModelEma(window=4)
    for v in (1.0, 2.0, 3.0, 0.0):  # until `window` versions were seen: the newest
        ema.update({"w": torch.tensor([v])})
        torch.testing.assert_close(ema.tensors["w"], torch.tensor([v]))
    ema.update({"w": torch.tensor([11.0])})  # then decay (1 + 0) / (10 + 0): 9/10 of the new one
    torch.testing.assert_close(ema.tensors["w"], torch.tensor([9.9]))
    ema.update({"w": torch.tensor([21.0])})  # decay 2/11
    torch.testing.assert_close(ema.tensors["w"], torch.tensor([(2 * 9.9 + 9 * 21.0) / 11]))
    for _ in range(40):
        ema.update({"w": torch.tensor([1.0])})
    assert ema.count == 46 and ema.decay() == pytest.approx(0.75)  # capped at 1 - 1/window
    before = float(ema.tensors["w"])
    ema.update({"w": torch.tensor([5.0])})
    assert float(ema.tensors["w"]) == pytest.approx(0.75 * before + 0.25 * 5.0)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="whole number of versions >= 1"):
            ModelEma(bad)  # type: ignore[arg-type]


def test_a_gateway_reports_the_average_and_serves_edges_the_live_model() -> None:
    gw = two_edge_gateway(lambda ps: server_optimizer("sgd", ps, 1.0), 1.0, ema=ModelEma(window=3))
    try:
        by_hand = ModelEma(window=3)
        lives = []
        for _ in rounds_of(gw, 8):
            live = {n: p.detach().clone() for n, p in zip(gw.names, gw.params)}
            by_hand.update(live)
            lives.append(live)
        averaged = gw.averaged()
        for n in gw.names:
            torch.testing.assert_close(averaged[n], by_hand.tensors[n])
            assert not torch.equal(averaged[n], lives[-1][n])  # it is not the live model
            torch.testing.assert_close(gw.snapshot()[n], lives[-1][n])  # what is served stays live
        averaged[gw.names[0]].add_(1.0)  # a copy: the caller cannot change the average
        torch.testing.assert_close(gw.averaged()[gw.names[0]], by_hand.tensors[gw.names[0]])
    finally:
        gw.close()


def test_a_gateway_without_an_average_reports_its_live_model() -> None:
    gw = two_edge_gateway(lambda ps: server_optimizer("sgd", ps, 1.0), 1.0)
    try:
        list(rounds_of(gw, 2))
        for n, p in zip(gw.names, gw.params):
            torch.testing.assert_close(gw.averaged()[n], p.detach())
    finally:
        gw.close()


def restored(tmp_path: Path) -> Gateway:
    """A fresh gateway with an average, restored from tmp_path/ckpt."""
    model = make_model()
    gw = Gateway(
        model,
        server_optimizer("sgd", model.parameters(), 1.0),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        checkpoints=GatewayCheckpoints(str(tmp_path / "ckpt"), every_rounds=1, keep=3),
        ema=ModelEma(window=5),
    )
    assert gw.checkpoints is not None and gw.restore() is not None
    return gw


def test_the_average_is_saved_and_restored_with_the_gateway(tmp_path: Path) -> None:
    first = two_edge_gateway(
        lambda ps: server_optimizer("sgd", ps, 1.0),
        1.0,
        ema=ModelEma(window=5),
        checkpoints=GatewayCheckpoints(str(tmp_path / "ckpt"), every_rounds=1, keep=3),
    )
    try:
        list(rounds_of(first, 4))
        saved, count = first.averaged(), first.ema.count  # type: ignore[union-attr]
    finally:
        first.close()
    again = restored(tmp_path)
    try:
        assert again.checkpoints is not None and again.checkpoints.skipped == [] and again.version == 4
        assert again.ema is not None and again.ema.count == count
        for n in again.names:
            torch.testing.assert_close(again.averaged()[n], saved[n], rtol=0, atol=0)
        newest = again.checkpoints.store.entries()[0]  # type: ignore[union-attr]
    finally:
        again.close()
    # A checkpoint whose average does not fit the model is skipped with a message naming it.
    bad = make_model()
    with torch.no_grad():
        for p in bad.parameters():
            p.zero_()
    tampered = Gateway(
        bad,
        server_optimizer("sgd", bad.parameters(), 1.0),
        GatewayOptions(bind="tcp://127.0.0.1:0"),
        ema=ModelEma(window=5),
    )
    try:
        tensors, meta = read_tensors(newest, "elasticfed-gateway")
        meta["ema_count"] = 0
        with pytest.raises(CheckpointError, match="ema_count must be a whole number >= 1"):
            tampered.adopt(decode(tensors, meta))
        for p in tampered.params:
            assert not p.detach().any()  # nothing was loaded from the refused file
    finally:
        tampered.close()


def test_the_average_is_a_gateway_setting_on_by_default() -> None:
    assert GatewaySettings().ema_window == 50
    assert cfg.load(CloudConfig, None, {"gateway.ema_window": "0"}).gateway.ema_window == 0
    with pytest.raises(cfg.ConfigError, match="--gateway-ema-window: must be >= 0"):
        cfg.load(CloudConfig, None, {"gateway.ema_window": "-1"})


def test_a_low_precision_model_is_averaged_in_float32() -> None:
    # At a weight of 1/1000 per version a bf16 average stalls once the steps fall below its
    # precision (8 bits: around 0.3 here); in float32 it reaches the model's value.
    ema = ModelEma(window=1000)
    for _ in range(1000):  # the window's first versions: the average is the newest, 0
        ema.update({"w": torch.zeros(3, dtype=torch.bfloat16)})
    for _ in range(4000):
        ema.update({"w": torch.ones(3, dtype=torch.bfloat16)})
    assert ema.tensors["w"].dtype == torch.float32
    assert float(ema.tensors["w"].min()) > 0.9


def test_a_checkpoint_without_an_average_starts_one_from_the_restored_model(tmp_path: Path) -> None:
    first = two_edge_gateway(
        lambda ps: server_optimizer("sgd", ps, 1.0),
        1.0,
        checkpoints=GatewayCheckpoints(str(tmp_path / "ckpt"), every_rounds=1, keep=3),
    )
    try:
        list(rounds_of(first, 2))
        live = {n: p.detach().clone() for n, p in zip(first.names, first.params)}
    finally:
        first.close()
    again = restored(tmp_path)
    try:
        assert again.checkpoints is not None and again.checkpoints.skipped == []
        assert again.ema is not None and again.ema.count == 0
        for n in again.names:
            torch.testing.assert_close(again.averaged()[n], live[n], rtol=0, atol=0)
    finally:
        again.close()
