"""halfsafe.core.sites: one Site type (parse/format keep every report's strings), one block_of, one headroom_bits,
one hook owner (Hooks) that every hook-holding class uses and that leaves no hook behind."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from halfsafe.core.forward import logits
from halfsafe.core.sites import Hooks, Site, block_of, find_blocks, headroom_bits
from halfsafe.core.stats import ActivationCollector, SiteStats
from halfsafe.engine.streamed import streamed_of
from halfsafe.errors import HalfsafeError
from halfsafe.io.loading import load_model
from halfsafe.runtime.baselines import clamp_residual_adds, keep_residual_fp32
from halfsafe.scan import LayerPeak, layer_peaks
from halfsafe.training.finetune import _owner, _Penalty
from halfsafe.training.headroom import PeakSampler
from halfsafe.verify.block_peaks import BlockPeaks
from tests.tiny import make_tiny, save_tiny, tiny_ids


# -- Site ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, module, kind, expert, part", [
    ("model.layers.1.mlp.down_proj:in", "model.layers.1.mlp.down_proj", "in", None, ""),
    ("model.layers.10:out", "model.layers.10", "out", None, ""),
    ("lm_head:out", "lm_head", "out", None, ""),
    ("model.layers.0.mlp.experts:expert3", "model.layers.0.mlp.experts", "expert3", 3, ""),
    ("model.layers.0.mlp.experts:expert12.gate", "model.layers.0.mlp.experts", "expert12.gate", 12, "gate"),
    ("m.experts:expert0.up", "m.experts", "expert0.up", 0, "up"),
])
def test_site_parse_and_format_round_trip(text, module, kind, expert, part):
    site = Site.parse(text)
    assert (site.module, site.kind, site.expert, site.part) == (module, kind, expert, part)
    assert str(site) == text
    assert Site.parse(site) is site
    if expert is not None:
        assert Site.of_expert(module, expert, part) == site


@pytest.mark.parametrize("text", ["model.layers.1", "a:b", "a:expert", "a:expertx", "a:expert1.down", "a:out.x", "out"])
def test_a_malformed_site_fails_in_one_line(text):
    with pytest.raises(HalfsafeError, match="not a site") as e:
        Site.parse(text)
    assert "\n" not in str(e.value)


def test_a_site_s_module_may_not_contain_a_colon():
    with pytest.raises(HalfsafeError):
        Site("a:b", "out")


class _Experts(nn.Module):
    """The fused-experts layout stats recognises: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, 6, 4))
        self.down_proj = nn.Parameter(torch.randn(2, 4, 3))
        self.is_transposed, self.has_gate = False, True

    def _apply_gate(self, h):
        gate, up = h.chunk(2, dim=-1)
        return torch.relu(gate) * up

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(2):
            rows = (index == e).any(-1)
            out[rows] += nn.functional.linear(self._apply_gate(nn.functional.linear(x[rows], self.gate_up_proj[e])), self.down_proj[e])
        return out


def test_collector_site_names_are_the_strings_reports_always_used():
    torch.manual_seed(0)
    model = nn.Module()
    model.proj = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.mlp = nn.Module()
    model.mlp.experts = _Experts()
    x = torch.randn(5, 4)
    with ActivationCollector(model) as c:
        h = model.proj(x)
        model.mlp.experts(h, torch.tensor([[0], [1], [0], [1], [1]]), None)
    expected = {"proj:out", "proj.0:in", "proj.0:out", "proj.1:in", "proj.1:out", "mlp.experts:in", "mlp.experts:out"}
    expected |= {f"mlp.experts:expert{e}{p}" for e in (0, 1) for p in ("", ".gate", ".up")}
    assert set(c.sites) == expected
    for name, s in c.sites.items():
        assert s.name == name and str(Site.parse(name)) == name and s.module == Site.parse(name).module
        assert s.to_dict()["site"] == name and s.to_dict()["name"] == Site.parse(name).module


# -- block_of ------------------------------------------------------------------------------------
BLOCKS = ["model.layers.1", "model.layers.10", "model.layers.1.inner", "model.layers.2"]


@pytest.mark.parametrize("what, block", [
    ("model.layers.1", "model.layers.1"),
    ("model.layers.1:out", "model.layers.1"),
    ("model.layers.1.mlp.up_proj:in", "model.layers.1"),
    ("model.layers.10.self_attn:out", "model.layers.10"),  # not layers.1: "layers.10" only shares a prefix
    ("model.layers.10", "model.layers.10"),
    ("model.layers.1.inner.x:out", "model.layers.1.inner"),  # the longest block that owns it
    ("model.layers.1.inner", "model.layers.1.inner"),
    ("model.layers.1.innerx:out", "model.layers.1"),
    ("model.layers.100:out", None),
    ("model.layers.2.experts:expert3.up", "model.layers.2"),
    ("model.layers", None),
    ("model.norm:out", None),
    ("lm_head", None),
])
def test_block_of_is_the_longest_block_that_owns_the_module(what, block):
    assert block_of(what, BLOCKS) == block
    assert block_of(what, list(reversed(BLOCKS))) == block  # order does not matter
    if ":" in what:
        assert block_of(Site.parse(what), BLOCKS) == block


class _Stack(nn.Module):
    """11 blocks, so that layers.1 and layers.10 share a prefix."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)) for _ in range(11)])
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_former_owner_lookups_use_block_of():
    model = _Stack()
    sampler = PeakSampler(model, "blocks")
    assert sampler.layer_of("layers.10.0:in") == 10 and sampler.layer_of("layers.1.0:out") == 1
    assert sampler.layer_of("layers.1:out") == 1 and sampler.layer_of("head:out") is None
    blocks = find_blocks(model)
    assert _owner("layers.10.0:out", blocks, "parent") == "layers.10"  # its parent is the block itself
    assert _owner("layers.10.0:out", blocks, "blocks") == "layers.10"
    assert _owner("layers.1:out", blocks, "parent") == "layers.1"
    assert _owner("head:out", blocks, "parent") == "head"
    sites = {"layers.1:out": SiteStats("layers.1:out", "", abs_max=5.0), "layers.1.0:in": SiteStats("layers.1.0:in", "", abs_max=7.0),
             "layers.10:out": SiteStats("layers.10:out", "", abs_max=3.0),
             "layers.10.0:out": SiteStats("layers.10.0:out", "", abs_max=100.0)}
    peaks = {p.name: p for p in layer_peaks(model, sites)}
    assert set(peaks) == {"layers.1", "layers.10"}
    assert (peaks["layers.1"].inner_peak, peaks["layers.1"].inner_site) == (7.0, "layers.1.0:in")
    assert (peaks["layers.10"].inner_peak, peaks["layers.10"].inner_site) == (100.0, "layers.10.0:out")


# -- headroom_bits -------------------------------------------------------------------------------
@pytest.mark.parametrize("peak, bits", [
    (65504.0, 0.0), (32752.0, 1.0), (8188.0, 3.0), (131008.0, -1.0), (65504.0 / 1024, 10.0),
    (0.0, math.inf), (math.inf, -math.inf), (math.nan, -math.inf),
])
def test_headroom_bits(peak, bits):
    assert headroom_bits(peak) == bits
    assert SiteStats("x:out", "", abs_max=peak).headroom_bits == bits
    assert LayerPeak("x", peak, peak, "x:out").headroom_bits == bits


# -- Hooks ---------------------------------------------------------------------------------------
def _hooks_left(model: nn.Module) -> list[str]:
    return [name or "<model>" for name, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks or m._forward_hooks_with_kwargs or m._forward_hooks_always_called
            or m._forward_pre_hooks_with_kwargs]


def test_hooks_removes_every_hook_after_an_exception_and_twice():
    model = _Stack()
    seen = []
    with pytest.raises(RuntimeError, match="inside"):
        with Hooks() as hooks:
            hooks.add_pre(model.head, lambda m, a: seen.append("pre"))
            hooks.add_post(model.head, lambda m, a, o: seen.append("post"))
            hooks.add_pre(model, lambda m, a, k: None, with_kwargs=True)
            hooks.add_post(model.layers[3], lambda m, a, k, o: None, with_kwargs=True, always_call=True)
            hooks.add_undo(lambda: seen.append("undo"))
            model(torch.zeros(1, 2))
            assert len(hooks) == 5 and len(_hooks_left(model)) == 3
            raise RuntimeError("inside")
    assert seen == ["pre", "post", "undo"]
    assert _hooks_left(model) == [] and len(hooks) == 0
    hooks.remove()  # idempotent


def test_hooks_remove_goes_on_past_a_failing_undo():
    done = []
    hooks = Hooks()
    hooks.add_undo(lambda: done.append(1))
    hooks.add_undo(lambda: 1 / 0)
    hooks.add_undo(lambda: done.append(3))
    with pytest.raises(ZeroDivisionError):
        hooks.remove()
    assert done == [3, 1] and len(hooks) == 0


@pytest.fixture(scope="module")
def llama():
    return make_tiny("llama")


def test_activation_collector_leaves_no_hooks_also_after_an_error(llama):
    ids = tiny_ids(llama, 8)
    with ActivationCollector(llama) as c:
        assert _hooks_left(llama)
        logits(llama, ids)
    assert c.sites and _hooks_left(llama) == []
    with pytest.raises(RuntimeError, match="boom"):
        with ActivationCollector(llama):
            raise RuntimeError("boom")
    assert _hooks_left(llama) == []


def test_peak_sampler_hooks_go_after_one_forward_or_disarm(llama):
    sampler = PeakSampler(llama, "all")
    sampler.arm()
    assert sampler.armed and _hooks_left(llama)
    logits(llama, tiny_ids(llama, 8))
    assert not sampler.armed and _hooks_left(llama) == []
    assert sampler.collect()
    sampler.arm()
    sampler.disarm()
    sampler.disarm()
    assert _hooks_left(llama) == []


def test_penalty_block_peaks_and_runtime_handles_leave_no_hooks(llama):
    ids = tiny_ids(llama, 8)
    blocks = find_blocks(llama)
    penalty = _Penalty(llama, [f"{blocks[0]}:out", f"{blocks[0]}.mlp.down_proj:in"], hinge=1.0)
    peaks = BlockPeaks(llama, blocks)
    assert _hooks_left(llama)
    logits(llama, ids)
    assert set(penalty.peaks) == {f"{blocks[0]}:out", f"{blocks[0]}.mlp.down_proj:in"} and all(peaks.peaks)
    penalty.remove()
    peaks.remove()
    assert _hooks_left(llama) == []
    for patch in (keep_residual_fp32, clamp_residual_adds):
        with patch(llama) as handle:
            assert _hooks_left(llama)
        assert _hooks_left(llama) == [] and len(handle) == 0
    handle = keep_residual_fp32(llama)
    handle.remove()
    handle.remove()
    assert _hooks_left(llama) == []
    assert not any("forward" in m.__dict__ for m in llama.modules())  # patched forwards undone too


def test_streamed_model_detach_removes_its_load_and_free_hooks(tmp_path):
    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, stream=True).model
    streamed = streamed_of(model)
    assert streamed is not None and _hooks_left(model)
    logits(model, tiny_ids(model, 8))
    streamed.detach()
    assert _hooks_left(model) == []
    streamed.detach()
