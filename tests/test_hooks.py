"""The shared backward-hook manager and the planning rules, in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from elasticfed.cloud.planning import CommCost, best_plan, boundaries_to_plan, finish_time, plan_to_boundaries
from elasticfed.common.gradient_hooks import (
    GradientHooks,
    HookError,
    default_block_of,
    group_by_block,
    pack_by_size,
    trainable_parameters,
)


class RecordingSink:
    """Records what the manager hands over, and which gradients existed at that moment."""

    def __init__(self, hooks_ref: list[GradientHooks]) -> None:
        self.events: list[tuple[str, int]] = []
        self.grads_present: dict[int, list[bool]] = {}
        self._hooks = hooks_ref

    def unit_ready(self, unit: int) -> None:
        hooks = self._hooks[0]
        self.events.append(("unit", unit))
        self.grads_present[unit] = [hooks.params[i].grad is not None for i in hooks.plan[unit]]

    def backward_done(self) -> None:
        self.events.append(("done", -1))


def make(model: nn.Module, plan: list[list[int]] | None = None) -> tuple[GradientHooks, RecordingSink]:
    ref: list[GradientHooks] = []
    sink = RecordingSink(ref)
    hooks = GradientHooks(trainable_parameters(model), sink, plan)
    ref.append(hooks)
    return hooks, sink


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum() + self.b(torch.relu(x)).sum()


def test_units_leave_in_plan_order_whatever_order_hooks_fire() -> None:
    model = TwoBranches()
    n = len(trainable_parameters(model))
    # Plan the reverse of the manifest: hooks fire roughly in manifest order, so most units
    # become ready before their predecessors and must wait.
    plan = [[i] for i in reversed(range(n))]
    hooks, sink = make(model, plan)
    hooks.arm(model(torch.randn(2, 4))).backward()
    assert [e for e in sink.events if e[0] == "unit"] == [("unit", u) for u in range(n)]
    assert sink.events[-1] == ("done", -1)
    names = hooks.names
    for u, present in sink.grads_present.items():
        unit_names = [names[i] for i in plan[u]]
        if not unit_names[0].startswith("unused"):
            assert all(present), f"unit {unit_names} handed over before its gradient existed"


def test_unused_parameters_are_handed_over_at_the_end_and_marked() -> None:
    model = TwoBranches()
    hooks, sink = make(model)
    seen_used: list[list[bool]] = []
    done = sink.backward_done

    def record_done() -> None:
        seen_used.append(list(hooks.used))
        done()

    sink.backward_done = record_done  # type: ignore[method-assign]
    hooks.arm(model(torch.randn(2, 4))).backward()
    assert len([e for e in sink.events if e[0] == "unit"]) == len(hooks.plan)
    assert seen_used == [[False] * 6], "the manager resets its per-backward state before backward_done"
    # A second backward starts from a clean slate.
    sink.events.clear()
    hooks.arm(model(torch.randn(2, 4))).backward()
    assert sink.events.count(("done", -1)) == 1


def test_tied_weight_fires_once_after_both_uses() -> None:
    embed = nn.Embedding(10, 4)
    out = nn.Linear(4, 10, bias=False)
    out.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "out": out})
    params = trainable_parameters(model)
    assert [n for n, _ in params] == ["embed.weight"], "a tied weight is one parameter"
    fired: list[torch.Tensor] = []
    hooks, sink = make(model)
    sink.unit_ready = lambda u: fired.append(hooks.params[0].grad.clone())  # type: ignore[method-assign]
    tokens = torch.tensor([1, 2, 3])
    loss = out(embed(tokens)).sum()
    loss.backward()
    assert len(fired) == 1
    # The gradient handed over is the full one (both uses), as a plain backward computes it.
    embed.weight.grad = None
    hooks.remove()
    out(embed(tokens)).sum().backward()
    assert torch.equal(fired[0], embed.weight.grad)


def test_disabled_hands_nothing_over_and_gradients_accumulate() -> None:
    model = TwoBranches()
    hooks, sink = make(model)
    with hooks.disabled():
        hooks.arm(model(torch.ones(1, 4))).backward()
        hooks.arm(model(torch.ones(1, 4))).backward()
    assert sink.events == []
    assert torch.equal(model.a.bias.grad, torch.full((4,), 2.0))
    hooks.arm(model(torch.ones(1, 4))).backward()
    assert sink.events[-1] == ("done", -1)


def test_reentrant_checkpointing_is_refused_clearly_and_non_reentrant_works() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    hooks, sink = make(model)
    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(model, x, use_reentrant=False)
    hooks.arm(out).sum().backward()
    assert sink.events[-1] == ("done", -1)
    sink.events.clear()
    with pytest.raises(HookError, match="use_reentrant=False"):
        # The armed node on the outer output runs first; the inner (reentrant) backward fires
        # hooks on parameters inside and outside the checkpoint: one of them fires twice.
        y = checkpoint(model, x, use_reentrant=True)
        z = hooks.arm(model[2](torch.relu(model[0](x))) + y)
        z.sum().backward()
    # After the refusal the next backward is clean.
    sink.events.clear()
    hooks.arm(model(x)).sum().backward()
    assert sink.events[-1] == ("done", -1)


def test_arm_keeps_output_structure_and_values() -> None:
    model = nn.Linear(3, 2)
    hooks, _ = make(model)
    x = torch.randn(1, 3)
    y = model(x)
    armed = hooks.arm({"logits": y, "extra": [y * 2, "text"], "n": 3})
    assert set(armed) == {"logits", "extra", "n"} and armed["extra"][1] == "text" and armed["n"] == 3
    assert torch.equal(armed["logits"], y) and armed["logits"] is not y
    with torch.no_grad():
        assert hooks.arm(model(x)) is not None
    armed = hooks.arm(model(x))
    armed.mul_(2)  # outputs may be modified in place, as with a plain model
    armed.sum().backward()
    assert torch.equal(model.bias.grad, torch.full((2,), 2.0))


def test_bad_plans_are_refused() -> None:
    hooks, _ = make(TwoBranches())
    with pytest.raises(HookError, match="exactly one"):
        hooks.set_plan([[0, 1], [1, 2, 3, 4, 5]])
    with pytest.raises(HookError, match="exactly one"):
        hooks.set_plan([[0, 1, 2, 3, 4]])
    with pytest.raises(HookError, match="no trainable parameters"):
        GradientHooks([], RecordingSink([]))


def test_pack_by_size_fills_units_up_to_the_cap() -> None:
    f32, f16 = torch.float32, torch.float16
    sizes = [100, 200, 5000, 300, 300, 300, 50]
    dtypes = [f32, f32, f32, f32, f32, f16, f16]
    assert pack_by_size(sizes, dtypes, 1000) == [[0, 1, 2], [3, 4], [5, 6]]
    assert pack_by_size(sizes, dtypes, 0) == [[i] for i in range(7)]
    assert pack_by_size([400, 400, 400], [f32] * 3, 1000) == [[0, 1, 2]]
    assert pack_by_size([400, 400, 400, 5], [f32] * 4, 800) == [[0, 1], [2, 3]]


def test_blocks_follow_the_first_numbered_module() -> None:
    assert default_block_of("encoder.layers.3.attn.q_proj.weight") == "encoder.layers.3"
    assert default_block_of("head.weight") == "head"
    assert default_block_of("bias") == ""
    names = [
        "head.weight",
        "layers.1.mlp.weight",
        "layers.1.attn.weight",
        "layers.0.mlp.weight",
        "layers.0.attn.weight",
        "embed.weight",
    ]
    assert group_by_block(names, [torch.float32] * 6) == [[0], [1, 2], [3, 4], [5]]


def test_adaptive_plan_merges_when_latency_dominates_and_splits_when_bandwidth_does() -> None:
    ready = [0.001 * (i + 1) for i in range(8)]  # one layer ready every millisecond
    sizes = [4096] * 8
    dtypes = [torch.float32] * 8
    latency_bound = CommCost(alpha_s=0.01, beta_s_per_byte=1e-12)
    assert best_plan(ready, sizes, dtypes, latency_bound) == [list(range(8))]
    bandwidth_bound = CommCost(alpha_s=1e-6, beta_s_per_byte=0.9e-3 / 4096)
    split = best_plan(ready, sizes, dtypes, bandwidth_bound)
    assert len(split) >= 4
    for plan in (split, [list(range(8))], [[i] for i in range(8)]):
        assert finish_time(split, ready, sizes, bandwidth_bound) <= finish_time(
            plan, ready, sizes, bandwidth_bound
        )
    assert boundaries_to_plan(plan_to_boundaries(split, 8)) == split
