"""What a user plugs in on every role: model, data, loss and evaluation, as `module:function`.

The function takes no arguments and returns a `Task`.  The digits task
(`common.tasks.digits:task`) is the embedded default and goes through exactly
this path; it is not a special case anywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset


def accuracy(model: nn.Module, data: Dataset, batch_size: int = 512) -> float:
    """Share of examples whose arg-max output is the label (models with one logits output)."""
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
    right = total = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            right += int((model(x).argmax(dim=1) == y).sum())
            total += len(y)
    model.train(was_training)
    return right / max(total, 1)


@dataclass(frozen=True)
class Task:
    """A training task: every field is a callable so nothing heavy happens at import time."""

    name: str
    build_model: Callable[[], nn.Module]
    train_set: Callable[[], Dataset]
    test_set: Callable[[], Dataset]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy
    evaluate: Callable[[nn.Module, Dataset], float] = accuracy
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9


class TaskError(ValueError):
    """A task spec could not be loaded; the message says which part and why."""


def load_task(spec: str) -> Task:
    """Import `package.module:function` and call it; the result must be a Task."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"task {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise TaskError(f"task {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise TaskError(f"task {spec!r}: {attr!r} is not callable")
    task = factory()
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r}: {attr}() returned {type(task).__name__}, expected common.task.Task")
    return task


def shard(data: Dataset, index: int, parts: int, partition: str = "iid", seed: int = 0) -> Dataset:
    """Part `index` of `parts` of a labelled data set, the way a fleet's devices would hold it.

    `iid`: a seeded shuffle cut into equal parts.  `shards`: examples sorted by
    label, cut into 2 x parts slices, and each device gets two of them, so most
    devices see two or three classes (McMahan et al.'s non-IID split).
    """
    if not 0 <= index < parts:
        raise ValueError(f"shard {index} of {parts} does not exist")
    n = len(data)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    if partition == "iid":
        order = torch.randperm(n, generator=gen)
        return torch.utils.data.Subset(data, order[index::parts].tolist())
    if partition != "shards":
        raise ValueError(f"partition {partition!r} is not iid or shards")
    labels = torch.tensor([int(data[i][1]) for i in range(n)])
    by_label = torch.argsort(labels * n + torch.randperm(n, generator=gen), stable=True)
    slices = torch.tensor_split(by_label, 2 * parts)
    pick = torch.randperm(2 * parts, generator=torch.Generator().manual_seed(seed + 1))
    mine = torch.cat([slices[int(pick[2 * index])], slices[int(pick[2 * index + 1])]])
    return torch.utils.data.Subset(data, mine.tolist())
