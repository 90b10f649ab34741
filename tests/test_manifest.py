"""The manifest: backward order, a digest that changes with any entry, and a readable first difference."""

from __future__ import annotations

import pytest
import torch

from elasticfed.protocol import LayerSpec, Manifest


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight  # tied: one layer, listed once


def test_from_parameters_lists_trainable_layers_once_in_backward_order() -> None:
    manifest = Manifest.from_parameters(Tied().named_parameters())
    assert [s.name for s in manifest] == ["body.bias", "body.weight", "embed.weight"]
    assert manifest["body.weight"] == LayerSpec("body.weight", (4, 4), "float32")


def test_digest_is_stable_and_sensitive_to_every_field() -> None:
    base = [LayerSpec("a", (2, 3), "float32"), LayerSpec("b", (3,), "float32")]
    digest = Manifest(base).digest
    assert Manifest(list(base)).digest == digest
    variants = [
        [LayerSpec("a2", (2, 3), "float32"), base[1]],
        [LayerSpec("a", (3, 2), "float32"), base[1]],
        [LayerSpec("a", (2, 3), "bfloat16"), base[1]],
        [base[1], base[0]],
        base[:1],
    ]
    assert len({Manifest(v).digest for v in variants} | {digest}) == len(variants) + 1


def test_first_difference_names_the_entry() -> None:
    ours = Manifest([LayerSpec("a", (2, 3), "float32"), LayerSpec("b", (3,), "float32")])
    assert ours.first_difference(Manifest(list(ours))) is None
    theirs = Manifest([LayerSpec("a", (2, 3), "float32"), LayerSpec("b", (4,), "float32")])
    assert ours.first_difference(theirs) == "entry 1: ours is b [3] float32, theirs is b [4] float32"
    shorter = Manifest([LayerSpec("a", (2, 3), "float32")])
    message = ours.first_difference(shorter)
    assert message is not None and "entry 1" in message and "only ours" in message and "b [3]" in message


def test_wire_form_round_trips_and_bad_entries_are_named() -> None:
    manifest = Manifest([LayerSpec("a", (2, 3), "float16"), LayerSpec("b", (), "float32")])
    assert Manifest.from_wire(manifest.to_wire()) == manifest
    with pytest.raises(ValueError, match="entry 1"):
        Manifest.from_wire([["a", [2], "float32"], ["b", [-1], "float32"]])
    with pytest.raises(ValueError, match="twice"):
        Manifest.from_wire([["a", [2], "float32"], ["a", [2], "float32"]])
    with pytest.raises(ValueError, match="dtype"):
        LayerSpec("a", (2,), "int8")
