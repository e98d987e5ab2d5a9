"""The probe's bookkeeping on hand-made groups: the relative output change it tolerates, how one spec's groups
are split into passes that share no block, and which group owns a measured site (blocks, spans, experts)."""

from __future__ import annotations

import torch

from halfsafe.core.groups import Group
from halfsafe.core.probe import _owner, _passes, _rel_change


def _g(name: str, block: str | None = None, span: tuple[str, ...] = (), expert: int | None = None) -> Group:
    return Group(name, name.split("@")[0], block, (), span=span, expert=expert)


def test_rel_change_is_the_largest_difference_over_the_largest_reference_value():
    ref = torch.tensor([[0.25, -0.5], [0.125, 0.0]])
    out = torch.tensor([[0.25, -0.25], [0.0, 0.0625]])
    assert _rel_change(ref, out) == 0.5  # |-0.25 - -0.5| / 0.5
    assert _rel_change(torch.tensor([1.0, -4.0]), torch.tensor([1.5, -4.0])) == 0.125
    assert _rel_change(torch.zeros(2), torch.tensor([0.0, 1e-30])) == 1.0  # a zero reference: divided by 1e-30


def test_passes_put_groups_of_disjoint_blocks_together():
    pre = [_g(f"vo@l.{i}", f"l.{i}") for i in range(3)]
    assert _passes(pre) == [pre]
    # post-norm groups span blocks i and i+1: neighbours never share a pass
    post = [_g(f"res@l.{i}", f"l.{i}", span=(f"l.{i}", f"l.{i + 1}")) for i in range(5)]
    assert _passes(post) == [[post[0], post[2], post[4]], [post[1], post[3]]]
    # one block's experts share the block but not their sites: one pass
    experts = [_g(f"moe@l.0#{e}", "l.0", expert=e) for e in range(3)] + [_g("moe@l.1#0", "l.1", expert=0)]
    assert _passes(experts) == [experts]
    twice = [_g("a@l.0", "l.0"), _g("b@l.0", "l.0"), _g("c@l.0", "l.0")]
    assert _passes(twice) == [[twice[0]], [twice[1]], [twice[2]]]


def test_owner_of_a_site():
    whole = _g("residual")
    assert _owner("anything.at.all:out", [whole]) == "residual"
    one = [_g("vo@m.layers.1", "m.layers.1")]
    assert _owner("m.layers.1.attn.v_proj:out", one) == "vo@m.layers.1"
    assert _owner("m.layers.1:in", one) == "vo@m.layers.1"
    assert _owner("m.layers.10.attn:out", one) is None  # a prefix of the name is not a parent module
    assert _owner("m.layers.0.attn:out", one) is None
    two = [_g("vo@m.layers.0", "m.layers.0"), _g("vo@m.layers.1", "m.layers.1")]
    assert _owner("m.layers.1.mlp:out", two) == "vo@m.layers.1"
    assert _owner("m.layers.0.mlp:out", two) == "vo@m.layers.0"
    assert _owner("m.norm:out", two) is None
    spans = [_g("res@m.layers.0", "m.layers.0", span=("m.layers.0", "m.layers.1"))]
    assert _owner("m.layers.1.input_layernorm:in", spans) == "res@m.layers.0"


def test_owner_of_an_expert_site_is_the_expert_it_names():
    experts = [_g(f"moe@m.layers.1#{e}", "m.layers.1", expert=e) for e in range(3)]
    assert _owner("m.layers.1.mlp.experts:expert1.gate", experts) == "moe@m.layers.1#1"
    assert _owner("m.layers.1.mlp.experts:expert2", experts) == "moe@m.layers.1#2"
    assert _owner("m.layers.1.mlp.experts:out", experts) is None  # every expert's output at once: nobody's
    assert _owner("m.layers.2.mlp.experts:expert1", experts) is None
