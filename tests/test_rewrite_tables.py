"""rewrite.py's table helpers by hand: a select's hashable key, two tensor tables merged into one (what a streamed
model applies when a second plan follows the first), and the finiteness check after a rewrite (core.weights)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from halfsafe.core.rewrite import merge_tables, select_key
from halfsafe.core.weights import check_finite

SA, SB = (0, slice(0, 2)), (0, slice(2, 4))  # two row ranges of one fused tensor


def test_select_key_is_the_part_itself_for_one_dim_and_a_tuple_for_several():
    assert select_key(None) is None
    assert select_key(SA) == (0, (0, 2, None))
    assert select_key((1, torch.tensor([3, 1]))) == (1, (3, 1))
    assert select_key(((0, slice(1, 2)), (1, torch.tensor([0, 2])))) == ((0, (1, 2, None)), (1, (0, 2)))


def test_merge_tables_adds_exponents_per_kind_and_part_and_drops_what_cancels():
    a = {"w": [("mul", -1, SA), ("gain1p", 2, None)], "v": [("mul", 3, None)], "u": [("mul", 1, None)]}
    b = {"w": [("mul", -2, SB), ("mul", 1, SA)], "v": [("mul", -3, None)], "x": [("mul", -4, SB)]}
    assert merge_tables(a, b) == {
        "w": [("gain1p", 2, None), ("mul", -2, SB)],  # SA: -1 + 1 = 0, dropped
        "u": [("mul", 1, None)],
        "x": [("mul", -4, SB)],
    }  # v cancels entirely
    assert merge_tables({}, b) == b and merge_tables(a, {}) == a


class _Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fine = nn.Parameter(torch.ones(2))
        for name, value in (("b", math.inf), ("c", math.nan), ("d", -math.inf), ("e", math.inf)):
            self.register_parameter(name, nn.Parameter(torch.tensor([1.0, value])))
        self.lazy = nn.Parameter(torch.empty(2, device="meta"))  # not loaded: nothing to check


def test_check_finite_names_the_first_three_non_finite_weights():
    model = _Weights()
    check_finite(model, ["fine", "lazy", "not-a-parameter"])
    with pytest.raises(FloatingPointError) as e:
        check_finite(model, ["fine", "b", "lazy", "c", "missing", "d", "e"])
    assert str(e.value) == "rescaling made b, c, d non-finite (please report this)"
    with pytest.raises(FloatingPointError, match="^rescaling made e non-finite"):
        check_finite(model, ["e"])
