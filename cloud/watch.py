"""The gateway's loss watch: a model whose loss exploded is neither served nor saved.

A model can stay finite and still be ruined: a server learning rate or momentum too
large for the task (issue 20 measured 0.0% next-byte accuracy from FedAvgM's 0.9 on a
transformer) sends the loss far above where training started.  Edges would adopt it,
train from it and push gradients of it, and a checkpoint would make it durable.  The
non-finite check (cloud/gateway.py) cannot see this, so the gateway also measures the
loss of each new version on a fixed probe of the task's held-out data, against the
loss of an untrained model of the task on the same probe (chance level), and stops
applying once it exceeds `ratio` times that.  No real training goes there: the loss
falls from chance level, and a model that leans to a few classes under skewed data
stays within a few times it; ten times chance is a model that predicts confidently
and wrongly everywhere.

The probe is one training batch of the task's test data, so it costs one training step's
forward pass.  So that it never slows the gateway down, a version
is probed only when the time spent probing stays under `budget` of the time since the
watch started (2%: on digits every version is probed; on a transformer whose rounds
close faster than 50 probes, some versions are served unprobed, and the next probe
catches an explosion within about 50 probe-times).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from elasticfed.common.task import Task


class LossWatch:
    """Answers, for a model about to be served, why it must not be (its loss exploded), or None."""

    def __init__(
        self,
        probe: Callable[[nn.Module], float],
        reference: float,
        ratio: float = 10.0,
        budget: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        described: str = "the probe",
    ) -> None:
        if not ratio > 1.0 or not math.isfinite(ratio):
            raise ValueError(f"the loss ratio must be a finite number above 1, got {ratio}")
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"the probing budget must be a share of time in (0, 1], got {budget}")
        if not reference > 0.0 or not math.isfinite(reference):
            raise ValueError(f"the untrained model's loss must be finite and above 0, got {reference}")
        self.probe = probe
        self.reference = reference
        self.ratio = ratio
        self.budget = budget
        self.clock = clock
        self.described = described
        self.started = clock()
        self.spent = 0.0  # seconds spent probing
        self.probes = 0
        self.last_loss: float | None = None

    @classmethod
    def for_task(cls, task: Task, ratio: float, examples: int = 0) -> LossWatch:
        """A probe of the task's first `examples` test examples (0: one training batch, so a probe
        costs a training step's forward pass); the reference is an untrained model of the task (built
        under a fixed seed, leaving the caller's random state as it was)."""
        data = task.test_set()
        n = min(examples or task.batch_size, len(data))  # type: ignore[arg-type]
        if n == 0:
            raise ValueError(f"task {task.name!r}: the test set is empty: nothing for the loss watch")
        xs, ys = zip(*(data[i] for i in range(n)))
        x = torch.stack([torch.as_tensor(v) for v in xs])
        y = torch.stack([torch.as_tensor(v) for v in ys])

        def probe(model: nn.Module) -> float:
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    return float(task.loss(model(x), y))
            finally:
                model.train(was_training)

        with torch.random.fork_rng():
            torch.manual_seed(0)
            untrained = task.build_model()
        return cls(probe, probe(untrained), ratio, described=f"{n} test examples of {task.name}")

    def due(self) -> bool:
        return self.probes == 0 or self.spent <= self.budget * (self.clock() - self.started)

    def check(self, model: nn.Module) -> str | None:
        """Why `model` must not be served (its loss exploded), or None (fine, or not probed now)."""
        if not self.due():
            return None
        began = self.clock()
        loss = self.probe(model)
        self.spent += self.clock() - began
        self.probes += 1
        self.last_loss = loss
        if math.isfinite(loss) and loss <= self.ratio * self.reference:
            return None
        return (
            f"the model's loss on {self.described} is {loss:.4g}, over {self.ratio:g} times an "
            f"untrained model's ({self.reference:.4g})"
        )
