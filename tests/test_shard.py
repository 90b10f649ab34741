"""How a fleet's devices split a task's data: IID parts, or non-IID label shards."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from common.task import shard

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
    with pytest.raises(ValueError, match="partition 'dirichlet'"):
        shard(DATA, 0, 4, "dirichlet")
