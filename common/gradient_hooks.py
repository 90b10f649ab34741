"""The backward-hook manager both sides share: gradients become ready layers for a sink.

One mechanism, two sinks (DESIGN.md section 4).  `GradientHooks` registers a
post-accumulate-grad hook on every trainable parameter; the hook fires once the
parameter's gradient for this backward is fully accumulated (a tied weight used
twice fires once, after both uses).  Parameters are grouped into *units* (one
layer, or several small layers packed together); a unit is handed to the sink
when all of its parameters are ready, and units are always handed over in plan
order, so every rank issues its collectives in the same order whatever order
autograd runs the hooks in.  At the end of the backward, units still waiting
(parameters unused in this step) are handed over too, so nothing hangs.

The cloud sink starts an asynchronous all-reduce per unit; the edge sink pushes
the unit over the Elastic Sync Protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

Plan = Sequence[Sequence[int]]  # units, each a list of parameter indices (manifest order)


class GradientSink(Protocol):
    """What the hook manager hands ready units to."""

    def unit_ready(self, unit: int) -> None:
        """All parameters of `unit` are ready (or unused this backward); called in plan order."""

    def backward_done(self) -> None:
        """Every unit of this backward has been handed over; the last call before backward returns."""


class HookError(RuntimeError):
    """The model did something the hook manager cannot sync correctly; the message says what."""


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in backward order (reverse of registration), tied weights once.

    This is the order of the protocol's manifest and of the default plan: roughly
    the order in which backward produces gradients.
    """
    return [(name, p) for name, p in reversed(list(model.named_parameters())) if p.requires_grad]


class _BackwardStart(torch.autograd.Function):
    """Identity on the model's outputs whose backward runs first and arms the end-of-backward callback."""

    @staticmethod
    def forward(ctx: Any, hooks: GradientHooks, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hooks = hooks
        # A copy, not a view: the caller may modify the outputs in place (as with DDP's _DDPSink).
        return tuple(t.clone() for t in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hooks._begin_backward()
        return (None, *grads)


class GradientHooks:
    """Per-parameter hooks that release units of ready gradients, in plan order, to a sink."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        sink: GradientSink,
        plan: Plan | None = None,
    ) -> None:
        if not named_params:
            raise HookError("the model has no trainable parameters: there is nothing to sync")
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.sink = sink
        self.sync_enabled = True
        # Seconds from the start of the backward to each parameter's hook, last backward (for planning).
        self.ready_at: list[float] = [0.0] * len(self.params)
        self.used: list[bool] = [False] * len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._in_backward = False
        self._started = 0.0
        self.set_plan(plan if plan is not None else [[i] for i in range(len(self.params))])
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # ----------------------------------------------------------------- plan
    def set_plan(self, plan: Plan) -> None:
        """Group parameters into units; every parameter in exactly one unit."""
        seen = sorted(i for unit in plan for i in unit)
        if seen != list(range(len(self.params))) or any(len(unit) == 0 for unit in plan):
            raise HookError("a plan must put every parameter index in exactly one non-empty unit")
        if self._in_backward:
            raise HookError("the plan cannot change during a backward")
        self.plan = [list(unit) for unit in plan]
        self.unit_of = [0] * len(self.params)
        for u, unit in enumerate(self.plan):
            for i in unit:
                self.unit_of[i] = u
        self._pending = [len(unit) for unit in self.plan]
        self._next_unit = 0

    # ------------------------------------------------------------- forward
    def arm(self, outputs: Any) -> Any:
        """Route the model's outputs through a node whose backward arms the end-of-backward flush.

        Without it the first hook arms the flush, which is just as correct; arming
        from the outputs also covers a backward in which no parameter fires at all,
        and attaches the flush to the outer backward under reentrant checkpointing.
        """
        if not torch.is_grad_enabled():
            return outputs
        tensors: list[torch.Tensor] = []
        _collect(outputs, tensors)
        needing = [t for t in tensors if t.requires_grad]
        if not needing:
            return outputs
        replaced = iter(_BackwardStart.apply(self, *needing))
        swap = {id(t): next(replaced) for t in needing}
        return _rebuild(outputs, swap)

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Gradients accumulate locally in `.grad`; nothing reaches the sink (DDP's `no_sync`)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    # ------------------------------------------------------------ backward
    def _begin_backward(self) -> None:
        if self._in_backward or not self.sync_enabled:
            return
        self._in_backward = True
        self._started = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        try:
            self._begin_backward()
            self._mark_ready(self._index[id(param)])
        except BaseException:
            self._reset()  # the error leaves backward; the next backward starts clean
            raise

    def _mark_ready(self, i: int) -> None:
        if self.used[i]:
            raise HookError(
                f"parameter {self.names[i]!r} produced its gradient twice in one backward; "
                "reentrant activation checkpointing does this: use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        self.used[i] = True
        self.ready_at[i] = time.perf_counter() - self._started
        u = self.unit_of[i]
        self._pending[u] -= 1
        if self._pending[u] == 0 and u == self._next_unit:
            self._release_ready()

    def _release_ready(self) -> None:
        while self._next_unit < len(self.plan) and self._pending[self._next_unit] == 0:
            unit = self._next_unit
            self._next_unit += 1
            self.sink.unit_ready(unit)

    def _end_backward(self) -> None:
        try:
            for u in range(self._next_unit, len(self.plan)):
                self._pending[u] = 0
            self._release_ready()
        finally:
            self._reset()
        self.sink.backward_done()  # after the reset: the sink may change the plan (adaptive re-planning)

    def _reset(self) -> None:
        self._in_backward = False
        self._pending = [len(unit) for unit in self.plan]
        self._next_unit = 0
        self.used = [False] * len(self.params)

    def remove(self) -> None:
        """Unregister every hook (the wrapped model is left as it was)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _collect(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, out)


def _rebuild(value: Any, swap: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return swap.get(id(value), value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_rebuild(v, swap) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, swap) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _rebuild(v, swap)) for k, v in value.items())
    return value


def pack_by_size(
    sizes_bytes: Sequence[int], dtypes: Sequence[torch.dtype], cap_bytes: int
) -> list[list[int]]:
    """Layer-wise plan: adjacent layers of one dtype share a unit until it reaches the cap.

    A layer at or above the cap therefore carries at most the small layers just
    before it (a bias rides with the next weight) instead of paying a collective
    of its own; with cap 0 every layer is its own unit (DESIGN.md section 3).
    """
    units: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, (size, dtype) in enumerate(zip(sizes_bytes, dtypes)):
        if current and dtypes[current[0]] != dtype:
            units.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
        if current_bytes >= cap_bytes:
            units.append(current)
            current, current_bytes = [], 0
    if current:
        units.append(current)
    return units


def default_block_of(name: str) -> str:
    """The block a parameter belongs to: its path up to the first numbered module.

    `encoder.layers.3.attn.q_proj.weight` -> `encoder.layers.3`; a parameter outside
    any numbered container belongs to its top-level module.
    """
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return parts[0] if len(parts) > 1 else ""


def group_by_block(
    names: Sequence[str], dtypes: Sequence[torch.dtype], block_of: Callable[[str], str] = default_block_of
) -> list[list[int]]:
    """Block-wise plan: adjacent parameters of one block (and one dtype) are one unit."""
    units: list[list[int]] = []
    last_key: tuple[str, torch.dtype] | None = None
    for i, (name, dtype) in enumerate(zip(names, dtypes)):
        key = (block_of(name), dtype)
        if key != last_key:
            units.append([])
            last_key = key
        units[-1].append(i)
    return units
