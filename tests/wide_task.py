"""A digits task whose model is several megabytes (a 1 M-parameter MLP): what a slow link must carry.

The 1024 x 1024 layer alone is a 4 MiB push and the model a 4.5 MB download:
at 5 Mbit/s each takes seconds, the regime the slow-link tests are about,
while a training step still takes milliseconds on a test machine.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from elasticfed.common.task import Task
from elasticfed.common.tasks import digits

HIDDEN = 1024


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10)
    )


def task() -> Task:
    return dataclasses.replace(digits.task(), name="wide-digits", build_model=build_model, lr=0.02)
