"""The embedded default task: 8x8 handwritten digits (scikit-learn), a small MLP.

Small enough to train in seconds on a laptop CPU, real enough that a broken
sync shows in the accuracy.  The test split is a fixed, stratified 20%.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elasticfed.common.task import Task

TEST_SHARE = 0.2
SPLIT_SEED = 0


@lru_cache(maxsize=1)
def _split() -> tuple[TensorDataset, TensorDataset]:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # scikit-learn is the `demo` extra
        raise ImportError("the digits task needs scikit-learn: pip install 'elasticfed[demo]'") from exc
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_SHARE, random_state=SPLIT_SEED, stratify=y
    )
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def task() -> Task:
    return Task(
        name="digits",
        build_model=build_model,
        train_set=lambda: _split()[0],
        test_set=lambda: _split()[1],
        batch_size=32,
        lr=0.05,
        momentum=0.9,
    )
