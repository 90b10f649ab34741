"""How a fleet's devices split a task's data: IID parts, or non-IID (label shards, Dirichlet label or
quantity skew)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from elasticfed.common.task import shard

LABELS = torch.arange(400) % 10
DATA = TensorDataset(torch.arange(400).float().unsqueeze(1), LABELS)


def indices(part: torch.utils.data.Subset) -> list[int]:
    return list(part.indices)


@pytest.mark.parametrize("partition", ["iid", "shards"])
def test_parts_are_disjoint_and_cover_the_data(partition: str) -> None:
    parts = [indices(shard(DATA, i, 4, partition, seed=3)) for i in range(4)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(400))
    assert all(len(p) == 100 for p in parts)
    assert parts == [indices(shard(DATA, i, 4, partition, seed=3)) for i in range(4)]  # seeded


def test_iid_parts_see_every_class_and_shards_only_a_few() -> None:
    for i in range(4):
        iid = {int(LABELS[j]) for j in indices(shard(DATA, i, 4, "iid"))}
        non_iid = {int(LABELS[j]) for j in indices(shard(DATA, i, 4, "shards"))}
        assert len(iid) == 10
        assert len(non_iid) <= 4


def test_bad_shard_requests_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="shard 4 of 4 does not exist"):
        shard(DATA, 4, 4)
    with pytest.raises(ValueError, match="partition 'dirichlet' is not one of"):
        shard(DATA, 0, 4, "dirichlet")
    for bad in ("dirichlet:0", "dirichlet:-1", "quantity:x", "dirichlet:inf", "dirichlet:nan"):
        with pytest.raises(ValueError, match=f"partition '{bad}': alpha must be a number above 0"):
            shard(DATA, 0, 4, bad)
    with pytest.raises(ValueError, match="fewer than 10 of 400 examples"):
        shard(DATA, 0, 30, "quantity:0.01")  # 30 parts of 13: a draw this skewed starves some


BIG_LABELS = torch.arange(2000) % 10
BIG = TensorDataset(torch.zeros(2000, 1), BIG_LABELS)


def label_shares(part: torch.utils.data.Subset) -> torch.Tensor:
    counts = torch.bincount(BIG_LABELS[torch.tensor(part.indices)], minlength=10).double()
    return counts / counts.sum()


@pytest.mark.parametrize("spec", ["dirichlet:0.1", "dirichlet:100", "quantity:0.5", "quantity:100"])
def test_dirichlet_parts_are_disjoint_cover_the_data_and_are_seeded(spec: str) -> None:
    parts = [indices(shard(BIG, i, 8, spec, seed=5)) for i in range(8)]
    assert sorted(i for p in parts for i in p) == list(range(2000))
    assert min(len(p) for p in parts) >= 10
    assert parts == [indices(shard(BIG, i, 8, spec, seed=5)) for i in range(8)]
    assert parts != [indices(shard(BIG, i, 8, spec, seed=6)) for i in range(8)]
    torch.manual_seed(1)
    before = torch.rand(1)
    torch.manual_seed(1)
    shard(BIG, 0, 8, spec, seed=5)
    assert torch.equal(torch.rand(1), before)  # the caller's random stream is left as it was


def test_dirichlet_alpha_sets_the_label_skew() -> None:
    """Total variation from the global label mix: alpha 0.1 far (one or two classes dominate), 100 near."""

    def mean_tv(spec: str) -> float:
        return sum(float((label_shares(shard(BIG, i, 8, spec)) - 0.1).abs().sum()) / 2 for i in range(8)) / 8

    strong, weak = mean_tv("dirichlet:0.1"), mean_tv("dirichlet:100")
    assert strong > 0.6, strong
    assert weak < 0.1, weak
    top2 = [float(label_shares(shard(BIG, i, 8, "dirichlet:0.1")).topk(2).values.sum()) for i in range(8)]
    assert sum(t > 0.6 for t in top2) >= 6, top2


def test_quantity_skew_varies_sizes_not_labels() -> None:
    sizes = [len(shard(BIG, i, 8, "quantity:0.5").indices) for i in range(8)]
    assert max(sizes) > 3 * min(sizes), sizes
    for i in range(8):
        part = shard(BIG, i, 8, "quantity:0.5")
        if len(part.indices) >= 200:  # large enough that an IID sample sees every class near 10%
            assert float((label_shares(part) - 0.1).abs().max()) < 0.07


def test_configs_check_the_partition_when_they_load() -> None:
    from elasticfed.cloud.config import DemoConfig
    from elasticfed.common import config as cfg
    from elasticfed.edge.config import EdgeConfig

    assert cfg.load(EdgeConfig, None, {"train.partition": "dirichlet:0.1"}).train.partition == "dirichlet:0.1"
    assert cfg.load(DemoConfig, None, {"partition": "quantity:1"}).partition == "quantity:1"
    with pytest.raises(cfg.ConfigError, match=r"--train-partition.*alpha must be a number above 0"):
        cfg.load(EdgeConfig, None, {"train.partition": "dirichlet:0"})
    with pytest.raises(cfg.ConfigError, match=r"partition.*'labels' is not one of"):
        cfg.load(DemoConfig, None, {"partition": "labels"})
