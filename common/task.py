"""What a user plugs in on every role: model, data, loss and evaluation, as `module:function`.

The function takes no arguments and returns a `Task`.  The embedded tasks
(common/tasks/) go through exactly this path; their short names (`digits`,
`stdlib-lm`, `stdlib-lm-base`) only spell their `module:function`.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset

from elasticfed.common.tasks import BUILT_IN


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


def percent(value: float) -> str:
    return f"{value:.2%}"


@dataclass(frozen=True)
class Task:
    """A training task: every field is a callable so nothing heavy happens at import time.

    `evaluate` returns the task's own figure, named `metric` (`metric_label` on
    narrow lines); reports print it with `format_metric` and its direction.
    `sample(model)`, when given, returns a few bytes the model generates (a
    language model's way of showing what it learnt).
    """

    name: str
    build_model: Callable[[], nn.Module]
    train_set: Callable[[], Dataset]
    test_set: Callable[[], Dataset]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy
    evaluate: Callable[[nn.Module, Dataset], float] = accuracy
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    metric: str = "accuracy"
    metric_label: str = "acc"
    higher_is_better: bool = True
    format_metric: Callable[[float], str] = percent
    sample: Callable[[nn.Module], bytes] | None = None

    @property
    def direction(self) -> str:
        return "higher is better" if self.higher_is_better else "lower is better"

    def describe(self, value: float) -> str:
        """E.g. 'accuracy 95.00% (higher is better)': the figure, never without its name and direction."""
        return f"{self.metric.replace('_', ' ')} {self.format_metric(value)} ({self.direction})"

    def figures(self, value: float) -> dict[str, object]:
        """JSON fields naming the figure: the value under the metric's own name, and which way is better."""
        return {"metric": self.metric, self.metric: value, "metric_higher_is_better": self.higher_is_better}


class TaskError(ValueError):
    """A task spec could not be loaded; the message says which part and why."""


def load_task(spec: str) -> Task:
    """A built-in's short name, or `package.module:function` to import and call; the result must be a Task."""
    if ":" not in spec:
        if spec not in BUILT_IN:
            raise TaskError(
                f"task {spec!r}: not a built-in task ({', '.join(BUILT_IN)}) nor 'package.module:function'"
            )
        spec = BUILT_IN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task {spec!r}: expected 'package.module:function'")
    if module_name.split(".")[0] in ("common", "cloud", "edge", "protocol"):
        # This project's modules are installed under elasticfed; specs written before that still load.
        warnings.warn(
            f"task {spec!r}: the project's modules are elasticfed.{module_name.split('.')[0]}...; "
            f"write 'elasticfed.{spec}'",
            FutureWarning,
            stacklevel=2,
        )
        module_name = f"elasticfed.{module_name}"
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
        raise TaskError(
            f"task {spec!r}: {attr}() returned {type(task).__name__}, expected elasticfed.common.task.Task"
        )
    return task


@runtime_checkable
class Grouped(Protocol):
    """A data set whose examples belong to named groups (a language model's: top-level packages)."""

    def groups(self) -> list[str]:
        """The group of every example, in order."""
        ...


PARTITIONS = ("iid", "shards", "package", "dirichlet:<alpha>", "quantity:<alpha>")
MIN_PART = 10  # examples: a Dirichlet draw leaving a device fewer than this is drawn again


def parse_partition(spec: str) -> tuple[str, float]:
    """`iid`, `shards`, `package`, `dirichlet:<alpha>` or `quantity:<alpha>` -> (kind, alpha).

    Raises ValueError naming the spec and the accepted forms: this is the check a
    config runs when it loads, and what `shard` runs before it touches the data.
    """
    kind, colon, arg = spec.partition(":")
    if kind in ("iid", "shards", "package") and not colon:
        return kind, 0.0
    if kind in ("dirichlet", "quantity") and colon:
        try:
            alpha = float(arg)
        except ValueError:
            alpha = -1.0
        if 0.0 < alpha < float("inf"):
            return kind, alpha
        raise ValueError(f"partition {spec!r}: alpha must be a number above 0, e.g. {kind}:0.1")
    raise ValueError(f"partition {spec!r} is not one of {', '.join(PARTITIONS)}")


def shard(data: Dataset, index: int, parts: int, partition: str = "iid", seed: int = 0) -> Dataset:
    """Part `index` of `parts` of a data set, the way a fleet's devices would hold it.

    `iid`: a seeded shuffle cut into equal parts.  `shards` (one label per
    example): examples sorted by label, cut into 2 x parts slices, and each
    device gets two of them, so most devices see two or three classes
    (McMahan et al.'s non-IID split).  `dirichlet:<alpha>` (label skew, the
    field's standard since Hsu et al. 2019): each class is split over the
    devices by proportions drawn from Dirichlet(alpha); 0.1 leaves most
    devices one or two dominant classes, 100 is nearly IID.
    `quantity:<alpha>`: IID examples, but each device's share of them drawn
    from Dirichlet(alpha) (sites of very different sizes).  `package` (a
    `Grouped` data set): each device owns whole groups, none shared, balanced
    by example count.  Every part is disjoint from the others, together they
    cover the data, and the same seed gives the same parts on every device.
    """
    kind, alpha = parse_partition(partition)
    if not 0 <= index < parts:
        raise ValueError(f"shard {index} of {parts} does not exist")
    n = len(data)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    if kind == "iid":
        order = torch.randperm(n, generator=gen)
        return torch.utils.data.Subset(data, order[index::parts].tolist())
    if kind == "package":
        return _by_group(data, index, parts, seed)
    if kind == "quantity":
        return torch.utils.data.Subset(data, _quantity_dirichlet(n, parts, alpha, seed, partition)[index])
    if n and torch.as_tensor(data[0][1]).numel() != 1:
        raise ValueError(
            f"partition {partition!r} splits examples by their label, and this data set's targets are "
            "not one label each; use iid or quantity:<alpha>"
            + (" or package" if isinstance(data, Grouped) else "")
        )
    labels = torch.tensor([int(data[i][1]) for i in range(n)])
    if kind == "dirichlet":
        return torch.utils.data.Subset(data, _label_dirichlet(labels, parts, alpha, seed, partition)[index])
    by_label = torch.argsort(labels * n + torch.randperm(n, generator=gen), stable=True)
    slices = torch.tensor_split(by_label, 2 * parts)
    pick = torch.randperm(2 * parts, generator=torch.Generator().manual_seed(seed + 1))
    mine = torch.cat([slices[int(pick[2 * index])], slices[int(pick[2 * index + 1])]])
    return torch.utils.data.Subset(data, mine.tolist())


def _dirichlet(alpha: float, parts: int) -> torch.Tensor:
    """Dirichlet(alpha, ..., alpha) from torch's global generator (`_seeded_draws` seeds and restores it)."""
    return torch.distributions.Dirichlet(torch.full((parts,), alpha, dtype=torch.float64)).sample()


def _split_counts(total: int, share: torch.Tensor) -> list[int]:
    """`total` items over parts in proportion to `share`, largest remainders first."""
    raw = share * total
    counts = raw.floor().long()
    for i in torch.argsort(raw - counts, descending=True, stable=True)[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


def _seeded_draws(
    seed: int, spec: str, draw: Callable[[], list[list[int]]], n: int, parts: int
) -> list[list[int]]:
    """Draw again (up to 100 times, seeded) until every part holds at least MIN_PART examples."""
    state = torch.random.get_rng_state()
    try:
        for attempt in range(100):
            torch.manual_seed(seed * 1000 + attempt)
            result = draw()
            if min(len(p) for p in result) >= min(MIN_PART, n // parts):
                return result
    finally:
        torch.random.set_rng_state(state)
    raise ValueError(
        f"partition {spec!r}: 100 draws all left some of {parts} parts with fewer than {MIN_PART} of "
        f"{n} examples; use a larger alpha or fewer parts"
    )


def _quantity_dirichlet(n: int, parts: int, alpha: float, seed: int, spec: str) -> list[list[int]]:
    def draw() -> list[list[int]]:
        order = torch.randperm(n).tolist()
        owned, start = [], 0
        for count in _split_counts(n, _dirichlet(alpha, parts)):
            owned.append(sorted(order[start : start + count]))
            start += count
        return owned

    return _seeded_draws(seed, spec, draw, n, parts)


def _label_dirichlet(labels: torch.Tensor, parts: int, alpha: float, seed: int, spec: str) -> list[list[int]]:
    def draw() -> list[list[int]]:
        owned: list[list[int]] = [[] for _ in range(parts)]
        for c in torch.unique(labels).tolist():
            members = torch.nonzero(labels == c).flatten()
            members = members[torch.randperm(len(members))]
            start = 0
            for p, count in enumerate(_split_counts(len(members), _dirichlet(alpha, parts))):
                owned[p].extend(members[start : start + count].tolist())
                start += count
        return [sorted(p) for p in owned]

    return _seeded_draws(seed, spec, draw, len(labels), parts)


def _by_group(data: Dataset, index: int, parts: int, seed: int) -> Dataset:
    """Whole groups per part: largest first onto the lightest part, the parts' order then seeded."""
    if not isinstance(data, Grouped):
        raise ValueError(
            f"partition 'package' needs a data set that names each example's group (a groups() method); "
            f"{type(data).__name__} does not: use iid or shards"
        )
    members: dict[str, list[int]] = {}
    for i, group in enumerate(data.groups()):
        members.setdefault(group, []).append(i)
    if len(members) < parts:
        raise ValueError(f"partition 'package': {len(members)} groups cannot fill {parts} parts")
    load = [0] * parts
    owned: list[list[str]] = [[] for _ in range(parts)]
    for group in sorted(members, key=lambda g: (-len(members[g]), g)):
        lightest = min(range(parts), key=lambda p: (load[p], p))
        load[lightest] += len(members[group])
        owned[lightest].append(group)
    mine = owned[int(torch.randperm(parts, generator=torch.Generator().manual_seed(seed))[index])]
    return torch.utils.data.Subset(data, sorted(i for g in mine for i in members[g]))
